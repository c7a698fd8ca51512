"""The layer-2 runaway in JAX: run arms of experiments/arms.py, then tabulate them.

    python -m experiments.reproduce run --arm fa2 --seed 0 --steps 3000 --out results/repro
        [--preset small-gpu]
    python -m experiments.reproduce table results/repro [--md results/repro/table.md]
    python -m experiments.reproduce probes results/repro/fa2-s1 [--steps 3000,4000] [--layer 1]
    python -m experiments.reproduce probe-stats results/repro/fa2-stable-s0 ... [--layers 1]
    python -m experiments.reproduce rerun RUN_A RUN_B   (two executions of one run: where they part)

Configuration (``--preset``, default small-gpu: GPT-2 small, 32×1024 tokens/step, AdamW (0.9, 0.95), wd 0,
clip 1, lr 1e-3 with 500 warmup then cosine over 600 k steps, bf16)) on the offline corpus, seed s for
init and data order (identical across arms of a seed). The causal-chain probe (train/probes.py) runs
every ``--probe-every`` steps on a fixed batch of 8 held-out windows. Layers are 0-based: the
paper's "layer 2" is L1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from experiments import arms

LAYER = 1  # the paper's layer 2


def run(args):
    import jax

    from train import config as config_lib
    from train import data as data_lib
    from train.gpt2 import train
    from train.probes import CausalChainProbe

    tokens = data_lib.load_tokens(args.data)
    run_dir = Path(args.out) / f"{args.arm}-s{args.seed}"
    cfg = config_lib.apply_overrides(config_lib.get_preset(args.preset), arms.overrides(args.arm) + [
        f"seed={args.seed}", f"data.seed={args.seed}", f"data.path={args.data}",
        f"max_steps={args.steps}", f"probe_every={args.probe_every}", f"eval_every={args.probe_every}",
        f"run_dir={run_dir}", f"checkpoint_every={args.checkpoint_every}", f"resume={args.resume}",
        f"progress={args.progress}"] + args.overrides)
    # A fixed probe batch (8 held-out windows), the same at every probe and in every arm.
    px, py = data_lib.fixed_batch(tokens.val, 8, cfg.data.seq_len or cfg.model.block_size, seed=7)
    chain = CausalChainProbe(n_seq=8, per_head=True)
    probes = [lambda step, model, batch: chain(step, model, (px, py))]
    if args.snapshot_steps:  # L1's q, k, v, dO for experiments/real_chain.py (CPU)
        from train.probes import LayerTensorProbe

        probes.append(LayerTensorProbe(run_dir / "tensors", (px, py), layer=LAYER,
                                       steps=[int(s) for s in args.snapshot_steps.split(",")],
                                       n_seq=args.snapshot_seqs))
    if args.compare_torch_at:  # GPU only: our "fa2" kernel vs PyTorch flash on the model's tensors
        from experiments.gpu.torch_compare import TorchFlashCompare

        steps = [int(s) for s in args.compare_torch_at.split(",")]
        probes.append(TorchFlashCompare((px, py), steps, layers=range(cfg.model.n_layer)))
    summary = train(cfg, tokens=tokens, probes=probes)
    summary["device"] = jax.devices()[0].device_kind
    summary["jax_version"] = jax.__version__
    # e.g. --xla_gpu_deterministic_ops=true: which executions of a run are repeatable
    summary["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    if summary.get("diverged_at") is not None:  # a result here, but the exit status says so
        from train.gpt2 import EXIT_DIVERGED

        print(f"diverged at step {summary['diverged_at']}: {summary['reason']}", file=sys.stderr)
        sys.exit(EXIT_DIVERGED)


def first_step_above(recs, key, threshold):
    for r in recs:
        if r.get(key) is not None and r[key] > threshold:
            return r["step"]
    return None


def at(recs, step, key):
    return next((r.get(key) for r in recs if r["step"] == step), None)


def _plain_step_times(recs):
    """Step times of ordinary steps (no probe or eval; the first few, which compile, left out)."""
    return [r["step_time_s"] for r in recs[5:]
            if "step_time_s" in r and "probe_time_s" not in r and "val_loss" not in r]


def mean_loss(recs, last: int, n: int = 100):
    """Mean training loss over steps last-n+1 … last (None unless all of them were recorded)."""
    vals = [r["loss"] for r in recs if "loss" in r and last - n < r["step"] <= last]
    return sum(vals) / n if len(vals) == n else None


def probe_overhead(recs):
    """Median probe call (after the first, which compiles) and its share of the steps between probes."""
    import statistics

    calls = [r["probe_time_s"] for r in recs if "probe_time_s" in r][1:]
    plain = _plain_step_times(recs)
    probe_steps = [r["step"] for r in recs if "probe_time_s" in r]
    if not calls or not plain or len(probe_steps) < 2:
        return {}
    every = probe_steps[1] - probe_steps[0]
    call, step = statistics.median(calls), statistics.median(plain)
    return {"probe s/call": call, "probe overhead": f"{100 * call / (every * step):.2f} %"}


def _run_dirs(roots):
    """(label, dir) of every run under the roots; a run in a sub-folder of a root (an archived
    batch, e.g. ``before-ln-fix/``) is labelled with its path relative to the root."""
    from train.gpt2 import METRICS_FILES

    found = []
    for root in map(Path, roots):
        for p in sorted(root.rglob("metrics.jsonl*")):
            if p.name in METRICS_FILES:
                found.append((str(p.parent.relative_to(root)), p.parent))
    return list(dict(found).items())


COMMON_STEPS = (2000, 3000, 4000)  # columns at common steps, so arms of different lengths compare


def table(args):
    rows = []
    from train.gpt2 import read_metrics

    for name, run_dir in _run_dirs(args.roots):
        recs = read_metrics(run_dir)
        summary = json.loads((run_dir / "summary.json").read_text()) \
            if (run_dir / "summary.json").exists() else {}
        probes = [r for r in recs if f"max_logit/L{LAYER}" in r]
        last = probes[-1] if probes else {}
        loss_at = {s: next((r["loss"] for r in recs if r["step"] == s and "loss" in r), None)
                   for s in (1000, 2000, 3000)}
        last_step = max((r["step"] for r in recs), default=0)
        peak = max(probes, key=lambda r: r[f"max_logit/L{LAYER}"]) if probes else {}
        vals = [r for r in recs if "val_loss" in r]
        low = min(vals, key=lambda r: r["val_loss"]) if vals else {}
        rows.append({
            "run": name, "steps": last_step,
            "L1 max logit >100 at": first_step_above(probes, f"max_logit/L{LAYER}", 100),
            "L1 max logit >1000 at": first_step_above(probes, f"max_logit/L{LAYER}", 1000),
            **{f"L1 max logit@{s}": at(probes, s, f"max_logit/L{LAYER}") for s in COMMON_STEPS},
            **{f"L1 max ‖W_Q‖₂@{s}": at(probes, s, f"wq_norm_max/L{LAYER}") for s in COMMON_STEPS},
            "last probe": last.get("step"),
            "last L1 max logit": last.get(f"max_logit/L{LAYER}"),
            "last L1 max ‖W_Q‖₂": last.get(f"wq_norm_max/L{LAYER}"),
            "last L1 tie frac": last.get(f"tie_frac/L{LAYER}"),
            "last L1 tie frac, bf16 S": last.get(f"tie_frac_bf16s/L{LAYER}"),
            **{f"loss@{s}": v for s, v in loss_at.items()},
            **{f"mean loss {s - 99}–{s}": mean_loss(recs, s) for s in (3000, 4000)},
            **{f"mean loss {a}–{b}": mean_loss(recs, b, b - a + 1) for a, b in args.loss_window},
            "L1 max logit, largest probe": peak.get(f"max_logit/L{LAYER}"),
            "largest probe at": peak.get("step"),
            "val loss min": low.get("val_loss"), "val loss min at": low.get("step"),
            "last val loss": vals[-1]["val_loss"] if vals else None,
            "step ms (median)": 1e3 * statistics.median(times) if (times := _plain_step_times(recs)) else None,
            "diverged at": summary.get("diverged_at") or f"none by {last_step}",
            **probe_overhead(recs),
        })
    cols = list(dict.fromkeys(c for r in rows for c in r))
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else ("—" if v is None else str(v))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    text = "\n".join(lines)
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")


def head_probes(runs, tag, head, want):
    """Per run and probe step, one head of the layer: max logit, ‖W_Q‖₂, tied rows, Σ δ error, the
    W_Q-gradient error and −wq_grad_err / Σ δ err — the softmax-mean score S̄ the δ error would need
    to account for all of it (docs/MECHANISM.md §7: the δ part is −Σ ε·S̄)."""
    from train.gpt2 import read_metrics

    h = f"{tag}/H{head}"
    print(f"| run | step | max logit {h} | ‖W_Q‖₂ | tie rows | Σ δ err | ⟨W_Q, Δg⟩ | implied S̄ |")
    print("|---|---|---|---|---|---|---|---|")
    for run in runs:
        for r in read_metrics(run):
            if f"max_logit/{h}" not in r or (want and r["step"] not in want):
                continue
            d, g = r.get(f"delta_err/{h}"), r.get(f"wq_grad_err/{h}")
            implied = -g / d if d and g is not None else None
            print(f"| {run} | {r['step']} | {r[f'max_logit/{h}']:.4g} | {r[f'wq_norm/{h}']:.3g} | "
                  f"{100 * r[f'tie_frac/{h}']:.2f} % | " + (f"{d:+.2e}" if d is not None else "—") + " | "
                  + (f"{g:+.2e}" if g is not None else "—") + " | "
                  + (f"{implied:.3g}" if implied is not None else "—") + " |")


def probes(args):
    """Per run and probe step: the layer's max logit, its largest head's ‖W_Q‖₂ (and which head), the
    tie fractions (FP32 and bf16-rounded scores) and the δ error — the rows behind the write-up.
    With ``--head``: that head's series instead (``head_probes``)."""
    from train.gpt2 import read_metrics

    tag = f"L{args.layer}"
    if args.head is not None:
        return head_probes(args.runs, tag, args.head,
                           {int(s) for s in args.steps.split(",")} if args.steps else None)
    want = {int(s) for s in args.steps.split(",")} if args.steps else None
    print("| run | step | max logit | max-head ‖W_Q‖₂ (head) | tie rows | tie rows, bf16 S | Σ δ err "
          "| Σ δ err, tied rows | ⟨W_Q, Δg⟩ / \\|⟨W_Q, g⟩\\| |")
    print("|---|---|---|---|---|---|---|---|---|")
    fmt = lambda x, f: format(x, f) if x is not None else "—"
    for run in args.runs:
        for r in read_metrics(run):
            if f"max_logit/{tag}" not in r or (want and r["step"] not in want):
                continue
            heads = sorted(int(k.rsplit("H", 1)[1]) for k in r if k.startswith(f"wq_norm/{tag}/H"))
            top = max(heads, key=lambda h: r[f"wq_norm/{tag}/H{h}"]) if heads else None
            bf16 = r.get(f"tie_frac_bf16s/{tag}")
            # (the last two columns: probe metrics that older runs lack; "—" there)
            g, g_err = r.get(f"wq_grad/{tag}"), r.get(f"wq_grad_err/{tag}")
            rel = g_err / abs(g) if g and g_err is not None else None
            print(f"| {run} | {r['step']} | {r[f'max_logit/{tag}']:.4g} | "
                  f"{r[f'wq_norm_max/{tag}']:.3g} (H{top}) | {100 * r[f'tie_frac/{tag}']:.2f} % | "
                  + (f"{100 * bf16:.2f} %" if bf16 is not None else "—") + " | "
                  + fmt(r.get(f"delta_err/{tag}"), "+.2e") + " | "
                  + fmt(r.get(f"delta_err_tie/{tag}"), "+.2e") + " | " + fmt(rel, "+.2e") + " |")


