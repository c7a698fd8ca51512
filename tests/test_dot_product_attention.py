"""jax_flash.dot_product_attention against jax.nn.dot_product_attention (float32) and a float64 NumPy
reference (bfloat16); the Pallas kernels (interpret mode) against the jnp executor; the stable shift
under masks; the plan's executor choice. Small shapes: the kernels run in interpret mode on CPU."""

import math

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash as jf
from jax_flash import api, tile
from jax_flash.pallas import backward_mosaic, forward_mosaic

from helpers import rel

BF16 = jnp.bfloat16
TILES = dict(block_q=16, block_k=16)  # several tiles per row at these lengths
U_BF16 = 2.0 ** -8  # BF16 unit roundoff (half its ulp at 1)

# the required bound for float32 inputs: ‖out − jax.nn‖ / ‖jax.nn‖; FP32 sums over ≤ 64 terms with
# a few roundings each stay below 1e-6 on these shapes
F32_REL = 2e-5


def normal(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


_JITTED = {}


def with_grads(f, args, do, key=None, consts=()):
    """(out, grads of ⟨out, do⟩ w.r.t. every arg), under jit; ``consts``: more arguments of ``f``,
    after ``args``, not differentiated. ``key``: compiled once per key — a sweep's seeds reuse it,
    so ``f`` must then depend on nothing random but its arguments."""
    def run(args, consts, do):
        o, vjp = jax.vjp(lambda *a: f(*a, *consts), *args)
        return (o,) + vjp(do)
    fn = jax.jit(run) if key is None else _JITTED.setdefault(key, jax.jit(run))
    return fn(tuple(args), tuple(consts), do)


# ------------------------------------------------------------------------- the float64 reference
def reference64(q, k, v, do=None, *, bias=None, mask=None, causal=False, window=None,
                q_lens=None, kv_lens=None, scale=None):
    """jax.nn's semantics in float64 NumPy, [B, T, N, H] (K/V heads repeated here, where it costs
    nothing but memory): O, and with ``do`` (dQ, dK, dV) plus the terms the BF16 bounds use."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = n // kh
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    logits = np.einsum("btnh,bsnh->bnts", q, kr) * scale
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    vis = np.ones((b, n, t, s), bool)
    rows, cols = np.arange(t)[:, None], np.arange(s)[None, :]
    if causal:
        vis &= cols <= rows
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        vis &= (cols >= rows - left) & (cols <= rows + right)
    if kv_lens is not None:
        vis &= np.arange(s)[None, None, None, :] < np.asarray(kv_lens)[:, None, None, None]
    if mask is not None:
        vis &= np.asarray(mask)
    # fully masked rows: uniform weights over all keys, as jax.nn's equal masked logits give
    empty = ~vis.any(-1, keepdims=True)
    logits = np.where(vis, logits, -np.inf)
    logits = np.where(empty, 0.0, logits)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    valid = np.ones((b, 1, t, 1), bool) if q_lens is None else \
        (np.arange(t)[None, None, :, None] < np.asarray(q_lens)[:, None, None, None])
    o = np.einsum("bnts,bsnh->btnh", p, vr) * valid.transpose(0, 2, 1, 3)
    if do is None:
        return o
    do = np.asarray(do, np.float64) * valid.transpose(0, 2, 1, 3)
    dp = np.einsum("btnh,bsnh->bnts", do, vr)
    delta = np.einsum("btnh,btnh->bnt", do, o)[..., None]
    ds = p * (dp - delta)
    ds_logits = np.where(empty, 0.0, ds)  # masked logits get no gradient (jnp.where)
    dq = np.einsum("bnts,bsnh->btnh", ds_logits, kr) * scale
    dk = np.einsum("bnts,btnh->bsnh", ds_logits, q) * scale
    dv = np.einsum("bnts,btnh->bsnh", p, do)
    fold = lambda x: x.reshape(b, s, kh, g, h).sum(3)
    terms = dict(p=p, ds=ds_logits, do=do, o=o, kr=kr, vr=vr, q=q, scale=scale, g=g)
    return o, dq, fold(dk), fold(dv), terms


# --------------------------------------------------------------- float32 against jax.nn's xla
CASES = {
    # name: (B, T, S, N, K, H, kwargs); odd lengths, T ≠ S, GQA/MQA, every masking argument
    "gqa_causal_cross": (2, 21, 37, 4, 2, 24, dict(is_causal=True)),
    "mqa_window_tuple": (1, 40, 40, 3, 1, 16, dict(local_window_size=(5, 2))),
    "window_int_causal": (2, 33, 33, 2, 1, 32, dict(local_window_size=7, is_causal=True)),
    "lengths": (3, 19, 29, 2, 2, 16, dict(query_seq_lengths=[19, 7, 0],
                                          key_value_seq_lengths=[29, 0, 12])),
    "lengths_causal_window": (2, 35, 35, 4, 2, 32, dict(
        key_value_seq_lengths=[9, 35], is_causal=True, local_window_size=(6, 0))),
    "window_rows_without_keys": (1, 40, 24, 2, 2, 16, dict(local_window_size=(3, 1))),
}
DENSE_CASES = {
    "mask_padding": (2, 17, 23, 4, 2, 32, dict(mask=(2, 1, 1, 23))),
    "mask_full_gqa_causal": (2, 20, 20, 4, 1, 16, dict(mask=(2, 4, 20, 20), is_causal=True)),
    "bias_heads": (1, 18, 25, 2, 2, 32, dict(bias=(1, 2, 18, 25))),
    "bias_and_mask_window": (2, 19, 19, 2, 1, 24, dict(bias=(2, 1, 1, 19), mask=(1, 2, 19, 19),
                                                      local_window_size=(4, 4))),
}


def _case_args(rng, spec, dtype=jnp.float32):
    b, t, s, n, kh, h, kw = spec
    kw = dict(kw)
    q, do = normal(rng, (b, t, n, h), dtype), normal(rng, (b, t, n, h), dtype)
    k, v = normal(rng, (b, s, kh, h), dtype), normal(rng, (b, s, kh, h), dtype)
    if "mask" in kw:
        kw["mask"] = jnp.asarray(rng.random(kw["mask"]) < 0.7)
    if "bias" in kw:
        kw["bias"] = normal(rng, kw["bias"], dtype)
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        if name in kw:
            kw[name] = jnp.asarray(kw[name], jnp.int32)
    return q, k, v, do, kw


def _against_jax_nn(rng, name, spec, impl, check):
    """Ours (``impl``) against jax.nn's XLA attention in float32, outputs and gradients; ``check``:
    the ``record_bound`` fixture."""
    q, k, v, do, kw = _case_args(rng, spec)
    bias, mask = kw.pop("bias", None), kw.pop("mask", None)
    args = (q, k, v) + (() if bias is None else (bias,))
    consts = () if mask is None else (mask,)

    def call(fn, **more):  # bias and mask as arguments: the compiled program serves every seed
        def f(q, k, v, *rest):
            extra = dict(more)
            if bias is not None:
                extra["bias"], rest = rest[0], rest[1:]
            if mask is not None:
                extra["mask"] = rest[0]
            return fn(q, k, v, **extra, **kw)
        return f

    got = with_grads(call(jf.dot_product_attention, implementation=impl, **TILES), args, do,
                     key=("jax_nn", name, impl, "ours"), consts=consts)
    want = with_grads(call(jax.nn.dot_product_attention, implementation="xla"), args, do,
                      key=("jax_nn", name, impl, "theirs"), consts=consts)
    for what, a, b in zip(("O", "dQ", "dK", "dV", "dbias"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, what
        check(rel(a, b), F32_REL, what)


SLOW = pytest.mark.slow  # the rest of the cases (JAX_FLASH_SLOW=1); the default subset stays < 60 s


def _cases(names, slow):
    return [pytest.param(n, marks=SLOW) if n in slow else n for n in sorted(names)]


@pytest.mark.parametrize("name", _cases(CASES, {"window_int_causal", "lengths_causal_window",
                                                "mqa_window_tuple"}))
def test_float32_matches_jax_nn_jnp(rng, record_bound, name):
    _against_jax_nn(rng, name, CASES[name], "jnp", record_bound)


@pytest.mark.parametrize("name", _cases(
    ["gqa_causal_cross", "lengths_causal_window", "window_rows_without_keys"],
    {"gqa_causal_cross", "window_rows_without_keys"}))
def test_float32_matches_jax_nn_pallas(rng, record_bound, name):
    _against_jax_nn(rng, name, CASES[name], "pallas", record_bound)


@pytest.mark.parametrize("name", _cases(DENSE_CASES, {"mask_padding", "bias_heads",
                                                      "mask_full_gqa_causal"}))
def test_float32_mask_and_bias_match_jax_nn(rng, record_bound, name):
    _against_jax_nn(rng, name, DENSE_CASES[name], None, record_bound)


def test_rank3_inputs_match_jax_nn(rng, record_bound):
    q, do = normal(rng, (19, 4, 16)), normal(rng, (19, 4, 16))
    k, v = normal(rng, (26, 2, 16)), normal(rng, (26, 2, 16))
    bias = normal(rng, (4, 19, 26))
    kw = dict(is_causal=True, key_value_seq_lengths=jnp.array([20], jnp.int32))
    got = with_grads(lambda q, k, v, b: jf.dot_product_attention(q, k, v, b, **TILES, **kw),
                     (q, k, v, bias), do, key="rank3-ours")
    want = with_grads(lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, b, **kw),
                      (q, k, v, bias), do, key="rank3-theirs")
    for what, a, b in zip(("O", "dQ", "dK", "dV", "dbias"), got, want):
        assert a.shape == b.shape
        record_bound(rel(a, b), F32_REL, what)


_TRACED_LENGTHS = jax.jit(lambda q, k, v, ql, kl: jf.dot_product_attention(
    q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl, **TILES))


def test_traced_lengths_under_jit(rng, record_bound):
    q, k, v, _, _ = _case_args(rng, CASES["lengths"])
    f = _TRACED_LENGTHS
    for ql, kl in (([19, 3, 8], [1, 29, 40]), ([0, 19, 19], [29, 5, -2])):
        ql, kl = jnp.asarray(ql, jnp.int32), jnp.asarray(kl, jnp.int32)
        want = jax.nn.dot_product_attention(q, k, v, query_seq_lengths=ql,
                                            key_value_seq_lengths=kl)
        record_bound(rel(f(q, k, v, ql, kl), want), F32_REL, "O")


def test_attention_keeps_its_meaning(rng):
    """``attention`` stays causal by default and computes what ``dot_product_attention`` does."""
    q, k, v = normal(rng, (2, 24, 4, 32), BF16), normal(rng, (2, 24, 2, 32), BF16), \
        normal(rng, (2, 24, 2, 32), BF16)
    a = jax.jit(lambda q, k, v: jf.attention(q, k, v, **TILES))(q, k, v)
    b = jax.jit(lambda q, k, v: jf.dot_product_attention(q, k, v, is_causal=True, **TILES))(q, k, v)
    chex.assert_trees_all_equal(a, b)
    with pytest.raises(ValueError, match="q_len == kv_len"):
        jf.attention(q, k[:, :20], v[:, :20])


# ------------------------------------------------------------- bfloat16 against float64
def _bf16_bounds(terms, o64, dq64, dk64, dv64, q, k):
    """Elementwise bounds on |ours − float64| for BF16 inputs under "fa2" (the inputs are exact BF16
    values, so the reference sees the same inputs). First-order terms: P̄ and dS rounded to BF16
    before their matmuls (each entry off by ≤ u = 2⁻⁸ relative), δ from the stored BF16 O, and each
    output rounded to BF16 (≤ u relative); FP32 accumulation adds ~2⁻²⁴ relative per term (the
    1e-6 floor covers it). Second-order products of these are below 1 % of the bound (the 1.01)."""
    p, ds, do, o, kr, vr = (terms[x] for x in ("p", "ds", "do", "o", "kr", "vr"))
    q64, scale, g = terms["q"], terms["scale"], terms["g"]
    b, s, kh, h = dk64.shape
    fold = lambda x: x.reshape(b, s, kh, g, h).sum(3)
    # δ = rowsum(dO ∘ O_bf16): O stored with ≤ u relative error per element
    d_delta = U_BF16 * np.einsum("btnh,btnh->bnt", np.abs(do), np.abs(o))[..., None]
    out = dict(
        O=U_BF16 * np.abs(o64) + U_BF16 * np.einsum("bnts,bsnh->btnh", p, np.abs(vr)),
        dV=U_BF16 * np.abs(dv64) + U_BF16 * fold(np.einsum("bnts,btnh->bsnh", p, np.abs(do))),
        dQ=U_BF16 * np.abs(dq64) + scale * np.einsum(
            "bnts,bsnh->btnh", U_BF16 * np.abs(ds) + p * d_delta, np.abs(kr)),
        dK=U_BF16 * np.abs(dk64) + scale * fold(np.einsum(
            "bnts,btnh->bsnh", U_BF16 * np.abs(ds) + p * d_delta, np.abs(q64))),
    )
    return {name: 1.01 * x + 1e-6 for name, x in out.items()}


@pytest.mark.parametrize("impl,stable", [pytest.param("jnp", False, marks=SLOW),
                                         pytest.param("jnp", True, marks=SLOW), ("pallas", True)])
def test_bfloat16_within_derived_bound_of_float64(rng, record_bound, impl, stable):
    b, t, s, n, kh, h = 2, 37, 37, 4, 2, 32
    q, do = normal(rng, (b, t, n, h), BF16), normal(rng, (b, t, n, h), BF16)
    k, v = normal(rng, (b, s, kh, h), BF16), normal(rng, (b, s, kh, h), BF16)
    kw = dict(is_causal=True, local_window_size=(9, 0), query_seq_lengths=[37, 30],
              key_value_seq_lengths=[37, 33])
    jkw = {key: jnp.asarray(x, jnp.int32) if "lengths" in key else x for key, x in kw.items()}
    got = with_grads(lambda q, k, v: jf.dot_product_attention(
        q, k, v, implementation=impl, stable=stable, **TILES, **jkw), (q, k, v), do,
        key=("bf16", impl, stable))
    o64, dq64, dk64, dv64, terms = reference64(
        q, k, v, do, causal=True, window=(9, 0), q_lens=kw["query_seq_lengths"],
        kv_lens=kw["key_value_seq_lengths"])
    bounds = _bf16_bounds(terms, o64, dq64, dk64, dv64, q, k)
    for name, a, ref in zip(("O", "dQ", "dK", "dV"), got, (o64, dq64, dk64, dv64)):
        assert a.dtype == BF16
        record_bound(np.abs(np.asarray(a, np.float64) - ref), bounds[name], name)


# ------------------------------------------------------- the kernels against the jnp executor
def _ulp(x, dtype):
    """``dtype``'s ulp at |x| (normal range)."""
    mag = max(abs(float(x)), float(jnp.finfo(dtype).tiny))
    return 2.0 ** (math.floor(math.log2(mag)) - jnp.finfo(dtype).nmant)


KERNEL_CASES = {
    "gqa_lengths_window": (2, 45, 45, 4, 2, 32, dict(
        is_causal=True, local_window_size=(20, 0), query_seq_lengths=[45, 28],
        key_value_seq_lengths=[40, 45])),
    "mqa_cross_window_both_sides": (1, 33, 50, 3, 1, 16, dict(local_window_size=(12, 17))),
}
LAUNCHES = {"default": None, "split_prefetch": dict(split_diagonal=True, prefetch_scores=True,
                                                    prefetch_rows=True)}


@pytest.mark.parametrize("case,launch", [
    ("gqa_lengths_window", "split_prefetch"),
    pytest.param("gqa_lengths_window", "default", marks=SLOW),
    pytest.param("mqa_cross_window_both_sides", "split_prefetch", marks=SLOW)])
def test_kernels_match_the_jnp_executor(rng, record_bound, case, launch):
    """Interpret mode against the jnp executor: the same tile.py arithmetic on the same tiles (the
    kernels skip the tiles the jnp executor visits as exact no-ops, and with split_diagonal run
    mask-free tiles as such). Not bitwise: XLA:CPU compiles the FP32 steps (dots, exp2, log2) of
    the interpreted kernel and of the executor's fusions into different instruction sequences,
    which leaves last-bit FP32 differences (already for plain causal attention). After the BF16
    rounding of the outputs they flip a few elements by one ulp; an element summed with
    cancellation (a small dK from large terms) moves by FP32 noise of its terms' size, far below
    one BF16 ulp of the tensor's largest element, which bounds every difference here."""
    q, k, v, do, kw = _case_args(rng, KERNEL_CASES[case], BF16)
    run = lambda impl, **extra: with_grads(lambda q, k, v: jf.dot_product_attention(
        q, k, v, implementation=impl, stable=True, **TILES, **kw, **extra), (q, k, v), do,
        key=("kernels", case, launch, impl))
    want = run("jnp")
    got = run("pallas", launch=LAUNCHES[launch])
    for name, a, b in zip(("O", "dQ", "dK", "dV"), got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        record_bound(np.abs(a - b), _ulp(np.max(np.abs(b)), BF16), name)


@pytest.mark.parametrize("head_dim", [pytest.param(24, marks=SLOW), 80])
def test_padded_head_dim_changes_no_value(rng, head_dim):
    """Head dims the kernels lack run zero-padded to the next one (24 → 32, 80 → 128): zero columns
    add exact zeros to every dot over head_dim and the scale is the true head_dim's. On the jnp
    executor, explicitly padded inputs give the unpadded call's bits; the kernels (padding
    internally) give the jnp executor's."""
    q, do = normal(rng, (1, 40, 2, head_dim), BF16), normal(rng, (1, 40, 2, head_dim), BF16)
    k, v = normal(rng, (1, 40, 1, head_dim), BF16), normal(rng, (1, 40, 1, head_dim), BF16)
    padded = api.kernel_head_dim(head_dim)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, padded - head_dim)))
    run = lambda impl, q, k, v, do, scale=None: with_grads(lambda q, k, v: jf.dot_product_attention(
        q, k, v, is_causal=True, scale=scale, implementation=impl, **TILES), (q, k, v), do)
    want = run("jnp", q, k, v, do)
    explicit = run("jnp", pad(q), pad(k), pad(v), pad(do), scale=1 / math.sqrt(head_dim))
    chex.assert_trees_all_equal(tuple(x[..., :head_dim] for x in explicit), want)
    chex.assert_trees_all_equal(tuple(x[..., head_dim:] for x in explicit),
                                tuple(jnp.zeros_like(x[..., head_dim:]) for x in explicit))
    chex.assert_trees_all_equal(run("pallas", q, k, v, do), want)
    p = jf.dot_product_attention_plan(q, k, v, implementation="pallas")
    assert p.numerics.sm_scale == 1 / math.sqrt(head_dim)
    assert any(f"zero-padded to {padded}" in n for n in p.notes)


