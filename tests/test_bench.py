"""bench.attention's and bench.tune's plumbing on CPU (records, tables, memory analysis, the tuner's
search and the entries it writes) — speed itself is measured on the GPU by `python -m
bench.attention`, never asserted in tests. The lab tools' tests are in lab/tests/."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash as jf
from bench import attention as bench
from bench import tune
from jax_flash.pallas import mosaic_common, tuning

KEYS = {"impl", "policy", "stable", "shape", "causal", "pass", "ms", "tflops", "jax_version", "device"}


def test_records_and_markdown():
    logged = []
    recs = bench.run([(1, 32, 2, 32)], reps=2, passes=("fwd",), log=logged.append)
    impls = {r["impl"] for r in recs}
    assert {"jax_flash", "xla"} <= impls
    assert {(r["policy"], r["stable"]) for r in recs if r["impl"] == "jax_flash"} == {
        ("fa2", False), ("fa2", True), ("paper", False), ("paper", True)}
    for r in recs:
        assert KEYS <= set(r) and r["ms"] > 0 and r["tflops"] > 0 and r["shape"] == [1, 32, 2, 32]
    if jax.default_backend() == "cpu":  # cuDNN cannot run here: reported, not fatal
        assert any("cudnn" in line and "failed" in line for line in logged)
    table = bench.markdown(recs)
    assert "| jax_flash | fa2 | True |" in table and "1×32×2×32, causal" in table
    expect = "jnp" if jax.default_backend() == "cpu" else "triton"  # no table entry at this shape
    assert {r.get("fwd_kernel") for r in recs if r["impl"] == "jax_flash"} == {expect}
    assert all("fwd_kernel" not in r for r in recs if r["impl"] != "jax_flash")
    assert all("bwd_kernel" not in r for r in recs)  # forward passes only


def _on_a_hopper_gpu_with_table(monkeypatch, table):
    """Plans as on an sm_90 GPU where the Mosaic GPU kernels can run, with ``table`` (key ->
    launch) as the tuning table (nothing is compiled: plans only)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(mosaic_common, "unavailable", lambda: None)
    monkeypatch.setattr(tuning, "device_arch", lambda: "sm_90")
    monkeypatch.setattr(tuning, "_table", lambda: {k: ("sm_90", v) for k, v in table.items()})


def test_records_name_the_kernels_the_table_chose(monkeypatch):
    """On a Hopper GPU the tuning table's "fwd_kernel" and "bwd_kernel" decide; a record says
    which ran — the Triton kernels where the Mosaic GPU ones do not cover the call."""
    mosaic = jf.Launch(fwd_kernel="mosaic", bwd_kernel="mosaic")
    q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    _on_a_hopper_gpu_with_table(monkeypatch, {"fa2/d64/t512/causal": mosaic,
                                              "paper/d64/t512/causal": mosaic})
    assert bench.kernels(q, True, "fa2", True) == {"fwd_kernel": "mosaic"}
    assert bench.kernels(q, True, "fa2", True, "fwd+bwd") == {"fwd_kernel": "mosaic",
                                                               "bwd_kernel": "mosaic"}
    # not covered: "fa2" only
    assert bench.kernels(q, True, "paper", False, "fwd+bwd") == {"fwd_kernel": "triton",
                                                                  "bwd_kernel": "triton"}
    _on_a_hopper_gpu_with_table(monkeypatch, {
        "fa2/d64/t512/causal": dataclasses.replace(mosaic, bwd_kernel="mosaic_dkdv")})
    assert bench.kernels(q, True, "fa2", False, "fwd+bwd")["bwd_kernel"] == "mosaic_dkdv"
    _on_a_hopper_gpu_with_table(monkeypatch, {})  # no entry for this shape
    assert bench.kernels(q, True, "fa2", False, "fwd+bwd") == {"fwd_kernel": "triton",
                                                                "bwd_kernel": "triton"}


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU sizes")
def test_timed_interleaved_alternates_and_drops_failures():
    """Every fn is warmed up first, then timed in rounds of `reps` calls each, in turn, odd rounds in
    reverse order; a fn that raises while compiling is reported and left out (the others are still
    timed)."""
    calls, logged = [], []

    def fn(name):
        def f(x):
            calls.append(name)
            return x
        return f

    def broken(x):
        raise RuntimeError("no kernel for this shape")

    ms = bench.timed_interleaved({"a": fn("a"), "bad": broken, "b": fn("b")}, (jax.numpy.ones(2),),
                                 reps=2, rounds=3, log=logged.append)
    assert set(ms) == {"a", "b"} and all(t >= 0 for t in ms.values())
    assert calls == ["a", "a", "b", "b"] + ["a", "a", "b", "b", "b", "b", "a", "a", "a", "a", "b", "b"]
    assert len(logged) == 1 and "bad: failed: RuntimeError" in logged[0]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU sizes")
