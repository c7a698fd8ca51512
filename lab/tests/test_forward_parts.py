"""lab.forward_parts on the CPU: each diagnostic form changes what its part computes, tile.py is
itself again afterwards, and the records feed ``lab.ab ratio``."""

import numpy as np

from lab import forward_parts, stable_parts
from lab.ab import paired_ratio


def test_each_form_replaces_its_part():
    rng = np.random.default_rng(0)
    q, k, v = (np.asarray(rng.standard_normal((1, 64, 2, 32)), np.float32) for _ in range(3))
    q, k, v = (stable_parts.jnp.asarray(x, stable_parts.jnp.bfloat16) for x in (q, k, v))
    out = {f: np.asarray(stable_parts.compiled_forward(f, q, k, v, impl="jnp",
                                                       parts=forward_parts.FORMS)(q, k, v),
                         np.float32) for f in forward_parts.FORMS}
    for form in ("no exp", "no P·V", "no Q·Kᵀ"):
        assert np.any(out[form] != out["base"]), form
    np.testing.assert_array_equal(out["no P·V"], 0.0)  # O is P·V summed: all zero without it
    again = stable_parts.compiled_forward("base", q, k, v, impl="jnp", parts=forward_parts.FORMS)
    np.testing.assert_array_equal(np.asarray(again(q, k, v), np.float32), out["base"])


def test_records_pair_by_round():
    records = stable_parts.run((1, 32, 1, 16), rounds=3, reps=1, impl="jnp", log=lambda m: None,
                               parts=forward_parts.FORMS)
    assert {r["variant"] for r in records} == set(forward_parts.FORMS)
    med, (lo, hi), n = paired_ratio(records, "no exp", "base", (1, 32, 1, 16), "fwd")
    assert n == 3 and lo <= med <= hi and med > 0