def _mean_t_rms(xs):
    """Mean, its t statistic (mean / standard error; None for fewer than 2 values or zero spread)
    and root mean square of a list of numbers."""
    n = len(xs)
    mean = sum(xs) / n
    sd = statistics.stdev(xs) if n > 1 else 0.0
    return mean, (mean / (sd / n ** 0.5) if sd > 0 else None), (sum(x * x for x in xs) / n) ** 0.5


def probe_stats(recs, tag):
    """Over a run's probes of one layer: is the attention backward's error along W_Q biased, and how
    large is it against the gradient's own component? ``wq_grad_err`` = ⟨W_Q, g_lp − g_hp⟩ (< 0
    grows ‖W_Q‖); a probe is one batch, so a bias shows only as a mean that stands out of the
    probe-to-probe scatter (t). The same for Σ δ error, and the tied rows' share of |Σ δ error|."""
    probes = [r for r in recs if f"wq_grad_err/{tag}" in r]
    if not probes:
        return None
    err = [r[f"wq_grad_err/{tag}"] for r in probes]
    grad = [r[f"wq_grad/{tag}"] for r in probes]
    delta = [r[f"delta_err/{tag}"] for r in probes]
    tie = [r[f"delta_err_tie/{tag}"] for r in probes]
    e_mean, e_t, e_rms = _mean_t_rms(err)
    d_mean, d_t, d_rms = _mean_t_rms(delta)
    g_rms = _mean_t_rms(grad)[2]
    # the part through δ (−Σ ε·S̄); older runs lack it
    via = [r[f"wq_grad_err_delta/{tag}"] for r in probes if f"wq_grad_err_delta/{tag}" in r]
    via_rms = _mean_t_rms(via)[2] if len(via) == len(probes) else None
    return {"probes": len(probes), "wq_grad_err mean": e_mean, "t": e_t, "wq_grad_err rms": e_rms,
            "via δ rms": via_rms, "wq_grad rms": g_rms, "err/grad rms": e_rms / g_rms if g_rms else None,
            "Σ δ err mean": d_mean, "t (δ)": d_t, "Σ δ err rms": d_rms,
            "tied share of Σ δ err (abs)": sum(map(abs, tie)) / sum(map(abs, delta))
            if any(delta) else None}


