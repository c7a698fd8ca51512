"""The arithmetic of one (query block × key tile) step — written once, run by both executors.

Every function here is plain ``jax.numpy`` on 2-D tiles: the Pallas kernels call them inside the kernel
body (traced into Triton on GPU, interpreted on CPU) and the jnp executor calls them under ``vmap``
inside a ``fori_loop``. The policy (``policy.py``) decides every rounding point, so the two executors
compute the same values by construction (``spec.Numerics`` fixes the arithmetic; the executors
differ only in the order of FP32 additions inside matrix products).

Shapes: q ``[bq, D]``, k and v ``[bk, D]``, mask ``[bq, bk]`` (True = attend), per-row vectors ``[bq]``.
All values are FP32 arrays; low-precision intermediates are FP32 containers holding rounded values.

Units: under a ``log2_units`` policy the scores, row maxima and the saved L are in log2 units
(S·log2 e) and exponentiated with ``exp2``; otherwise natural units with ``exp``. Probabilities are the
same either way.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .policy import LOG2E, Policy
from .rounding import cast_rounded, round_to, stochastic_round_to
from .spec import Numerics

NEG_INF = float("-inf")
_LOWEST = float(jnp.finfo(jnp.float32).min)  # the lowest finite FP32 value


class Carry(NamedTuple):
    m: jax.Array  # [bq] running max (the shift actually used)
    l: jax.Array  # [bq] running row sum of P̄
    acc: jax.Array  # [bq, D] running Σ P̄·V
    # [bq] running max of the unshifted tile maxima, kept only where the stable shift meets a tile-sum
    # floor (stable "paper" policies; see forward_tile); None elsewhere, so other kernels carry nothing
    m_raw: jax.Array | None = None


# ---------------------------------------------------------------------------------------------- dots
def _precision(pol: Policy):
    # FP32 operands must not silently become TF32 on GPU.
    return lax.Precision.HIGHEST if pol.fp32_dots else None


def split_bf16x3(x):
    """FP32 ``x`` as three BF16 terms, x ≈ hi + mid + lo, each the BF16 rounding of what is left."""
    hi = x.astype(jnp.bfloat16)
    r = x - hi.astype(jnp.float32)
    mid = r.astype(jnp.bfloat16)
    lo = (r - mid.astype(jnp.float32)).astype(jnp.bfloat16)
    return hi, mid, lo


# (a term, b term) pairs kept by "bf16x6", smallest first: the left-out ones (mid·lo, lo·mid,
# lo·lo) are below 2⁻²⁴ of the leading product, FP32's own rounding.
_X6_PAIRS = ((2, 0), (1, 1), (0, 2), (1, 0), (0, 1), (0, 0))


def _dot(a, b, dims, pol):
    if pol.fp32_dots and pol.fp32_dot == "bf16x6":
        a3, b3 = split_bf16x3(a.astype(jnp.float32)), split_bf16x3(b.astype(jnp.float32))
        out = None
        for i, j in _X6_PAIRS:
            t = lax.dot_general(a3[i], b3[j], dims, preferred_element_type=jnp.float32)
            out = t if out is None else out + t
        return out
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=_precision(pol))


def dot_nn(a, b, pol):  # [m, k] @ [k, n]
    return _dot(a, b, (((1,), (0,)), ((), ())), pol)


def dot_nt(a, b, pol):  # [m, k] @ [n, k]ᵀ
    return _dot(a, b, (((1,), (1,)), ((), ())), pol)


def _round_o(x, pol: Policy, salt: int):
    """A rounding of Ō or O to the policy's lp dtype: stochastic under a ``*_sr`` policy, else RNE."""
    if pol.stochastic_rounding:
        return stochastic_round_to(x, pol.lp_dtype, salt)
    return round_to(x, pol.lp_dtype)


_EXP2 = contextvars.ContextVar("jax_flash_exp2", default="xla")