def test_timed_interleaved_gives_each_fn_its_own_args():
    """``args`` as a dict: each fn is called with its own inputs (the mgpu variant's float16 copies)."""
    seen = {"a": set(), "b": set()}

    def fn(name):
        def f(x):
            seen[name].add(str(x.dtype))
            return x
        return f

    x = jax.numpy.ones(2, jax.numpy.bfloat16)
    bench.timed_interleaved({"a": fn("a"), "b": fn("b")}, {"a": (x,), "b": (x.astype("float16"),)},
                            reps=1, rounds=2)
    assert seen == {"a": {"bfloat16"}, "b": {"float16"}}


def test_timed_interleaved_round_sync_waits_once_per_round():
    """sync="round": a round's calls go out back to back and are waited for after the last one; the
    sample is their mean, so a fn of known duration reads that duration in both modes. sync="call":
    every call is waited for before the next."""
    import time

    events = []

    class Out:  # stands for a device array: block_until_ready waits on its leaves
        def block_until_ready(self):
            events.append("wait")
            return self

    def sleepy(x):
        events.append("call")
        time.sleep(0.005)
        return Out()

    warm = ["call", "wait"] * 2
    ms = bench.timed_interleaved({"s": sleepy}, (0,), reps=4, rounds=3, sync="round")
    assert 4.5 <= ms["s"] < 15
    assert events == warm + (["call"] * 4 + ["wait"] * 4) * 3
    events.clear()
    ms = bench.timed_interleaved({"s": sleepy}, (0,), reps=4, rounds=3, sync="call")
    assert 4.5 <= ms["s"] < 15
    assert events == warm + ["call", "wait"] * 12
    with pytest.raises(ValueError, match="sync"):
        bench.timed_interleaved({"s": sleepy}, (0,), reps=1, rounds=1, sync="never")


def _fake_clock(monkeypatch):
    """``bench``'s clock made a counter that fns built by ``takes(name, seconds)`` advance by their
    duration, each call logged in ``seq``: timing arithmetic checked without a GPU."""
    now, seq = [0.0], []
    monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])

    def takes(name, seconds):
        def f(x):
            seq.append(name)
            now[0] += seconds
            return x
        return f

    return seq, takes


def test_warm_up_precedes_every_sample(monkeypatch):
    """``warm_ms``: before each sample a fn runs back to back, as many calls as its last measured
    call time says fill that long, and only then is timed: on a fake clock, with a 20-ms warm-up a
    fn of 4 ms runs 5 calls untimed before each of its samples, one of 8 ms 3 (24 ms), one of 50 ms
    a single call; the timed figures are unchanged, and no warm-up (the default) adds no call."""
    seq, takes = _fake_clock(monkeypatch)
    fns = {"a": takes("a", 0.004), "b": takes("b", 0.008), "c": takes("c", 0.05)}
    for warm_ms, warm in ((20.0, {"a": 5, "b": 3, "c": 1}), (0.0, {"a": 0, "b": 0, "c": 0})):
        for sync in ("round", "call"):
            seq.clear()
            ms = bench.timed_interleaved(fns, (jax.numpy.ones(2),), reps=2, rounds=2, sync=sync,
                                         warm_ms=warm_ms)
            np.testing.assert_allclose([ms["a"], ms["b"], ms["c"]], [4.0, 8.0, 50.0])
            order = ["a", "b", "c", "c", "b", "a"]
            expected = [n for n in order for _ in range(warm[n] + 2)]  # after the compile calls
            assert seq[6:] == expected, (warm_ms, sync)


def test_slow_fns_take_fewer_calls_and_only_named_ones_are_warmed(monkeypatch):
    """``sample_ms``: on a fake clock, with 4 calls a sample and 60 ms to fill, a fn of 4 ms takes
    all 4, one of 25 ms 3 (75 ms), one of 200 ms 1 — its figures unchanged — and ``calls`` says so.
    ``warm``: only the named fns run the warm-up's calls before their samples."""
    seq, takes = _fake_clock(monkeypatch)
    fns = {"a": takes("a", 0.004), "b": takes("b", 0.025), "c": takes("c", 0.2)}
    for sync in ("round", "call"):
        seq.clear()
        calls = {}
        ms = bench.timed_interleaved(fns, (jax.numpy.ones(2),), reps=4, rounds=2, sync=sync,
                                     sample_ms=60.0, calls=calls, warm_ms=20.0, warm={"a"})
        np.testing.assert_allclose([ms["a"], ms["b"], ms["c"]], [4.0, 25.0, 200.0])
        assert calls == {"a": 4, "b": 3, "c": 1}, sync
        n = {"a": 5 + 4, "b": 3, "c": 1}  # a: 5 warm-up calls of 4 ms fill 20 ms, then its 4
        assert seq[6:] == [x for x in ["a", "b", "c", "c", "b", "a"] for _ in range(n[x])], sync


