"""Numerics policies: where each rounding of flash attention happens.

One algorithm (``tile.py``) runs under every policy; a policy only says which intermediate values are
rounded to which dtype. It is a frozen dataclass so it can be a static argument of ``jit`` and of the
Pallas kernels, and so the two executors cannot disagree about the arithmetic.

Presets (resolved against the input dtype by :func:`make_policy`):

``"fa2"``
    Production flash-attention numerics (FA2/FA3 CUDA, cuDNN, Triton): S, the row max m, the row sum
    ℓ and the O accumulator in FP32; P̄ cast to the input dtype right before the P̄·V matmul; O rounded
    once at the end. Like FA2, scores are kept in log2 units (scale·log2(e) folded into the scale) and
    ``exp2`` is used, with results below 2⁻¹²⁶ flushed to zero (the GPU's fast exp2).
``"paper"``
    The authors' pure-PyTorch kernel under BF16 autocast, operation by operation: S rounded to BF16
    (after QKᵀ and again after the scale), ``S − m`` rounded to BF16 before an FP32 ``exp``, each tile's
    P̄·V a BF16 GEMM output, the O and ℓ accumulators (and m) stored in BF16 with their update order,
    tile sums clamped at 1e-10, ``O /= ℓ`` in BF16, their tie test ``S ≥ bf16(r_m − 1e-3)``, and
    512-wide key tiles. Natural-log units.
``"fp32"``
    The high-precision control: inputs upcast, every step in FP32 (``precision=HIGHEST`` dots); the O
    kept for the backward's δ is FP32 too. Only the returned O is cast to the input dtype.
``"fp32_bf16x6"``
    "fp32" with every matmul computed from BF16 pieces on the tensor cores: each FP32 operand split
    into three BF16 terms (hi + mid + lo, 24 significant bits), the six products that carry
    magnitudes down to 2⁻¹⁶ of the leading one summed in FP32 (``tile.dot_nn``). Error of the order
    of FP32's own; on the GPU ~6 BF16 MMAs per dot instead of IEEE FP32 FMAs without tensor cores
    (the "fp32" kernels ran a GPT-2 small step in 3.7 s: docs/REPRODUCTION.md).
``"paper_sr"``, ``"fa2_sr"``
    "paper" and "fa2" with stochastic rounding (``rounding.stochastic_round_to``, a deterministic
    pseudo-random dither hashed from the value's bits and position) in place of round-to-nearest-even
    at the roundings of Ō and O: for "paper_sr" the tile's P̄·V GEMM output, the rescaled and updated
    BF16 O accumulator and ``O /= ℓ``; for "fa2_sr" the single final rounding of O to the input dtype
    (hence also the O kept for δ). ℓ, m, S and P̄ keep round-to-nearest-even. BF16 (and FP32) inputs
    only. Every other rounding point is the base policy's.
``"paper_fp32acc"``
    "paper" with FP32 accumulation of Ō: each tile's P̄·V output and the O, ℓ and m accumulators
    (and O /= ℓ) in FP32, as production kernels keep them; scores, S − m, the tie test, the clamp
    and the 512-wide tiles stay the authors'. The stored O is still BF16. The CPU ablation puts the
    bias the stable shift leaves under "paper" in the BF16 rounding of Ō (docs/MECHANISM.md §5):
    this preset is its training test.
``"paper_sr_all"``
    "paper_sr" plus stochastic rounding of the BF16 row-sum accumulator ℓ: with Ō alone stochastically
    rounded, ℓ = bf16(ties + remainder mass) still drops the remainder and biases O away from zero
    (docs/MECHANISM.md).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

POLICIES = ("fa2", "paper", "fp32", "paper_sr", "fa2_sr", "paper_sr_all", "paper_fp32acc",
            "fp32_bf16x6")
# stochastic-rounding variants of "paper" and "fa2" (see above)
SR_POLICIES = ("paper_sr", "fa2_sr", "paper_sr_all")

LOG2E = math.log2(math.e)

# The stable shift moves a tied row's max by at most this many nats (the underflow guard; larger offsets
# are folded back into [MAX/2, MAX): tile.stable_shift): a tied entry then has P̄ ≥ e^-20 ≈ 2e-9, far
# above FP32's smallest normal (1.2e-38) and above the authors' 1e-10 tile-sum clamp, so no row sum
# underflows or gets clamped (and the clamp is skipped on the later tiles of a shifted row:
# tile.forward_tile). Below it the shift is exactly the paper's (β·r_m or 0).
MAX_SHIFT_NATS = 20.0
# With a float16 P̄ the tied entries must stay above FP16's smallest normal (2⁻¹⁴ = e^-9.7): its
# guard folds into [4, 8) nats instead.
MAX_SHIFT_NATS_FP16 = 8.0


def max_shift_nats(p_dtype) -> float:
    """The stable shift's largest offset above the row max, in nats, for P̄ stored as ``p_dtype``."""
    return MAX_SHIFT_NATS_FP16 if np.dtype(p_dtype) == np.dtype(np.float16) else MAX_SHIFT_NATS