@contextlib.contextmanager
def exp2_backend(backend: str):
    """How the kernel body being traced computes exp2 in log2 units: "triton" (with
    ``Policy.exp_ftz`` PTX ``ex2.approx.ftz.f32`` inline, else the compiler's exp2), "mosaic" (the
    Mosaic GPU kernels' approximate exp2, which is that instruction already) or "xla" (``exp2``
    below, within 1.35 ulp of 2^x; with ``exp_ftz`` results below 2⁻¹²⁶ set to zero)."""
    token = _EXP2.set(backend)
    try:
        yield
    finally:
        _EXP2.reset(token)


def _pow2i(n):
    """2**n, exactly, for int32 ``n`` in [-126, 127]: the exponent field set directly."""
    return lax.bitcast_convert_type((n + 127) << 23, jnp.float32)


def exp2(x):
    """2^x in FP32 within 1.35 ulp of the exact value: 2^round(x), exact, times exp of the
    fraction, whose argument |f·ln 2| ≤ 0.35 rounds with a tiny absolute error. ``jnp.exp2``
    (exp(x·ln 2)) passes the rounding of x·ln 2 on to the result, several ulp for |x| near 30
    (further from 2^x than this one: ``tests/test_tile.py``); the GPU's ``ex2.approx``
    approximates 2^x itself, so this one stands closer to the kernels."""
    x = jnp.asarray(x, jnp.float32)
    n = jnp.round(x)
    r = jnp.exp((x - n) * np.float32(math.log(2.0)))  # x - n exact: r in [0.70, 1.42]
    ni = jnp.clip(n, -252.0, 128.0).astype(jnp.int32)
    hi = jnp.clip(ni, -126, 127)
    y = (r * _pow2i(hi)) * _pow2i(ni - hi)  # a second factor (2 or ≤ 1) past the normal range
    y = jnp.where(n > 128.0, jnp.inf, jnp.where(n < -252.0, 0.0, y))
    return jnp.where(jnp.isnan(x), x, y)


def _ptx_f32(instruction: str, x):
    """``instruction`` (a unary FP32 PTX instruction) of each entry of ``x``, inline in a Triton
    kernel being traced for the GPU."""
    from jax.experimental.pallas import triton as pltriton

    return pltriton.elementwise_inline_asm(
        f"{instruction} $0, $1;", args=[x], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])[0]


def ex2_approx_ftz(x):
    """2^x of FP32 ``x`` as the PTX instruction ``ex2.approx.ftz.f32`` computes it, inline in a
    Triton kernel being traced for the GPU (within 2 ulp; results below 2⁻¹²⁶ are 0)."""
    return _ptx_f32("ex2.approx.ftz.f32", x)


def rcp_approx_ftz(x):
    """1/x of FP32 ``x`` as ``rcp.approx.ftz.f32`` computes it (the MUFU.RCP FP32 division
    compiles to), inline in a Triton kernel being traced for the GPU."""
    return _ptx_f32("rcp.approx.ftz.f32", x)


def _exp(x, pol):
    if not pol.log2_units:
        return jnp.exp(x)
    backend = _EXP2.get()
    if not pol.exp_ftz:
        return exp2(x) if backend == "xla" else jnp.exp2(x)
    if backend == "triton":
        return ex2_approx_ftz(x)
    if backend == "mosaic":
        return jnp.exp2(x)
    return jnp.where(x < -126.0, 0.0, exp2(x))  # 2^x is subnormal exactly below −126


def _log(x: float, pol) -> float:
    return math.log2(x) if pol.log2_units else math.log(x)


# ------------------------------------------------------------------------------------------- forward
def scores(q, k, cfg: Numerics, bias=None):
    """S = scale·q·kᵀ (+ bias) in the policy's units and rounding (FP32 container). ``bias``: the
    tile of an additive bias on the natural-unit logits (FP32; ``Numerics.bias``), or None."""
    pol = cfg.policy
    s = dot_nt(q, k, pol)
    if pol.round_scores:  # a BF16 GEMM output, then a BF16 multiply by the scale
        s = round_to(round_to(s, pol.lp_dtype) * cfg.score_scale, pol.lp_dtype)
    else:
        s = s * cfg.score_scale
    return s if bias is None else add_bias(s, bias, cfg)


