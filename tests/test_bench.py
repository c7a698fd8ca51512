"""The benchmark's plumbing on CPU (records, tables, memory analysis) — speed itself is measured on the
GPU by `python -m bench.attention`, never asserted in tests."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import ab
from bench import attention as bench

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


def test_records_name_the_kernels_the_table_chose(monkeypatch):
    """On a Hopper GPU under jax 0.11 the tuning table's "fwd_kernel" and "bwd_kernel" decide; a
    record says which ran."""
    from jax_flash import api
    from jax_flash.pallas import backward_mosaic as bm
    from jax_flash.pallas import forward_mosaic as fm
    from jax_flash.pallas import mosaic_common, tuning

    class Dev:
        compute_capability = "9.0"

    monkeypatch.delenv(fm.ENV_VAR, raising=False)
    monkeypatch.delenv(bm.ENV_VAR, raising=False)
    monkeypatch.setattr(api.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(fm.jax, "devices", lambda: [Dev()])
    monkeypatch.setattr(fm.jax, "__version__", mosaic_common.TESTED_JAX + "2")
    q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    mosaic = {"block_q": 64, "block_k": 64, "fwd_kernel": "mosaic", "bwd_kernel": "mosaic"}
    with tuning.override(mosaic):
        assert bench.kernels(q, True, "fa2", True) == {"fwd_kernel": "mosaic"}
        assert bench.kernels(q, True, "fa2", True, "fwd+bwd") == {"fwd_kernel": "mosaic",
                                                                   "bwd_kernel": "mosaic"}
        # not covered: "fa2" only
        assert bench.kernels(q, True, "paper", False, "fwd+bwd") == {"fwd_kernel": "triton",
                                                                      "bwd_kernel": "triton"}
    with tuning.override({**mosaic, "bwd_kernel": "mosaic_dkdv"}):
        assert bench.kernels(q, True, "fa2", False, "fwd+bwd")["bwd_kernel"] == "mosaic_dkdv"
    # no entry for this shape
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


def test_per_round_times_pair_the_variants(monkeypatch):
    """``per_round`` receives each round's time per fn (on a fake clock: a fn that takes 2 units
    against one that takes 1 reads ×2 in every round, in both sync modes), and
    ``bench.ab.paired_ratio`` turns paired rounds into a median ratio with an interval that holds it;
    records without per-round times are refused."""
    from bench import ab

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
    records = [dict(variant=v, shape=[4, 8192, 16, 128], **{"pass": "fwd+bwd"}, rounds_ms=list(t))
               for v, t in (("new", base), ("new:stable", base * 1.025 * (1 + rng.normal(0, 1e-3, 20))))]
    med, (lo, hi), n = ab.paired_ratio(records, "new:stable", "new", (4, 8192, 16, 128), "fwd+bwd")
    assert n == 20 and lo <= med <= hi and abs(med - 1.025) < 2e-3 and hi - lo < 4e-3
    assert "×1.02" in ab.ratio_lines(records, "new:stable", "new")
    with pytest.raises(KeyError):
        ab.paired_ratio([{k: v for k, v in r.items() if k != "rounds_ms"} for r in records],
                        "new:stable", "new", (4, 8192, 16, 128), "fwd+bwd")


def test_memory_grows_linearly_for_flash_quadratically_for_xla():
    """Compiled fwd+bwd temp memory from T = 2048 to 4096: XLA's softmax attention holds B·H·T² scores
    (×4), the flash executor only tiles (×2). Measured: flash 10.0 → 20.1 MiB, XLA 98 → 388 MiB."""
    mem = bench.memory([2048, 4096], heads=2, head_dim=32, log=lambda _: None)
    temp = {(m["impl"], m["shape"][1]): m["temp_bytes"] for m in mem}
    assert temp["jax_flash", 4096] / temp["jax_flash", 2048] < 2.5
    assert temp["xla", 4096] / temp["xla", 2048] > 3.5
    quadratic = [m["quadratic_bytes"] for m in mem if m["shape"][1] == 4096][0]
    assert temp["xla", 4096] >= quadratic > 4 * temp["jax_flash", 4096]


def test_tuning_table_reaches_the_kernel_config(monkeypatch):
    """An entry of jax_flash/pallas/tuning.json (here an override, as the tuner sets) chooses the GPU
    kernels' tiles and launch parameters; user-given block sizes still win; off the GPU it is unused."""
    import jax.numpy as jnp

    from jax_flash.api import _make_config
    from jax_flash.pallas import tuning

    x = jnp.zeros((1, 1000, 2, 64), jnp.bfloat16)
    kw = dict(causal=True, stable=False, beta=2.0, sm_scale=None, policy="fa2", delta="o",
              impl="pallas", block_q=None, block_k=None)
    entry = {"block_q": 128, "block_k": 32, "fwd": {"num_warps": 8, "num_stages": 3},
             "bwd": {"num_warps": 4, "num_stages": 2}, "split_diagonal": True,
             "dq": {"num_warps": 8, "num_stages": 3}, "dq_block": 256}
    assert tuning.key("fa2", 64, 1000, True) == "fa2/d64/t1024/causal"
    with tuning.override(entry):
        cpu_cfg, _ = _make_config(x, x, x, **kw)
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        cfg, impl = _make_config(x, x, x, **kw)
        user, _ = _make_config(x, x, x, **{**kw, "block_k": 64})
    assert (cpu_cfg.block_q, cpu_cfg.block_k, cpu_cfg.fwd_launch) == (64, 64, None)
    assert impl == "pallas" and (cfg.block_q, cfg.block_k) == (128, 32)
    assert cfg.fwd_launch == (8, 3) and cfg.bwd_launch == (4, 2)
    assert cfg.dq_launch == (8, 3) and cfg.dq_block == 256 and cfg.bwd_block is None
    assert cfg.split_diagonal and not cpu_cfg.split_diagonal
    assert user.block_k == 64


