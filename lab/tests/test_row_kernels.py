"""lab.row_kernels on the CPU (kernels interpreted, tiny shapes): variants parse, every kind builds
and runs, the fused loss kernel's outputs are the two kernels', and the table reads the record."""

import chex
import jax

from lab import row_kernels as rk


def test_variants_parse_with_shipped_defaults_for_missing_keys():
    assert rk.parse("ln-bwd") == ("ln-bwd", {})
    assert rk.parse("ln-bwd:sub=none;warps=8") == ("ln-bwd", {"sub": None, "warps": 8})
    assert rk.parse("ce-fwd:rows=1;warps=1") == ("ce-fwd", {"rows": 1, "warps": 1})


def test_fused_kernel_is_the_statistics_and_gradient_kernels():
    fwd, (logits, targets), n_bytes = rk.build("ce-fwd:rows=2;warps=2", 8)
    assert n_bytes == 8 * rk.VOCAB * 2
    fused, (_, _, g_rows), _ = rk.build("ce-fused:rows=2;warps=2", 8)
    bwd, (_, _, m, s, _), _ = rk.build("ce-bwd:rows=2;warps=2", 8)
    got = fused(logits, targets, g_rows)
    chex.assert_trees_all_equal(got[:3], fwd(logits, targets))
    chex.assert_trees_all_equal(got[3], bwd(logits, targets, m, s, g_rows))


def test_run_and_table(capsys):
    res = rk.run(["ln-bwd:sub=4", "xla-ln-bwd", "no-such-kind"], tokens=16, rounds=1, reps=1)
    assert [r["variant"] for r in res["records"]] == ["ln-bwd:sub=4", "xla-ln-bwd"]
    assert "no-such-kind" in res["failed"] and res["jax_version"] == jax.__version__
    text = rk.table(res)
    assert "`ln-bwd:sub=4`" in text and "failed" in text
