"""The Triton forward lowered for CUDA on a CPU (``experiments.triton_ops``: the Pallas lowering's
Triton IR, caught before XLA's GPU compiler): what the stable shift adds to the kernel, op by op."""

from experiments import triton_ops


def test_stable_shift_adds_few_ops_per_row():
    """At the shipped 32×1024 launch (two loop bodies), stable − base is the count's compare, select
    and add per entry plus the per-row shift: 21 ops per body since the per-row rewrite (30 before it,
    docs/PERF_NOTES.md v16). A bound, so that a costlier form of the shift does not slip back in."""
    base, stable = (triton_ops.op_counts(**triton_ops.VARIANTS[n]) for n in ("base", "stable"))
    extra = triton_ops.difference(base, stable)
    assert extra.get("arith.cmpf") == 2 * 3  # per body: the entry's compare, ties > 1, over > 0
    assert "arith.fptosi" not in extra and "arith.andi" not in extra  # floor in one op, no r_m ≠ 0 test
    assert 2 * 15 <= sum(extra.values()) <= 2 * 22