def test_shipped_ab_entries_build_their_configs(monkeypatch):
    """Every entry of bench/entries-*.json (the next GPU session's A/B variants) is a valid tuning
    entry: its launches and resident blocks reach the Config and fit a 4×8192×16×128 call."""
    import dataclasses
    import glob
    import importlib

    from jax_flash.api import _make_config
    from jax_flash.pallas import tuning

    bwd = importlib.import_module("jax_flash.pallas.backward")
    files = glob.glob("bench/entries-*.json")
    assert files
    x = jax.ShapeDtypeStruct((4, 8192, 16, 128), jnp.bfloat16)
    kw = dict(causal=True, stable=False, beta=2.0, sm_scale=None, policy="fa2", delta="o",
              impl="pallas", block_q=None, block_k=None)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for f in files:
        for name, entry in json.load(open(f)).items():
            with tuning.override(entry):
                cfg, impl = _make_config(x, x, x, **kw)
            assert impl == "pallas", name
            # a numerics-neutral switch must reach the Config, or its A/B times the entry without it
            assert cfg.tie_count_int == bool(entry.get("tie_count_int")), name
            assert cfg.shift_factor == bool(entry.get("shift_factor")), name
            assert cfg.tie_top2 == bool(entry.get("tie_top2")), name
            assert cfg.exp2_ftz == bool(entry.get("exp2_ftz")), name
            assert cfg.scale_late == bool(entry.get("scale_late")), name
            if "dq" in entry:
                assert cfg.dq_launch == (entry["dq"]["num_warps"], entry["dq"]["num_stages"]), name
            for field in ("bwd_block", "dq_block"):
                if field in entry:
                    block = getattr(cfg, field)
                    assert bwd.resident_block(dataclasses.replace(cfg, bwd_block=block), 8192, 8192) \
                        == entry[field], (name, field)


def test_default_launch_without_a_table_entry():
    from jax_flash.pallas.common import default_launch

    # the tuned winners of 2026-11-29 (PERF_NOTES v7): 4 warps for 64×64 tiles in every kernel
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
            rec("cudnn", "fwd+bwd", 1.6), rec("jax_pallas_mha", "fwd+bwd", 3.0)]
    table = bench.targets(recs)
    assert "| 32×1024×12×64 | 0.80× | 1.50× | +5.0 % | +50.0 % | — |" in table
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


def test_tune_one_control_flow_on_cpu(monkeypatch):
    """bench.tune's search on a tiny shape with one tile pair and one launch (the kernels run
    interpreted, so the times mean nothing here): forward launch, then backward launch, then the
    finalist without and with split_diagonal in three interleaved rounds; every trial is logged and
    the result is one of them."""
    import time

    from bench import tune

    monkeypatch.setattr(tune, "TILES", {"fa2": [(16, 16)]})
    monkeypatch.setattr(tune, "LAUNCHES", [(4, 2)])
    best, trials = tune.tune_one((1, 32, 1, 16), "fa2", 1, time.time() + 600, lambda *a: None)
    assert [t["pass"] for t in trials] == ["fwd"] + ["fwd+bwd"] * 7
    assert [t.get("split_diagonal") for t in trials[2:]] == [False, True] * 3
    assert [t.get("round") for t in trials[2:]] == [0, 0, 1, 1, 2, 2]
    ms, entry = best
    assert entry["block_q"] == entry["block_k"] == 16 and entry["bwd"]["num_warps"] == 4
    rounds = [t["ms"] for t in trials[2:] if t["split_diagonal"] == entry["split_diagonal"]]
    assert ms == sorted(rounds)[1]  # the median of its three rounds


