"""jax_flash.attention / attention_with_lse / plan (jax_flash/api.py): every policy against the exact
float64 attention of the same inputs within its derived bound (helpers.o_bound, grad_bounds), on
both executors; jit against no jit; vmap; NaN isolation; and every kind of bad input (the table in
docs/TESTING.md), each with a clear error or a correct result."""

import functools
import itertools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash as jf
from helpers import (BF16, attention_with_lse, f64, grad_bounds, jaxpr_eqns, jitted, make_qkv,
                     numerics, o_bound, reference_outputs, run, run_eager, tied_inputs)

IMPLS = ("jnp", "pallas")  # pallas: the kernels in Pallas interpret mode on the CPU


def check_against_reference(assert_close, q, k, v, do, **kw):
    """O, dQ, dK, dV of ``attention(**kw)`` within the policy's bound of the float64 gradients; dtype
    and shape of every public output checked."""
    cfg = numerics(q, k, v, **kw)
    outs = run(q, k, v, do, **kw)
    refs = reference_outputs(q, k, v, do, cfg)
    bounds = (o_bound(q, k, v, cfg)[0],) + grad_bounds(q, k, v, do, cfg)
    for name, out, ref, bound, like in zip(("O", "dQ", "dK", "dV"), outs, refs, bounds, (q, q, k, v)):
        chex.assert_type(out, q.dtype)
        chex.assert_shape(out, like.shape)
        assert_close(out, ref, bound, name)
    return outs


# -------------------------------------------------------------------------------- against float64
REFERENCE_CASES = list(itertools.product(("fa2", "paper", "fp32"), (False, True), IMPLS, (True, False))) + [
    ("paper_fp32acc", stable, impl, True) for stable in (False, True) for impl in IMPLS] + [
    ("fp32_bf16x6", stable, "pallas", True) for stable in (False, True)] + [
    (p, True, "jnp", True) for p in ("fa2_sr", "paper_sr", "paper_sr_all")]


# by default the kernels' cases are causal FA2-family ones (non-causal: test_cross_attention; the
# other policies' kernels against the jnp executor's: tests/test_pallas_forward.py)
@pytest.mark.parametrize("policy,stable,impl,causal", [
    pytest.param(*c, marks=pytest.mark.slow)
    if c[2] == "pallas" and (not c[3] or c[0] in ("fp32", "paper_fp32acc")) else c
    for c in REFERENCE_CASES])
def test_policy_matches_float64_reference(rng, assert_close, policy, stable, impl, causal):
    # odd length: several key tiles of 16, the last one partly past kv_len; tied rows for the shift
    shape = (1, 37, 2, 32)
    q, k, v = tied_inputs(rng, shape) if stable else make_qkv(rng, shape)
    do = make_qkv(rng, shape, n=1)[0]
    check_against_reference(assert_close, q, k, v, do, policy=policy, stable=stable, impl=impl,
                            causal=causal, block_q=16, block_k=16)


@pytest.mark.parametrize("policy,delta,impl", [
    (p, d, i) if p == "fp32" or (d == "o" and i == "pallas") else pytest.param(p, d, i, marks=pytest.mark.slow)
    for p in ("fp32", "fp32_bf16x6") for d in ("o", "o_hp", "dpp") for i in IMPLS])
def test_fp32_inputs_under_fp32_policies(rng, assert_close, impl, delta, policy):
    q, k, v, do = make_qkv(rng, (1, 45, 2, 32), jnp.float32, n=4)
    check_against_reference(assert_close, q, k, v, do, policy=policy, impl=impl, delta=delta,
                            block_q=16, block_k=16)


@pytest.mark.parametrize("policy", ["fa2", "paper", "fp32"])
@pytest.mark.parametrize("delta", ["o_hp", "dpp"])
def test_delta_modes(rng, assert_close, policy, delta):
    q, k, v, do = make_qkv(rng, (1, 40, 2, 32), n=4)
    check_against_reference(assert_close, q, k, v, do, policy=policy, delta=delta, impl="jnp",
                            block_q=16, block_k=16)


