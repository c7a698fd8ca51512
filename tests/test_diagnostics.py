"""jax_flash/diagnostics.py, the kernel-level part (the training instrumentation is tested with the
probes in tests/test_probes.py): the tied-row generator, the signed-error statistics and the stored
O and δ the backward works with."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import BF16, f64, make_qkv
from jax_flash import diagnostics


def test_tied_rows_have_bitwise_tied_maxima(rng):
    q, k, v = diagnostics.tied_rows(rng, 64, kv_len=48, head_dim=32, ties=3)
    chex.assert_shape([q, k, v], [(64, 1, 1, 32), (64, 48, 1, 32), (64, 48, 1, 32)])
    qb, kb = (np.asarray(jnp.asarray(x, BF16), np.float64) for x in (q, k))
    s = np.einsum("nqhd,nkhd->nk", qb, kb)
    assert np.all((s == s.max(1, keepdims=True)).sum(1) == 3)
    top = s.max(1) / np.sqrt(32)
    assert np.all((top > 5.5) & (top < 10.5))  # r_m ~ U(6, 10), up to BF16 rounding of q, k


def test_signed_error_stats():
    err = np.array([[1.0, 3.0], [2.0, 2.0], [3.0, 1.0], [0.0, 4.0]])  # per-instance means 2, 2, 2, 2
    mean, t, mean_abs = diagnostics.signed_error_stats(err + np.array([[0.0], [0.5], [-0.5], [0.0]]))
    assert mean == 2.0 and mean_abs == 2.0
    assert t == pytest.approx(2.0 / (np.std([2, 2.5, 1.5, 2], ddof=1) / 2))


@pytest.mark.parametrize("impl,delta", [("pallas", "o"), ("jnp", "dpp"),
                                        pytest.param("jnp", "o", marks=pytest.mark.slow),
                                        pytest.param("pallas", "dpp", marks=pytest.mark.slow)])
def test_stored_o_and_delta(rng, assert_close, impl, delta):
    """The O the backward keeps (the policy's residual dtype) is attention's own; δ for "o" is the
    FP32 rowsum(dO∘O_stored) bitwise, "dpp" the same quantity within FP32 sums of the absolute
    terms ((T + d + 4)·2⁻²⁴·Σ|dO||O|-sized, plus O's BF16 storage: u·Σ|dO||O|)."""
    import jax_flash as jf

    q, k, v, do = make_qkv(rng, (1, 24, 2, 32), n=4)
    kw = dict(impl=impl, block_q=16, block_k=16, delta=delta)
    o_st, dlt = diagnostics.flash_stored_o_and_delta(q, k, v, do, **kw)
    chex.assert_shape(dlt, (1, 2, 24))
    chex.assert_trees_all_equal(o_st, jf.attention(q, k, v, **kw))
    rowsum = f64(diagnostics.rowsum_delta(do, o_st))
    if delta == "o":
        chex.assert_trees_all_equal(f64(dlt), rowsum)
    else:
        size = np.einsum("bthd,bthd->bht", np.abs(f64(do)), np.abs(f64(o_st)))
        bound = ((24 + 32 + 4) * 2.0 ** -24 + 2.0 ** -8) * size * 2
        assert_close(dlt, rowsum, bound, "δ")
