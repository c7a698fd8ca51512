"""Static op counts of our Triton forward kernel, per configuration, on a CPU (no GPU needed).

    python -m lab.triton_ops [--shape 1x1024x1x64] [--variants base,stable,stable+late]

The Pallas Triton lowering turns the kernel into a Triton IR module (``tt`` / ``arith`` / ``scf`` ops
on whole tiles) that XLA's GPU compiler later turns into PTX. ``jax.export`` for CUDA runs that
lowering on a CPU; the module is caught there and its ops are counted. The stable − base difference
is what the stable shift adds to the forward (``LAUNCH`` splits the causal loop at the diagonal, so
each added op appears twice, once per loop body). An op on a [rows] vector runs once per row a
thread holds; one on a [rows, keys] tile once per entry. Not a timing, and ptxas decides the
instructions. Variants: ``base`` and ``stable``, each with the call's default numerics
(``jax_flash.plan``), or with ``scale_late`` forced on (``+late``) or off (``-late``). The companion
of ``lab.mosaic_ops`` (the Mosaic GPU forward).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib
import re

import jax
import jax.numpy as jnp

import jax_flash as jf

# both of the Triton forward's launch options: two loop bodies (the tiles below the causal diagonal
# without a mask, then the diagonal's) and the next tile's scores ahead of this tile's softmax
LAUNCH = jf.Launch(split_diagonal=True, prefetch_scores=True)


def variants(tiles=None) -> dict:
    """name -> ``numerics`` arguments: ``base`` and ``stable``, then a suffix of ``tiles`` (suffix
    -> call arguments, e.g. ``{"-k64": {"block_k": 64}}``; none: the call's default tiles), then
    "" / "+late" / "-late" for ``scale_late`` as the call's default, on, off."""
    late = {"": None, "+late": True, "-late": False}
    return {kind + tile + suffix: dict(stable=kind == "stable", scale_late=value, **call)
            for kind in ("base", "stable") for tile, call in (tiles or {"": {}}).items()
            for suffix, value in late.items()}


VARIANTS = variants()
_OPS = re.compile(r"= ((?:arith|tt|math)\.[a-z_]+)")
FREE = ("arith.constant", "tt.splat")  # constants, and scalars splatted to tiles (no per-entry work)


@contextlib.contextmanager
def _captured_modules():
    """The text of every Triton module lowered inside the block, with the lowering made to believe
    it targets an sm_90 GPU and our kernels to run compiled, not in interpret mode."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    # (the package exports functions named like these modules)
    common, forward, backward = (importlib.import_module(f"jax_flash.pallas.{m}")
                                 for m in ("common", "forward", "backward"))
    seen = []
    lower = reg.lowering.lower_jaxpr_to_triton_module

    def spy(*args, **kwargs):
        result = lower(*args, **kwargs)
        seen.append(str(result.module))
        return result

    class _Sm90:
        compute_capability = "9.0"

    patches = [(reg.lowering, "lower_jaxpr_to_triton_module", spy)]
    patches += [(m, "interpret_mode", lambda: False) for m in (common, forward, backward)]
    try:  # the model's kernels too, where the model's dependencies (flax) are installed
        gelu_kernels, loss_kernels, layernorm = (
            importlib.import_module(f"models.{m}")
            for m in ("gelu_kernels", "loss_kernels", "layernorm"))
        patches += [(gelu_kernels, "interpret_mode", lambda: False),
                    (loss_kernels, "interpret_mode", lambda: False),
                    (layernorm, "_interpret", lambda: False)]  # their Triton params
    except ModuleNotFoundError:
        pass
    if hasattr(reg, "gpu_info_lib"):  # jax ≥ 0.11 asks the (absent) GPU for its compute capability
        patches.append((reg.gpu_info_lib, "get_gpu_info", _Sm90))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, new in patches:
            setattr(obj, name, new)
        yield seen
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)


def numerics(shape, causal=True, stable=False, scale_late=None, policy="fa2", **call):
    """The ``Numerics`` of a bfloat16 call at ``shape`` as ``jax_flash.plan`` makes it (``call``: more
    arguments of the call, e.g. ``block_k``), with ``scale_late`` replaced where it is not None."""
    sds = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    num = jf.plan(sds, sds, sds, causal=causal, stable=stable, policy=policy, impl="jnp",
                  **call).numerics
    return num if scale_late is None else dataclasses.replace(num, scale_late=scale_late)


def module_text(shape=(1, 1024, 1, 64), causal=True, launch=LAUNCH, **num_kw) -> str:
    """The Triton IR of the forward kernel under ``launch`` for ``numerics(shape, causal,
    **num_kw)``."""
    cfg = numerics(shape, causal, **num_kw)
    sds = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    forward = importlib.import_module("jax_flash.pallas.forward").forward
    f = jax.jit(lambda q, k, v: forward(q, k, v, cfg, launch, o_dtype=jnp.bfloat16))
    with _captured_modules() as seen:
        jax.export.export(f, platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(sds, sds, sds)
    if not seen:
        raise RuntimeError("no Triton module was lowered")
    return seen[-1]


def lowered_modules(f, *args) -> list[str]:
    """The Triton IR of every kernel ``jax.jit(f)(*args)`` lowers for CUDA (``args``: shapes)."""
    with _captured_modules() as seen:
        jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    return seen


def op_counts(shape=(1, 1024, 1, 64), causal=True, **kw) -> collections.Counter:
    """Ops of the forward kernel's Triton module (``module_text``), by name (``arith.cmpf``: …)."""
    return collections.Counter(_OPS.findall(module_text(shape, causal, **kw)))


def difference(a: collections.Counter, b: collections.Counter, free=FREE) -> dict:
    """b − a per op name, leaving out ``free`` ops; only the names whose counts differ."""
    return {k: b[k] - a[k] for k in sorted(set(a) | set(b)) if b[k] != a[k] and k not in free}


def counts_from_args(argv, doc, shape, variants, op_counts):
    """(variant names, {name: op counts}) from an op counter's command line: ``--shape`` (default
    ``shape``) and ``--variants`` (names of ``variants``)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default=shape)
    ap.add_argument("--variants", default="base,stable")
    args = ap.parse_args(argv)
    dims = tuple(int(x) for x in args.shape.split("x"))
    names = args.variants.split(",")
    return names, {n: op_counts(dims, **variants[n]) for n in names}


def main(argv=None):
    names, counts = counts_from_args(argv, __doc__, "1x1024x1x64", VARIANTS, op_counts)
    base = counts[names[0]]
    for n in names:
        total = sum(v for k, v in counts[n].items() if k not in FREE)
        print(f"{n}: {total} ops (constants and splats left out)")
    for n in names[1:]:
        d = difference(base, counts[n])
        print(f"{n} − {names[0]}: {sum(d.values()):+d} {d}")


if __name__ == "__main__":
    main()
