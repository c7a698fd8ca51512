"""jax_flash.attention against an independent float64 NumPy reference, and the two executors against
each other. Small shapes: the Pallas kernels run in interpret mode on CPU."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash as jf

BF16 = jnp.bfloat16

# ‖out − ref‖ / ‖ref‖ bounds for bf16 inputs (fp32 inputs for "fp32"): BF16 storage of O / dQ / dK / dV
# alone costs ~2e-3; "paper" adds BF16 scores, accumulators and per-tile GEMM outputs.
FWD_TOL = {"fa2": 1e-2, "paper": 2.5e-2, "fp32": 1e-2, "paper_fp32acc": 2.5e-2, "fp32_bf16x6": 1e-2}
GRAD_TOL = {"fa2": 2e-2, "paper": 4e-2, "fp32": 1.5e-2, "paper_fp32acc": 4e-2, "fp32_bf16x6": 1.5e-2}
FP32_TOL = 2e-5  # fp32 inputs under the fp32 policy


def rel(a, b):
    """‖a − b‖ / ‖b‖, with ‖b‖ floored at 1 (an exact zero, e.g. dQ of a one-token row)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1.0))


def make_qkv(rng, shape, dtype=BF16, n=3):
    return tuple(jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(n))


def run(q, k, v, do, **kw):
    o, vjp = jax.vjp(lambda q, k, v: jf.attention(q, k, v, **kw), q, k, v)
    return (o,) + vjp(do)


def check_against_reference(q, k, v, do, fwd_tol, grad_tol, **kw):
    outs = run(q, k, v, do, **kw)
    refs = jf.reference_numpy(q, k, v, do, causal=kw.get("causal", True),
                              sm_scale=kw.get("sm_scale"))
    for name, out, ref in zip(("O", "dQ", "dK", "dV"), outs, refs):
        assert out.dtype == q.dtype, name
        assert np.all(np.isfinite(np.asarray(out, np.float32))), name
        tol = fwd_tol if name == "O" else grad_tol
        assert rel(out, ref) < tol, (name, rel(out, ref), kw)
    return outs


# -------------------------------------------------------------------------------- against float64
@pytest.mark.parametrize("policy,stable,impl,causal", list(itertools.product(
    ("fa2", "paper", "fp32"), (False, True), ("jnp", "pallas"), (True, False))) + [
    ("paper_fp32acc", stable, impl, True) for stable in (False, True) for impl in ("jnp", "pallas")] + [
    ("fp32_bf16x6", stable, "pallas", True) for stable in (False, True)])
def test_matches_float64_reference(rng, policy, stable, impl, causal):
    # Odd length, several key tiles (block 16), tail tiles masked.
    q, k, v, do = make_qkv(rng, (2, 37, 2, 32), n=4)
    check_against_reference(q, k, v, do, FWD_TOL[policy], GRAD_TOL[policy], policy=policy,
                            stable=stable, impl=impl, causal=causal, block_q=16, block_k=16)


@pytest.mark.parametrize("impl", ["jnp", "pallas"])
@pytest.mark.parametrize("delta", ["o", "o_hp", "dpp"])
@pytest.mark.parametrize("policy", ["fp32", "fp32_bf16x6"])
def test_fp32_inputs_fp32_policy_tight(rng, impl, delta, policy):
    q, k, v, do = make_qkv(rng, (1, 45, 2, 32), jnp.float32, n=4)
    check_against_reference(q, k, v, do, FP32_TOL, FP32_TOL, policy=policy, impl=impl,
                            delta=delta, block_q=16, block_k=16)


def test_bf16x6_dot_is_fp32_accurate_and_not_one_bf16_product(rng):
    """``fp32_bf16x6``'s dots (three BF16 pieces per operand, six products) are as close to float64
    as IEEE FP32 dots — and far closer than one BF16 product, so the split is really used. Operands
    spread over 2⁻²⁰ … 2²⁰ so that no piece can be lost to a fixed scale."""
    from jax_flash import tile

    a = rng.standard_normal((48, 96)) * np.exp2(rng.integers(-20, 21, size=(48, 1)))
    b = rng.standard_normal((40, 96))
    ref = a @ b.T
    a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    err = {}
    for name in ("fp32", "fp32_bf16x6"):
        out = np.asarray(tile.dot_nt(a32, b32, jf.make_policy(name, jnp.float32)), np.float64)
        err[name] = np.max(np.abs(out - ref) / np.abs(a).max(axis=1, keepdims=True))
    one = np.asarray(jnp.dot(a32.astype(BF16), b32.astype(BF16).T, preferred_element_type=jnp.float32),
                     np.float64)
    err["bf16"] = np.max(np.abs(one - ref) / np.abs(a).max(axis=1, keepdims=True))
    assert err["fp32_bf16x6"] < 4 * err["fp32"] + 1e-12, err
    assert err["fp32_bf16x6"] < 1e-3 * err["bf16"], err
    hi, mid, lo = tile.split_bf16x3(a32)
    assert all(x.dtype == BF16 for x in (hi, mid, lo))
    back = np.asarray(hi, np.float64) + np.asarray(mid, np.float64) + np.asarray(lo, np.float64)
    assert np.max(np.abs(back - np.asarray(a32, np.float64)) / np.abs(np.asarray(a32))) < 2.0 ** -23


