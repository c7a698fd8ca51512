"""The public entry points: argument checking, the plan (numerics and launch), dispatch, custom_vjp."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from . import jnp_impl, pallas, tile
from .jnp_impl import Extras
from .pallas import backward_mosaic, forward_mosaic, mosaic_common, tuning
from .policy import POLICIES, make_policy
from .rounding import cast_rounded
from .spec import Launch, Numerics, Plan, default_scale_late, default_tiles

DELTAS = ("o", "o_hp", "dpp")
IMPLS = ("auto", "pallas", "jnp")
# head dims the Pallas kernels take; other head dims run there zero-padded to the next one (zero
# columns add exact zeros to q·k and to dO·v, and the padded output columns are sliced off). The
# jnp executor takes any head_dim.
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
        all of one dtype: bfloat16, float16 or float32. ``causal`` needs ``q_len == kv_len``. k and v
        may have fewer heads, a divisor of q's (GQA/MQA: query head h reads key/value head
        h // (q_heads // kv_heads)). Any head_dim (see ``HEAD_DIMS``). For masks, bias, per-batch
        lengths, windows and ``jax.nn``'s defaults see ``dot_product_attention``.
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


def attention_qkvpacked(qkv, **kwargs):
    """``attention`` of Q, K and V packed side by side: ``qkv`` ``[batch, seq, 3, heads, head_dim]``
    (q, k, v = ``qkv[:, :, 0]``, ``[:, :, 1]``, ``[:, :, 2]``), e.g. one projection's output
    ``[batch, seq, 3·heads·head_dim]`` reshaped. The keywords, numerics and result of
    ``attention(q, k, v, **kwargs)``; the gradient is one array of qkv's shape.

    Where the Triton kernels run the call (head_dim one of ``HEAD_DIMS``, the sequence a whole
    number of tiles), they read Q, K and V in place and write dQ, dK and dV into one buffer: no
    copies to slice the three apart or to join their gradients. Otherwise the three are sliced and
    ``attention`` runs them."""
    if not hasattr(qkv, "shape") or len(qkv.shape) != 5 or qkv.shape[2] != 3:
        raise ValueError("qkv must have shape [batch, seq, 3, heads, head_dim], got "
                         f"{getattr(qkv, 'shape', type(qkv).__name__)}")
    b, t, _, h, d = qkv.shape
    one = jax.ShapeDtypeStruct((b, t, h, d), qkv.dtype)
    p = plan(one, one, one, **kwargs)
    if _empty(one):
        return jnp.zeros(one.shape, qkv.dtype)
    num, lnch = p.numerics, p.launch
    if (p.executor == "pallas" and kernel_head_dim(d) == d and t % num.block_q == 0
            and t % num.block_k == 0 and lnch.fwd_kernel == "triton"
            and lnch.bwd_kernel == "triton"):
        return _attention_packed(qkv, num, lnch)
    return _attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], num, lnch, p.executor)


def attention_with_lse(q, k, v, **kwargs):
    """``attention`` plus the saved L = m + log ℓ ``[batch, heads, q_len]`` in natural-log units.

    Not differentiable; for diagnostics and tests of the forward state.
    """
    p = plan(q, k, v, **kwargs)
    o, _, lse = _forward(q, k, v, p.numerics, p.launch, p.executor)
    if p.numerics.policy.log2_units:
        lse = lse / math.log2(math.e)
    return o, lse[:, :, : p.numerics.q_len]


# --------------------------------------------------------------------- jax.nn.dot_product_attention
IMPLEMENTATIONS = (None, "pallas", "jnp")


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size=None, implementation=None, stable=False, beta=2.0,
                          policy="fa2", delta="o", block_q=None, block_k=None, launch=None):
    """``jax.nn.dot_product_attention`` with jax-flash's numerics: the same arguments and results.

    Shapes as in ``jax.nn``: B batch, T query length, S key length, N query heads, K key/value
    heads (N a multiple of K: GQA; K = 1: MQA; never repeated in memory), H head_dim (any).

    Args:
      query: ``[B, T, N, H]`` or ``[T, N, H]``; key, value: ``[B, S, K, H]`` or ``[S, K, H]``; one
        dtype: bfloat16, float16 or float32.
      bias: additive bias on the logits, broadcastable to ``[B, N, T, S]`` (rank ≤ 4, missing
        leading axes added); differentiable. Runs on the jnp executor.
      mask: boolean, True = attend, broadcastable like ``bias``. Runs on the jnp executor.
      scale: logit scale, a static number > 0; None: 1/√H.
      is_causal: query i attends to keys j ≤ i (top-left aligned when T ≠ S, as in ``jax.nn``:
        ``tril(ones((T, S)))``; for bottom-right alignment pass ``local_window_size=(S, S - T)``).
      query_seq_lengths, key_value_seq_lengths: integer ``[B]``: rows ≥ the query length of their
        batch element return 0 (and get no gradient), keys ≥ the key length are masked. Traced
        values are fine; the kernels skip the tiles past them.
      local_window_size: ``(left, right)`` or an int for ``(w, w)``: query i attends to keys
        i − left ≤ j ≤ i + right. Static ints; the kernels skip the tiles outside the window.
      implementation: None (the Pallas kernels on a GPU, the jnp executor elsewhere or for a dense
        mask/bias), "pallas" or "jnp" (the same numerics; ``dot_product_attention_plan`` says which
        runs and why). "xla" and "cudnn" belong to ``jax.nn`` and raise here.
      stable, beta, policy, delta: jax-flash's numerics, as in ``jax_flash.attention``.
      block_q, block_k, launch: tiles and GPU launch, as in ``jax_flash.attention``.

    Returns:
      The attention output, shaped like ``query``, in its dtype.

    Fully masked rows (every key masked for a query row inside its length) return the mean of V
    over all S keys, as ``jax.nn``'s XLA implementation does (its masked logits are all equal), and
    pass their gradient to V the same way. Deliberate differences from ``jax.nn``: ``scale`` must be
    static and positive; a row masked only through ``bias`` = −inf everywhere returns 0 (jax.nn:
    NaN); the numerics (policy, tiles, stable shift) are jax-flash's, so values agree with
    ``jax.nn``'s to the policy's accuracy, not bitwise; ``return_residual`` is not offered.
    """
    call = _dpa_call(query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths,
                     local_window_size, implementation)
    q, k, v, ex, window, impl, out_shape = call
    p = _dpa_plan(call, scale=scale, is_causal=is_causal, stable=stable, beta=beta, policy=policy,
                  delta=delta, block_q=block_q, block_k=block_k, launch=launch)
    if _empty(q):
        return jnp.zeros(out_shape, q.dtype)
    none = all(x is None for x in ex)
    o = _attention(q, k, v, p.numerics, p.launch, p.executor, None if none else ex)
    o = _fully_masked_rows(o, v, ex, p.numerics)
    return o.reshape(out_shape)


def dot_product_attention_plan(query, key, value, bias=None, mask=None, *, scale=None,
                               is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                               local_window_size=None, implementation=None, stable=False, beta=2.0,
                               policy="fa2", delta="o", block_q=None, block_k=None,
                               launch=None) -> Plan:
    """``plan`` for ``dot_product_attention``: the ``Plan`` it runs with these arguments (arrays or
    ``jax.ShapeDtypeStruct``s)."""
    call = _dpa_call(query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths,
                     local_window_size, implementation)
    return _dpa_plan(call, scale=scale, is_causal=is_causal, stable=stable, beta=beta,
                     policy=policy, delta=delta, block_q=block_q, block_k=block_k, launch=launch)


def _dpa_plan(call, *, scale, is_causal, **kw) -> Plan:
    q, k, v, ex, window, impl, _ = call
    return _plan(q, k, v, causal=_flag(is_causal, "is_causal"), sm_scale=scale, impl=impl,
                 window=window, seq_lengths=ex.q_lens is not None, mask=ex.mask is not None,
                 bias=ex.bias is not None, **kw)


def _rank4(x, name, ranks=(3, 4)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    if len(x.shape) not in ranks:
        raise ValueError(f"{name} must have rank {' or '.join(map(str, ranks))}, got shape "
                         f"{tuple(x.shape)}")
    return x if len(x.shape) == 4 else _reshape(x, (1,) * (4 - len(x.shape)) + tuple(x.shape))


def _reshape(x, shape):
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(shape, x.dtype)
    return jnp.reshape(x, shape)


def _dpa_call(query, key, value, bias, mask, q_lens, kv_lens, window, implementation):
    """jax.nn's arguments checked and brought to the executors' form: (q, k, v as [B, T, N, H],
    Extras, window, impl, the output's shape)."""
    if implementation not in IMPLEMENTATIONS:
        hint = " (jax.nn's own implementations: call jax.nn.dot_product_attention)" \
            if implementation in ("xla", "cudnn") else ""
        raise ValueError(f"implementation {implementation!r}: expected None, 'pallas' or 'jnp'"
                         + hint)
    impl = "auto" if implementation is None else implementation
    out_shape = tuple(query.shape)
    q, k, v = (_rank4(x, name) for x, name in ((query, "query"), (key, "key"), (value, "value")))
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"key and value shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"query shape {tuple(q.shape)} does not match key shape "
                         f"{tuple(k.shape)} in batch or head_dim")
    _check_arrays(q, k, v)
    b, t, n, _ = q.shape
    s = k.shape[1]
    full = (b, n, t, s)
    dense = {}
    for name, x in (("mask", mask), ("bias", bias)):
        if x is None:
            continue
        x = _rank4(x, name, ranks=(0, 1, 2, 3, 4))
        if name == "mask" and np.dtype(x.dtype) != np.dtype(bool):
            raise ValueError(f"mask must be boolean (True = attend), got {x.dtype}; pass an "
                             "additive mask as bias")
        if name == "bias" and not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"bias must be a float array, got {x.dtype}")
        if any(m not in (1, f) for m, f in zip(x.shape, full)):
            raise ValueError(f"{name} shape {tuple(x.shape)} does not broadcast to [B, N, T, S] = "
                             f"{full}")
        dense[name] = x
    lens = []
    for name, x, top in (("query_seq_lengths", q_lens, t), ("key_value_seq_lengths", kv_lens, s)):
        if x is None:
            lens.append(None)
            continue
        x = x if hasattr(x, "dtype") else jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.integer) or tuple(x.shape) != (b,):
            raise ValueError(f"{name} must be an integer array of shape ({b},), got {x.dtype} "
                             f"{tuple(x.shape)}")
        # jax.nn masks index ≥ length: lengths past the array mean all of it, below 0 none
        lens.append(x if isinstance(x, jax.ShapeDtypeStruct) else
                    jnp.clip(x.astype(jnp.int32), 0, top))
    if (lens[0] is None) != (lens[1] is None):  # the kernels take both: the other is the full one
        i = 0 if lens[0] is None else 1
        lens[i] = jnp.full((b,), (t, s)[i], jnp.int32)
    if window is not None:
        if isinstance(window, (bool, np.bool_)):
            raise TypeError(f"local_window_size must be an int or (left, right), got {window!r}")
        if isinstance(window, (int, np.integer)):
            window = (window, window)
        if not isinstance(window, (tuple, list)) or len(window) != 2 or not all(isinstance(w, (int, np.integer)) and
                                       not isinstance(w, (bool, np.bool_)) for w in window):
            raise TypeError(f"local_window_size must be an int or (left, right) ints, got "
                            f"{window!r}")
        window = (int(window[0]), int(window[1]))
    ex = Extras(lens[0], lens[1], dense.get("mask"), dense.get("bias"))
    return q, k, v, ex, window, impl, out_shape


