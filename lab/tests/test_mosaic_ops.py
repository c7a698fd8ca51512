"""``lab.mosaic_ops`` catches the Mosaic GPU forward's per-thread module on a CPU (jax ≥ 0.11): the
stable shift's tie count is per-entry work, visible in the op counts."""

import jax
import pytest

pytestmark = pytest.mark.skipif(jax.__version_info__ < (0, 11),
                                reason="Mosaic GPU lowers for CUDA on a CPU from jax 0.11 on")

BODIES = 2  # the causal kernel's loop bodies: unmasked tiles, then the diagonal's
# A compute warpgroup (128 threads) holds a [64 rows, block_k] score tile as 2-element vectors, so
# 64 more keys per tile are 64·64 / 128 / 2 more vector ops per thread for each per-entry op.
PER_ENTRY_OPS_PER_64_KEYS = 64 * 64 // 128 // 2


def test_tie_count_grows_with_the_key_tile():
    """stable − base holds the tie count's compare, select and add per entry (plus per-row work
    that does not depend on the tile): doubling the key tile from 64 to 128 adds exactly
    ``PER_ENTRY_OPS_PER_64_KEYS`` of each per body."""
    from lab import mosaic_ops

    extra = {}
    for tile in ("k64", "k128"):
        base, stable = (mosaic_ops.op_counts(**mosaic_ops.VARIANTS[f"{kind}-{tile}"])
                        for kind in ("base", "stable"))
        extra[tile] = mosaic_ops.difference(base, stable)
    for op in ("arith.cmpf", "arith.select", "arith.addf"):
        assert extra["k64"][op] > BODIES * PER_ENTRY_OPS_PER_64_KEYS, op
        assert extra["k128"][op] - extra["k64"][op] == BODIES * PER_ENTRY_OPS_PER_64_KEYS, op
