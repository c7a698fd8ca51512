"""The exact GELU's erf form in two Pallas kernels: ``GPTConfig.gelu = "pallas"``.

XLA's fusions of the erf form (``gelu="erf"``) move the GELU's bytes at about 2.2–2.7 TB/s on an
H200; kernels that stream wide blocks of the ``[tokens, 4·d]`` activations do better
(``python -m lab.row_kernels``). Pallas' Triton lowering has no erf, so the kernels evaluate the
kind of rational approximation XLA's FP32 erf is (x·P(x²)/Q(x²) on x clamped to [−4, 4], where erf
is ±1 in FP32, with the coefficients Eigen and XLA use); the operations are grouped otherwise, so
last bits differ from ``gelu="erf"`` — a named option, held to the same bound against float64
(``tests/helpers.py``, ``assert_gelu_erf_within_bound``). The backward keeps only the bf16 input,
as ``gelu_from_input`` does, and computes g·(Φ(x) + x·φ(x)) in one pass.

Compiled, the kernels issue about as many instructions as their bytes take to move (the backward
more), so two operations take their short forms. The quotient P/Q is the GPU's reciprocal and a
product (``RCP_QUOTIENT``): the two instructions FP32 division compiles to once its range checks
are dropped, which Q, between −2 and −0.014 on the clamped range, never needs; the same bits (a GPU
test). And φ's exponential is the GPU's ex2.approx of x²·(−½·log₂e) (``EX2_APPROX``), one
instruction and a product where libdevice's accurate expf takes about eight: that changes bits, so
the backward's bound adds what it costs (the argument's roundings grow with x², the instruction's
own error; ``tests/helpers.py``). Interpreted, ``jax_flash.tile.exp2`` stands in for the
instruction.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax_flash import tile
from jax_flash.pallas.common import exp2_ftz, interpret_mode
from models.layernorm import triton_params

SQRT_HALF = 0.7071067811865476
INV_SQRT_2PI = 1 / math.sqrt(2 * math.pi)
NEG_HALF_LOG2E = -0.5 / math.log(2)  # exp(−x²/2) = 2^(x²·NEG_HALF_LOG2E)
_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
      -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
      -1.60960333262415e-02)
_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
      -7.37332916720468e-03, -1.42647390514189e-02)
COLS = 1024  # a program's block is ROWS × COLS of the flattened activations
# rows and warps a program, forward and backward: the fastest lab.row_kernels compared (H200);
# elementwise arithmetic, so they change no value
FWD_ROWS, FWD_WARPS = 16, 8
BWD_ROWS, BWD_WARPS = 8, 8
RCP_QUOTIENT = True  # compiled: P/Q as rcp.approx and a product (no bit moves; False: division)
EX2_APPROX = True  # φ's exp as ex2.approx, the option's numerics (False: libdevice's expf)


def _quotient(n, d, rcp: bool):
    """n/d as the GPU's FP32 division computes it for d of normal size: rcp.approx.ftz of d (the
    one MUFU.RCP the division's expansion runs), then a product the compiler may contract with
    what follows, as it contracts the division's; plain division when not ``rcp`` or
    interpreted."""
    if not rcp or interpret_mode():
        return n / d
    return n * tile.rcp_approx_ftz(d)


def erf32(x, rcp: bool = False):
    """FP32 erf as x·P(x²)/Q(x²), x clamped to [−4, 4] (``rcp``: the quotient by ``_quotient``)."""
    x = jnp.clip(x, -4.0, 4.0)
    x2 = x * x
    p = jnp.float32(_P[0])
    for a in _P[1:]:
        p = p * x2 + jnp.float32(a)
    q = jnp.float32(_Q[0])
    for b in _Q[1:]:
        q = q * x2 + jnp.float32(b)
    return _quotient(x * p, q, rcp)


def _gauss(x, ex2: bool):
    """exp(−x²/2) in FP32: with ``ex2``, 2^(x²·(−½·log₂e)) by the GPU's ex2.approx.ftz (the
    argument ≥ −47: no result is subnormal), by ``tile.exp2`` interpreted; else ``jnp.exp``."""
    if not ex2:
        return jnp.exp(-(x * x) / 2)
    return exp2_ftz((x * x) * jnp.float32(NEG_HALF_LOG2E))


def _cdf(x, rcp: bool):
    return (1 + erf32(x * jnp.float32(SQRT_HALF), rcp)) / 2


def _fwd_kernel(h_ref, y_ref, *, rcp: bool):
    x = h_ref[...].astype(jnp.float32)
    y_ref[...] = (x * _cdf(x, rcp)).astype(y_ref.dtype)


def _bwd_kernel(h_ref, g_ref, dh_ref, *, rcp: bool, ex2: bool):
    x = h_ref[...].astype(jnp.float32)
    pdf = jnp.float32(INV_SQRT_2PI) * _gauss(x, ex2)
    dh_ref[...] = (g_ref[...].astype(jnp.float32) * (_cdf(x, rcp) + x * pdf)).astype(dh_ref.dtype)


def _blocks(kernel, name, out_dtype, *arrays, rows: int, warps: int, rcp: bool | None = None,
            ex2: bool | None = None):
    """``kernel`` over the arrays flattened into rows of COLS (padded with zeros where the size is
    not a whole number of blocks), reshaped back; ``rcp``, ``ex2`` (the backward's): the module's
    constants when None."""
    kw = {"rcp": RCP_QUOTIENT if rcp is None else rcp}
    if kernel is _bwd_kernel:
        kw["ex2"] = EX2_APPROX if ex2 is None else ex2
    kernel = functools.partial(kernel, **kw)
    shape, size = arrays[0].shape, arrays[0].size
    block = rows * COLS
    padded = -(-size // block) * block
    flat = [a.reshape(-1) for a in arrays]
    if padded != size:
        flat = [jnp.pad(a, (0, padded - size)) for a in flat]
    flat = [a.reshape(-1, COLS) for a in flat]
    spec = pl.BlockSpec((rows, COLS), lambda i: (i, 0))
    out = pl.pallas_call(
        kernel, grid=(padded // block,), in_specs=[spec] * len(flat), out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(flat[0].shape, out_dtype), interpret=interpret_mode(),
        compiler_params=triton_params(warps, 1), name=name)(*flat)
    return out.reshape(-1)[:size].reshape(shape)


@jax.custom_vjp
def gelu(h):
    """x·Φ(x) of ``h`` (FP32 inside), in ``h``'s dtype; the backward keeps only ``h``."""
    return _blocks(_fwd_kernel, "model_gelu_fwd", h.dtype, h, rows=FWD_ROWS, warps=FWD_WARPS)


def _gelu_fwd(h):
    return gelu(h), h


def _gelu_bwd(h, g):
    return (_blocks(_bwd_kernel, "model_gelu_bwd", h.dtype, h, g, rows=BWD_ROWS, warps=BWD_WARPS),)


gelu.defvjp(_gelu_fwd, _gelu_bwd)
