"""Kernel-level diagnostics: inputs that trigger the biased rounding, and signed-error statistics."""

from __future__ import annotations

import numpy as np


def tied_rows(rng, n, *, kv_len=64, head_dim=64, ties=2, top=(6.0, 10.0), gap=13.0, v_mean=-1.5):
    """n independent single-query attention problems with ``ties`` identical dominant keys.

    Each instance: a query q along a random unit vector u; ``ties`` identical keys with score
    r_m ~ U(top) (exactly tied); the other keys with scores r_m − gap + N(0, 1) (many tiny P̄ — the
    remainders that break the BF16 rounding of Ō one way); V ~ N(v_mean, 1) (mostly negative when
    v_mean < 0). Returns float64 arrays q ``[n, 1, 1, D]``, k, v ``[n, kv_len, 1, D]`` (cast them to the
    dtype under test).
    """
    u = rng.standard_normal((n, head_dim))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    root = head_dim ** 0.25  # scores are q·k/√D
    r_m = rng.uniform(*top, (n, 1))
    scores = r_m - gap + rng.standard_normal((n, kv_len))
    scores[:, :ties] = r_m
    q = u * root * np.sqrt(r_m)
    k = (scores / np.sqrt(r_m))[..., None] * u[:, None, :] * root
    k[:, 1:ties] = k[:, :1]  # bitwise-identical keys: an exact tie after any rounding
    v = v_mean + rng.standard_normal((n, kv_len, head_dim))
    return q[:, None, None, :], k[:, :, None, :], v[:, :, None, :]


def signed_error_stats(err):
    """(mean, t-statistic, mean |err|) of a signed error ``[n, ...]``, treating the n leading
    instances as independent (each instance's error is averaged over its other axes first)."""
    err = np.asarray(err, np.float64)
    per = err.reshape(err.shape[0], -1).mean(axis=1)
    mean = per.mean()
    t = mean / (per.std(ddof=1) / np.sqrt(len(per)))
    return float(mean), float(t), float(np.abs(err).mean())


# ------------------------------------------------------------------ training instrumentation (jnp)
# Used by train/probes.py and experiments/lowrank.py. Inputs follow jax_flash's layout: q, k, v, o
# and dO are [batch, seq, heads, head_dim]; per-row outputs are [batch, heads, seq].

def power_iteration(w, v, n_iter=16):
    """Largest singular value of ``w [..., m, n]`` by power iteration on the Gram matrix wᵀw.

    ``v [..., n]`` is the start vector (warm start: the ``v`` returned by the previous call); returns
    ``(sigma [...], v [...])`` with v the unit estimate of the top right singular vector. FP32; each
    iteration is an n×n mat-vec, so it is cheap for per-head W_Q ``[n_embd, head_dim]``.
    """
    import jax
    import jax.numpy as jnp

    w = jnp.asarray(w, jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    gram = jnp.einsum("...mi,...mj->...ij", w, w, precision=hi)

    def unit(x):
        n = jnp.linalg.norm(x, axis=-1, keepdims=True)
        return x / jnp.where(n == 0, 1.0, n)

    def body(_, x):
        return unit(jnp.einsum("...ij,...j->...i", gram, x, precision=hi))

    v = jax.lax.fori_loop(0, n_iter, body, unit(jnp.asarray(v, jnp.float32)))
    sigma = jnp.linalg.norm(jnp.einsum("...mi,...i->...m", w, v, precision=hi), axis=-1)
    return sigma, v


def causal_scores(q, k, sm_scale=None):
    """S = scale·q·kᵀ in FP32 (operands upcast, HIGHEST precision), ``[B, H, T, T]``, -inf where masked."""
    import jax
    import jax.numpy as jnp

    d = q.shape[-1]
    scale = 1.0 / np.sqrt(d) if sm_scale is None else sm_scale
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST) * scale
    t_q, t_k = q.shape[1], k.shape[1]
    return jnp.where(jnp.tril(jnp.ones((t_q, t_k), bool)), s, -jnp.inf)


def softmax_mean_score(q, k, sm_scale=None):
    """S̄ = Σ_j P_ij·S_ij per causal row, ``[B, H, T]`` (FP32): the score a row attends to on average.
    A δ error ε_i changes the row's q·dQ (its share of ⟨W_Q, ∂L/∂W_Q⟩) by exactly −ε_i·S̄_i."""
    import jax
    import jax.numpy as jnp

    s = causal_scores(q, k, sm_scale)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.sum(p * jnp.where(jnp.isfinite(s), s, 0.0), axis=-1)


def max_logit(q, k, sm_scale=None):
    """Per head, the largest causal attention logit over batch and rows: ``[H]`` (FP32)."""
    import jax.numpy as jnp

    return jnp.max(causal_scores(q, k, sm_scale), axis=(0, 2, 3))