def o_bias_stats(recs, tag):
    """Over a run's probes: the mean of (O_lp − O_hp)·sign(O_hp) (> 0: the O the backward's δ sees is
    rounded away from zero) and its t — a bias of the attention output that needs no tie."""
    away = [r[f"o_err_away/{tag}"] for r in recs if f"o_err_away/{tag}" in r]
    if len(away) < 2:
        return {}
    mean, t, _ = _mean_t_rms(away)
    return {"O err away mean": mean, "t (O)": t}


def probe_stats_cmd(args):
    from train.gpt2 import read_metrics

    rows = []
    for run in args.runs:
        recs = read_metrics(run)
        for layer in (int(x) for x in args.layers.split(",")):
            st = probe_stats(recs, f"L{layer}")
            rows.append({"run": str(run), "layer": f"L{layer}", **o_bias_stats(recs, f"L{layer}"),
                         **(st or {"probes": "— (no W_Q-gradient probe in this run)"})})
    cols = list(dict.fromkeys(c for r in rows for c in r))
    fmt = lambda v: f"{v:.2e}" if isinstance(v, float) and abs(v) < 1e-2 else (
        f"{v:.3g}" if isinstance(v, float) else ("—" if v is None else str(v)))
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |")


def rerun_diff(a, b, tag=f"L{LAYER}"):
    """Two executions of one run over the steps both logged (e.g. a GPU run resumed from a
    checkpoint, and the first attempt past that checkpoint): the first step whose loss differs, the
    largest loss difference, and the layer's max logit side by side at the common probe steps."""
    A = {r["step"]: r for r in a if "loss" in r}
    B = {r["step"]: r for r in b if "loss" in r}
    common = sorted(set(A) & set(B))
    differ = [s for s in common if A[s]["loss"] != B[s]["loss"]]
    probes = [(s, A[s][f"max_logit/{tag}"], B[s][f"max_logit/{tag}"]) for s in common
              if f"max_logit/{tag}" in A[s] and f"max_logit/{tag}" in B[s]]
    return {"steps": (common[0], common[-1]) if common else None,
            "first differing step": differ[0] if differ else None,
            "max |Δ loss|": max((abs(A[s]["loss"] - B[s]["loss"]) for s in common), default=0.0),
            "max logit (a, b)": probes}