def _fully_masked_rows(o, v, ex: Extras, cfg: Numerics):
    """jax.nn's value for query rows (inside their length) that see no key: the mean of V over all
    keys, per key/value head. The executors return 0 there; this replaces it (and routes the
    gradient to V as jax.nn's uniform weights do). Rows past a query length stay 0."""
    b, t, n, d = o.shape
    s = v.shape[1]
    rows = np.arange(t)[:, None]
    cols = np.arange(s)[None, :]
    visible = np.ones((t, s), bool)
    if cfg.causal:
        visible &= cols <= rows
    if cfg.window is not None:
        left, right = cfg.window
        visible &= (cols >= rows - left) & (cols <= rows + right)
    if ex.mask is None and ex.kv_lens is None:
        empty = ~visible.any(axis=1)  # [T], known at trace time
        if not empty.any():
            return o
        empty = jnp.asarray(empty)[None, :, None]
    elif ex.mask is None:
        # each row's visible keys are an interval [lo, hi]: empty if none of them is < kv_len
        lo = np.where(visible.any(axis=1), visible.argmax(axis=1), s)
        empty = (~visible.any(axis=1))[None, :] | (lo[None, :] >= ex.kv_lens[:, None])
        empty = empty[:, :, None]
    else:
        seen = ex.mask & jnp.asarray(visible)
        if ex.kv_lens is not None:
            seen = seen & (jnp.arange(s)[None, None, None, :] < ex.kv_lens[:, None, None, None])
        empty = ~jnp.any(seen, axis=3).transpose(0, 2, 1)  # [B|1, T, N|1]
    if ex.q_lens is not None:
        empty = empty & (jnp.arange(t)[None, :, None] < ex.q_lens[:, None, None])
    hk = v.shape[2]
    mean_v = jnp.mean(v.astype(jnp.float32), axis=1).astype(o.dtype)  # [B, K, H]
    o = o.reshape(b, t, hk, n // hk, d)
    empty = jnp.broadcast_to(empty, (empty.shape[0], t, n)).reshape(-1, t, hk, n // hk, 1)
    return jnp.where(empty, mean_v[:, None, :, None, :], o).reshape(b, t, n, d)


# ------------------------------------------------------------------------------------------ the plan
def plan(q, k, v, *, causal=True, stable=False, beta=2.0, sm_scale=None, policy="fa2", delta="o",
         impl="auto", block_q=None, block_k=None, launch=None) -> Plan:
    """What ``attention`` computes for these arguments and how it runs it: ``Plan(numerics, launch,
    executor, notes)``. ``q, k, v`` may be arrays or ``jax.ShapeDtypeStruct``s. ``numerics`` depends
    on the arguments alone (the same on every device and executor); ``launch`` is the tuning table's
    (or the given) choice on this machine, with kernels that cannot run the call replaced by the
    Triton ones; ``executor`` is "pallas" or "jnp"; ``notes`` says what was substituted and why.
    ``plan(...).to_dict()`` is a JSON record. (``dot_product_attention_plan``: the same for
    ``dot_product_attention``.)"""
    _check_arrays(q, k, v)
    causal = _flag(causal, "causal")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal attention needs q_len == kv_len, got {q.shape[1]} and "
                         f"{k.shape[1]}; use causal=False for cross-attention, or "
                         "jax_flash.dot_product_attention(..., is_causal=True) for jax.nn's "
                         "top-left alignment")
    return _plan(q, k, v, causal=causal, stable=stable, beta=beta, sm_scale=sm_scale,
                 policy=policy, delta=delta, impl=impl, block_q=block_q, block_k=block_k,
                 launch=launch)


def kernel_head_dim(head_dim: int) -> int | None:
    """The head_dim the Pallas kernels run ``head_dim`` at (zero-padded up to it); None above 256."""
    return next((d for d in HEAD_DIMS if d >= head_dim), None)


def _plan(q, k, v, *, causal, stable, beta, sm_scale, policy, delta, impl, block_q, block_k,
          launch, window=None, seq_lengths=False, mask=False, bias=False) -> Plan:
    """The plan of a call whose arrays ``_check_arrays`` accepted (see ``plan``)."""
    stable = _flag(stable, "stable")
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
    if delta not in DELTAS:
        raise ValueError(f"unknown delta {delta!r}; expected one of {DELTAS}")
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    beta = _number(beta, "beta", lower=1.0)
    q_len, kv_len, head_dim = q.shape[1], k.shape[1], q.shape[3]
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else _number(sm_scale, "sm_scale")
    pol = make_policy(policy, q.dtype)
    default_q, default_k = default_tiles(policy, head_dim)
    num = Numerics(policy=pol, causal=causal, stable=stable, beta=beta, sm_scale=sm_scale,
                   delta=delta, block_q=_block(block_q, default_q, q_len, "block_q"),
                   block_k=_block(block_k, default_k, kv_len, "block_k"), q_len=q_len,
                   kv_len=kv_len, scale_late=default_scale_late(pol, head_dim) and not bias,
                   window=window, seq_lengths=seq_lengths, mask=mask, bias=bias,
                   groups=q.shape[2] // k.shape[2] if k.shape[2] else 1)
    on_gpu = jax.default_backend() == "gpu"
    kernel_d = kernel_head_dim(head_dim)
    dense = [name for name, on in (("mask", mask), ("bias", bias)) if on]
    notes = []
    if impl == "pallas":
        if dense:
            raise ValueError(
                f"a dense {' and '.join(dense)} runs on the jnp executor only (the kernels take "
                "causal masks, windows and per-batch lengths): use implementation=None or 'jnp', "
                "or express it as is_causal / local_window_size / the seq_lengths arguments")
        if kernel_d is None:
            raise ValueError(f"head_dim {head_dim} exceeds the kernels' largest, {HEAD_DIMS[-1]}: "
                             "use the jnp executor")
        executor = "pallas"
    elif impl == "jnp":
        executor = "jnp"
    elif not on_gpu:
        executor = "jnp"
    elif dense:
        executor = "jnp"
        notes.append(f"jnp executor: a dense {' and '.join(dense)} (the kernels take causal, "
                     "windows and lengths only)")
    elif kernel_d is None:
        executor = "jnp"
        notes.append(f"jnp executor: head_dim {head_dim} exceeds the kernels' {HEAD_DIMS[-1]}")
    else:
        executor = "pallas"
    if executor == "pallas" and on_gpu and \
            2 * num.block_k * kernel_d * pol.operand_dtype.itemsize > MAX_KV_TILE_BYTES:
        # K and V tiles must both fit in shared memory (H200: 227 KiB per block)
        if impl != "auto":
            raise ValueError(
                f"block_k={num.block_k} with head_dim={head_dim} needs K+V tiles larger than the "
                "GPU's shared memory; use a smaller block_k (numerics change with it) or impl='jnp'")
        executor = "jnp"
        notes.append(f"jnp executor: K and V tiles of {num.block_k} keys exceed shared memory")
    if executor == "jnp":
        if launch is not None:
            _as_launch(launch)  # still checked: a typo must not pass silently
        return Plan(num, Launch(), executor, tuple(notes))
    if kernel_d != head_dim:
        notes.append(f"head_dim {head_dim} runs zero-padded to {kernel_d} in the kernels "
                     "(the same values)")
    explicit = launch is not None
    lnch = _as_launch(launch) if explicit else Launch()
    if not explicit and on_gpu:
        entry, lnch = tuning.lookup_entry(policy, kernel_d, kv_len, causal)
        own = tuning.key(policy, kernel_d, kv_len, causal)
        if entry is not None and entry != own:
            notes.append(f"launch: tuning entry {entry} (none measured at {own})")
    lnch, why = _covered(lnch, num, q, k, explicit, kernel_d, head_dim)
    return Plan(num, lnch, executor, tuple(notes + why))


def _as_launch(launch) -> Launch:
    if isinstance(launch, Launch):
        return launch
    if isinstance(launch, dict):
        return Launch.from_dict(launch)
    raise TypeError(f"launch must be a jax_flash.Launch or a dict of its fields, got "
                    f"{type(launch).__name__}")


def _covered(launch: Launch, num: Numerics, q, k, explicit: bool, kernel_d: int, head_dim: int):
    """(``launch`` with the Mosaic GPU kernels replaced by the Triton ones where they cannot run
    this call, the notes saying so); where the caller asked for them, that raises instead."""
    padded = (q.shape[0], _round_up(num.q_len, num.block_q), q.shape[2], kernel_d)
    k_padded = (k.shape[0], _round_up(num.kv_len, num.block_k), k.shape[2], kernel_d)
    padded_d = f"head_dim {head_dim} (zero-padded)" if kernel_d != head_dim else None
    reasons = {}
    if launch.fwd_kernel == "mosaic":
        reasons["fwd_kernel"] = mosaic_common.unavailable() or padded_d or forward_mosaic.check(
            num, padded, q.dtype, num.policy.o_residual_dtype)
    if launch.bwd_kernel != "triton":
        reasons["bwd_kernel"] = mosaic_common.unavailable() or padded_d or backward_mosaic.check(
            num, padded, q.dtype, q.dtype, k_padded)
    reasons = {f: r for f, r in reasons.items() if r is not None}
    if reasons and explicit:
        raise ValueError("the Mosaic GPU kernels cannot run this call: " + "; ".join(
            f"{f}={getattr(launch, f)!r}: {r}" for f, r in reasons.items()))
    notes = [f"{f}: triton for {getattr(launch, f)} ({r})" for f, r in reasons.items()]
    if reasons:
        launch = dataclasses.replace(launch, **{f: "triton" for f in reasons})
    return launch, notes


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
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v head counts differ: {k.shape[2]} vs {v.shape[2]}")
    if (k.shape[2] == 0 and q.shape[2] != 0) or (k.shape[2] and q.shape[2] % k.shape[2]):
        raise ValueError(f"q's head count must be a multiple of k's and v's (GQA/MQA), got q "
                         f"{q.shape[2]}, k {k.shape[2]}")
    if not (q.shape[3] == k.shape[3] == v.shape[3]):
        raise ValueError(f"head_dim differs: q {q.shape[3]}, k {k.shape[3]}, v {v.shape[3]}")
    if q.shape[3] == 0:
        raise ValueError("head_dim is 0")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v sequence lengths differ: {k.shape[1]} vs {v.shape[1]}")
    if k.shape[1] == 0:
        raise ValueError("kv_len is 0: softmax over no keys is undefined")


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


def _pad_d(x, d):
    """Zero columns up to head_dim ``d`` (the kernels' head dims)."""
    extra = d - x.shape[3]
    return x if extra == 0 else jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, extra)))


