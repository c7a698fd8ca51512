"""The arithmetic of one (query block × key tile) step — written once, run by both executors.

Every function here is plain ``jax.numpy`` on 2-D tiles: the Pallas kernels call them inside the kernel
body (traced into Triton on GPU, interpreted on CPU) and the jnp executor calls them under ``vmap``
inside a ``fori_loop``. The policy (``policy.py``) decides every rounding point, so the two executors
compute the same bits by construction.

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

from .policy import LOG2E, MAX_SHIFT_NATS, Policy
from .rounding import cast_rounded, round_to, stochastic_round_to

NEG_INF = float("-inf")
_LOWEST = float(jnp.finfo(jnp.float32).min)  # the lowest finite FP32 value


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything static about one attention call (hashable: a jit / custom_vjp static argument)."""

    policy: Policy
    causal: bool
    stable: bool
    beta: float
    sm_scale: float
    delta: str  # "o" | "o_hp" | "dpp"
    block_q: int
    block_k: int
    q_len: int  # true (unpadded) lengths; tails beyond them are masked
    kv_len: int
    # Triton launch parameters ((num_warps, num_stages) for the forward and the backward kernels);
    # None: the defaults. They do not change the numerics.
    fwd_launch: tuple | None = None
    bwd_launch: tuple | None = None
    # Pallas kernels: run the tiles that need no mask (below the causal diagonal, inside kv_len) in a
    # loop without mask arithmetic. The same operations on the same values in the same order; a
    # launch choice of the tuning table (pallas/tuning.py), off by default.
    split_diagonal: bool = False
    # Pallas backward: rows each program keeps resident — keys per dK/dV program, queries per dQ
    # program — a multiple of block_q and block_k (None: one tile). The streamed tiles stay
    # block_q × block_k, so every gradient row sums the same tile products in the same order (the
    # extra fully masked tiles a larger block visits add exact zeros): a launch choice of the tuning
    # table, not a change of numerics.
    bwd_block: int | None = None
    # The dQ kernel on its own (tuning fields "dq" and "dq_block"): its launch and resident query
    # block, where they differ from the dK/dV kernel's (None: ``bwd_launch`` / ``bwd_block``). The
    # two backward kernels stall differently (docs/PERF_NOTES.md, v9 profile); same numerics.
    dq_launch: tuple | None = None
    dq_block: int | None = None
    # Pallas dK/dV kernel: load the next query block's L and δ one iteration ahead (carried in the
    # loop), so that their global-load latency overlaps this block's MMAs (tuning field
    # "prefetch_rows"). The same values in the same order; a launch choice.
    prefetch_rows: bool = False
    # Pallas forward: compute the next key tile's scores Q·Kᵀ before this tile's softmax and P̄·V
    # (carried in the loop), so that the next tile's MMA can run while this tile's softmax does
    # (tuning field "prefetch_scores"; docs/PERF_NOTES.md, lever 2). The same values; a launch choice.
    prefetch_scores: bool = False
    # Pallas forward on Hopper: "mosaic" runs pallas/forward_mosaic.py (TMA, wgmma, warpgroup
    # ping-pong) where the tuning table measured it faster (field "fwd_kernel"), else "triton". The
    # same algorithm and rounding points; the summation order inside an MMA may differ.
    fwd_kernel: str = "triton"
    # Pallas backward on Hopper: "mosaic" runs pallas/backward_mosaic.py's dK/dV and dQ kernels,
    # "mosaic_dkdv" its dK/dV kernel only, where the table measured it faster (field "bwd_kernel");
    # else "triton". The same contract and rounding points; MMA summation orders their own.
    bwd_kernel: str = "triton"
    # The stable forward's tie count summed in int32 instead of FP32 (tuning field "tie_count_int"):
    # the same counts (small integers are exact in both); which compiles to fewer instructions per
    # score entry is for the GPU to say (docs/PERF_NOTES.md, "Next levers after the eleventh session").
    tie_count_int: bool = False
    # The stable shift applied as a per-row factor (tuning field "shift_factor"; FP32-accumulator
    # policies only): P̄ = exp(S − m_base)·exp(m_base − m_new), with m_base = max(m_old, r_m) the
    # baseline's shift, instead of exp(S − m_new). Equal in real arithmetic; in FP32 shifted rows differ
    # by the product's rounding (rows the shift leaves alone: factor 1, the same bits). The exps then no
    # longer wait for the tie count (docs/PERF_NOTES.md, "v15").
    shift_factor: bool = False
    # The stable forward's "≥ 2 ties" from the row's two largest scores, found in the same reduction
    # as the row max (tuning field "tie_top2"; ``row_top2``), instead of a count after it: the same
    # decisions (the count of entries ≥ the threshold is ≥ 2 exactly when the second largest is ≥ it),
    # without the count's serial chain between the row max and the exps — but with its min/max on the
    # ALU pipe, which made the H200's forward slower (docs/PERF_NOTES.md v17). Triton kernels and the
    # jnp executor; the Mosaic GPU forward does not lower it.
    tie_top2: bool = False
    # Pallas Triton forward: exp2 as PTX ``ex2.approx.ftz.f32`` (tuning field "exp2_ftz"; "fa2"-style
    # log2-unit policies). The hardware exp2 either way; without ftz the compiler wraps each one in
    # a compare and two multiplies for subnormal results (P̄ < 2⁻¹²⁶): three instructions per score
    # that base and stable both issue (docs/PERF_NOTES.md v17b). Same values except results below
    # 2⁻¹²⁶, which become 0; interpret mode and the jnp executor keep jnp.exp2.
    exp2_ftz: bool = False
    # The forward keeps the scores unscaled (q·kᵀ in FP32; tuning field "scale_late"; policies
    # without score rounding): the row max is scale·max(q·kᵀ) — the same value as the max of the
    # scaled scores, rounding being monotone — the exps take scale·s − m, which a GPU compiler fuses
    # into one FMA, and the tie test compares q·kᵀ against the threshold divided by the scale
    # (``tie_count``). Where the compiler fuses (the Mosaic forward) no multiply per score is left, in
    # base and stable alike. The tie test's boundary moves by at most an ulp or two of the threshold
    # (docs/PERF_NOTES.md v17c).
    scale_late: bool = False

    def __post_init__(self):
        pol = self.policy
        if self.shift_factor and (pol.round_shifted or pol.lp_accumulators or pol.tile_sum_floor):
            raise ValueError(f"shift_factor needs FP32 accumulators and unrounded exponents; policy "
                             f"{pol.name!r} has its own rounding points for the shift")
        if self.scale_late and (pol.round_scores or pol.round_shifted):
            raise ValueError(f"scale_late needs unrounded scores; policy {pol.name!r} rounds them")

    @property
    def score_scale(self) -> float:
        """Multiplier from raw q·k to the policy's score units."""
        return self.sm_scale * (LOG2E if self.policy.log2_units else 1.0)

    @property
    def score_scale_inv(self) -> float:
        """1 / score_scale rounded to FP32 (``tie_count`` under ``scale_late``)."""
        return float(np.float32(1.0 / self.score_scale))

    @property
    def max_shift(self) -> float:
        return MAX_SHIFT_NATS * (LOG2E if self.policy.log2_units else 1.0)


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


