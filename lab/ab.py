"""A/B: variants of the kernels timed side by side in one process, interleaved.

    python -m lab.ab prepare REV                      # here: writes build/ab/REV/jax_flash (git archive)
    python -m lab.ab run [--old build/ab/REV] [--variants new,new:stable,cudnn,old]
        [--entries lab/entries.json] [--shapes 4x8192x16x128] [--passes fwd,bwd,fwd+bwd]
        [--rounds 5] [--reps 10] [--non-causal] [--warm-ms 0] [--repeat 1] [--out FILE.json]
    python -m lab.ab table FILE.json [...]            # markdown table of runs
    python -m lab.ab ratio FILE.json [...] [--variant new:stable] [--base new]  # paired ratio

Variants: ``new`` (the working tree), ``old`` (the revision under ``--old``), ``mosaic`` (the working
tree with ``launch={"fwd_kernel": "mosaic"}``; a call the Mosaic GPU forward does not cover fails),
``cudnn`` (``jax.nn.dot_product_attention``), ``cudnn_det`` (the same, its programs compiled with
XLA's ``xla_gpu_deterministic_ops``, under which XLA asks cuDNN for its deterministic backward),
``mgpu`` (JAX's own Mosaic GPU attention,
``jax.experimental.pallas.ops.gpu.attention_mgpu``: forward only when causal, a measure of what a
Mosaic GPU path can reach); ``:stable`` adds the stable shift; ``@NAME`` runs with entry NAME of
``--entries`` (launch fields passed as ``launch=``, ``block_q``/``block_k`` as call arguments)
instead of the shipped table's launch, e.g. ``new@k64:stable``. An entry's tiles change the numerics;
its launch fields do not (``jax_flash.Launch``).

Passes: ``fwd``, ``fwd+bwd`` and ``bwd`` (the backward alone, from residuals saved once per input:
beside ``fwd`` it shows whether a faster forward reaches fwd+bwd).

Timings of one configuration drift between processes by more than the differences an A/B looks
for, so variants are compared within one process, interleaved: each round times every variant
``--reps`` times; a variant's figure is the median over all its rounds, and ``ratio`` pairs two
variants round by round. Records as ``bench.attention``'s plus ``"variant"`` (and, for the working
tree's variants, the ``"launch"`` that ran); the log gives each variant's time relative to the first.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

AB_DIR = Path("build/ab")


def prepare(rev: str, out: Path | None = None) -> Path:
    """Extract ``jax_flash/`` of git revision ``rev`` into ``out`` (default build/ab/REV/)."""
    out = Path(out) if out is not None else AB_DIR / rev
    out.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", rev, "jax_flash"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out


def load_old(root: Path, name: str = "jax_flash_old"):
    """Import root/jax_flash as module ``name`` (its imports are relative, so it stays self-contained)."""
    pkg = Path(root) / "jax_flash"
    spec = importlib.util.spec_from_file_location(name, pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    if spec is None:
        raise FileNotFoundError(f"no package at {pkg}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


ENTRIES = Path(__file__).with_name("entries.json")
CALL_ARGS = ("block_q", "block_k")  # entry fields that are arguments of the call, not of the launch


def candidate_entries() -> dict:
    """Every candidate of ``lab/entries.json`` (NAME → launch fields and tile arguments)."""
    return json.loads(ENTRIES.read_text())


def split_entry(entry: dict) -> tuple[dict, dict]:
    """(call arguments, launch fields) of an entry."""
    return ({k: v for k, v in entry.items() if k in CALL_ARGS},
            {k: v for k, v in entry.items() if k not in CALL_ARGS})


# variants that are not jax_flash, and their records' impl names
IMPL_NAMES = {"cudnn": "cudnn", "cudnn_det": "cudnn_deterministic", "mgpu": "jax_mgpu_attention"}
REFERENCES = tuple(IMPL_NAMES)


def compiler_options(spec: str) -> dict | None:
    """XLA options a variant's timed programs are compiled with, as ``bench.attention`` compiles
    the implementation it names (``cudnn_det``: ``xla_gpu_deterministic_ops``; the rest none)."""
    from bench.attention import COMPILER_OPTIONS

    return COMPILER_OPTIONS.get(IMPL_NAMES.get(parse_variant(spec)[0]))


def parse_variant(spec: str):
    """'new@NAME:stable' -> ('new', 'NAME', True)."""
    base, _, flags = spec.partition(":")
    if flags not in ("", "stable"):
        raise ValueError(f"variant {spec!r}: only ':stable' may follow")
    version, _, entry = base.partition("@")
    if version not in ("new", "old", "mosaic", *REFERENCES):
        raise ValueError(f"variant {spec!r}: version must be new, old, mosaic, "
                         f"{', '.join(REFERENCES[:-1])} or {REFERENCES[-1]}")
    if version in REFERENCES and (entry or flags):
        raise ValueError(f"variant {spec!r}: {version} takes no entry or flag")
    return version, entry or None, flags == "stable"


def call_kwargs(spec: str, entries: dict, causal: bool = True, policy: str = "fa2") -> dict:
    """Keyword arguments of ``jax_flash.attention`` for a working-tree variant (``new``, ``mosaic``,
    with ``@NAME`` and ``:stable``): the entry's tiles as call arguments, its launch as ``launch=``
    (None without an entry: the shipped table's)."""
    version, entry, stable = parse_variant(spec)
    if entry is not None and entry not in entries:
        raise KeyError(f"variant {spec!r}: no entry {entry!r} in --entries")
    call, launch = split_entry(entries[entry]) if entry else ({}, None)
    if version == "mosaic":
        launch = {**(launch or {}), "fwd_kernel": "mosaic"}
    return dict(causal=causal, policy=policy, stable=stable, launch=launch, **call)


def _attention_fn(spec, modules, entries, causal, policy):
    import jax

    version, entry, stable = parse_variant(spec)
    if version in ("cudnn", "cudnn_det"):
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                            implementation="cudnn")
    if version == "mgpu":
        from jax.experimental.pallas.ops.gpu import attention_mgpu as mg

        # the launch its own benchmark favours at head_dim 64-128: 64-row blocks per warpgroup (two
        # warpgroups per program), 128 keys, a 2-deep TMA pipeline. Its shared-memory buffers are
        # float16 (jax 0.11.2: bfloat16 inputs fail), so run() gives it float16 copies of the inputs —
        # the same tensor-core rate as bfloat16.
        cfg = mg.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal)
        return lambda q, k, v: mg.attention(q, k, v, cfg)
    mod = modules["new" if version == "mosaic" else version]
    kw = call_kwargs(spec, entries, causal, policy)  # (checks the entry for every revision)
    if not hasattr(mod, "Launch"):  # a revision from before the launch argument
        return _attention_fn_table(mod, entries.get(entry), version == "mosaic", causal, policy,
                                   stable)
    return lambda q, k, v: mod.attention(q, k, v, **kw)


