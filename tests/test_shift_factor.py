"""``Config.shift_factor``: the stable shift applied as a per-row factor after exps taken against the
baseline's shift (tile.softmax_update). Equal to the direct form in real arithmetic; rows the shift
leaves alone keep their bits, shifted rows differ by the product's FP32 rounding, and the fix holds:
tied maxima stay below 1 in P̄."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash as jf
from jax_flash import api, jnp_impl, tile
from jax_flash.policy import make_policy

from test_forward_mosaic import (_interpreted, _score_tile, assert_matches_jnp, needs_interpreter,
                                 tied_qkv)

BF16 = jnp.bfloat16


def _cfg(policy="fa2", **kw):
    return tile.Config(policy=make_policy(policy, BF16), causal=False, stable=True, beta=2.0,
                       sm_scale=1.0, delta="o", block_q=16, block_k=32, q_len=16, kv_len=32, **kw)


def test_config_refuses_what_it_cannot_do():
    for policy in ("paper", "paper_fp32acc"):  # their own rounding points for S − m, or a tile-sum floor
        with pytest.raises(ValueError, match="FP32 accumulators"):
            _cfg(policy, shift_factor=True)
    for policy in ("fa2", "fp32", "fa2_sr"):
        assert _cfg(policy, shift_factor=True).shift_factor


@pytest.mark.parametrize("m_old_kind", ["empty", "below", "above"])
def test_tile_update_against_the_direct_form_and_float64(rng, m_old_kind):
    """One tile step with every stable_shift branch (tied r_m > 0, folded, < 0, = 0, untied, empty
    rows): m and α identical; rows whose shift moved nothing bitwise identical; shifted rows' P̄
    within one BF16 ulp of the direct form's and of float64's exp(S − m_new), their ℓ within FP32
    rounding, and their tied entries below 1 — the fix."""
    s = _score_tile(rng)
    bq = s.shape[0]
    r_m = np.asarray(jnp.max(s, axis=1))
    m_old = {"empty": np.full(bq, -np.inf, np.float32),
             "below": np.where(np.isfinite(r_m), r_m - 3.0, -np.inf).astype(np.float32),
             "above": np.where(np.isfinite(r_m), np.abs(r_m) * 1.5 + 1.0, 0.5).astype(np.float32)}[m_old_kind]
    carry = tile.Carry(jnp.asarray(m_old), jnp.asarray(rng.uniform(1, 2, bq), jnp.float32),
                       jnp.zeros((bq, 8), jnp.float32))
    direct, factor = (tile.softmax_update(carry, s, None, _cfg(shift_factor=sf)) for sf in (False, True))
    m_d, l_d, a_d, p_d = (np.asarray(x, np.float64) for x in direct[:4])
    m_f, l_f, a_f, p_f = (np.asarray(x, np.float64) for x in factor[:4])
    np.testing.assert_array_equal(m_f, m_d)
    np.testing.assert_array_equal(a_f, a_d)
    m_base = np.maximum(m_old, r_m)
    shifted = m_d != m_base
    if m_old_kind != "above":
        assert shifted.sum() >= 4  # tied rows > 0, folded, < 0: the factor ran
    np.testing.assert_array_equal(p_f[~shifted], p_d[~shifted])
    np.testing.assert_array_equal(l_f[~shifted], l_d[~shifted])
    if not shifted.any():
        return
    eps = float(jnp.finfo(BF16).eps)
    exact = np.exp2(np.asarray(s, np.float64)[shifted] - m_d[shifted, None])
    for p in (p_f[shifted], p_d[shifted]):
        assert np.all(np.abs(p - exact) <= eps * exact + 1e-30)
    assert np.all(np.abs(p_f[shifted] - p_d[shifted]) <= eps * np.abs(p_d[shifted]))
    np.testing.assert_allclose(l_f[shifted], l_d[shifted], rtol=4 * 2.0 ** -23)
    tied = np.asarray(s)[shifted] >= r_m[shifted, None] - 1e-3
    assert np.all(p_f[shifted][tied] < 1.0) and np.all(np.isfinite(p_f))


@pytest.mark.parametrize("causal", [True, False])
def test_executor_rows_the_shift_leaves_alone_keep_their_bits(rng, causal):
    """Random inputs (few near-ties): every row whose O and L the direct stable form leaves as the
    unshifted forward's has bitwise the same O and L under the factor form."""
    q, k, v = (jnp.asarray(rng.standard_normal((1, 50, 2, 32)), BF16) for _ in range(3))
    cfg, _ = api._make_config(q, k, v, causal=causal, stable=True, beta=2.0, sm_scale=None,
                              policy="fa2", delta="o", impl="jnp", block_q=16, block_k=16)
    (o_b, l_b), (o_d, l_d), (o_f, l_f) = (
        (np.asarray(o, np.float64), np.moveaxis(np.asarray(l, np.float64)[:, :, :50], 1, 2))  # L: [B, T, H]
        for _, o, l in (api._forward(q, k, v, c, "jnp") for c in (
            dataclasses.replace(cfg, stable=False), cfg, dataclasses.replace(cfg, shift_factor=True))))
    alone = np.all(o_d == o_b, axis=-1) & (l_d == l_b)
    assert alone.mean() >= 0.9
    np.testing.assert_array_equal(o_f[alone], o_d[alone])
    np.testing.assert_array_equal(l_f[alone], l_d[alone])


