"""On the GPU (H200): the compiled Triton kernels against the jnp executor and an FP32 reference at
training-sized shapes, every policy, forward and backward. Run with `pytest -m gpu`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash as jf

pytestmark = pytest.mark.gpu

SHAPES = [(32, 1024, 12, 64), (4, 4096, 16, 128)]
# ‖x − ref‖/‖ref‖ bounds against an FP32 (HIGHEST) reference, per policy (BF16 inputs).
FWD_TOL = {"fa2": 1e-2, "paper": 3e-2, "fp32": 1e-2, "fp32_bf16x6": 1e-2}
GRAD_TOL = {"fa2": 2e-2, "paper": 5e-2, "fp32": 1.5e-2, "fp32_bf16x6": 1.5e-2}


def rel(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1.0))


def fwd_bwd(impl, policy, stable, block_k, q, k, v, do):
    f = lambda q, k, v: jf.attention(q, k, v, policy=policy, stable=stable, impl=impl,
                                     block_k=block_k)
    o, vjp = jax.vjp(f, q, k, v)
    return (o,) + vjp(do)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("policy", ["fa2", "paper", "fp32", "fp32_bf16x6"])
@pytest.mark.parametrize("stable", [False, True])
def test_gpu_kernels_vs_jnp_vs_reference(rng, shape, policy, stable):
    q, k, v, do = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(4))
    ref_f = lambda q, k, v: jf.reference_attention(q, k, v, dtype=jnp.float32)
    o_ref, vjp = jax.vjp(ref_f, *(x.astype(jnp.float32) for x in (q, k, v)))
    refs = (o_ref,) + vjp(do.astype(jnp.float32))
    # "paper" uses 512-wide key tiles; at head_dim 128 the K+V tiles exceed shared memory, so the
    # kernel is checked with 256-wide tiles there (impl="auto" would run the jnp executor instead).
    block_k = 256 if policy == "paper" and shape[-1] == 128 else None
    if block_k:
        with pytest.raises(ValueError, match="shared memory"):
            jf.attention(q, k, v, policy=policy, impl="pallas")
    run = jax.jit(fwd_bwd, static_argnums=(0, 1, 2, 3))
    pallas = run("pallas", policy, stable, block_k, q, k, v, do)
    emul = run("jnp", policy, stable, block_k, q, k, v, do)
    for name, a, b, r in zip(("O", "dQ", "dK", "dV"), pallas, emul, refs):
        tol = FWD_TOL[policy] if name == "O" else GRAD_TOL[policy]
        err_p, err_j, err_pj = rel(a, r), rel(b, r), rel(a, b)
        print(f"{shape} {policy} stable={stable} {name}: pallas-ref {err_p:.2e} jnp-ref {err_j:.2e} "
              f"pallas-jnp {err_pj:.2e}")
        assert np.isfinite(err_p) and err_p < tol, name
        assert err_j < tol, name
        # Same algorithm and rounding points; GPU exp/log and MMA summation order differ from XLA's.
        assert err_pj < tol / 2, name


@pytest.mark.parametrize("stable", [False, True])
def test_gpu_fp32_bf16x6_is_fp32_accurate(rng, stable):
    """FP32 inputs: "fp32_bf16x6" (dots from BF16 pieces on the tensor cores) as close to an FP32
    reference as FP32 itself, and as the "fp32" policy's IEEE dots."""
    shape = (2, 1024, 12, 64)
    q, k, v, do = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(4))
    ref_f = lambda q, k, v: jf.reference_attention(q, k, v, dtype=jnp.float32)
    o_ref, vjp = jax.vjp(ref_f, q, k, v)
    refs = (o_ref,) + vjp(do)
    run = jax.jit(fwd_bwd, static_argnums=(0, 1, 2, 3))
    x6 = run("pallas", "fp32_bf16x6", stable, None, q, k, v, do)
    ieee = run("pallas", "fp32", stable, None, q, k, v, do)
    for name, a, b, r in zip(("O", "dQ", "dK", "dV"), x6, ieee, refs):
        print(f"stable={stable} {name}: bf16x6-ref {rel(a, r):.2e} ieee-ref {rel(b, r):.2e}")
        assert rel(a, r) < 2e-5 and rel(a, r) < 4 * rel(b, r) + 1e-6, name


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("stable", [False, True])
def test_gpu_split_diagonal_same_values(rng, shape, stable):
    """The tuning table's ``split_diagonal`` (mask-free loops below the causal diagonal) on the
    compiled kernels: the same O and gradients as the masked loops, up to the last bit of a few
    elements (Triton may contract or order the mask-free arithmetic differently)."""
    from jax_flash.pallas import tuning

    q, k, v, do = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(4))
    outs = []
    for split in (False, True):
        with tuning.override({"split_diagonal": split}):
            outs.append(jax.jit(fwd_bwd, static_argnums=(0, 1, 2, 3))("pallas", "fa2", stable, None,
                                                                       q, k, v, do))
    for name, a, b in zip(("O", "dQ", "dK", "dV"), *outs):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        same = float(np.mean(a == b))
        print(f"{shape} stable={stable} {name}: bitwise equal {100 * same:.3f} %, "
              f"rel {rel(a, b):.2e}")
        assert same >= 0.99 and rel(a, b) < 1e-3, name