_TRITON_BODY = contextvars.ContextVar("jax_flash_triton_body", default=False)


@contextlib.contextmanager
def triton_body(enabled: bool = True):
    """Inside a compiled Pallas Triton kernel body (``pallas.common.kernel_body``): PTX may be
    inlined (``_exp(…, ftz=True)``)."""
    token = _TRITON_BODY.set(enabled)
    try:
        yield
    finally:
        _TRITON_BODY.reset(token)


def _exp(x, pol, ftz=False):
    if not pol.log2_units:
        return jnp.exp(x)
    if ftz and _TRITON_BODY.get():
        from jax.experimental.pallas import triton as pltriton

        return pltriton.elementwise_inline_asm(
            "ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])[0]
    return jnp.exp2(x)


def _log(x: float, pol) -> float:
    return math.log2(x) if pol.log2_units else math.log(x)


# ------------------------------------------------------------------------------------------- forward
def scores(q, k, cfg: Config):
    """S = scale·q·kᵀ in the policy's units and rounding (FP32 container)."""
    pol = cfg.policy
    s = dot_nt(q, k, pol)
    if pol.round_scores:  # a BF16 GEMM output, then a BF16 multiply by the scale
        return round_to(round_to(s, pol.lp_dtype) * cfg.score_scale, pol.lp_dtype)
    return s * cfg.score_scale


def tie_threshold(r_m, cfg: Config):
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


def tie_count(s, mask, r_m, cfg: Config, raw: bool = False):
    """Per row, the number of unmasked entries "at the max" r_m (masked entries never count;
    ``mask=None``: a tile without masked entries, or one whose masked entries are −inf in ``s``).

    ``p_one``: entries whose P̄ = exp(S − r_m) rounds to exactly 1.0 in the tie dtype (BF16: S within
    ~2⁻⁹ of r_m) — the entries that put exact copies of V rows into Ō. ``paper``: the authors' test
    ``S ≥ bf16(r_m − 1e-3)`` on BF16 scores.

    Both are one compare per entry against a per-row threshold (``tie_threshold``): the count is the
    stable forward's only per-entry extra work (docs/PERF_NOTES.md v8). ``raw``: ``s`` holds unscaled
    scores (``Config.scale_late``), compared against the threshold times 1/scale (FP32), kept finite
    so that −inf (masked) entries never count.
    """
    threshold = tie_threshold(r_m, cfg)
    if raw:
        threshold = jnp.maximum(threshold * cfg.score_scale_inv, _LOWEST)
    at_max = s >= threshold[:, None]
    if mask is not None:
        at_max = mask & at_max
    if cfg.tie_count_int:
        return jnp.sum(at_max.astype(jnp.int32), axis=1)
    return jnp.sum(jnp.where(at_max, 1.0, 0.0), axis=1)


def _top2_combine(a, b):
    (a1, a2), (b1, b2) = a, b
    return jnp.maximum(a1, b1), jnp.maximum(jnp.minimum(a1, b1), jnp.maximum(a2, b2))


def row_top2(s):
    """Per row, the largest and the second largest entry of ``s`` (with multiplicity: a value held
    twice is both), as one reduction whose combine keeps a (first, second) pair — so the row max and
    what the tie test needs leave the reduction together (``Config.tie_top2``). The first is
    ``jnp.max(s, axis=1)``: max is exact whatever the order."""
    pair = (s, jnp.full_like(s, NEG_INF))
    neg_inf = jnp.asarray(NEG_INF, s.dtype)
    return lax.reduce(pair, (neg_inf, neg_inf), _top2_combine, (1,))


def floor_positive(y):
    """floor(y) for y > 0 as a truncation, the ``floor`` the Mosaic GPU forward passes to
    ``stable_shift`` (Mosaic GPU, jax 0.11, has no floor; elsewhere one instruction does it, where
    this takes four per row): FP32 values ≥ 2²³ are integers already, below that truncation toward
    zero is floor. Other y: unspecified (the caller discards them)."""
    return jnp.where(y >= 2.0 ** 23, y, y.astype(jnp.int32).astype(jnp.float32))


def stable_shift(s, mask, r_m, cfg: Config, floor=jnp.floor, second=None, raw=False):
    """The paper's Algorithm 1 with an underflow guard: the tile's max to use for the softmax shift.

    Rows with ≥ 2 ties use β·r_m if r_m > 0 and 0 if r_m < 0 (so every P̄ < 1); other rows (and r_m = 0)
    use r_m. Guard: where that moves the shift more than MAX_SHIFT_NATS above r_m, the offset is folded
    back into [MAX_SHIFT_NATS / 2, MAX_SHIFT_NATS) (modulo MAX_SHIFT_NATS / 2), so the tied entries'
    P̄ stays ≥ e⁻²⁰ and no row sum underflows (or hits the 1e-10 clamp; ``forward_tile`` skips the
    clamp on later tiles of a shifted row). The offset must not be a constant: a tied P̄ = e^-offset
    is rounded to BF16 for P̄·V while ℓ sums it unrounded, so O carries the factor bf16(P̄)/P̄ — a
    dither while the offset varies with r_m, as (β − 1)·r_m does, but a bias of up to ±2⁻⁹ in every
    guarded row if the offset were fixed (the earlier cap at r_m + 20 nats: +2.5e-3 relative;
    docs/NUMERICS.md). Folding keeps it varying with r_m. ``floor`` only ever sees y > 0 where its
    result is used (``floor_positive`` does for backends without a floor). ``second``: the rows'
    second largest scores (``row_top2``); given, "≥ 2 ties" is ``second ≥ threshold`` — the same
    decision as ``tie_count(...) > 1`` (``s`` and ``mask`` are then unused). ``raw``: ``s`` unscaled
    (``Config.scale_late``; r_m and ``second`` are scaled).

    Written with as few operations per row as give these values; on the GPU they run beside the tie
    count, whose chain is the stable forward's whole extra time (docs/PERF_NOTES.md v16).
    """
    pol = cfg.policy
    if second is None:
        tied = tie_count(s, mask, r_m, cfg, raw) > 1
    else:  # ≥ 2 entries reach the threshold ⟺ the second largest does (the largest, r_m, always does)
        tied = second >= tie_threshold(r_m, cfg)
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


def _floor_vs_shift(cfg: Config) -> bool:
    return cfg.stable and bool(cfg.policy.tile_sum_floor)


def init_carry(bq: int, d: int, cfg: Config) -> Carry:
    m_raw = jnp.full((bq,), NEG_INF, jnp.float32) if _floor_vs_shift(cfg) else None
    return Carry(jnp.full((bq,), NEG_INF, jnp.float32), jnp.zeros((bq,), jnp.float32),
                 jnp.zeros((bq, d), jnp.float32), m_raw)


def forward_scores(q, k, cfg: Config):
    """The scores as the forward's softmax takes them: ``scores``, or unscaled q·kᵀ under
    ``Config.scale_late``."""
    return dot_nt(q, k, cfg.policy) if cfg.scale_late else scores(q, k, cfg)


def forward_tile(carry: Carry, q, k, v, mask, cfg: Config) -> Carry:
    """One online-softmax update of (m, ℓ, acc) with key tile (k, v); ``mask=None``: nothing masked."""
    return forward_tile_from_scores(carry, forward_scores(q, k, cfg), v, mask, cfg)


def forward_tile_from_scores(carry: Carry, s, v, mask, cfg: Config) -> Carry:
    """``forward_tile`` given the tile's scores ``s = forward_scores(q, k, cfg)`` (computed ahead by a
    kernel that overlaps them with the previous tile's softmax)."""
    pol = cfg.policy
    m_new, l_new, alpha, p_bar, m_raw = softmax_update(carry, s, mask, cfg)
    return Carry(m_new, l_new, accumulate(carry.acc, alpha, dot_nn(p_bar, v, pol), pol), m_raw)


def softmax_update(carry: Carry, s, mask, cfg: Config, floor=jnp.floor):
    """The online-softmax part of one tile step, everything but the P̄·V product:
    (m_new, ℓ_new, α, P̄ as the P̄·V operand, m_raw). A kernel that issues P̄·V itself (the Mosaic GPU
    forward's wgmma) finishes with ``accumulate``; ``floor``: see ``stable_shift``. ``s`` is
    ``forward_scores``' (unscaled under ``Config.scale_late``)."""
    pol = cfg.policy
    m_old, l_old, _, m_raw = carry
    if mask is not None:
        s = jnp.where(mask, s, NEG_INF)
    if cfg.stable and cfg.tie_top2:
        r_m, second = row_top2(s)
    else:
        r_m, second = jnp.max(s, axis=1), None
    raw = cfg.scale_late
    if raw:  # max(scale·s) = scale·max(s) exactly (rounding is monotone, scale > 0)
        r_m = r_m * cfg.score_scale
        second = None if second is None else second * cfg.score_scale
        shifted_by = lambda m: s * cfg.score_scale - m[:, None]  # one FMA where the compiler fuses
    else:
        shifted_by = lambda m: s - m[:, None]
    # masked entries are −inf in s by now and never reach a tie threshold: no mask needed in the count
    m_tile = stable_shift(s, None, r_m, cfg, floor, second=second, raw=raw) if cfg.stable else r_m
    m_new = jnp.maximum(m_old, m_tile)
    floor_vs_shift = _floor_vs_shift(cfg)
    if floor_vs_shift:
        m_raw = jnp.maximum(m_raw, r_m)
    m_ref = jnp.where(m_new == NEG_INF, 0.0, m_new)  # rows with nothing unmasked yet: avoid -inf - -inf
    rnd = (lambda x: round_to(x, pol.lp_dtype)) if pol.round_shifted else (lambda x: x)
    ftz = cfg.exp2_ftz
    alpha = _exp(rnd(m_old - m_ref), pol, ftz)
    if cfg.stable and cfg.shift_factor:
        # exps against the baseline's shift (they need not wait for the tie count), the stable shift
        # then as a factor ≤ 1 per row: exactly 1 (the same bits) where it moved nothing
        m_base = jnp.maximum(m_old, r_m)
        m_base = jnp.where(m_base == NEG_INF, 0.0, m_base)
        p = _exp(shifted_by(m_base), pol, ftz)
        factor = jnp.where(m_ref != m_base, _exp(m_base - m_ref, pol, ftz), 1.0)
        tile_sum = factor * jnp.sum(p, axis=1)
        p = p * factor[:, None]
    else:
        p = _exp(rnd(shifted_by(m_ref)), pol, ftz)  # masked entries: exp(-inf) = 0
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


def finish(carry: Carry, cfg: Config):
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


def probabilities(q, k, lse, mask, cfg: Config):
    """P = exp(S − L) recomputed from the saved L; masked entries 0 (``mask=None``: none masked)."""
    return _p_from_scores(scores(q, k, cfg), lse[:, None], mask, cfg.policy)


def delta_tile(acc, q, k, v, do, lse, mask, cfg: Config):
    """Accumulate one key tile into the δ pass for ``delta`` = "dpp" or "o_hp".

    "dpp": acc = (Σ_j rowsum(dP∘P),) — the paper's alternative δ.
    "o_hp": acc = (Σ_j P·V in FP32, Σ_j rowsum P) — a high-precision O recomputed from L and renormalised
    (so a rounded ℓ inside L does not bias it).
    """
    pol = cfg.policy
    p = probabilities(q, k, lse, mask, cfg)
    if cfg.delta == "dpp":
        dp = dot_nt(do, v, pol)
        return (acc[0] + jnp.sum(dp * p, axis=1),)
    hp = dataclasses.replace(pol, operand_dtype=jnp.dtype(jnp.float32))
    pv = dot_nn(p, v.astype(jnp.float32), hp)
    return (acc[0] + pv, acc[1] + jnp.sum(p, axis=1))


def delta_finish(acc, do, cfg: Config):
    if cfg.delta == "dpp":
        return acc[0]
    o_hp = acc[0] / jnp.where(acc[1] == 0.0, 1.0, acc[1])[:, None]
    return jnp.sum(do.astype(jnp.float32) * o_hp, axis=1)


def delta_from_o(o, do):
    """δ = rowsum(dO ∘ O) in FP32 with the stored O (the faithful FA2 δ)."""
    return jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)