def add_bias(s, bias, cfg: Numerics):
    """Scores plus an additive bias given in natural units (converted to the policy's units; a
    policy that rounds its scores rounds the sum too). −inf in the bias masks the entry."""
    pol = cfg.policy
    b = bias.astype(jnp.float32)
    s = s + (b * LOG2E if pol.log2_units else b)
    return round_to(s, pol.lp_dtype) if pol.round_scores else s


def tie_threshold(r_m, cfg: Numerics):
    """Per row, the score at and above which an entry is "at the max" r_m (see ``tie_count``)."""
    pol = cfg.policy
    # A row with nothing unmasked (r_m = −inf) has no ties: its −inf entries must not count, so its
    # threshold is taken from the lowest finite value instead of −inf (one max per row instead of a
    # compare and a select; every finite r_m keeps its threshold).
    if pol.tie_test == "paper":
        # (the lowest value of the BF16 threshold's dtype: FP32's would round to −inf there)
        return round_to(jnp.maximum(r_m, float(jnp.finfo(pol.lp_dtype).min)) - 1e-3, pol.lp_dtype)
    # lp(exp(x)) == 1  ⟺  exp(x) ≥ 1 − eps/4 (the midpoint below 1 rounds to even, i.e. to 1)
    # ⟺  x ≥ log(1 − eps/4), i.e. S ≥ r_m + log(1 − eps/4): a compare instead of an exp per entry.
    # The threshold is rounded to FP32 once per row, so it may admit the one FP32 value just below
    # the exact boundary (S − r_m is exact there, Sterbenz): a near-tie 2⁻⁹ below the max.
    eps = float(jnp.finfo(pol.tie_dtype).eps)
    return jnp.maximum(r_m, _LOWEST) + _log(1.0 - eps / 4.0, pol)


def tie_count(s, mask, r_m, cfg: Numerics, raw: bool = False):
    """Per row, the number of unmasked entries "at the max" r_m (masked entries never count;
    ``mask=None``: a tile without masked entries, or one whose masked entries are −inf in ``s``).

    ``p_one``: entries whose P̄ = exp(S − r_m) rounds to exactly 1.0 in the tie dtype (BF16: S within
    ~2⁻⁹ of r_m) — the entries that put exact copies of V rows into Ō. ``paper``: the authors' test
    ``S ≥ bf16(r_m − 1e-3)`` on BF16 scores.

    Both are one compare per entry against a per-row threshold (``tie_threshold``): the count is the
    stable forward's only per-entry extra work. ``raw``: ``s`` holds unscaled
    scores (``Numerics.scale_late``), compared against the threshold times 1/scale (FP32), kept finite
    so that −inf (masked) entries never count.
    """
    threshold = tie_threshold(r_m, cfg)
    if raw:
        threshold = jnp.maximum(threshold * cfg.score_scale_inv, _LOWEST)
    at_max = s >= threshold[:, None]
    if mask is not None:
        at_max = mask & at_max
    return jnp.sum(jnp.where(at_max, 1.0, 0.0), axis=1)


def floor_positive(y):
    """floor(y) for y > 0 as a truncation, the ``floor`` the Mosaic GPU forward passes to
    ``stable_shift`` (Mosaic GPU, jax 0.11, has no floor; elsewhere one instruction does it, where
    this takes four per row): FP32 values ≥ 2²³ are integers already, below that truncation toward
    zero is floor. Other y: unspecified (the caller discards them)."""
    return jnp.where(y >= 2.0 ** 23, y, y.astype(jnp.int32).astype(jnp.float32))