def _ab_entries():
    from bench.ab import candidate_entries

    return list(candidate_entries().items())


@pytest.mark.parametrize("name,entry", _ab_entries(), ids=lambda x: x if isinstance(x, str) else "")
def test_gpu_ab_entries_same_values(rng, name, entry):
    """Every candidate launch of bench/entries-*.json (resident blocks, the dQ kernel's own launch,
    L/δ prefetch), compiled: the same O and gradients as the default launch at the same tiles, up
    to the last bit of a few elements — the check a candidate passes before it enters tuning.json."""
    from jax_flash.pallas import tuning

    shape = (2, 2048, 16, 128)
    q, k, v, do = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(4))
    base = {f: entry[f] for f in ("block_q", "block_k") if f in entry}
    outs = []
    for e in (base, entry):
        with tuning.override(e):
            outs.append(jax.jit(fwd_bwd, static_argnums=(0, 1, 2, 3))("pallas", "fa2", True, None,
                                                                       q, k, v, do))
    for what, a, b in zip(("O", "dQ", "dK", "dV"), *outs):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        same = float(np.mean(a == b))
        print(f"{name} {what}: bitwise equal {100 * same:.3f} %, rel {rel(a, b):.2e}")
        assert same >= 0.99 and rel(a, b) < 1e-3, (name, what)


def forward_under(entries, q, k, v, stable=True):
    """(O as FP32, L) of the compiled causal Pallas forward under each tuning entry, in turn."""
    from jax_flash.pallas import tuning

    outs = []
    for entry in entries:
        with tuning.override(entry):  # read at trace time: a fresh jit per entry
            o, lse = jax.jit(lambda q, k, v: jf.attention_with_lse(q, k, v, causal=True, stable=stable,
                                                                  impl="pallas"))(q, k, v)
        outs.append((np.asarray(o, np.float32), np.asarray(lse)))
    return outs


def assert_forms_agree(name, first, second, ref, min_same):
    """Two forms' (O, L) on the same inputs: O bitwise in ≥ ``min_same`` of its elements, the rest
    within 2⁻⁵ of the row's largest output (a shifted row's P̄ all move with one last bit of m); L
    within FP32 rounding; the second as accurate against ``ref`` as the first."""
    (o_a, l_a), (o_b, l_b) = first, second
    row = np.abs(o_a).max(-1, keepdims=True)
    print(f"{name}: O bitwise {100 * np.mean(o_b == o_a):.3f} %, max |Δ|/row "
          f"{np.max(np.abs(o_b - o_a) / row):.2e}; rel err {rel(o_b, ref):.3e} (first {rel(o_a, ref):.3e})")
    assert np.mean(o_b == o_a) >= min_same and np.all(np.abs(o_b - o_a) <= 2.0 ** -5 * row)
    np.testing.assert_allclose(l_b, l_a, rtol=1e-6, atol=1e-5)
    assert rel(o_b, ref) <= 1.05 * rel(o_a, ref) + 1e-6


# the shipped 32×1024 launch (jax_flash/pallas/tuning.json "fa2/d64/t1024/causal", before its numerics fields)
D64 = {"block_q": 64, "block_k": 64, "split_diagonal": True, "prefetch_scores": True,
       "fwd": {"num_warps": 4, "num_stages": 3}}


