"""Where the stable forward's extra time goes at one shape: the per-entry tie count against the
per-row shift.

    python -m lab.stable_parts [--shape 32x1024x12x64] [--rounds 20] [--reps 6]
        [--sync round] [--out FILE.json]

Diagnostic forms of the stable forward, each built by replacing one part of ``tile.py``'s stable
shift while the kernel is traced — not shippable, they change what the shift computes:

* ``stable``: the shipped shift;
* ``per-row only``: the tie count replaced by a per-row stand-in that is never true at run time (the
  compiler cannot know): no per-entry work, the per-row shift (threshold, target, the guard's fold,
  the selects) kept — what the per-row work costs;
* ``count only``: the count kept, the per-row shift reduced to one max and one select — what the
  per-entry count costs;
* ``base``: the baseline forward.

Forward only (the backward is the same kernel with and without the shift), interleaved in balanced
order (``bench.attention.timed_interleaved``); the records carry per-round times, so ``python -m
lab.ab ratio FILE --variant V --base base`` gives paired ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash as jf
from jax_flash import tile

from bench.attention import timed_interleaved


def _per_row_only(s, mask, r_m, cfg, raw=False):
    return jnp.where(r_m > 3e38, 2.0, 0.0)  # no finite score reaches it: "no ties", per row


def _count_only(s, mask, r_m, cfg, floor=None, raw=False):
    ties = tile.tie_count(s, mask, r_m, cfg, raw)
    return jnp.where(ties > 1, jnp.maximum(cfg.beta * r_m, 0.0), r_m)


PARTS = {"base": (False, {}), "stable": (True, {}),
         "per-row only": (True, {"tie_count": _per_row_only}),
         "count only": (True, {"stable_shift": _count_only})}


@contextlib.contextmanager
def _replaced(names: dict):
    saved = {n: getattr(tile, n) for n in names}
    try:
        for n, f in names.items():
            setattr(tile, n, f)
        yield
    finally:
        for n, f in saved.items():
            setattr(tile, n, f)


def compiled_forward(part: str, q, k, v, impl="pallas", parts=None):
    """The forward of one diagnostic form of ``parts`` (default ``PARTS``), compiled now (traced
    with its part of tile.py replaced)."""
    stable, names = (parts or PARTS)[part]
    f = jax.jit(lambda q, k, v: jf.attention(q, k, v, stable=stable, impl=impl))
    with _replaced(names):
        return f.lower(q, k, v).compile()


def run(shape, rounds, reps, sync="round", impl="pallas", log=print, parts=None):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3))
    fns = {part: compiled_forward(part, q, k, v, impl, parts) for part in (parts or PARTS)}
    per_round = {}
    ms = timed_interleaved(fns, (q, k, v), reps, rounds, sync=sync, per_round=per_round, log=log)
    return [dict(variant=part, shape=list(shape), causal=True, **{"pass": "fwd"}, ms=ms[part],
                 rounds_ms=per_round[part], sync=sync, jax_version=jax.__version__,
                 device=jax.devices()[0].device_kind) for part in ms]


def main(argv=None, parts=None, doc=None):
    ap = argparse.ArgumentParser(description=doc or __doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="32x1024x12x64")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--sync", choices=("call", "round"), default="round")
    ap.add_argument("--impl", default="pallas", help="'jnp' for a CPU smoke run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split("x"))
    records = run(shape, args.rounds, args.reps, args.sync, args.impl, parts=parts)
    base = next(r["ms"] for r in records if r["variant"] == "base")
    for r in records:
        print(f"{r['variant']:>14}: {r['ms']:.4f} ms  ×{r['ms'] / base:.3f} of base")
    if args.out:
        Path(args.out).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