@pytest.mark.parametrize("impl", IMPLS)
def test_head_dim_128_fp16(rng, assert_close, impl):
    q, k, v, do = make_qkv(rng, (1, 33, 1, 128), jnp.float16, n=4)
    check_against_reference(assert_close, q, k, v, do, impl=impl, block_q=16, block_k=16)


@pytest.mark.parametrize("policy", ["fa2", "paper"])
def test_default_tiles(rng, assert_close, policy):
    """No block sizes given: the policy's default tiles (cut to the sequence)."""
    q, k, v, do = make_qkv(rng, (2, 17, 3, 64), n=4)
    check_against_reference(assert_close, q, k, v, do, policy=policy)


@pytest.mark.parametrize("impl", IMPLS)
def test_cross_attention(rng, assert_close, impl):
    q, do = make_qkv(rng, (2, 19, 2, 32), n=2)
    k, v = make_qkv(rng, (2, 44, 2, 32), n=2)
    check_against_reference(assert_close, q, k, v, do, causal=False, impl=impl, block_q=16,
                            block_k=16)


@pytest.mark.parametrize("policy", ["fa2", "paper", "fp32"])
@pytest.mark.parametrize("beta,score", [(2.0, 50.0), (7.0, 50.0),
                                        pytest.param(7.0, 120.0, marks=pytest.mark.slow),
                                        pytest.param(2.0, 120.0, marks=pytest.mark.slow)])
def test_stable_with_large_tied_max(rng, assert_close, policy, beta, score):
    """The underflow guard: tied maxima of 50–120 with β = 2 and 7 ((β − 1)·r_m up to 720 nats, far
    past exp's FP32 range and the authors' 1e-10 clamp): O and the gradients within the bound,
    whose δ term carries the stored O's rounding into the saturated rows' dQ, dK."""
    q, k, v = tied_inputs(rng, (1, 24, 2, 32), score=score)
    do = make_qkv(rng, q.shape, n=1)[0]
    for delta in ("o", "o_hp"):
        check_against_reference(assert_close, q, k, v, do, policy=policy, beta=beta, stable=True,
                                delta=delta, impl="jnp", block_q=16, block_k=32)


@pytest.mark.parametrize("policy", ["fa2", "paper"])
def test_stable_with_large_tied_max_on_the_kernels(rng, assert_close, policy):
    q, k, v = tied_inputs(rng, (1, 24, 1, 32), score=80.0)
    do = make_qkv(rng, q.shape, n=1)[0]
    check_against_reference(assert_close, q, k, v, do, policy=policy, beta=7.0, stable=True,
                            impl="pallas", block_q=16, block_k=32)


@pytest.mark.parametrize("impl", ["jnp", "pallas"])
def test_stable_fp16_large_tied_max(rng, impl):
    """FP16 inputs, "fa2", stable, tied maxima of ~30 nats: the guard folds the offset into [4, 8)
    nats for an FP16 P̄, so the tied keys' P̄ ≥ e^-8 stays above FP16's smallest normal (2⁻¹⁴); with
    the BF16 guard's [10, 20) they fell below its smallest subnormal and O collapsed towards 0."""
    q, k, v = tied_inputs(rng, (1, 24, 1, 32), jnp.float16, score=30.0)
    kw = dict(stable=True, block_q=16, block_k=32)
    o = f64(jitted(jf.attention, q, k, v, impl=impl, **kw))  # compiled whole, not op by op
    ref = jf.reference_numpy(q, k, v)
    bound, _ = o_bound(q, k, v, numerics(q, k, v, **kw))
    assert np.all(np.abs(o - ref) <= bound)


# ------------------------------------------------------------------------------------ composition
JIT_KW = dict(stable=True, block_q=16, block_k=16, impl="jnp")


@functools.cache
def _op_by_op():
    """The inputs of JitTest and their op-by-op (O, dQ, dK, dV), computed once for both variants."""
    rng = np.random.default_rng(0)
    q, k, v, do = make_qkv(rng, (2, 20, 2, 32), n=4)
    return (q, k, v, do), run_eager(q, k, v, do, **JIT_KW)


