"""Shared helpers of the test suite: inputs, plans, and error bounds derived from the arithmetic.

Test modules import from here (``from helpers import ...``), never from one another.

Bounds. ``o_bound`` and ``grad_bounds`` give, per output element, how far a correct implementation of
a policy can be from the exact (float64) attention of the same low-precision inputs: a first-order
forward error analysis of the algorithm in ``jax_flash/tile.py``, every rounding point of the policy
counted with its unit roundoff u (2⁻⁸ BF16, 2⁻¹¹ FP16, 2⁻²⁴ FP32; twice that for a stochastic
rounding), weighted by the problem's absolute terms (P·|V| for O, P·|dO| for dV, |dS|·|K| for dQ ...).
No factor was fitted to an observed error. Two executors of one policy are each within the bound of
the exact result, so they are within twice the bound of each other.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np

import jax_flash as jf
from jax_flash.policy import max_shift_nats

BF16 = jnp.bfloat16
U32 = 2.0 ** -24  # unit roundoff of FP32
# a rounding's absolute floor: FP32 and BF16 subnormals are flushed to zero (XLA:CPU, the GPU's fast
# exp2), so anything below 2⁻¹²⁶ may be lost whole; FP16's subnormals (normal FP32 values) are kept,
# half their spacing
TINY = 2.0 ** -126
SUB = {np.dtype(jnp.bfloat16): TINY, np.dtype(jnp.float16): 2.0 ** -25, np.dtype(jnp.float32): TINY}


def ulp_of_max(desired) -> float:
    """One ulp (of ``desired``'s dtype) of its largest magnitude: the bound between two executors of
    the same numerics on the same tiles. They share every rounding point; their FP32 steps (dots,
    exp2) may differ in last bits, which flips a BF16 rounding by one ulp of the element, or moves
    a cancelled sum by FP32 noise of its terms' size — both within this."""
    dtype = np.dtype(desired.dtype)
    mag = max(float(np.max(np.abs(np.asarray(desired, np.float64)))), float(jnp.finfo(dtype).tiny))
    return float(2.0 ** (np.floor(np.log2(mag)) - jnp.finfo(dtype).nmant))


def u_of(dtype) -> float:
    """Unit roundoff (half an ulp at 1) of ``dtype``: the relative error of one rounding to nearest."""
    return float(jnp.finfo(dtype).eps) / 2


def f64(x):
    """Any array (BF16 included) as float64, exactly."""
    return np.asarray(np.asarray(x, np.float32), np.float64)


# ------------------------------------------------------------------------------ launch cases
def launch_case_id(policy, causal, tiles, launch, delta=None):
    """A readable test id, e.g. ``fa2-causal-16x32-bwd_block=64-split_diagonal-o``."""
    fields = [k if v is True else f"{k}={v}" for k, v in sorted(launch.items())]
    return "-".join([policy, "causal" if causal else "full", "x".join(map(str, tiles)), *fields,
                     *([delta] if delta else [])])


def default_and_slow(default, everything):
    """Parametrisation: the ``default`` cases, then the rest of ``everything`` (each once) marked
    ``slow``; ids from ``launch_case_id``."""
    import pytest

    seen, out = [], []
    for case in [*default, *everything]:
        if case in seen:
            continue
        marks = () if len(seen) < len(default) else pytest.mark.slow
        seen.append(case)
        out.append(pytest.param(*case, id=launch_case_id(*case), marks=marks))
    return out


# -------------------------------------------------------------------------------------------- inputs
def make_qkv(rng, shape, dtype=BF16, n=3):
    return tuple(jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(n))


def tied_inputs(rng, shape, dtype=BF16, score=8.0, pairs=((3, 5),), dominant=None):
    """Random inputs whose queries all point along one direction, and pairs of identical keys along
    it: every row that sees a pair has a tied maximum of about ``score``. ``dominant``: a key that
    many times as strong at row 600 (the keys below it then have subnormal P̄: flush-to-zero exps)."""
    q, k, v = (np.asarray(rng.standard_normal(shape), np.float32) for _ in range(3))
    d = shape[-1]
    direction = rng.standard_normal(d).astype(np.float32)
    direction /= np.linalg.norm(direction)
    q = q * 0.3 + direction * 4.0
    key = direction * score * np.sqrt(d) / 4.0
    for a, b in pairs:
        k[:, a] = key
        k[:, b] = key
    if dominant is not None:
        k[:, 600] = key * dominant
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


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


def numerics(q, k, v, **kw):
    """The ``Numerics`` ``jax_flash.attention`` computes for these arguments."""
    return jf.plan(q, k, v, **kw).numerics


def run_eager(q, k, v, do, **kw):
    """(O, dQ, dK, dV) of ``jax_flash.attention``, op by op."""
    o, vjp = jax.vjp(lambda q, k, v: jf.attention(q, k, v, **kw), q, k, v)
    return (o,) + vjp(do)


def _frozen(x):
    """A hashable stand-in for a keyword value (dicts as sorted items, 0-d arrays by type and value)."""
    if isinstance(x, dict):
        return tuple(sorted((n, _frozen(y)) for n, y in x.items()))
    if isinstance(x, (np.generic, np.ndarray, jax.Array)) and np.shape(x) == () \
            and not isinstance(x, (bool, np.bool_)):
        return (type(x).__name__, np.asarray(x).dtype.name, float(x))
    return x


_COMPILED = {}


def jitted(fn, *args, **kw):
    """``fn(*args, **kw)`` under one jit per (fn, keywords): the compiled program is reused for every
    seed of a sweep (the keywords are static; a JAX scalar among them is passed as it is)."""
    key = (fn, tuple(sorted((n, _frozen(x)) for n, x in kw.items())))
    if key not in _COMPILED:
        _COMPILED[key] = jax.jit(lambda *a: fn(*a, **kw))
    return _COMPILED[key](*args)


def run(q, k, v, do, **kw):
    """(O, dQ, dK, dV) of ``jax_flash.attention`` (compiled once per keyword set)."""
    return jitted(run_eager, q, k, v, do, **kw)


def attention_with_lse(q, k, v, **kw):
    return jitted(jf.attention_with_lse, q, k, v, **kw)


# ------------------------------------------------------------------------------------------- bounds
def _exact(q, k, v, causal, sm_scale):
    """float64 [B, H, Q, K] scores s, probabilities P, the absolute score terms Σ|q||k|·scale, and
    the mask."""
    q64, k64 = f64(q), f64(k)
    s = np.einsum("bqhd,bkhd->bhqk", q64, k64) * sm_scale
    abs_s = np.einsum("bqhd,bkhd->bhqk", np.abs(q64), np.abs(k64)) * sm_scale
    tq, tk = s.shape[-2:]
    mask = np.tril(np.ones((tq, tk), bool)) if causal else np.ones((tq, tk), bool)
    s = np.where(mask, s, -np.inf)
    r = s.max(-1, keepdims=True)
    p = np.exp(s - r)
    lse = np.log(p.sum(-1, keepdims=True)) + r
    return s, p / p.sum(-1, keepdims=True), abs_s, mask, r, lse


def _may_shift(s, mask, cfg, u_lp):
    """[B, H, Q, 1]: rows in which some key tile could see a tie (its two largest scores within a
    margin wider than every policy's tie test plus the scores' rounding), i.e. where the stable
    shift may move the row's max."""
    b, h, tq, tk = s.shape
    bk = cfg.block_k
    pad = -tk % bk
    sp = np.concatenate([s, np.full((b, h, tq, pad), -np.inf)], -1).reshape(b, h, tq, -1, bk)
    top2 = np.sort(sp, -1)[..., -2:]
    finite = np.isfinite(top2).all(-1)
    with np.errstate(invalid="ignore"):  # (−inf − −inf in rows a tile masks entirely)
        gap = np.where(finite, top2[..., 1] - top2[..., 0], np.inf)
    margin = 1e-2 + 4 * u_lp * np.abs(np.where(finite, top2[..., 1], 0.0))
    return (gap <= margin).any(-1)[..., None]


def o_bound(q, k, v, cfg, *, out_dtype=None):
    """Elementwise bound on |O − O_exact| ([B, Q, H, D]) for the policy and tiles of ``cfg``
    (``jax_flash.Numerics``), and the row terms the gradient bounds reuse.

    O is Ñ / L̃ with Ñ = Σ_j p̃_j·V_j and L̃ = Σ_j p̃'_j. Each p_j = exp(s_j − m) carries a relative
    error e_j seen by Ñ and L̃ alike (score and exponent roundings; the common factor exp(−m) and the
    rescaling α cancel in the ratio); Ñ adds the P̄ cast and the accumulator roundings (relative to
    Σ P|V|), L̃ its own. Then |Õ − O| ≤ (Σ P e|V| + a·P|V| + (Σ P e + b)·|O|) / (1 − Σ P e − b), plus
    the final roundings of O.
    """
    pol = cfg.policy
    in_dtype = np.dtype(q.dtype)
    out_dtype = np.dtype(out_dtype or in_dtype)
    s, p, abs_s, mask, r, _ = _exact(q, k, v, cfg.causal, cfg.sm_scale)
    d = q.shape[-1]
    n_t = -(-cfg.kv_len // cfg.block_k)  # key tiles (online-softmax steps)
    u_lp, u_p = u_of(pol.lp_dtype), u_of(pol.p_dtype)
    sr = 2.0 if pol.stochastic_rounding else 1.0  # a stochastic rounding errs by < 1 ulp = 2u
    # operands coarser than the inputs ("paper" on FP32 inputs) are rounded once more
    op_round = u_of(pol.operand_dtype) if np.dtype(pol.operand_dtype).itemsize < in_dtype.itemsize else 0.0
    g_dot = (d + 12) * U32  # an FP32 dot of d terms (any order; "bf16x6": six partial dots)
    # the shift of a stable row: up to (β − 1)·r_m (r_m > 0) and at most the guard's cap after the
    # fold; negative maxima shift by up to the cap as well; "paper" also rounds the shifted max
    if cfg.stable:
        cap = max_shift_nats(pol.p_dtype)
        rr = np.where(np.isfinite(r), r, 0.0)
        off = np.where(rr > 0, np.minimum((cfg.beta - 1) * rr, cap), cap)
        off = np.where(_may_shift(s, mask, cfg, u_lp), off * (1 + 2 * u_lp) + 2 * u_lp * cfg.beta * np.abs(rr), 0.0)
    else:
        off = np.zeros_like(r)
    gap = np.where(mask, r - s, 0.0) + off  # |s − m| for every m the row's tiles may use
    s_abs = np.where(mask, np.abs(s), 0.0)
    # relative error of p_j in both Ñ and L̃ (as an exponent, nats)
    delta = (g_dot + 2 * op_round) * abs_s + 2 * U32 * s_abs + 4 * U32 + 3 * U32 * gap
    if pol.round_scores:  # S = lp(lp(q·k)·scale): two roundings of |S|
        delta = delta + 2 * u_lp * (1 + 2 * u_lp) * s_abs
    if pol.round_shifted:  # lp(S − m) before exp
        delta = delta + u_lp * gap
    with np.errstate(over="ignore"):
        e = np.where(mask, np.expm1(delta), 0.0)
    # the row's largest scores (bitwise-equal float64 scores: identical keys) carry one and the same
    # error, a common factor of Ñ and L̃ that cancels in O: the others' errors count relative to it
    # (each p̃_j = p_j·exp(Δ_j), |Δ_j| ≤ delta_j: relative to the top's, exp(Δ_j − Δ_top))
    top = mask & (s == r)
    d_ref = np.where(top, delta, 0.0).max(-1, keepdims=True)
    with np.errstate(over="ignore"):
        e_rel = np.where(top | ~mask, 0.0, np.expm1(delta + d_ref))
    pe = np.where(p > 0, p * e_rel, 0.0)
    lift = np.exp(off)  # p̃ is relative to the shifted max: absolute floors scale with it
    v64 = f64(v)
    vmax = np.abs(v64).max(axis=1, keepdims=True)  # [B, 1, H, D]
    # Ñ only: P̄ cast, tile P̄·V and accumulator roundings, FP32 sums; absolute floors
    a = (u_p + op_round + (sr * u_lp if pol.round_tile_pv else 0.0)
         + (2 * sr * u_lp * n_t if pol.lp_accumulators else 0.0) + (cfg.block_k + 2 * n_t + 2) * U32)
    abs_num = cfg.kv_len * (SUB[np.dtype(pol.p_dtype)] + TINY) * lift
    # L̃ only: ℓ's roundings, FP32 sums, the tile-sum floor, flushed exps
    b = ((u_lp * n_t * (2.0 if pol.stochastic_row_sum else 1.0) if pol.lp_accumulators else 0.0)
         + (cfg.block_k + 2 * n_t + 2) * U32 + n_t * pol.tile_sum_floor
         + cfg.kv_len * TINY * lift)
    to_bqhd = lambda x: x.transpose(0, 2, 1, 3)
    pv = to_bqhd(np.einsum("bhqk,bkhd->bhqd", p, np.abs(v64)))
    o = to_bqhd(np.einsum("bhqk,bkhd->bhqd", p, v64))
    num = to_bqhd(np.einsum("bhqk,bkhd->bhqd", pe, np.abs(v64))) + a * pv + to_bqhd(abs_num) * vmax
    den = to_bqhd(pe.sum(-1, keepdims=True) + b)  # [B, Q, H, 1]
    # L̃'s relative error (the common factor included): what the backward's recomputed P inherits
    den_l = to_bqhd(np.where(p > 0, p * e, 0.0).sum(-1, keepdims=True) + b)
    with np.errstate(divide="ignore"):
        pre = np.where(den < 0.5, (num + den * np.abs(o)) / (1 - den), np.inf)
    # final roundings: acc/ℓ (FP32, or lp under lp_accumulators), the stored O (residual dtype),
    # and the cast to the output dtype where it is coarser
    res = np.dtype(pol.o_residual_dtype)
    fin = (sr * u_lp if pol.lp_accumulators else U32) + sr * u_of(res)
    if out_dtype.itemsize < res.itemsize:
        fin += u_of(out_dtype)
    res_bound = pre + (U32 + sr * u_of(res)) * (np.abs(o) + pre) + SUB[res]
    bound = pre + fin * (np.abs(o) + pre) * (1 + fin) + SUB[res] + SUB[out_dtype]
    return bound, dict(s=s, p=p, abs_s=abs_s, mask=mask, e=e, den=den_l, o=o, pv=pv, res=res_bound,
                       op_round=op_round, g_dot=g_dot, gap=gap, n_t=n_t)


@np.errstate(invalid="ignore", over="ignore")
def grad_bounds(q, k, v, do, cfg, *, out_dtype=None):
    """Elementwise bounds on |dQ − dQ_exact|, |dK − dK_exact|, |dV − dV_exact| (δ exact in the
    reference) for ``cfg``'s policy, tiles and δ mode.

    P is recomputed as exp(S − L̃): relative error e' from the recomputed score, L̃'s error (the
    forward's L̃ relative error, ``o_bound``'s row term) and the exponent. dV = P̄ᵀ·dO; dS = P(dP − δ)
    with dP an FP32 dot and δ per mode ("o": rowsum(dO∘O) with the stored O, so O's bound enters —
    the mechanism that makes saturated rows' dQ inexact; "o_hp": O recomputed in FP32; "dpp":
    rowsum(dP∘P)); dQ = scale·dS·K, dK = scale·dSᵀ·Q; each cast to the output dtype.
    """
    pol = cfg.policy
    out_dtype = np.dtype(out_dtype or q.dtype)
    _, t = o_bound(q, k, v, cfg)
    s, p, abs_s, mask, e_fwd = t["s"], t["p"], t["abs_s"], t["mask"], t["e"]
    q64, k64, v64, do64 = (f64(x) for x in (q, k, v, do))
    d, tq, tk = q.shape[-1], q.shape[1], k.shape[1]
    n_q, n_k = -(-tq // cfg.block_q), t["n_t"]
    u_p, u_out = u_of(pol.p_dtype), u_of(out_dtype)
    sub_p, sub_out = SUB[np.dtype(pol.p_dtype)], SUB[out_dtype]
    op = t["op_round"]
    sc = cfg.sm_scale
    den = t["den"].transpose(0, 2, 1, 3)  # [B, H, Q, 1]
    with np.errstate(divide="ignore"):
        d_lse = np.where(den < 0.5, -np.log1p(-den), np.inf)
    _, _, _, _, r, lse = _exact(q, k, v, cfg.causal, sc)
    s_abs = np.where(mask, np.abs(s), 0.0)
    l_gap = np.where(mask, lse - s, 0.0)  # |s − L| ≥ 0
    delta_s = (t["g_dot"] + 2 * op) * abs_s + 2 * U32 * s_abs + 4 * U32 + 3 * U32 * l_gap
    if pol.round_scores:
        delta_s = delta_s + 2 * u_of(pol.lp_dtype) * (1 + 2 * u_of(pol.lp_dtype)) * s_abs
    delta_s = delta_s + d_lse + 4 * U32 * (np.abs(np.where(np.isfinite(lse), lse, 0.0)) + 1)
    with np.errstate(over="ignore"):
        e = np.where(mask & (p > 0), np.expm1(delta_s), 0.0)  # (P = 0 entries stay 0)
    pt = p * (1 + e) + np.where(mask, TINY, 0.0)  # ≥ |P̃| (a flushed P is off by < 2⁻¹²⁶)
    tiny_p = np.where(mask, TINY, 0.0)
    # dV_j = Σ_i P̄_ij dO_i: P̃'s error, its cast, dO's operand rounding, FP32 sums
    dv = np.einsum("bhqk,bqhd->bkhd", p, do64)
    err_dv = (np.einsum("bhqk,bqhd->bkhd", p * e + tiny_p + (u_p + op) * pt, np.abs(do64))
              + (tq + 2 * n_q + 2) * U32 * np.einsum("bhqk,bqhd->bkhd", pt, np.abs(do64))
              + tq * sub_p * np.abs(do64).max(1, keepdims=True))
    # dP and δ
    dp = np.einsum("bqhd,bkhd->bhqk", do64, v64)
    d_dp = (t["g_dot"] + 2 * op) * np.einsum("bqhd,bkhd->bhqk", np.abs(do64), np.abs(v64))
    o = t["o"]
    delta = np.einsum("bqhd,bqhd->bhq", do64, o)[..., None]
    abs_do_o = np.einsum("bqhd,bqhd->bhq", np.abs(do64), np.abs(o) + t["res"])[..., None]
    if cfg.delta == "o":
        d_delta = np.einsum("bqhd,bqhd->bhq", np.abs(do64), t["res"])[..., None] + (d + 2) * U32 * abs_do_o
    elif cfg.delta == "o_hp":
        pe = (p * e).sum(-1, keepdims=True)
        num = np.einsum("bhqk,bkhd->bhqd", p * e + op * pt, np.abs(v64)) + (tk + 2 * n_k + 2) * U32 * \
            np.einsum("bhqk,bkhd->bhqd", pt, np.abs(v64))
        with np.errstate(divide="ignore"):
            d_ohp = np.where(pe < 0.5, (num + (pe + (tk + 2) * U32) * np.abs(o.transpose(0, 2, 1, 3)))
                             / (1 - pe), np.inf)
        d_delta = np.einsum("bqhd,bhqd->bhq", np.abs(do64), d_ohp)[..., None] + (d + 2) * U32 * abs_do_o
    else:  # "dpp"
        d_delta = ((d_dp * pt + np.abs(dp) * p * e).sum(-1, keepdims=True)
                   + (tk + 2 * n_k + 2) * U32 * (pt * (np.abs(dp) + d_dp)).sum(-1, keepdims=True))
    ds = p * (dp - delta)
    d_ds = ((p * e + tiny_p) * np.abs(dp - delta) + pt * (d_dp + d_delta)
            + 2 * U32 * pt * (np.abs(dp - delta) + d_dp + d_delta) + tiny_p)
    ds_abs = np.abs(ds) + d_ds
    d_ds = np.where(mask, d_ds + u_p * ds_abs + sub_p + op * ds_abs, 0.0)  # the cast of dS
    ds_abs = np.where(mask, ds_abs + d_ds, 0.0)
    dq = sc * np.einsum("bhqk,bkhd->bqhd", ds, k64)
    err_dq = sc * (np.einsum("bhqk,bkhd->bqhd", d_ds, np.abs(k64))
                   + (tk + 2 * n_k + 4) * U32 * np.einsum("bhqk,bkhd->bqhd", ds_abs, np.abs(k64)))
    dk = sc * np.einsum("bhqk,bqhd->bkhd", ds, q64)
    err_dk = sc * (np.einsum("bhqk,bqhd->bkhd", d_ds, np.abs(q64))
                   + (tq + 2 * n_q + 4) * U32 * np.einsum("bhqk,bqhd->bkhd", ds_abs, np.abs(q64)))
    def fin(g, err):  # the cast to the output dtype; NaN (inf·0 where a bound is vacuous) is inf
        err = err + (u_out + U32) * (np.abs(g) + err) * (1 + u_out) + sub_out
        return np.where(np.isnan(err), np.inf, err)

    return fin(dq, err_dq), fin(dk, err_dk), fin(dv, err_dv)


def rel(a, b):
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def lse_bound(terms, lse):
    """|L̃ − L|: ℓ's relative error (o_bound's row term) plus FP32 roundings of m + log ℓ."""
    den = terms["den"][..., 0].transpose(0, 2, 1)  # [B, H, Q]
    return -np.log1p(-np.minimum(den, 0.5)) + 8 * 2.0 ** -24 * (np.abs(lse) + 1)


def reference_outputs(q, k, v, do, cfg):
    """float64 (O, dQ, dK, dV) of the exact attention of these inputs."""
    return jf.reference_numpy(q, k, v, do, causal=cfg.causal, sm_scale=cfg.sm_scale)


# --------------------------------------------------------------------------- training test inputs
class Tokens:
    """Stands in for train.data.TokenData: 1-D uint16 .train / .val."""

    def __init__(self, vocab=512, n=3000, seed=0):
        rng = np.random.default_rng(seed)
        # a repeated document over an eighth of the vocabulary: the unigram is learnt in a few steps
        doc = rng.integers(0, vocab // 8, size=n, dtype=np.uint16)
        self.train, self.val, self.meta = np.tile(doc, 4), doc[: n // 3].copy(), {}


# the smallest training config the training tests run: 2 layers of 64 wide, 8 steps (on tiny-cpu)
MICRO = ["model.vocab_size=512", "model.n_layer=2", "model.n_head=4", "model.n_embd=64",
         "model.block_size=32", "data.batch_size=4", "optim.warmup_steps=2", "optim.lr=1e-2",
         "max_steps=8", "eval_every=4", "data.eval_batches=2", "progress=false"]


def micro_cfg(run_dir, *extra):
    """``MICRO`` on the tiny-cpu preset, writing to ``run_dir``."""
    from train import config as C

    return C.apply_overrides(C.get_preset("tiny-cpu"), [*MICRO, f"run_dir={run_dir}", *extra])


def fp32_cross_entropy_of_upcast(logits, targets):
    """Autodiff's mean cross-entropy of logits upcast to FP32: ``jax.nn.logsumexp`` minus the
    target's logit (what the model's loss computed for bf16 logits before it kept them as they are)."""
    x = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(x, axis=-1)
    return jnp.mean(lse - jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0])


def assert_gelu_erf_within_bound(form: str = "erf"):
    """The GELU's "erf" form (``models.gpt2._gelu(h, "erf")``, x·(1 + erf(x/√2))/2 in FP32), or
    ``form="pallas"``, the same arithmetic in Pallas kernels, on every bf16 input in [-8, 8], value
    and derivative, against float64's exact GELU, on the default device. Allowed: half a bf16 ulp of the result (its one rounding to bf16) plus what FP32 adds —
    the backend's erf within E = 8·2⁻²⁴ absolutely (the accuracy this form requires of it), the
    rounding of x/√2 moving erf by under 2⁻²⁴, a few FP32 roundings of the products (4·2⁻²⁴
    relative), and results below 2⁻¹²⁶ flushed to zero as XLA does. 1 + erf is exact where
    erf ≤ −½, so near x = −8 the error is absolute (|x|·E/2), not relative: the form's known
    weakness in the tail. ``"pallas"``'s φ is 2^(x²·(−½·log₂e)) by the GPU's ex2.approx
    (``gelu_kernels.EX2_APPROX``): the argument's three roundings (x², the constant, their product)
    move it by 3u·x²·log₂e/2, which the power turns into 1.5·x²·u relative, and the instruction
    adds its own error (CUDA documents its exp2f, which is this instruction, within 2 ulp: 4u);
    so x·φ's relative allowance grows from 4u to (8 + 1.5·x²)·u.
    Returns the inputs, the values and the VJP."""
    import functools

    import ml_dtypes

    from models import gpt2

    bits = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    x = np.unique(bits[np.isfinite(bits) & (np.abs(bits) <= 8.0)])
    h = jnp.asarray(x, jnp.bfloat16)
    y, vjp = jax.vjp(jax.jit(functools.partial(gpt2._gelu, form=form)), h)
    (dy,) = vjp(jnp.ones_like(h))
    x64 = x.astype(np.float64)
    cdf = np.array([math.erfc(-v / math.sqrt(2)) / 2 for v in x64])
    pdf = np.exp(-x64 ** 2 / 2) / math.sqrt(2 * math.pi)
    e, u = 8 * U32, U32
    pdf_u = (8 + 1.5 * x64 ** 2) * u if form == "pallas" else 4 * u  # x·φ's relative error

    def ulp_bf16(v):
        return np.exp2(np.floor(np.log2(np.maximum(np.abs(v), TINY))) - 7)

    for name, got, want, absolute in (
            ("value", y, x64 * cdf, np.abs(x64) * (e + u) / 2),
            ("derivative", dy, cdf + x64 * pdf, (e + u) / 2 + np.abs(x64) * pdf * pdf_u)):
        err = np.abs(np.asarray(got, np.float64) - want)
        bound = ulp_bf16(want) / 2 + absolute + 4 * u * np.abs(want) + TINY
        worst = int(np.argmax(err / bound))
        assert np.all(err <= bound), (name, float(x[worst]), float(err[worst]), float(bound[worst]))
    return h, y, vjp


def assert_add_layer_norm_is_the_pair(rng, jit: bool):
    """``models.layernorm.add_layer_norm`` against x + r then ``layer_norm``, GPT-2's width,
    cotangents on both outputs: the sum, the normalised row and the scale's gradient bit for bit
    (the same additions, roundings and sums in other kernels). The input gradient adds the sum's cotangent to
    the LayerNorm's last product inside the kernel, where a compiler may contract the two into one
    FMA, skipping the product's rounding: each way is within half an ulp of the sum (plus half an
    ulp of the product apart) of the exact value, so the two differ by at most ulp(ds) + ½ulp(dx)
    ≤ 2u·(|dx| + |g_s|) + u·|dx| (u = 2⁻²⁴); r's gradient is exactly that sum cast to bf16.
    Returns the inputs x and r."""
    from models.layernorm import add_layer_norm, layer_norm

    eps = 1e-5
    x = jnp.asarray(rng.standard_normal((2, 24, 768)) * 2.0, jnp.float32)
    r = jnp.asarray(rng.standard_normal(x.shape), jnp.bfloat16)
    w = jnp.asarray(1.0 + 0.1 * rng.standard_normal(768), jnp.float32)
    gs = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    gy = jnp.asarray(rng.standard_normal(x.shape), jnp.bfloat16)

    def apart(x, r, w):
        s = x + r.astype(jnp.float32)
        return s, layer_norm(s, w, eps, jnp.bfloat16)

    def fused(x, r, w):
        return add_layer_norm(x, r, w, eps, jnp.bfloat16)

    def run(f):
        out, vjp = jax.vjp(f, x, r, w)
        return out, vjp((gs, gy))

    wrap = jax.jit if jit else (lambda f: f)
    got, want = wrap(lambda: run(fused))(), wrap(lambda: run(apart))()
    chex.assert_trees_all_equal(got[0], want[0])
    chex.assert_trees_all_equal(got[1][2], want[1][2])
    chex.assert_trees_all_equal_dtypes(got[1], (x, r, w))
    ln_dx = jax.vjp(lambda s: layer_norm(s, w, eps, jnp.bfloat16), want[0][0])[1](gy)[0]
    bound = U32 * (3 * np.abs(np.asarray(ln_dx)) + 2 * np.abs(np.asarray(gs)))
    assert np.all(np.abs(np.asarray(got[1][0]) - np.asarray(want[1][0])) <= bound)
    chex.assert_trees_all_equal(got[1][1], got[1][0].astype(jnp.bfloat16))
    return x, r


def cross_entropy_bounds(x64, targets, pieces):
    """Exact values and error bounds for ``models.loss_kernels`` on logits ``x64`` ``[N, V]``
    (float64 copies of the bf16 inputs, −inf allowed) and ``targets`` ``[N]``; ``pieces`` is
    ``loss_kernels.pieces(V)``: (chunk c, full chunks n, remainder widths).

    With y = m − x ≥ 0 (m the row max, exact: a max of bf16 values) and p the softmax:
    - each exp(x − shift) is 2^((x − shift)·log₂e) (``loss_kernels.EX2_APPROX``): the argument
      carries three roundings (the difference, log₂e, the product), 3u·y once exponentiated, and
      the exp2 its own error, taken as 4u (the GPU's ex2.approx is within 2 ulp, 2⁻²² relative;
      XLA's exp within that) — summed with the weights p: 3u·Σp·y + 4u;
    - each of the ``steps`` rescalings by exp(m_old − m_new) adds 4u + u (the product), and their
      arguments' roundings add up to 3u·(m − the row's finite minimum); ``steps`` is one a chunk
      and remainder piece;
    - a sum of positive terms in any order is within (terms − 1)·u relative: c − 1 inside a chunk
      and ``steps`` across them.
    So s is within rel_s = 4u·(1 + steps) + u·(3·Σp·y + 3·range + c − 1 + 2·steps), first order
    (times 1.01 for the rest), and log s + m within that of the exact log-sum-exp. The loss adds the
    FP32 log (2 ulps), the row's subtraction and the mean's N − 1 additions and division. The
    gradient (p − [target])/N per element adds 1/N's and 1/s's roundings, its exp (4u + 3u·y), the
    product, and the target's subtraction (u of the result), then FP32's flush below 2⁻¹²⁶; the
    caller adds half an ulp, in the logits' dtype, of the value it got for the final rounding.

    Returns (lse, rel_s, loss, loss_tol, grad, grad_tol) in float64."""
    u = U32
    c, n, rest = pieces
    steps = n + len(rest)
    rows = np.arange(x64.shape[0])
    finite = np.isfinite(x64)
    m = np.max(x64, axis=1)
    y = np.where(finite, m[:, None] - x64, np.inf)
    e = np.exp(-y)
    s = e.sum(axis=1)
    p = e / s[:, None]
    py = np.sum(np.where(finite, p * np.where(finite, y, 0.0), 0.0), axis=1)
    rng = m - np.min(np.where(finite, x64, np.inf), axis=1)
    rel_s = 1.01 * (4 * u * (1 + steps) + u * (3 * py + 3 * rng + c - 1 + 2 * steps))
    lse = np.log(s) + m
    row = lse - x64[rows, targets]
    nrows = x64.shape[0]
    loss = float(np.mean(row))
    row_tol = rel_s + 2 * u * np.abs(np.log(s)) + u * np.abs(lse) + u * np.abs(row)
    loss_tol = float(np.mean(row_tol) + (nrows + 1) * u * np.mean(np.abs(row)))
    hit = np.zeros_like(x64)
    hit[rows, targets] = 1.0
    grad = (p - hit) / nrows
    yf = np.where(finite, y, 0.0)
    grad_tol = (1.01 * p / nrows * (rel_s[:, None] + 4 * u + 3 * u * yf + 4 * u)
                + u * np.abs(grad) + 2.0 ** -126)
    return lse, rel_s, loss, loss_tol, grad, grad_tol


def half_ulp(a, dtype):
    """Half an ulp of each |a| in ``dtype`` (as ``ulp_of_max``, elementwise; 0 at 0)."""
    a = np.abs(np.asarray(a, np.float64))
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    return np.where(a > 0, 2.0 ** (e - jnp.finfo(dtype).nmant - 1), 0.0)


def assert_pallas_cross_entropy_within_bound(x, t):
    """``models.loss_kernels`` on logits ``x`` ``[N, V]`` and targets ``t`` ``[N]``, compiled for
    the default device: log-sum-exp from the row statistics, loss and gradient within
    ``cross_entropy_bounds`` of float64's; the target's logit exact; the gradient in x's dtype."""
    from models import loss_kernels as lk

    m, s, tgt = jax.jit(lk.row_stats)(x, t)
    x64, t64 = np.asarray(x, np.float64), np.asarray(t)
    lse, rel_s, want_loss, loss_tol, want_grad, grad_tol = cross_entropy_bounds(
        x64, t64, lk.pieces(x.shape[-1]))
    got_lse = np.log(np.asarray(s, np.float64)) + np.asarray(m, np.float64)
    assert np.all(np.abs(got_lse - lse) <= rel_s), float(np.max(np.abs(got_lse - lse) - rel_s))
    np.testing.assert_array_equal(np.asarray(tgt), x64[np.arange(x.shape[0]), t64])
    loss, grad = jax.jit(jax.value_and_grad(lk.cross_entropy))(x, t)
    chex.assert_trees_all_equal_dtypes(grad, x)
    assert abs(float(loss) - want_loss) <= loss_tol
    got = np.asarray(grad, np.float64)
    excess = np.abs(got - want_grad) - (grad_tol + half_ulp(got, x.dtype))
    assert np.all(excess <= 0), float(np.max(excess))


def jaxpr_eqns(jaxpr):
    """Every equation of ``jaxpr`` (a Jaxpr) and of the jaxprs inside its equations' parameters."""
    from jax.extend.core import jaxprs_in_params

    for e in jaxpr.eqns:
        yield e
        for sub in jaxprs_in_params(e.params):
            yield from jaxpr_eqns(sub)


LN_EPS = 1e-5
# LayerNorm launches beside the shipped one: rows a program, rows a step of its loop (fewer than
# the program's: a loop), warps
LN_LAUNCHES = [dict(rows=64, sub=8), dict(rows=32, sub=4, warps=8),
               dict(rows=16, sub=2, warps=2), dict(rows=128, sub=128)]


def launch_id(launch: dict) -> str:
    return ";".join(f"{k}={v}" for k, v in launch.items())


def ln_inputs(rng, n, d, offset=0.0):
    """float64 x (scaled by 2, shifted by ``offset``), scale near 1, and a cotangent."""
    x = rng.standard_normal((n, d)) * 2.0 + offset
    w = 1.0 + 0.1 * rng.standard_normal(d)
    dy = rng.standard_normal((n, d))
    return x, w, dy


def ln_reference(x, w, dy):
    """float64 LayerNorm (no bias) and its exact gradient: y, dx, d(scale), x̂, 1/σ, dy·scale."""
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + LN_EPS)
    xhat = (x - mean) * rstd
    g = dy * w
    dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    return xhat * w, dx, (dy * xhat).sum(0), xhat, rstd, g


def assert_ln_within_the_sums_bounds(assert_close, x, w, dy, y, dx, dw):
    """FP32 y, dx, d(scale) of float64 inputs against ``ln_reference``: a sum of d FP32 terms errs
    by at most d·u of the sum of their magnitudes; the mean's error enters x − mean, amplified by
    1/σ (|offset|·rstd)."""
    n, d = x.shape
    y_ref, dx_ref, dw_ref, xhat, rstd, g = ln_reference(x, w, dy)
    amp = 1.0 + np.abs(x).mean(-1, keepdims=True) * rstd
    y_bound = 4 * d * U32 * amp * (np.abs(xhat) + 1) * np.abs(w)
    chex.assert_trees_all_equal_shapes_and_dtypes(y, jnp.zeros((n, d), jnp.float32))
    assert_close(y, y_ref, y_bound, "y")
    terms = np.abs(g) + np.abs(g).mean(-1, keepdims=True) + np.abs(xhat) * np.abs(g * xhat).mean(
        -1, keepdims=True)
    dx_bound = 8 * d * U32 * amp * (rstd * terms + np.abs(dx_ref))
    assert_close(dx, dx_ref, dx_bound, "dx")
    dw_bound = 8 * (n + d) * U32 * (amp * np.abs(dy) * (np.abs(xhat) + 1)).sum(0)
    assert_close(dw, dw_ref, dw_bound, "dscale")


def assert_ln_launch_within_the_sums_bounds(rng, assert_close, launch: dict):
    """``models.layernorm``'s kernels under another launch (other programs, loop steps, warps: the
    sums in another order, d(scale)'s partials over programs of another size) within the bounds of
    ``assert_ln_within_the_sums_bounds``, 256 rows of GPT-2's width shifted by 3."""
    from models import layernorm

    n, d = 256, 768
    x, w, dy = ln_inputs(rng, n, d, 3.0)
    x32, w32, dy32 = (jnp.asarray(a, jnp.float32) for a in (x, w, dy))
    y, mean, rstd = layernorm._forward(x32, w32, LN_EPS, jnp.dtype(jnp.float32), **launch)
    dx, dw = layernorm._backward(x32, w32, mean, rstd, dy32, **launch)
    assert_ln_within_the_sums_bounds(assert_close, x, w, dy, y, dx, dw)