def test_run_compiles_deterministic_cudnn_with_xlas_option(monkeypatch):
    """The implementation named cudnn_deterministic, and only it, has its programs compiled with
    ``xla_gpu_deterministic_ops`` (what makes XLA ask cuDNN for its deterministic backward)."""
    det, other = (lambda q, k, v: q * 2), (lambda q, k, v: q * 3)
    monkeypatch.setattr(bench, "_jax_impls", lambda causal: [
        ("cudnn_deterministic", None, None, det), ("xla", None, None, other)])
    monkeypatch.setattr(bench, "_torch_records", lambda *a, **k: [])
    seen, real = {}, bench._jax_pass

    def spy(f, pss, compiler_options=None):
        seen[f] = compiler_options
        return real(f, pss, compiler_options)

    monkeypatch.setattr(bench, "_jax_pass", spy)
    recs = bench.run([(1, 32, 1, 16)], reps=2, passes=("fwd",), rounds=2, log=lambda m: None)
    assert seen == {det: {"xla_gpu_deterministic_ops": True}, other: None}
    assert {r["impl"] for r in recs} == {"cudnn_deterministic", "xla"}


def test_run_warms_only_the_compared_implementations(monkeypatch):
    """``bench.attention.run`` gives the warm-up and ``sample_ms`` to ``timed_interleaved`` with
    "fa2" (with and without the shift) and cuDNN named to be warmed; the records say which had the
    warm-up, and their calls a sample."""
    seen = {}

    def fake(fns, args, reps, rounds, **kw):
        seen.update(kw, names=set(fns))
        kw["calls"].update({name: 1 if name[0] == "xla" else reps for name in fns})
        kw["per_round"].update({name: [1.0] * rounds for name in fns})
        return {name: 1.0 for name in fns}

    monkeypatch.setattr(bench, "timed_interleaved", fake)
    monkeypatch.setattr(bench, "_torch_records", lambda *a, **k: [])
    recs = bench.run([(1, 64, 1, 16)], reps=4, passes=("fwd",), rounds=2, sync="round",
                     warm_ms=300.0, sample_ms=100.0, log=lambda m: None)
    assert seen["warm"] == {("jax_flash", "fa2", False), ("jax_flash", "fa2", True),
                            ("cudnn", None, None), ("cudnn_deterministic", None, None)}
    assert seen["warm"] <= seen["names"]
    assert seen["warm_ms"] == 300.0 and seen["sample_ms"] == 100.0
    warmed = {(r["impl"], r["policy"], r["stable"]) for r in recs if r.get("warm_ms") == 300.0}
    assert warmed == seen["warm"]
    assert {r["calls"] for r in recs if r["impl"] == "xla"} == {1}
    assert all(r["sample_ms"] == 100.0 for r in recs)
    line = bench.timing_line(recs)
    assert ("each sample of fa2, fa2 stable, cuDNN and cuDNN deterministic after 300 ms"
            in line), line
    assert "up to 2 calls a sample" in line and "fill 100 ms" in line, line


def test_warm_up_keeps_one_result_alive(monkeypatch):
    """The warm-up's results are dropped as it goes: a fast fn's hundreds of warm-up calls, each
    result held until one wait, once filled an 80-GB GPU. On a fake clock, 50 calls of 0.1 ms fill
    5 ms, and no more than two results (the one held, the one being made) are ever alive."""
    import weakref

    now, alive, peak = [0.0], [0], [0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])

    class Out:
        def block_until_ready(self):
            return self

    def f(x):
        now[0] += 1e-4
        out = Out()
        alive[0] += 1
        peak[0] = max(peak[0], alive[0])
        weakref.finalize(out, lambda: alive.__setitem__(0, alive[0] - 1))
        return out

    calls = []
    monkeypatch.setattr(bench, "jax", type("J", (), {"block_until_ready": staticmethod(
        lambda x: calls.append(x) or x)}))
    bench._warm(f, (0,), 5.0, 0.1)
    assert now[0] == pytest.approx(5e-3) and len(calls) == 1
    assert peak[0] <= 2, peak[0]