class JitTest(chex.TestCase):
    """attention under jit and without it: the same program, bitwise the same values."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_forward_and_gradients(self):
        (q, k, v, do), want = _op_by_op()
        f = self.variant(lambda q, k, v, do: run_eager(q, k, v, do, **JIT_KW))
        outs = f(q, k, v, do)
        chex.assert_trees_all_equal(outs, want)
        for out, x in zip(outs, (q, q, k, v)):
            chex.assert_shape(out, x.shape)
            chex.assert_type(out, BF16)


@pytest.mark.parametrize("impl", ["pallas", pytest.param("jnp", marks=pytest.mark.slow)])
def test_grad_of_vmap_equals_per_element(rng, assert_close, impl):
    """jit(vmap(grad)) over a leading axis: each slice's gradients are the single call's, within
    twice the gradient bound (each is within it of the exact gradient; the batched program may
    fuse and block FP32 sums otherwise than the single call's)."""
    q, k, v = make_qkv(rng, (2, 1, 20, 2, 32))
    kw = dict(stable=True, block_q=16, block_k=16)

    def loss(q, k, v, impl):
        return jnp.sum(jf.attention(q, k, v, impl=impl, **kw).astype(jnp.float32) ** 2)

    g = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, 0, 0, None)),
                static_argnums=3)(q, k, v, impl)
    chex.assert_trees_all_equal_shapes_and_dtypes(g, (q, k, v))
    # compiled once for both slices: op by op, each slice's call compiled its own pieces
    grad_one = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    for i in range(q.shape[0]):
        g_one = grad_one(q[i], k[i], v[i], impl)
        # dO = 2·O: both calls see the same dO, so the exact-δ bound covers each
        do = 2 * jitted(jf.attention, q[i], k[i], v[i], impl=impl, **kw).astype(jnp.float32)
        cfg = numerics(q[i], k[i], v[i], impl=impl, **kw)
        for name, a, b, bd in zip(("dQ", "dK", "dV"), g, g_one, grad_bounds(q[i], k[i], v[i], do, cfg)):
            assert_close(a[i], b, 2 * bd, name)


@pytest.mark.parametrize("impl", ["pallas", pytest.param("jnp", marks=pytest.mark.slow)])
def test_nan_stays_in_its_rows(rng, impl):
    """A NaN in one key of one (batch, head): exactly the rows that attend to it are NaN — rows
    before it (causal), other heads and other batch elements stay finite, gradients too."""
    q, k, v = make_qkv(rng, (3, 20, 2, 32))
    k = k.at[1, 4, 0, 0].set(jnp.nan)
    kw = dict(impl=impl, block_q=16, block_k=16)
    o = f64(jitted(jf.attention, q, k, v, **kw))  # compiled whole, not op by op
    nan_rows = np.isnan(o).any(-1)  # [B, T, H]
    want = np.zeros_like(nan_rows)
    want[1, 4:, 0] = True
    np.testing.assert_array_equal(nan_rows, want)
    g = jax.jit(jax.grad(lambda q: jnp.sum(jf.attention(q, k, v, **kw).astype(jnp.float32))))(q)
    assert np.isfinite(f64(g)[[0, 2]]).all() and np.isfinite(f64(g)[1, :, 1]).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_with_lse(rng, record_bound, impl):
    """The saved L = logsumexp of the scaled scores, natural-log units, [batch, heads, q_len];
    bound: L̃'s relative error of ℓ (the forward's row term) plus FP32 roundings of m + log ℓ."""
    q, k, v = make_qkv(rng, (1, 37, 2, 32))
    kw = dict(impl=impl, block_q=16, block_k=16)
    o, lse = attention_with_lse(q, k, v, **kw)  # compiled whole, not op by op
    chex.assert_shape(lse, (1, 2, 37))
    chex.assert_type(lse, jnp.float32)
    chex.assert_trees_all_equal(o, jitted(jf.attention, q, k, v, **kw))
    s = np.einsum("bqhd,bkhd->bhqk", f64(q), f64(k)) / math.sqrt(32)
    s = np.where(np.tril(np.ones((37, 37), bool)), s, -np.inf)
    ref = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    _, terms = o_bound(q, k, v, numerics(q, k, v, **kw))
    den = terms["den"][..., 0].transpose(0, 2, 1)  # [B, H, Q]
    bound = -np.log1p(-den) + 8 * 2.0 ** -24 * (np.abs(ref) + 1)
    record_bound(np.abs(f64(lse) - ref), bound, "L")


