"""The end of the paper's chain at the kernel level: the error the attention backward puts into W_Q's
gradient along W_Q, split into its δ part and the rest (under the authors' numerics, is it δ, or
the recomputed P?).

    python -m experiments.wq_chain [--rows 2048] [--seed 0] [--out DIR]

One query row i contributes q_i·dQ_i = Σ_j dS_ij·S_ij to ⟨W_Q, ∂loss/∂W_Q⟩ (S = q·kᵀ/√D; q = x·W_Q,
so this is the gradient's component along W_Q; < 0 after the update's minus sign grows ‖W_Q‖). An
error ε_i in δ changes dS_ij = P_ij·(dP_ij − δ_i) by −P_ij·ε_i and so q_i·dQ_i by **−ε_i·S̄_i**, with
S̄_i = Σ_j P_ij·S_ij the row's softmax-mean score: a δ error enters the W_Q gradient multiplied by the
scores the row attends to, which is how a small O bias can feed the logits' growth. Everything else —
the recomputed P = exp(S − L) not being the forward's softmax ("paper" rounds S − m to BF16 in the
forward only), dS's and dQ's own roundings — is "the rest".

Per cell, against float64 on the same BF16 inputs and dO (``bias_map.bias_rows``: 512 keys, two
exactly tied maxima in half the rows, remainders at r_m − gap ± 1 (gap 13: tiny remainders; gap 6: a
remainder mass of ~1, where a recomputed P that is not the forward's softmax would show most),
V ~ N(−1.5, 1), dO along V's sign; r_m ~ U(6, 10) and U(20, 30); then at gap 13 a zero-mean dO): total = q·(dQ_lp − dQ_hp) with dQ_lp rounded to BF16 as the kernels
write it, its δ part −(δ_lp − δ_hp)·S̄ and the rest, mean (t) on tied and on tie-free rows, and the
mean |q·dQ_hp| for scale. The kernel is the tile code both executors run (``jax_flash.tile``), one
query row per problem, as in ``bias_map``. Writes ``wq_chain.csv`` and ``wq_chain.md`` into ``--out``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from experiments import arms as registry
from jax_flash import tile
from jax_flash.rounding import round_to

from .bias_map import BF16, _stats, ablation_main, bias_rows, exact, kernel_config, make_do

DEFAULT_OUT = os.path.join("experiments", "results", "wq_chain")
# arms of experiments/arms.py
ARMS = ("fa2", "fa2-stable", "fa2-dpp", "paper", "paper-stable", "paper-fp32acc",
        "paper-fp32acc-stable")
TOPS = ((6.0, 10.0), (20.0, 30.0))
GAPS = (13.0, 6.0)
# dO along V's sign (the bias map's; it makes a biased O show in δ) in every (gap, r_m) cell, then a
# zero-mean dO at gap 13: a δ bias needs dO to correlate with O's error, which zero-mean dO does not
CASES = [(gap, top, "V's sign") for gap, top in itertools.product(GAPS, TOPS)] + \
        [(GAPS[0], top, "zero-mean") for top in TOPS]
KV_LEN = 512
PARTS = ("total", "delta", "rest")

_RUNNERS = {}


def backward_runner(cfg):
    """jit(vmap) of the kernel's forward, δ and dQ on single query rows: (q [n, D], k, v [n, T, D],
    dO [n, D], BF16 values) -> (dQ [n, D] as the kernel writes it (BF16 values, sm_scale applied),
    δ [n]), FP32."""
    if cfg in _RUNNERS:
        return _RUNNERS[cfg]
    pol, bk = cfg.policy, cfg.block_k
    n_tiles = -(-cfg.kv_len // bk)

    def one(q, k, v, do):
        d = q.shape[-1]
        q2, do2 = q[None].astype(pol.operand_dtype), do[None].astype(pol.operand_dtype)
        tiles = [(k[j * bk:(j + 1) * bk].astype(pol.operand_dtype),
                  v[j * bk:(j + 1) * bk].astype(pol.operand_dtype),
                  tile.tile_mask(0, j * bk, 1, min(bk, cfg.kv_len - j * bk), cfg))
                 for j in range(n_tiles)]
        carry = tile.init_carry(1, d, cfg)
        for kj, vj, mask in tiles:
            carry = tile.forward_tile(carry, q2, kj, vj, mask, cfg)
        o, lse = tile.finish(carry, cfg)
        if cfg.delta == "o":
            dlt = tile.delta_from_o(round_to(o, pol.o_residual_dtype), do2)
        else:
            zeros = jnp.zeros((1,), jnp.float32)
            acc = (zeros,) if cfg.delta == "dpp" else (jnp.zeros((1, d), jnp.float32), zeros)
            for kj, vj, mask in tiles:
                acc = tile.delta_tile(acc, q2, kj, vj, do2, lse, mask, cfg)
            dlt = tile.delta_finish(acc, do2, cfg)
        dq = jnp.zeros((1, d), jnp.float32)
        for kj, vj, mask in tiles:
            dq = tile.backward_tile_dq(dq, q2, kj, vj, do2, lse, dlt, mask, cfg)
        return round_to(dq[0] * cfg.sm_scale, BF16), dlt[0]

    _RUNNERS[cfg] = jax.jit(jax.vmap(one))
    return _RUNNERS[cfg]


def exact_backward(q, k, v, do):
    """float64 (dQ [n, D], δ [n], S̄ [n]) of softmax attention for single query rows."""
    s, p, o = exact(q, k, v)
    k64, v64 = np.asarray(k, np.float64), np.asarray(v, np.float64)
    dp = np.einsum("nd,ntd->nt", do, v64)
    delta = np.sum(do * o, axis=1)
    ds = p * (dp - delta[:, None])
    dq = np.einsum("nt,ntd->nd", ds, k64) / math.sqrt(q.shape[-1])
    return dq, delta, np.sum(p * s, axis=1)


def decompose(q, dq_lp, dlt_lp, dq_hp, dlt_hp, s_bar):
    """Per row: total = q·(dQ_lp − dQ_hp), its δ part −(δ_lp − δ_hp)·S̄, the rest, and q·dQ_hp."""
    q = np.asarray(q, np.float64)
    total = np.sum(q * (np.asarray(dq_lp, np.float64) - dq_hp), axis=1)
    delta = -(np.asarray(dlt_lp, np.float64) - dlt_hp) * s_bar
    return dict(total=total, delta=delta, rest=total - delta, own=np.sum(q * dq_hp, axis=1))


def arm_config(arm, kv_len=KV_LEN):
    """The arm's numerics for single-query rows of ``kv_len`` keys."""
    kw = registry.attention_kwargs(arm)
    cfg = kernel_config(kw["policy"], kw.get("stable", False), kv_len, beta=kw.get("beta", 2.0))
    return dataclasses.replace(cfg, delta=kw.get("delta", "o"))


