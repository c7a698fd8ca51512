"""``lab.mosaic_ops`` catches the Mosaic GPU kernels' per-thread modules on a CPU (jax ≥ 0.11): the
stable shift's tie count is per-entry work, visible in the op counts; a register split changes
only its requests; the persistent forward keeps its products; the forward leaves each P̄·V in
flight."""

import re

import jax
import pytest

import jax_flash
from lab import same_lowering

pytestmark = pytest.mark.skipif(jax.__version_info__ < (0, 11),
                                reason="Mosaic GPU lowers for CUDA on a CPU from jax 0.11 on")

BODIES = 2  # the causal kernel's loop bodies: unmasked tiles, then the diagonal's
# A compute warpgroup (128 threads) holds a [64 rows, block_k] score tile as 2-element vectors, so
# 64 more keys per tile are 64·64 / 128 / 2 more vector ops per thread for each per-entry op.
PER_ENTRY_OPS_PER_64_KEYS = 64 * 64 // 128 // 2


def test_tie_count_grows_with_the_key_tile(monkeypatch):
    """stable − base holds the tie count's compare, select and add per entry (plus per-row work
    that does not depend on the tile): doubling the key tile from 64 to 128 adds exactly
    ``PER_ENTRY_OPS_PER_64_KEYS`` of each per body. (With 128-key tiles the diagonal's half-tile
    body, ``mosaic_common.HALF_LAST``, would be a third body: off here.)"""
    from jax_flash.pallas import mosaic_common
    from lab import mosaic_ops

    monkeypatch.setattr(mosaic_common, "HALF_LAST", False)

    extra = {}
    for tile in ("k64", "k128"):
        base, stable = (mosaic_ops.op_counts(**mosaic_ops.VARIANTS[f"{kind}-{tile}"])
                        for kind in ("base", "stable"))
        extra[tile] = mosaic_ops.difference(base, stable)
    for op in ("arith.cmpf", "arith.select", "arith.addf"):
        assert extra["k64"][op] > BODIES * PER_ENTRY_OPS_PER_64_KEYS, op
        assert extra["k128"][op] - extra["k64"][op] == BODIES * PER_ENTRY_OPS_PER_64_KEYS, op


SETMAXNREG = re.compile(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32 (\d+);")


@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
def test_bwd_regs_change_only_the_register_requests(kernel):
    """``Launch.mosaic_bwd_regs`` lowers for CUDA and changes only the immediates of the compute
    warpgroups' ``setmaxnreg.inc`` and the producer's ``setmaxnreg.dec``: every other line of the
    module is the default kernel's."""
    plain, ours = (same_lowering.lowered(jax_flash, kernel, (1, 256, 2, 128), True, regs=r)
                   for r in (None, (240, 24)))
    assert SETMAXNREG.findall(plain) == [("inc", "232"), ("dec", "40")]
    assert SETMAXNREG.findall(ours) == [("inc", "240"), ("dec", "24")]
    strip = lambda m: SETMAXNREG.sub(r"setmaxnreg.\1.sync.aligned.u32 N;", m)
    assert strip(plain) == strip(ours)


LAUNCH = re.compile(r"gpu\.launch .*?blocks\([^)]*\) in \(%\w+ = %c(\d+)(?:_\d+)?, "
                    r"%\w+ = %c(\d+)(?:_\d+)?, %\w+ = %c(\d+)(?:_\d+)?\)")


@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
def test_blocks_are_launched_fastest(kernel):
    """Each Mosaic GPU kernel launches its row or key blocks along x, the axis the GPU schedules
    fastest, then heads, then the batch: a head's programs run side by side and share its K and V
    (Q and dO) in L2. At [3, 512, 5, 128]: x = 4 blocks of 128, y = 5 heads, z = 3."""
    module = same_lowering.lowered(jax_flash, kernel, (3, 512, 5, 128), True)
    assert [tuple(map(int, m)) for m in LAUNCH.findall(module)] == [(4, 5, 3)]


def test_fwd_persistent_launches_programs_with_the_same_products():
    """``Launch.mosaic_fwd_persistent`` (``programs``) lowers for CUDA to a one-dimensional launch
    of that many programs, with the per-block kernel's wgmma instructions, commit groups and waits
    (the same products in the same order, now inside the loop over blocks)."""
    shape = (3, 512, 5, 128)
    plain = same_lowering.lowered(jax_flash, "fwd", shape, True)
    ours = same_lowering.lowered(jax_flash, "fwd", shape, True, programs=7)
    assert [tuple(map(int, m)) for m in LAUNCH.findall(ours)] == [(7, 1, 1)]
    for instr in ("wgmma.mma_async", "wgmma.commit_group", "wgmma.wait_group"):
        assert ours.count(instr) == plain.count(instr) > 0, instr


WGMMA_SYNC = re.compile(r"wgmma\.(commit_group|wait_group)|scf\.yield")


@pytest.mark.parametrize("causal,bodies", [(False, 1), (True, 3)])
def test_fwd_leaves_each_pv_in_flight(causal, bodies):
    """The forward's loop bodies (unmasked tiles; with the mask also the diagonal and its half
    tile) end with P̄·V's commit group and no wait: the next tile's QKᵀ queues behind the product
    instead of after its completion. A body that awaited P̄·V would show a wait before its yield."""
    module = same_lowering.lowered(jax_flash, "fwd", (1, 512, 2, 128), causal)
    seq = [m.group(1) or "yield" for m in WGMMA_SYNC.finditer(module)]
    ends = sum(a == "commit_group" and b == "yield" for a, b in zip(seq, seq[1:]))
    assert ends == bodies