# ----------------------------------------------------------------------------------------- plan
def test_plan_is_the_same_on_every_executor_and_machine(monkeypatch):
    """plan()'s Numerics depend on the arguments alone: the same for impl jnp / pallas / auto, on a
    CPU and (the backend faked) on a GPU whatever the tuning table holds."""
    from jax_flash.pallas import tuning

    x = jax.ShapeDtypeStruct((2, 1024, 4, 128), BF16)
    kw = dict(stable=True, causal=True)
    base = jf.plan(x, x, x, impl="jnp", **kw).numerics
    assert jf.plan(x, x, x, impl="pallas", **kw).numerics == base
    assert jf.plan(x, x, x, impl="auto", **kw).numerics == base
    assert (base.block_q, base.block_k, base.scale_late) == (64, 128, True)  # "fa2" at head_dim 128
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(tuning, "lookup_entry", lambda *a: (
        "fa2/d128/t1024/causal", jf.Launch(fwd_kernel="mosaic", prefetch_rows=True, split_diagonal=True)))
    p = jf.plan(x, x, x, impl="auto", **kw)
    assert p.numerics == base and p.executor == "pallas" and p.launch.split_diagonal
    assert p.launch.fwd_kernel == "triton"  # Mosaic unavailable here: the table's choice falls back
    record = p.to_dict()
    assert record["policy"] == "fa2" and record["block_k"] == 128 and record["executor"] == "pallas"


def test_plan_defaults_per_policy_and_head_dim():
    for policy, d, tiles in (("fa2", 64, (64, 64)), ("fa2", 128, (64, 128)), ("paper", 64, (32, 512)),
                             ("fp32", 128, (64, 64)), ("paper_sr", 128, (32, 512))):
        x = jax.ShapeDtypeStruct((1, 4096, 1, d), BF16)
        num = jf.plan(x, x, x, policy=policy).numerics
        assert (num.block_q, num.block_k) == tiles, policy
        assert num.scale_late == (policy == "fa2" and d == 128)
        assert num.policy.exp_ftz == policy.startswith("fa2")


def test_table_choice_falls_back_explicit_launch_raises(monkeypatch):
    """A tuning-table entry that names the Mosaic kernels falls back to Triton silently where they
    cannot run; the same request given as ``launch=`` raises (here: no GPU)."""
    from jax_flash.pallas import mosaic_common, tuning

    x = jax.ShapeDtypeStruct((1, 256, 1, 64), BF16)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(mosaic_common, "unavailable", lambda: "no Hopper here (test)")
    monkeypatch.setattr(tuning, "lookup_entry",
                        lambda *a: (None, jf.Launch(fwd_kernel="mosaic", bwd_kernel="mosaic")))
    p = jf.plan(x, x, x, impl="pallas")
    assert (p.launch.fwd_kernel, p.launch.bwd_kernel) == ("triton", "triton")
    assert "fwd_kernel: triton for mosaic (no Hopper here (test))" in p.notes  # the entry was seen
    with pytest.raises(ValueError, match="Mosaic GPU kernels cannot run this call.*no Hopper"):
        jf.plan(x, x, x, impl="pallas", launch={"fwd_kernel": "mosaic"})
    # available, but the call is not covered ("paper"): the same two outcomes
    monkeypatch.setattr(mosaic_common, "unavailable", lambda: None)
    p = jf.plan(x, x, x, impl="pallas", policy="paper", block_k=64)
    assert p.launch.fwd_kernel == "triton" and any("policy 'paper'" in n for n in p.notes)
    with pytest.raises(ValueError, match="policy 'paper'"):
        jf.plan(x, x, x, impl="pallas", policy="paper", block_k=64, launch={"fwd_kernel": "mosaic"})
    assert jf.plan(x, x, x, impl="pallas", launch={"fwd_kernel": "mosaic"}).launch.fwd_kernel == "mosaic"