def stable_shift(s, mask, r_m, cfg: Numerics, floor=jnp.floor, raw=False):
    """The paper's Algorithm 1 with an underflow guard: the tile's max to use for the softmax shift.

    Rows with ≥ 2 ties use β·r_m if r_m > 0 and 0 if r_m < 0 (so every P̄ < 1); other rows (and r_m = 0)
    use r_m. Guard: where that moves the shift more than the cap C = ``cfg.max_shift`` above r_m (20
    nats; 8 for an FP16 P̄), the offset is folded back into [C/2, C) (modulo C/2), so the tied
    entries' P̄ stays ≥ e^-C and no row sum underflows (or hits the 1e-10 clamp; ``forward_tile`` skips the
    clamp on later tiles of a shifted row). The offset must not be a constant: a tied P̄ = e^-offset
    is rounded to BF16 for P̄·V while ℓ sums it unrounded, so O carries the factor bf16(P̄)/P̄ — a
    dither while the offset varies with r_m, as (β − 1)·r_m does, but a bias of up to ±2⁻⁹ in every
    guarded row if the offset were fixed (the earlier cap at r_m + 20 nats: +2.5e-3 relative;
    docs/NUMERICS.md). Folding keeps it varying with r_m. ``floor`` only ever sees y > 0 where its
    result is used (``floor_positive`` does for backends without a floor). ``raw``: ``s`` unscaled
    (``Numerics.scale_late``; r_m is scaled).

    Written with as few operations per row as give these values; on the GPU they run beside the tie
    count, whose serial chain after the row max is the stable forward's whole extra time.
    """
    pol = cfg.policy
    tied = tie_count(s, mask, r_m, cfg, raw) > 1
    # m is stored in BF16 by the authors' kernel ("paper"), in FP32 otherwise.
    m_dtype = pol.lp_dtype if pol.lp_accumulators else jnp.float32
    # β·r_m where r_m > 0, else 0, as one max (β > 1: β·r_m < 0 exactly where r_m < 0)
    target = jnp.maximum(round_to(cfg.beta * r_m, m_dtype), 0.0)
    cap = cfg.max_shift
    over = target - r_m - cap  # > 0: the paper's shift would go past the guard
    # over mod cap/2 with a multiply and floor (the same IEEE operations on every backend)
    folded = cap / 2 + (over - floor(over * (2.0 / cap)) * (cap / 2))
    shifted = jnp.where(over > 0, round_to(r_m + folded, m_dtype), target)
    # r_m = 0 needs no test of its own: its target is 0 and its `over` is −cap, so `shifted` is r_m
    # (up to the sign of a zero); r_m = −inf has no ties (tie_count)
    return jnp.where(tied, shifted, r_m)


def _floor_vs_shift(cfg: Numerics) -> bool:
    return cfg.stable and bool(cfg.policy.tile_sum_floor)


def init_carry(bq: int, d: int, cfg: Numerics) -> Carry:
    m_raw = jnp.full((bq,), NEG_INF, jnp.float32) if _floor_vs_shift(cfg) else None
    return Carry(jnp.full((bq,), NEG_INF, jnp.float32), jnp.zeros((bq,), jnp.float32),
                 jnp.zeros((bq, d), jnp.float32), m_raw)


def forward_scores(q, k, cfg: Numerics, bias=None):
    """The scores as the forward's softmax takes them: ``scores``, or unscaled q·kᵀ under
    ``Numerics.scale_late`` (never with a bias)."""
    return dot_nt(q, k, cfg.policy) if cfg.scale_late else scores(q, k, cfg, bias)


def forward_tile(carry: Carry, q, k, v, mask, cfg: Numerics, bias=None) -> Carry:
    """One online-softmax update of (m, ℓ, acc) with key tile (k, v); ``mask=None``: nothing masked;
    ``bias``: the tile's additive bias (``scores``)."""
    return forward_tile_from_scores(carry, forward_scores(q, k, cfg, bias), v, mask, cfg)