def test_per_round_times_pair_the_variants(monkeypatch):
    """``per_round`` receives each round's time per fn (on a fake clock: a fn that takes 2 units
    against one that takes 1 reads ×2 in every round, in both sync modes), and ``paired_median``
    turns paired rounds into a median ratio with an interval that holds it."""
    now = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])

    def takes(seconds):
        def f(x):
            now[0] += seconds
            return x
        return f

    for sync in ("call", "round"):
        per_round = {}
        bench.timed_interleaved({"a": takes(0.004), "b": takes(0.008)}, (jax.numpy.ones(2),),
                                reps=2, rounds=5, sync=sync, per_round=per_round)
        assert set(per_round) == {"a", "b"} and all(len(v) == 5 for v in per_round.values())
        np.testing.assert_allclose(per_round["a"], 4.0)
        np.testing.assert_allclose(np.asarray(per_round["b"]) / np.asarray(per_round["a"]), 2.0)
    rng = np.random.default_rng(1)
    base = 8.0 + rng.normal(0, 0.5, 20)  # a drifting GPU: the pairs share each round's drift
    med, (lo, hi) = bench.paired_median(base * 1.025 * (1 + rng.normal(0, 1e-3, 20)), base)
    # the ratios spread as the 1e-3 noise does, not as the 0.5 ms drift (6 % of the times)
    assert lo <= med <= hi and abs(med - 1.025) < 2e-3 and hi - lo < 4e-3


def test_memory_grows_linearly_for_flash_quadratically_for_xla():
    """Compiled fwd+bwd temp memory from T = 2048 to 4096: XLA's softmax attention holds B·H·T² scores
    (×4), the flash executor only tiles (×2). Measured: flash 10.0 → 20.1 MiB, XLA 98 → 388 MiB."""
    mem = bench.memory([2048, 4096], heads=2, head_dim=32, log=lambda _: None)
    temp = {(m["impl"], m["shape"][1]): m["temp_bytes"] for m in mem}
    assert temp["jax_flash", 4096] / temp["jax_flash", 2048] < 2.5
    assert temp["xla", 4096] / temp["xla", 2048] > 3.5
    quadratic = [m["quadratic_bytes"] for m in mem if m["shape"][1] == 4096][0]
    assert temp["xla", 4096] >= quadratic > 4 * temp["jax_flash", 4096]


def test_tuning_table_reaches_the_plan(monkeypatch, tmp_path):
    """An entry of a tuning table (read by ``tuning.load``, as the library reads tuning.json) sets the
    launch of calls of its key on GPUs of its architecture only; it never sets tiles (the call's
    arguments and defaults do), an explicit ``launch=`` wins, and off the GPU it is unused."""
    entry = {"fwd": {"num_warps": 8, "num_stages": 3}, "bwd": [4, 2], "split_diagonal": True,
             "dq": {"num_warps": 8, "num_stages": 3}, "dq_block": 256,
             "arch": "sm_90", "device": "Test GPU", "jax_version": "0.0", "ms": 1.0}
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({tuning.key("fa2", 64, 1000, True): entry}))
    assert tuning.key("fa2", 64, 1000, True) == "fa2/d64/t1024/causal"
    table = tuning.load(path)
    x = jax.ShapeDtypeStruct((1, 1000, 2, 64), jnp.bfloat16)
    cpu = jf.plan(x, x, x, impl="pallas")
    assert cpu.launch == jf.Launch() and (cpu.numerics.block_q, cpu.numerics.block_k) == (64, 64)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(tuning, "_table", lambda: table)
    monkeypatch.setattr(tuning, "device_arch", lambda: "sm_90")
    gpu = jf.plan(x, x, x)
    assert gpu.executor == "pallas" and gpu.numerics == cpu.numerics
    assert gpu.launch == jf.Launch(fwd=(8, 3), bwd=(4, 2), dq=(8, 3), dq_block=256,
                                   split_diagonal=True)
    assert jf.plan(x, x, x, block_k=32).numerics.block_k == 32
    assert jf.plan(x, x, x, launch={"fwd": (4, 3)}).launch == jf.Launch(fwd=(4, 3))
    assert jf.plan(x, x, x, causal=False).launch == jf.Launch()  # another key
    monkeypatch.setattr(tuning, "device_arch", lambda: "sm_80")
    assert jf.plan(x, x, x).launch == jf.Launch()  # measured on another architecture


def test_tuning_table_refuses_numerics():
    """A table entry holds launch fields and provenance only: tiles or a numerics flag in it raise."""
    for field in ("block_q", "block_k", "scale_late", "stable"):
        with pytest.raises(ValueError, match="not launch fields"):
            tuning.entry_launch({"arch": "sm_90", "ms": 1.0, field: 64})


def test_shipped_tuning_table_holds_launches_with_provenance():
    raw = json.loads(tuning.TABLE_PATH.read_text())
    table = tuning.load()
    assert set(table) == set(raw)
    for key, entry in raw.items():
        assert set(tuning.META_FIELDS) <= set(entry), key
        assert table[key][0] == entry["arch"] and table[key][0].startswith("sm_"), key


