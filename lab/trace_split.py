"""Where one attention call's time goes on the GPU: kernels, gaps between them, and the wait before
the first — read from a JAX profiler trace (CUPTI's kernel records, in situ: no cache flush or
serialisation as under Nsight Compute).

    python -m lab.trace_split [--shape 4x8192x16x128] [--pass fwd+bwd]
        [--variants new,new@k64] [--entries lab/entries.json] [--calls 20] [--out F.json]

Variants as in ``lab.ab`` (``new``, ``new@ENTRY``, ``mosaic``, ``:stable``, ``cudnn``). Each variant is
jitted, warmed up, then called ``--calls`` times inside ``jax.profiler.trace``, each call waited for
on its own (as ``lab.ab``'s ``sync="call"``). The trace's device events are split per call at the
host's ``PjitFunction`` events; per call: the host-to-first-kernel wait, each kernel's time, the
device's busy time (union of its events), the span from first start to last end, and the idle time
inside that span.
Printed as medians per variant; ``--out`` keeps them with the per-call rows. What it answers: why
a faster kernel need not make the call faster (time spent between kernels or before the first).

Without a GPU: ``--from-json F.json`` prints a saved run again, with the medians of the first and
the second half of the calls apart (the GPU's clocks fall as it warms: later calls are slower);
``--smi F.csv[.gz]`` summarises an ``nvidia-smi --query-gpu=...,clocks.sm,...,power.draw,...,
clocks_throttle_reasons.active --format=csv`` log over its busy samples (power above ``--busy-watts``).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import statistics
import tempfile


def load_trace(log_dir: str) -> list[dict]:
    """The events of the newest perfetto trace under ``log_dir`` (written by jax.profiler.trace)."""
    files = sorted(glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir}")
    t = json.load(gzip.open(files[-1]))
    return t["traceEvents"] if isinstance(t, dict) else t


def device_pids(events) -> set:
    """Process ids whose name is a GPU device (``/device:GPU:0`` …)."""
    return {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
            and str(e.get("args", {}).get("name", "")).startswith("/device:GPU")}


def _union(intervals):
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def split_calls(events, call_marker: str = "PjitFunction(") -> list[dict]:
    """Per host call (an X event whose name starts with ``call_marker``, outside any other such event):
    the device X events that start between it and the next call. Times in ms."""
    gpu = device_pids(events)
    calls = sorted((e for e in events if e.get("ph") == "X" and e.get("pid") not in gpu
                    and str(e.get("name", "")).startswith(call_marker)), key=lambda e: e["ts"])
    top = []  # nested markers (a jitted call inside another) belong to the outer one
    for c in calls:
        if top and c["ts"] < top[-1]["ts"] + top[-1].get("dur", 0):
            continue
        top.append(c)
    dev = sorted((e for e in events if e.get("ph") == "X" and e.get("pid") in gpu), key=lambda e: e["ts"])
    rows = []
    for i, c in enumerate(top):
        t0, t1 = c["ts"], top[i + 1]["ts"] if i + 1 < len(top) else float("inf")
        mine = [e for e in dev if t0 <= e["ts"] < t1]
        if not mine:
            rows.append({"kernels": [], "wait_ms": None, "busy_ms": 0.0, "span_ms": 0.0, "idle_ms": 0.0})
            continue
        iv = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in mine]
        first, last = min(s for s, _ in iv), max(e for _, e in iv)
        busy = _union(iv)
        rows.append({"kernels": [(e["name"], e.get("dur", 0) / 1e3) for e in mine],
                     "wait_ms": (first - t0) / 1e3, "busy_ms": busy / 1e3,
                     "span_ms": (last - first) / 1e3, "idle_ms": (last - first - busy) / 1e3})
    return rows


def summarize(rows: list[dict]) -> dict:
    """Medians over calls; per kernel name, the median of its summed time per call."""
    med = lambda xs: statistics.median(xs) if xs else None
    names = sorted({n for r in rows for n, _ in r["kernels"]})
    per_kernel = {n: med([sum(d for m, d in r["kernels"] if m == n) for r in rows]) for n in names}
    return {"calls": len(rows), "wait_ms": med([r["wait_ms"] for r in rows if r["wait_ms"] is not None]),
            "busy_ms": med([r["busy_ms"] for r in rows]), "span_ms": med([r["span_ms"] for r in rows]),
            "idle_ms": med([r["idle_ms"] for r in rows]), "kernels_ms": per_kernel}


def halves(rows: list[dict]) -> tuple[dict, dict]:
    """``summarize`` of the first and of the second half of the calls (in call order)."""
    n = len(rows) // 2
    return summarize(rows[:n]), summarize(rows[n:])


def smi_summary(path: str, busy_watts: float = 300.0) -> dict:
    """Over the samples of an nvidia-smi CSV log drawing more than ``busy_watts``: their count, the
    median and minimum SM clock (MHz), the median and maximum power (W), and the fraction with the
    software power cap (throttle/event reason bit 0x4) active."""
    import csv

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = [[c.strip() for c in r] for r in csv.reader(f)]
    head, body = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
    col = lambda test: next(i for i, h in enumerate(head) if test(h))
    # nvidia-smi names the clocks.sm column "clocks.current.sm [MHz]"
    sm = col(lambda h: h.startswith("clocks.") and h.split(" ")[0].endswith(".sm"))
    pw, why = col(lambda h: h.startswith("power.draw")), col(lambda h: "reasons.active" in h)
    num = lambda x: float(x.split()[0])
    busy = [r for r in body if num(r[pw]) > busy_watts]
    if not busy:
        return {"samples": len(body), "busy": 0}
    clocks, watts = [num(r[sm]) for r in busy], [num(r[pw]) for r in busy]
    capped = sum(1 for r in busy if int(r[why], 16) & 0x4)
    return {"samples": len(body), "busy": len(busy), "sm_mhz_median": statistics.median(clocks),
            "sm_mhz_min": min(clocks), "power_w_median": statistics.median(watts),
            "power_w_max": max(watts), "power_cap_fraction": capped / len(busy)}


def _print_summary(shape, pss, spec, s, tag=""):
    fmt = lambda x: "—" if x is None else f"{x:.3f}"
    print(f"{shape} {pss} {spec:>20}{tag}: wait {fmt(s['wait_ms'])}  span {fmt(s['span_ms'])}  "
          f"busy {fmt(s['busy_ms'])}  idle {fmt(s['idle_ms'])} ms  | "
          + "  ".join(f"{n[:32]} {fmt(t)}" for n, t in s["kernels_ms"].items()))


def trace_variant(fn, args, calls: int, log_dir: str) -> list[dict]:
    import jax

    jax.block_until_ready(fn(*args))  # compile, warm up
    jax.block_until_ready(fn(*args))
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
    return split_calls(load_trace(log_dir))


def main(argv=None):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_flash
    from bench.attention import _jax_pass
    from lab import ab

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="4x8192x16x128")
    p.add_argument("--pass", dest="pss", default="fwd+bwd", choices=("fwd", "bwd", "fwd+bwd"))
    p.add_argument("--variants", default="new")
    p.add_argument("--entries", default=str(ab.ENTRIES), help="JSON file: NAME -> entry")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--from-json", default=None, help="print a saved --out file (no GPU), with halves")
    p.add_argument("--smi", default=None, help="summarise an nvidia-smi CSV log (no GPU)")
    p.add_argument("--busy-watts", type=float, default=300.0)
    a = p.parse_args(argv)
    if a.smi:
        print(json.dumps(smi_summary(a.smi, a.busy_watts)))
    if a.from_json:
        saved = json.load(open(a.from_json))
        shape = "x".join(str(x) for x in saved["shape"])
        for spec, v in saved["variants"].items():
            _print_summary(shape, saved["pass"], spec, summarize(v["rows"]), " all")
            for tag, h in zip((" 1st half", " 2nd half"), halves(v["rows"])):
                _print_summary(shape, saved["pass"], spec, h, tag)
    if a.smi or a.from_json:
        return
    shape = tuple(int(x) for x in a.shape.split("x"))
    entries = json.load(open(a.entries))
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3))
    out = {"shape": list(shape), "pass": a.pss, "jax_version": jax.__version__,
           "device": jax.devices()[0].device_kind, "variants": {}}
    for spec in a.variants.split(","):
        fn = _jax_pass(ab._attention_fn(spec, {"new": jax_flash}, entries, True, "fa2"), a.pss)
        rows = trace_variant(fn, (q, k, v), a.calls, tempfile.mkdtemp(prefix="trace-"))
        s = summarize(rows)
        out["variants"][spec] = {**s, "rows": rows}
        _print_summary(a.shape, a.pss, spec, s)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