def forward_tile_from_scores(carry: Carry, s, v, mask, cfg: Numerics) -> Carry:
    """``forward_tile`` given the tile's scores ``s = forward_scores(q, k, cfg)`` (computed ahead by a
    kernel that overlaps them with the previous tile's softmax)."""
    pol = cfg.policy
    m_new, l_new, alpha, p_bar, m_raw = softmax_update(carry, s, mask, cfg)
    return Carry(m_new, l_new, accumulate(carry.acc, alpha, dot_nn(p_bar, v, pol), pol), m_raw)


def softmax_update(carry: Carry, s, mask, cfg: Numerics, floor=jnp.floor):
    """The online-softmax part of one tile step, everything but the P̄·V product:
    (m_new, ℓ_new, α, P̄ as the P̄·V operand, m_raw). A kernel that issues P̄·V itself (the Mosaic GPU
    forward's wgmma) finishes with ``accumulate``; ``floor``: see ``stable_shift``. ``s`` is
    ``forward_scores``' (unscaled under ``Numerics.scale_late``)."""
    pol = cfg.policy
    m_old, l_old, _, m_raw = carry
    if mask is not None:
        s = jnp.where(mask, s, NEG_INF)
    r_m = jnp.max(s, axis=1)
    raw = cfg.scale_late
    if raw:  # max(scale·s) = scale·max(s) exactly (rounding is monotone, scale > 0)
        r_m = r_m * cfg.score_scale
        shifted_by = lambda m: s * cfg.score_scale - m[:, None]  # one FMA where the compiler fuses
    else:
        shifted_by = lambda m: s - m[:, None]
    # masked entries are −inf in s by now and never reach a tie threshold: no mask needed in the count
    m_tile = stable_shift(s, None, r_m, cfg, floor, raw=raw) if cfg.stable else r_m
    m_new = jnp.maximum(m_old, m_tile)
    floor_vs_shift = _floor_vs_shift(cfg)
    if floor_vs_shift:
        m_raw = jnp.maximum(m_raw, r_m)
    m_ref = jnp.where(m_new == NEG_INF, 0.0, m_new)  # rows with nothing unmasked yet: avoid -inf - -inf
    rnd = (lambda x: round_to(x, pol.lp_dtype)) if pol.round_shifted else (lambda x: x)
    alpha = _exp(rnd(m_old - m_ref), pol)
    p = _exp(rnd(shifted_by(m_ref)), pol)  # masked entries: exp(-inf) = 0
    tile_sum = jnp.sum(p, axis=1)
    if pol.tile_sum_floor:
        # The authors clamp every tile sum; rows with no unmasked entry in the tile are skipped tiles here.
        floored = jnp.maximum(tile_sum, pol.tile_sum_floor)
        if mask is not None:
            any_key = jnp.max(jnp.where(mask, 1.0, 0.0), axis=1) > 0  # (no boolean reductions in Triton)
            floored = jnp.where(any_key, floored, tile_sum)
        if floor_vs_shift:
            # A row the stable shift has moved (m above every unshifted tile max) has ℓ as small as
            # 2·e⁻²⁰ ≈ 4e-9; the floor on a later, weaker tile would add a fake 1e-10 to it (+2.5 % per
            # tile: O shrinks towards 0, a biased error). The authors' code does that; here such rows keep the exact
            # sum. Rows never shifted keep the authors' bits.
            floored = jnp.where(m_new > m_raw, tile_sum, floored)
        tile_sum = floored
    l_new = alpha * l_old + tile_sum
    if pol.lp_accumulators:
        if pol.stochastic_row_sum:
            l_new = stochastic_round_to(l_new, pol.lp_dtype, salt=5, position_axes=())  # [bq]: bits only
        else:
            l_new = round_to(l_new, pol.lp_dtype)
    return m_new, l_new, alpha, cast_rounded(p, pol.p_dtype), m_raw


def accumulate(acc_old, alpha, pv, pol: Policy):
    """acc·α + P̄·V with the policy's roundings (``pv``: the tile's P̄·V product, FP32)."""
    if pol.round_tile_pv:
        pv = _round_o(pv, pol, salt=1)
    if pol.lp_accumulators:
        return _round_o(_round_o(acc_old * alpha[:, None], pol, salt=2) + pv, pol, salt=3)
    return acc_old * alpha[:, None] + pv


