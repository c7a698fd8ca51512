"""Executor 2: Pallas kernels (Triton on GPU, interpret mode on CPU) built on ``jax_flash.tile``."""

from .backward import backward, delta
from .forward import forward

__all__ = ["forward", "delta", "backward"]
