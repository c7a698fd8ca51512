"""Static op counts of our Mosaic GPU forward kernel, per configuration, on a CPU (no GPU needed).

    python -m lab.mosaic_ops [--shape 1x2048x2x128] [--variants base,stable,stable-k64]

Mosaic GPU lowers the kernel in Python to per-thread MLIR (arith / vector / nvvm ops on each thread's
registers: the wgmma layout gives a thread 2-element vectors of a tile's rows) before it is serialized
for the GPU compiler. The module is caught there (``jax.export`` for CUDA, which works without a GPU
on jax ≥ 0.11) and its ops are counted. The difference between two configurations is what one adds
per loop body (the causal kernel has two bodies: masked and unmasked tiles) — a proxy for the extra
instructions before ptxas, e.g. what the stable shift's tie count and per-row shift add. Not a
timing. Variants: ``base`` and ``stable`` with the call's default numerics (``jax_flash.plan``),
``-k64`` / ``-k128`` for that key tile (``block_k``), ``+late`` / ``-late`` for ``scale_late`` on /
off. The companion of ``lab.triton_ops`` (the Triton forward).
"""

from __future__ import annotations

import collections
import contextlib
import re

import jax
import jax.numpy as jnp

from lab.triton_ops import counts_from_args, numerics, variants

VARIANTS = variants({"": {}, "-k64": {"block_k": 64}, "-k128": {"block_k": 128}})


@contextlib.contextmanager
def captured_modules():
    """The text of every Mosaic GPU module serialized inside the block (jax ≥ 0.11)."""
    import jax.experimental.mosaic.gpu.core as core

    seen, orig = [], core._run_serde_pass

    def spy(module, *args, **kwargs):
        if kwargs.get("serialize"):
            seen.append(str(module))
        return orig(module, *args, **kwargs)

    core._run_serde_pass = spy
    try:
        yield seen
    finally:
        core._run_serde_pass = orig


def op_counts(shape=(1, 2048, 2, 128), causal=True, **num_kw) -> collections.Counter:
    """Ops of the forward kernel's module, by name (``arith.cmpf``: …), for
    ``triton_ops.numerics(shape, causal, **num_kw)``."""
    from jax_flash.pallas import forward_mosaic

    cfg = numerics(shape, causal, **num_kw)
    sds = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    f = jax.jit(lambda q, k, v: forward_mosaic.forward_mosaic(q, k, v, cfg, o_dtype=jnp.bfloat16))
    with captured_modules() as seen:
        jax.export.export(f, platforms=["cuda"])(sds, sds, sds)
    if not seen:
        raise RuntimeError("no Mosaic GPU module was serialized (jax ≥ 0.11 needed)")
    return collections.Counter(re.findall(r'= "?([a-z_]+\.[a-z_0-9.]+)', seen[-1]))


# ops that move or name values rather than compute (mostly free after register allocation)
PLUMBING = ("builtin.unrealized_conversion_cast", "vector.broadcast", "vector.extract", "vector.insert",
            "vector.bitcast", "vector.shuffle", "arith.constant", "llvm.mlir.undef", "arith.index_cast",
            "gpu.thread_id", "gpu.block_dim")


def difference(a: collections.Counter, b: collections.Counter) -> dict:
    """b − a per op, compute ops first (largest first), plumbing last."""
    diff = {k: b[k] - a[k] for k in set(a) | set(b) if b[k] != a[k]}
    return dict(sorted(diff.items(), key=lambda kv: (kv[0] in PLUMBING, -abs(kv[1]), kv[0])))


def main(argv=None):
    names, counts = counts_from_args(argv, __doc__, "1x2048x2x128", VARIANTS, op_counts)
    for n in names:
        print(f"{n}: {sum(counts[n].values())} ops")
    for n in names[1:]:
        diff = difference(counts[names[0]], counts[n])
        compute = {k: v for k, v in diff.items() if k not in PLUMBING}
        print(f"{n} − {names[0]}: compute ops {sum(compute.values()):+d} {compute}")
        print(f"  plumbing {sum(v for k, v in diff.items() if k in PLUMBING):+d}")


if __name__ == "__main__":
    main()