def finish(carry: Carry, cfg: Numerics):
    """(O, L) from the final carry. O is FP32 holding the policy's rounding of acc/ℓ.

    L = m + log ℓ (policy units) is what the backward needs to recompute P = exp(S − L). Rows without
    any unmasked key (padding) get O = 0 and L = +inf, so their recomputed P is 0.
    """
    pol = cfg.policy
    m, l, acc, _ = carry
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    o = acc / l_safe[:, None]
    if pol.lp_accumulators:
        o = _round_o(o, pol, salt=4)
    elif pol.stochastic_rounding:  # "fa2_sr": the final rounding of O, done here so that the
        o = stochastic_round_to(o, pol.lp_dtype, salt=4)  # executors' cast to lp is then exact
    log_l = jnp.log2(l_safe) if pol.log2_units else jnp.log(l_safe)
    lse = jnp.where(empty, float("inf"), m + log_l)
    return o, lse


# ------------------------------------------------------------------------------------------ backward
def _p_from_scores(s, lse, mask, pol: Policy):
    p = _exp(s - lse, pol)
    return p if mask is None else jnp.where(mask, p, 0.0)


def probabilities(q, k, lse, mask, cfg: Numerics, bias=None):
    """P = exp(S − L) recomputed from the saved L; masked entries 0 (``mask=None``: none masked)."""
    return _p_from_scores(scores(q, k, cfg, bias), lse[:, None], mask, cfg.policy)


def delta_tile(acc, q, k, v, do, lse, mask, cfg: Numerics, bias=None):
    """Accumulate one key tile into the δ pass for ``delta`` = "dpp" or "o_hp".

    "dpp": acc = (Σ_j rowsum(dP∘P),) — the paper's alternative δ.
    "o_hp": acc = (Σ_j P·V in FP32, Σ_j rowsum P) — a high-precision O recomputed from L and renormalised
    (so a rounded ℓ inside L does not bias it).
    """
    pol = cfg.policy
    p = probabilities(q, k, lse, mask, cfg, bias)
    if cfg.delta == "dpp":
        dp = dot_nt(do, v, pol)
        return (acc[0] + jnp.sum(dp * p, axis=1),)
    hp = dataclasses.replace(pol, operand_dtype=jnp.dtype(jnp.float32))
    pv = dot_nn(p, v.astype(jnp.float32), hp)
    return (acc[0] + pv, acc[1] + jnp.sum(p, axis=1))


def delta_finish(acc, do, cfg: Numerics):
    if cfg.delta == "dpp":
        return acc[0]
    o_hp = acc[0] / jnp.where(acc[1] == 0.0, 1.0, acc[1])[:, None]
    return jnp.sum(do.astype(jnp.float32) * o_hp, axis=1)


def delta_from_o(o, do):
    """δ = rowsum(dO ∘ O) in FP32 with the stored O (the faithful FA2 δ)."""
    return jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)


def backward_tile_dkdv(dk, dv, q, k, v, do, lse, delta, mask_t, cfg: Numerics, bias_t=None):
    """Accumulate one query block's contribution to (dK, dV) of a key tile. dK lacks the sm_scale.

    Computed transposed, keys along rows (Sᵀ = K·Qᵀ, ``mask_t`` and ``bias_t`` ``[bk, bq]``): then Pᵀ
    and dSᵀ are the left operands of dV += Pᵀ·dO and dK += dSᵀ·Q as they are, where the untransposed
    form makes the compiled kernel transpose two score tiles per step through shared memory.
    """
    pol = cfg.policy
    s_t = scores(k, q, cfg, bias_t)  # Sᵀ = scale·k·qᵀ: P's entries, transposed
    # dPᵀ does not need P: its MMA goes out before P's exp, which can then run under it
    dp_t = dot_nt(v, do, pol)
    p_t = _p_from_scores(s_t, lse[None, :], mask_t, pol)
    dv = dv + dot_nn(cast_rounded(p_t, pol.p_dtype), do, pol)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = dk + dot_nn(cast_rounded(ds_t, pol.p_dtype), q, pol)
    return dk, dv


