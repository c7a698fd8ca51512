"""Exact softmax attention: the high-precision yardstick every kernel is measured against.

``reference_attention`` is plain JAX (differentiable by autodiff) and computes in float64 when x64 is
enabled, else float32. ``reference_numpy`` is an independent float64 NumPy implementation of the
forward and of the closed-form gradients, for tests.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def reference_attention(q, k, v, *, causal=True, sm_scale=None, dtype=None):
    """Softmax attention on ``[batch, seq, heads, head_dim]`` in ``dtype`` (default: float64 if
    ``jax_enable_x64`` is on, else float32); returns that dtype."""
    if dtype is None:
        dtype = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    q, k, v = (jnp.asarray(x).astype(dtype) for x in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=jax.lax.Precision.HIGHEST) * scale
    if causal:
        t_q, t_k = q.shape[1], k.shape[1]
        s = jnp.where(jnp.tril(jnp.ones((t_q, t_k), bool)), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v, precision=jax.lax.Precision.HIGHEST)


def _probs64(q, k, causal, sm_scale):
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    return p / p.sum(axis=-1, keepdims=True), scale


def reference_numpy(q, k, v, do=None, *, causal=True, sm_scale=None, o_for_delta=None):
    """float64 NumPy forward, and with ``do`` the gradients: returns O or (O, dQ, dK, dV).

    ``o_for_delta``: compute the backward's δ as rowsum(dO ∘ o_for_delta) (e.g. a kernel's stored
    low-precision O) instead of the exact rowsum(dP ∘ P) — the exact gradient *given* that δ.
    """
    p, scale = _probs64(q, k, causal, sm_scale)
    v64 = np.asarray(v, np.float64)
    o = np.einsum("bhqk,bkhd->bqhd", p, v64)
    if do is None:
        return o
    do64 = np.asarray(do, np.float64)
    dv = np.einsum("bhqk,bqhd->bkhd", p, do64)
    dp = np.einsum("bqhd,bkhd->bhqk", do64, v64)
    if o_for_delta is None:
        delta = (dp * p).sum(axis=-1, keepdims=True)
    else:
        delta = np.einsum("bqhd,bqhd->bhq", do64, np.asarray(o_for_delta, np.float64))[..., None]
    ds = p * (dp - delta)
    dq = np.einsum("bhqk,bkhd->bqhd", ds, np.asarray(k, np.float64)) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, np.asarray(q, np.float64)) * scale
    return o, dq, dk, dv


def scores_numpy(q, k, *, causal=True, sm_scale=None):
    """float64 scores S = scale·QKᵀ, ``[batch, heads, q, k]``, -inf where masked."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    return s
