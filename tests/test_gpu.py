"""On the GPU (H200): the compiled kernels against the jnp executor and FP32/float64 references at
training-sized shapes. Run with ``pytest -m gpu`` (skipped elsewhere).

The central check: for every entry of the shipped tuning table, the Pallas kernels under that
entry's launch compute what the jnp executor computes for the same arguments — the numerics are a
function of the call, the launch only of the machine.
"""

import dataclasses
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash as jf
from jax_flash.pallas import tuning
from helpers import (LN_LAUNCHES, TINY, assert_add_layer_norm_is_the_pair,
                     assert_gelu_erf_within_bound, assert_ln_launch_within_the_sums_bounds,
                     assert_pallas_cross_entropy_within_bound, launch_id,
                     fp32_cross_entropy_of_upcast, tied_inputs)

pytestmark = pytest.mark.gpu

BF16 = jnp.bfloat16
EPS_BF16 = float(jnp.finfo(BF16).eps)  # 2⁻⁷: one BF16 ulp relative to the leading bit
SHAPES = [(32, 1024, 12, 64), (4, 4096, 16, 128)]
# ‖x − ref‖/‖ref‖ bounds against an FP32 (HIGHEST) reference, per policy (BF16 inputs): BF16 inputs
# carry 2⁻⁹ relative error each, the stored O and the gradients one more BF16 rounding.
FWD_TOL = {"fa2": 1e-2, "paper": 3e-2, "fp32": 1e-2, "fp32_bf16x6": 1e-2}
GRAD_TOL = {"fa2": 2e-2, "paper": 5e-2, "fp32": 1.5e-2, "fp32_bf16x6": 1.5e-2}


def rel(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1.0))


def randn(seed, shape, dtype=BF16):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def tied_qkv(seed, shape, score=20.0, pairs=((3, 5), (300, 301)), dominant=None):
    return tied_inputs(np.random.default_rng(seed), shape, score=score, pairs=pairs,
                       dominant=dominant)


def fwd_bwd(q, k, v, do, **kw):
    o, vjp = jax.vjp(lambda q, k, v: jf.attention(q, k, v, **kw), q, k, v)
    return (o,) + vjp(do)


def run(q, k, v, do, **kw):
    """(O, dQ, dK, dV) of one jitted call (keyword arguments are static)."""
    return jax.jit(lambda q, k, v, do: fwd_bwd(q, k, v, do, **kw))(q, k, v, do)


def run_dpa(q, k, v, do, **kw):
    """``run`` through ``jf.dot_product_attention`` (GQA, windows, lengths the call pads)."""
    def grads(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: jf.dot_product_attention(q, k, v, **kw), q, k, v)
        return (o,) + vjp(do)

    return jax.jit(grads)(q, k, v, do)