def backward_tile_dq(dq, q, k, v, do, lse, delta, mask, cfg: Numerics, bias=None,
                     with_ds=False):
    """Accumulate one key tile's contribution to dQ of a query block. dQ lacks the sm_scale.
    ``with_ds``: also return the tile's dS = P∘(dP − δ) (FP32), the gradient of the natural-unit
    logits and so of an additive bias."""
    pol = cfg.policy
    s = scores(q, k, cfg, bias)
    dp = dot_nt(do, v, pol)  # before P's exp, as in backward_tile_dkdv
    ds = _p_from_scores(s, lse[:, None], mask, pol) * (dp - delta[:, None])
    dq = dq + dot_nn(cast_rounded(ds, pol.p_dtype), k, pol)
    return (dq, ds) if with_ds else dq


def tile_mask(q_start, k_start, bq: int, bk: int, cfg: Numerics, *, transposed: bool = False,
              lengths=None):
    """[bq, bk] mask of a tile (True = visible): keys inside kv_len, key ≤ query when causal
    (top-left aligned), keys in [query − left, query + right] under a window, and with ``lengths``
    = (q_len, kv_len) of this batch element (traced scalars, ``Numerics.seq_lengths``) rows before
    q_len and keys before kv_len only. ``transposed``: the same mask as [bk, bq] (keys along rows),
    built directly."""
    q_axis, k_axis = (1, 0) if transposed else (0, 1)
    shape = (bk, bq) if transposed else (bq, bk)
    rows = q_start + lax.broadcasted_iota(jnp.int32, shape, q_axis)
    cols = k_start + lax.broadcasted_iota(jnp.int32, shape, k_axis)
    mask = cols < (cfg.kv_len if lengths is None else lengths[1])
    if lengths is not None:
        mask = mask & (rows < lengths[0])
    if cfg.causal:
        mask = mask & (cols <= rows)
    if cfg.window is not None:
        left, right = cfg.window
        mask = mask & (cols >= rows - left) & (cols <= rows + right)
    return mask


# ----------------------------------------------------------------------------------- loop bounds
# Which tiles a kernel visits. Any superset of the tiles holding a visible entry gives the same
# values (a tile with nothing visible is an exact no-op: α = 1, P̄ = 0; the jnp executor visits every
# tile), so these bounds decide speed only. Integer scalars: Python ints or traced int32.
def _cdiv(a, b: int):
    return (a + (b - 1)) // b


def _clip(x, lo, hi):
    return jnp.minimum(jnp.maximum(x, lo), hi)


