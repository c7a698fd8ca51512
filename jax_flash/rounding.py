"""Rounding helpers shared by the kernels, the emulation and the diagnostics.

Low-precision values are carried in FP32 containers and rounded explicitly (``round_to``): an FP32
operation followed by a rounding to BF16 is exactly what PyTorch does for a BF16 operation (it computes
in FP32 "opmath" and rounds once), and it lowers to every backend (XLA, Triton, interpret mode).

Why not simply ``x.astype(bf16).astype(f32)``: XLA (CPU and GPU, under ``jit``) may delete such a
convert pair — its default ``xla_allow_excess_precision`` lets it keep the FP32 value — and it does so
depending on fusion (e.g. after a row sum: ``jnp.sum(e, 1).astype(bf16).astype(f32)`` comes back
unrounded). An emulation that silently skips a rounding is wrong without any error, so outside Triton
kernels ``round_to`` uses ``lax.reduce_precision``, which XLA keeps. Triton compiles the conversions
as written, and Pallas' Triton lowering has no ``reduce_precision``: kernel bodies compiled for the
GPU (``native_casts``) use the casts. ``cast_rounded`` is the same guarantee for a matmul operand.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax.numpy as jnp
import numpy as np
from jax import lax

# True while a Pallas kernel body is traced for the Triton backend (set by pallas/common.py)
_NATIVE_CASTS = contextvars.ContextVar("jax_flash_native_casts", default=False)


@contextlib.contextmanager
def native_casts(enabled: bool = True):
    """Round with plain dtype conversions inside the block (Triton kernel bodies; see above)."""
    token = _NATIVE_CASTS.set(enabled)
    try:
        yield
    finally:
        _NATIVE_CASTS.reset(token)


def round_to(x, dtype):
    """Round ``x`` to ``dtype`` (round-to-nearest-even) and return it as FP32.

    A no-op for FP32 and wider dtypes, so policies can call it unconditionally.
    """
    dtype = np.dtype(dtype)
    if dtype.itemsize >= 4:
        return x
    if _NATIVE_CASTS.get():
        return x.astype(dtype).astype(jnp.float32)
    x = jnp.asarray(x, jnp.float32)
    fi = jnp.finfo(dtype)
    y = lax.reduce_precision(x, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)
    if fi.nexp < 8:
        # reduce_precision flushes the narrow format's subnormals to zero; the IEEE conversion keeps
        # them (FP16: multiples of 2⁻²⁴ below 2⁻¹⁴), rounding half to even — scaling by a power of two
        # is exact
        step = float(fi.smallest_subnormal)
        sub = jnp.round(x * (1.0 / step)) * step
        y = jnp.where(jnp.abs(x) < float(fi.smallest_normal), sub, y)
    return y


def cast_rounded(x, dtype):
    """``x`` as a ``dtype`` array (e.g. a matmul operand) whose values are certainly rounded to
    ``dtype``, even where XLA would elide the conversion (see the module docstring)."""
    dtype = np.dtype(dtype)
    if dtype.itemsize >= 4 or _NATIVE_CASTS.get():
        return x.astype(dtype)
    return round_to(x, dtype).astype(dtype)


# ------------------------------------------------------------------------------- stochastic rounding
# A stateless, key-free pseudo-random dither: the random bits come from an integer hash of the value's
# FP32 bit pattern mixed with the element's position in the array (iota), not from a PRNG. Inside a
# Pallas kernel body (Triton on GPU, interpret mode on CPU) there is no PRNG state to thread through
# the online-softmax loop, and both executors must compute the same bits; a hash of (bits, position)
# needs only uint32 multiply/xor/shift, runs everywhere, and is reproducible run to run. It is
# deterministic: the same value at the same position always rounds the same way. It is unbiased in
# the sense that matters here: over values whose low bits vary (or over positions), the 16 random bits
# are independent of the 16 bits being dropped, so P(round up) = dropped / 2¹⁶ and E[SR(x)] = x.

def _lowbias32(h):
    """A 32-bit integer finaliser (C. Wellons' "lowbias32"): full avalanche with two multiplies."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


_POSITION_MIX = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)


def _position_hash(shape, salt: int, axes):
    """uint32 hash of each element's index along ``axes`` (one odd multiplier per axis) and a salt."""
    h = jnp.full(shape, jnp.uint32(salt & 0xFFFFFFFF), jnp.uint32)
    for axis in sorted({a % len(shape) for a in axes} if shape else ()):
        idx = lax.broadcasted_iota(jnp.int32, shape, axis).astype(jnp.uint32)
        h = h + idx * jnp.uint32(_POSITION_MIX[axis % len(_POSITION_MIX)])
    return _lowbias32(h)


def stochastic_round_to(x, dtype, salt: int = 0, position_axes=(-1,)):
    """Stochastically round ``x`` to ``dtype`` and return it as FP32 (a no-op for FP32 and wider).

    BF16 only (its values are the FP32 values with 16 zero low bits): 16 pseudo-random bits — the high
    half of ``lowbias32(bits(x) ^ hash(position, salt))`` — are added to the FP32 bit pattern and the low
    16 bits truncated. The magnitude rounds up with probability (dropped bits)/2¹⁶, so the expectation
    over the dither is x (for either sign: the carry goes into the magnitude; a carry into the exponent
    is the correct next BF16 value, up to +inf above BF16's largest finite value as round-to-nearest
    would). Values already in BF16 are unchanged; NaN stays NaN. ``salt`` decorrelates the dither of
    different rounding points in one kernel. ``position_axes``: the axes whose index enters the hash —
    by default the last one, the feature axis of a ``[rows, head_dim]`` tile, which every tiling keeps
    whole, so the result does not depend on block sizes or on where a row sits in its query block;
    ``()`` hashes the value bits alone. See the comment above for why it is a hash, not a PRNG.
    """
    dtype = np.dtype(dtype)
    if dtype.itemsize >= 4:
        return x
    if dtype != np.dtype(jnp.bfloat16):
        raise NotImplementedError(f"stochastic rounding is implemented for bfloat16 only, not {dtype}")
    x = jnp.asarray(x, jnp.float32)
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    noise = _lowbias32(bits ^ _position_hash(x.shape, salt, position_axes)) >> 16
    rounded = (bits + noise) & jnp.uint32(0xFFFF0000)
    y = lax.bitcast_convert_type(rounded, jnp.float32)
    return jnp.where(x != x, x, y)