# ------------------------------------------------------------------------------------ bad input
# One row of docs/TESTING.md's table each: (case, build(q, k, v) -> (args, kwargs), expected):
# expected is (exception, message) or None for a correct result checked against float64.
SHAPE = (2, 8, 2, 32)


def _cast(dtype):
    return lambda q, k, v: ((np.asarray(q, np.float32).astype(dtype), np.asarray(k, np.float32).astype(dtype),
                             np.asarray(v, np.float32).astype(dtype)), {})


def _with(**kw):
    return lambda q, k, v: ((q, k, v), dict(kw))


def _head_dim(d):
    return lambda q, k, v: ((jnp.zeros((1, 4, 1, d), BF16),) * 3, {})


ERRORS = {
    "rank 3": (lambda q, k, v: ((q[0], k, v), {}), ValueError, "rank 4"),
    "rank 5": (lambda q, k, v: ((q[None], k, v), {}), ValueError, "rank 4"),
    "batch mismatch": (lambda q, k, v: ((jnp.concatenate([q, q]), k, v), {}), ValueError, "batch sizes"),
    "heads mismatch": (lambda q, k, v: ((q, k[:, :, :1], v), {}), ValueError, "head counts"),
    "head_dim mismatch": (lambda q, k, v: ((q[..., :16], k, v), {}), ValueError, "head_dim"),
    "k, v lengths differ": (lambda q, k, v: ((q, k, v[:, :5]), {}), ValueError, "sequence lengths"),
    "causal q_len != kv_len": (lambda q, k, v: ((q, k[:, :5], v[:, :5]), {}), ValueError, "causal"),
    "mixed dtypes": (lambda q, k, v: ((q, k.astype(jnp.float32), v), {}), TypeError, "one dtype"),
    "int32": (_cast(np.int32), TypeError, "bfloat16, float16 or float32"),
    "float64": (_cast(np.float64), TypeError, "float64 .*'fp32' policy"),
    "a list": (lambda q, k, v: ((np.asarray(q, np.float32).tolist(), k, v), {}), TypeError, "must be an array"),
    "kv_len 0": (lambda q, k, v: ((q[:, :0], k[:, :0], v[:, :0]), {}), ValueError, "kv_len is 0"),
    "head_dim 0": (_head_dim(0), ValueError, "head_dim"),
    "unknown policy": (_with(policy="bf16"), ValueError, "unknown policy"),
    "unknown delta": (_with(delta="x"), ValueError, "unknown delta"),
    "unknown impl": (_with(impl="cuda"), ValueError, "unknown impl"),
    "causal='false'": (_with(causal="false"), TypeError, "causal must be a bool"),
    "stable='no'": (_with(stable="no"), TypeError, "stable must be a bool"),
    "causal=1": (_with(causal=1), TypeError, "causal must be a bool"),
    "beta=1": (_with(beta=1.0), ValueError, "beta must be a finite number > 1"),
    "beta=inf": (_with(beta=float("inf")), ValueError, "beta"),
    "beta='2'": (_with(beta="2"), TypeError, "beta must be a number"),
    "sm_scale=-1": (_with(sm_scale=-1.0), ValueError, "sm_scale must be a finite number > 0"),
    "sm_scale=nan": (_with(sm_scale=float("nan")), ValueError, "sm_scale"),
    "sm_scale=True": (_with(sm_scale=True), TypeError, "sm_scale must be a number"),
    "block_q=24": (_with(block_q=24), ValueError, "block_q must be a power of two"),
    "block_k=8": (_with(block_k=8), ValueError, "block_k must be a power of two >= 16"),
    "block_k=64.0": (_with(block_k=64.0), ValueError, "block_k must be a power of two"),
    "launch with a numerics field": (_with(launch={"block_k": 64}), ValueError, "not launch fields"),
    "launch of a wrong type": (_with(launch="mosaic"), TypeError, "launch must be"),
    "launch fwd_kernel unknown": (_with(launch={"fwd_kernel": "cuda"}), ValueError, "fwd_kernel"),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_raises(rng, case, impl):
    build, exc, msg = ERRORS[case]
    args, kw = build(*make_qkv(rng, SHAPE))
    with pytest.raises(exc, match=msg):
        jf.attention(*args, impl=kw.pop("impl", impl), **kw)


@pytest.mark.parametrize("impl", IMPLS)
def test_explicit_mosaic_launch_raises_off_hopper(rng, impl):
    """``launch={"fwd_kernel": "mosaic"}`` where the Mosaic kernels cannot run (no GPU): the pallas
    executor raises; the jnp executor runs no kernel, so a valid launch is accepted and unused."""
    q, k, v = make_qkv(rng, (1, 256, 1, 64))
    if impl == "pallas":
        with pytest.raises(ValueError, match="Mosaic GPU kernels cannot run this call"):
            jf.attention(q, k, v, impl=impl, launch={"fwd_kernel": "mosaic"})
    else:
        assert jf.plan(q, k, v, impl=impl, launch={"fwd_kernel": "mosaic"}).launch == jf.Launch()


def test_traced_sm_scale_must_be_static(rng):
    q, k, v = make_qkv(rng, SHAPE)
    for name in ("sm_scale", "beta"):
        f = jax.jit(lambda x, q, k, v, name=name: jf.attention(q, k, v, **{name: x}))
        with pytest.raises(TypeError, match=f"{name} must be a static Python number"):
            f(2.0, q, k, v)


EMPTY = {"batch 0": (0, 8, 2, 8), "heads 0": (2, 8, 0, 8), "q_len 0": (2, 0, 2, 8)}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(EMPTY))
def test_empty_input_gives_empty_result(rng, case, impl):
    """Nothing to compute: an empty O of q's shape and dtype (q_len 0: cross-attention over 8 keys),
    and empty gradients."""
    b, tq, h, tk = EMPTY[case]
    q = jnp.zeros((b, tq, h, 32), BF16)
    k = v = jnp.asarray(rng.standard_normal((b, tk, h, 32)), BF16)
    f = lambda q, k, v: jf.attention(q, k, v, causal=False, impl=impl)
    o = f(q, k, v)
    chex.assert_shape(o, q.shape)
    chex.assert_type(o, BF16)
    grads = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)
    chex.assert_trees_all_equal_shapes_and_dtypes(grads, (q, k, v))


