"""The executions a pre-registered design still needs, and the device command that makes the next.

    python -m experiments.queue list                      # the queues and their designs
    python -m experiments.queue status NAME               # every execution: made (how it ended) or left
    python -m experiments.queue next NAME [--gpus N] [--seconds 590]   # the next call's command
    python -m experiments.queue collect NAME DIR          # a call's returned runs into the design's folder
    python -m experiments.queue refresh NAME              # its tables and figures from the raw metrics

A queue is a design's executions in the order the design fixes (arm, seed, steps, the time limit of
each), its setting (``experiments.search`` settings: VARIANT and OVERRIDES of
experiments/gpu/repro_seq.sh) and its results folder. ``next`` packs the first executions not yet
made into one call: on one GPU as many as fit ``--seconds`` with their limits (executions of one
limit share an experiments/gpu/setting_seq.sh command), on N GPUs one lane each with
experiments/gpu/lanes.sh.
``collect`` copies the runs that come back (``repro-<variant>/<run>/`` or the lanes' ``lanes.tgz``)
into the folder and never overwrites one: an execution cut by its limit that the design has made
again is moved to ``cut/`` first, so that every execution made stays listed. Then it rewrites the
design's tables and figures from the raw metrics (``refresh``: the commands its results index
gives), so that what lands with new executions is counted with them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tarfile
import tempfile
from pathlib import Path

CONFIRM_ARMS = ("paper", "paper-stable", "fa2", "fa2-stable", "fa2-dpp", "standard")
TWIN_ARMS = ("torch-flash-o", "torch-flash-dpp")
# limits per execution: two `paper`/`fa2`-family executions (3,000 steps of 6 layers: 170–270 s)
# fit a 600-s call; `standard` (about 90 ms a step) and a PyTorch-twin execution take one call each
# (the twin's 6-layer step takes 131-135 ms with its backward written out in PyTorch: 3,000 steps
# and its compilation in about 430 s of the 475 s that repro_seq.sh leaves it of 520)
LIMIT_S = {"standard": 400, "torch-flash-o": 520, "torch-flash-dpp": 520}
DEFAULT_LIMIT_S = 295


@dataclasses.dataclass(frozen=True)
class Queue:
    design: str  # the design's file, committed before its runs
    root: str  # where its runs are kept: <root>/<arm>-s<seed>/
    setting: str  # experiments.search setting (the runs' VARIANT)
    items: tuple  # (arm, seed, steps, limit_s) in the design's order
    remake_cut: bool  # an execution cut by its limit is made again once (else counted as cut)
    # the tables and figures made from the runs: (module, argv) with {root} (the runs' folder),
    # {dir} (its parent) and {runs} (every run folder, by name) filled in
    products: tuple = ()


_CONFIRM_JAX = ["--arms", "paper,paper-stable,fa2,fa2-stable,fa2-dpp,standard",
                "--seeds", "9,10,11,12,13,14,15,16", "--horizon", "3000"]
CONFIRM_PRODUCTS = (
    ("experiments.reproduce", ["executions", "{root}", *_CONFIRM_JAX, "--compare", "paper:paper-stable",
                               "--compare", "fa2:fa2-stable", "--compare", "fa2:fa2-dpp",
                               "--md", "{dir}/l6_count.md"]),
    ("experiments.reproduce", ["executions", "{root}", "--arms", "torch-flash-o,torch-flash-dpp,standard",
                               "--seeds", "9,10,11,12", "--horizon", "3000",
                               "--compare", "torch-flash-o:torch-flash-dpp", "--md", "{dir}/l6_twin_count.md"]),
    ("experiments.search", ["verdict", "{runs}", "--md", "{dir}/l6_loss.md"]),
    ("experiments.reproduce", ["executions", "{root}", *_CONFIRM_JAX, "--plot", "{dir}/l6_L1.png",
                               "--plot-loss", "{dir}/l6_loss.png"]),
)


def _confirm_items():
    items = []
    for seed in range(9, 17):
        items += [(arm, seed, 3000, LIMIT_S.get(arm, DEFAULT_LIMIT_S)) for arm in CONFIRM_ARMS]
        if seed <= 12:  # the twin after the JAX executions of its seed
            items += [(arm, seed, 3000, LIMIT_S.get(arm, DEFAULT_LIMIT_S)) for arm in TWIN_ARMS]
    return tuple(items)


QUEUES = {
    "stage6": Queue(design="results/search/stage6.md", root="results/search/l6", setting="l6",
                    items=tuple([("paper", s, 3000, 295) for s in (0, 2, 3, 4, 5, 6, 7, 8)]
                                + [("standard", s, 3000, 400) for s in (0, 2, 3, 4, 5, 6, 7, 8)]),
                    remake_cut=False),
    "confirm": Queue(design="results/confirm/design.md", root="results/confirm/l6", setting="l6",
                     items=_confirm_items(), remake_cut=True, products=CONFIRM_PRODUCTS),
}


def get(name: str) -> Queue:
    if name not in QUEUES:
        raise KeyError(f"unknown queue {name!r}; known: {', '.join(QUEUES)}")
    return QUEUES[name]


def run_name(arm: str, seed: int) -> str:
    return f"{arm}-s{seed}"


def state(run_dir: Path, steps: int) -> dict | None:
    """How an execution ended, from its folder: None if not made; else its last step and whether
    it is complete (reached ``steps``), diverged (the divergence stop) or cut (neither)."""
    from train.gpt2 import has_metrics, read_metrics

    if not has_metrics(run_dir):
        return None
    summary = run_dir / "summary.json"
    s = json.loads(summary.read_text()) if summary.exists() else {}
    last = max((r["step"] for r in read_metrics(run_dir) if "step" in r), default=0)
    if s.get("diverged_at") is not None:
        end = "diverged"
    elif last >= steps:
        end = "complete"
    else:
        end = "cut"
    return {"step": last, "end": end, "diverged_at": s.get("diverged_at")}


def status(q: Queue, root: Path | None = None) -> list[dict]:
    """One row per execution of the design, in its order; an execution a standing run already
    covers (a longer one of an earlier stage: ``steps`` reached) counts as made."""
    root = Path(root or q.root)
    rows = []
    for arm, seed, steps, limit in q.items:
        name = run_name(arm, seed)
        st = state(root / name, steps)
        remade = (root / "cut" / name).exists()
        pending = st is None or (st["end"] == "cut" and q.remake_cut and not remade)
        rows.append({"run": name, "arm": arm, "seed": seed, "steps": steps, "limit_s": limit,
                     "state": st, "made_again": remade, "pending": pending})
    return rows


def plan_call(rows: list[dict], gpus: int = 1, seconds: float = 590.0) -> list[list[dict]]:
    """The next call's executions, one list per GPU: the pending ones in order, each lane filled
    while the sum of its limits fits ``seconds`` (a lane keeps to one limit, as one repro_seq.sh
    command does)."""
    pending = [r for r in rows if r["pending"]]
    lanes: list[list[dict]] = [[] for _ in range(gpus)]
    for r in pending:
        placed = False
        for lane in lanes:
            if (not lane or lane[0]["limit_s"] == r["limit_s"]) and \
                    sum(x["limit_s"] for x in lane) + r["limit_s"] <= seconds:
                lane.append(r)
                placed = True
                break
        if not placed:
            break  # keep the design's order: nothing after an execution that did not fit
    return [lane for lane in lanes if lane]


def seq_command(q: Queue, lane: list[dict]) -> str:
    specs = " ".join(f"{r['arm']}:{r['seed']}:{r['steps']}" for r in lane)
    return f"bash experiments/gpu/setting_seq.sh {q.setting} {lane[0]['limit_s']} {specs}"


def command(q: Queue, lanes: list[list[dict]], total: float = 600.0) -> str:
    """The device command: OUT=$OUT and one setting_seq.sh call, or lanes.sh around one per GPU
    with ``total`` seconds in all (lanes.sh ends its lanes' executions 30 s before that and kills
    them 20 s before, so that its archive is always written: give it the call's whole limit)."""
    if not lanes:
        return ""
    if len(lanes) == 1:
        return "OUT=$OUT " + seq_command(q, lanes[0])
    inner = " ".join(f'"{seq_command(q, lane)}"' for lane in lanes)
    return f"OUT=$OUT bash experiments/gpu/lanes.sh {int(total)} {inner}"


def collect(q: Queue, src: Path, root: Path | None = None) -> list[str]:
    """Copy the runs under ``src`` (a call's returned folder: repro-<setting>/<run>/, or lanes.tgz
    holding g<i>/repro-<setting>/<run>/) into the queue's folder. Returns the runs copied. A run of
    the design already there is refused, unless it was cut and the design makes it again: then the
    cut one moves to cut/ first."""
    root = Path(root or q.root)
    src = Path(src)
    with tempfile.TemporaryDirectory() as tmp:
        sources = []
        if (src / "lanes.tgz").exists():
            with tarfile.open(src / "lanes.tgz") as tar:
                tar.extractall(tmp, filter="data")
            sources += sorted(Path(tmp).glob(f"g*/repro-{q.setting}"))
        if (src / f"repro-{q.setting}").is_dir():
            sources.append(src / f"repro-{q.setting}")
        if not sources:
            raise FileNotFoundError(f"no repro-{q.setting}/ or lanes.tgz under {src}")
        by_name = {run_name(a, s): st for a, s, st, _ in q.items}
        copied = []
        for base in sources:
            for run in sorted(p for p in base.iterdir() if p.is_dir()):
                if run.name not in by_name:
                    raise ValueError(f"{run.name} is not an execution of the queue ({q.design})")
                dest = root / run.name
                if dest.exists():
                    st = state(dest, by_name[run.name])
                    if not (q.remake_cut and st and st["end"] == "cut" and not (root / "cut" / run.name).exists()):
                        raise FileExistsError(f"{dest} exists: an execution is never overwritten")
                    (root / "cut").mkdir(parents=True, exist_ok=True)
                    shutil.move(str(dest), str(root / "cut" / run.name))
                shutil.copytree(run, dest)
                for f in dest.rglob("*"):
                    f.chmod(f.stat().st_mode | 0o200)
                copied.append(run.name)
    return copied


def refresh(q: Queue, root: Path | None = None) -> list[str]:
    """Run the queue's ``products`` commands on the runs in ``root``: its count tables, loss table
    and figures, written again from the raw metrics. Returns the files written."""
    import contextlib
    import importlib
    import io

    root = Path(root or q.root)
    runs = [str(p) for p in sorted(root.glob("*-s*"), key=lambda p: p.name) if p.is_dir()]
    written = []
    for module, argv in q.products:
        args = []
        for a in argv:
            args += runs if a == "{runs}" else [a.format(root=root, dir=root.parent)]
        with contextlib.redirect_stdout(io.StringIO()):  # each prints what it writes: not needed here
            importlib.import_module(module).main(args)
        written += [b for a, b in zip(args, args[1:]) if a in ("--md", "--plot", "--plot-loss")]
    return written


def status_markdown(q: Queue, rows: list[dict]) -> str:
    done = sum(not r["pending"] for r in rows)
    lines = [f"{q.design}: {done} of {len(rows)} executions made ({q.root})", "",
             "| run | steps | limit s | state |", "|---|---|---|---|"]
    for r in rows:
        st = r["state"]
        if st is None:
            what = "left"
        else:
            what = (f"diverged at {st['diverged_at']:,}" if st["end"] == "diverged"
                    else f"cut at {st['step']:,}" if st["end"] == "cut"
                    else "complete" if st["step"] == r["steps"] else f"complete ({st['step']:,} steps)")
            if r["pending"]:
                what += ": to be made again"
            if r["made_again"]:
                what += " (made again; the cut one in cut/)"
        lines.append(f"| {r['run']} | {r['steps']:,} | {r['limit_s']} | {what} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list")
    s = sub.add_parser("status")
    s.add_argument("name")
    n = sub.add_parser("next")
    n.add_argument("name")
    n.add_argument("--gpus", type=int, default=1)
    n.add_argument("--seconds", type=float, default=590.0,
                   help="the sum of a GPU's execution limits in one call")
    n.add_argument("--total", type=float, default=600.0, help="the call's limit (lanes.sh's total)")
    c = sub.add_parser("collect")
    c.add_argument("name")
    c.add_argument("dir", help="the folder a device call's files came back in")
    r = sub.add_parser("refresh")
    r.add_argument("name")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        for name, q in QUEUES.items():
            print(f"{name:8s} {len(q.items):3d} executions, setting {q.setting}, {q.design} → {q.root}")
        return
    try:
        q = get(args.name)
    except KeyError as e:
        ap.error(str(e))
    if args.cmd == "status":
        print(status_markdown(q, status(q)), end="")
    elif args.cmd == "next":
        lanes = plan_call(status(q), args.gpus, args.seconds)
        if not lanes:
            print(f"# every execution of {q.design} is made")
            return
        print("# " + "; ".join(", ".join(r["run"] for r in lane) for lane in lanes))
        print(command(q, lanes, args.total))
    elif args.cmd == "refresh":
        for f in refresh(q):
            print(f"wrote {f}")
    else:
        for name in collect(q, Path(args.dir)):
            print(f"{q.root}/{name}")
        for f in refresh(q):
            print(f"wrote {f}")


if __name__ == "__main__":
    main()
