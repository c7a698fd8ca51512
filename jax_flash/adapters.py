"""Drop-ins for other libraries' attention functions (their packages imported only when called)."""

from __future__ import annotations

import math

import jax.numpy as jnp

from .api import dot_product_attention


def nnx_dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                              dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                              precision=None, module=None, promote_dtype=None, is_causal=False, *,
                              stable=False, beta=2.0, policy="fa2", delta="o", implementation=None,
                              block_q=None, block_k=None, launch=None):
    """``flax.nnx.dot_product_attention``'s signature on ``jax_flash.dot_product_attention``:

        nnx.MultiHeadAttention(..., attention_fn=functools.partial(
            jax_flash.nnx_dot_product_attention, stable=True))

    Shapes as in nnx: query ``[batch..., T, N, H]`` (any number of batch axes, or none), key and
    value ``[batch..., S, K, H]`` (K dividing N); ``mask`` (float or bool: nonzero = attend, as
    ``nnx.make_attention_mask`` and ``nnx.make_causal_mask`` make them) and ``bias`` broadcastable
    to ``[batch..., N, T, S]``; ``is_causal`` as nnx's (top-left ``tril``). ``dtype``: the
    computation's dtype, the inputs promoted to it by ``promote_dtype`` (default: flax's, as nnx).
    The keyword-only arguments are jax-flash's numerics and executor choice
    (``jax_flash.dot_product_attention``).

    Refused, with an error rather than ignored: attention dropout (``dropout_rate > 0`` and not
    ``deterministic``: it needs the attention weights, which a flash kernel never forms), sowing
    the weights (``module`` given, i.e. ``sow_weights=True``), and a value head_dim other than the
    query's. ``precision`` is accepted and not used: the policy decides the dots' precision (FP32
    inputs run at full FP32 precision, bf16/fp16 inputs with FP32 accumulation). ``broadcast_dropout``
    and ``dropout_rng`` only matter with dropout.
    """
    if dropout_rate > 0.0 and not deterministic:
        raise NotImplementedError(
            f"attention dropout (dropout_rate={dropout_rate}, deterministic=False) needs the "
            "attention weights, which jax-flash never forms: use dropout_rate=0 or "
            "deterministic=True, or nnx.dot_product_attention for training with attention dropout")
    if module is not None:
        raise NotImplementedError("sowing the attention weights (sow_weights=True) needs them "
                                  "formed, which jax-flash never does")
    if promote_dtype is None:
        from flax.nnx.nn import dtypes as nnx_dtypes

        promote_dtype = nnx_dtypes.promote_dtype
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
        raise ValueError(f"query, key, value must share a rank ≥ 3 [batch..., length, heads, "
                         f"depth], got {query.shape}, {key.shape}, {value.shape}")
    if value.shape[-1] != query.shape[-1]:
        raise ValueError(f"value head_dim {value.shape[-1]} differs from the query's "
                         f"{query.shape[-1]}: not supported")
    batch = query.shape[:-3]
    if key.shape[:-3] != batch or value.shape[:-3] != batch:
        raise ValueError(f"batch axes differ: {query.shape}, {key.shape}, {value.shape}")
    flat = math.prod(batch)

    def to_4d(x):  # [batch..., a, b, c] -> [prod(batch), a, b, c]
        return x.reshape((flat,) + x.shape[-3:])

    def dense_4d(x):  # [batch..., N|1, T|1, S|1] (broadcastable) -> [prod(batch)|1, ...]
        if x.ndim <= 4 and len(batch) <= 1:
            return x
        lead = x.shape[:-3]
        if all(n == 1 for n in lead):
            return x.reshape((1,) + x.shape[-3:])
        return jnp.broadcast_to(x, batch + x.shape[-3:]).reshape((flat,) + x.shape[-3:])

    if mask is not None:
        mask = dense_4d(jnp.asarray(mask).astype(bool))
    if bias is not None:
        bias = dense_4d(jnp.asarray(bias))
    q4, k4, v4 = (query, key, value) if len(batch) == 1 or query.ndim == 3 else \
        (to_4d(query), to_4d(key), to_4d(value))
    out = dot_product_attention(q4, k4, v4, bias, mask, is_causal=is_causal,
                                implementation=implementation, stable=stable, beta=beta,
                                policy=policy, delta=delta, block_q=block_q, block_k=block_k,
                                launch=launch)
    return out.reshape(query.shape)