def test_gpu_shift_factor_on_tied_rows(rng):
    """The stable shift as a per-row factor (``Config.shift_factor``), compiled, on rows with tied
    maxima (where the count decides shifts): within a few BF16 ulps of the direct form, as accurate
    against float64, L as the direct form's."""
    from test_forward_mosaic import tied_qkv

    shape = (1, 2048, 2, 128)
    q, k, v = tied_qkv(rng, shape, score=20.0, pairs=((3, 5), (700, 900)))
    ref = jf.reference_numpy(q, k, v, causal=True)
    base = {"block_q": 64, "block_k": 128, "fwd_kernel": "mosaic"}
    assert_forms_agree("factor vs direct", *forward_under([base, {**base, "shift_factor": True}], q, k, v),
                       ref, min_same=0.99)


def test_gpu_tie_top2_on_tied_rows(rng):
    """"≥ 2 ties" from the row's two largest scores (``Config.tie_top2``, the Triton lowering of
    ``tile.row_top2``'s reduction), compiled at the shipped D = 64 launch, on rows with tied maxima
    and near-ties: the count form's O and L, bitwise."""
    from test_forward_mosaic import tied_qkv

    shape = (2, 1024, 4, 64)
    q, k, v = tied_qkv(rng, shape, score=20.0, pairs=((3, 5), (300, 301), (700, 900)))
    outs = forward_under([D64, {**D64, "tie_top2": True}], q, k, v)
    unstable = np.asarray(jf.attention(q, k, v, causal=True, stable=False, impl="pallas"), np.float32)
    (o_c, l_c), (o_t, l_t) = outs
    print(f"top2 vs count: O bitwise {100 * np.mean(o_t == o_c):.4f} %, L {100 * np.mean(l_t == l_c):.4f} %;"
          f" rows the shift changed: {100 * np.mean(np.any(o_c != unstable, -1)):.2f} %")
    assert np.any(o_c != unstable)  # the shift fired somewhere: the decision is tested
    np.testing.assert_array_equal(o_t, o_c)
    np.testing.assert_array_equal(l_t, l_c)


@pytest.mark.parametrize("stable", [False, True])
def test_gpu_exp2_ftz_same_values(rng, stable):
    """The forward's exps as ``ex2.approx.ftz.f32`` (``Config.exp2_ftz``), compiled at the shipped
    D = 64 launch: the hardware exp2 as before, so O and L are bitwise the library exp2's — on random
    rows, tied rows, and rows whose other scores sit far enough below a dominant one that their P̄
    are subnormal (flushed to 0 here: below anything ℓ ≥ 2·e⁻²⁰ or a BF16 O can show)."""
    from test_forward_mosaic import tied_qkv

    shape = (2, 1024, 4, 64)
    q, k, v = tied_qkv(rng, shape, score=20.0, pairs=((3, 5), (300, 301)))
    # rows past 600: a dominant key 4.5·20 = 90 nats above the tied ones, whose P̄ ≈ 2⁻¹³⁰ are subnormal
    k = k.at[:, 600].set(k[:, 3] * 5.5)
    (o_l, l_l), (o_f, l_f) = forward_under([D64, {**D64, "exp2_ftz": True}], q, k, v, stable)
    print(f"ftz vs libdevice exp2: O bitwise {100 * np.mean(o_f == o_l):.4f} %, L {100 * np.mean(l_f == l_l):.4f} %")
    assert np.all(np.isfinite(o_f)) and np.all(np.isfinite(l_f))
    np.testing.assert_array_equal(o_f, o_l)
    np.testing.assert_array_equal(l_f, l_l)


@pytest.mark.parametrize("entry", [
    {**D64, "exp2_ftz": True},
    {"block_q": 64, "block_k": 128, "fwd_kernel": "mosaic", "shift_factor": True},
    {"block_q": 64, "block_k": 128, "fwd_kernel": "mosaic"}], ids=["triton", "mosaic-factor", "mosaic"])