def on_cpu(fn, *arrays):
    """``fn(*arrays)`` on the host's CPU. On the GPU, XLA chooses its products' algorithms by timing
    them, so the jnp executor's FP32 sums there can differ between processes; on the CPU they are
    fixed by the arguments, the computation a user's CPU runs for the same call."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        return fn(*jax.device_put(arrays, cpu))


def abs_terms(q, k, v, do, causal, sm_scale):
    """Per output element, the sum of the absolute values of the terms that make it (FP32, on the
    GPU): |P||V| for O; for the gradients, with dS = P∘(dP − δ) taken term by term, |dS| ≤
    P∘(|dO||V|ᵀ + Σ|dO∘O|): |dS||K|·scale for dQ, |dS|ᵀ|Q|·scale for dK, |P|ᵀ|dO| for dV — what one
    BF16 flip of each P̄ or dS entry, or FP32 rounding inside dP and δ, can move an element by."""
    hi = jax.lax.Precision.HIGHEST
    q, k, v, do = (x.astype(jnp.float32).transpose(0, 2, 1, 3) for x in (q, k, v, do))

    @jax.jit
    def terms(q, k, v, do):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision=hi) * sm_scale
        if causal:
            t = s.shape[-1]
            s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bhqk,bhkd->bhqd", p, v, precision=hi)
        dp_abs = jnp.einsum("bhqd,bhkd->bhqk", jnp.abs(do), jnp.abs(v), precision=hi)
        delta_abs = jnp.sum(jnp.abs(do * o), -1, keepdims=True)
        ds = p * (dp_abs + delta_abs)
        mm = lambda a, b: jnp.einsum("bhij,bhjd->bhid", a, jnp.abs(b), precision=hi)
        out = (mm(p, v), mm(ds, k) * sm_scale, mm(ds.swapaxes(-1, -2), q) * sm_scale,
               mm(p.swapaxes(-1, -2), do))
        return tuple(x.transpose(0, 2, 1, 3) for x in out)

    return terms(q, k, v, do)


def cpu_flush_term(q, k, v, do):
    """What XLA:CPU's flushing of FP32 subnormals can move an output element by. The CPU flushes
    every subnormal operand and result to zero, the GPU keeps them; each flushed value is below
    2⁻¹²⁶. A flushed P̄ or dS entry moves its term by under 2⁻¹²⁶·M (M the largest input
    magnitude), a flushed product or partial sum by under 2⁻¹²⁶, the flushes inside dP and δ (d
    products and d partial sums each) move a dS entry by under 4d·2⁻¹²⁶ (P ≤ 1); over n terms:
    under 2⁻¹²⁶·n·(2 + (4d + 1)·M)."""
    n, d = q.shape[1], q.shape[-1]
    m = max(float(jnp.max(jnp.abs(x.astype(jnp.float32)))) for x in (q, k, v, do))
    return TINY * n * (2 + (4 * d + 1) * m)


def assert_same_numerics(name, a, b, terms, flush=0.0):
    """Two executors' outputs of one call: every element within 2 ulps plus one BF16 ulp of its
    absolute terms, plus ``flush`` (an absolute term for a reference that flushes subnormals,
    ``cpu_flush_term``). The executors share every rounding point; their exp2 and their FP32
    summation order inside products differ in last FP32 bits, which can flip a BF16 rounding of P̄
    or dS. Where an output is a cancellation of much larger terms, one such flip is many ulps of
    the output. The share within one BF16 ulp is printed, not asserted: it is a statistic of the
    two summation orders, below 99.9 % at head_dim 128 already between the jnp executor and itself
    with its products summed in another order (``python -m lab.product_order``); the bound is
    derived."""
    a, b, terms = (np.asarray(x, np.float64) for x in (a, b, terms))
    mag = np.maximum(np.abs(a), np.abs(b))
    ulp = EPS_BF16 * 2.0 ** np.floor(np.log2(np.where(mag > 0, mag, 1.0)))
    diff = np.abs(a - b)
    within = float(np.mean(diff <= ulp))
    bound = 2 * ulp + EPS_BF16 * terms + flush
    share = diff / bound
    worst = np.unravel_index(np.argmax(share), share.shape)
    print(f"{name}: bitwise {100 * np.mean(diff == 0):.3f} %, ≤ 1 ulp {100 * within:.4f} %, "
          f"worst share of bound {share[worst]:.3f} (at {a[worst]:.4g} vs {b[worst]:.4g}, "
          f"terms {terms[worst]:.4g})")
    assert np.all(diff <= bound), (name, float(share[worst]))


def _entry_cases():
    """(key, shape) per shipped tuning entry: a shape in the entry's bucket, kept small enough for
    the float64-free bound above (one batch element, two heads)."""
    cases = []
    for key in json.loads(tuning.TABLE_PATH.read_text()):
        policy, d, t, causal = key.split("/")
        cases.append((key, policy, (1, int(t[1:]), 2, int(d[1:])), causal == "causal"))
    return cases


@pytest.mark.parametrize("inputs", ["random", "tied"])
@pytest.mark.parametrize("stable", [False, True])
@pytest.mark.parametrize("key,policy,shape,causal", _entry_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_gpu_every_tuning_entry_computes_the_jnp_numerics(key, policy, shape, causal, stable, inputs):
    """The shipped table's launch at its shape (``plan`` picks it) against the jnp executor on the
    same arguments, run on the GPU and on the CPU (``on_cpu``): the same ``Plan.numerics``, and
    every element within ``assert_same_numerics``'s bound of each (the CPU's with its flushed
    subnormals, ``cpu_flush_term``), on random inputs and on tied rows, near-ties and subnormal P̄
    (a key 4.5× as strong as the tied ones)."""
    if inputs == "random":
        q, k, v = (randn(s, shape) for s in (1, 2, 3))
    else:
        q, k, v = tied_qkv(1, shape, dominant=4.5)
    do = randn(4, shape)
    kw = dict(causal=causal, stable=stable, policy=policy)
    plan_p, plan_j = jf.plan(q, k, v, impl="pallas", **kw), jf.plan(q, k, v, impl="jnp", **kw)
    assert plan_p.numerics == plan_j.numerics
    assert plan_p.launch == tuning.lookup(policy, shape[-1], shape[1], causal)
    assert plan_p.launch != jf.Launch(), "the entry did not reach the call"
    print(key, plan_p.to_dict())
    pallas = run(q, k, v, do, impl="pallas", **kw)
    refs = {"gpu": (run(q, k, v, do, impl="jnp", **kw), 0.0),
            "cpu": (on_cpu(lambda *a: run(*a, impl="jnp", **kw), q, k, v, do),
                    cpu_flush_term(q, k, v, do))}
    terms = abs_terms(q, k, v, do, causal, plan_p.numerics.sm_scale)
    for where, (jnp_ex, flush) in refs.items():
        for name, a, b, t in zip(("O", "dQ", "dK", "dV"), pallas, jnp_ex, terms):
            chex.assert_type(a, BF16)
            chex.assert_shape(a, b.shape)
            assert_same_numerics(f"{key} stable={stable} {inputs} {name} vs jnp on {where}", a, b,
                                 t, flush=flush)
    lse_p = jf.attention_with_lse(q, k, v, impl="pallas", **kw)[1]
    lse_j = on_cpu(lambda *a: jf.attention_with_lse(*a, impl="jnp", **kw)[1], q, k, v)
    # L = m + log ℓ: the same m; ℓ summed in another order (a few FP32 ulps) and the GPU's
    # approximate log2 (absolute error below 2⁻²²)
    chex.assert_trees_all_close(np.asarray(lse_p), np.asarray(lse_j), rtol=2.0 ** -20,
                                atol=2.0 ** -20)


def _candidates():
    from lab.ab import candidate_entries, split_entry

    return [(name, *split_entry(e)) for name, e in candidate_entries().items()]


@pytest.mark.parametrize("name,call,launch", _candidates(), ids=lambda x: x if isinstance(x, str) else "")
def test_gpu_candidate_launches_change_no_value(name, call, launch):
    """Every candidate launch of lab/entries.json against the default launch at the same call
    arguments, on tied rows: values within ``assert_same_numerics`` (Triton launches are mostly
    bitwise; another kernel family sums inside its products in its own order)."""
    d = 128 if call.get("block_k", 64) == 128 or launch.get("bwd_kernel") == "mosaic" else 64
    shape = (2, 2048, 8, d)
    q, k, v = tied_qkv(3, shape)
    do = randn(4, shape)
    kw = dict(causal=True, stable=True, impl="pallas", **call)
    base, cand = run(q, k, v, do, **kw), run(q, k, v, do, launch=launch, **kw)
    terms = abs_terms(q, k, v, do, True, d ** -0.5)
    for what, a, b, t in zip(("O", "dQ", "dK", "dV"), base, cand, terms):
        assert_same_numerics(f"{name} {what}", a, b, t)


@pytest.mark.parametrize("field,one,other", [("mosaic_dq_keys", 64, 128)])
def test_gpu_dq_launches_change_no_bit(field, one, other):
    """The Mosaic dQ kernel's launch options only regroup work: 128-key tiles continue one
    accumulator with the same dS·K products in the same key order. On tied rows under the stable
    shift, O, dQ, dK and dV bitwise under either setting, the shipped launch's other fields kept."""
    shape = (2, 2048, 4, 128)
    q, k, v = tied_qkv(7, shape)
    do = randn(8, shape)
    base = jf.plan(q, k, v, impl="pallas", causal=True, stable=True).launch
    assert base.bwd_kernel == "mosaic", "the shape has a shipped Mosaic entry"
    kw = dict(causal=True, stable=True, impl="pallas")
    a, b = (run(q, k, v, do, launch=dataclasses.replace(base, **{field: x}), **kw)
            for x in (one, other))
    chex.assert_trees_all_equal(a, b)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("policy", ["fa2", "paper", "fp32", "fp32_bf16x6"])