def backward_tile_dkdv(dk, dv, q, k, v, do, lse, delta, mask_t, cfg: Config):
    """Accumulate one query block's contribution to (dK, dV) of a key tile. dK lacks the sm_scale.

    Computed transposed, keys along rows (Sᵀ = K·Qᵀ, ``mask_t`` ``[bk, bq]``): then Pᵀ and dSᵀ are the
    left operands of dV += Pᵀ·dO and dK += dSᵀ·Q as they are, where the untransposed form makes the
    compiled kernel transpose two score tiles per step through shared memory (PERF_NOTES v9).
    """
    pol = cfg.policy
    s_t = scores(k, q, cfg)  # Sᵀ = scale·k·qᵀ: P's entries, transposed
    # dPᵀ does not need P: its MMA goes out before P's exp, which can then run under it (PERF_NOTES v12)
    dp_t = dot_nt(v, do, pol)
    p_t = _p_from_scores(s_t, lse[None, :], mask_t, pol)
    dv = dv + dot_nn(cast_rounded(p_t, pol.p_dtype), do, pol)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = dk + dot_nn(cast_rounded(ds_t, pol.p_dtype), q, pol)
    return dk, dv


def backward_tile_dq(dq, q, k, v, do, lse, delta, mask, cfg: Config):
    """Accumulate one key tile's contribution to dQ of a query block. dQ lacks the sm_scale."""
    pol = cfg.policy
    s = scores(q, k, cfg)
    dp = dot_nt(do, v, pol)  # before P's exp, as in backward_tile_dkdv
    ds = _p_from_scores(s, lse[:, None], mask, pol) * (dp - delta[:, None])
    return dq + dot_nn(cast_rounded(ds, pol.p_dtype), k, pol)


def tile_mask(q_start, k_start, bq: int, bk: int, cfg: Config, *, transposed: bool = False):
    """[bq, bk] mask of a tile: keys inside kv_len, and key ≤ query when causal.
    ``transposed``: the same mask as [bk, bq] (keys along rows), built directly."""
    q_axis, k_axis = (1, 0) if transposed else (0, 1)
    shape = (bk, bq) if transposed else (bq, bk)
    rows = q_start + lax.broadcasted_iota(jnp.int32, shape, q_axis)
    cols = k_start + lax.broadcasted_iota(jnp.int32, shape, k_axis)
    mask = cols < cfg.kv_len
    if cfg.causal:
        mask = mask & (cols <= rows)
    return mask