def test_default_launch_without_a_table_entry():
    from jax_flash.pallas.common import default_launch

    # the tuner's winners (bench/results/2026-11-29-NVIDIA_H200-tune-log.json): 4 warps for 64×64
    # tiles in every kernel
    assert default_launch(64, 64, 64) == default_launch(64, 64, 64, backward=True) == (4, 3)
    assert default_launch(128, 64, 64) == (4, 3) and default_launch(128, 64, 64, backward=True) == (4, 2)
    assert default_launch(64, 128, 64, backward=True) == (8, 2)  # larger tiles: 8 warps
    # not measured (FP32 inputs, head_dim 256: more shared memory per pipelined tile): the earlier
    # defaults, 2 stages and 8 warps for the wide forward
    assert default_launch(128, 64, 64, itemsize=4) == default_launch(256, 64, 64) == (8, 2)
    assert default_launch(64, 64, 64, itemsize=4) == default_launch(256, 64, 64, backward=True) == (4, 2)


def test_targets_table_from_records(tmp_path):
    """The ratio table is computed from the records (hand-made here), and --from-json re-renders it."""
    import json

    def rec(impl, pss, ms, policy=None, stable=None, shape=(32, 1024, 12, 64)):
        return dict(impl=impl, policy=policy, stable=stable, shape=list(shape), causal=True,
                    **{"pass": pss}, ms=ms, tflops=1.0, jax_version="x", device="Test GPU")

    recs = [rec("jax_flash", "fwd+bwd", 2.0, "fa2", False), rec("jax_flash", "fwd+bwd", 2.1, "fa2", True),
            rec("jax_flash", "fwd", 1.0, "fa2", False), rec("jax_flash", "fwd", 1.5, "fa2", True),
            rec("cudnn", "fwd+bwd", 1.6), rec("jax_pallas_mha", "fwd+bwd", 3.0), rec("cudnn", "fwd", 0.9)]
    table = bench.targets(recs)
    assert "| 32×1024×12×64 | 0.80× | 1.50× | +5.0 % | +50.0 % | — | 0.90× | — | — |" in table
    path = tmp_path / "2026-01-02-Test_GPU.json"
    path.write_text(json.dumps(recs))
    bench.main(["--from-json", str(path), "--md", str(tmp_path / "B.md")])
    md = (tmp_path / "B.md").read_text()
    assert "| 32×1024×12×64 | 0.80× | 1.50× |" in md and "jax x, 2026-01-02" in md
    # with per-round times the stable extra is paired by round (both variants share each round's
    # drift, which cancels), read instead of the medians' ratio (+5.0 % here), with a 90 % interval
    drift = [1.0, 1.0, 1.0, 1.4, 1.4]
    paired = [dict(r, rounds_ms=[2.0 * d * (1.03 if r["stable"] else 1.0) for d in drift])
              for r in recs[:2]] + recs[2:]
    assert "| +3.0 % (+3.0 … +3.0) |" in bench.targets(paired)
    # cuDNN over ours paired by round too, beside the medians' ratio (0.80× here): cuDNN 0.9 of ours
    # in every round but one, where it is 1.2 of ours; the median of the five ratios is 0.9
    ratio = [0.9, 0.9, 1.2, 0.9, 0.9]
    ours = dict(recs[0], rounds_ms=[2.0 * d for d in drift])
    cudnn = dict(recs[4], rounds_ms=[2.0 * d * q for d, q in zip(drift, ratio)])
    speed = [ours] + recs[1:4] + [cudnn] + recs[5:]
    assert "| 0.90× | 0.900× (0.900 … 1.200) | — |" in bench.targets(speed)
    # and cuDNN's deterministic backward in the last column: 1.4 of ours in every round
    det = dict(recs[4], impl="cudnn_deterministic", rounds_ms=[2.8 * d for d in drift])
    assert "| 0.900× (0.900 … 1.200) | 1.400× (1.400 … 1.400) |" in bench.targets(speed + [det])
    # the same records without the causal mask, after the causal ones: a row of their own
    full = [dict(r, causal=False, ms=r["ms"] * (2.2 if r["stable"] else 2.0)) for r in recs]
    rows = [line for line in bench.targets(full + recs).splitlines() if line.startswith("| 32")]
    assert rows == ["| 32×1024×12×64 | 0.80× | 1.50× | +5.0 % | +50.0 % | — | 0.90× | — | — |",
                    "| 32×1024×12×64, no mask | 0.80× | 1.50× | +15.5 % | +65.0 % | — | 0.90× | — "
                    "| — |"]


