"""jax_flash/rounding.py: round_to / cast_rounded give IEEE round-to-nearest-even under jit (where
XLA would delete a convert pair), and stochastic_round_to is unbiased, exact on representable values
and deterministic."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_flash as jf
from helpers import BF16
from jax_flash import rounding
from jax_flash.rounding import round_to, stochastic_round_to


@pytest.mark.parametrize("dtype", [BF16, jnp.float16])
def test_round_to_survives_jit(rng, dtype):
    """``round_to`` / ``cast_rounded`` under jit give IEEE round-to-nearest-even (NumPy's conversion),
    subnormals, overflow and NaN included — also right after a row sum, where XLA deletes a plain
    f32 → bf16 → f32 convert pair (``xla_allow_excess_precision``; rounding.py), so an emulated BF16
    accumulator would silently stay FP32."""
    np_dtype = ml_dtypes.bfloat16 if dtype == BF16 else np.float16
    fi = jnp.finfo(dtype)
    edges = [0.0, -0.0, np.inf, -np.inf, np.nan, float(fi.max), float(fi.max) * 1.002,
             float(fi.smallest_normal), float(fi.smallest_subnormal) * 1.5,
             float(fi.smallest_subnormal) * 0.5, float(fi.smallest_subnormal) * 0.51, 1e-40, 1 + 2.0**-8]
    x = np.concatenate([edges, rng.standard_normal(20000) * 10.0 ** rng.uniform(-45, 38, 20000)])
    x = x.astype(np.float32)
    with np.errstate(over="ignore"):
        want = x.astype(np_dtype).astype(np.float32)
    got = np.asarray(jax.jit(lambda x: rounding.round_to(x, dtype))(x))
    np.testing.assert_array_equal(got, want)
    got_cast = np.asarray(jax.jit(lambda x: rounding.cast_rounded(x, dtype))(x).astype(jnp.float32))
    np.testing.assert_array_equal(got_cast, want)

    e = jnp.asarray(rng.standard_normal((4096, 512)), jnp.float32)  # (at 64 rows XLA keeps the pair)
    row_sum = np.asarray(jax.jit(lambda e: jnp.sum(jnp.exp(e), axis=1))(e))
    got = np.asarray(jax.jit(lambda e: rounding.round_to(jnp.sum(jnp.exp(e), axis=1), dtype))(e))
    np.testing.assert_array_equal(got, row_sum.astype(np_dtype).astype(np.float32))


def test_worked_rounding_example():
    """The exact sum −4.703990459… rounds to −4.71875 in BF16 (error −0.01476); without its tiny
    remainder it would be the halfway case −4.703125, which rounds to even, −4.6875."""
    exact = jnp.float32(-4.703990459)
    assert float(jf.round_to(exact, BF16)) == -4.71875
    assert abs(float(jf.round_to(exact, BF16)) - float(exact) + 0.01476) < 1e-5
    assert float(jf.round_to(jnp.float32(-4.703125), BF16)) == -4.6875
    assert float(jf.round_to(jnp.float32(-4.703125), jnp.float32)) == -4.703125  # no-op for FP32


def bits_to_f32(bits):
    return np.asarray(bits, np.uint32).view(np.float32)


# --------------------------------------------------------------------------------- the SR helper
def test_sr_unbiased_where_round_to_nearest_is_not(rng):
    """Values just above a BF16 halfway point (dropped bits 0x8001–0x80ff): round-to-nearest always
    rounds the magnitude up (a bias of ~+ulp/2 in magnitude); SR rounds up with probability
    dropped/2¹⁶ and averages to the value. Both signs, random BF16 high halves, many exponents."""
    n = 20000
    hi = rng.integers(0x3C00, 0x4300, n).astype(np.uint32)  # |x| in ~[2⁻⁷, 2⁷)
    sign = rng.integers(0, 2, n).astype(np.uint32) << 31
    low = rng.integers(0x8001, 0x8100, n).astype(np.uint32)
    x = bits_to_f32(sign | (hi << 16) | low)
    ulp = bits_to_f32((hi << 16) + 0x10000) - bits_to_f32(hi << 16)  # BF16 spacing at |x|
    mag = lambda y: (np.abs(np.asarray(y, np.float64)) - np.abs(x.astype(np.float64))) / ulp
    rne = mag(round_to(jnp.asarray(x), BF16))
    sr = mag(stochastic_round_to(jnp.asarray(x), BF16))
    assert rne.mean() > 0.45  # always up by ~half an ulp
    t = sr.mean() / (sr.std() / np.sqrt(n))
    assert abs(t) < 5, (sr.mean(), t)
    # Each result is one of the two neighbours, and it is a BF16 value.
    y = np.asarray(stochastic_round_to(jnp.asarray(x), BF16))
    assert np.all(y.astype(ml_dtypes.bfloat16).astype(np.float32) == y)
    assert np.all(np.abs(y - x) < np.abs(ulp))


@pytest.mark.parametrize("dropped", [0x0800, 0x3000, 0x8000, 0xF000])
def test_sr_fixed_value_averages_to_it_over_positions(rng, dropped):
    """One fixed value along the feature axis (the hashed position, default): the dither varies with
    the position, so the fraction rounded up is dropped/2¹⁶ (binomial tolerance). Rows of a tile are
    not hashed (block-size independence): every row rounds alike."""
    hi = int(rng.integers(0x3F00, 0x4100)) << 16
    x = jnp.full((4, 8192), float(bits_to_f32(hi | dropped)), jnp.float32)
    y = np.asarray(stochastic_round_to(x, BF16, salt=int(rng.integers(0, 2**31))))
    np.testing.assert_array_equal(y[0], y[3])
    up = np.mean(y[0] > float(x[0, 0]))
    p = dropped / 65536
    assert abs(up - p) < 5 * np.sqrt(p * (1 - p) / y.shape[1]), (up, p)
    assert set(np.unique(y).tolist()) <= {float(bits_to_f32(hi)), float(bits_to_f32(hi + 0x10000))}
    # position_axes=(): the value's bits alone decide, so one value rounds one way everywhere
    z = np.asarray(stochastic_round_to(x, BF16, position_axes=()))
    assert len(np.unique(z)) == 1


def test_sr_exact_values_and_specials():
    x = jnp.asarray([1.5, -4.6875, 0.0, -0.0, jnp.inf, -jnp.inf, jnp.nan], jnp.float32)
    y = np.asarray(stochastic_round_to(x, BF16))
    np.testing.assert_array_equal(y[:6], np.asarray(x)[:6])
    assert np.signbit(y[3]) and np.isnan(y[6])
    z = jnp.asarray([1.0 + 2**-20], jnp.float32)
    assert stochastic_round_to(z, jnp.float32) is z  # FP32: a no-op
    with pytest.raises(NotImplementedError):
        stochastic_round_to(z, jnp.float16)


# ----------------------------------------------------------------------------------- SR policies
