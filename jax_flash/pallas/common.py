"""Backend plumbing shared by the kernels: interpret mode on CPU, Triton compiler parameters on GPU."""

from __future__ import annotations

import functools

import jax

from .. import tile
from ..rounding import native_casts


def interpret_mode() -> bool:
    """Pallas has no compiled CPU backend: off-GPU the kernels run in interpret mode."""
    return jax.default_backend() != "gpu"


def exp2_ftz(x):
    """2^x in a Triton kernel body: the GPU's ``ex2.approx.ftz`` compiled, ``tile.exp2`` (within
    1.35 ulp of the exact power) interpreted."""
    return tile.exp2(x) if interpret_mode() else tile.ex2_approx_ftz(x)


def kernel_body(fn):
    """Decorator for Pallas kernel bodies: compiled for Triton they round with plain conversions
    (``rounding.native_casts``) and take exp2 from the PTX instruction; in interpret mode, which XLA
    compiles, they keep ``round_to``'s XLA-proof rounding and the XLA exp2."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        compiled = not interpret_mode()
        with native_casts(compiled), tile.exp2_backend("triton" if compiled else "xla"):
            return fn(*args, **kwargs)

    return wrapped


def default_launch(head_dim: int, block_q: int, block_k: int, *, backward: bool = False,
                   itemsize: int = 2):
    """(num_warps, num_stages) when the tuning table has no entry.

    16-bit inputs, head_dim ≤ 128, tiles up to 64×64: what ``bench.tune`` measured fastest on the
    H200, 4 warps in every kernel and 3 stages, except 2 in the backward at head_dim > 64 (8 warps
    took 1.5–1.9× as long there). FP32 inputs and wider heads (more shared memory per pipelined
    tile; not measured): 4 warps, 8 for the forward at head_dim > 64, 2 stages. Larger tiles: 8
    warps, 2 stages. itemsize: bytes per input element."""
    if block_q * block_k > 64 * 64:
        return (8, 2)
    if itemsize > 2 or head_dim > 128:
        return (4 if backward or head_dim <= 64 else 8, 2)
    return (4, 2 if backward and head_dim > 64 else 3)


def compiler_params(launch, head_dim: int, block_q: int, block_k: int, *, backward: bool = False,
                    itemsize: int = 2):
    """Triton compiler parameters (passing them selects the Triton backend over Mosaic GPU).

    launch: (num_warps, num_stages) from the tuning table, or None for ``default_launch``."""
    if interpret_mode():
        return None
    from jax.experimental.pallas import triton as plgpu

    if launch is None:
        launch = default_launch(head_dim, block_q, block_k, backward=backward, itemsize=itemsize)
    return plgpu.CompilerParams(num_warps=launch[0], num_stages=launch[1])


def resident_block(big: int | None, cfg, tq: int, tk: int) -> int | None:
    """``big`` (``Launch.bwd_block`` / ``dq_block``) where it is a multiple of both
    tiles and divides both padded lengths: the rows or keys a program keeps over the same streamed
    tiles, which changes no value."""
    if not big or big % cfg.block_q or big % cfg.block_k or tq % big or tk % big:
        return None
    return big