def _lengths(ex: Extras | None, cfg: Numerics):
    return (ex.q_lens, ex.kv_lens) if cfg.seq_lengths else None


def _forward(q, k, v, cfg: Numerics, launch: Launch, executor: str, ex: Extras | None = None):
    """(O in q's dtype, O residual, L) on unpadded inputs."""
    qp, kp, vp = _pad(q, cfg.block_q), _pad(k, cfg.block_k), _pad(v, cfg.block_k)
    res_dtype = cfg.policy.o_residual_dtype
    if executor == "pallas":
        d, kd = q.shape[3], kernel_head_dim(q.shape[3])
        qp, kp, vp = (_pad_d(x, kd) for x in (qp, kp, vp))
        o_res, lse = pallas.forward(qp, kp, vp, cfg, launch, o_dtype=res_dtype,
                                    lengths=_lengths(ex, cfg))
        o_res = o_res[..., :d]
    else:
        o, lse = jnp_impl.forward(qp, kp, vp, cfg, ex)
        o_res = cast_rounded(o, res_dtype)  # an XLA-proof rounding: δ must see the stored O
    o_res = o_res[:, : cfg.q_len]
    return o_res.astype(q.dtype), o_res, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(q, k, v, cfg: Numerics, launch: Launch, executor: str, ex: Extras | None = None):
    return _forward(q, k, v, cfg, launch, executor, ex)[0]