@pytest.mark.parametrize("stable", [False, True])
def test_gpu_kernels_vs_jnp_vs_reference(shape, policy, stable):
    q, k, v, do = (randn(s, shape) for s in range(4))
    ref_f = lambda q, k, v: jf.reference_attention(q, k, v, dtype=jnp.float32)
    o_ref, vjp = jax.vjp(ref_f, *(x.astype(jnp.float32) for x in (q, k, v)))
    refs = (o_ref,) + vjp(do.astype(jnp.float32))
    # "paper" uses 512-wide key tiles; at head_dim 128 the K+V tiles exceed shared memory, so the
    # kernel is checked with 256-wide tiles there (impl="auto" would run the jnp executor instead).
    block_k = 256 if policy == "paper" and shape[-1] == 128 else None
    if block_k:
        with pytest.raises(ValueError, match="shared memory"):
            jf.attention(q, k, v, policy=policy, impl="pallas")
    kw = dict(policy=policy, stable=stable, block_k=block_k)
    pallas, emul = run(q, k, v, do, impl="pallas", **kw), run(q, k, v, do, impl="jnp", **kw)
    for name, a, b, r in zip(("O", "dQ", "dK", "dV"), pallas, emul, refs):
        tol = FWD_TOL[policy] if name == "O" else GRAD_TOL[policy]
        err_p, err_j, err_pj = rel(a, r), rel(b, r), rel(a, b)
        print(f"{shape} {policy} stable={stable} {name}: pallas-ref {err_p:.2e} jnp-ref {err_j:.2e} "
              f"pallas-jnp {err_pj:.2e}")
        assert np.isfinite(err_p) and err_p < tol, name
        assert err_j < tol, name
        assert err_pj < tol / 2, name  # same rounding points: far closer to each other than to ref