CORRECT = {
    "q_len = kv_len = 1": dict(shape=(2, 1, 2, 32)),
    "odd length 37": dict(shape=(1, 37, 2, 32)),
    "prime length 61": dict(shape=(1, 61, 1, 32)),
    "head_dim 1": dict(shape=(1, 20, 1, 1)),
    "head_dim 3 (the kernels pad it)": dict(shape=(1, 20, 1, 3)),
    "head_dim 16": dict(shape=(1, 20, 1, 16)),
    "head_dim 24 (the kernels pad it)": dict(shape=(1, 20, 1, 24)),
    "head_dim 256": dict(shape=(1, 20, 1, 256)),
    "cross-attention 1 query": dict(shape=(2, 1, 2, 32), kv=29, causal=False),
    "block_k 1024 > T (cut to T)": dict(shape=(1, 37, 1, 32), block_k=1024),
    "block_q 512 > T (cut to T)": dict(shape=(1, 37, 1, 32), block_q=512),
    "sm_scale np.float32": dict(shape=(1, 20, 1, 32), sm_scale=np.float32(0.1)),
    "sm_scale jnp scalar": dict(shape=(1, 20, 1, 32), sm_scale=jnp.float32(0.1)),
    "beta np.float64": dict(shape=(1, 20, 1, 32), beta=np.float64(3.0), stable=True),
    "beta jnp scalar": dict(shape=(1, 20, 1, 32), beta=jnp.asarray(3.0), stable=True),
    "causal np.bool_": dict(shape=(1, 20, 1, 32), causal=np.bool_(True)),
    "launch dict of launch fields": dict(shape=(1, 37, 1, 32), launch={"split_diagonal": True,
                                                                       "prefetch_scores": True}),
}


