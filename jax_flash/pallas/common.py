"""Backend plumbing shared by the kernels: interpret mode on CPU, Triton compiler parameters on GPU."""

from __future__ import annotations

import jax


def interpret_mode() -> bool:
    """Pallas has no compiled CPU backend: off-GPU the kernels run in interpret mode."""
    return jax.default_backend() != "gpu"


def compiler_params(launch, head_dim: int, block_q: int, block_k: int):
    """Triton compiler parameters (passing them selects the Triton backend over Mosaic GPU).

    launch: (num_warps, num_stages) from the tuning table, or None for the defaults."""
    if interpret_mode():
        return None
    from jax.experimental.pallas import triton as plgpu

    if launch is None:
        launch = (4 if block_q * block_k <= 64 * 64 and head_dim <= 64 else 8, 2)
    return plgpu.CompilerParams(num_warps=launch[0], num_stages=launch[1])
