"""Mean token cross-entropy as two Pallas kernels: ``GPTConfig.cross_entropy = "pallas"``.

XLA computes the loss of bf16 logits in two passes over them (the row max, then the sum of
exponentials), each with its own read of the logits (3.3 GB a step at GPT-2's vocabulary and 32 K
tokens). Here the forward reads every row once, keeping the running max m, the sum of exp(x − m)
rescaled whenever m grows (the online softmax) and the target's logit; the backward reads it again
and writes the gradient exp(x − m)/s − [target] times the loss's cotangent a token, in the logits'
dtype. Both in FP32. The sum of exponentials runs in another order, with rescalings, than XLA's,
so last bits of loss and gradient differ from the default ``"xla"`` loss — a named option, within
the bound tests/helpers.py derives (``cross_entropy_bounds``).

A program takes ``BLOCK_ROWS`` rows and walks the vocabulary in chunks of ``CHUNK`` columns
(Triton's tensors are powers of two), then the remainder in power-of-two pieces: GPT-2's 50,304
is 49 chunks of 1,024 and one of 128.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from models.layernorm import row_call

BLOCK_ROWS = 4  # rows per program: a chunk of each is 32 FP32 registers a thread (4 warps)
CHUNK = 1024  # columns per step of the vocabulary loop


def pieces(v: int, chunk: int = CHUNK) -> tuple[int, int, tuple[int, ...]]:
    """(chunk, full chunks, remainder pieces): ``v`` columns as ``n`` chunks of ``chunk`` (the
    largest power of two ≤ ``chunk`` and ≤ ``v``) then powers of two, largest first."""
    c = 1
    while c * 2 <= min(chunk, v):
        c *= 2
    n, r = divmod(v, c)
    rest = tuple(1 << b for b in reversed(range(c.bit_length())) if r & (1 << b))
    return c, n, rest


def _walk(v: int, step, carry):
    """``step(start, width, carry)`` over the columns: a loop over the full chunks, then each
    remainder piece (static widths)."""
    c, n, rest = pieces(v)
    carry = lax.fori_loop(0, n, lambda j, cr: step(j * c, c, cr), carry)
    start = n * c
    for w in rest:
        carry = step(start, w, carry)
        start += w
    return carry


def _safe(m):
    # a row of −inf (or +inf) logits shifts by 0, as jax.nn.logsumexp does
    return jnp.where(jnp.isfinite(m), m, 0.0)


def _fwd_kernel(x_ref, t_ref, m_ref, s_ref, tgt_ref, *, v: int):
    t = t_ref[...]
    rows = t.shape[0]

    def step(start, w, carry):
        m, s, tgt = carry
        x = x_ref[:, pl.ds(start, w)].astype(jnp.float32)
        m_new = jnp.maximum(m, jnp.max(x, axis=1))
        shift = _safe(m_new)
        s = s * jnp.exp(m - shift) + jnp.sum(jnp.exp(x - shift[:, None]), axis=1)
        cols = lax.broadcasted_iota(jnp.int32, x.shape, 1) + start
        tgt = tgt + jnp.sum(jnp.where(cols == t[:, None], x, 0.0), axis=1)
        return m_new, s, tgt

    zero = jnp.zeros((rows,), jnp.float32)
    m, s, tgt = _walk(v, step, (jnp.full((rows,), -jnp.inf, jnp.float32), zero, zero))
    m_ref[...] = _safe(m)
    s_ref[...] = s
    tgt_ref[...] = tgt


def _bwd_kernel(x_ref, t_ref, m_ref, s_ref, g_ref, dx_ref, *, v: int):
    t, m, g = t_ref[...], m_ref[...], g_ref[...]
    scale = g / s_ref[...]  # the cotangent of each row's log-sum-exp over its sum

    def step(start, w, carry):
        cols = pl.ds(start, w)
        x = x_ref[:, cols].astype(jnp.float32)
        hit = lax.broadcasted_iota(jnp.int32, x.shape, 1) + start == t[:, None]
        dx = jnp.exp(x - m[:, None]) * scale[:, None] - jnp.where(hit, g[:, None], 0.0)
        dx_ref[:, cols] = dx.astype(dx_ref.dtype)
        return carry

    _walk(v, step, 0)


def _call(kernel, x2, ins, outs, name, *args):
    n, v = x2.shape
    return row_call(functools.partial(kernel, v=v), n, v, ins, outs, name, *args,
                    rows=BLOCK_ROWS, num_stages=2)


def row_stats(logits, targets):
    """(row max, sum of exp(x − max), target logit), FP32, one number a row of ``[..., vocab]``."""
    v = logits.shape[-1]
    x2, t1 = logits.reshape(-1, v), targets.reshape(-1).astype(jnp.int32)
    f32 = jnp.float32
    return tuple(_call(_fwd_kernel, x2, ("row", "vec"), (("vec", f32),) * 3,
                       "model_cross_entropy_fwd", x2, t1))


@jax.custom_vjp
def cross_entropy(logits, targets):
    """Mean over tokens of log Σ exp(logits) − logits[target], in FP32, of logits ``[..., vocab]``
    in any float dtype; the gradient in the logits' dtype."""
    return _fwd(logits, targets)[0]


def _fwd(logits, targets):
    m, s, tgt = row_stats(logits, targets)
    loss = jnp.mean(jnp.log(s) + m - tgt)
    return loss, (logits, targets, m, s)


def _bwd(res, g):
    logits, targets, m, s = res
    v = logits.shape[-1]
    x2, t1 = logits.reshape(-1, v), targets.reshape(-1).astype(jnp.int32)
    gr = jnp.full(m.shape, g / m.shape[0], jnp.float32)  # the mean's cotangent, a token
    (dx,) = _call(_bwd_kernel, x2, ("row", "vec", "vec", "vec", "vec"), (("row", logits.dtype),),
                  "model_cross_entropy_bwd", x2, t1, m, s, gr)
    return dx.reshape(logits.shape), None


cross_entropy.defvjp(_fwd, _bwd)
