"""Backend plumbing shared by the kernels: interpret mode on CPU, Triton compiler parameters on GPU."""

from __future__ import annotations

import jax


def interpret_mode() -> bool:
    """Pallas has no compiled CPU backend: off-GPU the kernels run in interpret mode."""
    return jax.default_backend() != "gpu"


def default_launch(head_dim: int, block_q: int, block_k: int, *, backward: bool = False):
    """(num_warps, num_stages) when the tuning table has no entry.

    Forward: 4 warps for tiles up to 64×64 at head_dim ≤ 64, else 8. Backward: 4 warps for tiles up
    to 64×64 at any head_dim — JAX's Pallas mha backward with 64×64 tiles and 4 warps ran in half our
    8-warp time at head_dim 128 on the H200 (docs/PERF_NOTES.md, v4: a prediction until measured)."""
    small = block_q * block_k <= 64 * 64
    return (4 if small and (backward or head_dim <= 64) else 8, 2)


def compiler_params(launch, head_dim: int, block_q: int, block_k: int, *, backward: bool = False):
    """Triton compiler parameters (passing them selects the Triton backend over Mosaic GPU).

    launch: (num_warps, num_stages) from the tuning table, or None for ``default_launch``."""
    if interpret_mode():
        return None
    from jax.experimental.pallas import triton as plgpu

    if launch is None:
        launch = default_launch(head_dim, block_q, block_k, backward=backward)
    return plgpu.CompilerParams(num_warps=launch[0], num_stages=launch[1])
