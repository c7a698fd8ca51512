"""models/loss_kernels.py: the cross-entropy's Pallas kernels (interpret mode here) against float64,
within bounds derived from their FP32 arithmetic, and wired into the model as
``GPTConfig.cross_entropy = "pallas"``."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_pallas_cross_entropy_within_bound, half_ulp
from models import gpt2
from models import loss_kernels as lk


def _logits(seed, rows, v, dtype, scale=4.0):
    """Logits with the cases the walk meets: a row of ties, a row spanning ±60, a row whose
    max sits in the last remainder piece, and −inf entries (a masked vocabulary)."""
    rng = np.random.default_rng(seed)
    x = scale * rng.standard_normal((rows, v))
    x[0] = 1.5  # every entry the max
    x[1] *= 15.0
    x[2, -1] = 40.0
    x[3, : v // 3] = -np.inf
    t = rng.integers(0, v, rows)
    t[4], t[5], t[3] = 0, v - 1, v // 2
    return jnp.asarray(x, dtype), jnp.asarray(t, jnp.int32)


@pytest.mark.parametrize("v,dtype", [(2048 + 64 + 3, jnp.bfloat16), (1000, jnp.float32)])
def test_pallas_cross_entropy_within_its_bound(v, dtype):
    """Row statistics, loss and gradient of the kernels against float64 on the same logits (bf16,
    as the model's under ``logits_dtype="bfloat16"``, or FP32), each within the bound
    ``helpers.cross_entropy_bounds`` derives (the gradient after its rounding to the logits'
    dtype); the target's logit exact; the gradient in the logits' dtype
    (``helpers.assert_pallas_cross_entropy_within_bound``)."""
    assert_pallas_cross_entropy_within_bound(*_logits(v, 16, v, dtype))


def test_training_forward_is_the_statistics_kernel_and_scales_its_gradient():
    """The training forward writes the gradient for a cotangent of 1 beside the statistics: its
    loss is bit-identical to the statistics kernel's alone; at another cotangent the gradient is
    that one scaled with one more rounding to the logits' dtype (within half an ulp, or flushed to
    zero below FP32's normal range)."""
    x, t = _logits(5, 16, 2048 + 64 + 3, jnp.bfloat16)
    f = lambda x, c: c * lk.cross_entropy(x, t)
    (l1, g1), (l2, g2) = (jax.jit(jax.value_and_grad(f))(x, c) for c in (1.0, 0.375))
    chex.assert_trees_all_equal(l1, jax.jit(lk.cross_entropy)(x, t))
    chex.assert_trees_all_equal(l2, 0.375 * l1)
    chex.assert_type(g2, jnp.bfloat16)
    want = 0.375 * np.asarray(g1, np.float64)
    flush = np.where(np.abs(want) < 2.0 ** -126, 2.0 ** -126, 0.0)  # FP32 products flush to zero
    assert np.all(np.abs(np.asarray(g2, np.float64) - want) <= half_ulp(want, x.dtype) + flush)


@pytest.mark.parametrize("rows", [1, 4])
def test_target_fixup_changes_no_bit(rows):
    """``TARGET_FIXUP``: the gradient's walk without the target's compare and select, each row's
    target entry written again after it, gives the masked walk's statistics and gradient bit for
    bit, targets at the first column, the last and inside the remainder piece."""
    v = 2048 + 64 + 3
    x, t = _logits(11, 16, v, jnp.bfloat16)
    t = t.at[:3].set(jnp.asarray([0, v - 1, v - 10], jnp.int32))
    g = jnp.full((16,), 1.0 / 16, jnp.float32)
    run = lambda fixup: lk.row_stats_and_grad(x, t, g, rows=rows, fixup=fixup)
    chex.assert_trees_all_equal(run(True), run(False))


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_target_logit_is_the_logit_at_any_rows_per_program(rows):
    """The kernels read each row's target logit alone (one gathered element a row): exactly the
    logit, in both kernels, whichever row of a program's block it sits in."""
    x, t = _logits(7, 16, 1000, jnp.bfloat16)
    want = jnp.asarray(np.asarray(x, np.float32)[np.arange(16), np.asarray(t)])
    g = jnp.full((16,), 1.0 / 16, jnp.float32)
    chex.assert_trees_all_equal(lk.row_stats(x, t, rows=rows)[2], want)
    chex.assert_trees_all_equal(lk.row_stats_and_grad(x, t, g, rows=rows)[2], want)


def test_pieces_cover_the_vocabulary():
    """The walk's chunk widths are powers of two that add up to the vocabulary, largest first."""
    for v in (1, 7, 128, 1000, 1024, 50257, 50304):
        c, n, rest = lk.pieces(v)
        widths = [c] * n + list(rest)
        assert sum(widths) == v and all(w & (w - 1) == 0 for w in widths)
        assert widths == sorted(widths, reverse=True) and c <= lk.CHUNK
    assert lk.pieces(50304, 1024) == (1024, 49, (128,))
    assert lk.pieces(50304, 8192) == (8192, 6, (1024, 128))


def test_model_option_selects_the_kernels():
    """``cross_entropy="pallas"`` reaches the training loss: the loss of a small model under it is
    the kernels' on the model's logits, and a value outside the choices is refused."""
    from flax import nnx

    from train.gpt2 import loss_fn, split_model

    cfg = gpt2.GPTConfig(vocab_size=96, block_size=16, n_layer=1, n_head=2, n_embd=32,
                         logits_dtype="bfloat16", cross_entropy="pallas")
    model = gpt2.GPT(cfg, rngs=nnx.Rngs(0))
    idx = jax.random.randint(jax.random.key(1), (2, 17), 0, 96)
    graphdef, params = split_model(model)
    got = jax.jit(loss_fn, static_argnums=1)(params, graphdef, idx[:, :-1], idx[:, 1:])
    want = jax.jit(lambda p, x, y: lk.cross_entropy(nnx.merge(graphdef, p)(x), y))(
        params, idx[:, :-1], idx[:, 1:])
    chex.assert_trees_all_equal(got, want)
    with pytest.raises(ValueError, match="cross_entropy"):
        dataclasses.replace(cfg, cross_entropy="fused")
