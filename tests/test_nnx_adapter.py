"""jax_flash.nnx_dot_product_attention as nnx.MultiHeadAttention's attention_fn: the same outputs and
parameter gradients as nnx's default attention (float32), nnx's masks, dtype, is_causal, extra batch
axes, GQA; dropout and weight sowing refused."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

import jax_flash as jf  # noqa: E402
from helpers import rel  # noqa: E402

F32_REL = 2e-5  # as tests/test_dot_product_attention.py: FP32 sums over ≤ 64 terms stay below 1e-6


def mha(attention_fn=None, **kw):
    extra = {} if attention_fn is None else dict(attention_fn=attention_fn)
    kw = dict(dict(decode=False), **kw)
    return nnx.MultiHeadAttention(num_heads=4, in_features=32, qkv_features=64, rngs=nnx.Rngs(0),
                                  **extra, **kw)


FLASH = functools.partial(jf.nnx_dot_product_attention, stable=True, block_q=16, block_k=16)


_RUNS = {}


def _loss_and_grads(module, x, **call):
    """The module's output and its parameters' gradients, compiled once per call signature (the
    mask an argument): a sweep's seeds reuse it."""
    mask = call.pop("mask", None)
    key = (tuple(sorted(call.items())), mask is None)
    if key not in _RUNS:
        @nnx.jit
        def run(m, x, mask):
            weights = jnp.cos(jnp.arange(x.shape[-1], dtype=jnp.float32))
            kw = dict(call, mask=mask) if mask is not None else call
            out = m(x, **kw)
            return out, nnx.grad(lambda m: jnp.sum(m(x, **kw) * weights))(m)

        _RUNS[key] = run
    return _RUNS[key](module, x, mask)


def _by_name(state):
    """{(module, parameter): array} of a gradient state."""
    return {tuple(str(getattr(p, "key", getattr(p, "name", p))) for p in path
                  if not getattr(p, "name", None) == "value"): np.asarray(x)
            for path, x in jax.tree_util.tree_leaves_with_path(state)}


@pytest.mark.parametrize("masking", ["padding_and_causal_float", "is_causal"])
def test_multihead_attention_matches_nnx_default(rng, record_bound, masking):
    """Forward and every parameter gradient within the float32 bound of nnx's default attention.
    The padding mask leaves the padded query rows with no key: both give them the mean of V."""
    x = jnp.asarray(rng.standard_normal((2, 21, 32)), jnp.float32)
    call = {}
    if masking == "is_causal":
        call = dict(is_causal=True)
    else:
        tokens = jnp.asarray(np.arange(21)[None, :] < np.array([[21], [13]]), jnp.float32)
        mask = nnx.combine_masks(nnx.make_attention_mask(tokens, tokens),  # float32 0/1
                                 nnx.make_causal_mask(tokens))
        call = dict(mask=mask)
    want_o, want_g = _loss_and_grads(mha(), x, **call)
    got_o, got_g = _loss_and_grads(mha(FLASH), x, **call)
    record_bound(rel(got_o, want_o), F32_REL, "O")
    # the key projection's bias adds q·b to every score of a row: its exact gradient is 0, and
    # both sides return rounding noise, bounded by the key kernel's gradient times F32_REL
    got, want = _by_name(got_g), _by_name(want_g)
    assert got.keys() == want.keys()
    floor = F32_REL * float(np.linalg.norm(want[("key", "kernel")]))
    for name in want:
        if name == ("key", "bias"):
            record_bound(max(np.linalg.norm(got[name]), np.linalg.norm(want[name])), floor,
                         "key bias gradient")
        else:
            record_bound(rel(got[name], want[name]), F32_REL, "gradients")


def _direct_grads(fn, q, k, v, bias, mask, do):
    o, vjp = jax.vjp(lambda q, k, v, b: fn(q, k, v, bias=b, mask=mask), q, k, v, bias)
    return (o,) + vjp(do)


_DIRECT = jax.jit(_direct_grads, static_argnums=0)


def test_extra_batch_axes_gqa_and_bool_mask_match_nnx(rng, record_bound):
    """Called directly: two batch axes, 4 query heads on 2 key/value heads, a boolean mask
    broadcast over heads and a bias, against nnx.dot_product_attention."""
    q = jnp.asarray(rng.standard_normal((2, 3, 17, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 3, 23, 2, 16)), jnp.float32) for _ in range(2))
    mask = jnp.asarray(rng.random((2, 3, 1, 17, 23)) < 0.8)
    bias = jnp.asarray(rng.standard_normal((2, 3, 4, 17, 23)), jnp.float32)
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    for what, a, b in zip(("O", "dQ", "dK", "dV", "dbias"),
                          _DIRECT(FLASH, q, k, v, bias, mask, do),
                          _DIRECT(nnx.dot_product_attention, q, k, v, bias, mask, do)):
        assert a.shape == b.shape
        record_bound(rel(a, b), F32_REL, what)


def test_dtype_promotes_the_inputs(rng):
    """``dtype`` is the computation's dtype, as in nnx: float32 inputs run as bfloat16."""
    q, k, v = (jnp.asarray(rng.standard_normal((2, 20, 2, 32)), jnp.float32) for _ in range(3))
    out = jax.jit(lambda q, k, v: FLASH(q, k, v, dtype=jnp.bfloat16, is_causal=True))(q, k, v)
    assert out.dtype == jnp.bfloat16
    want = jax.jit(lambda q, k, v: jf.dot_product_attention(
        *(x.astype(jnp.bfloat16) for x in (q, k, v)), is_causal=True, stable=True, block_q=16,
        block_k=16))(q, k, v)
    chex.assert_trees_all_equal(out, want)


_STEP = nnx.jit(lambda m, x: m(x))
_DETERMINISTIC = nnx.jit(lambda m, x: m(x, deterministic=True))


def test_decoding_with_the_kv_cache_matches_nnx(rng, record_bound):
    """nnx's autoregressive cache: one query against the cached keys, masked by nnx."""
    x = jnp.asarray(rng.standard_normal((2, 3, 32)), jnp.float32)
    step = _STEP
    outs = []
    for fn in (None, FLASH):
        m = mha(fn, decode=True)
        m.init_cache(x.shape, dtype=jnp.float32)
        outs.append(jnp.concatenate([step(m, x[:, i:i + 1]) for i in range(x.shape[1])], axis=1))
    record_bound(rel(outs[1], outs[0]), F32_REL, "O")


def test_dropout_is_refused_not_ignored(rng, record_bound):
    x = jnp.asarray(rng.standard_normal((2, 8, 32)), jnp.float32)
    flash, default = mha(FLASH, dropout_rate=0.1), mha(dropout_rate=0.1)
    with pytest.raises(NotImplementedError, match="dropout"):
        flash(x, deterministic=False)
    # deterministic: no dropout anywhere, the same result
    run = _DETERMINISTIC
    record_bound(rel(run(flash, x), run(default, x)), F32_REL, "O")
    with pytest.raises(NotImplementedError, match="sow"):
        mha(FLASH)(x, sow_weights=True)
