"""lab.row_kernels on the CPU (kernels interpreted, tiny shapes): variants parse, every kind builds
and runs, the fused loss kernel's outputs are the two kernels', and the table reads the record."""

import chex
import jax
import jax.numpy as jnp
import pytest

from lab import row_kernels as rk


def test_variants_parse_with_shipped_defaults_for_missing_keys():
    assert rk.parse("ln-bwd") == ("ln-bwd", {})
    assert rk.parse("ln-bwd:sub=2;warps=8") == ("ln-bwd", {"sub": 2, "warps": 8})
    assert rk.parse("ce-fwd:rows=1;warps=1") == ("ce-fwd", {"rows": 1, "warps": 1})


def test_launch_keys_reach_the_kernel_or_fail():
    """A variant's keys become the kernel's arguments, switches as booleans; a key its kind does
    not take fails rather than timing the shipped kernel under the variant's name."""
    assert rk.launch_kwargs("ln-bwd", {"reload": 1, "sub": 2}) == {"reload": True, "sub": 2}
    assert rk.launch_kwargs("gelu-bwd", {"rcp": 0, "ex2": 0}) == {"rcp": False, "ex2": False}
    assert rk.launch_kwargs("ce-fused", {"ex2": 0}) == {"ex2": False}
    for kind, kw in (("ln-fwd", {"reload": 1}), ("gelu-fwd", {"ex2": 0}),
                     ("xla-ln-bwd", {"rows": 8}), ("ce-fwd", {"sub": 2})):
        with pytest.raises(ValueError, match="takes no"):
            rk.launch_kwargs(kind, kw)
    with pytest.raises(ValueError, match="takes no"):
        rk.build("ln-fwd:reload=1", 16)


def test_fused_kernel_is_the_statistics_kernel_and_the_gradient():
    v = 2048 + 128 + 3  # full chunks and remainder pieces, as GPT-2's vocabulary has
    fwd, (logits, targets), n_bytes = rk.build("ce-fwd:rows=2;warps=2", 8, v)
    assert n_bytes == 8 * v * 2
    fused, (_, _, g_rows), _ = rk.build("ce-fused:rows=2;warps=2", 8, v)
    got = fused(logits, targets, g_rows)
    chex.assert_trees_all_equal(got[:3], fwd(logits, targets))
    want = jax.grad(lambda x: jnp.sum(g_rows * (jax.nn.logsumexp(x.astype(jnp.float32), axis=1)
                                             - x[jnp.arange(8), targets].astype(jnp.float32))))
    chex.assert_trees_all_close(got[3].astype(jnp.float32), want(logits).astype(jnp.float32),
                                atol=2.0 ** -8 / 8, rtol=0.0)  # two bf16 roundings below 1/8


def test_run_and_table(capsys):
    ok = ["ln-bwd:sub=4", "ln-bwd:rows=8;sub=2", "xla-ln-bwd", "ln-fwd:rows=16;sub=4",
          "xla-ln-fwd", "gelu-bwd:rows=4"]
    res = rk.run(ok + ["no-such-kind"], tokens=16, rounds=1, reps=1)
    assert [r["variant"] for r in res["records"]] == ok
    assert "no-such-kind" in res["failed"] and res["jax_version"] == jax.__version__
    text = rk.table(res)
    assert "`ln-bwd:sub=4`" in text and "failed" in text


def _res(tokens, ms):
    return {"tokens": tokens, "records": [{"variant": k, "ms": v} for k, v in ms.items()]}


def test_pick_takes_the_best_worst_case_gain_over_every_run():
    runs = [_res(16, {"ln-bwd": 1.0, "ln-bwd:rows=64": 0.80, "ln-bwd:rows=32": 0.85,
                      "ln-fwd": 1.0, "ln-fwd:rows=32": 0.99}),
            _res(32, {"ln-bwd": 2.0, "ln-bwd:rows=64": 1.98, "ln-bwd:rows=32": 1.80,
                      "ln-fwd": 2.0, "ln-fwd:rows=32": 1.99})]
    spec, launch, gains = rk.pick(runs, "ln-bwd")
    assert spec == "ln-bwd:rows=32" and launch["rows"] == 32  # x1.11 worst, not rows=64's x1.01
    assert abs(min(gains) - 1 / 0.9) < 1e-9
    from models import layernorm
    assert launch == {**layernorm.BWD, "rows": 32}
    assert rk.pick(runs, "ln-fwd") is None  # 1 % faster: within the margin


def test_write_constants_rewrites_each_constant_once(tmp_path):
    from pathlib import Path
    src = Path(rk.__file__).resolve().parents[1] / "models" / "layernorm.py"
    dst = tmp_path / "layernorm.py"
    dst.write_text(src.read_text())
    text = rk.write_constants("ln-bwd", dict(rows=64, sub=8, warps=4, stages=3, reload=1), dst)
    for line in ("BWD_BLOCK_ROWS = 64", "BWD_SUB_ROWS = 8", "BWD_NUM_WARPS = 4",
                 "BWD_NUM_STAGES = 3", "BWD_RELOAD = True", "BLOCK_ROWS = 16"):
        assert any(l.startswith(line) for l in text.splitlines()), line


def test_pick_and_write_the_loss_launch(tmp_path):
    """The loss's launch constants are picked like the LayerNorm's; variants that set a
    non-launch key (``ex2``, ``fixup``) are not candidates, however fast."""
    from pathlib import Path
    from models import loss_kernels as lk
    runs = [_res(32, {"ce-fused": 3.39, "ce-fused:warps=16;chunk=8192": 3.20,
                      "ce-fused:warps=8;chunk=4096": 3.29, "ce-fused:ex2=0;warps=16": 1.0})]
    spec, launch, _ = rk.pick(runs, "ce-fused")
    assert spec == "ce-fused:warps=16;chunk=8192"
    assert launch == dict(rows=lk.BLOCK_ROWS, chunk=8192, warps=16, stages=lk.NUM_STAGES)
    dst = tmp_path / "loss_kernels.py"
    dst.write_text((Path(rk.__file__).resolve().parents[1] / "models" / "loss_kernels.py")
                   .read_text())
    text = rk.write_constants("ce-fused", launch, dst).splitlines()
    for line in ("CHUNK = 8192", "NUM_WARPS = 16", f"BLOCK_ROWS = {lk.BLOCK_ROWS}"):
        assert any(l.startswith(line) for l in text), line