def execution_cells(roots, arms, seeds, horizon=4000, control="standard", factor=10.0,
                    tag=f"L{LAYER}", control_roots=None):
    """Every execution of each arm and seed: ``roots[i]/<arm>-s<seed>`` is execution i + 1 (GPU runs
    of one configuration are not repeatable, so a repeat is another sample, not a check). Per cell:
    the L1 max logit at ``horizon`` (or the last probe before it, marked as such), the first step
    above 100, and whether it is ≥ ``factor``× the seed's control arm at the same step (the control's
    first execution found in ``control_roots``, default ``roots``: a set of replicates that has no
    control run of its own takes it from the first executions' folder). An execution the divergence
    stop ended before the horizon (``diverged_at`` in its summary.json) failed at the loss: it is
    counted, and on both endpoints — dropping it would drop an arm's worst outcomes. Returns
    {(arm, seed): [cell or None per root]} and per arm the counts (n, k, k100): of the n executions
    that reached the horizon or diverged before it, k are ≥ factor× the control or diverged and k100
    went above 100 or diverged."""
    from train.gpt2 import has_metrics, read_metrics

    key = f"max_logit/{tag}"

    def diverged_at(d):
        f = Path(d) / "summary.json"
        at = json.loads(f.read_text()).get("diverged_at") if f.exists() else None
        return at if at is not None and at <= horizon else None

    def probe_series(d):
        return [r for r in read_metrics(d) if r.get(key) is not None and r["step"] <= horizon]

    def ctrl_at(seed, step):
        for root in control_roots or roots:
            d = Path(root) / f"{control}-s{seed}"
            if has_metrics(d):
                pts = [r for r in probe_series(d) if r["step"] <= step]
                return pts[-1][key] if pts else None
        return None

    cells, counts = {}, {}
    for arm in arms:
        for seed in seeds:
            row = []
            for root in roots:
                d = Path(root) / f"{arm}-s{seed}"
                pts = probe_series(d) if has_metrics(d) else []
                if not pts:
                    row.append(None)
                    continue
                last = pts[-1]
                ctrl = ctrl_at(seed, last["step"])
                ratio = last[key] / ctrl if ctrl else None
                div = diverged_at(d)
                cell = {"step": last["step"], "max_logit": last[key], "ratio": ratio,
                        "first_above_100": first_step_above(pts, key, 100),
                        "diverged_at": div, "complete": last["step"] == horizon or div is not None}
                row.append(cell)
                if cell["complete"] and (ratio is not None or div is not None):
                    n, k, k100 = counts.get(arm, (0, 0, 0))
                    counts[arm] = (n + 1, k + int(div is not None or ratio >= factor),
                                   k100 + int(div is not None or cell["first_above_100"] is not None))
            cells[(arm, seed)] = row
    return cells, counts


