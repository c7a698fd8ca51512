"""The search for a setting in which FA2-numerics training fails at the loss, and standard attention
does not: the settings screened, the criteria, and the verdict computed from raw metrics.

    python -m experiments.search settings                 # the registry of settings
    python -m experiments.search overrides SETTING        # its config overrides, one a line
    python -m experiments.search verdict RUN_DIR [...] [--md FILE]
    python -m experiments.search count RUN_DIR [...] --seeds 0,2,3 [--arm paper]   # a reliability stage's decision
    python -m experiments.search onsets RUN_DIR [...] [--from 1000]   # runaway onsets, a hazard estimate
    python -m experiments.search series RUN_DIR [...] [--window 500]  # probe series, loss, grad norms

A setting is a set of config overrides on a preset (default small-gpu); arms come from
experiments/arms.py. The design of each stage — which settings, arms, seeds and steps, and what
advances a setting — is committed under results/search/ before its runs; every execution is kept
and counted there. Runs are made on the GPU with experiments/gpu/repro_seq.sh
(``VARIANT=SETTING OVERRIDES="$(python -m experiments.search overrides SETTING)"``).

The loss failure (fixed before any run): with m_t the mean training loss over steps t−49 … t and
R_t the lowest m_s since the end of warmup, the run fails at the first step t after warmup + 100
where m ≥ 1.5·R holds for 100 consecutive steps; a non-finite loss or the trainer's divergence
stop is a failure too. The logit runaway (the precursor): layer 2's (0-based L1) max attention
logit at the last probe ≥ 10× the same seed's standard arm in the same setting.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

SETTINGS: dict[str, tuple[str, ...]] = {
    # the reproduction's setting: the logit runaway by step 4,000 in about 4 of 10 executions
    "base": (),
    "lr1.5e-3": ("optim.lr=1.5e-3",),
    "lr1.5e-3-noclip": ("optim.lr=1.5e-3", "optim.clip=none"),
    "lr1e-3-noclip": ("optim.clip=none",),
    "lr1.25e-3-w250": ("optim.lr=1.25e-3", "optim.warmup_steps=250"),
    # stage 2: more optimizer steps inside 5 H200-minutes by fewer tokens a step or fewer layers
    "b16": ("data.batch_size=16",),
    "b8": ("data.batch_size=8",),
    "b16-l6": ("data.batch_size=16", "model.n_layer=6"),
    # stage 3: the reproduction's 32 K tokens a step, a cheaper step by fewer layers or bf16 logits
    "l6": ("model.n_layer=6",),
    "l4": ("model.n_layer=4",),
    "bf16-logits": ("model.logits_dtype=bfloat16",),
    # the head's backward GEMMs in bf16, FP32 logits and loss (a faster step, screened for the runaway)
    "bf16-head-grad": ("model.head_grad_dtype=bfloat16",),
}

WINDOW = 50  # steps in the running mean of the loss
FACTOR = 1.5  # failure: the running mean this many times its lowest value since warmup
SUSTAIN = 100  # … for this many consecutive steps
SETTLE = 100  # steps after warmup before the rule applies
LOGIT_FACTOR = 10.0


def overrides(name: str) -> list[str]:
    if name not in SETTINGS:
        raise KeyError(f"unknown setting {name!r}; known: {', '.join(SETTINGS)}")
    return list(SETTINGS[name])


def loss_failure(steps, losses, warmup: int, diverged_at=None):
    """The first step of a loss failure (module docstring), or None. ``steps``/``losses``: the
    per-step training loss in step order."""
    if diverged_at is not None:
        return int(diverged_at)
    for s, x in zip(steps, losses):
        if not math.isfinite(x):
            return int(s)
    start, lowest, run_from = warmup + SETTLE, math.inf, None
    window = []
    for s, x in zip(steps, losses):
        window.append(x)
        if len(window) > WINDOW:
            window.pop(0)
        if len(window) < WINDOW or s <= warmup:
            continue
        m = sum(window) / WINDOW
        lowest = min(lowest, m)
        if s < start:
            continue
        if m >= FACTOR * lowest:
            run_from = s if run_from is None else run_from
            if s - run_from + 1 >= SUSTAIN:
                return int(run_from)
        else:
            run_from = None
    return None


def run_record(run_dir) -> dict:
    """What the verdict needs from one run folder (config.json, summary.json, metrics)."""
    from train.gpt2 import read_metrics

    run_dir = Path(run_dir)
    cfg = json.loads((run_dir / "config.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text()) \
        if (run_dir / "summary.json").exists() else {}
    recs = read_metrics(run_dir)
    steps = [r["step"] for r in recs if "loss" in r]
    losses = [r["loss"] for r in recs if "loss" in r]
    probes = [(r["step"], r["max_logit/L1"]) for r in recs if r.get("max_logit/L1") is not None]
    warmup = cfg["optim"]["warmup_steps"]
    return {"run": run_dir.name, "steps": steps[-1] if steps else 0,
            "loss_failure": loss_failure(steps, losses, warmup, summary.get("diverged_at")),
            "probes": dict(probes), "last_probe": probes[-1] if probes else None,
            "max_probe": max((v for _, v in probes), default=None),
            "final_loss": sum(losses[-WINDOW:]) / min(len(losses), WINDOW) if losses else None}


def verdict(run_dirs) -> list[dict]:
    """One row per run: loss failure, layer 2's max logit, and its ratio to the standard arm of
    the same seed among ``run_dirs`` (folders named ``<arm>-s<seed>``) at the last probe step both
    reached."""
    rows = [run_record(d) for d in run_dirs]
    by_name = {r["run"]: r for r in rows}
    for r in rows:
        arm, _, seed = r["run"].rpartition("-s")
        ctrl = by_name.get(f"standard-s{seed}")
        ratio, at = None, None
        common = sorted(set(r["probes"]) & set(ctrl["probes"])) if ctrl else []
        if common and ctrl["probes"][common[-1]]:
            at = common[-1]
            ratio = r["probes"][at] / ctrl["probes"][at]
        r["arm"], r["seed"], r["ratio_to_standard"], r["ratio_at"] = arm, seed, ratio, at
        r["runaway"] = ratio is not None and ratio >= LOGIT_FACTOR and arm != "standard"
    return rows


STANDARD_CEILING = 100.0  # a standard execution at or above this layer-2 max logit fails the setting


def count(rows, seeds, *, arm="fa2", loss_need=6, runaway_need=7, futility_after=2) -> dict:
    """A reliability stage's decision (results/search/stage4.md) from ``verdict`` rows: among the
    ``arm`` executions of ``seeds``, how many failed at the loss and how many ran away, whether a
    ``standard`` execution failed (at the loss, or a last probe ≥ STANDARD_CEILING), and whether
    the futility stop holds (``futility_after`` ``arm`` executions with no loss failure and every
    probe below STANDARD_CEILING, judged without the ``standard`` arm). Keys name the arm."""
    seeds = [str(x) for x in seeds]
    by = {(r["arm"], r["seed"]): r for r in rows}
    mine = [by[(arm, x)] for x in seeds if (arm, x) in by]
    std = [by[("standard", x)] for x in seeds if ("standard", x) in by]
    loss = sum(r["loss_failure"] is not None for r in mine)
    runaway = sum(bool(r["runaway"]) for r in mine)
    judged = sum(r["ratio_to_standard"] is not None for r in mine)
    flat = sum(r["loss_failure"] is None and (r["max_probe"] or 0.0) < STANDARD_CEILING for r in mine)
    std_failed = [r["run"] for r in std if r["loss_failure"] is not None
                  or (r["last_probe"] is not None and r["last_probe"][1] >= STANDARD_CEILING)]
    n = len(seeds)
    if std_failed:
        decision = "the standard arm failed: no reproducer"
    elif len(mine) == n and len(std) == n and loss >= loss_need:
        decision = "loss-failure reproducer"
    elif len(mine) == n and len(std) == n and runaway >= runaway_need:
        decision = "runaway reproducer"
    elif flat >= futility_after:
        decision = "futility stop"
    elif len(mine) == n and len(std) == n:
        decision = "neither"
    else:
        decision = "undecided"
    return {"seeds": n, f"{arm}_made": len(mine), "standard_made": len(std),
            f"{arm}_loss_failures": loss, f"{arm}_runaways": runaway, f"{arm}_judged": judged,
            f"{arm}_flat": flat, "standard_failed": std_failed, "decision": decision}


ONSET_LOGIT = 300.0  # about 10x a standard execution's layer-2 max logit (29-36 at step 4,000)


def _poisson_cdf(k: int, mu: float) -> float:
    term = total = math.exp(-mu)
    for i in range(1, k + 1):
        term *= mu / i
        total += term
    return total


def _poisson_interval(k: int, level: float = 0.95) -> tuple[float, float]:
    """The exact (Garwood) interval for a Poisson mean from ``k`` events, by bisection."""
    alpha = (1.0 - level) / 2

    def solve(f):  # f increasing in mu, root in [0, big]
        lo, hi = 0.0, 10.0 * (k + 10)
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
        return (lo + hi) / 2

    lower = 0.0 if k == 0 else solve(lambda mu: (1 - _poisson_cdf(k - 1, mu)) - alpha)
    upper = solve(lambda mu: alpha - _poisson_cdf(k, mu))
    return lower, upper


def onsets(records, *, start: int, threshold: float = ONSET_LOGIT,
           reliabilities=(0.5, 0.7, 0.8)) -> dict:
    """A runaway's onset per execution — the first probe with layer 2's max logit ≥ ``threshold``
    (None: none up to its last probe) — and, under a constant-hazard model from step ``start`` on
    (an exploratory summary, fitted to the executions given), the hazard per step with its exact 95 %
    interval and the horizon at which an execution would have run away with each probability.
    ``records``: ``run_record`` dicts."""
    rows, events, exposure = [], 0, 0
    for r in records:
        probes = sorted(r["probes"].items())
        if not probes:
            continue
        onset = next((s for s, v in probes if v >= threshold), None)
        end = onset if onset is not None else probes[-1][0]
        events += onset is not None
        exposure += max(end - start, 0)
        rows.append({"run": r["run"], "last_probe": probes[-1][0], "onset": onset})
    rate = events / exposure if exposure else None
    lo, hi = _poisson_interval(events)
    interval = (lo / exposure, hi / exposure) if exposure else None

    def horizon(lam, p):
        return None if not lam else start + math.log(1 / (1 - p)) / lam

    # a higher hazard reaches a reliability sooner: the interval's upper end gives the early horizon
    horizons = {p: (horizon(rate, p), horizon(interval[1], p) if interval else None,
                    horizon(interval[0], p) if interval else None) for p in reliabilities}
    return {"rows": rows, "events": events, "exposure_steps": exposure, "hazard": rate,
            "hazard_95": interval, "horizons": horizons, "start": start, "threshold": threshold}


def series(run_dir, *, window: int = 500) -> dict:
    """What a stage's results write out per execution, from its metrics: layer 2's max logit at
    every probe, and per ``window`` steps the mean training loss and the largest and median
    gradient norm (a last, shorter window where the run ends inside one)."""
    from train.gpt2 import read_metrics

    recs = read_metrics(run_dir)
    probes = [(r["step"], r["max_logit/L1"]) for r in recs if r.get("max_logit/L1") is not None]
    train = [r for r in recs if "loss" in r]
    windows = []
    if train:
        last = train[-1]["step"]
        for lo in range(0, last, window):
            rows = [r for r in train if lo < r["step"] <= lo + window]
            if not rows:
                continue
            norms = sorted(r["grad_norm"] for r in rows if "grad_norm" in r)
            windows.append({"steps": (lo + 1, min(lo + window, last)),
                            "loss": sum(r["loss"] for r in rows) / len(rows),
                            "grad_norm_max": norms[-1] if norms else None,
                            "grad_norm_median": norms[len(norms) // 2] if norms else None})
    return {"run": Path(run_dir).name, "probes": probes, "windows": windows}


def series_markdown(results) -> str:
    """``series`` of several runs as the lines a stage's results file quotes."""
    fmt = lambda v: f"{v:,.0f}" if v >= 100 else f"{v:.3g}"
    out = []
    for res in results:
        pr = res["probes"]
        first = f" from step {pr[0][0]:,} every {pr[1][0] - pr[0][0]:,}" if len(pr) > 1 else ""
        out.append(f"- `{res['run']}`, layer 2's max logit{first}: " + " ".join(fmt(v) for _, v in pr))
        w = res["windows"]
        if w:
            out.append(f"  training loss per {w[0]['steps'][1] - w[0]['steps'][0] + 1:,} steps: "
                       + " ".join(f"{x['loss']:.2f}" for x in w))
            out.append("  largest / median gradient norm: " + " ".join(
                f"{x['grad_norm_max']:.2f}/{x['grad_norm_median']:.2f}" for x in w
                if x["grad_norm_max"] is not None))
    return "\n".join(out) + "\n"