def test_tune_ranks_finalists_by_median_not_by_a_lucky_timing(monkeypatch):
    """Scripted times: the search's one-shot winner and a split_diagonal variant with one lucky
    round lose to the candidate whose median over the interleaved rounds is lowest."""
    import time

    from bench import tune
    from jax_flash.pallas import tuning

    monkeypatch.setattr(tune, "TILES", {"fa2": [(16, 16), (32, 16)]})
    monkeypatch.setattr(tune, "LAUNCHES", [(4, 2)])
    script = {  # (block_q, split_diagonal) -> fwd+bwd times in the final rounds
        (16, False): iter([2.0, 2.1, 1.9]), (16, True): iter([0.5, 3.0, 3.1]),
        (32, False): iter([2.5, 2.6, 2.4]), (32, True): iter([2.7, 2.8, 2.9])}

    def fake_timed(fn, args, reps):
        entry = tuning._OVERRIDE[-1]
        if "bwd" not in entry:
            return 1.0
        if "split_diagonal" not in entry:  # the search: block_q 32 looks best in one shot
            return 1.0 if entry["block_q"] == 32 else 1.5
        return next(script[(entry["block_q"], entry["split_diagonal"])])

    monkeypatch.setattr(tune, "_timed", fake_timed)
    (ms, entry), trials = tune.tune_one((1, 32, 1, 16), "fa2", 1, time.time() + 600, lambda *a: None)
    assert (entry["block_q"], entry["split_diagonal"], ms) == (16, False, 2.0)
    assert len([t for t in trials if "round" in t]) == 12


def test_kernel_isa_counts_per_entry():
    """The PTX scan attributes instructions to the kernel whose body holds them, and counts only the
    MMA itself (not the fences and commits around a wgmma)."""
    from experiments.gpu.kernel_isa import isa_counts

    ptx = """
.version 8.4
.target sm_90a
.visible .entry jax_flash_fwd_fa2(
    .param .u64 p0
)
{
    wgmma.fence.sync.aligned;
    wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, 1, 1, 1, 0, 0;
    wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1}, %rd3, %rd4, 1, 1, 1, 0, 0;
    wgmma.commit_group.sync.aligned;
    ex2.approx.f32 %f2, %f3;
}
.visible .entry jax_flash_dkdv_fa2(
    .param .u64 p0
)
{
    ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r1, %r2, %r3, %r4}, [%r5];
    mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f2};
}
"""
    got = isa_counts(ptx)
    assert got == {
        "jax_flash_fwd_fa2": {"wgmma": 2, "mma_sync": 0, "ldmatrix": 0, "ex2": 1},
        "jax_flash_dkdv_fa2": {"wgmma": 0, "mma_sync": 1, "ldmatrix": 1, "ex2": 0},
    }
    assert isa_counts("no entries here") == {}
    # LLVM IR, where Triton writes the MMAs as inline PTX
    ll = """
define ptx_kernel void @jax_flash_dq_fa2(ptr addrspace(1) %0) {
  %r = tail call { float } asm sideeffect "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 ...", "=f"()
  ret void
}
define internal void @helper() {
  ret void
}
"""
    assert isa_counts(ll) == {
        "jax_flash_dq_fa2": {"wgmma": 1, "mma_sync": 0, "ldmatrix": 0, "ex2": 0},
        "helper": {"wgmma": 0, "mma_sync": 0, "ldmatrix": 0, "ex2": 0},
    }


def test_ab_times_an_archived_revision_beside_the_working_tree(tmp_path):
    """bench.ab imports `jax_flash/` of a git revision as its own package (not the working tree's
    modules under another name) and times every variant of one case in one interleaved run."""
    import jax_flash

    root = ab.prepare("HEAD", out=tmp_path / "rev")
    old = ab.load_old(root, name="jax_flash_ab_probe")
    assert old.__file__.startswith(str(tmp_path)) and old.tile is not jax_flash.tile
    assert old.tile.__name__ == "jax_flash_ab_probe.tile"
    entries = {"t16": {"block_q": 16, "block_k": 16}}
    variants = ["old", "new", "new:stable", "new@t16:stable"]
    recs = ab.run(root, [(1, 64, 2, 32)], ["fwd+bwd"], variants, rounds=2, reps=1,
                  entries=entries, log=lambda _: None, out=tmp_path / "ab.json")
    assert [(r["variant"], r["impl"], r["stable"]) for r in recs] == [
        ("old", "jax_flash@old", False), ("new", "jax_flash@new", False),
        ("new:stable", "jax_flash@new", True), ("new@t16:stable", "jax_flash@new", True)]
    assert all(KEYS <= set(r) and r["ms"] > 0 for r in recs)
    assert len(json.loads((tmp_path / "ab.json").read_text())) == 4
    table = ab.markdown([("run1", recs)])
    assert table.splitlines()[0] == "| run | shape | pass | old | new | new:stable | new@t16:stable |"
    assert "| run1 | 1×64×2×32 | fwd+bwd | " in table and "(×1.000)" in table
    assert ab.parse_variant("mgpu") == ("mgpu", None, False)
    for bad in ("new:fast", "newer", "cudnn@t16", "mgpu:stable"):
        with pytest.raises(ValueError):
            ab.parse_variant(bad)
    with pytest.raises(KeyError):
        ab.run(root, [(1, 64, 2, 32)], ["fwd"], ["new@nope"], rounds=1, reps=1)


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

    rng = np.random.default_rng()
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