def test_order_check_compares_forward_and_reversed_rounds(tmp_path):
    """The order check divides an implementation's median over the rounds run in the listed order
    (even) by its median over the reversed ones (odd): rounds alternating 8.0 / 7.4 ms read
    ×1.081, steady ones ×1.000; without per-round times, or with fewer than 4, "—". The rendered
    file carries it, and says whether its samples followed a warm-up."""
    import json

    def rec(impl, rounds, policy=None, stable=None, causal=True):
        return dict(impl=impl, policy=policy, stable=stable, shape=[4, 8192, 16, 128],
                    causal=causal, **{"pass": "fwd+bwd"}, ms=7.7, tflops=1.0, jax_version="x",
                    device="Test GPU", sync="round", **({"rounds_ms": rounds} if rounds else {}))

    recs = [rec("jax_flash", [8.0, 7.4] * 3, "fa2", False),
            rec("jax_flash", [7.5] * 6, "fa2", True),
            rec("cudnn", None), rec("cudnn", [7.0, 7.1, 7.0], causal=False),
            rec("cudnn_deterministic", [10.0, 10.5] * 3)]
    rows = [line for line in bench.order_check(recs).splitlines() if line.startswith("| 4")]
    assert rows == ["| 4×8192×16×128 | ×1.081 | ×1.000 | — | ×0.952 |",
                    "| 4×8192×16×128, no mask | — | — | — | — |"]
    path = tmp_path / "2026-01-02-Test_GPU.json"
    for warm, says in ((None, "no warm-up"), (300.0, "each sample after 300 ms of its own calls")):
        path.write_text(json.dumps([dict(r, **({"warm_ms": warm} if warm else {})) for r in recs]))
        bench.main(["--from-json", str(path), "--md", str(tmp_path / "B.md")])
        md = (tmp_path / "B.md").read_text()
        assert says in md and "| 4×8192×16×128 | ×1.081 |" in md


@pytest.mark.slow  # experiment tooling, 5–15 s: JAX_FLASH_SLOW=1 (make test-all)
def test_tune_one_searches_launches_on_cpu(monkeypatch):
    """bench.tune's search on a tiny shape with one Triton launch (the kernels run interpreted, so
    the times mean nothing here): forward candidates on the forward pass, then backward ones on
    fwd+bwd, then the finalists with and without split_diagonal, interleaved; the Mosaic GPU
    candidates are refused by the plan off a GPU and skipped. Every trial has the call's default
    tiles and a launch; the winner is one of the final trials."""
    monkeypatch.setattr(tune, "LAUNCHES", [(4, 2)])
    logged = []
    best, trials = tune.tune_one((1, 32, 1, 16), "fa2", 1, float("inf"), logged.append)
    assert [t["pass"] for t in trials] == ["fwd"] * 2 + ["fwd+bwd"] * (2 + 4)
    rings = 1 + len(tune.MOSAIC_STAGES)  # each Mosaic candidate at each ring depth
    # the forward's rings, the dK/dV kernel beside Triton's dQ, the backward's rings, register
    # splits and its dQ on 128-key tiles with the default and each split
    assert sum("skipped" in m and "mosaic" in m for m in logged) == (
        rings + 1 + rings + len(tune.MOSAIC_REGS) + 1 + len(tune.MOSAIC_REGS))
    assert all((t["block_q"], t["block_k"]) == (32, 32) for t in trials)  # 64 cut to the length
    finals = [t for t in trials if t.get("final")]
    assert [t["launch"].get("split_diagonal", False) for t in finals] == [False, True] * 2
    assert all(len(t["rounds_ms"]) == tune.ROUNDS for t in finals)
    ms, launch = best
    assert ms == min(t["ms"] for t in finals) and launch.bwd == (4, 2)
    assert {"launch": launch.to_dict(), "ms": ms} in [{"launch": t["launch"], "ms": t["ms"]}
                                                      for t in finals]
    # the same search without the causal mask: every trial records it, the winner as before
    full, full_trials = tune.tune_one((1, 32, 1, 16), "fa2", 1, float("inf"), logged.append,
                                      causal=False)
    assert full is not None and all(t["causal"] is False for t in full_trials)
    assert all(t["causal"] is True for t in trials)


class _Candidate:
    """A stand-in for a candidate's compiled pass: which launch and pass it times."""

    def __init__(self, launch, pss):
        self.launch, self.pss = launch, pss

    def __call__(self, q, k, v):
        return q


