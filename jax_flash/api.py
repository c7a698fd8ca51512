"""The public entry points: argument checking, the plan (numerics and launch), dispatch, custom_vjp."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from . import jnp_impl, pallas
from .pallas import backward_mosaic, forward_mosaic, mosaic_common, tuning
from .policy import POLICIES, make_policy
from .rounding import cast_rounded
from .spec import Launch, Numerics, Plan, default_scale_late, default_tiles

DELTAS = ("o", "o_hp", "dpp")
IMPLS = ("auto", "pallas", "jnp")
HEAD_DIMS = (16, 32, 64, 128, 256)
MIN_BLOCK = 16  # Triton's smallest dot tile
# Largest K+V tile pair the Triton kernels stage in shared memory (the "paper" policy's 512-wide key
# tiles at head_dim 128 need 256 KiB: impl="auto" runs those on the jnp executor instead).
MAX_KV_TILE_BYTES = 160 * 1024
_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))


def attention(q, k, v, *, causal=True, stable=False, beta=2.0, sm_scale=None, policy="fa2",
              delta="o", impl="auto", block_q=None, block_k=None, launch=None):
    """Flash attention with a choice of numerics, optionally with the paper's stable softmax shift.

    Args:
      q, k, v: ``[batch, seq, heads, head_dim]`` (the layout of ``jax.nn.dot_product_attention``),
        all of one dtype: bfloat16, float16 or float32. ``causal`` needs ``q_len == kv_len``.
      causal: mask keys after the query position.
      stable: apply the stable softmax shift of Qiu & Yao (arXiv 2510.04212, Algorithm 1): in each key
        tile, a row whose maximum r_m is reached by ≥ 2 entries is shifted by β·r_m (r_m > 0) or 0
        (r_m < 0) instead of r_m, so no P̄ = exp(S − m) is exactly 1. Exact in real arithmetic. An
        offset (β − 1)·r_m above 20 nats is folded back into [10, 20) nats (varying with r_m: a
        constant offset would bias O), so O and the gradients stay finite and accurate for any β and
        score size. On tie-free rows it performs the same operations as ``stable=False``.
      beta: the paper's β (> 1).
      sm_scale: score scale; ``None`` means 1/√head_dim.
      policy: where the roundings happen — "fa2" (production FA2 numerics, FP32 softmax state),
        "paper" (the authors' BF16-accumulating kernel, 512-wide key tiles), "fp32" (the
        high-precision control) or "fp32_bf16x6" (the same control with its dots from BF16 pieces on
        the tensor cores). See ``jax_flash.policy``.
      delta: the backward's δ — "o": rowsum(dO∘O) with the stored O (faithful FA2); "o_hp": from a
        high-precision O recomputed in FP32; "dpp": rowsum(dP∘P).
      impl: "pallas" (the kernels; on CPU in Pallas interpret mode), "jnp" (the same algorithm in
        plain XLA: fast on CPU) or "auto" (Pallas on GPU, jnp elsewhere). Both compute the same
        numerics (``plan``).
      block_q, block_k: query and key tiles (powers of two ≥ 16; a tile longer than the sequence is
        cut to it). Both change the numerics: the key tile is the online softmax's, the query tile
        the block over which the backward sums dK and dV. Defaults: ``spec.default_tiles``.
      launch: how the GPU kernels run (``Launch`` or a dict of its fields); None: the tuning table's
        choice for this shape. No launch changes the numerics.

    Returns:
      O, ``[batch, q_len, heads, head_dim]`` in q's dtype. Differentiable (``jax.custom_vjp``);
      composes with ``jit``, ``grad``, ``vjp`` and ``vmap``. Rows never mix across batch elements or
      heads, so a NaN in one batch element stays there.
    """
    p = plan(q, k, v, causal=causal, stable=stable, beta=beta, sm_scale=sm_scale, policy=policy,
             delta=delta, impl=impl, block_q=block_q, block_k=block_k, launch=launch)
    if _empty(q):
        return jnp.zeros(q.shape, q.dtype)
    return _attention(q, k, v, p.numerics, p.launch, p.executor)


def attention_with_lse(q, k, v, **kwargs):
    """``attention`` plus the saved L = m + log ℓ ``[batch, heads, q_len]`` in natural-log units.

    Not differentiable; for diagnostics and tests of the forward state.
    """
    p = plan(q, k, v, **kwargs)
    o, _, lse = _forward(q, k, v, p.numerics, p.launch, p.executor)
    if p.numerics.policy.log2_units:
        lse = lse / math.log2(math.e)
    return o, lse[:, :, : p.numerics.q_len]


# ------------------------------------------------------------------------------------------ the plan
def plan(q, k, v, *, causal=True, stable=False, beta=2.0, sm_scale=None, policy="fa2", delta="o",
         impl="auto", block_q=None, block_k=None, launch=None) -> Plan:
    """What ``attention`` computes for these arguments and how it runs it: ``Plan(numerics, launch,
    executor)``. ``q, k, v`` may be arrays or ``jax.ShapeDtypeStruct``s. ``numerics`` depends on the
    arguments alone (the same on every device and executor); ``launch`` is the tuning table's (or
    the given) choice on this machine, with kernels that cannot run the call replaced by the
    Triton ones; ``executor`` is "pallas" or "jnp". ``plan(...).to_dict()`` is a JSON record."""
    _check_arrays(q, k, v)
    causal, stable = _flag(causal, "causal"), _flag(stable, "stable")
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
    if delta not in DELTAS:
        raise ValueError(f"unknown delta {delta!r}; expected one of {DELTAS}")
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    beta = _number(beta, "beta", lower=1.0)
    q_len, kv_len, head_dim = q.shape[1], k.shape[1], q.shape[3]
    if causal and q_len != kv_len:
        raise ValueError(f"causal attention needs q_len == kv_len, got {q_len} and {kv_len}; "
                         "use causal=False for cross-attention")
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else _number(sm_scale, "sm_scale")
    pol = make_policy(policy, q.dtype)
    default_q, default_k = default_tiles(policy, head_dim)
    num = Numerics(policy=pol, causal=causal, stable=stable, beta=beta, sm_scale=sm_scale,
                   delta=delta, block_q=_block(block_q, default_q, q_len, "block_q"),
                   block_k=_block(block_k, default_k, kv_len, "block_k"), q_len=q_len,
                   kv_len=kv_len, scale_late=default_scale_late(pol, head_dim))
    on_gpu = jax.default_backend() == "gpu"
    auto = impl == "auto"
    executor = ("pallas" if on_gpu else "jnp") if auto else impl
    if executor == "pallas" and on_gpu and \
            2 * num.block_k * head_dim * pol.operand_dtype.itemsize > MAX_KV_TILE_BYTES:
        # K and V tiles must both fit in shared memory (H200: 227 KiB per block)
        if not auto:
            raise ValueError(
                f"block_k={num.block_k} with head_dim={head_dim} needs K+V tiles larger than the "
                "GPU's shared memory; use a smaller block_k (numerics change with it) or impl='jnp'")
        executor = "jnp"
    if executor == "jnp":
        if launch is not None:
            _as_launch(launch)  # still checked: a typo must not pass silently
        return Plan(num, Launch(), executor)
    explicit = launch is not None
    lnch = _as_launch(launch) if explicit else \
        tuning.lookup(policy, head_dim, kv_len, causal) if on_gpu else Launch()
    return Plan(num, _covered(lnch, num, q, k, explicit), executor)


def _as_launch(launch) -> Launch:
    if isinstance(launch, Launch):
        return launch
    if isinstance(launch, dict):
        return Launch.from_dict(launch)
    raise TypeError(f"launch must be a jax_flash.Launch or a dict of its fields, got "
                    f"{type(launch).__name__}")


def _covered(launch: Launch, num: Numerics, q, k, explicit: bool) -> Launch:
    """``launch`` with the Mosaic GPU kernels replaced by the Triton ones where they cannot run this
    call; where the caller asked for them, that raises instead."""
    padded = (q.shape[0], _round_up(num.q_len, num.block_q), q.shape[2], q.shape[3])
    k_padded = (k.shape[0], _round_up(num.kv_len, num.block_k), k.shape[2], k.shape[3])
    reasons = {}
    if launch.fwd_kernel == "mosaic":
        reasons["fwd_kernel"] = mosaic_common.unavailable() or forward_mosaic.check(
            num, padded, q.dtype, num.policy.o_residual_dtype)
    if launch.bwd_kernel != "triton":
        reasons["bwd_kernel"] = mosaic_common.unavailable() or backward_mosaic.check(
            num, padded, q.dtype, q.dtype, k_padded)
    reasons = {f: r for f, r in reasons.items() if r is not None}
    if reasons and explicit:
        raise ValueError("the Mosaic GPU kernels cannot run this call: " + "; ".join(
            f"{f}={getattr(launch, f)!r}: {r}" for f, r in reasons.items()))
    if reasons:
        launch = dataclasses.replace(launch, **{f: "triton" for f in reasons})
    return launch


def _round_up(n: int, b: int) -> int:
    return -(-n // b) * b


# ------------------------------------------------------------------------------------------ checking
def _check_arrays(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if len(x.shape) != 4:
            raise ValueError(f"{name} must have rank 4 [batch, seq, heads, head_dim], got shape "
                             f"{tuple(x.shape)}")
        if np.dtype(x.dtype) not in _DTYPES:
            hint = " (cast to float32: the 'fp32' policy is the high-precision control)" \
                if np.dtype(x.dtype) == np.dtype(np.float64) else ""
            raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}{hint}")
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
    if k.shape[1] == 0:
        raise ValueError("kv_len is 0: softmax over no keys is undefined")
    if q.shape[3] not in HEAD_DIMS:
        raise ValueError(f"unsupported head_dim {q.shape[3]}; supported: {HEAD_DIMS}")


def _empty(q) -> bool:
    """Nothing to compute (batch, heads or q_len of 0): the result is an empty array."""
    return 0 in (q.shape[0], q.shape[1], q.shape[2])


def _flag(value, name: str) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r}")


def _number(value, name: str, lower: float = 0.0) -> float:
    """A static finite number > ``lower`` (Python, NumPy or concrete JAX scalar) as a float."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"{name} must be a static Python number, not a traced value (it is baked "
                        "into the kernels): pass it outside jit or mark it static")
    if isinstance(value, (bool, np.bool_)) or not (
            isinstance(value, numbers.Real) or (hasattr(value, "shape") and np.shape(value) == ())):
        raise TypeError(f"{name} must be a number, got {value!r}")
    out = float(value)
    if not math.isfinite(out) or out <= lower:
        raise ValueError(f"{name} must be a finite number > {lower:g}, got {out!r}")
    return out


