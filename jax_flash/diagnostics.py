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
