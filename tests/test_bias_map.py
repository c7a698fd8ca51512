"""The bias map (experiments/bias_map.py) and the stochastic-rounding policies: cells with a known
answer, the CSV of --quick, the "paper" ablation and the stable shift's β (the stochastic-rounding
helper itself: tests/test_rounding.py)."""

import csv

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_flash as jf
from experiments import bias_map as bm
from jax_flash.policy import make_policy
from jax_flash.rounding import round_to, stochastic_round_to

BF16 = jnp.bfloat16


# ------------------------------------------------------------------------------------- the map
def cell(rng, policy, stable=False, *, ties=2, rows=1024, kv_len=64, gap=13.0, v_mean=-1.5):
    q, k, v, counts = bm.bias_rows(rng, rows, kv_len=kv_len, ties=ties, gap=gap, v_mean=v_mean)
    q, k, v = (np.asarray(jnp.asarray(x, BF16)) for x in (q, k, v))
    do = bm.make_do(rng, np.asarray(v, np.float32))
    cfg = bm.kernel_config(policy, stable, kv_len)
    return bm.measure_cell(cfg, (q, k, v, counts), bm.exact(q, k, v), do), (q, k, v)


def test_bias_rows_ties(rng):
    q, k, v, counts = bm.bias_rows(rng, 40, kv_len=512, ties=4)
    s = np.einsum("nd,ntd->nt", *(np.asarray(jnp.asarray(x, BF16), np.float64) for x in (q, k)))
    at_max = (s == s.max(axis=1, keepdims=True)).sum(axis=1)
    np.testing.assert_array_equal(at_max, counts)
    assert list(counts[:20]) == [4] * 20 and list(counts[20:]) == [1] * 20
    for i in range(20):  # the tied keys share one aligned 64-key block
        assert len(set(np.flatnonzero(s[i] == s[i].max()) // 64)) == 1


def test_bias_rows_split_ties(rng):
    """``split=True``: the same exact ties, each in its own aligned 64-key block."""
    q, k, v, counts = bm.bias_rows(rng, 40, kv_len=512, ties=3, split=True)
    s = np.einsum("nd,ntd->nt", *(np.asarray(jnp.asarray(x, BF16), np.float64) for x in (q, k)))
    at_max = (s == s.max(axis=1, keepdims=True)).sum(axis=1)
    np.testing.assert_array_equal(at_max, counts)
    for i in range(20):
        assert len(set(np.flatnonzero(s[i] == s[i].max()) // 64)) == 3


@pytest.mark.parametrize("policy", ["paper", pytest.param("fa2", marks=pytest.mark.slow), "fa2_sr",
                                    pytest.param("paper_sr", marks=pytest.mark.slow)])
def test_kernel_runner_is_jax_flash_attention(rng, policy):
    """The map's single-row tile loop computes what jax_flash.attention returns."""
    _, (q, k, v) = cell(rng, policy, rows=64)
    out = bm.run_kernel(bm.kernel_config(policy, True, 64), q, k, v)
    o = jf.attention(jnp.asarray(q)[:, None, None], jnp.asarray(k)[:, :, None],
                     jnp.asarray(v)[:, :, None], causal=False, policy=policy, stable=True, impl="jnp")
    o = np.asarray(o, np.float64)[:, 0, 0]
    # XLA:CPU may order an FP32 dot differently for a 1-row and a 16-row query block. Round-to-nearest
    # hides such last-bit FP32 differences except near halfway points; the SR dither hashes all 32 bits,
    # so there any FP32 difference re-draws the rounding (still one of the same two BF16 neighbours).
    # Near-halfway cases come per row: under the stable shift the tied P̄ < 1 is rounded to BF16 for
    # P̄·V but summed in FP32 into ℓ, so one FP32 ulp that flips bf16(P̄) moves the whole row's O by
    # 2⁻⁹ relative (seen: 1 row of 64, 48 of its 64 outputs). Hence the check on whole rows.
    if policy.endswith("_sr"):
        assert np.mean(out["o_out"] == o) > 0.8
    else:
        assert np.mean(np.all(out["o_out"] == o, axis=1)) > 0.95  # ≥ 61 of 64 rows bitwise equal
    # ≤ 2 BF16 ulps; "paper_sr" rounds stochastically up to 4 times per tile (P̄V, acc·α, acc + P̄V, O),
    # and a re-drawn dither can move each by an ulp (seen: 3 ulps in 1 of ~30 runs): ≤ 4 ulps there
    np.testing.assert_allclose(out["o_out"], o, rtol=2**-5 if policy == "paper_sr" else 2**-6, atol=0)


def test_fp32_policy_has_only_the_final_rounding_bias(rng):
    row, _ = cell(rng, "fp32")
    # O as returned = bf16(FP32 O): nothing beyond rounding the exact O once …
    assert abs(row["o_excess_all_t"]) < 5 and abs(row["o_excess_all_mean"]) < 2e-5
    assert row["o_tie_mean"] == pytest.approx(row["round_tie_mean"], rel=0.05)
    # … and that rounding is the +6e-4 halfway bias of two tied negative V rows.
    assert row["round_tie_mean"] > 2e-4 and row["round_tie_t"] > 8
    # The O kept for δ is FP32: no δ bias to speak of; the accumulator is unbiased.
    assert abs(row["delta_tie_mean"]) < 1e-4
    assert abs(row["obar_tie_mean"]) < 1e-6


def test_paper_bias_needs_ties(rng):
    """Under "paper" numerics Ō (and O) of rows with ≥ 2 tied maxima is rounded away from
    zero (negative for V ~ N(−1.5, 1)). With a unique maximum (ties=1) Ō instead drops the tiny
    remainder (a smaller bias towards zero, which ℓ's rounding cancels in O): the O bias is ≥ 10× smaller."""
    tied, _ = cell(rng, "paper", ties=2)
    single, _ = cell(rng, "paper", ties=1)
    assert tied["obar_tie_mean"] < -5e-4 and tied["obar_tie_t"] < -15
    assert tied["o_tie_mean"] < -5e-4 and tied["o_tie_t"] < -15
    assert single["obar_tie_mean"] > 0 and single["obar_tie_mean"] < abs(tied["obar_tie_mean"]) / 2
    assert abs(single["o_tie_mean"]) < abs(tied["o_tie_mean"]) / 10
    assert abs(tied["o_free_mean"]) < abs(tied["o_tie_mean"]) / 10  # tie-free half of the cell
    assert tied["delta_tie_mean"] > 0 and tied["delta_tie_t"] > 10  # the paper's positive δ bias


def test_sr_removes_the_accumulator_and_final_rounding_bias(rng):
    fa2, _ = cell(rng, "fa2")
    fa2_sr, _ = cell(rng, "fa2_sr")
    paper_sr, _ = cell(rng, "paper_sr")
    assert fa2["o_tie_t"] > 8  # round-to-nearest: the halfway bias
    assert abs(fa2_sr["o_tie_t"]) < 5 and abs(fa2_sr["o_tie_mean"]) < fa2["o_tie_mean"] / 4
    assert abs(paper_sr["obar_tie_t"]) < 5
    # … but under "paper" numerics ℓ = bf16(1 + remainder) drops the remainder: O of tie-free rows is
    # biased away from zero until ℓ is stochastically rounded too ("paper_sr_all").
    assert paper_sr["o_free_mean"] < -1.5e-4 and paper_sr["o_free_t"] < -10
    paper_sr_all, _ = cell(rng, "paper_sr_all")
    assert abs(paper_sr_all["o_free_t"]) < 5 and abs(paper_sr_all["o_tie_t"]) < 5


@pytest.mark.slow  # experiment tooling, 5–15 s: JAX_FLASH_SLOW=1 (make test-all)
def test_quick_csv(tmp_path):
    results = bm.main(["--quick", "--out", str(tmp_path), "--rows", "128"])
    with open(tmp_path / "bias_map.csv") as f:
        rows = list(csv.DictReader(f))
    g = bm.QUICK
    n_cells = (len(g["policies"]) * len(g["stable"]) * len(g["ties"]) * len(g["v_mean"]) *
               len(g["gap"]) * len(g["kv_len"]))
    assert len(rows) == len(results) == n_cells
    assert list(rows[0].keys()) == bm.COLUMNS
    assert {r["policy"] for r in rows} == set(g["policies"])
    assert {r["block_k"] for r in rows if r["policy"].startswith("paper")} == {"64"}  # kv_len 64
    assert (tmp_path / "bias_map.png").stat().st_size > 10_000


# ------------------------------------------------------------------------ the "paper" ablation
@pytest.mark.slow  # (the ablation's cells: 20 seconds)
def test_paper_ablation_cells(rng):
    """experiments/paper_ablation.py on a few rows (fewer than its default): the "paper" tie-row bias
    is there without the shift (t < −20) and mostly gone with it (at most half left); a rounding
    switched off that cannot matter for one key tile (the tile-sum clamp) changes no bit (at 4,096
    rows it once did: XLA had
    deleted the BF16 rounding of ℓ in that variant's graph — jax_flash/rounding.py, guarded by
    tests/test_tile.py::test_round_to_survives_jit); keeping Ō in FP32 leaves the tie-free bias of the
    final O rounding alone, about half of "paper"'s."""
    from experiments import paper_ablation as pa

    res = {(r["top"], r["variant"], r["stable"]): r for r in pa.run(rows=1024, seed=int(rng.integers(1 << 30)),
                                                                      progress=False)}
    lo = "6–10"
    paper, no_clamp = pa.VARIANTS[0][0], "no 1e-10 tile-sum clamp"
    fp32_obar = "P̄·V output and accumulators in FP32"
    assert res[lo, paper, 0]["o_tie_t"] < -20
    # (÷ 2: the stable mean, ~2e-4, has a standard error of ~1.5e-4 at 512 tied rows)
    assert abs(res[lo, paper, 1]["o_tie_mean"]) < abs(res[lo, paper, 0]["o_tie_mean"]) / 2
    for top in ("6–10", "20–30"):
        for stable in (0, 1):
            for col in pa.COLUMNS:
                assert res[top, no_clamp, stable][col] == res[top, paper, stable][col], (top, col)
    assert res[lo, fp32_obar, 0]["o_free_t"] < -10
    assert 0.3 < res[lo, fp32_obar, 0]["o_free_mean"] / res[lo, paper, 0]["o_free_mean"] < 0.7


# ------------------------------------------------------------------------ the stable shift's β
@pytest.mark.slow  # experiment tooling, 15–30 s: JAX_FLASH_SLOW=1 (make test-all)
def test_stable_beta_cells(rng):
    """experiments/stable_beta.py on a few rows: with both ties in one key tile the "fa2" tie bias
    (t > 20) is gone at every β (|t| < 4); with the ties split over two tiles the shift never fires
    and changes nothing; the tie-free rows' bias is the same at every β. ("Nothing" up to the
    compiler: XLA:CPU may fuse the stable program's exp differently, and an FP32 ulp then flips a
    BF16 rounding; a few flipped BF16 roundings among 65,536 outputs move a t of −60 by ≈ 2e-4 each,
    so the cell statistics are compared to 5e-3 relative, not bitwise; the shift firing moves them
    by far more, see the "one tile" asserts.)"""
    from experiments import stable_beta as sb

    res = {(r["ties"], r["beta"]): r for r in sb.run(rows=1024, seed=int(rng.integers(1 << 30)),
                                                     progress=False, tops=((6.0, 10.0),), gaps=(13.0,))}
    assert res["one tile", "off"]["o_tie_t"] > 20 and res["split", "off"]["o_tie_t"] > 20
    for beta in ("2", "3", "7"):
        assert abs(res["one tile", beta]["o_tie_t"]) < 4, beta
        assert res["one tile", beta]["shift_fired_tie"] == 1.0
        assert res["split", beta]["shift_fired_tie"] == 0.0
        same = lambda a, b: a == b or abs(a - b) <= 5e-3 * abs(b)
        for col in sb.COLUMNS:
            assert same(res["split", beta][col], res["split", "off"][col]), (beta, col)
        assert same(res["one tile", beta]["o_free_mean"], res["one tile", "off"]["o_free_mean"])