@pytest.mark.parametrize("policy", ["fa2", "paper", "fp32"])
@pytest.mark.parametrize("delta", ["o_hp", "dpp"])
def test_delta_switches_match_reference(rng, policy, delta):
    q, k, v, do = make_qkv(rng, (2, 40, 2, 32), n=4)
    check_against_reference(q, k, v, do, FWD_TOL[policy], GRAD_TOL[policy], policy=policy,
                            delta=delta, impl="jnp", block_q=16, block_k=16)


@pytest.mark.parametrize("impl", ["jnp", "pallas"])
def test_head_dim_128_and_fp16(rng, impl):
    q, k, v, do = make_qkv(rng, (1, 33, 1, 128), jnp.float16, n=4)
    check_against_reference(q, k, v, do, FWD_TOL["fa2"], GRAD_TOL["fa2"], impl=impl, block_q=16,
                            block_k=16)


@pytest.mark.parametrize("policy", ["fa2", "paper"])
def test_single_token_and_default_blocks(rng, policy):
    for t in (1, 2, 17):
        q, k, v, do = make_qkv(rng, (2, t, 3, 64), n=4)
        check_against_reference(q, k, v, do, FWD_TOL[policy], GRAD_TOL[policy], policy=policy)


def test_cross_attention_non_causal(rng):
    q, do = make_qkv(rng, (2, 19, 2, 32), n=2)
    k, v = make_qkv(rng, (2, 44, 2, 32), n=2)
    for impl in ("jnp", "pallas"):
        check_against_reference(q, k, v, do, FWD_TOL["fa2"], GRAD_TOL["fa2"], causal=False,
                                impl=impl, block_q=16, block_k=16)


def test_reference_attention_matches_numpy(rng):
    q, k, v = make_qkv(rng, (2, 21, 2, 16), jnp.float32)
    for causal in (True, False):
        out = jf.reference_attention(q, k, v, causal=causal)
        assert rel(out, jf.reference_numpy(q, k, v, causal=causal)) < 1e-6


# ------------------------------------------------------------------------------ executors agree
def tied_inputs(rng, shape, dtype=BF16, score=8.0):
    """Random inputs plus a dominant pair of identical keys (positions 3 and 5): every row that sees
    both has a tied maximum of about ``score``."""
    q, k, v = (np.asarray(rng.standard_normal(shape), np.float32) for _ in range(3))
    d = shape[-1]
    direction = rng.standard_normal(d).astype(np.float32)
    direction /= np.linalg.norm(direction)
    q = q * 0.3 + direction * 4.0  # every query points along `direction`
    key = direction * score * np.sqrt(d) / 4.0
    k[:, 3] = key
    k[:, 5] = key
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def make_policy_dtype(policy, dtype):
    return jf.make_policy(policy, dtype).lp_dtype


