"""jax_flash/tile.py, the per-tile arithmetic both executors run: the tie test, the stable shift and
its guard, scale_late, the flushed exp2 of "fa2", masks — and the rounding bias itself."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_flash as jf
from helpers import BF16, f64, jitted, make_qkv, numerics, o_bound, tied_inputs
from jax_flash import api, diagnostics, rounding, tile
from jax_flash.policy import LOG2E, MAX_SHIFT_NATS


def config(policy="fa2", stable=True, beta=2.0, block_k=16, dtype=BF16):
    x = jax.ShapeDtypeStruct((1, 16, 1, 32), dtype)
    return numerics(x, x, x, causal=False, stable=stable, beta=beta, policy=policy, impl="jnp",
                    block_q=16, block_k=block_k)


def count(cfg, s_nat, mask=None):
    """tie_count on one row given natural-unit scores."""
    units = LOG2E if cfg.policy.log2_units else 1.0
    s = jnp.asarray([s_nat], jnp.float32) * units
    mask = jnp.ones(s.shape, bool) if mask is None else jnp.asarray([mask])
    s = jnp.where(mask, s, -jnp.inf)
    return float(tile.tie_count(s, mask, jnp.max(s, axis=1), cfg)[0])


def test_tie_count_cases():
    fa2 = config("fa2")
    assert count(fa2, [3.0, 3.0, 1.0, 0.0]) == 2
    assert count(fa2, [3.0, 3.0, 3.0, 0.0]) == 3
    assert count(fa2, [3.0, 2.0, 1.0, 0.0]) == 1
    # Masked entries never count, even when equal to (or above) the max.
    assert count(fa2, [3.0, 3.0, 1.0, 0.0], [True, False, True, True]) == 1
    assert count(fa2, [3.0, 9.0, 3.0, 0.0], [True, False, True, True]) == 2
    # FP32 scores: a tie is an entry whose P̄ rounds to exactly 1.0 in BF16, S ≥ r_m − ~2⁻⁹.
    assert count(fa2, [3.0, 3.0 - 1e-3, 0.0]) == 2
    assert count(fa2, [3.0, 3.0 - 4e-3, 0.0]) == 1
    # The authors' test on BF16 scores: S ≥ bf16(r_m − 1e-3), i.e. BF16 equality here.
    paper = config("paper")
    assert count(paper, [5.0, 5.0, 1.0]) == 2
    assert count(paper, [5.0, 4.96875, 1.0]) == 1  # the next BF16 value below 5
    # A row with no unmasked entry has no ties.
    assert count(fa2, [1.0, 1.0], [False, False]) == 0


@pytest.mark.parametrize("policy", ["fa2", "paper", "fp32"])
def test_tie_count_matches_brute_force(rng, policy):
    cfg = config(policy)
    pol = cfg.policy
    units = LOG2E if pol.log2_units else 1.0
    # Rows crowded near their max, with a random mask.
    s = rng.uniform(-0.01, 0, (64, 16)) + rng.uniform(-3, 3, (64, 1))
    s = np.asarray(jf.round_to(jnp.asarray(s, jnp.float32), pol.lp_dtype))  # "paper": BF16 scores
    mask = rng.random((64, 16)) < 0.8
    sm = np.where(mask, s, -np.inf)
    r_m = sm.max(axis=1, keepdims=True)
    if pol.tie_test == "paper":
        threshold = (r_m - 1e-3).astype(ml_dtypes.bfloat16).astype(np.float64)
        want = ((sm >= threshold) & mask).sum(axis=1)
    else:
        p = np.exp(np.float64(sm - r_m))
        want = ((p.astype(np.float32).astype(ml_dtypes.bfloat16) == 1.0) & mask).sum(axis=1)
    s_units = jnp.where(mask, jnp.asarray(s * units, jnp.float32), -jnp.inf)
    got = tile.tie_count(s_units, jnp.asarray(mask), jnp.max(s_units, axis=1), cfg)
    # Boundary entries (P̄ within an ulp of the rounding threshold) may fall either way.
    np.testing.assert_allclose(np.asarray(got), want, atol=1)
    assert np.mean(np.asarray(got) == want) > 0.9
    assert want.max() >= 2


def test_stable_shift_rule():
    for policy in ("fa2", "paper", "fp32"):
        cfg = config(policy, beta=2.0)
        units = LOG2E if cfg.policy.log2_units else 1.0

        def shift(row, mask=None):
            s = jnp.asarray([row], jnp.float32) * units
            m = jnp.ones(s.shape, bool) if mask is None else jnp.asarray([mask])
            s = jnp.where(m, s, -jnp.inf)
            return float(tile.stable_shift(s, m, jnp.max(s, axis=1), cfg)[0]) / units

        assert shift([3.0, 3.0, 1.0]) == pytest.approx(6.0, rel=1e-6)  # ties, r_m > 0: β·r_m
        assert shift([-3.0, -3.0, -5.0]) == 0.0  # ties, r_m < 0: 0
        assert shift([0.0, 0.0, -1.0]) == 0.0  # r_m == 0: unchanged
        assert shift([3.0, 2.0, 1.0]) == pytest.approx(3.0, rel=1e-6)  # no tie: r_m
        assert shift([3.0, 3.0, 1.0], [True, False, True]) == pytest.approx(3.0, rel=1e-6)
        # The underflow guard: an offset (β − 1)·r_m (or −r_m) beyond MAX_SHIFT_NATS is folded back
        # into [MAX/2, MAX) modulo MAX/2 — bounded, yet still varying with r_m (a constant offset
        # biases O: test_guarded_shift_keeps_o_unbiased). "paper" stores m in BF16 (0.5 apart at 110)
        # and tests ties on BF16 scores, hence BF16-exact maxima here.
        tol = 0.5 if policy == "paper" else 1e-3
        half = MAX_SHIFT_NATS / 2
        for r_m, offset in ((100.0, half), (100.5, half + 0.5), (-100.0, half), (-57.25, half + 7.25)):
            assert shift([r_m, r_m, r_m - 1.0]) - r_m == pytest.approx(offset, abs=tol), (policy, r_m)
        offsets = {round(shift([r, r, r - 1.0]) - r, 3) for r in np.arange(40.0, 41.01, 0.25)}  # BF16-exact
        assert len(offsets) >= 3 and min(offsets) >= half - tol and max(offsets) <= 2 * half + tol


def _stable_shift_as_first_written(s, r_m, cfg):
    """The shift in its first, plainer form, as the spec: −inf
    rows excluded by an inf threshold, r_m = 0 by its own test, the target by a select, floor by
    truncation."""
    pol = cfg.policy
    if pol.tie_test == "paper":
        threshold = rounding.round_to(r_m - 1e-3, pol.lp_dtype)
    else:
        eps = float(jnp.finfo(pol.tie_dtype).eps)
        threshold = r_m + (np.log2 if pol.log2_units else np.log)(1.0 - eps / 4.0)
    threshold = jnp.where(r_m == -jnp.inf, jnp.inf, threshold)
    ties = jnp.sum(jnp.where(s >= threshold[:, None], 1.0, 0.0), axis=1)
    m_dtype = pol.lp_dtype if pol.lp_accumulators else jnp.float32
    target = jnp.where(r_m > 0, rounding.round_to(cfg.beta * r_m, m_dtype), 0.0)
    cap = cfg.max_shift
    over = target - r_m - cap
    folded = cap / 2 + (over - tile.floor_positive(over * (2.0 / cap)) * (cap / 2))
    shifted = jnp.where(over > 0, rounding.round_to(r_m + folded, m_dtype), target)
    return jnp.where((ties > 1) & (r_m != 0), shifted, r_m)


@pytest.mark.parametrize("policy", ["fa2", "paper", "fp32"])
@pytest.mark.parametrize("beta", [1.5, 2.0, 7.0])
def test_stable_shift_rewrite_is_the_first_form(rng, policy, beta):
    """The per-row rewrite (a max for the −inf threshold and for the target, no r_m = 0 test, floor
    as given) computes the first form's shift on every branch: ties above, below and at 0, folded
    both ways, untied, near-ties at the threshold, empty (−inf) rows, −0.0, BF16-exact maxima ("paper"
    tests on them) — with either floor."""
    cfg = config(policy, beta=beta)
    units = LOG2E if cfg.policy.log2_units else 1.0
    bq, bk = 64, 32
    s = rng.standard_normal((bq, bk)).astype(np.float32) * 3
    tops = rng.choice(np.array([5.0, 60.0, 1e4, 3e8, -2.0, -60.0, -1e4, 0.0, -0.0, 7.5, 1e-3, 40.25],
                               np.float32), bq) * rng.choice([1.0, 1.0, rng.uniform(0.5, 2)], bq)
    tops = tops.astype(ml_dtypes.bfloat16).astype(np.float32) * units
    r = np.arange(bq)
    s[r, 0] = tops
    # second entry: tied, untied, or a near-tie ±2 FP32 ulps around the FP32 threshold's neighbourhood
    eps_gap = np.abs(tops) * 2.0 ** -9
    s[r, 1] = np.select([r % 4 == 0, r % 4 == 1, r % 4 == 2],
                        [tops, tops - 1.0, tops - eps_gap * 0.5], tops - eps_gap * 1.02)
    s = np.minimum(s, tops[:, None])
    s[r % 16 == 15] = -np.inf  # empty rows
    s[r % 16 == 14, 5:] = -np.inf  # partly masked rows
    s = jnp.asarray(s)
    r_m = jnp.max(s, axis=1)
    want = np.asarray(jax.jit(lambda s, r: _stable_shift_as_first_written(s, r, cfg))(s, r_m))
    moved = want != np.asarray(r_m)
    assert moved.sum() >= 8 and (~moved).sum() >= 8
    for floor in (jnp.floor, tile.floor_positive):
        got = np.asarray(jax.jit(lambda s, r: tile.stable_shift(s, None, r, cfg, floor))(s, r_m))
        np.testing.assert_array_equal(got, want)  # −0.0 == 0.0: the sign of a zero r_m may differ


@pytest.mark.parametrize("sm_scale", [0.125, 64 ** -0.5 * 1.1, 3.0])
def test_scale_late_row_max_and_tie_test(rng, sm_scale):
    """``scale_late``: scale·max(s) is bitwise max(scale·s) on every row (monotone rounding; −inf,
    +inf and −0 rows included), and the raw tie count differs from the scaled one only in entries
    whose scaled score lies within 2 ulps of the threshold (near-ties placed on and around it);
    masked (−inf) entries never count, in rows with finite entries or none."""
    import dataclasses

    cfg = dataclasses.replace(config("fa2"), sm_scale=sm_scale)
    late = dataclasses.replace(cfg, scale_late=True)
    c = np.float32(cfg.score_scale)
    bq, bk = 128, 32
    raw = (rng.standard_normal((bq, bk)) * rng.choice([0.01, 1.0, 30.0, 1e4], (bq, 1))).astype(np.float32)
    top = raw.max(axis=1)
    thr = np.asarray(tile.tie_threshold(jnp.asarray(top * c, jnp.float32), cfg))
    r = np.arange(bq)
    # near-ties: raw values whose scaled value lands on, just above and just below the threshold
    for j, steps in enumerate((-2, -1, 0, 1, 2)):
        x = (thr / c).astype(np.float32)
        for _ in range(abs(steps)):
            x = np.nextafter(x, np.float32(np.sign(steps) * np.inf)).astype(np.float32)
        raw[r % 7 == j, 1 + j] = np.minimum(x, top)[r % 7 == j]
    raw[r % 16 == 15] = -np.inf
    raw[r % 16 == 14, 3:] = -np.inf
    raw[r % 32 == 13, :2] = np.inf
    raw[r % 32 == 29, 0] = -0.0
    s_raw = jnp.asarray(raw)
    s = s_raw * c
    np.testing.assert_array_equal(np.asarray(jnp.max(s_raw, axis=1) * c), np.asarray(jnp.max(s, axis=1)))
    r_m = jnp.max(s, axis=1)
    n_scaled = np.asarray(tile.tie_count(s, None, r_m, cfg))
    n_raw = np.asarray(tile.tie_count(s_raw, None, r_m, late, raw=True))
    assert np.all(n_raw[r % 16 == 15] == 0) and np.all(n_raw[r % 16 == 14] <= 3)
    differ = n_raw != n_scaled
    if differ.any():
        sc, th = np.asarray(s)[differ], np.asarray(tile.tie_threshold(r_m, cfg))[differ, None]
        near = np.abs(sc - th) <= 2 * np.spacing(np.abs(th).astype(np.float32))
        mismatch = (sc >= th) != (np.asarray(s_raw)[differ] >= (th * np.float32(cfg.score_scale_inv)))
        assert np.all(near[mismatch]), "a tie decision moved away from the threshold"
    assert np.mean(differ) < 0.1 and (n_scaled >= 2).sum() >= 10
    with pytest.raises(ValueError, match="scale_late"):
        dataclasses.replace(config("paper"), scale_late=True)


def test_guarded_shift_keeps_o_unbiased(rng, record_bound):
    """Where the paper's shift would move a tied row's max by more than the guard's 20 nats — β = 7
    with r_m ~ U(6, 10) (offset 6·r_m ≥ 36), β = 2 with r_m ~ U(25, 30) — the "fa2" stable O stays
    as unbiased as below the guard (test_rounding_bias_on_tied_rows: |t| < 6). The first guard, a
    fixed offset of 20 nats, gave every guarded row the same factor bf16(e⁻²⁰)/e⁻²⁰ = 1 + 2.5e-3:
    mean signed error +2.4e-3 (away from zero) in this setting, t in the hundreds."""
    for beta, top in ((7.0, (6.0, 10.0)), (2.0, (25.0, 30.0))):
        q, k, v = (jnp.asarray(x, BF16) for x in diagnostics.tied_rows(rng, 4000, top=top))
        exact = jf.reference_numpy(q, k, v, causal=False)
        o = jitted(jf.attention, q, k, v, causal=False, policy="fa2", stable=True, beta=beta,
                   block_k=64)
        mean, t, mean_abs = diagnostics.signed_error_stats(np.asarray(o, np.float64) - exact)
        # |t| < 6: an unbiased O exceeds it with probability ~2e-9
        record_bound(abs(t), 6.0, f"t-statistic, beta={beta}")
        assert abs(mean) < 2e-4, (beta, mean, t, mean_abs)


def test_ties_split_across_key_tiles_are_not_detected(rng):
    """Documented behaviour (the paper's per-tile rule): a row whose two maxima fall in different key
    tiles has one "tie" per tile, so the shift does not fire and P̄ = 1 twice — stable equals the
    baseline bitwise. With one tile covering both, the shift fires."""
    q, k, v = (np.asarray(rng.standard_normal((1, 32, 1, 32)), np.float32) for _ in range(3))
    direction = rng.standard_normal(32).astype(np.float32)
    direction /= np.linalg.norm(direction)
    # queries alike but not equal (32 distinct rows: identical rows once kept every output's BF16
    # bits under the shift by chance), identical dominant keys at 3 and 20 (scores ≈ 6–10)
    q = q * 0.3 + direction * 4.0
    k[:, 3] = k[:, 20] = direction * rng.uniform(6.0, 10.0) * np.sqrt(32) / 4.0
    q, k, v = (jnp.asarray(x, BF16) for x in (q, k, v))
    kw = dict(causal=False, impl="jnp", block_q=16)
    # each call compiled whole: op by op, every op of the executor compiled a program of its own
    split = [np.asarray(jitted(jf.attention, q, k, v, stable=s, block_k=16, **kw), np.float32)
             for s in (False, True)]
    np.testing.assert_array_equal(split[0], split[1])
    joint = [np.asarray(jitted(jf.attention, q, k, v, stable=s, block_k=32, **kw), np.float32)
             for s in (False, True)]
    assert np.any(joint[0] != joint[1])


def test_rounding_bias_on_tied_rows(rng, record_bound):
    """Signed O error against float64 on rows with 2 exactly tied maxima (r_m ~ U(6, 10)), 62 tiny
    remainders (scores r_m − 13 ± 1) and V ~ N(−1.5, 1): two large terms and many small ones, the
    setting in which Qiu & Yao (arXiv 2510.04212) trace the BF16 rounding bias.

    Measured (4000 rows, D = 64, one 64-wide key tile),
    mean signed error / t / mean |error|:
      exact O rounded once to BF16     +6.4e-4 / +105 / 2.1e-3
      "paper" baseline                 −1.4e-3 / −262 / 2.2e-3   (the paper's bias: away from zero)
      "paper" stable                   −2.3e-4 /  −26 / 2.7e-3   (6× smaller, not gone)
      "fa2"   baseline                 +6.4e-4 / +106 / 2.1e-3   (= the final rounding's bias)
      "fa2"   stable                   +3.0e-5 /   +1 / 2.7e-3   (no detectable bias)
    Under "fa2" the shift makes the tied P̄ = e^{−(β−1)r_m} inexact in BF16 while ℓ sums the FP32
    P̄, so O carries a per-row factor bf16(P̄)/P̄ that dithers the halfway case: the bias goes, at
    the price of a larger mean |error|. Asserted with wide margins: |t| < 6 for the unbiased case
    (exceeded by chance with probability ~2e-9), |t| > 10 or 20 for the biased ones.
    """
    n = 4000  # the per-row factor of the stable shift makes rows noisy: fewer rows blur the means
    q, k, v = (jnp.asarray(x, BF16) for x in diagnostics.tied_rows(rng, n))
    exact = jf.reference_numpy(q, k, v, causal=False)
    stats = {}
    for policy in ("paper", "fa2"):
        for stable in (False, True):
            o = jitted(jf.attention, q, k, v, causal=False, policy=policy, stable=stable, block_k=64)
            stats[policy, stable] = diagnostics.signed_error_stats(np.asarray(o, np.float64) - exact)
    rounded = np.asarray(jnp.asarray(exact, BF16), np.float64)
    stats["round"] = diagnostics.signed_error_stats(rounded - exact)

    assert stats["round"][0] > 0 and stats["round"][1] > 10
    assert stats["paper", False][0] < 0 and stats["paper", False][1] < -20
    assert abs(stats["paper", True][0]) < abs(stats["paper", False][0]) / 2.5
    assert stats["fa2", False][1] > 10
    assert stats["fa2", False][0] == pytest.approx(stats["round"][0], rel=0.2)
    record_bound(abs(stats["fa2", True][1]), 6.0, "t-statistic, fa2 stable")
    assert abs(stats["fa2", True][0]) < stats["fa2", False][0] / 3


@pytest.mark.parametrize("causal", [True, False])
def test_transposed_tile_mask_is_the_transpose(causal):
    """The dK/dV tile works keys-along-rows; its mask must be exactly the forward mask transposed,
    on and off the diagonal and past kv_len."""
    cfg = dataclasses.replace(config(), causal=causal, kv_len=100)
    for q_start, k_start in [(0, 0), (64, 32), (32, 64), (96, 96), (128, 64)]:
        m = tile.tile_mask(q_start, k_start, 32, 16, cfg)
        mt = tile.tile_mask(q_start, k_start, 32, 16, cfg, transposed=True)
        assert mt.shape == (16, 32)
        np.testing.assert_array_equal(np.asarray(mt), np.asarray(m).T)


@pytest.mark.parametrize("causal,window,kv_len", [
    (True, None, 512), (True, None, 450), (False, (100, 0), 512), (False, (60, 40), 512),
    (True, (200, 0), 300), (False, (300, 1), 512), (False, None, 450)])
def test_kv_half_last_only_where_the_second_half_is_unseen(causal, window, kv_len):
    """``tile.kv_half_last`` says 1 exactly where the rows' last tile is a masked trailing one and
    its mask holds no visible key in the second half (so a kernel may run that tile on its first
    half), for every 64-row block of 512 rows with 128-key tiles; it fires somewhere in each case
    with a causal or right window edge."""
    bq, bk, t = 64, 128, 512
    cfg = dataclasses.replace(config(), causal=causal, window=window, kv_len=kv_len, q_len=kv_len)
    fired = 0
    for q_start in range(0, t, bq):
        bounds = tile.kv_tile_bounds(q_start, bq, bk, t // bk, cfg)
        lo, _, full_hi, hi = (int(b) for b in bounds)
        half = int(tile.kv_half_last(q_start, bq, bk, cfg, bounds))
        if hi == lo:
            assert half == 0
            continue
        mask = np.asarray(tile.tile_mask(q_start, (hi - 1) * bk, bq, bk, cfg))
        assert mask[:, : bk // 2].any()  # the last tile holds a visible key in its first half
        assert half == int(hi > full_hi and not mask[:, bk // 2:].any()), q_start
        fired += half
    assert fired > 0 or (not causal and window is None)


def test_exp2_flush_to_zero_of_fa2():
    """``Policy.exp_ftz`` ("fa2"): outside compiled kernels exp2 results below 2⁻¹²⁶ (the FP32
    subnormals) are 0, as the GPU's ex2.approx.ftz gives them; above, ``tile.exp2`` unchanged.
    Policies without it keep the subnormals."""
    x = jnp.asarray([-149.5, -130.0, -126.5, -126.0, -125.9, -1.0, 0.0, 3.0, -jnp.inf], jnp.float32)
    fa2, fp32 = jf.make_policy("fa2", BF16), jf.make_policy("fp32", BF16)
    assert fa2.exp_ftz and not fp32.exp_ftz
    plain = np.asarray(jax.jit(tile.exp2)(x))
    with tile.exp2_backend("xla"):
        got = np.asarray(jax.jit(lambda x: tile._exp(x, fa2))(x))
    want = np.where(np.asarray(x) < -126, 0.0, plain)
    np.testing.assert_array_equal(got, want)
    assert np.all(got[:3] == 0) and np.all(got[4:8] > 0)  # (XLA:CPU's own exp2 flushes as well)
    assert np.asarray(tile._exp(x, fp32))[0] == np.exp(np.float32(-149.5))  # natural units: exp


def test_exp2_within_its_bound_of_the_exact_power():
    """``tile.exp2`` = 2^round(x) (exact) × exp(f·ln 2), |f| ≤ 1/2. Its error: exp's own (1 ulp
    allowed), plus the rounding of f·ln 2 (≤ 2⁻²⁶ absolute, |f·ln 2| ≤ 0.35, so ≤ 1/4 ulp of a result
    in [0.70, 1.42]) and of the constant ln 2 (≤ 2⁻²⁵·|f|·ln 2 relative, under 1/10 ulp): 1.35 ulp in
    all, where exp(x·ln 2) carries x's own rounding into the result (many ulps at |x| ≈ 30). Checked
    against float64 on a fixed grid over the softmax's range, the normal range's ends and overflow."""
    x = np.concatenate([np.linspace(-40.0, 2.0, 400_001), np.linspace(-126.0, -120.0, 20_001),
                        np.linspace(120.0, 128.5, 20_001)]).astype(np.float32)
    exact = np.exp2(x.astype(np.float64))
    got = np.asarray(jax.jit(tile.exp2)(x), np.float64)
    finite = exact < np.finfo(np.float32).max
    ulp = np.spacing(exact[finite].astype(np.float32)).astype(np.float64)
    err = np.abs(got[finite] - exact[finite]) / ulp
    assert err.max() <= 1.35, err.max()
    assert np.all(np.isinf(got[~finite]))
    plain = np.asarray(jax.jit(jnp.exp2)(x), np.float64)[finite]
    assert err.max() < (np.abs(plain - exact[finite]) / ulp).max()  # what it is for
    special = jnp.asarray([-jnp.inf, jnp.inf, jnp.nan, 0.0, 1.0, -1.0, 127.0, -126.0, -300.0])
    np.testing.assert_array_equal(np.asarray(jax.jit(tile.exp2)(special)),
                                  [0.0, np.inf, np.nan, 1.0, 2.0, 0.5, 2.0**127, 2.0**-126, 0.0])


@pytest.mark.parametrize("stable", [False, True])
def test_scale_late_changes_only_last_bits(rng, assert_close, stable):
    """``Numerics.scale_late`` (the "fa2" default at head_dim 128: unscaled scores, scale·max for the
    row max, scale·s − m in the exps, the tie threshold divided by the scale) computes the same
    attention: with and without it O is within the policy's bound of the exact result, so the two
    within twice it; on tied rows under the stable shift too."""
    q, k, v = tied_inputs(rng, (1, 48, 1, 32), score=20.0)
    cfg = numerics(q, k, v, stable=stable, block_q=16, block_k=16, impl="jnp")
    assert not cfg.scale_late  # head_dim 32: off by default
    late = dataclasses.replace(cfg, scale_late=True)
    o, o_late = (api._attention(q, k, v, c, jf.Launch(), "jnp") for c in (cfg, late))
    bound, _ = o_bound(q, k, v, cfg)
    assert_close(o_late, o, 2 * bound, "O")
    assert_close(o_late, jf.reference_numpy(q, k, v), bound, "O vs float64")


def test_bf16x6_dot_is_fp32_accurate_and_not_one_bf16_product(rng, assert_close):
    """``fp32_bf16x6``'s dots (three BF16 pieces per operand, six products) are within an FP32 dot's
    error bound (d + 12)·2⁻²⁴·Σ|a||b| of float64 — which one BF16 product (2⁻⁸ relative per operand)
    is not, so the split is really used. Operands spread over 2⁻²⁰ … 2²⁰ so that no piece can be
    lost to a fixed scale."""
    a = rng.standard_normal((48, 96)) * np.exp2(rng.integers(-20, 21, size=(48, 1)))
    b = rng.standard_normal((40, 96))
    a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    a, b = f64(a32), f64(b32)
    ref, size = a @ b.T, np.abs(a) @ np.abs(b).T
    bound = (96 + 12) * 2.0 ** -24 * size
    for name in ("fp32", "fp32_bf16x6"):
        assert_close(tile.dot_nt(a32, b32, jf.make_policy(name, jnp.float32)), ref, bound, name)
    one = f64(jnp.dot(a32.astype(BF16), b32.astype(BF16).T, preferred_element_type=jnp.float32))
    assert np.any(np.abs(one - ref) > bound)
    hi, mid, lo = tile.split_bf16x3(a32)
    chex.assert_type([hi, mid, lo], BF16)
    back = f64(hi) + f64(mid) + f64(lo)
    assert np.all(np.abs(back - a) <= 2.0 ** -24 * np.abs(a))  # 24 significant bits kept


# ------------------------------------------------------------------- the stable shift, end to end
@pytest.mark.parametrize("policy", ["fa2", "paper", "fp32"])
@pytest.mark.parametrize("impl", ["jnp", "pallas"])
def test_stable_with_fully_masked_key_tiles(rng, assert_close, policy, impl):
    """Causal 32-row query blocks over 16-key tiles: rows 0–15 of each block meet a key tile that is
    entirely masked for them (r_m = −inf there). The tie count must find no ties in such a row (its
    entries are −inf and so is the max) — else the shift turns the row into NaN — while the tied pair
    (keys 3 and 5) still gets the shift: O and the gradients within the policy's bound."""
    from helpers import grad_bounds, reference_outputs, run

    q, k, v = tied_inputs(rng, (1, 48, 1, 32))
    do = make_qkv(rng, q.shape, n=1)[0]
    kw = dict(policy=policy, impl=impl, causal=True, block_q=32, block_k=16)
    cfg = numerics(q, k, v, stable=True, **kw)
    stab = run(q, k, v, do, stable=True, **kw)
    bounds = (o_bound(q, k, v, cfg)[0],) + grad_bounds(q, k, v, do, cfg)
    for name, x, ref, bound in zip(("O", "dQ", "dK", "dV"), stab, reference_outputs(q, k, v, do, cfg),
                                   bounds):
        assert_close(x, ref, bound, name)
    if policy != "fp32":  # (under "fp32" the shift moves O by less than its final BF16 rounding)
        base = jitted(jf.attention, q, k, v, stable=False, **kw)
        assert np.any(f64(stab[0]) != f64(base))  # the shift fired somewhere


@pytest.mark.parametrize("policy,impl", [("fa2", "jnp"), ("paper", "jnp"), ("fp32", "jnp"),
                                         ("fa2", "pallas"),
                                         pytest.param("paper", "pallas", marks=pytest.mark.slow),
                                         pytest.param("fp32", "pallas", marks=pytest.mark.slow)])
def test_stable_is_bitwise_baseline_without_ties(rng, policy, impl):
    """On rows without ties the shift performs the same operations as the baseline: O and the
    gradients bitwise equal."""
    from helpers import run, tie_free_inputs

    q, k, v = tie_free_inputs(rng, (1, 12, 2, 32))
    do = make_qkv(rng, q.shape, n=1)[0]
    kw = dict(policy=policy, impl=impl, block_q=16, block_k=16)
    chex.assert_trees_all_equal(run(q, k, v, do, stable=False, **kw), run(q, k, v, do, stable=True, **kw))


@pytest.mark.parametrize("policy", ["fa2", "paper"])
def test_stable_changes_only_tie_rows(rng, policy):
    q, k, v = tied_inputs(rng, (2, 40, 2, 32))
    kw = dict(policy=policy, impl="jnp", block_q=16, block_k=64)  # one key tile: the pair shares it
    base = f64(jitted(jf.attention, q, k, v, stable=False, **kw))
    stab = f64(jitted(jf.attention, q, k, v, stable=True, **kw))
    # Rows 0..4 see at most one of the identical keys (3 and 5): no tie, identical bits — except rows
    # whose random scores happen to have a near-tie at their max (kept out)
    s = np.sort(jf.reference.scores_numpy(q, k), axis=-1)  # [b, h, q, k], -inf where masked
    accidental = np.any(s[..., -1] - s[..., -2] < 0.05, axis=1)  # [b, q], any head
    early = ~accidental[:, :5]
    assert early.sum() >= 5
    np.testing.assert_array_equal(base[:, :5][early], stab[:, :5][early])
    assert np.any(base[:, 5:] != stab[:, 5:])  # rows ≥ 5 have the tied maximum


@pytest.mark.parametrize("policy", ["paper", "paper_sr"])
@pytest.mark.parametrize("impl", ["jnp", "pallas"])
def test_stable_floor_after_shift(rng, policy, impl):
    """Ties in the first key tile, only weak keys after it. Once the shift has made ℓ ≈ 2·e⁻²⁰, the
    authors' 1e-10 floor on each later tile's tiny sum would add a fake 2.5 % to ℓ per tile (three
    later tiles here: O shrinks by ~7 %); such rows must not shrink. Measured as O's mean projection
    on the exact O, whose rounding noise averages out over the 48 × 2 × 32 outputs: |shrink| < 5e-3,
    a fifth of one tile's fake share."""
    q, k, v = tied_inputs(rng, (1, 64, 2, 32), score=50.0)
    k = k.at[:, 16:].set(-k[:, 3:4])  # scores ≈ −50 after the first tile of 16 keys
    kw = dict(policy=policy, impl=impl, block_q=16, block_k=16)
    ref = jf.reference_numpy(q, k, v)[:, 16:]
    stab = f64(jitted(jf.attention, q, k, v, stable=True, **kw))[:, 16:]
    assert np.all(np.isfinite(stab))
    shrink = np.sum((stab - ref) * ref) / np.sum(ref * ref)
    assert abs(shrink) < 5e-3, shrink
