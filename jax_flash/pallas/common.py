"""Backend plumbing shared by the kernels: interpret mode on CPU, Triton compiler parameters on GPU."""

from __future__ import annotations

import jax


def interpret_mode() -> bool:
    """Pallas has no compiled CPU backend: off-GPU the kernels run in interpret mode."""
    return jax.default_backend() != "gpu"


def default_launch(head_dim: int, block_q: int, block_k: int, *, backward: bool = False):
    """(num_warps, num_stages) when the tuning table has no entry: the tuner's winners on the H200.

    Tiles up to 64×64: 4 warps in every kernel; 3 stages, except 2 in the backward at head_dim > 64
    (bench.tune, 2026-11-29: a backward with 8 warps took 1.5–1.9× the 4-warp time at both tuned
    shapes; the stable forward at head_dim 128 cost +59 % with 8 warps against +17 % with 4;
    docs/PERF_NOTES.md v7). Larger tiles: 8 warps, 2 stages."""
    if block_q * block_k > 64 * 64:
        return (8, 2)
    return (4, 2 if backward and head_dim > 64 else 3)


def compiler_params(launch, head_dim: int, block_q: int, block_k: int, *, backward: bool = False):
    """Triton compiler parameters (passing them selects the Triton backend over Mosaic GPU).

    launch: (num_warps, num_stages) from the tuning table, or None for ``default_launch``."""
    if interpret_mode():
        return None
    from jax.experimental.pallas import triton as plgpu

    if launch is None:
        launch = default_launch(head_dim, block_q, block_k, backward=backward)
    return plgpu.CompilerParams(num_warps=launch[0], num_stages=launch[1])