def test_tune_ranks_by_the_interleaved_rounds_not_by_one_shot(monkeypatch):
    """Scripted times: the backward candidate fastest in its one-shot timing loses to the one whose
    interleaved median is lowest; the forward's winner is carried into every backward candidate."""
    monkeypatch.setattr(tune, "LAUNCHES", [(4, 2), (8, 2)])
    monkeypatch.setattr(tune, "_pass_fn",
                        lambda policy, launch, pss, causal=True: _Candidate(launch, pss))
    fast_fwd = jf.Launch(fwd=(8, 2), prefetch_scores=True)
    lucky = dataclasses.replace(fast_fwd, bwd=(4, 2))
    steady = dataclasses.replace(fast_fwd, bwd=(8, 2), prefetch_rows=True)

    def one_shot(fn, args, reps):
        if fn.pss == "fwd":
            return 1.0 if fn.launch == fast_fwd else 1.5
        assert (fn.launch.fwd, fn.launch.prefetch_scores) == ((8, 2), True)
        return {lucky: 1.0, steady: 1.2}.get(fn.launch, 2.0)

    final = {lucky: 2.0, steady: 1.8, dataclasses.replace(steady, split_diagonal=True): 1.9}
    calls = []

    def interleaved(fns, args, reps, rounds, log=print, per_round=None):
        calls.append((len(fns), rounds))
        per_round.update({i: [final.get(fn.launch, 3.0)] * rounds for i, fn in fns.items()})
        return {i: final.get(fn.launch, 3.0) for i, fn in fns.items()}

    monkeypatch.setattr(tune, "_timed", one_shot)
    monkeypatch.setattr(tune, "timed_interleaved", interleaved)
    (ms, launch), trials = tune.tune_one((1, 32, 1, 16), "fa2", 1, float("inf"), lambda m: None)
    assert (ms, launch) == (1.8, steady)
    assert calls == [(2 * tune.FINALISTS, tune.ROUNDS)]
    assert len([t for t in trials if t["pass"] == "fwd"]) == 4  # the Mosaic forward: refused


def test_tune_writes_launch_fields_only(monkeypatch, tmp_path):
    """The entries bench.tune writes hold launch fields (off their defaults) and where they were
    measured — no tile, no numerics flag — and read back through ``tuning.load`` as the launch that
    won; ``main`` merges them into the table it is given, keeping the other entries."""
    launch = jf.Launch(fwd=(8, 3), bwd=(4, 2), prefetch_rows=True, split_diagonal=True)
    entry = tune.table_entry(launch, 1.23456, "Test GPU", "sm_90", "0.0")
    launch_fields = {f.name for f in dataclasses.fields(jf.Launch)}
    assert set(entry) - set(tuning.META_FIELDS) <= launch_fields
    assert entry == {"fwd": {"num_warps": 8, "num_stages": 3},
                     "bwd": {"num_warps": 4, "num_stages": 2}, "prefetch_rows": True,
                     "split_diagonal": True, "device": "Test GPU", "arch": "sm_90",
                     "jax_version": "0.0", "ms": 1.235}
    out, log = tmp_path / "tuning.json", tmp_path / "log.json"
    other = {"arch": "sm_90", "device": "Test GPU", "jax_version": "0.0", "ms": 2.0}
    out.write_text(json.dumps({"fa2/d64/t1024/causal": other}))
    monkeypatch.setattr(tune, "tune_one", lambda shape, policy, reps, deadline, log, causal: (
        (1.5, launch), [{"shape": list(shape), "policy": policy, "causal": causal}]))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(tuning, "device_arch", lambda: "sm_90")
    tune.main(["--shapes", "4x8192x16x128", "--masks", "causal", "--out", str(out), "--log",
               str(log)])
    table = tuning.load(out)
    assert table["fa2/d128/t8192/causal"] == ("sm_90", launch)
    assert table["fa2/d64/t1024/causal"] == ("sm_90", jf.Launch())
    written = json.loads(out.read_text())["fa2/d128/t8192/causal"]
    assert set(written) - set(tuning.META_FIELDS) <= launch_fields and written["ms"] == 1.5
    assert json.loads(log.read_text()) == [{"shape": [4, 8192, 16, 128], "policy": "fa2",
                                            "causal": True}]
    # by default both masks: an entry without the mask beside the causal one
    tune.main(["--shapes", "4x8192x16x128", "--out", str(out), "--log", str(log)])
    assert set(tuning.load(out)) == {"fa2/d64/t1024/causal", "fa2/d128/t8192/causal",
                                     "fa2/d128/t8192/full"}
    assert [r["causal"] for r in json.loads(log.read_text())] == [True, False]
    with pytest.raises(SystemExit, match="--masks"):
        tune.main(["--masks", "diagonal", "--out", str(out), "--log", str(log)])