def fisher_one_sided(ka, na, kb, nb):
    """P(at least ka of the ka + kb events fall in group a | the totals): Fisher's exact test that
    group a has the higher rate (hypergeometric tail)."""
    from math import comb

    k, n = ka + kb, na + nb
    return sum(comb(na, x) * comb(nb, k - x) for x in range(ka, min(k, na) + 1)) / comb(n, k)


def executions_cmd(args):
    arms, seeds = args.arms.split(","), [int(x) for x in args.seeds.split(",")]
    cells, counts = execution_cells(args.roots, arms, seeds, args.horizon, args.control, args.factor,
                                    control_roots=args.control_from)

    def fmt(c):
        if c is None:
            return "—"
        v = f"{c['max_logit']:,.0f}" if c["max_logit"] >= 100 else f"{c['max_logit']:.1f}"
        hit = c["diverged_at"] is not None or (c["ratio"] is not None and c["ratio"] >= args.factor)
        v = f"**{v}**" if hit else v
        where = "" if c["step"] == args.horizon else f" at {c['step']:,}"
        if c["diverged_at"] is not None:
            where += f", diverged at {c['diverged_at']:,}"
        first = f" (> 100 at {c['first_above_100']:,})" if c["first_above_100"] else ""
        return v + where + first

    lines = [f"L1 max logit at step {args.horizon:,} per execution (1 / 2 / …: "
             + ", ".join(args.roots) + f"); bold: ≥ {args.factor:g}× the seed's {args.control} arm"
             " or stopped by the divergence stop (counted as reaching both endpoints)",
             "", "| arm | " + " | ".join(f"seed {s}" for s in seeds)
             + f" | ≥ {args.factor:g}× {args.control} by {args.horizon:,} | > 100 by {args.horizon:,} |",
             "|---|" + "---|" * (len(seeds) + 2)]
    for arm in arms:
        n, k, k100 = counts.get(arm, (0, 0, 0))
        lines.append(f"| {arm} | " + " | ".join(" / ".join(fmt(c) for c in cells[(arm, s)])
                                                for s in seeds)
                     + (f" | {k} of {n} executions |" if arm != args.control else " | — |")
                     + f" {k100} of {n} |")
    # both endpoints: ≥ factor× the control (index 1 of a count) and above 100 (index 2)
    endpoints = ((1, f"≥ {args.factor:g}× {args.control} by {args.horizon:,}"),
                 (2, f"> 100 by {args.horizon:,}"))
    for spec in args.compare:
        a, b = ([x for x in g.split(",") if x] for g in spec.split(":"))
        for idx, label in endpoints:
            (na, ka), (nb, kb) = ((sum(counts.get(x, (0, 0, 0))[0] for x in g),
                                   sum(counts.get(x, (0, 0, 0))[idx] for x in g)) for g in (a, b))
            lines.append(f"\n{label}: {' + '.join(a)} {ka} of {na} vs {' + '.join(b)} {kb} of {nb}; "
                         f"one-sided Fisher exact p = {fisher_one_sided(ka, na, kb, nb):.3g}")
    text = "\n".join(lines)
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    if args.plot or args.plot_loss:
        from experiments.plot_run import plot_executions
        from experiments.search import WINDOW

        if args.plot:
            plot_executions(args.roots, arms, seeds, args.plot, horizon=args.horizon)
        if args.plot_loss:
            plot_executions(args.roots, arms, seeds, args.plot_loss, horizon=args.horizon,
                            metric="loss", window=WINDOW)