def _array_sizes(jaxpr):
    """Element counts of every value a jaxpr (and the jaxprs inside it) computes."""
    sizes = []
    for eqn in jaxpr.eqns:
        sizes += [math.prod(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")]
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            sizes += _array_sizes(sub)
    return sizes


@pytest.mark.parametrize("impl", ["jnp", "pallas"])
def test_gqa_never_repeats_kv(impl):
    """K and V (48 keys, 2 heads) are never repeated to the 8 query heads: no value in the forward
    and backward holds more elements than q (32 rows × 8 heads), where a repeated K (48 × 8) would."""
    q = jax.ShapeDtypeStruct((1, 32, 8, 16), BF16)
    k = jax.ShapeDtypeStruct((1, 48, 2, 16), BF16)
    loss = lambda q, k, v: jf.dot_product_attention(
        q, k, v, implementation=impl, **TILES).astype(jnp.float32).sum()
    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, k).jaxpr
    assert max(_array_sizes(jaxpr)) <= math.prod(q.shape)


# --------------------------------------------------------------- the stable shift under masks
def _tie_inputs(dtype=BF16):
    """Keys 5 and 9 equal and aligned with query head 0's rows (a tie at the row max wherever both
    are visible); query head 1 random but opposed to them (their equal scores are its lowest: no
    ties at its max)."""
    rng = np.random.default_rng(19)
    t, h = 32, 16
    k = rng.standard_normal((1, t, 1, h)) * 0.3
    direction = np.zeros(h)
    direction[0] = 1.0
    k[0, 5, 0] = k[0, 9, 0] = 3.0 * direction
    q = np.zeros((1, t, 2, h))
    q[0, :, 0] = 3.0 * direction
    q[0, :, 1] = rng.standard_normal((t, h))
    q[0, :, 1, 0] = -3.0
    v = rng.standard_normal((1, t, 1, h))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


@pytest.mark.parametrize("impl", ["jnp", pytest.param("pallas", marks=SLOW)])
@pytest.mark.parametrize("kw,tied_rows", [
    # window (2, 2): only row 7 sees both keys 5 and 9; rows 3..6 and 8..11 see one of them
    (dict(local_window_size=(2, 2)), [7]),
    # window (6, 6): rows 3..11 see both
    (dict(local_window_size=(6, 6)), list(range(3, 12))),
    # key 9 past the batch element's kv length: no row sees both
    (dict(key_value_seq_lengths=[9], is_causal=True), []),
    # causal: rows ≥ 9 see both
    (dict(is_causal=True), list(range(9, 32))),
])
def test_stable_shift_counts_visible_ties_only(impl, kw, tied_rows):
    """Keys 5 and 9 tie at query head 0's row max. The stable shift moves exactly the rows that see
    both: there O changes (the tied keys' P̄ becomes bf16(e^-r_m) instead of exactly 1, a relative
    change of 2⁻⁹ against ℓ), and every other row — its tie partner outside the window or past
    the length — keeps stable=False's bits, as does query head 1 of the same key/value group
    (no ties)."""
    q, k, v = _tie_inputs()
    kw = {key: jnp.asarray(x, jnp.int32) if "lengths" in key else x for key, x in kw.items()}
    run = lambda stable: np.asarray(jax.jit(lambda q, k, v: jf.dot_product_attention(
        q, k, v, stable=stable, implementation=impl, **TILES, **kw))(q, k, v), np.float32)
    base, stable = run(False), run(True)
    moved = np.nonzero(np.any(stable[0, :, 0] != base[0, :, 0], axis=-1))[0]
    assert moved.tolist() == tied_rows
    chex.assert_trees_all_equal(stable[0, :, 1], base[0, :, 1])


@pytest.mark.parametrize("lengths,expect_shift", [((16, 16), True), ((16, 9), False),
                                                  ((7, 16), False)])
def test_tile_tie_count_ignores_masked_entries(lengths, expect_shift):
    """One tile, two equal maxima (keys 5 and 9 of row 7): the shift moves the row's max only where
    both are visible under the window and the lengths; a row past q_len has no max at all."""
    q, k, v = _tie_inputs(jnp.float32)
    cfg = jf.dot_product_attention_plan(q, k, v, local_window_size=(4, 4), stable=True,
                                        key_value_seq_lengths=jnp.array([16], jnp.int32),
                                        implementation="jnp", **TILES).numerics
    lens = tuple(jnp.int32(x) for x in lengths)
    mask = tile.tile_mask(0, 0, 16, 16, cfg, lengths=lens)
    s = tile.forward_scores(q[0, :16, 0], k[0, :16, 0], cfg)
    m = tile.softmax_update(tile.init_carry(16, 16, cfg), s, mask, cfg)[0]
    r_m = float(jnp.max(jnp.where(mask[7], s[7], -jnp.inf)))
    if lengths[0] <= 7:
        assert float(m[7]) == -np.inf
    elif expect_shift:
        assert float(m[7]) == pytest.approx(cfg.beta * r_m, rel=1e-6)
    else:
        assert float(m[7]) == r_m


# ----------------------------------------------------------------------------- plan and errors
def test_plan_names_the_executor_and_fields():
    q = jax.ShapeDtypeStruct((2, 40, 8, 64), BF16)
    k = jax.ShapeDtypeStruct((2, 50, 2, 64), BF16)
    mask = jax.ShapeDtypeStruct((2, 1, 40, 50), bool)
    p = jf.dot_product_attention_plan(q, k, k, is_causal=True, local_window_size=16,
                                      key_value_seq_lengths=jax.ShapeDtypeStruct((2,), jnp.int32),
                                      implementation="pallas")
    num = p.numerics
    assert (p.executor, num.groups, num.window, num.seq_lengths, num.causal) == \
        ("pallas", 4, (16, 16), True, True)
    assert (num.q_len, num.kv_len, num.mask, num.bias) == (40, 50, False, False)
    d = p.to_dict()
    assert d["window"] == [16, 16] and d["notes"] == []
    assert jf.dot_product_attention_plan(q, k, k, mask=mask).executor == "jnp"
    with pytest.raises(ValueError, match="jnp executor only"):
        jf.dot_product_attention_plan(q, k, k, mask=mask, implementation="pallas")
    bias = jax.ShapeDtypeStruct((1, 8, 40, 50), jnp.float32)
    pb = jf.dot_product_attention_plan(q, k, k, bias=bias, implementation="jnp")
    assert pb.numerics.bias and not pb.numerics.scale_late
    big = jax.ShapeDtypeStruct((1, 16, 1, 320), jnp.float32)
    with pytest.raises(ValueError, match="largest"):
        jf.dot_product_attention_plan(big, big, big, implementation="pallas")
    assert jf.dot_product_attention_plan(big, big, big).executor == "jnp"


@pytest.mark.parametrize("k_heads,window", [(2, None), (1, None), (4, (127, 0)), (2, 64)],
                         ids=["gqa", "mqa", "window", "gqa-window"])
def test_mosaic_kernels_cover_gqa_and_windows(k_heads, window, monkeypatch):
    """GQA/MQA and windows are in the Hopper kernels: their checks pass, the plan keeps them; K of
    another head count than the groups say is refused."""
    q = jax.ShapeDtypeStruct((1, 256, 4, 128), BF16)
    k = jax.ShapeDtypeStruct((1, 256, k_heads, 128), BF16)
    cfg = jf.dot_product_attention_plan(q, k, k, is_causal=True, implementation="jnp",
                                        local_window_size=window).numerics
    assert cfg.groups == 4 // k_heads
    assert forward_mosaic.check(cfg, q.shape, BF16, BF16) is None
    assert backward_mosaic.check(cfg, q.shape, BF16, BF16, k.shape) is None
    if k_heads != 4:
        assert "key/value head" in backward_mosaic.check(cfg, q.shape, BF16, BF16, q.shape)
    monkeypatch.setattr(api.mosaic_common, "unavailable", lambda: None)
    launch, notes = api._covered(jf.Launch(fwd_kernel="mosaic", bwd_kernel="mosaic"), cfg, q, k,
                                 True, 128, 128)
    assert (launch.fwd_kernel, launch.bwd_kernel, notes) == ("mosaic", "mosaic", [])


@pytest.mark.parametrize("kw,reason", [
    (dict(key_value_seq_lengths=jax.ShapeDtypeStruct((1,), jnp.int32)), "lengths"),
    (dict(bias=jax.ShapeDtypeStruct((1, 4, 256, 256), BF16)), "mask or bias")])
def test_mosaic_kernels_refuse_what_they_do_not_implement(kw, reason, monkeypatch):
    """The Hopper kernels' checks name the reason, so the plan runs the Triton kernels (the same
    numerics) or, asked for explicitly, raises."""
    kw = dict(kw)
    k_heads = kw.pop("k_heads", 4)
    q = jax.ShapeDtypeStruct((1, 256, 4, 128), BF16)
    k = jax.ShapeDtypeStruct((1, 256, k_heads, 128), BF16)
    cfg = jf.dot_product_attention_plan(q, k, k, is_causal=True, implementation="jnp",
                                        **kw).numerics
    assert reason in forward_mosaic.check(cfg, q.shape, BF16, BF16)
    assert reason in backward_mosaic.check(cfg, q.shape, BF16, BF16, k.shape)
    plain = jf.dot_product_attention_plan(q, q, q, is_causal=True, implementation="jnp").numerics
    assert forward_mosaic.check(plain, q.shape, BF16, BF16) is None  # the same call without it
    # the plan's substitution, as on a Hopper GPU (where the Mosaic kernels are available)
    monkeypatch.setattr(api.mosaic_common, "unavailable", lambda: None)
    launch, notes = api._covered(jf.Launch(fwd_kernel="mosaic", bwd_kernel="mosaic"), cfg, q, k,
                                 False, 128, 128)
    assert (launch.fwd_kernel, launch.bwd_kernel) == ("triton", "triton")
    assert all(reason in note for note in notes) and len(notes) == 2
    with pytest.raises(ValueError, match=reason):
        api._covered(jf.Launch(fwd_kernel="mosaic"), cfg, q, k, True, 128, 128)


@pytest.mark.parametrize("kw,match", [
    (dict(implementation="cudnn"), "jax.nn"), (dict(implementation="xla"), "jax.nn"),
    (dict(mask=np.ones((1, 1, 8, 8), np.float32)), "boolean"),
    (dict(mask=np.ones((1, 3, 8, 8), bool)), "broadcast"),
    (dict(key_value_seq_lengths=np.array([[8]], np.int32)), r"shape \(1,\)"),
    (dict(local_window_size=(1, 2, 3)), "local_window_size"),
    (dict(local_window_size=1.5), "local_window_size"),
    (dict(scale=-1.0), "scale"),
])
def test_refusals_name_the_problem(kw, match):
    x = jnp.zeros((1, 8, 2, 16), jnp.float32)
    with pytest.raises((ValueError, TypeError), match=match):
        jf.dot_product_attention(x, x, x, **kw)