def markdown(rows) -> str:
    """``verdict`` rows as a table; "runaway" is "—" where no standard execution of the seed was
    there to judge against."""
    num = lambda x, f="{:,.1f}": "—" if x is None else f.format(x)
    lines = ["| run | steps | loss failure at | mean loss, last 50 | L1 max logit, last probe | "
             "largest probe | ÷ standard (at step) | runaway |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lp = r["last_probe"]
        at = "" if r["ratio_at"] is None else f" ({r['ratio_at']:,})"
        lines.append(f"| {r['run']} | {r['steps']:,} | {num(r['loss_failure'], '{:,}')} | "
                     f"{num(r['final_loss'], '{:.3f}')} | "
                     f"{'—' if lp is None else f'{lp[1]:,.1f} at {lp[0]:,}'} | "
                     f"{num(r['max_probe'])} | {num(r['ratio_to_standard'])}{at} | "
                     f"{'—' if r['ratio_to_standard'] is None else 'yes' if r['runaway'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("settings")
    o = sub.add_parser("overrides")
    o.add_argument("setting")
    v = sub.add_parser("verdict")
    v.add_argument("runs", nargs="+")
    v.add_argument("--md", default=None)
    c = sub.add_parser("count", help="a reliability stage's counts and decision (stage4.md)")
    c.add_argument("runs", nargs="+")
    c.add_argument("--seeds", required=True, help="comma-separated seeds of the stage, e.g. 0,2,3")
    c.add_argument("--arm", default="fa2", help="the arm whose reliability is counted (default fa2)")
    e = sub.add_parser("series", help="per execution: layer 2's max logit at every probe, the "
                       "mean loss and gradient norms per window")
    e.add_argument("runs", nargs="+")
    e.add_argument("--window", type=int, default=500)
    n = sub.add_parser("onsets", help="each execution's runaway onset and a constant-hazard "
                       "estimate of the horizon a reliability needs (exploratory)")
    n.add_argument("runs", nargs="+")
    n.add_argument("--from", dest="start", type=int, default=1000,
                   help="the step the hazard is counted from (default 1000)")
    n.add_argument("--threshold", type=float, default=ONSET_LOGIT)
    args = ap.parse_args(argv)
    if args.cmd == "onsets":
        records = [dict(run_record(d), run=str(d).rstrip("/")) for d in args.runs]
        res = onsets(records, start=args.start, threshold=args.threshold)
        fmt = lambda x: "—" if x is None else f"{x:,.0f}"
        print(f"| run | last probe | onset (layer 2 max logit >= {res['threshold']:g}) |\n|---|---|---|")
        for r in res["rows"]:
            print(f"| {r['run']} | {r['last_probe']:,} | {fmt(r['onset'])} |")
        lo, hi = res["hazard_95"] or (None, None)
        print(f"\n{res['events']} onsets in {res['exposure_steps']:,} steps at risk from step "
              f"{res['start']:,}: hazard {res['hazard'] or 0:.3g} per step (95 % {lo or 0:.3g} – {hi or 0:.3g})")
        for p, (mid, early, late) in res["horizons"].items():
            print(f"P(onset by step T) = {p:.0%}: T = {fmt(mid)} (95 %: {fmt(early)} – {fmt(late)})")
        return
    if args.cmd == "series":
        print(series_markdown([series(d, window=args.window) for d in args.runs]), end="")
        return
    if args.cmd == "count":
        res = count(verdict(args.runs), args.seeds.split(","), arm=args.arm)
        for key, value in res.items():
            print(f"{key:18s} {value}")
        return
    if args.cmd == "settings":
        for name, ovr in SETTINGS.items():
            print(f"{name:20s} {' '.join(ovr) or '(the preset)'}")
    elif args.cmd == "overrides":
        print("\n".join(overrides(args.setting)))
    else:
        # rows by run name whatever order the shell's glob gave (it follows the locale)
        text = markdown(verdict(sorted(args.runs, key=lambda p: Path(p).name)))
        print(text, end="")
        if args.md:
            Path(args.md).write_text(text)


if __name__ == "__main__":
    main()