def rerun_cmd(args):
    from train.gpt2 import read_metrics

    d = rerun_diff(read_metrics(args.a), read_metrics(args.b), f"L{args.layer}")
    print(f"steps both ran: {d['steps']}; first step whose loss differs: {d['first differing step']}; "
          f"max |Δ loss| {d['max |Δ loss|']:.3g}")
    print(f"| step | L{args.layer} max logit, {args.a} | L{args.layer} max logit, {args.b} |\n|---|---|---|")
    for s, x, y in d["max logit (a, b)"]:
        print(f"| {s} | {x:.4g} | {y:.4g} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--arm", choices=sorted(arms.ARMS), required=True)
    r.add_argument("--preset", default="small-gpu", help="train/config.py preset the arm modifies")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--steps", type=int, default=3000)
    r.add_argument("--probe-every", type=int, default=250)
    r.add_argument("--checkpoint-every", type=int, default=0)
    r.add_argument("--resume", default="false",
                   help="false: a new run; true: continue it; auto: continue it if it has a checkpoint, "
                        "else start it (docs/TRAINING.md)")
    r.add_argument("--progress", default="false")
    r.add_argument("--data", default="data/full.npz")
    r.add_argument("--out", default="results/repro")
    r.add_argument("--compare-torch-at", default="",
                   help="steps (comma-separated) at which to compare with PyTorch flash (GPU + torch)")
    r.add_argument("--snapshot-steps", default="",
                   help="steps (comma-separated) at which to save L1's q, k, v, dO (train.probes."
                        "save_layer_tensors) under <run>/tensors/, for experiments/real_chain.py")
    r.add_argument("--snapshot-seqs", type=int, default=1, help="probe sequences per snapshot")
    r.add_argument("overrides", nargs="*", help="extra key=value overrides (e.g. model.n_layer=6)")
    t = sub.add_parser("table")
    t.add_argument("roots", nargs="+", help="folders of runs (sub-folders are searched too)")
    t.add_argument("--md", default=None)
    t.add_argument("--loss-window", action="append", default=[],
                   type=lambda w: tuple(int(x) for x in w.split("-")),
                   help="FIRST-LAST: a column with the mean training loss over those steps "
                        "(e.g. 3501-3747, where a run ended before 4,000); repeatable")
    e = sub.add_parser("executions", help="arm × seed × execution: L1 max logit at a fixed step, "
                       "and how many executions of each arm are ≥ 10× the seed's standard arm")
    e.add_argument("roots", nargs="+", help="one folder per execution (execution 1 first)")
    e.add_argument("--arms", default="fa2,standard,fa2-stable,fa2-dpp")
    e.add_argument("--seeds", default="0,1,2")
    e.add_argument("--horizon", type=int, default=4000)
    e.add_argument("--control", default="standard")
    e.add_argument("--control-from", nargs="+", default=None,
                   help="folders searched for the control arm (default: the roots)")
    e.add_argument("--factor", type=float, default=10.0)
    e.add_argument("--md", default=None)
    e.add_argument("--plot", default=None, help="PNG: one panel per seed")
    e.add_argument("--plot-loss", default=None,
                   help="PNG: the training loss's running mean (the loss-failure rule's), one panel per seed")
    e.add_argument("--compare", action="append", default=[],
                   help="ARMS:ARMS (comma-separated groups), e.g. fa2,fa2-stable:fa2-dpp — pooled "
                        "counts above 100 and a one-sided Fisher exact test")
    p = sub.add_parser("probes", help="per-probe rows of one layer (max logit, ‖W_Q‖₂, ties, δ error)")
    p.add_argument("runs", nargs="+")
    p.add_argument("--layer", type=int, default=LAYER)
    p.add_argument("--steps", default="", help="comma-separated probe steps (default: all)")
    p.add_argument("--head", type=int, default=None, help="one head's series (0-based)")
    ps = sub.add_parser("probe-stats", help="over all probes of a run: mean, t and rms of the W_Q-"
                        "gradient error and of Σ δ error, the tied rows' share")
    ps.add_argument("runs", nargs="+")
    ps.add_argument("--layers", default=str(LAYER), help="comma-separated, 0-based")
    rr = sub.add_parser("rerun", help="two executions of one run: where and how far they part")
    rr.add_argument("a")
    rr.add_argument("b")
    rr.add_argument("--layer", type=int, default=LAYER)
    args = ap.parse_args(argv)
    {"run": run, "table": table, "probes": probes, "probe-stats": probe_stats_cmd,
     "rerun": rerun_cmd, "executions": executions_cmd}[args.cmd](args)


if __name__ == "__main__":
    main()
