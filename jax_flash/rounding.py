"""Rounding helpers shared by the kernels, the emulation and the diagnostics.

Low-precision values are carried in FP32 containers and rounded explicitly (``round_to``): an FP32
operation followed by a rounding to BF16 is exactly what PyTorch does for a BF16 operation (it computes
in FP32 "opmath" and rounds once), and it lowers to every backend (XLA, Triton, interpret mode).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def round_to(x, dtype):
    """Round ``x`` to ``dtype`` (round-to-nearest-even) and return it as FP32.

    A no-op for FP32 and wider dtypes, so policies can call it unconditionally.
    """
    if np.dtype(dtype).itemsize >= 4:
        return x
    return x.astype(dtype).astype(jnp.float32)
