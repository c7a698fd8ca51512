"""The public entry point: argument checking, defaults, executor dispatch and the custom_vjp."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from . import jnp_impl, pallas
from .pallas import tuning
from .policy import POLICIES, make_policy
from .rounding import cast_rounded
from .tile import Config

DELTAS = ("o", "o_hp", "dpp")
IMPLS = ("auto", "pallas", "jnp")
HEAD_DIMS = (16, 32, 64, 128, 256)
MIN_BLOCK = 16  # Triton's smallest dot tile
# Largest K+V tile pair the Triton kernels stage in shared memory (the "paper" policy's 512-wide key
# tiles at head_dim 128 need 256 KiB: impl="auto" runs those on the jnp executor instead).
MAX_KV_TILE_BYTES = 160 * 1024


def attention(q, k, v, *, causal=True, stable=False, beta=2.0, sm_scale=None, policy="fa2",
              delta="o", impl="auto", block_q=None, block_k=None):
    """Flash attention with a choice of numerics, optionally with the paper's stable softmax shift.

    Args:
      q, k, v: ``[batch, seq, heads, head_dim]`` (the layout of ``jax.nn.dot_product_attention``),
        all of one dtype: bfloat16, float16 or float32. ``causal`` needs ``q_len == kv_len``.
      causal: mask keys after the query position.
      stable: apply the paper's fix (Qiu & Yao 2025, Algorithm 1): in each key tile, a row whose
        maximum r_m is reached by ≥ 2 entries is shifted by β·r_m (r_m > 0) or 0 (r_m < 0) instead of
        r_m, so no P̄ = exp(S − m) is exactly 1 and Ō stops picking up V rows exactly. Exact in real
        arithmetic. Underflow guard: an offset (β − 1)·r_m above 20 nats is folded back into
        [10, 20) nats (varying with r_m: a constant offset would bias O), so tied entries keep
        P̄ ≥ e⁻²⁰; for finite inputs O and the gradients stay finite and accurate for any β and any
        score size (the authors' kernel collapses O towards 0 once (β − 1)·r_m ≳ 23). On tie-free
        inputs it performs the same operations as ``stable=False`` (bitwise equal up to a compiler
        fusing the two programs differently: an FP32 ulp, rarely a BF16 flip).
      beta: the paper's β (> 1); 2.0 follows the authors' current code, the paper's Figure 7 uses 7.
      sm_scale: score scale; ``None`` means 1/√head_dim.
      policy: where the roundings happen — "fa2" (production FA2 numerics, FP32 softmax state),
        "paper" (the authors' BF16-accumulating PyTorch kernel, 512-wide key tiles), "fp32" (the
        high-precision control, IEEE FP32 dots: slow on GPUs) or "fp32_bf16x6" (the same control
        with its dots from BF16 pieces on the tensor cores). See ``jax_flash.policy``.
      delta: the backward's δ — "o": rowsum(dO∘O) with the stored O (faithful FA2); "o_hp": from a
        high-precision O recomputed in FP32; "dpp": rowsum(dP∘P).
      impl: "pallas" (Triton kernels on GPU, interpret mode on CPU), "jnp" (the same algorithm in plain
        XLA: fast on CPU) or "auto" (Pallas on GPU, jnp elsewhere).
      block_q, block_k: tile sizes (powers of two ≥ 16). The key tile changes the numerics; the
        default is the policy's (64, or 512 for "paper").

    Returns:
      O, ``[batch, q_len, heads, head_dim]`` in q's dtype. Differentiable (``jax.custom_vjp``);
      composes with ``jit``, ``grad``, ``vjp`` and ``vmap``. Rows never mix across batch elements or
      heads, so a NaN in one batch element stays there.
    """
    cfg, impl = _make_config(q, k, v, causal=causal, stable=stable, beta=beta, sm_scale=sm_scale,
                             policy=policy, delta=delta, impl=impl, block_q=block_q,
                             block_k=block_k)
    return _attention(q, k, v, cfg, impl)


# ------------------------------------------------------------------------------------------ checking
def _check_arrays(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 [batch, seq, heads, head_dim], got shape "
                             f"{tuple(x.shape)}")
        if not jnp.issubdtype(x.dtype, jnp.floating) or np.dtype(x.dtype).itemsize > 4 or \
                np.dtype(x.dtype) not in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16),
                                          np.dtype(jnp.float32)):
            raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if not (q.shape[2] == k.shape[2] == v.shape[2]):
        raise ValueError(f"head counts differ: q {q.shape[2]}, k {k.shape[2]}, v {v.shape[2]}")
    if not (q.shape[3] == k.shape[3] == v.shape[3]):
        raise ValueError(f"head_dim differs: q {q.shape[3]}, k {k.shape[3]}, v {v.shape[3]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v sequence lengths differ: {k.shape[1]} vs {v.shape[1]}")
    if q.shape[1] == 0 or k.shape[1] == 0:
        raise ValueError(f"empty sequence: q_len {q.shape[1]}, kv_len {k.shape[1]}")
    if q.shape[3] not in HEAD_DIMS:
        raise ValueError(f"unsupported head_dim {q.shape[3]}; supported: {HEAD_DIMS}")


def _pow2_at_least(n: int) -> int:
    return max(MIN_BLOCK, 1 << (max(n, 1) - 1).bit_length())


def _block(requested, default, length, name):
    if requested is None:
        return min(default, _pow2_at_least(length))
    if not isinstance(requested, (int, np.integer)) or requested < MIN_BLOCK or \
            requested & (requested - 1):
        raise ValueError(f"{name} must be a power of two >= {MIN_BLOCK}, got {requested!r}")
    return int(requested)


def _make_config(q, k, v, *, causal, stable, beta, sm_scale, policy, delta, impl, block_q, block_k):
    _check_arrays(q, k, v)
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
    if delta not in DELTAS:
        raise ValueError(f"unknown delta {delta!r}; expected one of {DELTAS}")
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    if not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta <= 1:
        raise ValueError(f"beta must be a finite number > 1, got {beta!r}")
    q_len, kv_len, head_dim = q.shape[1], k.shape[1], q.shape[3]
    if causal and q_len != kv_len:
        raise ValueError(f"causal attention needs q_len == kv_len, got {q_len} and {kv_len}; "
                         "use causal=False for cross-attention")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    if not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be a finite number > 0, got {sm_scale!r}")
    pol = make_policy(policy, q.dtype)
    auto = impl == "auto"
    if auto:
        impl = "pallas" if jax.default_backend() == "gpu" else "jnp"
    # Tuned tiles and launch parameters for the GPU kernels (pallas/tuning.json), where measured.
    tuned = tuning.lookup(policy, head_dim, kv_len, bool(causal)) \
        if impl == "pallas" and jax.default_backend() == "gpu" else {}
    launch = {p: (tuned[p]["num_warps"], tuned[p]["num_stages"]) for p in ("fwd", "bwd", "dq")
              if p in tuned}
    cfg = Config(policy=pol, causal=bool(causal), stable=bool(stable), beta=float(beta),
                 sm_scale=float(sm_scale), delta=delta,
                 block_q=_block(block_q, tuned.get("block_q", pol.block_q), q_len, "block_q"),
                 block_k=_block(block_k, tuned.get("block_k", pol.block_k), kv_len, "block_k"),
                 q_len=q_len, kv_len=kv_len, fwd_launch=launch.get("fwd"),
                 bwd_launch=launch.get("bwd"), split_diagonal=bool(tuned.get("split_diagonal")),
                 bwd_block=tuned.get("bwd_block"), dq_launch=launch.get("dq"),
                 dq_block=tuned.get("dq_block"), prefetch_rows=bool(tuned.get("prefetch_rows")),
                 prefetch_scores=bool(tuned.get("prefetch_scores")),
                 fwd_kernel=tuned.get("fwd_kernel", "triton"),
                 bwd_kernel=tuned.get("bwd_kernel", "triton"),
                 tie_count_int=bool(tuned.get("tie_count_int")),
                 shift_factor=bool(tuned.get("shift_factor")),
                 tie_top2=bool(tuned.get("tie_top2")),
                 exp2_ftz=bool(tuned.get("exp2_ftz")),
                 scale_late=bool(tuned.get("scale_late")))
    if impl == "pallas" and jax.default_backend() == "gpu" and \
            2 * cfg.block_k * head_dim * pol.operand_dtype.itemsize > MAX_KV_TILE_BYTES:
        # K and V tiles must both fit in shared memory (H200: 227 KiB per block).
        if not auto:
            raise ValueError(
                f"block_k={cfg.block_k} with head_dim={head_dim} needs K+V tiles larger than the GPU's "
                f"shared memory; use a smaller block_k (numerics change with it) or impl='jnp'")
        impl = "jnp"
    return cfg, impl


# ------------------------------------------------------------------------------------------ dispatch
def _pad(x, block):
    extra = -x.shape[1] % block
    if extra == 0:
        return x
    return jnp.pad(x, ((0, 0), (0, extra), (0, 0), (0, 0)))


def _forward(q, k, v, cfg: Config, impl: str):
    """(O in q's dtype, O residual, L) on unpadded inputs."""
    qp, kp, vp = _pad(q, cfg.block_q), _pad(k, cfg.block_k), _pad(v, cfg.block_k)
    res_dtype = cfg.policy.o_residual_dtype
    if impl == "pallas":
        o_res, lse = pallas.forward(qp, kp, vp, cfg, o_dtype=res_dtype)
    else:
        o, lse = jnp_impl.forward(qp, kp, vp, cfg)
        o_res = cast_rounded(o, res_dtype)  # an XLA-proof rounding: δ must see the stored O
    o_res = o_res[:, : cfg.q_len]
    return o_res.astype(q.dtype), o_res, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention(q, k, v, cfg: Config, impl: str):
    return _forward(q, k, v, cfg, impl)[0]


def _attention_fwd(q, k, v, cfg, impl):
    o, o_res, lse = _forward(q, k, v, cfg, impl)
    return o, (q, k, v, o_res, lse)


def _attention_bwd(cfg, impl, res, do):
    q, k, v, o_res, lse = res
    qp, kp, vp = _pad(q, cfg.block_q), _pad(k, cfg.block_k), _pad(v, cfg.block_k)
    dop, op = _pad(do, cfg.block_q), _pad(o_res, cfg.block_q)
    ex = pallas if impl == "pallas" else jnp_impl
    dlt = ex.delta(qp, kp, vp, op, dop, lse, cfg)
    dq, dk, dv = ex.backward(qp, kp, vp, dop, lse, dlt, cfg, out_dtype=q.dtype)  # q, k, v: one dtype
    return dq[:, : cfg.q_len], dk[:, : cfg.kv_len], dv[:, : cfg.kv_len]


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention_with_lse(q, k, v, **kwargs):
    """``attention`` plus the saved L = m + log ℓ ``[batch, heads, q_len]`` in natural-log units.

    Not differentiable; for diagnostics and tests of the forward state.
    """
    impl = kwargs.pop("impl", "auto")
    cfg, impl = _make_config(q, k, v, impl=impl, **{**_DEFAULTS, **kwargs})
    o, _, lse = _forward(q, k, v, cfg, impl)
    if cfg.policy.log2_units:
        lse = lse / math.log2(math.e)
    return o, lse[:, :, : cfg.q_len]


_DEFAULTS = dict(causal=True, stable=False, beta=2.0, sm_scale=None, policy="fa2", delta="o",
                 block_q=None, block_k=None)
