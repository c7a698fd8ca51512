"""Mean token cross-entropy in Pallas kernels: ``GPTConfig.cross_entropy = "pallas"``.

XLA computes the loss of bf16 logits in two passes over them (the row max, then the sum of
exponentials), each with its own read of the logits (3.3 GB a step at GPT-2's vocabulary and 32 K
tokens). Here the forward reads every row once, keeping the running max m, the sum of exp(x − m)
rescaled whenever m grows (the online softmax) and the target's logit; the gradient is
exp(x − m)/s − [target] times the loss's cotangent a token, in the logits' dtype. Both in FP32.
The sum of exponentials runs in another order, with rescalings, than XLA's, so last bits of loss
and gradient differ from the default ``"xla"`` loss — a named option, within
the bound tests/helpers.py derives (``cross_entropy_bounds``).

The training forward, the custom VJP's, computes the gradient at a cotangent of 1 in the same
kernel, reading each row a second time, last columns first (what the first pass read last is the
likeliest to be still in cache), and the backward returns it (scaled, with one more rounding, when
the cotangent is not 1; a training step's loss has cotangent 1): no backward kernel and no third
read of the logits. A loss without a gradient runs the statistics kernel alone.

A program takes ``BLOCK_ROWS`` rows and walks the vocabulary in chunks of ``CHUNK`` columns
(Triton's tensors are powers of two), then the remainder in power-of-two pieces: GPT-2's 50,304
is 6 chunks of 8,192, one of 1,024 and one of 128.

Each exponential is exp(d) = 2^(d·log₂e) by the GPU's ex2.approx (``EX2_APPROX``; interpreted,
``jax_flash.tile.exp2``): one instruction and a product where libdevice's accurate expf takes
about eight, in a kernel that issues about as many instructions as its bytes take to move. The
product's rounding and log₂e's join the argument's in the bound. ``TARGET_FIXUP`` (off) drops the
gradient walk's compare and select per logit, writing each row's target entry again after it: the
same values (a GPU test), for when the second read comes from cache and instructions bound the walk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jax_flash.pallas.common import exp2_ftz, interpret_mode
from jax_flash.policy import LOG2E
from models.layernorm import row_call

# one row a program on 16 warps, a chunk 16 FP32 registers a thread: the training kernel ran ×1.06
# the 1-warp launch's speed on an H100 (lab.row_kernels; likely fewer rows in flight, so more of a
# row still in L2 for the gradient's second read); warps and chunk set the sums' order
BLOCK_ROWS = 1
CHUNK = 8192  # columns per step of the vocabulary loop
NUM_WARPS = 16
NUM_STAGES = 2
EX2_APPROX = True  # exp(d) as 2^(d·log₂e) by ex2.approx, the option's numerics (False: jnp.exp)
TARGET_FIXUP = False  # the gradient's target entries written after the walk (no value changes)
F32 = jnp.float32


def _exp(d, ex2: bool):
    """exp(d) in FP32: with ``ex2``, 2^(d·log₂e) by ex2.approx.ftz compiled, by ``tile.exp2``
    interpreted; else ``jnp.exp``."""
    if not ex2:
        return jnp.exp(d)
    return exp2_ftz(d * F32(LOG2E))


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
    c, n, rest = pieces(v, chunk)
    carry = lax.fori_loop(0, n, lambda j, cr: step(j * c, c, cr), carry)
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


def _target_logits(x_ref, t):
    """Each row's logit at its target, one gathered element a row (``t``: the rows' targets)."""
    return x_ref[lax.broadcasted_iota(jnp.int32, t.shape, 0), t].astype(jnp.float32)


def _stats(x_ref, t, *, v: int, chunk: int, ex2: bool):
    """(shift, sum of exp(x − shift), target's logit) of the program's rows, in one read: the
    running max and sum a row, rescaled once per chunk after the chunk's max; the target's logit
    read alone (picking it out of every chunk cost a compare and a select per logit: 23 % of the
    statistics kernel's time, lab.row_kernels)."""
    def step(start, w, carry):
        m, s = carry
        x = x_ref[:, pl.ds(start, w)].astype(jnp.float32)
        m_new = jnp.maximum(m, jnp.max(x, axis=1))
        shift = _safe(m_new)
        s = s * _exp(m - shift, ex2) + jnp.sum(_exp(x - shift[:, None], ex2), axis=1)
        return m_new, s

    m, s = _walk(v, chunk, step, (jnp.full(t.shape, -jnp.inf, F32), jnp.zeros(t.shape, F32)))
    return _safe(m), s, _target_logits(x_ref, t)


def _grad(x_ref, t, m, s, tgt, g, dx_ref, *, v: int, chunk: int, ex2: bool, fixup: bool):
    """dx = exp(x − m)·g/s − g·[target], each row's cotangent ``g``, in dx's dtype, the columns
    walked back from the row's end (elementwise: the same values in any order). ``fixup``: the
    walk writes exp(x − m)·g/s everywhere, without a compare and a select per logit, and each
    row's target entry is written again afterwards from its logit ``tgt`` by the same expression
    with g subtracted (the same values: x − 0 is x)."""
    scale = g / s  # the cotangent of each row's log-sum-exp over its sum

    def step(start, w, carry):
        cols = pl.ds(start, w)
        x = x_ref[:, cols].astype(jnp.float32)
        dx = _exp(x - m[:, None], ex2) * scale[:, None]
        if not fixup:
            hit = lax.broadcasted_iota(jnp.int32, x.shape, 1) == (t - start)[:, None]
            dx = dx - jnp.where(hit, g[:, None], 0.0)
        dx_ref[:, cols] = dx.astype(dx_ref.dtype)
        return carry

    _walk_back(v, chunk, step, 0)
    if fixup:
        if not interpret_mode():
            pltriton.debug_barrier()  # the walk's stores of the program land before this one
        rows = lax.broadcasted_iota(jnp.int32, t.shape, 0)
        dx_ref[rows, t] = (_exp(tgt - m, ex2) * scale - g).astype(dx_ref.dtype)


def _fwd_kernel(x_ref, t_ref, m_ref, s_ref, tgt_ref, *, v: int, chunk: int, ex2: bool):
    m_ref[...], s_ref[...], tgt_ref[...] = _stats(x_ref, t_ref[...], v=v, chunk=chunk, ex2=ex2)


def _fwd_grad_kernel(x_ref, t_ref, g_ref, m_ref, s_ref, tgt_ref, dx_ref, *, v: int, chunk: int,
                     ex2: bool, fixup: bool):
    t = t_ref[...]
    m, s, tgt = _stats(x_ref, t, v=v, chunk=chunk, ex2=ex2)
    m_ref[...], s_ref[...], tgt_ref[...] = m, s, tgt
    _grad(x_ref, t, m, s, tgt, g_ref[...], dx_ref, v=v, chunk=chunk, ex2=ex2, fixup=fixup)


def _call(kernel, x2, ins, outs, name, *args, rows=BLOCK_ROWS, chunk=CHUNK, warps=NUM_WARPS,
          stages=NUM_STAGES, ex2=None, fixup=None):
    n, v = x2.shape
    kw = {"ex2": EX2_APPROX if ex2 is None else ex2}
    if kernel is _fwd_grad_kernel:
        kw["fixup"] = TARGET_FIXUP if fixup is None else fixup
    return row_call(functools.partial(kernel, v=v, chunk=chunk, **kw), n, v, ins, outs, name,
                    *args, rows=rows, num_warps=warps, num_stages=stages)


def _flat(logits, targets):
    v = logits.shape[-1]
    return logits.reshape(-1, v), targets.reshape(-1).astype(jnp.int32)


def row_stats(logits, targets, **launch):
    """(row max, sum of exp(x − max), target logit), FP32, one number a row of ``[..., vocab]``."""
    x2, t1 = _flat(logits, targets)
    return tuple(_call(_fwd_kernel, x2, ("row", "vec"), (("vec", F32),) * 3,
                       "model_cross_entropy_fwd", x2, t1, **launch))


def row_stats_and_grad(logits, targets, g_rows, **launch):
    """``row_stats`` and the gradient of ``g_rows``·(log-sum-exp − target logit) per row, in the
    logits' dtype, from one kernel (each row read twice by its program)."""
    x2, t1 = _flat(logits, targets)
    m, s, tgt, dx = _call(_fwd_grad_kernel, x2, ("row", "vec", "vec"),
                          (("vec", F32),) * 3 + (("row", logits.dtype),),
                          "model_cross_entropy_fwd_grad", x2, t1, g_rows, **launch)
    return m, s, tgt, dx.reshape(logits.shape)


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
    n = logits.size // logits.shape[-1]
    m, s, tgt, dx = row_stats_and_grad(logits, targets, _per_token(n, 1.0))
    return _loss(m, s, tgt), (dx,)


def _bwd(res, g):
    # the gradient at cotangent 1, from the forward; scaled when g is not 1
    (dx,) = res
    return lax.cond(g == 1, lambda: dx, lambda: (dx.astype(F32) * g).astype(dx.dtype)), None


cross_entropy.defvjp(_fwd, _bwd)