# on both executors by default: the lengths and tiles (the kernels' padding and masks); the rest on
# the jnp executor, and on the kernels with JAX_FLASH_SLOW=1
BOTH = ("q_len = kv_len = 1", "odd length 37", "prime length 61", "cross-attention 1 query",
        "block_k 1024 > T (cut to T)", "launch dict of launch fields")


@pytest.mark.parametrize("case,impl", [(c, i) if i == "jnp" or c in BOTH else
                                       pytest.param(c, i, marks=pytest.mark.slow)
                                       for c in CORRECT for i in IMPLS])
def test_edge_input_gives_correct_result(rng, assert_close, case, impl):
    spec = dict(CORRECT[case])
    shape, kv = spec.pop("shape"), spec.pop("kv", None)
    q, do = make_qkv(rng, shape, n=2)
    k, v = make_qkv(rng, shape[:1] + (kv or shape[1],) + shape[2:], n=2)
    check_against_reference(assert_close, q, k, v, do, impl=impl, **spec)
    if "sm_scale" in spec or "beta" in spec:  # a NumPy / JAX scalar is its Python float
        plain = {n: float(x) for n, x in spec.items() if n in ("sm_scale", "beta")}
        chex.assert_trees_all_equal(jitted(jf.attention, q, k, v, impl=impl, **spec),
                                    jitted(jf.attention, q, k, v, impl=impl, **{**spec, **plain}))
    if "block_k" in spec or "block_q" in spec:
        num = numerics(q, k, v, **spec)
        assert num.block_k <= 64 and num.block_q <= 64  # the next power of two ≥ T = 37


@pytest.mark.parametrize("impl,where,value", [
    (i, w, x) if i == "jnp" or w == "v" else pytest.param(i, w, x, marks=pytest.mark.slow)
    for i in IMPLS for w in ("q", "k", "v") for x in (np.nan, np.inf)])
def test_nonfinite_input_stays_in_its_rows(rng, impl, where, value):
    """A NaN or +inf in one element of q, k or v (batch 1, head 0, position 17 of 20; 16-row tiles):
    other heads and batch elements stay finite; within the (batch, head), the query's own row (q)
    or the rows from the key on (k, v; causal) are non-finite, the 16 rows of the first query block
    (which cannot see position 17) finite. Row 16 shares the key's tile without seeing it: P̄ = 0
    times a non-finite V row is NaN there (0·inf), as in every flash kernel."""
    q, k, v = make_qkv(rng, (2, 20, 2, 32))
    x = {"q": q, "k": k, "v": v}
    x[where] = x[where].at[1, 17, 0, 3].set(value)
    # one compiled program serves every case of an executor: op by op, each case compiled its own
    o = f64(jitted(jf.attention, x["q"], x["k"], x["v"], impl=impl, block_q=16, block_k=16))
    bad = ~np.isfinite(o).all(-1)  # [B, T, H]
    outside = bad.copy()
    outside[1, :, 0] = False
    assert not outside.any()
    rows = bad[1, :, 0]
    assert not rows[:16].any(), np.flatnonzero(rows)
    if where == "q":
        np.testing.assert_array_equal(rows, np.arange(20) == 17)
    elif not (where == "k" and value == np.inf):  # q·k = −inf masks the key instead of +inf
        assert rows[17:].all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("policy", ["fa2", "paper", "fp32"])