@pytest.mark.parametrize("dtype", [BF16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("policy", ["fa2", "paper", "fp32", "paper_fp32acc"])
@pytest.mark.parametrize("stable", [False, True])
def test_pallas_matches_jnp_bitwise_or_ulps(rng, dtype, policy, stable):
    """The interpreted kernel and the jnp executor run the same tile code with the same rounding
    points. Documented exception: XLA:CPU chooses its GEMM kernel by problem size (the jnp executor
    batches many tiles into one dot), so the FP32 sums inside a dot can be ordered differently and
    differ in the last bit. Measured on 6 seeds × 3 dtypes at 2×50×2×32: "paper" always bitwise
    (its BF16 roundings absorb FP32 ulps); "fa2" bitwise for BF16, 0–2 of 6400 elements off by one
    ulp for FP16, ~1/3 of elements a few ulps off for FP32 operands ("fp32", "fa2" on FP32 inputs).
    Asserted: 16-bit outputs ≥ 99.5 % bitwise and all within 1 ulp; FP32 operands within 8 FP32 ulps
    of the element or of the largest output (plus one ulp of a 16-bit output dtype)."""
    q, k, v = tied_inputs(rng, (2, 50, 2, 32), dtype)
    kw = dict(policy=policy, stable=stable, block_q=16, block_k=16)
    o_jnp, l_jnp = jf.attention_with_lse(q, k, v, impl="jnp", **kw)
    o_pl, l_pl = jf.attention_with_lse(q, k, v, impl="pallas", **kw)
    fp32_operands = policy == "fp32" or (dtype == jnp.float32 and policy == "fa2")
    a, b = np.asarray(o_jnp, np.float64), np.asarray(o_pl, np.float64)
    # one ulp of x is at most eps·|x|, in the coarser of the output dtype and the O the policy stores
    # (the "paper" presets store a BF16 O also for FP32 inputs; "paper_fp32acc" rounds its FP32 acc/ℓ
    # to it once, so an FP32 last-bit difference can flip that rounding, as for "fa2" on 16 bits)
    res_dtype = jf.make_policy(policy, dtype).o_residual_dtype
    out_eps = max(float(jnp.finfo(dtype).eps), float(jnp.finfo(res_dtype).eps))
    if fp32_operands:
        # Last-bit differences of several FP32 dots accumulate over the key tiles and cancel in small
        # outputs (bound by the output's scale), then the final rounding to a 16-bit output may flip.
        fp32_eps = 2.0**-23
        bound = 8 * fp32_eps * (np.abs(b) + np.abs(b).max())
        if out_eps > fp32_eps:
            bound = bound + out_eps * np.abs(b)
        assert np.mean(a == b) >= 0.2
    else:
        # "paper" stores ℓ in the 16-bit dtype: an FP32 last-bit difference of a tile sum can flip
        # that rounding (see L below), and the row's whole O then moves by one ulp of ℓ on top of its
        # own rounding — seen: one FP16 row, 12 outputs 1.0–1.4 eps apart (JAX_FLASH_SEED=2355164130)
        ulps = 2 if policy == "paper" else 1
        bound = ulps * out_eps * np.maximum(np.abs(a), np.abs(b))
        assert np.mean(a == b) >= 0.995, np.mean(a == b)
    assert np.all(np.abs(a - b) <= bound)
    # L = m + log ℓ: besides the above, XLA:CPU's vectorised and scalar log may differ by an ulp, and
    # under "paper" ℓ is stored in the low-precision dtype, where an FP32 last-bit difference of the
    # tile sum can flip one rounding (measured: 1 of 200 rows, FP16): one ulp of ℓ, eps in log ℓ.
    l_tol = 2 * float(jnp.finfo(make_policy_dtype(policy, dtype)).eps) if policy == "paper" else 1e-6
    np.testing.assert_allclose(np.asarray(l_jnp), np.asarray(l_pl), rtol=1e-6, atol=l_tol)


def test_pallas_gradients_match_jnp(rng):
    q, k, v = tied_inputs(rng, (1, 40, 2, 32))
    do = jnp.asarray(rng.standard_normal(q.shape), BF16)
    for delta in ("o", "o_hp", "dpp"):
        kw = dict(stable=True, delta=delta, block_q=16, block_k=16)
        a = run(q, k, v, do, impl="jnp", **kw)
        b = run(q, k, v, do, impl="pallas", **kw)
        for x, y in zip(a[1:], b[1:]):
            assert x.dtype == y.dtype == BF16  # the kernels write the input dtype directly
            assert rel(x, y) < 5e-3, delta  # bf16 storage of the gradients; FP32 accumulation inside


SPLIT_FAST = [("fa2", True, (16, 16)), ("fa2", True, (16, 32)), ("fa2", False, (32, 16)),
              ("fp32", True, (32, 16)), ("paper", True, (16, 16))]
SPLIT_ALL = list(itertools.product(("fa2", "paper", "fp32"), (True, False), ((16, 16), (32, 16), (16, 32))))


def assert_same_values_under(rng, policy, causal, tiles, transforms, min_same=0.99):
    """O, dQ, dK, dV and L of the kernels (interpret mode) under each of two Config ``transforms``,
    for δ from O and from dP∘P, with a kv tail (T = 50 is no multiple of the tiles) and tied rows
    under the stable shift: bitwise for ≥ 99 % of the elements, the rest within one ulp of the
    element or FP32 last bits of the tile sums where a gradient cancels, plus ``moved_row_slack`` in
    rows whose L the transform moved."""
    import dataclasses

    from jax_flash import api

    q, k, v = tied_inputs(rng, (1, 50, 2, 32))
    do = jnp.asarray(rng.standard_normal(q.shape), BF16)
    bq, bk = tiles
    n = q.shape[1]
    for delta in ("o", "dpp"):
        cfg, _ = api._make_config(q, k, v, causal=causal, stable=True, beta=2.0, sm_scale=None,
                                  policy=policy, delta=delta, impl="pallas", block_q=bq, block_k=bk)
        outs = []
        for transform in transforms:
            c = dataclasses.replace(cfg, **transform)
            o, vjp = jax.vjp(lambda q, k, v, c=c: api._attention(q, k, v, c, "pallas"), q, k, v)
            lse = api._forward(q, k, v, c, "pallas")[2]
            outs.append([o, *vjp(do), lse])
        moved = np.asarray(outs[0][4] != outs[1][4])[..., :n]  # rows whose L differs in last bits
        slack = moved_row_slack(q, k, v, do, causal, moved)
        for name, a, b in zip(("O", "dQ", "dK", "dV", "L"), *outs):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            eps = float(jnp.finfo(BF16 if name != "L" else jnp.float32).eps)
            assert np.mean(a == b) >= min_same, (name, delta, np.mean(a == b))
            bound = eps * np.maximum(np.abs(a), np.abs(b)) + 8 * 2.0**-23 * np.abs(b).max()
            bound = bound + slack.get(name, 0.0)
            assert np.all(np.abs(a - b) <= bound), (name, delta, np.max(np.abs(a - b)))


def moved_row_slack(q, k, v, do, causal, moved):
    """Where a transform moves a row's L by FP32 last bits (``moved``, [B, H, T]), the P that the
    kernels recompute from L for that row can round to the neighbouring BF16 value, one BF16 ulp of
    each term it feeds. The gradients then move by at most eps_bf16 times the sums of the absolute
    terms of those rows (float64 here): |P||V| for O, |dS||K| for dQ, |dS|ᵀ|Q| for dK, |P|ᵀ|dO| for
    dV; zero wherever no row moved. Without it, ``test_scale_late_is_the_same_arithmetic`` fails at
    81752f7 with JAX_FLASH_SEED=2241817229 (dQ, δ from dP∘P: max |Δ| 1.5e-5)."""
    q, k, v, do = (np.asarray(x, np.float64).transpose(0, 2, 1, 3) for x in (q, k, v, do))
    scale = q.shape[-1] ** -0.5
    s = scale * q @ k.swapaxes(-1, -2)
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = do @ v.swapaxes(-1, -2)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    w = moved[..., None].astype(np.float64)  # only the moved rows' terms can move
    eps = float(jnp.finfo(BF16).eps)
    back = lambda x: eps * x.transpose(0, 2, 1, 3)  # [B, H, T, D] -> [B, T, H, D]
    return {"O": back(w * (np.abs(p) @ np.abs(v))), "dQ": back(w * (np.abs(ds) @ np.abs(k)) * scale),
            "dK": back(np.abs(w * ds).swapaxes(-1, -2) @ np.abs(q) * scale),
            "dV": back(np.abs(w * p).swapaxes(-1, -2) @ np.abs(do))}


@pytest.mark.parametrize("policy,causal,tiles", SPLIT_FAST + [
    pytest.param(*c, marks=pytest.mark.slow) for c in SPLIT_ALL if c not in SPLIT_FAST])
def test_split_diagonal_is_the_same_arithmetic(rng, policy, causal, tiles):
    """``Config.split_diagonal`` (a tuning-table choice: mask-free loops over the tiles below the
    causal diagonal and inside kv_len) changes no value (XLA:CPU may fuse the mask-free exp
    differently: an ulp)."""
    assert_same_values_under(rng, policy, causal, tiles,
                             ({"split_diagonal": False}, {"split_diagonal": True}))


BWD_BLOCK_FAST = [("fa2", True, (16, 16), 32, False), ("fa2", True, (16, 32), 64, True),
                  ("paper", True, (32, 16), 64, False), ("fa2", False, (16, 16), 64, False)]
BWD_BLOCK_ALL = [(p, c, t, 2 * max(t), s) for p in ("fa2", "paper", "fp32") for c in (True, False)
                 for t in ((16, 16), (32, 16), (16, 32)) for s in (False, True)]


@pytest.mark.parametrize("policy,causal,tiles,big,split", BWD_BLOCK_FAST + [
    pytest.param(*c, marks=pytest.mark.slow) for c in BWD_BLOCK_ALL if c not in BWD_BLOCK_FAST])
def test_bwd_block_is_the_same_arithmetic(rng, policy, causal, tiles, big, split):
    """``Config.bwd_block`` (a tuning-table choice: dK/dV programs keep `big` keys, dQ programs
    `big` queries, over the same streamed tiles) changes no gradient: every row sums the same tile
    products in the same order, and the fully masked tiles a larger block visits add exact zeros
    (XLA:CPU may block an FP32 GEMM's sum differently when the matmul is taller: last bits)."""
    import dataclasses

    from jax_flash import api
    from jax_flash.pallas.backward import resident_block

    assert_same_values_under(rng, policy, causal, tiles, ({"split_diagonal": split},
                                                          {"split_diagonal": split, "bwd_block": big}))
    x = jnp.zeros((1, 64, 1, 32), BF16)
    cfg, _ = api._make_config(x, x, x, causal=causal, stable=True, beta=2.0, sm_scale=None,
                              policy=policy, delta="o", impl="pallas", block_q=tiles[0],
                              block_k=tiles[1])
    assert resident_block(dataclasses.replace(cfg, bwd_block=big), 64, 64) == big


@pytest.mark.parametrize("policy,causal,tiles,big", [
    ("fa2", True, (16, 16), 32), pytest.param("paper", False, (32, 16), 64, marks=pytest.mark.slow)])
def test_dq_block_on_its_own_is_the_same_arithmetic(rng, policy, causal, tiles, big):
    """``Config.dq_block`` (the dQ kernel's resident queries, apart from the dK/dV kernel's
    ``bwd_block``) changes no gradient either way round."""
    assert_same_values_under(rng, policy, causal, tiles, ({}, {"dq_block": big}))
    assert_same_values_under(rng, policy, causal, tiles, ({}, {"bwd_block": big, "dq_block": tiles[0]}))


@pytest.mark.parametrize("policy,causal,tiles,extra", [
    ("fa2", True, (16, 16), {}), ("fa2", True, (16, 32), {"split_diagonal": True}),
    pytest.param("paper", True, (32, 16), {"bwd_block": 64}, marks=pytest.mark.slow),
    pytest.param("fa2", False, (16, 16), {}, marks=pytest.mark.slow)])
def test_prefetch_rows_is_the_same_arithmetic(rng, policy, causal, tiles, extra):
    """``Config.prefetch_rows`` (the dK/dV kernel loads the next query block's L and δ a loop
    iteration ahead) changes no gradient, with the mask-free split and a resident block too."""
    assert_same_values_under(rng, policy, causal, tiles, (extra, {**extra, "prefetch_rows": True}))


@pytest.mark.parametrize("policy,causal,tiles,extra", [
    ("fa2", True, (16, 16), {}), ("fa2", True, (32, 16), {"split_diagonal": True}),
    ("paper", False, (32, 16), {}),
    pytest.param("fp32", True, (16, 32), {"split_diagonal": True}, marks=pytest.mark.slow)])
def test_prefetch_scores_is_the_same_arithmetic(rng, policy, causal, tiles, extra):
    """``Config.prefetch_scores`` (the forward computes the next key tile's scores a loop iteration
    ahead, the last tile's twice) changes no value, across the mask-free split too."""
    assert_same_values_under(rng, policy, causal, tiles, (extra, {**extra, "prefetch_scores": True}))


@pytest.mark.parametrize("policy,causal,tiles,extra", [
    ("fa2", True, (16, 16), {}), ("fa2", True, (32, 16), {"split_diagonal": True, "prefetch_scores": True}),
    pytest.param("paper", False, (32, 16), {}, marks=pytest.mark.slow)])
def test_tie_count_int_is_the_same_arithmetic(rng, policy, causal, tiles, extra):
    """``Config.tie_count_int`` (the stable forward's tie count summed in int32) changes no value:
    the inputs have tied rows, so the count decides shifts here."""
    assert_same_values_under(rng, policy, causal, tiles, (extra, {**extra, "tie_count_int": True}))


@pytest.mark.parametrize("policy,causal,tiles,extra", [
    ("fa2", True, (16, 16), {}), ("fa2", True, (32, 16), {"split_diagonal": True, "prefetch_scores": True}),
    ("fa2", False, (16, 32), {"shift_factor": True}),
    pytest.param("paper", False, (32, 16), {}, marks=pytest.mark.slow)])
def test_tie_top2_is_the_same_arithmetic(rng, policy, causal, tiles, extra):
    """``Config.tie_top2`` ("≥ 2 ties" from the row's two largest scores, found with the row max)
    changes no value: the inputs have tied rows, so the decision matters here."""
    assert_same_values_under(rng, policy, causal, tiles, (extra, {**extra, "tie_top2": True}))


@pytest.mark.parametrize("policy,causal,tiles,extra", [
    ("fa2", True, (16, 16), {}), ("fa2", True, (32, 16), {"split_diagonal": True, "prefetch_scores": True}),
    ("fa2", False, (16, 32), {"shift_factor": True, "tie_top2": True}),
    pytest.param("fp32", True, (16, 16), {}, marks=pytest.mark.slow)])
def test_scale_late_is_the_same_arithmetic(rng, policy, causal, tiles, extra):
    """``Config.scale_late`` (unscaled scores in the forward: scale·max for the row max, scale·s − m
    for the exps, the tie threshold divided by the scale) gives the same O, L and gradients on tied
    rows up to last bits: the max is the same value, but XLA (like the GPU compilers) fuses
    scale·s − m into one FMA, one rounding where the scaled form has two; and an entry within an ulp
    or two of a tie threshold could be decided differently."""
    assert_same_values_under(rng, policy, causal, tiles, (extra, {**extra, "scale_late": True}),
                             min_same=0.95)


def test_dq_launch_and_block_reach_the_dq_kernel_only(monkeypatch):
    """The dQ kernel takes ``dq_launch`` / ``dq_block`` where set, the dK/dV kernel keeps
    ``bwd_launch`` / ``bwd_block``: grids and the launch each pallas_call is built with."""
    import dataclasses
    import importlib

    from jax_flash import api

    bwd = importlib.import_module("jax_flash.pallas.backward")
    x = jnp.zeros((1, 64, 1, 32), BF16)
    lse = jnp.zeros((1, 1, 64), jnp.float32)
    cfg, _ = api._make_config(x, x, x, causal=True, stable=False, beta=2.0, sm_scale=None,
                              policy="fa2", delta="o", impl="pallas", block_q=16, block_k=16)
    launches = []
    monkeypatch.setattr(bwd, "compiler_params", lambda launch, d, bq, bk, **kw: launches.append(
        (launch, bq, bk)))

    def grids(c):
        launches.clear()
        jaxpr = jax.make_jaxpr(lambda *a: bwd.backward(*a, c))(x, x, x, x, lse, lse)
        return [e.params["grid_mapping"].grid[0] for e in jaxpr.jaxpr.eqns
                if e.primitive.name == "pallas_call"]

    assert grids(cfg) == [4, 4]  # dK/dV over 4 key tiles, dQ over 4 query blocks
    assert grids(dataclasses.replace(cfg, bwd_launch=(4, 2), dq_launch=(8, 3), dq_block=32)) == [4, 2]
    assert launches == [((4, 2), 16, 16), ((8, 3), 32, 16)]
    assert grids(dataclasses.replace(cfg, bwd_block=32, dq_block=16)) == [2, 4]
    assert grids(dataclasses.replace(cfg, bwd_block=32)) == [2, 2]  # one block for both, as before
    assert launches == [(None, 32, 32)]


def test_bwd_block_falls_back_where_it_does_not_fit():
    """A resident block that is no multiple of the tiles, or does not divide the padded lengths, is
    not used (the kernels then keep one tile per program)."""
    import dataclasses

    from jax_flash.pallas.backward import resident_block

    from jax_flash import api

    x = jnp.zeros((1, 64, 1, 32), BF16)
    cfg, _ = api._make_config(x, x, x, causal=True, stable=False, beta=2.0, sm_scale=None,
                              policy="fa2", delta="o", impl="pallas", block_q=16, block_k=32)
    assert resident_block(dataclasses.replace(cfg, bwd_block=64), 128, 128) == 64
    assert resident_block(dataclasses.replace(cfg, bwd_block=48), 96, 96) is None  # not × 32
    assert resident_block(dataclasses.replace(cfg, bwd_block=64), 96, 96) is None  # 96 % 64
    assert resident_block(cfg, 128, 128) is None


# --------------------------------------------------------------------------------- stable shift
def tie_free_inputs(rng, shape):
    """Inputs whose every score row has its maximum ≥ 0.3 above the runner-up (no tie under any
    policy's test): q_i ≈ a_i·u and k_j ≈ c_j·u with increasing c_j, so row i peaks at key i."""
    b, t, h, d = shape
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    a = rng.uniform(0.5, 1.5, (b, t, h, 1))
    c = (np.arange(t) * 0.7 + rng.uniform(0, 0.1, t))[None, :, None, None]
    root = d ** 0.25  # S = (q·k)/√d = a_i·c_j
    q = a * u * root + 0.01 * rng.standard_normal(shape)
    k = c * u * root + 0.01 * rng.standard_normal(shape)
    v = rng.standard_normal(shape)
    return tuple(jnp.asarray(x, BF16) for x in (q, k, v))


@pytest.mark.parametrize("policy", ["fa2", "paper", "fp32"])
@pytest.mark.parametrize("impl", ["jnp", "pallas"])
def test_stable_with_fully_masked_key_tiles(rng, policy, impl):
    """Causal 32-row query blocks over 16-key tiles: rows 0–15 of each block meet a key tile that is
    entirely masked for them (r_m = −inf there). The tie count must find no ties in such a row (its
    entries are −inf and so is the max) — else the shift turns the row into NaN — while the tied pair
    (keys 3 and 5) still gets the shift. Forward and gradients against float64."""
    q, k, v = tied_inputs(rng, (1, 48, 2, 32))
    do = jnp.asarray(rng.standard_normal(q.shape), BF16)
    kw = dict(policy=policy, impl=impl, causal=True, block_q=32, block_k=16)
    stab, base = run(q, k, v, do, stable=True, **kw), run(q, k, v, do, stable=False, **kw)
    refs = jf.reference_numpy(q, k, v, do)
    for name, x, b, ref in zip(("O", "dQ", "dK", "dV"), stab, base, refs):
        assert np.all(np.isfinite(np.asarray(x, np.float32))), name
        # dQ, dK of rows saturated by the tied pair cancel to ~0 and carry the δ error of a BF16 O
        # (see check_large_tied_max), which the shift's dither makes larger: they are held to 3× the
        # baseline's error (measured over 60 seeds: up to 1.6×), O and dV to the fixed tolerances
        tol = {"O": FWD_TOL[policy], "dV": GRAD_TOL[policy]}.get(
            name, max(GRAD_TOL[policy], 3 * rel(b, ref)))
        assert rel(x, ref) < tol, (name, rel(x, ref), rel(b, ref))
    if policy != "fp32":  # (under "fp32" the shift moves O by less than its final BF16 rounding)
        assert np.any(np.asarray(stab[0]) != np.asarray(base[0]))  # the shift fired somewhere


@pytest.mark.parametrize("policy", ["fa2", "paper", "fp32"])
@pytest.mark.parametrize("impl", ["jnp", "pallas"])
def test_stable_is_bitwise_baseline_without_ties(rng, policy, impl):
    q, k, v = tie_free_inputs(rng, (1, 12, 2, 16 * 2))
    do = jnp.asarray(rng.standard_normal(q.shape), BF16)
    kw = dict(policy=policy, impl=impl, block_q=16, block_k=16)
    base = run(q, k, v, do, stable=False, **kw)
    stab = run(q, k, v, do, stable=True, **kw)
    for a, b in zip(base, stab):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("policy", ["fa2", "paper"])
def test_stable_changes_only_tie_rows(rng, policy):
    q, k, v = tied_inputs(rng, (2, 40, 2, 32))
    kw = dict(policy=policy, impl="jnp", block_q=16, block_k=64)  # one key tile: the pair shares it
    base = np.asarray(jf.attention(q, k, v, stable=False, **kw), np.float32)
    stab = np.asarray(jf.attention(q, k, v, stable=True, **kw), np.float32)
    # Rows 0..4 see at most one of the identical keys (3 and 5): no tie, identical bits — except rows
    # whose random scores happen to have a near-tie at their max (kept out; measured: ~1 run in 10).
    s = np.sort(jf.reference.scores_numpy(q, k), axis=-1)  # [b, h, q, k], -inf where masked
    accidental = np.any(s[..., -1] - s[..., -2] < 0.05, axis=1)  # [b, q], any head
    early = ~accidental[:, :5]
    assert early.sum() >= 5
    np.testing.assert_array_equal(base[:, :5][early], stab[:, :5][early])
    # Rows ≥ 5 have the tied maximum; the shift must have changed some of them.
    assert np.any(base[:, 5:] != stab[:, 5:])
    ref = jf.reference_numpy(q, k, v)
    assert rel(stab, ref) < FWD_TOL[policy]


def check_large_tied_max(rng, policy, beta, score, impl, heads=2):
    """Tied maxima of ``score`` with β: everything finite, O and dV accurate, dQ and dK accurate given
    the stored O. (With saturated rows the exact dQ is ~0, and a δ = rowsum(dO∘O) from a BF16 O leaves
    an error α·(δ_lp − δ_hp)·P·K that grows with ‖K‖ — the paper's mechanism, there with and without
    the shift — so dQ, dK are compared with the exact gradient given that δ; with "o_hp" against the
    exact gradient itself.)"""
    q, k, v = tied_inputs(rng, (1, 24, heads, 32), score=score)
    do = jnp.asarray(rng.standard_normal(q.shape), BF16)
    s = jf.reference.scores_numpy(q, k)
    assert np.nanmax(np.where(np.isfinite(s), s, np.nan)) > score * 0.8
    refs = jf.reference_numpy(q, k, v, do)
    kw = dict(policy=policy, beta=beta, impl=impl, block_q=16, block_k=32)
    stab = run(q, k, v, do, stable=True, **kw)
    for x in stab:
        assert np.isfinite(np.asarray(x, np.float32)).all()
    assert rel(stab[0], refs[0]) < FWD_TOL[policy]
    assert rel(stab[3], refs[3]) < GRAD_TOL[policy]
    # dQ = α·dS·K sums terms that cancel (exactly, for the tied pair of identical keys), so its error
    # is measured against the size of the terms, α·|dS|·|K| (and α·|dS|ᵀ·|Q| for dK).
    given = jf.reference_numpy(q, k, v, do, o_for_delta=None if policy == "fp32" else stab[0])
    p, _ = jf.reference._probs64(q, k, True, None)
    dp = np.einsum("bqhd,bkhd->bhqk", np.asarray(do, np.float64), np.asarray(v, np.float64))
    ds = np.abs(p * dp) + p * np.abs(np.einsum("bqhd,bqhd->bhq", np.asarray(do, np.float64),
                                               np.asarray(refs[0]))[..., None])
    alpha = 1 / np.sqrt(q.shape[-1])
    size_dq = alpha * np.einsum("bhqk,bkhd->bqhd", ds, np.abs(np.asarray(k, np.float64)))
    size_dk = alpha * np.einsum("bhqk,bqhd->bkhd", ds, np.abs(np.asarray(q, np.float64)))
    for i, size in ((1, size_dq), (2, size_dk)):
        err = np.asarray(stab[i], np.float64) - given[i]
        assert np.linalg.norm(err) / np.linalg.norm(size) < GRAD_TOL[policy], i
    # δ from a high-precision O removes the amplified δ error: dQ, dK near the exact gradient.
    hp = run(q, k, v, do, stable=True, delta="o_hp", **kw)
    for i, size in ((1, size_dq), (2, size_dk)):
        err = np.asarray(hp[i], np.float64) - refs[i]
        assert np.linalg.norm(err) / np.linalg.norm(size) < GRAD_TOL[policy], i


@pytest.mark.parametrize("policy", ["fa2", "paper", "fp32"])
@pytest.mark.parametrize("beta", [2.0, 7.0])
@pytest.mark.parametrize("score", [50.0, 120.0])
def test_stable_accurate_with_large_tied_max(rng, policy, beta, score):
    """The underflow guard: tied maxima of 50–120 with β = 2 and 7 ((β−1)·r_m up to 720 nats, far
    past exp's FP32 range and the authors' 1e-10 clamp)."""
    check_large_tied_max(rng, policy, beta, score, "jnp")


@pytest.mark.parametrize("policy", ["paper", "paper_sr"])
@pytest.mark.parametrize("impl", ["jnp", "pallas"])
def test_stable_floor_after_shift(rng, policy, impl):
    """Ties in the first key tile, only weak keys after it. Once the shift has made ℓ ≈ 2·e⁻²⁰, the
    authors' 1e-10 floor on each later tile's tiny sum would add a fake 2.5 % to ℓ per tile (O shrinks
    towards 0: a biased error); such rows must be as accurate as without the shift."""
    q, k, v = tied_inputs(rng, (1, 64, 2, 32), score=50.0)
    k = k.at[:, 16:].set(-k[:, 3:4])  # scores ≈ −50 after the first tile of 16 keys
    kw = dict(policy=policy, impl=impl, block_q=16, block_k=16)
    ref = jf.reference_numpy(q, k, v)[:, 16:]
    base = np.asarray(jf.attention(q, k, v, stable=False, **kw), np.float64)[:, 16:]
    stab = np.asarray(jf.attention(q, k, v, stable=True, **kw), np.float64)[:, 16:]
    assert np.all(np.isfinite(stab))
    # the rows' O is ~(v_3 + v_5)/2; a shrink by 2.5–7.5 % shows as a negative mean projection
    shrink = np.sum((stab - ref) * ref) / np.sum(ref * ref)
    assert abs(shrink) < 5e-3, shrink
    assert rel(stab, ref) < 2 * rel(base, ref) + 2e-3


def test_stable_large_tied_max_pallas(rng):
    for policy in ("fa2", "paper"):
        check_large_tied_max(rng, policy, 7.0, 80.0, "pallas", heads=1)


# ---------------------------------------------------------------------------------- composition
def test_jit_grad_vmap(rng):
    q, k, v = make_qkv(rng, (3, 2, 20, 2, 32))  # a leading axis to vmap over

    def loss(q, k, v):
        return jnp.sum(jf.attention(q, k, v, stable=True, block_q=16, block_k=16)
                       .astype(jnp.float32) ** 2)

    g_vmap = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v)
    for i in range(q.shape[0]):
        g_one = jax.grad(loss, argnums=(0, 1, 2))(q[i], k[i], v[i])
        for a, b in zip(g_vmap, g_one):  # equal up to BF16 ulps (XLA:CPU GEMM choice, see above)
            assert rel(a[i], b) < 1e-2


def test_vmap_over_pallas(rng):
    q, k, v = make_qkv(rng, (2, 1, 20, 1, 32))
    f = lambda q, k, v: jf.attention(q, k, v, impl="pallas", block_q=16, block_k=16)
    out = jax.vmap(f)(q, k, v)
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(out[i], np.float32),
                                      np.asarray(f(q[i], k[i], v[i]), np.float32))