def run(rows: int, seed: int, progress=True):
    from tqdm import tqdm

    rng = np.random.default_rng(seed)
    results = []
    bar = tqdm(total=len(CASES) * len(ARMS), desc="W_Q-gradient cells", disable=not progress)
    for gap, top, do_mode in CASES:
        q, k, v, counts = bias_rows(rng, rows, kv_len=KV_LEN, ties=2, top=top, gap=gap)
        q, k, v = (np.asarray(jnp.asarray(x, BF16), np.float32) for x in (q, k, v))
        do = make_do(rng, v) if do_mode == "V's sign" else \
            np.asarray(jnp.asarray(rng.standard_normal(q.shape), BF16), np.float64)
        dq_hp, dlt_hp, s_bar = exact_backward(q, k, v, do)
        tie = counts > 1
        for label in ARMS:
            dq_lp, dlt_lp = backward_runner(arm_config(label))(
                *(jnp.asarray(x, BF16) for x in (q, k, v, do)))
            parts = decompose(q, dq_lp, dlt_lp, dq_hp, dlt_hp, s_bar)
            row = dict(arm=label, gap=gap, top=f"{top[0]:g}–{top[1]:g}", dO=do_mode, rows=rows,
                       tie_rows=int(tie.sum()),
                       own_mabs=float(np.abs(parts["own"]).mean()))
            for part in PARTS:
                for sub, sel in (("tie", tie), ("free", ~tie)):
                    mean, t, _ = _stats(parts[part], sel)
                    row[f"{part}_{sub}_mean"], row[f"{part}_{sub}_t"] = mean, t
            results.append(row)
            bar.update(1)
    bar.close()
    return results


def markdown(results) -> str:
    head = " | ".join(f"{p} {s}: mean (t)" for p in ("total", "δ part", "rest") for s in ("tie", "tie-free"))
    lines = [f"| gap | r_m | dO | arm | {head} | mean abs q·dQ_hp |", "|---|---|---|---|" + "---|" * 7]
    for r in results:
        cells = [f"{r[f'{p}_{s}_mean']:+.2e} ({r[f'{p}_{s}_t']:+.1f})" for p in PARTS for s in ("tie", "free")]
        lines.append(f"| {r['gap']:g} | {r['top']} | {r['dO']} | {r['arm']} | " + " | ".join(cells)
                     + f" | {r['own_mabs']:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ablation_main(argv, __doc__, run, markdown, "wq_chain", DEFAULT_OUT)


if __name__ == "__main__":
    main()
