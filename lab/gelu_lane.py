"""A kernel lane: the erf-form GELU (``GPTConfig.gelu = "erf"``) and its input gradient as Pallas
kernels, to time against XLA's fusions (``python -m lab.row_kernels``'s ``gelu-*`` variants).

XLA's GELU fusions in the GPT-2 step move their bytes at about 2.4 (forward) and 2.8 TB/s
(backward), below what the step's other row kernels reach, and the FP32 erf is a rational
function with a division per element; the question here is whether a kernel that streams wide row
blocks does better. Pallas' Triton lowering has no erf, so the lane evaluates the same kind of
rational approximation (the coefficients Eigen and XLA use for FP32: x·P(x²)/Q(x²) on x clamped
to [−4, 4]); its values are not XLA's bit for bit, which is why this is not a model option.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from models.layernorm import triton_params

SQRT_HALF = 0.7071067811865476
TWO_OVER_SQRT_PI = 1.1283791670955126
_ALPHA = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
          -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
          -1.60960333262415e-02)
_BETA = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
         -7.37332916720468e-03, -1.42647390514189e-02)
ROWS, COLS = 16, 1024  # a program's block of the [tokens, 4·d] activations


def erf32(x):
    """FP32 erf as x·P(x²)/Q(x²), x clamped to [−4, 4] (where erf is ±1 in FP32)."""
    x = jnp.clip(x, -4.0, 4.0)
    x2 = x * x
    p = jnp.float32(_ALPHA[0])
    for a in _ALPHA[1:]:
        p = p * x2 + jnp.float32(a)
    q = jnp.float32(_BETA[0])
    for b in _BETA[1:]:
        q = q * x2 + jnp.float32(b)
    return x * p / q


def _gelu(x):
    return x * ((1 + erf32(x * jnp.float32(SQRT_HALF))) / 2)


def _fwd_kernel(h_ref, y_ref):
    y_ref[...] = _gelu(h_ref[...].astype(jnp.float32)).astype(y_ref.dtype)


def _bwd_kernel(h_ref, g_ref, dh_ref):
    x = h_ref[...].astype(jnp.float32)
    z = x * jnp.float32(SQRT_HALF)
    cdf = (1 + erf32(z)) / 2
    pdf_term = x * jnp.float32(SQRT_HALF * TWO_OVER_SQRT_PI / 2) * jnp.exp(-z * z)
    dh_ref[...] = (g_ref[...].astype(jnp.float32) * (cdf + pdf_term)).astype(dh_ref.dtype)


def _call(kernel, out_dtype, *arrays, rows=ROWS, cols=COLS, warps=4):
    n, f = arrays[0].shape
    spec = pl.BlockSpec((rows, cols), lambda i, j: (i, j))
    from jax_flash.pallas.common import interpret_mode

    return pl.pallas_call(
        kernel, grid=(n // rows, f // cols), in_specs=[spec] * len(arrays), out_specs=spec,
        out_shape=jax.ShapeDtypeStruct((n, f), out_dtype), interpret=interpret_mode(),
        compiler_params=triton_params(warps, 1), name="lab_gelu")(*arrays)


def gelu(h, **launch):
    """The erf-form GELU of ``h`` ``[n, f]`` (FP32 inside), in ``h``'s dtype."""
    return _call(_fwd_kernel, h.dtype, h, **launch)


def gelu_input_grad(h, g, **launch):
    """``g`` times the GELU's derivative at ``h``, in ``h``'s dtype."""
    return _call(_bwd_kernel, h.dtype, h, g, **launch)


@functools.lru_cache
def xla_pair():
    """XLA's forward and input gradient of the model's erf form, jitted, for comparison."""
    from models.gpt2 import _gelu as model_gelu
    from models.gpt2 import gelu_from_input

    fwd = jax.jit(functools.partial(model_gelu, form="erf"))
    bwd = jax.jit(lambda h, g: jax.vjp(functools.partial(gelu_from_input, form="erf"), h)[1](g)[0])
    return fwd, bwd