def test_scores_of_1e4(rng, assert_close, impl, policy):
    """Scores near 1e4, the two largest 45 apart (10001 and 9956; the rest near 6800): exactly, the
    softmax is one-hot on the largest (e⁻⁴⁵). "fa2" and "fp32" keep the scores in FP32 and give that
    within their bound. "paper" rounds the scores to BF16 (spacing 64 near 1e4): both become 9984,
    a tie, and O is the mean of the two V rows — by design (the authors' arithmetic), finite, and
    without a warning."""
    import warnings

    d = 32
    q = np.zeros((1, 4, 1, d), np.float32)
    q[..., 0] = 128.0
    k = np.zeros((1, 16, 1, d), np.float32)
    k[0, :, 0, 0] = 300.0 + rng.integers(0, 8, 16)  # scores ≈ 6800
    k[0, 0, 0, 0], k[0, 1, 0, 0] = 442.0, 440.0  # 128·442/√32 = 10001.1, 128·440/√32 = 9955.8
    q, k = jnp.asarray(q, BF16), jnp.asarray(k, BF16)
    v = make_qkv(rng, k.shape, n=1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o = f64(jf.attention(q, k, v, causal=False, impl=impl, policy=policy, block_q=16, block_k=16))
    assert np.isfinite(o).all()
    ref = jf.reference_numpy(q, k, v, causal=False)
    if policy == "paper":
        mean = (f64(v)[:, 0] + f64(v)[:, 1])[:, None] / 2
        bound = 4 * 2.0 ** -8 * (np.abs(f64(v)[:, 0]) + np.abs(f64(v)[:, 1]))[:, None]  # BF16 roundings
        assert_close(o, np.broadcast_to(mean, o.shape), bound, "O (mean of the tied V rows)")
        assert np.abs(o - ref).max() > 0.1  # not the exact softmax
    else:
        cfg = numerics(q, k, v, causal=False, policy=policy, block_q=16, block_k=16)
        assert_close(o, ref, o_bound(q, k, v, cfg)[0], "O")


@pytest.mark.parametrize("shape,kw,impl", [
    ((1, 32, 2, 32), {"stable": True}, "pallas"),
    ((1, 32, 2, 32), {"block_q": 16, "block_k": 16, "launch": {"heavy_first": True}}, "pallas"),
    pytest.param((1, 32, 3, 32), {"delta": "dpp", "policy": "paper", "causal": False}, "pallas",
                 marks=pytest.mark.slow),
    ((1, 40, 2, 24), {}, "pallas"),  # neither a whole number of tiles nor a kernel head_dim: sliced
    pytest.param((1, 32, 2, 16), {}, "jnp", marks=pytest.mark.slow),
])
def test_attention_qkvpacked_is_attention_of_its_slots(shape, kw, impl):
    """``attention_qkvpacked(qkv)``: output and gradient bit-identical to ``attention`` of the three
    slots; where the Triton kernels run it they read the packed array in place and write one
    gradient buffer (no slice or concatenation in the computation)."""
    b, t, h, d = shape
    qkv = (2 * jax.random.normal(jax.random.key(0), (b, t, 3, h, d))).astype(jnp.bfloat16)
    do = jax.random.normal(jax.random.key(1), (b, t, h, d), jnp.bfloat16)
    packed = lambda x: jf.attention_qkvpacked(x, impl=impl, **kw)
    sliced = lambda x: jf.attention(x[:, :, 0], x[:, :, 1], x[:, :, 2], impl=impl, **kw)
    o, vjp = jax.vjp(packed, qkv)
    want, want_vjp = jax.vjp(sliced, qkv)
    chex.assert_trees_all_equal(o, want)
    chex.assert_trees_all_equal(vjp(do), want_vjp(do))

    step = jax.make_jaxpr(lambda x: jax.vjp(packed, x)[1](do))(qkv).jaxpr
    prims = {e.primitive.name for e in jaxpr_eqns(step)}
    in_place = impl == "pallas" and t == 32 and d in jf.api.HEAD_DIMS  # tiles cut to 32
    assert in_place == (not {"slice", "concatenate", "pad"} & prims)


def test_attention_qkvpacked_bad_shape_raises():
    with pytest.raises(ValueError, match=r"\[batch, seq, 3, heads, head_dim\]"):
        jf.attention_qkvpacked(jnp.zeros((1, 16, 2, 2, 16), jnp.bfloat16))