@pytest.mark.parametrize("score", [8.0, 40.0])
def test_executor_on_tied_rows_is_as_accurate(rng, score):
    """Tied rows (score 40: the guard folds the shift): O within 2 BF16 ulps of the row's largest output
    and L within FP32 rounding of the direct form, both as accurate against float64."""
    q, k, v = tied_qkv(rng, (1, 128, 2, 64), score=score, pairs=((3, 5), (70, 90)))
    cfg, _ = api._make_config(q, k, v, causal=True, stable=True, beta=2.0, sm_scale=None,
                              policy="fa2", delta="o", impl="jnp", block_q=32, block_k=32)
    o_d, l_d = (np.asarray(x, np.float64) for x in jnp_impl.forward(q, k, v, cfg))
    o_f, l_f = (np.asarray(x, np.float64)
                for x in jnp_impl.forward(q, k, v, dataclasses.replace(cfg, shift_factor=True)))
    o_b = np.asarray(jnp_impl.forward(q, k, v, dataclasses.replace(cfg, stable=False))[0], np.float64)
    assert np.any(o_f != o_b)  # the shift moved rows (their outputs took another rounding)
    row = np.abs(o_d).max(-1, keepdims=True)
    assert np.all(np.abs(o_f - o_d) <= 2.0 ** -7 * row)
    np.testing.assert_allclose(l_f, l_d, rtol=2.0 ** -20, atol=2.0 ** -20)
    ref = jf.reference_numpy(q, k, v, causal=True)
    err_d, err_f = (np.linalg.norm(o - ref) / np.linalg.norm(ref) for o in (o_d, o_f))
    assert err_f <= 1.05 * err_d + 1e-6


@needs_interpreter
@pytest.mark.parametrize("block_k", [64, 128])
def test_interpreted_kernel_matches_the_executor(rng, block_k):
    """The Mosaic GPU forward, interpreted, with the factor form: O and L as the jnp executor's under
    the same Config."""
    shape = (1, 256, 1, 128)
    q, k, v = tied_qkv(rng, shape, score=20.0, pairs=((3, 5), (130, 140)))
    cfg = tile.Config(policy=make_policy("fa2", BF16), causal=True, stable=True, beta=2.0,
                      sm_scale=128 ** -0.5, delta="o", block_q=64, block_k=block_k, q_len=256,
                      kv_len=256, shift_factor=True)
    o, lse = _interpreted(q, k, v, cfg)
    oj, lj = jnp_impl.forward(q, k, v, cfg)
    oj = np.asarray(jnp.asarray(oj).astype(BF16), np.float32)
    assert_matches_jnp(o, lse, oj, lj)


@needs_interpreter
def test_factor_form_lowers_for_the_gpu():
    """The factor form compiles for the GPU (jax.export for CUDA on a CPU: the kernel's per-thread
    module): the same compare-select-add count per entry as the direct form, plus the factor's multiply
    of every entry (64 per thread of a 64×128 tile, in each of the causal kernel's two loop bodies)."""
    from experiments import mosaic_ops

    shape = (1, 256, 1, 128)
    direct, factor = (mosaic_ops.op_counts(shape, **mosaic_ops.VARIANTS[n])
                      for n in ("stable-k128", "stable-k128+sf"))
    for op in ("arith.cmpf", "arith.addf"):
        assert factor[op] >= direct[op]
    assert factor["arith.mulf"] - direct["arith.mulf"] >= 2 * 32  # 2-wide vectors: 32 per body


def test_triton_kernel_interpreted_matches_the_executor(rng):
    """The Triton forward (interpret mode) runs the same factor form as the jnp executor: O and L
    as the executor's up to last bits, on tied rows."""
    q, k, v = tied_qkv(rng, (1, 96, 2, 32), score=20.0, pairs=((3, 5), (40, 70)))
    cfg, _ = api._make_config(q, k, v, causal=True, stable=True, beta=2.0, sm_scale=None,
                              policy="fa2", delta="o", impl="pallas", block_q=32, block_k=32)
    cfg = dataclasses.replace(cfg, shift_factor=True)
    (_, o_p, l_p), (_, o_j, l_j) = (api._forward(q, k, v, cfg, impl) for impl in ("pallas", "jnp"))
    o_p, o_j = np.asarray(o_p, np.float64), np.asarray(o_j, np.float64)
    assert np.mean(o_p == o_j) >= 0.99
    assert np.all(np.abs(o_p - o_j) <= 2.0 ** -7 * np.abs(o_j).max(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(l_p), np.asarray(l_j), rtol=1e-6, atol=1e-5)
