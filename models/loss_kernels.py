"""Mean token cross-entropy in Pallas kernels: ``GPTConfig.cross_entropy = "pallas"``.

XLA computes the loss of bf16 logits in two passes over them (the row max, then the sum of
exponentials), each with its own read of the logits (3.3 GB a step at GPT-2's vocabulary and 32 K
tokens). Here the forward reads every row once, keeping the running max m, the sum of exp(x − m)
rescaled whenever m grows (the online softmax) and the target's logit; the backward reads it again
and writes the gradient exp(x − m)/s − [target] times the loss's cotangent a token, in the logits'
dtype. Both in FP32. The sum of exponentials runs in another order, with rescalings, than XLA's,
so last bits of loss and gradient differ from the default ``"xla"`` loss — a named option, within
the bound tests/helpers.py derives (``cross_entropy_bounds``).

With ``FUSED_GRAD`` (on) the training forward, the custom VJP's, computes the gradient at a cotangent
of 1 in the same kernel, reading each row a second time, last columns first (what the first pass
read last is the likeliest to be still in cache), and the
backward returns it (scaled, with one more rounding, when the cotangent is not 1; a training step's
loss has cotangent 1): no backward kernel and no third read of the logits. Off, the backward kernel
reads the logits again. A loss without a gradient runs the statistics kernel alone either way.

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
NUM_WARPS = 4
NUM_STAGES = 2
FUSED_GRAD = True  # the training forward writes the gradient too (module docstring)
FORM = "chunks"  # how the statistics walk a row (``_stats``)


def pieces(v: int, chunk: int = CHUNK) -> tuple[int, int, tuple[int, ...]]:
    """(chunk, full chunks, remainder pieces): ``v`` columns as ``n`` chunks of ``chunk`` (the
    largest power of two ≤ ``chunk`` and ≤ ``v``) then powers of two, largest first."""
    c = 1
    while c * 2 <= min(chunk, v):
        c *= 2
    n, r = divmod(v, c)
    rest = tuple(1 << b for b in reversed(range(c.bit_length())) if r & (1 << b))
    return c, n, rest


def _walk(v: int, chunk: int, step, carry):
    """``step(start, width, carry)`` over the columns: a loop over the full chunks, then each
    remainder piece (static widths)."""
    c, n, _ = pieces(v, chunk)
    carry = lax.fori_loop(0, n, lambda j, cr: step(j * c, c, cr), carry)
    return _walk_rest(v, chunk, step, carry)


def _walk_rest(v: int, chunk: int, step, carry):
    """``step`` over the remainder pieces after the full chunks."""
    c, n, rest = pieces(v, chunk)
    start = n * c
    for w in rest:
        carry = step(start, w, carry)
        start += w
    return carry


def _walk_back(v: int, chunk: int, step, carry):
    """``_walk`` from the last column to the first: a second pass over a row meets first what the
    first pass read last, most likely still in cache."""
    c, n, rest = pieces(v, chunk)
    start = v
    for w in reversed(rest):
        start -= w
        carry = step(start, w, carry)
    return lax.fori_loop(0, n, lambda j, cr: step((n - 1 - j) * c, c, cr), carry)


def _safe(m):
    # a row of −inf (or +inf) logits shifts by 0, as jax.nn.logsumexp does
    return jnp.where(jnp.isfinite(m), m, 0.0)


def _stats(x_ref, t, *, v: int, chunk: int, form: str = "chunks"):
    """(shift, sum of exp(x − shift), target's logit) of the program's rows, in one read.

    ``form="chunks"``: the running max and sum a row, rescaled once per chunk after the chunk's
    max (three reductions across the program's threads a chunk). ``form="lanes"``: a running max
    and sum per column of the chunk (each rescaled, with the one exp an element takes, whenever
    its max grows), reduced across the chunk once at the end; then the remainder pieces as in
    "chunks". Another order of the same sums: different last bits."""
    if form == "lanes":
        return _stats_lanes(x_ref, t, v=v, chunk=chunk)
    if form != "chunks":
        raise ValueError(f"form {form!r}: 'chunks' or 'lanes'")

    zero = jnp.zeros(t.shape, jnp.float32)
    init = (jnp.full(t.shape, -jnp.inf, jnp.float32), zero, zero)
    m, s, tgt = _walk(v, chunk, _chunk_step(x_ref, t), init)
    return _safe(m), s, tgt


def _chunk_step(x_ref, t):
    """The "chunks" walk's step: (m, s, tgt) after the columns [start, start + w)."""
    def step(start, w, carry):
        m, s, tgt = carry
        x = x_ref[:, pl.ds(start, w)].astype(jnp.float32)
        m_new = jnp.maximum(m, jnp.max(x, axis=1))
        shift = _safe(m_new)
        s = s * jnp.exp(m - shift) + jnp.sum(jnp.exp(x - shift[:, None]), axis=1)
        cols = lax.broadcasted_iota(jnp.int32, x.shape, 1) + start
        tgt = tgt + jnp.sum(jnp.where(cols == t[:, None], x, 0.0), axis=1)
        return m_new, s, tgt

    return step


def _stats_lanes(x_ref, t, *, v: int, chunk: int):
    c, n, _ = pieces(v, chunk)
    rows = t.shape[0]
    lane = lax.broadcasted_iota(jnp.int32, (rows, c), 1)

    def step(j, carry):
        m, s, tgt = carry
        x = x_ref[:, pl.ds(j * c, c)].astype(jnp.float32)
        d = x - m
        grow = d > 0
        # exp(−|x − m|): the new element's term, or the old sum's rescaling when x is the new max;
        # x = m = −inf (d is nan) adds nothing
        e = jnp.where(x == -jnp.inf, 0.0, jnp.exp(jnp.where(grow, -d, d)))
        s = jnp.where(grow, s * e + 1.0, s + e)
        tgt = tgt + jnp.where(lane + j * c == t[:, None], x, 0.0)
        return jnp.maximum(m, x), s, tgt

    init = (jnp.full((rows, c), -jnp.inf, jnp.float32), jnp.zeros((rows, c), jnp.float32),
            jnp.zeros((rows, c), jnp.float32))
    m_l, s_l, tgt_l = lax.fori_loop(0, n, step, init)
    m = jnp.max(m_l, axis=1)
    s = jnp.sum(s_l * jnp.exp(m_l - _safe(m)[:, None]), axis=1)
    carry = (m, s, jnp.sum(tgt_l, axis=1))
    m, s, tgt = _walk_rest(v, chunk, _chunk_step(x_ref, t), carry)
    return _safe(m), s, tgt


def _grad(x_ref, t, m, s, g, dx_ref, *, v: int, chunk: int, back: bool = False):
    """dx = exp(x − m)·g/s − g·[target], each row's cotangent ``g``, in dx's dtype, the columns
    walked forward or ``back`` (elementwise: the same values either way)."""
    scale = g / s  # the cotangent of each row's log-sum-exp over its sum

    def step(start, w, carry):
        cols = pl.ds(start, w)
        x = x_ref[:, cols].astype(jnp.float32)
        hit = lax.broadcasted_iota(jnp.int32, x.shape, 1) + start == t[:, None]
        dx = jnp.exp(x - m[:, None]) * scale[:, None] - jnp.where(hit, g[:, None], 0.0)
        dx_ref[:, cols] = dx.astype(dx_ref.dtype)
        return carry

    (_walk_back if back else _walk)(v, chunk, step, 0)


def _fwd_kernel(x_ref, t_ref, m_ref, s_ref, tgt_ref, *, v: int, chunk: int, form: str):
    m_ref[...], s_ref[...], tgt_ref[...] = _stats(x_ref, t_ref[...], v=v, chunk=chunk, form=form)


def _bwd_kernel(x_ref, t_ref, m_ref, s_ref, g_ref, dx_ref, *, v: int, chunk: int, form: str):
    del form  # the gradient's arithmetic has one form
    _grad(x_ref, t_ref[...], m_ref[...], s_ref[...], g_ref[...], dx_ref, v=v, chunk=chunk)


def _fwd_grad_kernel(x_ref, t_ref, g_ref, m_ref, s_ref, tgt_ref, dx_ref, *, v: int, chunk: int,
                     form: str):
    t = t_ref[...]
    m, s, tgt = _stats(x_ref, t, v=v, chunk=chunk, form=form)
    m_ref[...], s_ref[...], tgt_ref[...] = m, s, tgt
    _grad(x_ref, t, m, s, g_ref[...], dx_ref, v=v, chunk=chunk, back=True)


def _call(kernel, x2, ins, outs, name, *args, rows=BLOCK_ROWS, chunk=CHUNK, warps=NUM_WARPS,
          stages=NUM_STAGES, form=None):
    n, v = x2.shape
    form = FORM if form is None else form
    return row_call(functools.partial(kernel, v=v, chunk=chunk, form=form), n, v, ins, outs, name,
                    *args,
                    rows=rows, num_warps=warps, num_stages=stages)


def _flat(logits, targets):
    v = logits.shape[-1]
    return logits.reshape(-1, v), targets.reshape(-1).astype(jnp.int32)


def row_stats(logits, targets, **launch):
    """(row max, sum of exp(x − max), target logit), FP32, one number a row of ``[..., vocab]``."""
    x2, t1 = _flat(logits, targets)
    return tuple(_call(_fwd_kernel, x2, ("row", "vec"), (("vec", F32),) * 3,
                       "model_cross_entropy_fwd", x2, t1, **launch))


def row_grad(logits, targets, m, s, g_rows, **launch):
    """The gradient of ``g_rows``·(log-sum-exp − target logit) per row, in the logits' dtype."""
    x2, t1 = _flat(logits, targets)
    (dx,) = _call(_bwd_kernel, x2, ("row", "vec", "vec", "vec", "vec"), (("row", logits.dtype),),
                  "model_cross_entropy_bwd", x2, t1, m, s, g_rows, **launch)
    return dx.reshape(logits.shape)


def row_stats_and_grad(logits, targets, g_rows, **launch):
    """``row_stats`` and ``row_grad`` from one kernel (each row read twice by its program)."""
    x2, t1 = _flat(logits, targets)
    m, s, tgt, dx = _call(_fwd_grad_kernel, x2, ("row", "vec", "vec"),
                          (("vec", F32),) * 3 + (("row", logits.dtype),),
                          "model_cross_entropy_fwd_grad", x2, t1, g_rows, **launch)
    return m, s, tgt, dx.reshape(logits.shape)


F32 = jnp.float32


@jax.custom_vjp
def cross_entropy(logits, targets):
    """Mean over tokens of log Σ exp(logits) − logits[target], in FP32, of logits ``[..., vocab]``
    in any float dtype; the gradient in the logits' dtype."""
    m, s, tgt = row_stats(logits, targets)
    return _loss(m, s, tgt)


def _loss(m, s, tgt):
    return jnp.mean(jnp.log(s) + m - tgt)


def _per_token(n: int, g):
    # the mean's cotangent, a token: an FP32 division, whether g is a traced cotangent or the 1 the
    # fused forward assumes
    return jnp.full((n,), jnp.asarray(g, F32) / n, F32)


def _fwd(logits, targets):
    if FUSED_GRAD:
        n = logits.size // logits.shape[-1]
        m, s, tgt, dx = row_stats_and_grad(logits, targets, _per_token(n, 1.0))
        return _loss(m, s, tgt), (dx,)
    m, s, tgt = row_stats(logits, targets)
    return _loss(m, s, tgt), (logits, targets, m, s)


def _bwd(res, g):
    if len(res) == 1:  # the gradient at cotangent 1, from the forward; scaled when g is not 1
        (dx,) = res
        return lax.cond(g == 1, lambda: dx, lambda: (dx.astype(F32) * g).astype(dx.dtype)), None
    logits, targets, m, s = res
    return row_grad(logits, targets, m, s, _per_token(m.shape[0], g)), None


cross_entropy.defvjp(_fwd, _bwd)