def _pow2_at_least(n: int) -> int:
    return max(MIN_BLOCK, 1 << (max(n, 1) - 1).bit_length())


def _block(requested, default, length, name):
    if requested is None:
        return min(default, _pow2_at_least(length))
    if isinstance(requested, (bool, np.bool_)) or not isinstance(requested, (int, np.integer)) or \
            requested < MIN_BLOCK or requested & (requested - 1):
        raise ValueError(f"{name} must be a power of two >= {MIN_BLOCK}, got {requested!r}")
    return min(int(requested), _pow2_at_least(length))


# ------------------------------------------------------------------------------------------ dispatch
def _pad(x, block):
    extra = -x.shape[1] % block
    if extra == 0:
        return x
    return jnp.pad(x, ((0, 0), (0, extra), (0, 0), (0, 0)))


def _forward(q, k, v, cfg: Numerics, launch: Launch, executor: str):
    """(O in q's dtype, O residual, L) on unpadded inputs."""
    qp, kp, vp = _pad(q, cfg.block_q), _pad(k, cfg.block_k), _pad(v, cfg.block_k)
    res_dtype = cfg.policy.o_residual_dtype
    if executor == "pallas":
        o_res, lse = pallas.forward(qp, kp, vp, cfg, launch, o_dtype=res_dtype)
    else:
        o, lse = jnp_impl.forward(qp, kp, vp, cfg)
        o_res = cast_rounded(o, res_dtype)  # an XLA-proof rounding: δ must see the stored O
    o_res = o_res[:, : cfg.q_len]
    return o_res.astype(q.dtype), o_res, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(q, k, v, cfg: Numerics, launch: Launch, executor: str):
    return _forward(q, k, v, cfg, launch, executor)[0]


def _attention_fwd(q, k, v, cfg, launch, executor):
    o, o_res, lse = _forward(q, k, v, cfg, launch, executor)
    return o, (q, k, v, o_res, lse)


def _attention_bwd(cfg, launch, executor, res, do):
    q, k, v, o_res, lse = res
    qp, kp, vp = _pad(q, cfg.block_q), _pad(k, cfg.block_k), _pad(v, cfg.block_k)
    dop, op = _pad(do, cfg.block_q), _pad(o_res, cfg.block_q)
    if executor == "pallas":
        dlt = pallas.delta(qp, kp, vp, op, dop, lse, cfg, launch)
        dq, dk, dv = pallas.backward(qp, kp, vp, dop, lse, dlt, cfg, launch, out_dtype=q.dtype)
    else:
        dlt = jnp_impl.delta(qp, kp, vp, op, dop, lse, cfg)
        dq, dk, dv = jnp_impl.backward(qp, kp, vp, dop, lse, dlt, cfg, out_dtype=q.dtype)
    return dq[:, : cfg.q_len], dk[:, : cfg.kv_len], dv[:, : cfg.kv_len]


_attention.defvjp(_attention_fwd, _attention_bwd)
