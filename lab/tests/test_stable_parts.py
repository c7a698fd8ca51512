"""experiments.gpu.stable_parts on the CPU: its diagnostic forms compute what they claim, and its
records feed ``bench.ab ratio``."""

import numpy as np
import pytest

from bench.ab import paired_ratio
from experiments.gpu import stable_parts
from tests.test_attention import tied_inputs


@pytest.mark.parametrize("impl", ["jnp", "pallas"])  # pallas: the Triton kernel, interpreted
def test_diagnostic_forms_replace_their_part(rng, impl):
    """On tied rows: "per-row only" never shifts (the baseline's O), "count only" shifts (O differs
    from the baseline's), and tile.py is itself again afterwards (the stable form shifts)."""
    q, k, v = tied_inputs(rng, (1, 64, 2, 32))
    out = {part: np.asarray(stable_parts.compiled_forward(part, q, k, v, impl=impl)(q, k, v),
                            np.float32) for part in stable_parts.PARTS}
    np.testing.assert_array_equal(out["per-row only"], out["base"])
    assert np.any(out["count only"] != out["base"]) and np.any(out["stable"] != out["base"])


def test_records_pair_by_round():
    records = stable_parts.run((1, 32, 1, 16), rounds=3, reps=1, impl="jnp", log=lambda m: None)
    assert {r["variant"] for r in records} == set(stable_parts.PARTS)
    med, (lo, hi), n = paired_ratio(records, "stable", "base", (1, 32, 1, 16), "fwd")
    assert n == 3 and lo <= med <= hi and med > 0