def _attention_fn_table(mod, entry, mosaic, causal, policy, stable):
    """Revisions before ``launch=`` chose launches and tiles with their ``tuning.override`` and
    ``forward_mosaic.force`` context managers, read while jit traces the call (kept so that
    ``old`` can be such a revision)."""
    tuning = importlib.import_module(f"{mod.__name__}.pallas.tuning")
    forward_mosaic = importlib.import_module(f"{mod.__name__}.pallas.forward_mosaic")

    def f(q, k, v):
        with contextlib.ExitStack() as scope:
            if entry:
                scope.enter_context(tuning.override(entry))
            if mosaic:
                scope.enter_context(forward_mosaic.force(True))
            return mod.attention(q, k, v, causal=causal, policy=policy, stable=stable)

    return f


def run(old_root, shapes, passes, variants, rounds, reps, entries=None, causal=True, policy="fa2",
        log=print, out=None, sync="call", warm_ms=0.0):
    import jax
    import jax.numpy as jnp

    import jax_flash as new

    from bench.attention import _jax_pass, pass_flops, timed_interleaved

    modules = {"new": new}
    if any(parse_variant(s)[0] == "old" for s in variants):
        modules["old"] = load_old(old_root)
    entries = entries or {}
    records = []
    for shape in shapes:
        rng = np.random.default_rng(0)
        q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3))
        f16 = tuple(x.astype(jnp.float16) for x in (q, k, v))
        args = {spec: f16 if parse_variant(spec)[0] == "mgpu" else (q, k, v) for spec in variants}
        for pss in passes:
            fns = {spec: _jax_pass(_attention_fn(spec, modules, entries, causal, policy), pss,
                                   compiler_options(spec)) for spec in variants}
            per_round = {}
            ms = timed_interleaved(fns, args, reps, rounds, sync=sync, per_round=per_round,
                                   log=lambda m, p=pss, sh=shape: log(f"{sh} {p} {m}"),
                                   warm_ms=warm_ms)
            first = next(iter(ms.values()), None)
            for spec in ms:
                version, _, stable = parse_variant(spec)
                ran = {}
                if version in ("new", "mosaic"):  # the launch after the plan's coverage check
                    ran["launch"] = new.plan(q, k, v, **call_kwargs(spec, entries, causal, policy)
                                             ).launch.to_dict()
                records.append(dict(
                    impl=IMPL_NAMES.get(version, f"jax_flash@{version}"),
                    policy=None if version in REFERENCES else policy,
                    stable=None if version in REFERENCES else stable, variant=spec,
                    shape=list(shape), causal=causal, **{"pass": pss}, ms=ms[spec],
                    tflops=pass_flops(shape, causal, pss) / ms[spec] / 1e9,
                    jax_version=jax.__version__, device=jax.devices()[0].device_kind, sync=sync,
                    **({"warm_ms": warm_ms} if warm_ms else {}), rounds_ms=per_round[spec], **ran))
                log(f"{'x'.join(map(str, shape))} {pss} {spec:>24}: {ms[spec]:8.3f} ms  "
                    f"×{ms[spec] / first:.3f} of {next(iter(ms))}")
            if out:  # after every case, so a cut-off run keeps what it measured
                Path(out).write_text(json.dumps(records, indent=1))
    return records