def _attention_fwd(q, k, v, cfg, launch, executor, ex=None):
    o, o_res, lse = _forward(q, k, v, cfg, launch, executor, ex)
    return o, (q, k, v, ex, o_res, lse)


def _attention_bwd(cfg, launch, executor, res, do):
    q, k, v, ex, o_res, lse = res
    qp, kp, vp = _pad(q, cfg.block_q), _pad(k, cfg.block_k), _pad(v, cfg.block_k)
    dop, op = _pad(do, cfg.block_q), _pad(o_res, cfg.block_q)
    ds = None
    if executor == "pallas":
        # δ = rowsum(dO∘O) before the head_dim padding: the sum has the jnp executor's terms
        dlt = tile.delta_from_o(op, dop).transpose(0, 2, 1) if cfg.delta == "o" else None
        d, kd = q.shape[3], kernel_head_dim(q.shape[3])
        qp, kp, vp, dop, op = (_pad_d(x, kd) for x in (qp, kp, vp, dop, op))
        lengths = _lengths(ex, cfg)
        if dlt is None:
            dlt = pallas.delta(qp, kp, vp, op, dop, lse, cfg, launch, lengths)
        dq, dk, dv = (g[..., :d] for g in pallas.backward(
            qp, kp, vp, dop, lse, dlt, cfg, launch, out_dtype=q.dtype, lengths=lengths))
    else:
        dlt = jnp_impl.delta(qp, kp, vp, op, dop, lse, cfg, ex)
        dq, dk, dv, ds = jnp_impl.backward_with_ds(qp, kp, vp, dop, lse, dlt, cfg,
                                                   out_dtype=q.dtype, ex=ex)
    grads = (dq[:, : cfg.q_len], dk[:, : cfg.kv_len], dv[:, : cfg.kv_len])
    if ex is None:
        return grads + (None,)
    dbias = _reduce_to(ds[:, :, : cfg.q_len, : cfg.kv_len], ex.bias) if cfg.bias else None
    return grads + (Extras(None, None, None, dbias),)


