"""A/B: variants of the kernels timed side by side in one process, interleaved.

    python -m bench.ab prepare REV                      # here: writes build/ab/REV/jax_flash (git archive)
    python -m bench.ab run [--old build/ab/REV] [--variants new,new:stable,cudnn,old]
        [--entries FILE.json] [--shapes 4x8192x16x128] [--passes fwd+bwd] [--rounds 5] [--reps 10]
        [--out FILE.json]                               # on the GPU (carry build/ab)

Variants: ``new`` (the working tree), ``old`` (the revision under ``--old``), ``cudnn``
(``jax.nn.dot_product_attention``); ``:stable`` adds the stable shift, ``@NAME`` launches with the
tuning entry NAME of ``--entries`` (a JSON object NAME → entry, as in jax_flash/pallas/tuning.json)
instead of the shipped table, e.g. ``new@bwd128:stable``.

Timings of one ~1-ms configuration spread by up to 17 % between runs (docs/PERF_NOTES.md), so
variants are compared within one process, interleaved: each round times every variant ``--reps``
times; a variant's figure is the median over all its rounds. Records as bench.attention's plus
``"variant"``; the log gives each variant's time relative to the first.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import subprocess
import sys
import time
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


def parse_variant(spec: str):
    """'new@NAME:stable' -> ('new', 'NAME', True)."""
    base, _, flags = spec.partition(":")
    if flags not in ("", "stable"):
        raise ValueError(f"variant {spec!r}: only ':stable' may follow")
    version, _, entry = base.partition("@")
    if version not in ("new", "old", "cudnn"):
        raise ValueError(f"variant {spec!r}: version must be new, old or cudnn")
    if version == "cudnn" and (entry or flags):
        raise ValueError(f"variant {spec!r}: cudnn takes no entry or flag")
    return version, entry or None, flags == "stable"


def _attention_fn(spec, modules, entries, causal, policy):
    import jax

    version, entry, stable = parse_variant(spec)
    if version == "cudnn":
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                            implementation="cudnn")
    mod = modules[version]
    if entry is not None and entry not in entries:
        raise KeyError(f"variant {spec!r}: no entry {entry!r} in --entries")
    tuning = importlib.import_module(f"{mod.__name__}.pallas.tuning")

    def f(q, k, v):  # the override is read while jit traces this
        with tuning.override(entries[entry]) if entry else contextlib.nullcontext():
            return mod.attention(q, k, v, causal=causal, policy=policy, stable=stable)

    return f


def run(old_root, shapes, passes, variants, rounds, reps, entries=None, causal=True, policy="fa2",
        log=print, out=None):
    import jax
    import jax.numpy as jnp

    import jax_flash as new

    from .attention import _jax_pass, pass_flops

    modules = {"new": new}
    if any(parse_variant(s)[0] == "old" for s in variants):
        modules["old"] = load_old(old_root)
    entries = entries or {}
    records = []
    for shape in shapes:
        rng = np.random.default_rng(0)
        q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3))
        for pss in passes:
            fns = {}
            for spec in variants:
                f = _jax_pass(_attention_fn(spec, modules, entries, causal, policy), pss)
                try:  # compile + warm-up
                    jax.block_until_ready(f(q, k, v))
                    jax.block_until_ready(f(q, k, v))
                except Exception as e:  # e.g. shared memory exceeded: reported, not fatal
                    log(f"{spec} {shape} {pss}: failed: {type(e).__name__}: {str(e)[:200]}")
                    continue
                fns[spec] = f
            times = {spec: [] for spec in fns}
            for _ in range(rounds):
                for spec, f in fns.items():
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        jax.block_until_ready(f(q, k, v))
                        times[spec].append(time.perf_counter() - t0)
            ms = {spec: float(np.median(t)) * 1e3 for spec, t in times.items()}
            first = next(iter(ms.values()), None)
            for spec in fns:
                version, _, stable = parse_variant(spec)
                records.append(dict(
                    impl="cudnn" if version == "cudnn" else f"jax_flash@{version}",
                    policy=None if version == "cudnn" else policy,
                    stable=None if version == "cudnn" else stable, variant=spec,
                    shape=list(shape), causal=causal, **{"pass": pss}, ms=ms[spec],
                    tflops=pass_flops(shape, causal, pss) / ms[spec] / 1e9,
                    jax_version=jax.__version__, device=jax.devices()[0].device_kind))
                log(f"{'x'.join(map(str, shape))} {pss} {spec:>24}: {ms[spec]:8.3f} ms  "
                    f"×{ms[spec] / first:.3f} of {next(iter(ms))}")
            if out:  # after every case, so a cut-off run keeps what it measured
                Path(out).write_text(json.dumps(records, indent=1))
    return records


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("rev")
    r = sub.add_parser("run")
    r.add_argument("--old", default=None)
    r.add_argument("--variants", default="old,new")
    r.add_argument("--entries", default=None, help="JSON file: NAME -> tuning entry")
    r.add_argument("--shapes", default="4x8192x16x128")
    r.add_argument("--passes", default="fwd+bwd")
    r.add_argument("--rounds", type=int, default=5)
    r.add_argument("--reps", type=int, default=10)
    r.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        print(prepare(args.rev))
        return
    entries = json.loads(Path(args.entries).read_text()) if args.entries else None
    run(args.old, [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")],
        args.passes.split(","), args.variants.split(","), args.rounds, args.reps, entries=entries,
        out=args.out)


if __name__ == "__main__":
    main()