def test_plot_series_and_png(tmp_path):
    """The bar chart's numbers are the records' TFLOP/s recomputed from ms (causal shapes only, in
    record order; None where an implementation has no record), and the PNG is written."""
    shapes = [(2, 256, 2, 64), (1, 512, 2, 128)]
    recs = []
    for i, shape in enumerate(shapes):
        for impl, policy, stable, ms in (("jax_flash", "fa2", False, 1.0 + i), ("jax_flash", "fa2", True, 1.5),
                                         ("cudnn", None, None, 0.5)):
            for pss in ("fwd", "fwd+bwd"):
                recs.append(dict(impl=impl, policy=policy, stable=stable, shape=list(shape), causal=True,
                                 ms=ms, tflops=0.0, **{"pass": pss}))
    recs.append(dict(recs[0], causal=False, shape=[9, 9, 9, 9]))  # non-causal: not plotted
    recs.append(dict(recs[1], impl="xla", policy=None, stable=None))  # fwd+bwd, first shape only
    got_shapes, series = bench.plot_series(recs, "fwd+bwd")
    assert got_shapes == shapes
    assert set(series) == {"jax-flash fa2", "jax-flash fa2 stable", "cuDNN", "XLA"}
    for j, shape in enumerate(shapes):
        flops = bench.pass_flops(shape, True, "fwd+bwd")
        assert series["jax-flash fa2"][j] == pytest.approx(flops / (1.0 + j) / 1e9)
        assert series["cuDNN"][j] == pytest.approx(flops / 0.5 / 1e9)
    assert series["XLA"][1] is None
    bench.plot(recs, tmp_path / "b.png", "test")
    assert (tmp_path / "b.png").stat().st_size > 10_000


def test_bwd_pass_is_the_backward_of_fwd_bwd_from_one_forward():
    """The "bwd" pass returns the gradients the "fwd+bwd" pass returns (same cotangent), runs the
    forward once per input however often it is called, and again for new inputs."""
    import numpy as np

    import jax_flash as jf

    forwards = []

    def f(q, k, v):
        forwards.append(1)
        return jf.attention(q, k, v, causal=True, stable=True, impl="jnp")

    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 64, 2, 32)), jnp.bfloat16) for _ in range(3))
    want = bench._jax_pass(f, "fwd+bwd")(q, k, v)
    forwards.clear()
    bwd = bench._jax_pass(f, "bwd")
    for _ in range(3):
        got = bwd(q, k, v)
    assert len(forwards) == 1
    for g, w in zip(got, want):
        # the same gradients up to XLA:CPU fusing the forward alone differently from inside fwd+bwd
        # (seen once: one row of dQ off by a BF16 ulp at its largest entry, 8 of 4,096 elements)
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.mean(g == w) >= 0.98
        np.testing.assert_allclose(g, w, rtol=0, atol=2.0 ** -7 * np.abs(w).max())
    q2 = q + jnp.asarray(rng.standard_normal(q.shape), q.dtype)
    other = bwd(q2, k, v)
    assert len(forwards) == 2 and not np.array_equal(np.asarray(other[0], np.float32),
                                                     np.asarray(got[0], np.float32))
    assert bench.pass_flops((1, 64, 2, 32), True, "bwd") == 2.5 * bench.pass_flops((1, 64, 2, 32), True, "fwd")
    with pytest.raises(ValueError, match="pass"):
        bench._jax_pass(f, "bwd+fwd")


def test_dropin_times_the_hopper_kernels_where_they_cover_the_case(monkeypatch):
    """The drop-in benchmark's implementations: jax-flash (default and stable), cuDNN, XLA, K/V
    repeated by hand for GQA, and — where the plan says the Hopper kernels cover the case — those
    kernels asked for explicitly (here, as on a Hopper GPU; padding lengths they lack)."""
    from jax_flash import api

    q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
    names = lambda window, kk: [(i, s) for i, s, _ in bench._dropin_impls(2, window, 4, q, kk)]
    assert ("jax_flash_mosaic", True) not in names(None, k)  # no Hopper GPU here
    monkeypatch.setattr(api.mosaic_common, "unavailable", lambda: None)
    assert names(None, k) == [("jax_flash", False), ("jax_flash", True), ("jax_flash_mosaic", False),
                              ("jax_flash_mosaic", True), ("cudnn", None), ("xla", None),
                              ("jax_flash_repeat_kv", False)]
    assert ("jax_flash_mosaic", False) in names((63, 0), k)


def test_dropin_file_renders_its_own_table(tmp_path, capsys):
    """--from-json on a --dropin file prints each case's ratios to cuDNN (cases sharing a shape kept
    apart), paired by round."""
    import json

    def rec(case, impl, ms):
        return dict(case=case, shape=[2, 8192, 16, 128], impl=impl, stable=False, causal=True,
                    **{"pass": "fwd"}, ms=ms, rounds_ms=[ms, ms * 1.1], device="Test GPU",
                    jax_version="x")

    path = tmp_path / "d.json"
    path.write_text(json.dumps([rec("window1024", "jax_flash", 0.5), rec("window1024", "cudnn", 0.6),
                                rec("causal_full", "jax_flash", 1.2), rec("causal_full", "cudnn", 1.2)]))
    bench.main(["--from-json", str(path)])
    out = capsys.readouterr().out
    assert "| window1024 | fwd | jax_flash | False | 0.500 | 1.20 (1.20 … 1.20) |" in out
    assert "| causal_full | fwd | jax_flash | False | 1.200 | 1.00 (1.00 … 1.00) |" in out