@pytest.mark.parametrize("stable", [False, True])
def test_gpu_fp32_bf16x6_is_fp32_accurate(stable):
    """FP32 inputs: "fp32_bf16x6" (dots from BF16 pieces on the tensor cores) as close to an FP32
    reference as FP32 itself, and as the "fp32" policy's IEEE dots."""
    shape = (2, 1024, 12, 64)
    q, k, v, do = (randn(s, shape, jnp.float32) for s in range(4))
    ref_f = lambda q, k, v: jf.reference_attention(q, k, v, dtype=jnp.float32)
    o_ref, vjp = jax.vjp(ref_f, q, k, v)
    refs = (o_ref,) + vjp(do)
    x6 = run(q, k, v, do, impl="pallas", policy="fp32_bf16x6", stable=stable)
    ieee = run(q, k, v, do, impl="pallas", policy="fp32", stable=stable)
    for name, a, b, r in zip(("O", "dQ", "dK", "dV"), x6, ieee, refs):
        print(f"stable={stable} {name}: bf16x6-ref {rel(a, r):.2e} ieee-ref {rel(b, r):.2e}")
        assert rel(a, r) < 2e-5 and rel(a, r) < 4 * rel(b, r) + 1e-6, name


@pytest.mark.parametrize("stable", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_scale_late_is_as_accurate(d, stable):
    """``Numerics.scale_late`` (on by default at head_dim 128) against the scaled form, compiled, on
    tied rows: O within a BF16 ulp or two of the scaled form's (the row max is the same value; the
    exps' FMA and the tie threshold's division move last bits), L within FP32 rounding, as accurate
    against float64, and — stable — the shift still firing."""
    import dataclasses

    from jax_flash import api

    shape = (2, 1024, 4, d)
    q, k, v = tied_qkv(5, shape)
    ref = jf.reference_numpy(q, k, v, causal=True)
    p = jf.plan(q, k, v, causal=True, stable=stable, impl="pallas")
    outs = []
    for late in (False, True):
        num = dataclasses.replace(p.numerics, scale_late=late)
        o, _, lse = jax.jit(lambda q, k, v, n=num: api._forward(q, k, v, n, p.launch, "pallas"))(q, k, v)
        outs.append((np.asarray(o, np.float64), np.asarray(lse)))
    (o_s, l_s), (o_l, l_l) = outs
    row = np.abs(o_s).max(-1, keepdims=True)
    print(f"d={d} stable={stable}: O bitwise {100 * np.mean(o_l == o_s):.3f} %, rel err "
          f"{rel(o_l, ref):.3e} (scaled {rel(o_s, ref):.3e})")
    assert np.mean(o_l == o_s) >= 0.9 and np.all(np.abs(o_l - o_s) <= 2.0 ** -5 * row)
    chex.assert_trees_all_close(l_l, l_s, rtol=1e-6, atol=1e-5)
    assert rel(o_l, ref) <= 1.05 * rel(o_s, ref) + 1e-6
    if stable:
        o_b = np.asarray(jf.attention(q, k, v, causal=True, impl="pallas"), np.float64)
        assert np.mean(np.any(o_b != o_l, -1)) > 0.5  # the shift fired on the tied rows


# ------------------------------------------------------------------ the Mosaic GPU kernels
MOSAIC_SHAPES = [(2, 1024, 4, 64), (1, 2048, 2, 128)]
TRITON = {"fwd_kernel": "triton", "bwd_kernel": "triton"}


@pytest.mark.parametrize("shape", MOSAIC_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("stable", [False, True])
def test_gpu_mosaic_forward_vs_reference_and_triton(shape, causal, stable):
    """The Mosaic forward (TMA, wgmma, warpgroup ping-pong) against float64 and the Triton forward:
    its error within 1.5× Triton's (both round O to BF16 once), L the same up to FP32 rounding."""
    q, k, v = (randn(10 + s, shape) for s in range(3))
    ref = jf.reference_numpy(q, k, v, causal=causal)
    f = lambda launch: jax.jit(lambda q, k, v: jf.attention_with_lse(
        q, k, v, impl="pallas", causal=causal, stable=stable, launch=launch))(q, k, v)
    o_m, l_m = f({"fwd_kernel": "mosaic"})
    o_t, l_t = f(TRITON)
    o_m, o_t = np.asarray(o_m, np.float64), np.asarray(o_t, np.float64)
    err_m, err_t = (float(np.linalg.norm(o - ref) / np.linalg.norm(ref)) for o in (o_m, o_t))
    print(f"{shape} causal={causal} stable={stable}: mosaic-ref {err_m:.3e}, triton-ref {err_t:.3e}, "
          f"mosaic-triton bitwise {100 * np.mean(o_m == o_t):.2f} %")
    assert np.all(np.isfinite(o_m)) and err_m <= 1.5 * err_t + 1e-6
    chex.assert_trees_all_close(l_m, l_t, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,causal,stable", [
    (MOSAIC_SHAPES[0], True, False), (MOSAIC_SHAPES[0], False, True),
    (MOSAIC_SHAPES[1], True, True), (MOSAIC_SHAPES[1], False, False)],
    ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_gpu_mosaic_backward_vs_reference_and_triton(shape, causal, stable):
    """The Mosaic dK/dV and dQ kernels against float64 (the exact gradients given the stored O's δ)
    and the Triton backward: each gradient's error within 1.5× Triton's and within 1 % of it."""
    q, k, v, do = (randn(20 + s, shape) for s in range(4))
    kw = dict(impl="pallas", causal=causal, stable=stable)
    o_m, *g_m = run(q, k, v, do, launch={"bwd_kernel": "mosaic"}, **kw)
    o_t, *g_t = run(q, k, v, do, launch=TRITON, **kw)
    chex.assert_trees_all_equal(o_m, o_t)  # the same (Triton) forward
    _, *g64 = jf.reference_numpy(q, k, v, do, causal=causal, o_for_delta=o_t)
    for name, m, t, ref in zip(("dQ", "dK", "dV"), g_m, g_t, g64):
        m, t = np.asarray(m, np.float64), np.asarray(t, np.float64)
        err_m, err_t = (float(np.linalg.norm(x - ref) / np.linalg.norm(ref)) for x in (m, t))
        print(f"{shape} causal={causal} stable={stable} {name}: mosaic-ref {err_m:.3e}, "
              f"triton-ref {err_t:.3e}, bitwise {100 * np.mean(m == t):.2f} %")
        assert np.all(np.isfinite(m)) and err_m <= 1.5 * err_t + 1e-6, name
        assert rel(m, t) < 1e-2, name


def test_gpu_mosaic_dkdv_only_keeps_triton_dq():
    """``bwd_kernel="mosaic_dkdv"``: dK, dV the Mosaic kernel's, bitwise as with both Mosaic kernels;
    dQ the Triton kernel's, bitwise."""
    shape = MOSAIC_SHAPES[0]
    q, k, v, do = (randn(30 + s, shape) for s in range(4))
    f = lambda bwd: run(q, k, v, do, impl="pallas", launch={"bwd_kernel": bwd})
    _, dq_o, dk_o, dv_o = f("mosaic_dkdv")
    _, _, dk_m, dv_m = f("mosaic")
    _, dq_t, _, _ = f("triton")
    chex.assert_trees_all_equal((dq_o, dk_o, dv_o), (dq_t, dk_m, dv_m))


@pytest.mark.parametrize("shape", [(4, 2048, 8, 128), (8, 1024, 6, 64)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_mosaic_fwd_persistent_changes_no_bit(shape, causal):
    """``Launch.mosaic_fwd_persistent`` only changes which program runs which query block, and when
    its Q and K/V tiles load (3 or 4 blocks a program at these shapes): O and the gradients (from
    its O and L) bitwise those of a program per block, plain and stable."""
    q, k, v, do = (randn(70 + s, shape) for s in range(4))
    for stable in (False, True):
        f = lambda persistent: run(q, k, v, do, impl="pallas", causal=causal, stable=stable,
                                   launch={"fwd_kernel": "mosaic", "bwd_kernel": "mosaic",
                                           "mosaic_fwd_persistent": persistent})
        chex.assert_trees_all_equal(f(True), f(False))


@pytest.mark.parametrize("shape", [(2, 2048, 4, 128), (2, 1024, 4, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gpu_mosaic_bwd_regs_change_no_bit(shape):
    """``Launch.mosaic_bwd_regs`` (240 registers a compute thread, 24 a producer's, against 232 and
    40) changes only where the compiler keeps values: O, dQ, dK, dV bitwise the default split's."""
    q, k, v, do = (randn(60 + s, shape) for s in range(4))
    f = lambda regs: run(q, k, v, do, impl="pallas", causal=True,
                         launch={"bwd_kernel": "mosaic", "mosaic_bwd_regs": regs})
    chex.assert_trees_all_equal(f((240, 24)), f(None))


@pytest.mark.parametrize("stable", [False, True])
@pytest.mark.parametrize("dpp", [False, True], ids=["o", "dpp"])
def test_gpu_heavy_first_changes_no_bit(stable, dpp):
    """``Launch.heavy_first`` only reverses which program takes which query block in the Triton δ
    (dP∘P) and dQ kernels: O, dQ, dK, dV bitwise those of the plain order, causal, on tied rows."""
    shape = (2, 1024, 4, 64)
    q, k, v = tied_qkv(70, shape)
    do = randn(74, shape)
    base = {"bwd": (4, 3), "prefetch_rows": True}
    f = lambda hf: run(q, k, v, do, impl="pallas", causal=True, stable=stable,
                       delta="dpp" if dpp else "o", launch={**base, "heavy_first": hf})
    chex.assert_trees_all_equal(f(True), f(False))


def assert_same_bits_every_run(fn, args, runs: int = 5):
    """``runs`` calls of ``fn(*args)`` return the same bits each time."""
    first = jax.device_get(fn(*args))
    for _ in range(runs - 1):
        chex.assert_trees_all_equal(jax.device_get(fn(*args)), first)


@pytest.mark.parametrize("shape", [(4, 4096, 16, 128), (16, 1024, 12, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gpu_same_call_gives_the_same_bits_every_run(shape):
    """Every kernel sums each output in one fixed order, without atomic additions: one jitted call
    run five times on the same inputs gives O, dQ, dK and dV bit for bit each time (causal, the
    shipped launch: Mosaic kernels at head_dim 128, Triton at 64). cuDNN's default backward does not
    (its dQ; ``python -m lab.determinism``)."""
    q, k, v, do = (randn(90 + s, shape) for s in range(4))
    f = jax.jit(lambda q, k, v, do: fwd_bwd(q, k, v, do, impl="pallas", causal=True))
    assert_same_bits_every_run(f, (q, k, v, do))


def test_gpu_bench_cudnn_deterministic_is_deterministic():
    """The benchmark's cuDNN deterministic implementation, compiled with XLA's option as
    ``bench.attention`` times it, returns the same gradients on every run."""
    from bench import attention as ba

    name = "cudnn_deterministic"
    fn = next(f for impl, _, _, f in ba._jax_impls(True) if impl == name)
    g = ba._jax_pass(fn, "fwd+bwd", ba.COMPILER_OPTIONS[name])
    assert_same_bits_every_run(g, tuple(randn(95 + s, (4, 4096, 16, 128)) for s in range(3)))


def test_gpu_explicit_mosaic_launch_that_cannot_run_raises():
    """Asked for explicitly, a Mosaic kernel that does not cover the call (T padded to 1088 rows,
    not a multiple of 128) raises; chosen by the table, the call runs the Triton kernel (``plan``
    says so)."""
    x = randn(40, (1, 1050, 2, 128))
    with pytest.raises(ValueError, match="Mosaic"):
        jf.plan(x, x, x, impl="pallas", launch={"fwd_kernel": "mosaic"})


@pytest.mark.parametrize("kv_heads,window,causal,t", [
    (2, None, True, 2048), (1, None, False, 2048), (4, (256, 0), True, 2048),
    (2, (128, 128), False, 2048), (2, None, True, 2000), (8, None, False, 1900)],
    ids=lambda x: str(x).replace(" ", ""))
def test_gpu_mosaic_gqa_and_windows_vs_reference_and_triton(kv_heads, window, causal, t):
    """GQA/MQA, sliding windows and lengths the call pads (2000, 1900) through
    ``dot_product_attention``: the Mosaic forward and backward (which read one kv head per
    query-head group, skip the tiles outside the window or past the length) against an FP32
    (HIGHEST) reference and the Triton kernels on the same call — each output's error within 1.5×
    Triton's, and within 1 % of Triton's values."""
    b, n, d = 1, 8, 128
    q, do = randn(50, (b, t, n, d)), randn(51, (b, t, n, d))
    k, v = randn(52, (b, t, kv_heads, d)), randn(53, (b, t, kv_heads, d))
    kw = dict(is_causal=causal, local_window_size=window)

    def ours(launch):
        return run_dpa(q, k, v, do, implementation="pallas", launch=launch, **kw)

    with jax.default_matmul_precision("highest"):
        f32 = lambda x: x.astype(jnp.float32)
        fn = lambda q, k, v: jax.nn.dot_product_attention(f32(q), f32(k), f32(v),
                                                          implementation="xla", **kw)
        o, vjp = jax.vjp(fn, q, k, v)
        ref = (o,) + vjp(f32(do))
    plan = jf.dot_product_attention_plan(q, k, v, implementation="pallas",
                                         launch={"fwd_kernel": "mosaic", "bwd_kernel": "mosaic"},
                                         **kw)
    assert (plan.launch.fwd_kernel, plan.launch.bwd_kernel) == ("mosaic", "mosaic"), plan
    mosaic = ours({"fwd_kernel": "mosaic", "bwd_kernel": "mosaic"})
    triton = ours(TRITON)
    for name, m, tr, r in zip(("O", "dQ", "dK", "dV"), mosaic, triton, ref):
        chex.assert_equal_shape((m, tr, r))
        err_m, err_t = rel(m, r), rel(tr, r)
        print(f"kv_heads={kv_heads} window={window} causal={causal} {name}: mosaic-ref {err_m:.3e}, "
              f"triton-ref {err_t:.3e}, mosaic-triton {rel(m, tr):.2e}")
        assert np.all(np.isfinite(np.asarray(m, np.float32))) and err_m <= 1.5 * err_t + 1e-6, name
        assert rel(m, tr) < 1e-2, name


@pytest.mark.parametrize("option", ["recompute_gelu", "gelu_from_input"])
def test_gpu_gelu_recomputations_change_no_bit(option):
    """The two bit-neutral GELU options of the model, compiled for the GPU (its fusions, its FMA
    contraction): the loss and every gradient of a small GPT-2 at a training-like width equal
    autodiff's bit for bit. Each token occurs once in the batch: the token embedding's gradient is
    a scatter-add the GPU runs with atomics, so a token occurring three times or more gets its
    terms summed in an order that varies from run to run, whatever the GELU."""
    import dataclasses

    from flax import nnx

    from models import gpt2

    cfg = gpt2.GPTConfig(vocab_size=1536, block_size=256, n_layer=2, n_head=6, n_embd=384)
    idx = jnp.asarray(np.random.default_rng(0).permutation(1536)[:4 * 257].reshape(4, 257), jnp.int32)

    def loss(m):
        return gpt2.cross_entropy(m(idx[:, :-1]), idx[:, 1:])

    value_and_grad = nnx.jit(nnx.value_and_grad(loss))
    want = value_and_grad(gpt2.GPT(cfg, rngs=nnx.Rngs(0)))
    got = value_and_grad(gpt2.GPT(dataclasses.replace(cfg, **{option: True}), rngs=nnx.Rngs(0)))
    chex.assert_trees_all_equal(got, want)


@pytest.mark.parametrize("launch", [dict(stages=2), dict(stages=3), dict(reload=True),
                                    dict(reload=True, stages=2)], ids=launch_id)
def test_gpu_layernorm_backward_launch_changes_no_bit(launch):
    """The fused LayerNorm backward's pipeline depth (``models.layernorm.BWD_NUM_STAGES``) only
    moves when rows are loaded, and ``reload`` (``BWD_RELOAD``) reads them again for the input
    gradient through the same expressions: ds, dr and d(scale) bitwise the shipped launch's, at
    GPT-2's width."""
    from models import layernorm

    rng = np.random.default_rng(5)
    n, d = 4096, 768
    s = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    r = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
    w = jnp.asarray(1.0 + 0.1 * rng.standard_normal(d), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
    gs = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    _, _, mean, rstd = jax.jit(layernorm._add_forward, static_argnums=(3, 4))(
        s, r, w, 1e-5, jnp.dtype(jnp.bfloat16))
    bwd = lambda kw: jax.jit(lambda *a: layernorm._add_backward(
        *a, r_dtype=jnp.bfloat16, **kw))(s, w, mean, rstd, dy, gs)
    chex.assert_trees_all_equal(bwd(launch), bwd({}))


@pytest.mark.parametrize("stages", [2, 3])
def test_gpu_layernorm_forward_stages_change_no_bit(stages):
    """The forward's loop (``rows`` a program, ``sub`` a step) loaded further ahead: the sum, the
    normalised row, the mean and 1/σ bitwise those of one stage."""
    from models import layernorm

    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((4096, 768)), jnp.float32)
    r = jnp.asarray(rng.standard_normal((4096, 768)), jnp.bfloat16)
    w = jnp.asarray(1.0 + 0.1 * rng.standard_normal(768), jnp.float32)
    fwd = lambda st: jax.jit(lambda *a: layernorm._add_forward(
        *a, 1e-5, jnp.dtype(jnp.bfloat16), rows=64, sub=8, stages=st))(x, r, w)
    chex.assert_trees_all_equal(fwd(stages), fwd(1))


@pytest.mark.parametrize("launch", LN_LAUNCHES, ids=launch_id)
def test_gpu_layernorm_every_launch_within_the_sums_bounds(rng, assert_close, launch):
    """The CPU test's launches compiled for the GPU (Triton): within the same float64 bounds."""
    assert_ln_launch_within_the_sums_bounds(rng, assert_close, launch)


def test_gpu_add_layer_norm_is_the_pair():
    """The fused residual addition and LayerNorm compiled for the GPU (Triton): as the CPU test,
    ``helpers.assert_add_layer_norm_is_the_pair``."""
    assert_add_layer_norm_is_the_pair(np.random.default_rng(0), jit=True)


def _gpt2_logits(rows=4096, v=50304):
    k1, k2 = jax.random.split(jax.random.key(0))
    logits = (4.0 * jax.random.normal(k1, (rows, v))).astype(jnp.bfloat16)
    return logits, jax.random.randint(k2, (rows,), 0, v)


def test_gpu_pallas_cross_entropy_within_its_bound():
    """model.cross_entropy="pallas" compiled for the GPU (Triton) at GPT-2's vocabulary, 4,096 rows
    of bf16 logits: as the CPU test, ``helpers.assert_pallas_cross_entropy_within_bound``; and the
    training kernel's statistics bit-identical to the statistics kernel's alone."""
    from models import loss_kernels as lk

    logits, targets = _gpt2_logits()
    assert_pallas_cross_entropy_within_bound(logits, targets)
    g_rows = jnp.full((logits.shape[0],), 1.0 / logits.shape[0], jnp.float32)
    m, s, tgt, _ = jax.jit(lk.row_stats_and_grad)(logits, targets, g_rows)
    chex.assert_trees_all_equal((m, s, tgt), jax.jit(lk.row_stats)(logits, targets))


@pytest.mark.parametrize("warps,chunk", [(None, None), (1, 1024)])
def test_gpu_loss_target_fixup_changes_no_bit(warps, chunk):
    """The loss's training kernel with ``loss_kernels.TARGET_FIXUP`` (the walk without a compare and
    a select per logit, each target entry written again after it) against the masked walk, at
    GPT-2's vocabulary, targets at the first column, the last and in the remainder piece: the
    statistics and every gradient element bitwise; at the shipped launch and a 1-warp one."""
    import functools

    from models import loss_kernels as lk

    logits, targets = _gpt2_logits(rows=1024)
    targets = targets.at[:3].set(jnp.asarray([0, 50303, 50200], jnp.int32))
    g_rows = jnp.full((1024,), 1.0 / 1024, jnp.float32)
    launch = {} if warps is None else {"warps": warps, "chunk": chunk}
    run = lambda fixup: jax.jit(functools.partial(lk.row_stats_and_grad, fixup=fixup, **launch))(
        logits, targets, g_rows)
    chex.assert_trees_all_equal(run(True), run(False))


@pytest.mark.parametrize("stable", [False, True])
def test_gpu_attention_qkvpacked_is_attention_of_its_slots(stable):
    """``attention_qkvpacked`` compiled for the GPU at GPT-2's shape (the Triton kernels reading the
    packed array in place, dQ/dK/dV into one buffer): output and gradient bit-identical to
    ``attention`` of the three slots."""
    qkv = (2 * jax.random.normal(jax.random.key(0), (8, 1024, 3, 12, 64))).astype(jnp.bfloat16)
    do = jax.random.normal(jax.random.key(1), (8, 1024, 12, 64), jnp.bfloat16)
    packed = jax.jit(lambda x: jax.vjp(lambda t: jf.attention_qkvpacked(t, stable=stable), x)[1](do))
    sliced = jax.jit(lambda x: jax.vjp(
        lambda t: jf.attention(t[:, :, 0], t[:, :, 1], t[:, :, 2], stable=stable), x)[1](do))
    o = jax.jit(lambda x: jf.attention_qkvpacked(x, stable=stable))(qkv)
    want = jax.jit(lambda x: jf.attention(x[:, :, 0], x[:, :, 1], x[:, :, 2], stable=stable))(qkv)
    chex.assert_trees_all_equal(o, want)
    chex.assert_trees_all_equal(packed(qkv), sliced(qkv))


@pytest.mark.parametrize("form", ["erf", "pallas"])
def test_gpu_gelu_erf_form_within_its_bound(form):
    """model.gelu="erf" compiled for the GPU (its erf is the GPU backend's), and "pallas" (the
    Triton kernels): every bf16 input in [-8, 8] within the bound the CPU test asserts
    (``helpers.assert_gelu_erf_within_bound``)."""
    assert_gelu_erf_within_bound(form)


def test_gpu_gelu_reciprocal_quotient_changes_no_bit():
    """The Pallas GELU's quotient as the GPU's reciprocal and a product
    (``gelu_kernels.RCP_QUOTIENT``) against FP32 division: forward and input gradient bitwise on
    every finite bf16 input, those past the erf's clamp included, with random cotangents."""
    import functools

    import ml_dtypes

    from models import gelu_kernels as gk

    bits = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16)
    h = jnp.asarray(bits[np.isfinite(bits.astype(np.float32))], BF16)
    g = jnp.asarray(np.random.default_rng(7).standard_normal(h.shape), BF16)

    def both(rcp):
        fwd = functools.partial(gk._blocks, gk._fwd_kernel, "model_gelu_fwd", BF16,
                                rows=gk.FWD_ROWS, warps=gk.FWD_WARPS, rcp=rcp)
        bwd = functools.partial(gk._blocks, gk._bwd_kernel, "model_gelu_bwd", BF16,
                                rows=gk.BWD_ROWS, warps=gk.BWD_WARPS, rcp=rcp)
        return jax.jit(fwd)(h), jax.jit(bwd)(h, g)

    chex.assert_trees_all_equal(both(True), both(False))


def test_gpu_cross_entropy_of_bf16_logits_is_autodiffs():
    """cross_entropy of bf16 logits, compiled for the GPU at GPT-2's vocabulary: loss and gradient
    bit-identical to autodiff's of the logits upcast to FP32 (what the bf16-logits option computed
    before the loss kept only the bf16 logits and two numbers a row for its backward)."""
    k1, k2 = jax.random.split(jax.random.key(0))
    logits = (4.0 * jax.random.normal(k1, (8, 1024, 50304))).astype(jnp.bfloat16)
    targets = jax.random.randint(k2, (8, 1024), 0, 50304)

    from models import gpt2

    got = jax.jit(jax.value_and_grad(gpt2.cross_entropy))(logits, targets)
    want = jax.jit(jax.value_and_grad(fp32_cross_entropy_of_upcast))(logits, targets)
    chex.assert_trees_all_equal(got, want)


@pytest.mark.parametrize("clip", [100.0, 1e-3], ids=["clip-idle", "clip-cutting"])
def test_gpu_stack_params_keeps_the_tree_steps_numerics(clip):
    """``optim.stack_params`` where XLA's GPU compiler decides which products it contracts into
    FMAs: the micro model's first step bitwise the tree layout's, a later step from the same state
    within ``tests/test_stacked.py``'s derived bounds. Both steps compiled with XLA's deterministic
    ops: without them the embedding gradient's scatter adds repeated tokens' rows in an order that
    changes between executions of one program, let alone two."""
    import test_stacked

    test_stacked.test_first_step_is_the_tree_steps_bits(clip, clip < 1, deterministic=True)
    test_stacked.test_a_later_step_within_one_contraction_of_the_tree_step(clip, clip < 1,
                                                                           deterministic=True)