def _variant(rec):
    """A record's variant (records of the first runs lack the field: rebuilt from impl and stable)."""
    if "variant" in rec:
        return rec["variant"]
    return rec["impl"].partition("@")[2] + (":stable" if rec["stable"] else "")


def markdown(runs):
    """A table of interleaved runs: a row per (file, shape, pass), a column per variant; cells give ms
    and the ratio to the row's first variant. ``runs``: [(label, records)]."""
    runs = [(label, [dict(r, variant=_variant(r)) for r in recs]) for label, recs in runs]
    variants = list(dict.fromkeys(r["variant"] for _, recs in runs for r in recs))
    lines = ["| run | shape | pass | " + " | ".join(variants) + " |",
             "|---|---|---|" + "---|" * len(variants)]
    for label, recs in runs:
        for case in dict.fromkeys((tuple(r["shape"]), r["pass"]) for r in recs):
            got = {r["variant"]: r["ms"] for r in recs if (tuple(r["shape"]), r["pass"]) == case}
            ref = next(iter(got.values()))
            cells = [f"{got[v]:.3f} (×{got[v] / ref:.3f})" if v in got else "—" for v in variants]
            lines.append(f"| {label} | {'×'.join(map(str, case[0]))} | {case[1]} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def paired_ratio(records, variant, base, shape, pss, n_boot=10000, seed=0):
    """``variant``'s time over ``base``'s, paired by round (the same round of an interleaved run ran
    both on the same GPU state): (median of the per-round ratios, its 90 % bootstrap interval, rounds).
    Needs records with ``rounds_ms``."""
    got = {r["variant"]: r["rounds_ms"] for r in records
           if tuple(r["shape"]) == tuple(shape) and r["pass"] == pss and "rounds_ms" in r}
    if variant not in got or base not in got:
        raise KeyError(f"no per-round times for {variant!r} and {base!r} at {shape} {pss}")
    from bench.attention import paired_median

    med, interval = paired_median(got[variant], got[base], n_boot, seed)
    return med, interval, len(got[variant])


def _paired_rows(records, variant, base):
    """(shape × pass, median, 90 % interval, rounds) of ``paired_ratio`` for every (shape, pass) of
    ``records`` that has both variants' per-round times."""
    for shape, pss in dict.fromkeys((tuple(r["shape"]), r["pass"]) for r in records):
        try:
            med, interval, n = paired_ratio(records, variant, base, shape, pss)
        except KeyError:
            continue
        yield f"{'×'.join(map(str, shape))} | {pss}", med, interval, n


def ratio_lines(records, variant, base):
    """Markdown rows of ``paired_ratio`` for every (shape, pass) of ``records``."""
    lines = [f"| shape | pass | {variant} / {base}, median of rounds | 90 % interval | rounds |",
             "|---|---|---|---|---|"]
    for case, med, (lo, hi), n in _paired_rows(records, variant, base):
        lines.append(f"| {case} | ×{med:.4f} | ×{lo:.4f} … ×{hi:.4f} | {n} |")
    return "\n".join(lines) + "\n"


def runs_lines(runs, variant, base):
    """``ratio`` over several runs of the same design (``runs``: (name, records) pairs): each run's
    paired ratio per (shape, pass), then across the runs their range, median and how many read
    ≥ ×1 — one run's interval says nothing of the next run's."""
    head = f"| run | shape | pass | {variant} / {base}, median of rounds | 90 % interval | rounds |"
    lines = [head, "|---|---|---|---|---|---|"]
    per_case = {}
    for name, records in runs:
        for case, med, (lo, hi), n in _paired_rows(records, variant, base):
            per_case.setdefault(case, []).append(med)
            lines.append(f"| {name} | {case} | ×{med:.4f} | ×{lo:.4f} … ×{hi:.4f} | {n} |")
    for case, meds in per_case.items():
        n, at_least = len(meds), sum(m >= 1.0 for m in meds)
        lines.append(f"| {n} runs | {case} | median ×{float(np.median(meds)):.4f} | "
                     f"×{min(meds):.4f} … ×{max(meds):.4f} (range) | {at_least} of {n} ≥ ×1 |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("rev")
    r = sub.add_parser("run")
    r.add_argument("--old", default=None)
    r.add_argument("--variants", default="old,new")
    r.add_argument("--entries", default=str(ENTRIES), help="JSON file: NAME -> entry")
    r.add_argument("--shapes", default="4x8192x16x128")
    r.add_argument("--passes", default="fwd+bwd")
    r.add_argument("--rounds", type=int, default=5)
    r.add_argument("--reps", type=int, default=10)
    r.add_argument("--out", default=None)
    r.add_argument("--sync", choices=("call", "round"), default="call",
                   help="bench.attention.timed_interleaved: wait per call, or once per round of calls")
    r.add_argument("--non-causal", action="store_true", help="without the causal mask")
    r.add_argument("--warm-ms", type=float, default=0.0,
                   help="before each sample, the variant's calls back to back, untimed, this long")
    r.add_argument("--repeat", type=int, default=1,
                   help="this many whole runs one after the other, each to FILE-1.json, FILE-2.json"
                        " …: one run's ratio moves from the next's (read them with ratio FILE-*)")
    t = sub.add_parser("table", help="print the markdown table of result files")
    t.add_argument("files", nargs="+")
    pr = sub.add_parser("ratio", help="paired per-round ratio of two variants, with a 90 %% "
                        "interval; several files: each run's, then their range and median")
    pr.add_argument("files", nargs="+")
    pr.add_argument("--variant", default="new:stable")
    pr.add_argument("--base", default="new")
    args = ap.parse_args(argv)
    if args.cmd == "ratio":
        runs = [(Path(f).name, json.loads(Path(f).read_text())) for f in args.files]
        lines = (ratio_lines(runs[0][1], args.variant, args.base) if len(runs) == 1
                 else runs_lines(runs, args.variant, args.base))
        print(lines, end="")
        return
    if args.cmd == "prepare":
        print(prepare(args.rev))
        return
    if args.cmd == "table":
        print(markdown([(Path(f).name, json.loads(Path(f).read_text())) for f in args.files]), end="")
        return
    entries = json.loads(Path(args.entries).read_text())
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    for i in range(1, args.repeat + 1):
        out = args.out
        if out and args.repeat > 1:
            out = str(Path(out).with_name(f"{Path(out).stem}-{i}{Path(out).suffix}"))
        run(args.old, [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")],
            args.passes.split(","), args.variants.split(","), args.rounds, args.reps,
            entries=entries, causal=not args.non_causal, out=out, sync=args.sync,
            warm_ms=args.warm_ms)


if __name__ == "__main__":
    main()