@pytest.mark.parametrize("stable", [False, True])
def test_gpu_scale_late_on_tied_rows(rng, entry, stable):
    """Unscaled scores in the compiled forward (``Config.scale_late``), Triton and Mosaic kernels, on
    tied rows: O within the last bits of the scaled form's (the row max is the same value; the exps'
    FMA and the tie threshold's division move last bits), L within FP32 rounding, as accurate against
    float64, and — stable — the shift still firing where the scaled form's does."""
    from test_forward_mosaic import tied_qkv

    from jax_flash.pallas import tuning

    d = 64 if entry["block_k"] == 64 else 128
    shape = (2, 1024, 4, d)
    q, k, v = tied_qkv(rng, shape, score=20.0, pairs=((3, 5), (300, 301)))
    ref = jf.reference_numpy(q, k, v, causal=True)
    scaled, late = forward_under([entry, {**entry, "scale_late": True}], q, k, v, stable)
    assert_forms_agree("scale_late vs scaled", scaled, late, ref, min_same=0.9)
    if stable:
        with tuning.override({**entry, "scale_late": True}):
            o_b = np.asarray(jax.jit(lambda q, k, v: jf.attention(q, k, v, causal=True, stable=False,
                                                                  impl="pallas"))(q, k, v), np.float32)
        assert np.mean(np.any(o_b != late[0], -1)) > 0.5  # the shift fired on the tied rows


# ---------------------------------------------------------------- the Mosaic GPU forward (opt-in)
MOSAIC_SHAPES = [(2, 1024, 4, 64), (1, 2048, 2, 128)]


def _fwd_with_lse(q, k, v, mosaic, **kw):
    """O and L (natural log) of the Pallas forward, with the Mosaic GPU forward forced on or off."""
    from jax_flash.pallas import forward_mosaic as fm

    with fm.force(mosaic):  # read at trace time: a fresh jit per call
        return jax.jit(lambda q, k, v: jf.attention_with_lse(q, k, v, impl="pallas", **kw))(q, k, v)


