"""Whether the working tree's Mosaic GPU kernels lower to the same CUDA modules as an archived
revision's, on a CPU (jax >= 0.11): for refactors and launch changes meant to move no instruction,
checked without a GPU. ``lab.same_bits`` is the GPU's check of values; this one is of the code.

    python -m lab.ab prepare REV             # build/ab/REV/jax_flash
    python -m lab.same_lowering --old build/ab/REV [--shape 1x512x2x128]

For the forward, dK/dV and dQ kernels (dQ with 64- and 128-key tiles), causal and not, each
module's text (the per-process dump name removed) is compared: "identical", "reordered" (the same
lines in another order, e.g. a constant hoisted elsewhere) or "differs" with the count of lines in
one and not the other. Exit status 1 when any kernel differs.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import re
import sys

KERNELS = (("fwd", {}), ("dkdv", {}), ("dq", {}), ("dq", {"keys": 128}))


def lowered(pkg, kernel: str, shape, causal: bool, **kw) -> str:
    """The Mosaic GPU module ``pkg``'s ``kernel`` ("fwd", "dkdv", "dq") serializes for CUDA at
    ``shape`` (bf16, policy fa2), without its per-process dump name; ``kw`` go to the kernel."""
    import jax
    import jax.numpy as jnp

    from lab import mosaic_ops

    mosaic = lambda name: importlib.import_module(f"{pkg.__name__}.pallas.{name}")
    cfg = mosaic_ops.numerics(shape, causal)
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((shape[0], shape[2], shape[1]), jnp.float32)
    if kernel == "fwd":
        fn = mosaic("forward_mosaic").forward_mosaic
        f = jax.jit(lambda q, k, v: fn(q, k, v, cfg, o_dtype=jnp.bfloat16, **kw))
        args = (x, x, x)
    else:
        bm = mosaic("backward_mosaic")
        fn = bm.dkdv_mosaic if kernel == "dkdv" else bm.dq_mosaic
        f = jax.jit(lambda *a: fn(*a, cfg, out_dtype=jnp.bfloat16, **kw))
        args = (x, x, x, x, rows, rows)
    with mosaic_ops.captured_modules() as seen:
        jax.export.export(f, platforms=["cuda"])(*args)
    if not seen:
        raise RuntimeError(f"{kernel}: no Mosaic GPU module was serialized")
    return re.sub(r'dump_basename = "[^"]*"', "", seen[-1])


def verdict(old: str, new: str) -> tuple[str, int]:
    """("identical" | "reordered" | "differs", lines in one module and not the other)."""
    if old == new:
        return "identical", 0
    a, b = collections.Counter(old.splitlines()), collections.Counter(new.splitlines())
    moved = sum(((a - b) + (b - a)).values())
    return ("reordered" if moved == 0 else "differs"), moved


def compare(old_root, shape=(1, 512, 2, 128), masks=(True, False), new_kw=None) -> list[dict]:
    """Rows {kernel, kw, causal, verdict, lines} of the archived revision at ``old_root`` against
    the working tree. ``new_kw``: {kernel: extra arguments} for the working tree's side only."""
    import jax_flash

    from lab import ab

    old = ab.load_old(old_root)
    rows = []
    for (kernel, kw), causal in ((k, c) for k in KERNELS for c in masks):
        extra = (new_kw or {}).get(kernel, {})
        got = verdict(lowered(old, kernel, shape, causal, **kw),
                      lowered(jax_flash, kernel, shape, causal, **kw, **extra))
        rows.append(dict(kernel=kernel, kw=kw, causal=causal, verdict=got[0], lines=got[1]))
        print(f"{kernel}{kw or ''} causal={causal}: {got[0]}"
              + (f" ({got[1]} lines)" if got[1] else ""), flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="an archived revision (python -m lab.ab prepare)")
    p.add_argument("--shape", default="1x512x2x128", help="B x T x H x D (D: 64 or 128)")
    args = p.parse_args(argv)
    rows = compare(args.old, tuple(int(x) for x in args.shape.split("x")))
    return 1 if any(r["verdict"] == "differs" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
