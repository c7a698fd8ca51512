"""jax_flash/reference.py: the float64 yardsticks agree with each other and with brute force."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash as jf
from helpers import f64, make_qkv
from jax_flash import reference


@pytest.mark.parametrize("causal", [True, False])
def test_reference_attention_matches_numpy(rng, assert_close, causal):
    """reference_attention in FP32 (x64 off) against the float64 NumPy forward: within FP32's error
    for a softmax-weighted sum, (d + T + 8)·2⁻²⁴ of the absolute terms P|V| (+ |O|)."""
    q, k, v = make_qkv(rng, (2, 21, 2, 16), jnp.float32)
    out = f64(jf.reference_attention(q, k, v, causal=causal))
    want = jf.reference_numpy(q, k, v, causal=causal)
    s = reference.scores_numpy(q, k, causal=causal)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    pv = np.einsum("bhqk,bkhd->bqhd", p, np.abs(f64(v)))
    abs_s = np.einsum("bqhd,bkhd->bhqk", np.abs(f64(q)), np.abs(f64(k))).max() / 4
    bound = (16 + 21 + 8) * 2.0 ** -24 * (pv + np.abs(want)) * (1 + 2 * abs_s)
    assert_close(out, want, bound, "O")


def test_numpy_gradients_are_the_derivative(rng):
    """reference_numpy's closed-form gradients against central differences of its forward
    (float64: step 1e-5, error O(h²·|f'''|) ≈ 1e-9 on these unit-size inputs)."""
    q, k, v, do = (rng.standard_normal((1, 5, 1, 4)) for _ in range(4))
    _, dq, dk, dv = jf.reference_numpy(q, k, v, do)
    loss = lambda q, k, v: float(np.sum(jf.reference_numpy(q, k, v) * do))
    h = 1e-5
    for x, g, i in ((q, dq, 0), (k, dk, 1), (v, dv, 2)):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            args = [q, k, v]
            plus, minus = x.copy(), x.copy()
            plus[idx] += h
            minus[idx] -= h
            args[i] = plus
            f_plus = loss(*args)
            args[i] = minus
            num[idx] = (f_plus - loss(*args)) / (2 * h)
        np.testing.assert_allclose(g, num, rtol=0, atol=1e-8)


def test_o_for_delta_is_the_gradient_given_that_delta(rng):
    """o_for_delta = O itself reproduces the exact gradients (δ = rowsum(dO∘O) = rowsum(dP∘P))."""
    q, k, v, do = (rng.standard_normal((1, 6, 2, 4)) for _ in range(4))
    exact = jf.reference_numpy(q, k, v, do)
    given = jf.reference_numpy(q, k, v, do, o_for_delta=exact[0])
    chex.assert_trees_all_close(exact, given, rtol=1e-12, atol=1e-14)


def test_scores_and_scale():
    q = np.ones((1, 2, 1, 4))
    s = reference.scores_numpy(q, q, causal=True)
    assert s[0, 0, 0, 0] == 2.0 and s[0, 0, 0, 1] == -np.inf  # 4 / √4, masked above the diagonal
    assert reference.scores_numpy(q, q, causal=False, sm_scale=1.0)[0, 0, 0, 1] == 4.0
    assert jf.reference_attention(q, q, q).dtype == (jnp.float64 if jax.config.jax_enable_x64
                                                      else jnp.float32)
    assert math.isclose(float(jf.reference_attention(q, q, q, dtype=jnp.float32)[0, 1, 0, 0]), 1.0)
