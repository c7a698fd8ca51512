"""lab/trace_split.py: splitting a profiler trace into calls, kernels and idle time (the
parser on synthetic traces with known answers; the capture on a CPU, where there are no GPU events)."""

import gzip
import json
import random

import numpy as np
import pytest

from lab import trace_split as ts


def _trace(calls, rng):
    """Perfetto-style events: a host PjitFunction per call, then device kernels with known gaps."""
    ev = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
          {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}}]
    want, t = [], 1000.0
    for c in calls:
        ev.append({"ph": "X", "pid": 1, "tid": 1, "name": "PjitFunction(f)", "ts": t, "dur": 50.0})
        ev.append({"ph": "X", "pid": 1, "tid": 1, "name": "PjitFunction(inner)", "ts": t + 5, "dur": 5.0})
        wait = float(rng.uniform(5, 50))
        k, busy, first = t + wait, 0.0, t + wait
        for name, dur, gap in c:
            ev.append({"ph": "X", "pid": 7, "tid": 3, "name": name, "ts": k, "dur": dur})
            busy += dur
            k += dur + gap
        last = k - c[-1][2]
        want.append({"wait": wait / 1e3, "busy": busy / 1e3, "span": (last - first) / 1e3})
        t = k + 500.0
    rng.shuffle(ev)  # the parser must not rely on the file's order
    return ev, want


def test_split_calls_finds_kernels_waits_and_idle_time():
    rng = np.random.default_rng(0)
    calls = [[("fwd", float(rng.uniform(100, 300)), float(rng.uniform(0, 80))),
              ("dkdv", float(rng.uniform(100, 300)), float(rng.uniform(0, 80))),
              ("dq", float(rng.uniform(100, 300)), 0.0)] for _ in range(5)]
    ev, want = _trace(calls, rng)
    rows = ts.split_calls(ev)
    assert len(rows) == 5  # the nested PjitFunction is not a call of its own
    for r, w, c in zip(rows, want, calls):
        assert [n for n, _ in r["kernels"]] == ["fwd", "dkdv", "dq"]
        np.testing.assert_allclose([d for _, d in r["kernels"]], [d / 1e3 for _, d, _ in c])
        np.testing.assert_allclose([r["wait_ms"], r["busy_ms"], r["span_ms"]], [w["wait"], w["busy"], w["span"]])
        np.testing.assert_allclose(r["idle_ms"], sum(g for _, _, g in c) / 1e3, atol=1e-9)
    s = ts.summarize(rows)
    assert s["calls"] == 5
    np.testing.assert_allclose(s["kernels_ms"]["dkdv"], np.median([c[1][1] / 1e3 for c in calls]))