@pytest.mark.parametrize("shape", MOSAIC_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("stable", [False, True])
def test_gpu_mosaic_forward_vs_reference_and_triton(rng, shape, causal, stable):
    """forward_mosaic (TMA, wgmma, warpgroup ping-pong) against float64 and the Triton forward: its
    error within 1.5× Triton's (both round O to BF16 once), L the same up to FP32 rounding."""
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3))
    ref = jf.reference_numpy(q, k, v, causal=causal)
    o_m, l_m = _fwd_with_lse(q, k, v, True, causal=causal, stable=stable)
    o_t, l_t = _fwd_with_lse(q, k, v, False, causal=causal, stable=stable)
    o_m, o_t = np.asarray(o_m, np.float64), np.asarray(o_t, np.float64)
    err_m, err_t = (float(np.linalg.norm(o - ref) / np.linalg.norm(ref)) for o in (o_m, o_t))
    same = float(np.mean(o_m == o_t))
    print(f"{shape} causal={causal} stable={stable}: mosaic-ref {err_m:.3e} (max {np.abs(o_m - ref).max():.2e}, "
          f"mean {np.abs(o_m - ref).mean():.2e}), triton-ref {err_t:.3e} (max "
          f"{np.abs(o_t - ref).max():.2e}, mean {np.abs(o_t - ref).mean():.2e}), mosaic-triton "
          f"bitwise {100 * same:.2f} %, max {np.abs(o_m - o_t).max():.2e}, "
          f"L max {np.abs(np.asarray(l_m) - np.asarray(l_t)).max():.2e}")
    assert np.all(np.isfinite(o_m)) and err_m <= 1.5 * err_t + 1e-6
    np.testing.assert_allclose(np.asarray(l_m), np.asarray(l_t), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", MOSAIC_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_mosaic_stable_tied_rows_match_triton(rng, shape):
    """Rows with exactly tied maxima (repeated keys): the Mosaic kernel's stable shift gives what
    the Triton stable kernel gives, to within BF16 rounding, and differs from its own baseline."""
    b, t, h, d = shape
    q, k, v = (np.asarray(rng.standard_normal(shape), np.float32) for _ in range(3))
    direction = rng.standard_normal(d).astype(np.float32)
    direction /= np.linalg.norm(direction)
    q = q * 0.3 + direction * 4.0
    key = direction * 8.0 * np.sqrt(d) / 4.0
    for a in (3, 5, 700, 701, t - 9, t - 2):  # tied pairs inside one key tile, early and late
        k[:, a] = key
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    o_m = np.asarray(_fwd_with_lse(q, k, v, True, stable=True)[0], np.float64)
    o_t = np.asarray(_fwd_with_lse(q, k, v, False, stable=True)[0], np.float64)
    o_b = np.asarray(_fwd_with_lse(q, k, v, True, stable=False)[0], np.float64)
    tied = slice(5, None)  # rows that see the first pair
    diff = np.abs(o_m[:, tied] - o_t[:, tied])
    ulp = 2.0 ** -7 * np.maximum(np.abs(o_m[:, tied]), np.abs(o_t[:, tied]))
    print(f"{shape} tied rows: mosaic-triton bitwise {100 * np.mean(diff == 0):.2f} %, "
          f"> 1 ulp {100 * np.mean(diff > ulp):.3f} %, rel {rel(o_m, o_t):.2e}; "
          f"stable vs baseline differ on {100 * np.mean(o_m[:, tied] != o_b[:, tied]):.1f} %")
    assert np.mean(diff > ulp) < 1e-3 and rel(o_m, o_t) < 2e-3
    assert np.any(o_m[:, tied] != o_b[:, tied])


# ------------------------------------------------------------- the Mosaic GPU backward (opt-in)
def _grads(q, k, v, do, mosaic_bwd, dq=True, **kw):
    """(O, dQ, dK, dV) of the Pallas path, with the Mosaic GPU backward (dK/dV kernel, and dQ
    kernel unless ``dq=False``) forced on or off; the forward is Triton's either way."""
    from jax_flash.pallas import backward_mosaic as bm
    from jax_flash.pallas import forward_mosaic as fm

    def f(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: jf.attention(q, k, v, impl="pallas", **kw), q, k, v)
        return (o,) + vjp(do)

    with bm.force(mosaic_bwd, dq=dq), fm.force(False):  # read at trace time: a fresh jit per call
        return jax.jit(f)(q, k, v, do)


@pytest.mark.parametrize("shape,causal,stable", [
    (MOSAIC_SHAPES[0], True, False), (MOSAIC_SHAPES[0], False, True),
    (MOSAIC_SHAPES[1], True, True), (MOSAIC_SHAPES[1], False, False)],
    ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_gpu_mosaic_backward_vs_reference_and_triton(rng, shape, causal, stable):
    """backward_mosaic's dK/dV and dQ kernels (TMA ring, wgmma, two compute warpgroups) against
    float64 (the exact gradients given the stored O's δ) and the Triton backward: each gradient's
    error within 1.5× Triton's, and within 1 % of Triton's gradient."""
    q, k, v, do = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(4))
    o_m, *g_m = _grads(q, k, v, do, True, causal=causal, stable=stable)
    o_t, *g_t = _grads(q, k, v, do, False, causal=causal, stable=stable)
    np.testing.assert_array_equal(np.asarray(o_m, np.float32), np.asarray(o_t, np.float32))
    _, *g64 = jf.reference_numpy(q, k, v, do, causal=causal, o_for_delta=o_t)
    for name, m, t, ref in zip(("dQ", "dK", "dV"), g_m, g_t, g64):
        m, t = np.asarray(m, np.float64), np.asarray(t, np.float64)
        err_m, err_t = (float(np.linalg.norm(x - ref) / np.linalg.norm(ref)) for x in (m, t))
        print(f"{shape} causal={causal} stable={stable} {name}: mosaic-ref {err_m:.3e}, triton-ref "
              f"{err_t:.3e}, mosaic-triton bitwise {100 * np.mean(m == t):.2f} %, "
              f"max {np.abs(m - t).max():.2e}, rel {rel(m, t):.2e}")
        assert np.all(np.isfinite(m)) and err_m <= 1.5 * err_t + 1e-6, name
        assert rel(m, t) < 1e-2, name


def test_gpu_mosaic_dkdv_only_keeps_triton_dq(rng):
    """``force(dq=False)`` (``JAX_FLASH_BWD=mosaic_dkdv``): dK, dV the Mosaic kernel's, bitwise as
    with both Mosaic kernels; dQ the Triton kernel's, bitwise."""
    shape = MOSAIC_SHAPES[0]
    q, k, v, do = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(4))
    _, dq_o, dk_o, dv_o = (np.asarray(x, np.float32) for x in _grads(q, k, v, do, True, dq=False))
    _, _, dk_m, dv_m = (np.asarray(x, np.float32) for x in _grads(q, k, v, do, True))
    _, dq_t, _, _ = (np.asarray(x, np.float32) for x in _grads(q, k, v, do, False))
    print(f"{shape} mosaic-dkdv-only: dK, dV as with both kernels; dQ as Triton's")
    np.testing.assert_array_equal(dq_o, dq_t)
    np.testing.assert_array_equal(dk_o, dk_m)
    np.testing.assert_array_equal(dv_o, dv_m)
