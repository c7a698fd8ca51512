"""Bias map: where flash attention's BF16 rounding is biased, and what the stable shift and stochastic
rounding do about it (the kernel-level part of the "mechanism diagnostics").

    python -m experiments.bias_map [--quick] [--out DIR] [--rows N] [--seed S]

Sweeps policy ("paper", "paper_sr", "paper_sr_all", "fa2", "fa2_sr", "fp32") × stable {off, on} × ties per row
{1, 2, 4, 8} × V's mean {0, −0.5, −1.5} (V ~ N(v_mean, 1): v_mean < 0 makes V mostly negative) ×
remainder gap {13, 6} (the non-max keys score r_m − gap + N(0, 1): gap 13 = many tiny P̄, gap 6 = a
larger remainder mass) × kv_len {64, 512}. Each cell is a set of independent single-query rows; half
of them have ``ties`` bitwise-identical maximal keys (placed in one aligned 64-key block, so they share
a key tile under both tilings), the other half a unique maximum. Key tiles are each policy's default:
"paper" 512 (capped at kv_len: one tile), "fa2"/"fp32" 64 (kv_len 512: 8 tiles); the CSV says which.

Per cell, against float64 (mean signed error, t-statistic, mean |error|; all rows, tie rows, tie-free
rows):
  * O as returned (BF16), and O − bf16(exact O) (what the kernel adds on top of rounding the exact O once);
  * Ō, the unnormalised accumulator after the last key tile, against float64 Σ exp(S − m_used)·V with the
    kernel's own scores S (for "paper": its BF16 scores — the score rounding is an input perturbation
    that Ō and ℓ share and that cancels in O) and the m the kernel actually used; reported in O units,
    (Ō_lp − Ō_ref)/ℓ_ref, so that baseline and shifted rows are comparable;
  * δ_lp − δ_hp = rowsum(dO∘(O_kept − O_exact)), with O_kept the O the kernel keeps for the backward's δ
    (BF16 for "paper"/"fa2", FP32 for "fp32") and dO = sign(column mean of V) + N(0, 1), rounded to BF16.
Writes ``bias_map.csv`` (one row per cell) and ``bias_map.png`` into ``--out``.

The kernel is run through ``jax_flash.tile`` (init_carry / forward_tile / finish over the key tiles, the
code both executors run) with one query row per problem: the same arithmetic as ``jax_flash.attention``
(tests/test_bias_map.py checks agreement) without padding every problem to a 16-row query block.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import tile
import jax_flash as jf
from jax_flash.diagnostics import signed_error_stats
from jax_flash.rounding import round_to

BF16 = jnp.bfloat16
HEAD_DIM = 64
TIE_BLOCK = 64  # ties are placed inside one aligned block of this many keys (the smallest key tile)
DEFAULT_OUT = os.path.join("experiments", "results", "bias_map")

POLICIES = ("paper", "paper_sr", "paper_sr_all", "fa2", "fa2_sr", "fp32")
FULL = dict(policies=POLICIES, stable=(False, True),
            ties=(1, 2, 4, 8), v_mean=(0.0, -0.5, -1.5), gap=(13.0, 6.0), kv_len=(64, 512), rows=1024)
QUICK = dict(policies=POLICIES, stable=(False, True),
             ties=(1, 2), v_mean=(-1.5,), gap=(13.0,), kv_len=(64,), rows=512)

SUBSETS = ("all", "tie", "free")
METRICS = ("o", "o_excess", "obar", "delta")
STAT_COLS = [f"{m}_{s}_{x}" for m in METRICS for s in SUBSETS for x in ("mean", "t", "mabs")]
COLUMNS = (["policy", "stable", "ties", "v_mean", "gap", "kv_len", "block_k", "n_tiles", "rows",
            "tie_rows", "remainder_mass", "shift_fired_tie", "shift_fired_free",
            "round_all_mean", "round_all_t", "round_tie_mean", "round_tie_t"] + STAT_COLS)


# ------------------------------------------------------------------------------------------- inputs
def bias_rows(rng, n, *, kv_len=64, head_dim=HEAD_DIM, ties=2, tie_frac=0.5, top=(6.0, 10.0),
              gap=13.0, v_mean=-1.5, split=False):
    """``jax_flash.diagnostics.tied_rows`` generalised: n single-query problems, the first
    round(n·tie_frac) with ``ties`` bitwise-identical maximal keys, the rest with a unique maximum
    (``ties=1`` everywhere means no row is tied).

    Scores: the maxima r_m ~ U(top); the other keys r_m − gap + N(0, 1). The tied keys sit at random
    positions inside one random aligned block of ``TIE_BLOCK`` keys; with ``split``, tie j sits in
    the j-th block after it instead (cyclically), so no key tile holds two of them. V ~ N(v_mean, 1).
    Returns q ``[n, D]``, k, v ``[n, kv_len, D]`` (float32, to be cast to BF16) and the tie counts ``[n]``.
    """
    assert kv_len % TIE_BLOCK == 0 or kv_len < TIE_BLOCK
    u = rng.standard_normal((n, head_dim))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    root = head_dim ** 0.25  # scores are q·k/√D
    r_m = rng.uniform(*top, (n, 1))
    scores = r_m - gap + rng.standard_normal((n, kv_len))
    n_tied = int(round(n * tie_frac))
    counts = np.where(np.arange(n) < n_tied, ties, 1)
    block = min(TIE_BLOCK, kv_len)
    starts = rng.integers(0, kv_len // block, n) * block
    pos = np.argsort(rng.random((n, block)), axis=1) + starts[:, None]  # a random permutation per row
    q = u * root * np.sqrt(r_m)
    k = (scores / np.sqrt(r_m))[..., None] * u[:, None, :] * root
    rows = np.arange(n)
    top_key = k[rows, pos[:, 0]] = (r_m / np.sqrt(r_m)) * u * root
    if split:
        assert ties <= kv_len // block, "split ties need one block each"
        pos = pos + np.arange(block)[None, :] * block  # the j-th entry moves j blocks on
        pos = pos % kv_len
    for j in range(1, max(ties, 1)):
        sel = counts > j
        k[rows[sel], pos[sel, j]] = top_key[sel]  # bitwise-identical keys: an exact tie after rounding
    v = v_mean + rng.standard_normal((n, kv_len, head_dim), dtype=np.float32)
    return q.astype(np.float32), k.astype(np.float32), v, counts


# --------------------------------------------------------------------------------------- the kernel
def kernel_config(policy, stable, kv_len, *, beta=2.0, head_dim=HEAD_DIM, block_k=None):
    """The numerics ``jax_flash.attention`` computes for one BF16 query row against kv_len keys."""
    q = jax.ShapeDtypeStruct((1, 1, 1, head_dim), BF16)
    kv = jax.ShapeDtypeStruct((1, kv_len, 1, head_dim), BF16)
    return jf.plan(q, kv, kv, causal=False, stable=stable, beta=beta, policy=policy, impl="jnp",
                   block_k=block_k).numerics


_RUNNERS = {}


def kernel_runner(cfg):
    """jit(vmap) of the kernel's forward on single query rows: (q [n, D], k, v [n, T, D], BF16) ->
    dict of O (as returned, BF16 values), O kept for δ, m, ℓ, Ō (the final carry) and the scores, all
    FP32; scores and m in the policy's units."""
    if cfg in _RUNNERS:
        return _RUNNERS[cfg]
    pol, bk = cfg.policy, cfg.block_k
    n_tiles = -(-cfg.kv_len // bk)

    def one(q, k, v):
        d = q.shape[-1]
        q2 = q[None].astype(pol.operand_dtype)
        carry = tile.init_carry(1, d, cfg)
        s_tiles = []
        for j in range(n_tiles):
            kj = k[j * bk:(j + 1) * bk].astype(pol.operand_dtype)
            vj = v[j * bk:(j + 1) * bk].astype(pol.operand_dtype)
            mask = tile.tile_mask(0, j * bk, 1, kj.shape[0], cfg)
            s_tiles.append(tile.scores(q2, kj, cfg)[0])
            carry = tile.forward_tile(carry, q2, kj, vj, mask, cfg)
        o, _ = tile.finish(carry, cfg)
        o = o[0]
        return dict(o_out=round_to(o, BF16),  # the executors cast O to the input dtype (RNE)
                    o_kept=round_to(o, pol.o_residual_dtype), m=carry.m[0], l=carry.l[0],
                    acc=carry.acc[0], s=jnp.concatenate(s_tiles))

    _RUNNERS[cfg] = jax.jit(jax.vmap(one))
    return _RUNNERS[cfg]


def run_kernel(cfg, q, k, v):
    out = kernel_runner(cfg)(q, k, v)
    return {name: np.asarray(x, np.float64) for name, x in out.items()}


# ---------------------------------------------------------------------------------------- reference
def _rowwise_pv(p, v, chunk=256):
    """Σ_k p[n, k]·v[n, k, :] in float64, in row chunks (v may be large)."""
    out = np.empty((p.shape[0], v.shape[-1]))
    for i in range(0, p.shape[0], chunk):
        out[i:i + chunk] = np.matmul(p[i:i + chunk, None, :], v[i:i + chunk].astype(np.float64))[:, 0]
    return out


def exact(q, k, v):
    """float64 scores, P and O of BF16-valued inputs (q [n, D], k, v [n, T, D])."""
    q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
    s = np.einsum("nd,ntd->nt", q64, k64) / math.sqrt(q.shape[-1])
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return s, p, _rowwise_pv(p, np.asarray(v, np.float32))


def obar_error(cfg, out, v):
    """(Ō_lp − Ō_ref)/ℓ_ref [n, D] with Ō_ref = Σ exp(S_kernel − m_used)·V in float64 — in O units.

    S_kernel are the kernel's own scores and m_used the final running max it used (policy units). Under
    a policy that rounds S − m to BF16 before exp ("paper"), the reference applies that rounding too:
    with a shifted max (stable) it moves every tied P̄ by the same factor of up to e^±0.03, shared by Ō
    and ℓ and cancelling in O, which would otherwise swamp the accumulator's rounding error. (Exact for
    one key tile — "paper" always has one here — where m_used is the only shift.)
    """
    diff = out["s"] - out["m"][:, None]
    if cfg.policy.round_shifted:
        diff = np.asarray(round_to(jnp.asarray(diff, jnp.float32), cfg.policy.lp_dtype), np.float64)
    pbar = np.exp2(diff) if cfg.policy.log2_units else np.exp(diff)
    l_ref = pbar.sum(axis=1)
    return (out["acc"] - _rowwise_pv(pbar, np.asarray(v, np.float32))) / l_ref[:, None]


# -------------------------------------------------------------------------------------------- cells
def _stats(err, sel):
    """signed_error_stats on the selected rows; an error that is exactly 0 everywhere has t = 0."""
    if sel.sum() < 2:
        return (float("nan"),) * 3
    if not np.any(err[sel]):
        return 0.0, 0.0, 0.0
    return signed_error_stats(err[sel])


def measure_cell(cfg, inputs, ref, do):
    """One row of the bias map for numerics ``cfg`` on prepared inputs and their float64 reference."""
    q, k, v, counts = inputs
    s64, p64, o_exact = ref
    out = run_kernel(cfg, q, k, v)
    tie = counts > 1 if counts.max() > 1 else np.arange(len(counts)) < len(counts) // 2
    subsets = {"all": np.ones(len(counts), bool), "tie": tie, "free": ~tie}
    o_round = np.asarray(jnp.asarray(o_exact, BF16), np.float64)
    errs = {"o": out["o_out"] - o_exact, "o_excess": out["o_out"] - o_round,
            "obar": obar_error(cfg, out, v),
            "delta": np.sum(do * (out["o_kept"] - o_exact), axis=1)}
    units = math.log2(math.e) if cfg.policy.log2_units else 1.0
    r_m = out["s"].max(axis=1)
    fired = out["m"] > r_m + 1e-3 * units  # the kernel used a larger shift than the row max
    top = p64 >= p64.max(axis=1, keepdims=True) * (1 - 1e-9)
    rem = np.where(top, 0.0, p64).sum(axis=1) / np.where(top, p64, 0.0).sum(axis=1)
    row = dict(policy=cfg.policy.name, stable=int(cfg.stable), block_k=cfg.block_k,
               n_tiles=-(-cfg.kv_len // cfg.block_k), kv_len=cfg.kv_len, rows=len(counts),
               tie_rows=int((counts > 1).sum()), remainder_mass=float(rem.mean()),
               shift_fired_tie=float(fired[counts > 1].mean()) if (counts > 1).any() else 0.0,
               shift_fired_free=float(fired[counts == 1].mean()))
    for name, sel in (("all", subsets["all"]), ("tie", tie)):
        mean, t, _ = _stats(o_round - o_exact, sel)
        row[f"round_{name}_mean"], row[f"round_{name}_t"] = mean, t
    for metric, err in errs.items():
        for sub, sel in subsets.items():
            mean, t, mabs = _stats(err, sel)
            row[f"{metric}_{sub}_mean"], row[f"{metric}_{sub}_t"], row[f"{metric}_{sub}_mabs"] = \
                mean, t, mabs
    return row


def make_do(rng, v):
    """dO = sign of V's column means (a direction shared by all rows) + N(0, 1), rounded to BF16."""
    sign = np.sign(v.mean(axis=(0, 1), dtype=np.float64))
    do = sign[None, :] + rng.standard_normal((v.shape[0], v.shape[-1]))
    return np.asarray(jnp.asarray(do, BF16), np.float64)


def input_sets(grid):
    return list(itertools.product(grid["kv_len"], grid["gap"], grid["v_mean"], grid["ties"]))


def sweep(grid, seed=0, rows=None, progress=True, beta=2.0):
    """All cells of ``grid``; returns a list of dicts (CSV rows)."""
    from tqdm import tqdm

    rows = rows or grid["rows"]
    rng = np.random.default_rng(seed)
    configs = list(itertools.product(grid["policies"], grid["stable"]))
    sets = input_sets(grid)
    bar = tqdm(total=len(sets) * len(configs), desc="bias map cells", unit="cell", disable=not progress)
    results = []
    for kv_len, gap, v_mean, ties in sets:
        q, k, v, counts = bias_rows(rng, rows, kv_len=kv_len, ties=ties, gap=gap, v_mean=v_mean)
        q, k, v = (np.asarray(jnp.asarray(x, BF16)) for x in (q, k, v))  # BF16 inputs
        ref = exact(q, k, v)
        do = make_do(rng, np.asarray(v, np.float32))
        for policy, stable in configs:
            cfg = kernel_config(policy, stable, kv_len, beta=beta)
            row = measure_cell(cfg, (q, k, v, counts), ref, do)
            row.update(ties=ties, v_mean=v_mean, gap=gap)
            results.append(row)
            bar.update(1)
    bar.close()
    return results


# ------------------------------------------------------------------------------------------- output
def write_csv(results, path):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in results:
            w.writerow({c: (f"{r[c]:.4g}" if isinstance(r[c], float) else r[c]) for c in COLUMNS})


def stat_cells(r) -> str:
    """Markdown cells "mean (t)" of O and δ on tied and tie-free rows, and the tied rows' mean |O error|
    (a row of ``measure_cell``'s columns)."""
    cells = [f"{r[f'{m}_mean']:+.2e} ({r[f'{m}_t']:+.1f})"
             for m in ("o_tie", "o_free", "delta_tie", "delta_free")]
    return " | ".join(cells + [f"{r['o_tie_mabs']:.2e}"])


def ablation_main(argv, doc, run, markdown, stem, default_out):
    """The command line of the ablation-style experiments: --rows, --seed, --out; runs, saves, prints."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=default_out)
    args = ap.parse_args(argv)
    results = run(args.rows, args.seed)
    save_table(results, args.out, stem, markdown(results))


def save_table(results, out_dir, stem, md):
    """``stem``.csv (every key of the result dicts) and ``stem``.md (the markdown ``md``) into
    ``out_dir``; prints the markdown (the ablation-style experiments built on this module)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(results[0]))
        w.writeheader()
        w.writerows(results)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(md)
    print(md)


def plot(results, path):
    """t-statistics of the tie rows' O, Ō and δ errors by cell: baseline vs stable, one row per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(r["policy"] for r in results))
    keys = list(dict.fromkeys((r["kv_len"], r["gap"], r["v_mean"], r["ties"]) for r in results))
    index = {key: i for i, key in enumerate(keys)}
    metrics = (("o_tie_t", "O (tie rows)"), ("obar_tie_t", "Ō (tie rows)"),
               ("delta_tie_t", "δ_lp − δ_hp (tie rows)"))
    fig, axes = plt.subplots(len(policies), len(metrics), figsize=(5.2 * len(metrics),
                             1.9 * len(policies) + 1.2), sharex=True, squeeze=False)
    x = np.arange(len(keys))
    for i, pol in enumerate(policies):
        for j, (col, title) in enumerate(metrics):
            ax = axes[i, j]
            ax.axhspan(-4, 4, color="0.9", zorder=0)
            for stable, style in ((0, dict(marker="o", color="C3", label="baseline")),
                                  (1, dict(marker="^", color="C0", label="stable (β=2)"))):
                pts = [(index[(r["kv_len"], r["gap"], r["v_mean"], r["ties"])], r[col])
                       for r in results if r["policy"] == pol and r["stable"] == stable]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, linestyle="none", markersize=4, alpha=0.85, **style)
            # the bias of rounding the exact O once (the same inputs for every policy)
            base = {index[(r["kv_len"], r["gap"], r["v_mean"], r["ties"])]: r["round_tie_t"]
                    for r in results}
            if j == 0:
                ax.plot(sorted(base), [base[k] for k in sorted(base)], "k_", markersize=5,
                        label="bf16(exact O)" if j == 0 else None)
            ax.set_yscale("symlog", linthresh=4)
            ax.set_ylim(-250, 250)
            ax.set_yticks([-100, -10, -4, 0, 4, 10, 100])
            ax.set_yticklabels(["−100", "−10", "−4", "0", "4", "10", "100"])
            ax.axhline(0, color="k", lw=0.5)
            if i == 0:
                ax.set_title(f"t of mean signed error: {title}", fontsize=9)
            if j == 0:
                ax.set_ylabel(pol, fontsize=10, fontweight="bold")
            for b in range(1, len(keys)):
                if keys[b][:3] != keys[b - 1][:3]:
                    ax.axvline(b - 0.5, color="0.7", lw=0.5)
            ax.tick_params(labelsize=7)
    labels = [f"T{kv} g{g:g} μ{vm:g} t{t}" for kv, g, vm, t in keys]
    for ax in axes[-1]:
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=90, fontsize=5)
    axes[0, 0].legend(fontsize=7, loc="best")
    fig.suptitle("Signed-error t-statistics by cell (T = kv_len, g = gap, μ = V mean, t = ties per "
                 "tied row); grey band |t| < 4", fontsize=9)
    fig.tight_layout()
    from experiments.plot_run import save_png

    save_png(fig, path, dpi=110)


def summary(results):
    """A short text table of the tie rows' O error (mean, t) per policy × stable, at ties=2."""
    lines = [f"{'policy':9s} {'stable':6s} {'T':>4s} {'gap':>4s} {'μ':>5s}  {'O tie mean':>11s} {'t':>7s}"
             f"  {'Ō tie mean':>11s} {'t':>7s}  {'δ tie mean':>11s} {'t':>7s}"]
    for r in results:
        if r["ties"] != 2:
            continue
        lines.append(f"{r['policy']:9s} {r['stable']:<6d} {r['kv_len']:4d} {r['gap']:4g} "
                     f"{r['v_mean']:5g}  {r['o_tie_mean']:+11.2e} {r['o_tie_t']:+7.1f}  "
                     f"{r['obar_tie_mean']:+11.2e} {r['obar_tie_t']:+7.1f}  "
                     f"{r['delta_tie_mean']:+11.2e} {r['delta_tie_t']:+7.1f}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a reduced grid (< 1 minute)")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--rows", type=int, default=None, help="problems per cell (half of them tied)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--beta", type=float, default=2.0)
    args = ap.parse_args(argv)
    grid = QUICK if args.quick else FULL
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    results = sweep(grid, seed=args.seed, rows=args.rows, beta=args.beta)
    write_csv(results, os.path.join(args.out, "bias_map.csv"))
    plot(results, os.path.join(args.out, "bias_map.png"))
    print(summary(results))
    print(f"\n{len(results)} cells, {results[0]['rows']} rows each; wrote {args.out}/bias_map.csv and "
          f"bias_map.png in {time.time() - t0:.1f} s")
    return results


if __name__ == "__main__":
    main()