def test_overlapping_kernels_count_once_in_busy_time():
    ev = [{"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
          {"ph": "X", "pid": 1, "name": "PjitFunction(f)", "ts": 0.0, "dur": 1.0},
          {"ph": "X", "pid": 7, "name": "a", "ts": 10.0, "dur": 100.0},
          {"ph": "X", "pid": 7, "name": "b", "ts": 60.0, "dur": 100.0},   # overlaps a by 50
          {"ph": "X", "pid": 7, "name": "c", "ts": 200.0, "dur": 10.0}]
    (r,) = ts.split_calls(ev)
    assert r["busy_ms"] == pytest.approx(0.160) and r["span_ms"] == pytest.approx(0.200)
    assert r["idle_ms"] == pytest.approx(0.040) and r["wait_ms"] == pytest.approx(0.010)


@pytest.mark.slow  # a profiled run end to end
def test_capture_on_cpu_sees_every_call(tmp_path):
    """On a CPU the trace has the host calls but no GPU events: rows without kernels, one per call."""
    out = tmp_path / "t.json"
    ts.main(["--shape", "1x128x2x32", "--pass", "bwd", "--variants", "new,new:stable", "--calls", "3",
             "--out", str(out)])
    got = json.loads(out.read_text())
    assert set(got["variants"]) == {"new", "new:stable"}
    for v in got["variants"].values():
        assert v["calls"] == 3 and all(r["kernels"] == [] for r in v["rows"])


def test_halves_split_the_calls_in_order():
    rng = np.random.default_rng(1)
    early, late = rng.uniform(7, 8, 10), rng.uniform(8.5, 9, 10)  # a GPU slowing as it warms
    rows = [{"kernels": [("k", x)], "wait_ms": 0.1, "busy_ms": x, "span_ms": x, "idle_ms": 0.0}
            for x in np.concatenate([early, late])]
    first, second = ts.halves(rows)
    assert first["span_ms"] == pytest.approx(np.median(early))
    assert second["span_ms"] == pytest.approx(np.median(late))
    assert first["calls"] == second["calls"] == 10


def test_smi_summary_counts_busy_samples_and_the_power_cap(tmp_path):
    import gzip

    head = ("timestamp, clocks.current.sm [MHz], clocks.current.memory [MHz], power.draw [W], "
            "temperature.gpu, clocks_event_reasons.active")
    rows = ["2026/11/30 12:00:00.000, 1980 MHz, 3201 MHz, 130.00 W, 40, 0x0000000000000001",  # idle
            "2026/11/30 12:00:00.100, 1800 MHz, 3201 MHz, 690.00 W, 55, 0x0000000000000004",  # capped
            "2026/11/30 12:00:00.200, 1900 MHz, 3201 MHz, 650.00 W, 55, 0x0000000000000000",
            "2026/11/30 12:00:00.300, 1700 MHz, 3201 MHz, 705.00 W, 56, 0x0000000000000024",  # capped + thermal
            "broken line"]
    p = tmp_path / "smi.csv.gz"
    with gzip.open(p, "wt") as f:
        f.write("\n".join([head, *rows]) + "\n")
    s = ts.smi_summary(str(p), busy_watts=300)
    assert s["samples"] == 4 and s["busy"] == 3
    assert s["sm_mhz_median"] == 1800 and s["sm_mhz_min"] == 1700 and s["power_w_max"] == 705
    assert s["power_cap_fraction"] == pytest.approx(2 / 3)
    ts.main(["--smi", str(p)])  # the CLI path prints it without touching a GPU


def _step_trace(kind, rename=False):
    """Two steps of GPU events with known gaps, as JAX writes them (device pid, correlation ids, a
    host cuGraphLaunch per step) or as PyTorch does (kernel / gpu_memset categories, no graph)."""
    step = [("a", 100.0, 15.0), ("b", 105.0, 5.0),   # b runs inside a
            ("Memset 0", 118.0, 1.0),                # 3 µs after a, 8 after b
            ("c", 119.5, 20.0), ("d", 170.0, 10.0)]  # 0.5 µs, then 30.5 µs
    ev = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}}]
    for i, shift in enumerate((0.0, 230.0)):
        corr = str(11 + i)
        if kind == "jax":
            ev.append({"ph": "X", "pid": 2, "tid": 1, "name": "cuGraphLaunch (CudaGraph:5)",
                       "ts": shift, "dur": 20.0, "args": {"correlation_id": corr}})
        for name, t, dur in step:
            t += shift - (22.5 if i and name == "d" else 0.0)  # step 2: an 8 µs gap before d
            name = "e" if rename and i and name == "d" else name
            e = {"ph": "X", "pid": 1, "tid": 3, "name": name, "ts": t, "dur": dur}
            memset = name.startswith("Memset")
            if kind == "jax":
                e["args"] = {"correlation_id": corr}
                if memset:
                    e["args"]["Memset_details"] = "num_bytes:4"
            else:
                e.update(cat="gpu_memset" if memset else "kernel", args={"correlation": int(corr)})
            ev.append(e)
    random.Random(0).shuffle(ev)
    return ev


