"""A/B: the kernels of an earlier revision against the working tree's, side by side in one process.

    python -m bench.ab prepare REV                      # here: writes build/ab/REV/jax_flash (git archive)
    python -m bench.ab run --old build/ab/REV [--shapes 4x8192x16x128] [--passes fwd,fwd+bwd]
        [--stable 0,1] [--rounds 5] [--reps 10] [--out FILE.json]   # on the GPU (carry build/ab)

Timings of one ~1-ms configuration spread by up to 17 % between runs (docs/PERF_NOTES.md), so a
change is judged in one process, old and new interleaved: each round times every variant ``--reps``
times; a variant's figure is the median over all its rounds. Records as bench.attention's, with
``"impl": "jax_flash@old"`` or ``"jax_flash@new"`` and the ratio new/old per case.
"""

from __future__ import annotations

import argparse
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


def _parse_shape(s):
    return tuple(int(x) for x in s.split("x"))


def run(old_root, shapes, passes, stables, rounds, reps, causal=True, policy="fa2"):
    import jax
    import jax.numpy as jnp

    import jax_flash as new

    from .attention import _jax_pass, pass_flops

    old = load_old(old_root)
    versions = {"old": old, "new": new}
    records = []
    for shape in shapes:
        rng = np.random.default_rng(0)
        q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3))
        for pss in passes:
            for stable in stables:
                fns = {tag: _jax_pass(lambda q, k, v, m=mod, s=stable: m.attention(
                    q, k, v, causal=causal, policy=policy, stable=s), pss)
                    for tag, mod in versions.items()}
                for f in fns.values():  # compile + warm-up
                    jax.block_until_ready(f(q, k, v))
                    jax.block_until_ready(f(q, k, v))
                times = {tag: [] for tag in fns}
                for _ in range(rounds):
                    for tag, f in fns.items():
                        for _ in range(reps):
                            t0 = time.perf_counter()
                            jax.block_until_ready(f(q, k, v))
                            times[tag].append(time.perf_counter() - t0)
                ms = {tag: float(np.median(t)) * 1e3 for tag, t in times.items()}
                flops = pass_flops(shape, causal, pss)
                for tag in fns:
                    records.append(dict(impl=f"jax_flash@{tag}", policy=policy, stable=stable,
                                        shape=list(shape), causal=causal, **{"pass": pss},
                                        ms=ms[tag], tflops=flops / ms[tag] / 1e9,
                                        jax_version=jax.__version__,
                                        device=jax.devices()[0].device_kind))
                print(f"{'x'.join(map(str, shape))} {pss} stable={int(stable)}: old {ms['old']:.3f} ms, "
                      f"new {ms['new']:.3f} ms, new/old {ms['new'] / ms['old']:.3f}", flush=True)
    return records


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("rev")
    r = sub.add_parser("run")
    r.add_argument("--old", required=True)
    r.add_argument("--shapes", default="4x8192x16x128")
    r.add_argument("--passes", default="fwd,fwd+bwd")
    r.add_argument("--stable", default="0")
    r.add_argument("--rounds", type=int, default=5)
    r.add_argument("--reps", type=int, default=10)
    r.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        print(prepare(args.rev))
        return
    records = run(args.old, [_parse_shape(s) for s in args.shapes.split(",")], args.passes.split(","),
                  [bool(int(s)) for s in args.stable.split(",")], args.rounds, args.reps)
    if args.out:
        Path(args.out).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