def tied_row_mask(q, k, *, policy="fa2"):
    """``[B, H, T]`` bool: causal rows whose maximum is reached by ≥ 2 unmasked entries.

    The tie test is ``jax_flash.tile.tie_count`` of the named policy over the whole causal row (one
    key tile = the row): for "fa2" / "fp32", entries with bf16(exp(S − r_m)) == 1 (S − r_m ≥
    ln(1 − 2⁻⁹), S in FP32 from the input-dtype operands); for "paper", the authors' S ≥
    bf16(r_m − 1e-3) on BF16 scores. Masked (future) entries never count.
    """
    import jax
    import jax.numpy as jnp

    from . import api, tile

    cfg = api.plan(q, k, k, policy=policy, impl="jnp").numerics
    t = q.shape[1]
    mask = jnp.tril(jnp.ones((t, t), bool))

    def rows(q2, k2):  # [T, D] each
        op = cfg.policy.operand_dtype  # the kernels' matmul operands
        s = tile.scores(q2.astype(op), k2.astype(op), cfg)
        s = jnp.where(mask, s, -jnp.inf)
        r_m = jnp.max(s, axis=1)
        return tile.tie_count(s, mask, r_m, cfg) >= 2

    qt, kt = jnp.swapaxes(q, 1, 2), jnp.swapaxes(k, 1, 2)  # [B, H, T, D]
    return jax.vmap(jax.vmap(rows))(qt, kt)


def tied_row_mask_rounded_scores(q, k, *, dtype="bfloat16", sm_scale=None):
    """``[B, H, T]`` bool: causal rows whose maximum is reached by ≥ 2 entries once the FP32 scores
    are rounded to ``dtype`` — the tie count a probe sees when it takes S from a low-precision
    matmul (e.g. ``q @ k.T`` under bf16 autocast) instead of accumulating in FP32."""
    import jax.numpy as jnp

    s = causal_scores(q, k, sm_scale).astype(dtype)  # -inf stays -inf
    r_m = jnp.max(s, axis=-1, keepdims=True)
    return jnp.sum(s == r_m, axis=-1) >= 2


def flash_stored_o_and_delta(q, k, v, do, *, causal=True, stable=False, beta=2.0, sm_scale=None,
                             policy="fa2", delta="o", impl="auto", block_q=None, block_k=None):
    """What ``jax_flash.attention``'s backward works with: (O as the kernel stores it for δ
    ``[B, T, H, D]`` in the policy's residual dtype, δ ``[B, H, T]`` FP32 as the backward computes it
    for the ``delta`` mode — rowsum(dO ∘ O_stored) for "o")."""
    from . import api, jnp_impl, pallas

    p = api.plan(q, k, v, causal=causal, stable=stable, beta=beta, sm_scale=sm_scale,
                 policy=policy, delta=delta, impl=impl, block_q=block_q, block_k=block_k)
    cfg, launch, impl = p.numerics, p.launch, p.executor
    _, o_res, lse = api._forward(q, k, v, cfg, launch, impl)
    qp, kp, vp = (api._pad(x, b) for x, b in ((q, cfg.block_q), (k, cfg.block_k), (v, cfg.block_k)))
    dop, op = api._pad(do, cfg.block_q), api._pad(o_res, cfg.block_q)
    if impl == "pallas":
        dlt = pallas.delta(qp, kp, vp, op, dop, lse, cfg, launch)
    else:
        dlt = jnp_impl.delta(qp, kp, vp, op, dop, lse, cfg)
    return o_res, dlt[:, :, : q.shape[1]]


def rowsum_delta(do, o):
    """δ = rowsum(dO ∘ O) in FP32, ``[B, H, T]``."""
    import jax.numpy as jnp

    return jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), o.astype(jnp.float32))


def hp_attention(q, k, v, sm_scale=None):
    """The FP32 shadow O_hp of causal attention on the same (rounded) q, k, v, ``[B, T, H, D]``."""
    import jax.numpy as jnp

    from .reference import reference_attention

    return reference_attention(q, k, v, causal=True, sm_scale=sm_scale, dtype=jnp.float32)


# ------------------------------------------------------------------------ low-rank analysis (NumPy)
def rank1_cosines(x_a, pk_a, x_b=None, pk_b=None):
    """Cosine similarities of the rank-1 terms x[T]ᵀ·pk[T] (flattened ``[n_embd × head_dim]``).

    x ``[N, n_embd]``, pk ``[N, head_dim]``; cos(a⊗b, c⊗e) = cos(a, c)·cos(b, e), so the ``[N, M]``
    matrix is formed without the outer products. Without the second pair: within one set.
    """
    def unit(a):
        a = np.asarray(a, np.float64)
        n = np.linalg.norm(a, axis=-1, keepdims=True)
        return a / np.where(n == 0, 1.0, n)

    xa, pa = unit(x_a), unit(pk_a)
    xb, pb = (xa, pa) if x_b is None else (unit(x_b), unit(pk_b))
    return (xa @ xb.T) * (pa @ pb.T)


def rank1_sum(x, pk, coef=None):
    """Σ_T coef[T]·x[T]ᵀ·pk[T] = xᵀ·diag(coef)·pk, ``[n_embd, head_dim]`` (coef defaults to 1)."""
    x, pk = np.asarray(x, np.float64), np.asarray(pk, np.float64)
    if coef is not None:
        pk = pk * np.asarray(coef, np.float64)[:, None]
    return x.T @ pk


def top_singular_share(m, ks=(1, 3)):
    """Fraction of ‖m‖_F² carried by the top-k singular values, for each k in ks."""
    s = np.linalg.svd(np.asarray(m, np.float64), compute_uv=False)
    tot = float(np.sum(s ** 2))
    return {k: (float(np.sum(s[:k] ** 2)) / tot if tot > 0 else float("nan")) for k in ks}