@dataclasses.dataclass(frozen=True)
class Policy:
    name: str
    operand_dtype: np.dtype  # dtype of q, k, v (and dO) as matmul operands
    lp_dtype: np.dtype  # the low-precision dtype that rounding points round to
    p_dtype: np.dtype  # P̄ (forward) and P, dS (backward) as matmul operands
    o_residual_dtype: np.dtype  # dtype of the O saved for δ = rowsum(dO ∘ O)
    log2_units: bool  # scores carried as S·log2(e) and exponentiated with exp2 (FA2 style)
    round_scores: bool  # S rounded to lp after QKᵀ and after the scale
    round_shifted: bool  # S − m (and m_old − m_new) rounded to lp before exp
    round_tile_pv: bool  # each tile's P̄·V product rounded to lp (a low-precision GEMM output)
    lp_accumulators: bool  # O accumulator, ℓ and m stored in lp between tiles; O /= ℓ in lp
    tile_sum_floor: float  # clamp(min=…) on each tile's row sum; 0 = none
    tie_test: str  # "paper": S ≥ lp(r_m − 1e-3); "p_one": lp(P̄) == 1 with P̄ = exp(S − r_m)
    tie_dtype: np.dtype  # dtype of the "P̄ rounds to 1" test
    # Ō / O roundings (tile P̄·V output, O accumulator, O /= ℓ under lp_accumulators; else the final O)
    # stochastic instead of round-to-nearest-even.
    stochastic_rounding: bool = False
    # the lp row-sum accumulator ℓ (lp_accumulators only) stochastically rounded too
    stochastic_row_sum: bool = False
    # FP32 operands: "ieee" (dots at Precision.HIGHEST) or "bf16x6" (three BF16 pieces, six products)
    fp32_dot: str = "ieee"
    # exp2 results below 2⁻¹²⁶ (FP32 subnormals) are 0, as the GPU's fast exp2 gives them; every
    # executor computes it that way (log2-unit policies only)
    exp_ftz: bool = False

    @property
    def fp32_dots(self) -> bool:
        return self.operand_dtype == np.dtype(np.float32)


def _is_16bit(dtype) -> bool:
    return np.dtype(dtype).itemsize == 2


def make_policy(name: str, dtype) -> Policy:
    """The preset ``name`` resolved for inputs of ``dtype`` (bf16, fp16 or fp32)."""
    dtype = np.dtype(dtype)
    if name in SR_POLICIES:
        if dtype == np.dtype(jnp.float16):
            raise ValueError(f"policy {name!r}: stochastic rounding is implemented for bfloat16 (and "
                             "float32) inputs only, got float16")
        base = make_policy(name.split("_")[0], dtype)
        return dataclasses.replace(base, name=name, stochastic_rounding=True,
                                   stochastic_row_sum=name.endswith("_all"))
    if name == "fp32_bf16x6":
        return dataclasses.replace(make_policy("fp32", dtype), name=name, fp32_dot="bf16x6")
    if name == "paper_fp32acc":
        return dataclasses.replace(make_policy("paper", dtype), name=name, round_tile_pv=False,
                                   lp_accumulators=False)
    f32 = np.dtype(np.float32)
    bf16 = np.dtype(jnp.bfloat16)
    if name == "fa2":
        return Policy(
            name=name, operand_dtype=dtype, lp_dtype=dtype, p_dtype=dtype, o_residual_dtype=dtype,
            log2_units=True, round_scores=False, round_shifted=False, round_tile_pv=False,
            lp_accumulators=False, tile_sum_floor=0.0, tie_test="p_one",
            tie_dtype=dtype if _is_16bit(dtype) else bf16, exp_ftz=True)
    if name == "paper":
        # Autocast runs the GEMMs in BF16 (fp16 inputs keep fp16, as autocast(dtype=float16) would).
        lp = dtype if _is_16bit(dtype) else bf16
        return Policy(
            name=name, operand_dtype=lp, lp_dtype=lp, p_dtype=lp, o_residual_dtype=lp,
            log2_units=False, round_scores=True, round_shifted=True, round_tile_pv=True,
            lp_accumulators=True, tile_sum_floor=1e-10, tie_test="paper", tie_dtype=lp)
    if name == "fp32":
        return Policy(
            name=name, operand_dtype=f32, lp_dtype=f32, p_dtype=f32, o_residual_dtype=f32,
            log2_units=False, round_scores=False, round_shifted=False, round_tile_pv=False,
            lp_accumulators=False, tile_sum_floor=0.0, tie_test="p_one", tie_dtype=bf16)
    raise ValueError(f"unknown policy {name!r}; expected one of {POLICIES}")
