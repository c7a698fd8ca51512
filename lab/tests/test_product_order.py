"""lab.product_order: the reordered products change bits, stay within one ulp almost everywhere,
and leave the library as it was."""

import jax.numpy as jnp
import numpy as np

from jax_flash import tile
from jax_flash.policy import make_policy
from lab import product_order as po


def test_reordered_products_move_bits_and_are_undone():
    original = tile._dot
    rows = po.run((1, 512, 1, 64))
    assert tile._dot is original
    names = [r[0] for r in rows]
    assert names == ["O", "dQ", "dK", "dV"]
    bitwise = {name: bw for name, bw, _, _ in rows}
    assert min(bitwise.values()) < 100.0, "another summation order moved no bit: nothing was patched"
    for name, bw, w1, md in rows:
        assert 0.0 < bw <= w1 <= 100.0, (name, bw, w1)
        assert md < 2.0 ** -6, (name, md)  # a few BF16 ulps of the largest element, not a wrong value


def test_halves_dot_is_a_dot():
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((32, 4)), jnp.float32)
    pol = make_policy("fa2", jnp.bfloat16)
    out = po._halves_dot(a, b, (((1,), (0,)), ((), ())), pol)
    np.testing.assert_allclose(np.asarray(out), np.asarray(a) @ np.asarray(b), rtol=1e-5, atol=1e-5)