@pytest.mark.parametrize("impl", ["jnp", "pallas"])
def test_nan_stays_in_its_batch_element(rng, impl):
    q, k, v = make_qkv(rng, (3, 20, 2, 32))
    k = k.at[1, 4, 0, 0].set(jnp.nan)
    o = np.asarray(jf.attention(q, k, v, impl=impl, block_q=16, block_k=16), np.float32)
    g = jax.grad(lambda q: jnp.sum(jf.attention(q, k, v, impl=impl, block_q=16, block_k=16)
                                   .astype(jnp.float32)))(q)
    assert np.isnan(o[1]).any()
    for b in (0, 2):
        assert np.isfinite(o[b]).all() and np.isfinite(np.asarray(g[b], np.float32)).all()


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(policy="bf16"), ValueError, "unknown policy"),
    (dict(delta="x"), ValueError, "unknown delta"),
    (dict(impl="cuda"), ValueError, "unknown impl"),
    (dict(beta=1.0), ValueError, "beta"),
    (dict(beta=float("inf")), ValueError, "beta"),
    (dict(sm_scale=-1.0), ValueError, "sm_scale"),
    (dict(block_q=24), ValueError, "power of two"),
    (dict(block_k=8), ValueError, "power of two"),
])
def test_bad_arguments(rng, kwargs, exc, msg):
    q, k, v = make_qkv(rng, (1, 8, 1, 32))
    with pytest.raises(exc, match=msg):
        jf.attention(q, k, v, **kwargs)


def test_bad_arrays(rng):
    q, k, v = make_qkv(rng, (1, 8, 2, 32))
    cases = [
        ((q[0], k, v), ValueError, "rank 4"),
        ((q, k[:, :, :1], v), ValueError, "head counts"),
        ((q, k.astype(jnp.float32), v), TypeError, "one dtype"),
        ((q.astype(jnp.int32), k.astype(jnp.int32), v.astype(jnp.int32)), TypeError, "bfloat16"),
        ((q[:1], k[:1], v[:1]), None, None),
        ((jnp.concatenate([q, q]), k, v), ValueError, "batch"),
        ((q[..., :16], k, v), ValueError, "head_dim"),
        ((q[..., :24], k[..., :24], v[..., :24]), ValueError, "unsupported head_dim"),
        ((q[:, :0], k[:, :0], v[:, :0]), ValueError, "empty"),
        ((q, k[:, :5], v), ValueError, "sequence lengths"),
        ((q, k[:, :5], v[:, :5]), ValueError, "causal"),
        ((np.asarray(q).tolist(), k, v), TypeError, "array"),
    ]
    for args, exc, msg in cases:
        if exc is None:
            jf.attention(*args)
            continue
        with pytest.raises(exc, match=msg):
            jf.attention(*args)