def kv_tile_bounds(q_start, bq: int, bk: int, nk: int, cfg: Numerics, lengths=None):
    """(lo, full_lo, full_hi, hi) for the query rows [q_start, q_start + bq): key tiles [lo, hi) hold
    every key visible to one of them; tiles [full_lo, full_hi) ⊆ [lo, hi) are visible to all of
    them (no mask needed). ``lengths``: as in ``tile_mask``."""
    q_end, kv_len = q_start + bq, cfg.kv_len
    if lengths is not None:
        q_end, kv_len = jnp.minimum(q_end, lengths[0]), lengths[1]
    k_lo, k_hi = 0, _kv_seen_end(q_end, kv_len, cfg)  # keys that some row may see: [k_lo, k_hi)
    f_lo, f_hi = 0, kv_len  # keys that every row sees: [f_lo, f_hi)
    if cfg.causal:
        f_hi = jnp.minimum(f_hi, q_start + 1)
    if cfg.window is not None:
        left, right = cfg.window
        k_lo = jnp.maximum(q_start - left, 0)
        f_lo = jnp.maximum(q_start + bq - 1 - left, 0)
        f_hi = jnp.minimum(f_hi, q_start + right + 1)
    lo = jnp.minimum(k_lo // bk, nk)
    hi = jnp.where(k_hi > k_lo, _clip(_cdiv(jnp.maximum(k_hi, 0), bk), lo, nk), lo)
    if lengths is not None:
        hi = jnp.where(q_end > q_start, hi, lo)  # rows all past q_len: nothing to visit
    full_lo = _clip(_cdiv(f_lo, bk), lo, hi)
    full_hi = _clip(jnp.maximum(f_hi, 0) // bk, full_lo, hi)
    if lengths is not None:  # a row past q_len is masked: no tile is mask-free then
        full_hi = jnp.where(q_start + bq <= lengths[0], full_hi, full_lo)
    return lo, full_lo, full_hi, hi


def _kv_seen_end(q_end, kv_len, cfg: Numerics):
    """One past the last key that a row before ``q_end`` may see."""
    k_hi = kv_len
    if cfg.causal:
        k_hi = jnp.minimum(k_hi, q_end)
    if cfg.window is not None:
        k_hi = jnp.minimum(k_hi, q_end + cfg.window[1])
    return k_hi


def kv_half_last(q_start, bq: int, bk: int, cfg: Numerics, bounds):
    """1 where the rows [q_start, q_start + bq) see none of the second half of their last tile
    (tile hi − 1 of ``bounds``, ``kv_tile_bounds``' for them) and that tile is one of the masked
    trailing ones [full_hi, hi), else 0. A kernel may then run that tile on its first bk / 2 keys:
    the other half holds masked scores only, whose exps are exact zeros, so every max, sum and
    product over the tile takes the same values in the same order, with zeros left off its end."""
    _, _, full_hi, hi = bounds
    k_hi = _kv_seen_end(q_start + bq, cfg.kv_len, cfg)
    return ((hi > full_hi) & (k_hi <= (hi - 1) * bk + bk // 2)).astype(jnp.int32)


def q_block_bounds(k_start, bq: int, bk: int, nq: int, cfg: Numerics, lengths=None):
    """(lo, full_lo, full_hi, hi) for the keys [k_start, k_start + bk): query blocks [lo, hi) hold
    every row that sees one of them; blocks [full_lo, full_hi) ⊆ [lo, hi) see all of them (no mask
    needed). ``lengths``: as in ``tile_mask``."""
    k_end, kv_len, q_hi = k_start + bk, cfg.kv_len, nq * bq
    if lengths is not None:
        k_end, kv_len, q_hi = jnp.minimum(k_end, lengths[1]), lengths[1], lengths[0]
    q_lo = 0  # rows that may see a key of the tile: [q_lo, q_hi)
    f_lo, f_hi = 0, q_hi  # rows that see every key of the tile: [f_lo, f_hi)
    if cfg.causal:
        q_lo = k_start
        f_lo = k_start + bk - 1
    if cfg.window is not None:
        left, right = cfg.window
        q_lo = jnp.maximum(q_lo, k_start - right)
        q_hi = jnp.minimum(q_hi, k_end + left)
        f_lo = jnp.maximum(f_lo, k_start + bk - 1 - right)
        f_hi = jnp.minimum(f_hi, k_start + left + 1)
    q_lo = jnp.maximum(q_lo, 0)
    lo = jnp.minimum(q_lo // bq, nq)
    hi = jnp.where((q_hi > q_lo) & (k_end > k_start),
                   _clip(_cdiv(jnp.maximum(q_hi, 0), bq), lo, nq), lo)
    full_lo = _clip(_cdiv(jnp.maximum(f_lo, 0), bq), lo, hi)
    full_hi = _clip(jnp.maximum(f_hi, 0) // bq, full_lo, hi)
    full_hi = jnp.where(k_start + bk <= kv_len, full_hi, full_lo)  # keys past kv_len are masked
    return lo, full_lo, full_hi, hi
