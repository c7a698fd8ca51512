"""Is dW_Q's δ-error low rank and shared across tokens and steps? (Qiu & Yao's Figure 4.)

The error the biased δ puts into one head's W_Q gradient is
    dW_Q,hp − dW_Q,lp = α·Σ_T (δ_lp − δ_hp)[T] · X[T]ᵀ·(PK)[T]
(X the attention input, PK = P·K). The paper's claim: the rank-1 terms X[T]ᵀ(PK)[T] point in nearly
the same direction across tokens and across training steps (a shared low-rank structure R), so a
coefficient Σ(δ_lp − δ_hp) with a consistent sign accumulates along R instead of cancelling.

Snapshots come from ``train.probes.save_snapshot`` / ``SnapshotProbe`` (``python -m train.probes
--snapshot LAYER,HEAD,STEP_A,STEP_B ...``). This script prints, per snapshot and across the pair:
the cosine similarities of the rank-1 terms (mean, median, quantiles, share > 0.5), and the share of
the sum's Frobenius norm² carried by its top-1 / top-3 singular values — for the plain sum Σ_T
X[T]ᵀ(PK)[T] and for the δ-error-weighted sum — plus the alignment of the two steps' top singular
vectors. It writes a histogram of the cosines (Figure 4 style).

    python -m experiments.lowrank runs/x/snapshots/snap_L1_H7_step1500.npz \
        runs/x/snapshots/snap_L1_H7_step2000.npz --out runs/x/lowrank.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from jax_flash.diagnostics import rank1_cosines, rank1_sum, top_singular_share

MAX_TOKENS = 2048  # cosine matrices are N×M; subsample tokens above this


def load_snapshot(path) -> dict:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def _tokens(snap, rng, max_tokens=MAX_TOKENS, causal_from=1):
    """Flattened (x [N, n_embd], pk [N, hd], coef [N] or None) over sequences and positions ≥ causal_from
    (position 0 attends only to itself: PK = K[0], a trivial term)."""
    x, pk = snap["x"][:, causal_from:], snap["pk"][:, causal_from:]
    x, pk = x.reshape(-1, x.shape[-1]), pk.reshape(-1, pk.shape[-1])
    coef = snap.get("delta_err")
    coef = None if coef is None else coef[:, causal_from:].reshape(-1)
    if len(x) > max_tokens:
        idx = np.sort(rng.choice(len(x), max_tokens, replace=False))
        x, pk, coef = x[idx], pk[idx], (None if coef is None else coef[idx])
    return x, pk, coef


def _offdiag(c):
    return c[~np.eye(c.shape[0], dtype=bool)] if c.shape[0] == c.shape[1] else c.ravel()


def cos_stats(c) -> dict:
    c = np.asarray(c).ravel()
    return {
        "mean": float(c.mean()),
        "mean_abs": float(np.abs(c).mean()),
        "median": float(np.median(c)),
        "q10": float(np.quantile(c, 0.1)),
        "q90": float(np.quantile(c, 0.9)),
        "frac_gt_0.5": float(np.mean(c > 0.5)),
    }


def analyze(snaps, seed=0, max_tokens=MAX_TOKENS) -> dict:
    """Statistics for one or two snapshots (dicts from ``load_snapshot``). Returns a dict with
    ``within`` (per snapshot: cosine stats, top-1/top-3 shares of the plain and δ-weighted sums),
    and for two snapshots ``across`` (cosines between their tokens' terms, and the |cos| between the
    two steps' top singular vector pairs of the plain and weighted sums), plus the raw cosine arrays
    under ``cos_within`` / ``cos_across`` for plotting."""
    rng = np.random.default_rng(seed)
    toks = [_tokens(s, rng, max_tokens) for s in snaps]
    res = {"within": [], "cos_within": []}
    tops = []
    for s, (x, pk, coef) in zip(snaps, toks):
        c = _offdiag(rank1_cosines(x, pk))
        m = rank1_sum(x, pk)
        row = {
            "step": int(s.get("step", -1)),
            "layer": int(s.get("layer", -1)),
            "head": int(s.get("head", -1)),
            "tokens": len(x),
            "cos": cos_stats(c),
            "sum_share": top_singular_share(m),
        }
        u, sv, vt = np.linalg.svd(m, full_matrices=False)
        top = {"sum": (u[:, 0], vt[0])}
        if coef is not None:
            mw = rank1_sum(x, pk, coef)
            row["weighted_share"] = top_singular_share(mw)
            row["coef_sum"] = float(np.sum(coef))
            row["coef_frac_pos"] = float(np.mean(coef > 0))
            uw, _, vtw = np.linalg.svd(mw, full_matrices=False)
            top["weighted"] = (uw[:, 0], vtw[0])
        res["within"].append(row)
        res["cos_within"].append(c)
        tops.append(top)
    if len(snaps) == 2:
        (xa, pa, _), (xb, pb, _) = toks
        c = rank1_cosines(xa, pa, xb, pb).ravel()
        res["cos_across"] = c
        res["across"] = {"cos": cos_stats(c)}
        for key in tops[0]:
            if key in tops[1]:
                (ua, va), (ub, vb) = tops[0][key], tops[1][key]
                # the rank-1 top direction u vᵀ as a unit matrix: |cos| = |u_a·u_b|·|v_a·v_b|
                res["across"][f"top_dir_cos_{key}"] = float(abs(ua @ ub) * abs(va @ vb))
    return res


def print_table(res) -> None:
    hdr = (
        f"{'set':<22}{'tokens':>7}{'cos mean':>10}{'|cos|':>8}{'median':>8}{'>0.5':>7}"
        f"{'sum top1':>10}{'top3':>7}{'δw top1':>9}{'top3':>7}{'Σcoef':>11}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in res["within"]:
        c = r["cos"]
        w = r.get("weighted_share", {})
        name = f"L{r['layer']} H{r['head']} step {r['step']}"
        print(
            f"{name:<22}{r['tokens']:>7}{c['mean']:>10.3f}{c['mean_abs']:>8.3f}{c['median']:>8.3f}"
            f"{c['frac_gt_0.5']:>7.2f}{r['sum_share'][1]:>10.3f}{r['sum_share'][3]:>7.3f}"
            f"{w.get(1, float('nan')):>9.3f}{w.get(3, float('nan')):>7.3f}"
            f"{r.get('coef_sum', float('nan')):>11.3e}"
        )
    if "across" in res:
        c = res["across"]["cos"]
        print(
            f"{'across the two steps':<22}{'':>7}{c['mean']:>10.3f}{c['mean_abs']:>8.3f}"
            f"{c['median']:>8.3f}{c['frac_gt_0.5']:>7.2f}"
        )
        for k, v in res["across"].items():
            if k.startswith("top_dir_cos"):
                print(f"  |cos| of the two steps' top singular directions ({k[12:]}): {v:.3f}")
    print(
        "shares: fraction of ‖Σ‖_F² in the top-1 / top-3 singular values; δw = weighted by "
        "δ_lp − δ_hp per token"
    )


def plot(res, out, title=None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    bins = np.linspace(-1, 1, 81)
    for r, c in zip(res["within"], res["cos_within"]):
        ax.hist(
            c,
            bins=bins,
            density=True,
            histtype="step",
            lw=1.5,
            label=f"within step {r['step']} (mean {c.mean():.2f})",
        )
    if "cos_across" in res:
        c = res["cos_across"]
        ax.hist(
            c,
            bins=bins,
            density=True,
            histtype="step",
            lw=1.5,
            ls="--",
            label=f"across the two steps (mean {c.mean():.2f})",
        )
    r0 = res["within"][0]
    ax.set(
        xlabel="cosine similarity of rank-1 terms X[T]ᵀ(PK)[T]",
        ylabel="density",
        title=title or f"Fig. 4 style: layer {r0['layer']} head {r0['head']} (0-based)",
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    from experiments.plot_run import save_figure

    return save_figure(fig, out)


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m experiments.lowrank", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "snapshots", nargs="+", help="one or two .npz files from train.probes.save_snapshot"
    )
    ap.add_argument("--out", default=None, help="histogram PNG")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if len(args.snapshots) > 2:
        ap.error("give one or two snapshots")
    res = analyze(
        [load_snapshot(p) for p in args.snapshots], seed=args.seed, max_tokens=args.max_tokens
    )
    print_table(res)
    if args.out:
        print(plot(res, args.out))
    return res


if __name__ == "__main__":
    main()
