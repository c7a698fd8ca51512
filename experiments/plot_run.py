"""Paper-style panels from training runs' metrics.jsonl (written with train/probes.py's probes).

    python -m experiments.plot_run runs/flash runs/standard --out runs/compare.png [--layer 1]

Panels: loss (and val loss); the paper's Figure 3 — per-head ‖W_Q‖₂ of one layer over steps; its
Figure 5a — the cumulative Σ(δ_lp − δ_hp) of that layer; its Figure 9 — spectral norm by layer (max
over heads) over steps; the max attention logit and the fraction of tied rows of that layer. Several
runs are overlaid (one line style / colour per run) with labels from their config.json (attention kind,
policy, stable / β, δ mode, per-layer overrides). Layers and heads are 0-based (the paper's layer 2 is
``--layer 1``).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from train.gpt2 import has_metrics, read_metrics  # noqa: E402

STYLES = ["-", "--", ":", "-."]
SMOOTH = 25  # steps in the loss panel's running mean


def save_png(fig, out, dpi: int = 110) -> Path:
    """Write ``fig`` to ``out`` (folders made as needed) as a 256-colour palette PNG — line plots
    have few colours, and the palette makes the committed figures about a third of the size
    (every GPU call carries the repository) — and close it."""
    import io

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png")
    plt.close(fig)
    compact_png(buf, out)
    return out


def compact_png(src, dest) -> None:
    """``src`` (a path or file) re-encoded as ``save_png`` writes figures."""
    from PIL import Image

    Image.open(src).convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT).save(
        dest, format="png", optimize=True)


def save_figure(fig, out) -> Path:
    """Lay out, write ``out`` as ``save_png`` does and close ``fig``."""
    fig.tight_layout()
    return save_png(fig, out)


def read_run(run_dir) -> tuple[list[dict], dict]:
    run_dir = Path(run_dir)
    recs = read_metrics(run_dir)
    cfg_path = run_dir / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    return recs, cfg


def _spec_label(spec: dict) -> str:
    kind = spec.get("kind", "?")
    if kind != "flash":
        return kind
    s = f"flash/{spec.get('policy', 'fa2')}"
    if spec.get("stable"):
        s += f" stable β={spec.get('beta', 2.0):g}"
    if spec.get("delta", "o") != "o":
        s += f" δ={spec['delta']}"
    return s


def run_label(cfg: dict, run_dir) -> str:
    """ "flash/fa2 stable β=2 [L1: standard]" from a config.json dict (falls back to the dir name)."""
    model = cfg.get("model") or {}
    if "attention" not in model:
        return Path(run_dir).name
    label = _spec_label(model["attention"])
    for ov in model.get("attention_overrides") or ():
        if len(ov) == 2:
            label += f" [L{ov[0]}: {_spec_label(ov[1])}]"
        else:
            label += f" [L{ov[0]} H{','.join(map(str, ov[1]))}: {_spec_label(ov[2])}]"
    if model.get("dtype", "bfloat16") != "bfloat16":
        label += f" {model['dtype']}"
    return label


def series(recs, key):
    """(steps, values) of the records that have ``key``."""
    pts = [(r["step"], r[key]) for r in recs if key in r and r[key] is not None]
    if not pts:
        return np.zeros(0), np.zeros(0)
    s, v = zip(*pts)
    return np.asarray(s), np.asarray(v, float)


def running_sum(recs, key):
    """(steps, cumulative sum) of ``key`` over the records — rebuilt from the per-probe values, so a
    run resumed from a checkpoint (whose probe restarts its own running sum) still adds up."""
    s, v = series(recs, key)
    return s, np.cumsum(v)


def _indices(recs, pattern):
    """Sorted ints captured by ``pattern`` (one group) over all keys of all records."""
    rx = re.compile(pattern)
    found = {int(m.group(1)) for r in recs for k in r for m in [rx.fullmatch(k)] if m}
    return sorted(found)


def top_heads(recs, tag, n):
    """The ``n`` heads of layer ``tag`` with the largest ‖W_Q‖₂ at the last probe (all if n is None)."""
    heads = _indices(recs, rf"wq_norm/{tag}/H(\d+)")
    if n is None or not heads:
        return heads
    last = [r for r in recs if f"wq_norm/{tag}/H{heads[0]}" in r][-1]
    return sorted(sorted(heads, key=lambda h: -last[f"wq_norm/{tag}/H{h}"])[:n])


def running_mean(s, v, window: int):
    """(steps, mean of the last ``window`` values) from the ``window``-th value on."""
    if len(v) < window:
        return s[:0], v[:0]
    c = np.cumsum(np.concatenate([[0.0], v]))
    return s[window - 1:], (c[window:] - c[:-window]) / window


def plot_runs(run_dirs, out, *, layer: int = 1, labels=None, title=None, n_heads=None) -> Path:
    runs = [read_run(d) for d in run_dirs]
    labels = list(labels) if labels else [run_label(cfg, d) for (_, cfg), d in zip(runs, run_dirs)]
    if len(set(labels)) < len(labels):  # disambiguate identical configs by directory name
        labels = [f"{lab} ({Path(d).name})" for lab, d in zip(labels, run_dirs)]
    fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
    ax_loss, ax_f3, ax_f5, ax_f9, ax_logit, ax_tie = axes.ravel()
    run_colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    cmap = plt.get_cmap("tab20")
    tag = f"L{layer}"
    shown = set()  # heads already in the Fig. 3 legend

    for i, ((recs, _), lab) in enumerate(zip(runs, labels)):
        ls, col = STYLES[i % len(STYLES)], run_colors[i % len(run_colors)]
        s, v = series(recs, "loss")
        if len(v) > 2 * SMOOTH:  # per-step losses are noisy: a running mean keeps runs apart
            s, v = running_mean(s, v, SMOOTH)
        ax_loss.plot(s, v, ls, color=col, lw=1, label=lab)
        s, v = series(recs, "val_loss")
        if len(s):
            ax_loss.plot(s, v, "o", color=col, ms=3)
        # Figure 3: per-head ||W_Q||_2 of the chosen layer (colour = head, style = run)
        for h in top_heads(recs, tag, n_heads):
            s, v = series(recs, f"wq_norm/{tag}/H{h}")
            ax_f3.plot(s, v, ls, color=cmap(h % 20), lw=1.2, label=f"H{h}" if h not in shown else None)
            shown.add(h)
        # Figure 5a: cumulative delta error of the chosen layer
        s, v = running_sum(recs, f"delta_err/{tag}")
        ax_f5.plot(s, v, ls, color=col, lw=1.2, label=lab)
        # Figure 9: spectral norm by layer, max over heads (colour = layer, style = run)
        layers = _indices(recs, r"wq_norm_max/L(\d+)")
        for l in layers:
            s, v = series(recs, f"wq_norm_max/L{l}")
            ax_f9.plot(s, v, ls, color=cmap(l % 20), lw=1.2, label=f"L{l}" if i == 0 else None)
        s, v = series(recs, f"max_logit/{tag}")
        ax_logit.plot(s, v, ls, color=col, lw=1.2, label=lab)
        s, v = series(recs, f"tie_frac/{tag}")
        ax_tie.plot(s, 100 * v, ls, color=col, lw=1.2, label=lab)
        s, v = series(recs, f"tie_frac_bf16s/{tag}")  # ties among bf16-rounded scores
        if len(s):
            ax_tie.plot(s, 100 * v, ls, color=col, lw=0.8, marker="o", ms=3)

    ax_loss.set(title=f"training loss, running mean of {SMOOTH} (dots: val)", xlabel="step",
                ylabel="loss", ylim=(None, 6))
    ax_f3.set(
        title=f"Fig. 3: per-head ‖W_Q‖₂, layer {layer} (0-based)"
        + (f", top {n_heads} heads per run" if n_heads else ""),
        xlabel="step",
        ylabel="spectral norm",
    )
    ax_f5.set(
        title=f"Fig. 5a: cumulative Σ(δ_lp − δ_hp), layer {layer}",
        xlabel="step",
        ylabel="cumulative sum (probe steps)",
    )
    ax_f5.axhline(0, color="k", lw=0.5)
    ax_f9.set(title="Fig. 9: max-head ‖W_Q‖₂ by layer", xlabel="step", ylabel="spectral norm")
    ax_logit.set(title=f"max attention logit, layer {layer}", xlabel="step", ylabel="max S",
                 yscale="log")  # a runaway spans decades
    ax_tie.set(title=f"rows with a tied max, layer {layer} (dots: on bf16-rounded S)",
               xlabel="step", ylabel="% of rows")
    for ax in axes.ravel():
        ax.grid(alpha=0.3)
    ax_loss.legend(fontsize=7)
    ax_f5.legend(fontsize=7)
    if ax_f3.get_legend_handles_labels()[0]:
        ax_f3.legend(fontsize=6, ncol=2, title="colour: head; style: run", title_fontsize=6)
    if ax_f9.get_legend_handles_labels()[0]:
        ax_f9.legend(fontsize=6, ncol=2, title="colour: layer; style: run", title_fontsize=6)
    if title:
        fig.suptitle(title)
    return save_figure(fig, out)


def plot_executions(roots, arms, seeds, out, *, layer: int = 1, horizon=None,
                    metric: str = "logit", window: int = 50) -> Path:
    """Layer ``layer``'s max logit (``metric="logit"``) or the training loss's running mean over
    ``window`` steps (``metric="loss"``, the mean the loss-failure rule of experiments/search.py
    reads) over steps, one panel per seed (at most four a row): colour = arm, line style =
    execution (``roots[i]/<arm>-s<seed>`` is execution i + 1), a cross where the divergence stop
    ended an execution — how far repeated executions of one configuration part, beside how far the
    arms do. A seed with no execution yet keeps an empty, labelled panel."""
    if metric not in ("logit", "loss"):
        raise ValueError(f"metric {metric!r}: 'logit' or 'loss'")
    ncols = min(4, len(seeds))
    nrows = -(-len(seeds) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.6 * ncols, 4.6 * nrows), sharex=True,
                             sharey=True, squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax in axes.ravel()[len(seeds):]:
        ax.set_visible(False)
    for ax, seed in zip(axes.ravel(), seeds):
        made = False
        for a, arm in enumerate(arms):
            for e, root in enumerate(roots):
                d = Path(root) / f"{arm}-s{seed}"
                if not has_metrics(d):
                    continue
                made = True
                if metric == "loss":
                    s, v = running_mean(*series(read_metrics(d), "loss"), window)
                else:
                    s, v = series(read_metrics(d), f"max_logit/L{layer}")
                if horizon:
                    s, v = s[s <= horizon], v[s <= horizon]
                # the reference arm in black, so it never shares a hue with a flash arm
                color = "black" if arm == "standard" else colors[a % len(colors)]
                ax.plot(s, v, STYLES[e % len(STYLES)], color=color, lw=1.3,
                        label=f"{arm}, execution {e + 1}")
                summary = d / "summary.json"
                if len(s) and summary.exists() and json.loads(summary.read_text()).get("diverged_at"):
                    ax.plot(s[-1], v[-1], "x", color=color, ms=9, mew=2)
        ax.set(title=f"seed {seed}" + ("" if made else " (no execution yet)"), xlabel="step",
               yscale="log" if metric == "logit" else "linear")
        ax.grid(alpha=0.3)
        if made:
            ax.legend(fontsize=7)
    what = (f"max attention logit, layer {layer} (0-based)" if metric == "logit"
            else f"training loss, mean of the last {window} steps")
    for row in axes:
        row[0].set_ylabel(what)
    fig.suptitle(f"{what}, per execution "
                 "(colour: arm; style: execution; ×: ended by the divergence stop)")
    return save_figure(fig, out)


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m experiments.plot_run", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("runs", nargs="+", metavar="RUN_DIR")
    ap.add_argument("--out", required=True, help="output PNG")
    ap.add_argument(
        "--layer",
        type=int,
        default=1,
        help="layer for Fig. 3 / 5a / logit / tie panels "
        "(0-based; default 1 = the paper's layer 2)",
    )
    ap.add_argument(
        "--labels", nargs="*", default=None, help="one label per run (default: from config)"
    )
    ap.add_argument("--title", default=None)
    ap.add_argument("--heads", type=int, default=None,
                    help="Fig. 3: only each run's N heads with the largest final ‖W_Q‖₂")
    args = ap.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        ap.error("--labels needs one label per run")
    print(plot_runs(args.runs, args.out, layer=args.layer, labels=args.labels, title=args.title,
                         n_heads=args.heads))


if __name__ == "__main__":
    main()
