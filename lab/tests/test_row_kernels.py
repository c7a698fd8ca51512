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
    res = rk.run(["ln-bwd:sub=4", "xla-ln-bwd", "no-such-kind"], tokens=16, rounds=1, reps=1)
    assert [r["variant"] for r in res["records"]] == ["ln-bwd:sub=4", "xla-ln-bwd"]
    assert "no-such-kind" in res["failed"] and res["jax_version"] == jax.__version__
    text = rk.table(res)
    assert "`ln-bwd:sub=4`" in text and "failed" in text


def test_gelu_lane_is_within_a_bf16_ulp_of_the_model_erf_form():
    """The lane's kernels (interpreted) against XLA's erf form: another FP32 erf, so not bit for
    bit, but the bf16 results at most one ulp apart on every bf16 input in [−8, 8], plus in the
    negative tail, where 1 + erf cancels, a few FP32 ulps of 1 times |x| (either erf's error)."""
    import jax.numpy as jnp
    import numpy as np

    from lab import gelu_lane

    h = np.arange(-8.0, 8.0, 2.0 ** -7, dtype=np.float32)
    h = jnp.asarray(h[: h.size // 1024 * 1024].reshape(-1, 1024), jnp.bfloat16)
    g = jnp.ones_like(h)
    fwd, bwd = gelu_lane.xla_pair()
    for got, want in ((gelu_lane.gelu(h, rows=1), fwd(h)),
                      (gelu_lane.gelu_input_grad(h, g, rows=1), bwd(h, g))):
        a, b = (np.asarray(x, np.float64) for x in (got, want))
        ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(b), 2.0 ** -126))) - 7)
        tail = np.abs(np.asarray(h, np.float64)) * 2.0 ** -21
        assert np.all(np.abs(a - b) <= ulp + tail)
