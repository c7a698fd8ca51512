"""lab.row_kernels on the CPU (kernels interpreted, tiny shapes): variants parse, every kind builds
and runs, the fused loss kernel's outputs are the two kernels', and the table reads the record."""

import chex
import jax
import jax.numpy as jnp

from lab import row_kernels as rk


def test_variants_parse_with_shipped_defaults_for_missing_keys():
    assert rk.parse("ln-bwd") == ("ln-bwd", {})
    assert rk.parse("ln-bwd:sub=2;warps=8") == ("ln-bwd", {"sub": 2, "warps": 8})
    assert rk.parse("ce-fwd:rows=1;warps=1") == ("ce-fwd", {"rows": 1, "warps": 1})


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