@pytest.mark.parametrize("kind,rename,split", [("jax", False, "graph launches"),
                                               ("torch", False, "repeated event names"),
                                               ("torch", True, "largest gaps")])
def test_gaps_per_step(tmp_path, kind, rename, split):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _step_trace(kind, rename)}, f)
    r = ts.gaps(str(path), steps=2)
    assert r["split"] == split
    assert [s["span_ms"] for s in r["per_step"]] == pytest.approx([0.080, 0.0575])
    assert [s["idle_ms"] for s in r["per_step"]] == pytest.approx([0.034, 0.0115])
    assert r["span_ms"] == pytest.approx(0.06875) and r["idle_ms"] == pytest.approx(0.02275)
    assert r["busy_ms"] == pytest.approx(0.046) and r["kernel_ms"] == pytest.approx(0.050)
    assert (r["kernels"], r["memsets"], r["memcpys"]) == (4, 1, 0)
    # <2, 2–5, 5–20, 20–100, >100 µs
    assert [h["count"] for h in r["histogram"]] == [1.0, 1.0, 0.5, 0.5, 0.0]
    assert [h["ms"] for h in r["histogram"]] == pytest.approx([0.0005, 0.003, 0.004, 0.01525, 0.0])
    assert r["between_steps_us"] == pytest.approx([150.0])
    top = [(g["us"], g["step"], g["before"], g["after"]) for g in r["largest"]]
    assert top[:2] == [(pytest.approx(30.5), 1, "c", "d"),
                       (pytest.approx(8.0), 2, "c", "e" if rename else "d")]
    assert (pytest.approx(3.0), 1, "a", "Memset 0") in top  # a ended last, not b
    assert (r["graph_launches"], r["in_graph"]) == ((2, 1.0) if kind == "jax" else (0, 0.0))
    out = tmp_path / "gaps.md"
    ts.main(["--gaps", str(path), "--steps", "2", "--out", str(out)])
    assert f"steps split by {split}" in out.read_text()


def test_host_side_of_each_call(tmp_path):
    """Two calls with nested markers and phases at known times; another thread's events and a
    kernel launch outside any call must not count."""
    ev = [{"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}}]
    x = lambda name, ts, dur, tid=1: {"ph": "X", "pid": 2, "tid": tid, "name": name, "ts": ts,
                                      "dur": dur}
    for t0, update, launch_at in ((0.0, 300.0, 700.0), (5000.0, 500.0, 900.0)):
        ev += [x("PjitFunction(jit(step))", t0, 3000.0), x("PjitFunction(jit(step))", t0 + 2, 2990.0),
               x("ParseArguments", t0 + 10, 150.0),
               x("CommonPjRtLoadedExecutable::ExecutePrepare", t0 + 200, 100.0),
               x("command_buffer::update", t0 + 350, update),
               x("cuGraphLaunch (CudaGraph:1)", t0 + launch_at, 2000.0),
               x("CommonPjRtClient::CreateOutputs", t0 + 2800, 120.0),
               x("command_buffer::update", t0 + 400, 999.0, tid=9)]  # another thread
    ev.append(x("cuLaunchKernel", 4000.0, 5.0))  # between the calls
    random.Random(1).shuffle(ev)
    r = ts.host(ev)
    assert r["calls"] == 2
    assert [c["to_launch_us"] for c in r["per_call"]] == [700.0, 900.0]
    assert [c["command_buffer::update_us"] for c in r["per_call"]] == [300.0, 500.0]
    assert r["to_launch_us"] == 800.0 and r["call_us"] == 3000.0
    assert (r["ParseArguments_us"], r["ExecutePrepare_us"], r["CreateOutputs_us"]) == (150.0, 100.0, 120.0)
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    out = tmp_path / "host.md"
    ts.main(["--host", str(path), "--out", str(out)])
    assert "| call start to first launch | **800** |" in out.read_text()
