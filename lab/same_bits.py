"""Whether the working tree computes the same bits as an archived revision: O and the gradients of
every case (shape, mask, stable shift), compared element by element. For changes that should move
no value (a launch, a grid order, a refactor), on the device they are timed on.

    python -m lab.ab prepare REV          # here: build/ab/REV/jax_flash
    python -m lab.same_bits --old build/ab/REV --shapes 8x2048x16x128 [--policy fa2] [--out F.json]

Each case draws inputs and a cotangent from fixed seeds, runs O = attention(q, k, v) and its VJP
under both revisions, and counts the elements that differ in O, dQ, dK and dV. Exit status 1 when
any element differs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys


def _case(mod, q, k, v, do, causal, stable, policy):
    import jax

    def f(q, k, v):
        return mod.attention(q, k, v, causal=causal, stable=stable, policy=policy)

    o, vjp = jax.vjp(f, q, k, v)
    return (o, *vjp(do))


def compare(old_root, shapes, policy="fa2", masks=(True, False), stables=(False, True)):
    """Rows {shape, causal, stable, differing: {o, dq, dk, dv}, elements}, old against new."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_flash
    from lab import ab

    old = ab.load_old(old_root)
    rows = []
    for shape, causal, stable in itertools.product(shapes, masks, stables):
        rng = np.random.default_rng(0)
        q, k, v, do = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(4))
        got = jax.device_get(_case(jax_flash, q, k, v, do, causal, stable, policy))
        want = jax.device_get(_case(old, q, k, v, do, causal, stable, policy))
        differing = {name: int(np.sum(np.asarray(a).view(np.uint16)
                                      != np.asarray(b).view(np.uint16)))
                     for name, a, b in zip(("o", "dq", "dk", "dv"), got, want)}
        rows.append(dict(shape=list(shape), causal=causal, stable=stable, policy=policy,
                         differing=differing, elements=int(np.prod(shape))))
        print(f"{'x'.join(map(str, shape))} causal={causal} stable={stable}: "
              f"differing {differing} of {rows[-1]['elements']} each", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="an archived revision (python -m lab.ab prepare)")
    p.add_argument("--shapes", default="8x2048x16x128")
    p.add_argument("--policy", default="fa2")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import jax

    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    rows = compare(args.old, shapes, args.policy)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind,
                       "old": args.old, "rows": rows}, f, indent=1)
    return 1 if any(any(r["differing"].values()) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