def _packed_forward(qkv, cfg: Numerics, launch: Launch):
    o_res, lse = pallas.forward(qkv, qkv, qkv, cfg, launch, o_dtype=cfg.policy.o_residual_dtype,
                                packed=True)
    return o_res.astype(qkv.dtype), o_res, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _attention_packed(qkv, cfg: Numerics, launch: Launch):
    """``_attention`` on the Pallas executor, Q, K and V one packed array (no padding)."""
    return _packed_forward(qkv, cfg, launch)[0]


def _attention_packed_fwd(qkv, cfg, launch):
    o, o_res, lse = _packed_forward(qkv, cfg, launch)
    return o, (qkv, o_res, lse)


def _attention_packed_bwd(cfg, launch, res, do):
    qkv, o_res, lse = res
    dlt = pallas.delta(qkv, qkv, qkv, o_res, do, lse, cfg, launch, packed=True)
    return (pallas.backward(qkv, qkv, qkv, do, lse, dlt, cfg, launch, out_dtype=qkv.dtype,
                            packed=True),)


_attention_packed.defvjp(_attention_packed_fwd, _attention_packed_bwd)


def _reduce_to(g, like):
    """``g`` ``[B, H, T, S]`` summed over the axes ``like`` broadcasts, in ``like``'s dtype."""
    axes = tuple(i for i, (n, m) in enumerate(zip(like.shape, g.shape)) if n == 1 and m != 1)
    return jnp.sum(g, axis=axes, keepdims=True).astype(like.dtype)


_attention.defvjp(_attention_fwd, _attention_bwd)
