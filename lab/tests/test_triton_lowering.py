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



def test_top2_tie_test_has_no_per_entry_count():
    """``tie_top2``: the row max becomes a two-operand reduction (max and second largest, one
    ``tt.reduce``) and the count's per-entry compare, select and add are gone — the stable extra is
    per-row ops plus the reduction's combine (docs/PERF_NOTES.md v17)."""
    text = triton_ops.module_text(**triton_ops.VARIANTS["stable+top2"])
    assert text.count("\"tt.reduce\"(") == text.count("tt.reduce.return") and "minnumf" in text
    pairs = [line for line in text.splitlines() if "\"tt.reduce\"(" in line and ":2 = " in line]
    assert len(pairs) == 2  # one per loop body
    base, top2 = (triton_ops.op_counts(**triton_ops.VARIANTS[n]) for n in ("base", "stable+top2"))
    extra = triton_ops.difference(base, top2)
    assert extra.get("arith.cmpf") == 2 * 2  # per body: second ≥ threshold, over > 0 (no per-entry compare)
    assert "tt.broadcast" not in extra and "tt.expand_dims" not in extra  # no [rows, keys] threshold


def test_exp2_ftz_replaces_the_library_exp2():
    """``exp2_ftz``: the forward's exps (P̄ and α, in both loop bodies) become one inline
    ``ex2.approx.ftz.f32`` each instead of libdevice's exp2 (whose subnormal handling costs a compare
    and two multiplies per entry); nothing else changes."""
    for kind in ("base", "stable"):
        plain, ftz = (triton_ops.op_counts(**triton_ops.VARIANTS[n]) for n in (kind, kind + "+ftz"))
        assert triton_ops.difference(plain, ftz) == {"tt.elementwise_inline_asm": 2 * 2,
                                                       "tt.extern_elementwise": -2 * 2}
    text = triton_ops.module_text(**triton_ops.VARIANTS["stable+ftz"])
    assert text.count("ex2.approx.ftz.f32") == 2 * 2 and "exp2" not in text.replace("ex2.approx", "")
