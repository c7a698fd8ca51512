"""``lab.determinism``: repeated calls of a function that returns the same bits count one pattern
per output; one whose output changes between calls counts each call's, with its difference."""

import json

import jax.numpy as jnp
import pytest

from lab import determinism


def test_counts_distinct_bit_patterns_per_output():
    calls = []

    def g(x):
        calls.append(1)
        # the second output moves by one ulp of 1.0 in bfloat16 on every other call
        return x * 2, x + jnp.bfloat16(2 ** -7) * (len(calls) % 2)

    x = jnp.ones((4, 4), jnp.bfloat16)
    same, moving = determinism.distinct_runs(g, (x,), 5)
    assert len(calls) == 5
    assert same == {"distinct": 1, "max_abs_diff": 0.0}
    assert moving == {"distinct": 2, "max_abs_diff": 2 ** -7}


def test_needs_two_runs():
    with pytest.raises(ValueError, match="at least 2"):
        determinism.distinct_runs(lambda x: (x,), (jnp.ones(2),), 1)


def test_runs_on_a_cpu_and_records_the_flags(tmp_path, monkeypatch):
    """Ours on a CPU (the jnp executor): every gradient the same bits on each of three calls."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    out = tmp_path / "d.json"
    determinism.main(["--shape", "1x64x2x16", "--variants", "new", "--repeats", "3",
                      "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["xla_flags"] == "--xla_cpu_enable_fast_math=false" and got["repeats"] == 3
    (row,) = got["rows"]
    assert row["variant"] == "new"
    assert all(row[n]["distinct"] == 1 and row[n]["max_abs_diff"] == 0 for n in ("dq", "dk", "dv"))
