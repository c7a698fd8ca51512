"""lab.stable_parts on the CPU: its diagnostic forms compute what they claim, and its records feed
``lab.ab ratio``."""

import jax.numpy as jnp
import numpy as np
import pytest

from lab import stable_parts
from lab.ab import paired_ratio


def tied_inputs(seed, shape):
    """Random bfloat16 inputs in which keys 3 and 5 are equal and aligned with every query, so far
    above the other keys (≈ 9 of their standard deviations at D = 32) that every causal row from
    query 5 on has an exact tie at its maximum."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    q[..., 0] = 4.0  # every query along the first axis
    k[:, (3, 5)] = 0.0
    k[:, (3, 5), :, 0] = 16.0  # q·k = 64 for both; another key's q·k has std √(16 + D − 1)
    return tuple(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))


@pytest.mark.parametrize("impl", ["jnp", pytest.param("pallas", marks=pytest.mark.slow)])  # pallas: interpreted
def test_diagnostic_forms_replace_their_part(impl):
    """On tied rows: "per-row only" never shifts (the baseline's O), "count only" shifts (O differs
    from the baseline's), and tile.py is itself again afterwards (the stable form shifts)."""
    q, k, v = tied_inputs(0, (1, 64, 2, 32))
    out = {part: np.asarray(stable_parts.compiled_forward(part, q, k, v, impl=impl)(q, k, v),
                            np.float32) for part in stable_parts.PARTS}
    np.testing.assert_array_equal(out["per-row only"], out["base"])
    assert np.any(out["count only"] != out["base"]) and np.any(out["stable"] != out["base"])


def test_records_pair_by_round():
    records = stable_parts.run((1, 32, 1, 16), rounds=3, reps=1, impl="jnp", log=lambda m: None)
    assert {r["variant"] for r in records} == set(stable_parts.PARTS)
    med, (lo, hi), n = paired_ratio(records, "stable", "base", (1, 32, 1, 16), "fwd")
    assert n == 3 and lo <= med <= hi and med > 0
