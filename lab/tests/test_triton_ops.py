"""The Triton forward lowered for CUDA on a CPU (``lab.triton_ops``: the Pallas lowering's Triton IR,
caught before XLA's GPU compiler): what the stable shift and ``scale_late`` add to the kernel, op by
op. Counts per loop body: ``triton_ops.LAUNCH`` splits the causal loop into two bodies."""

import collections
import re

from lab import triton_ops

BODIES = 2


def test_stable_shift_adds_few_ops_per_row():
    """stable − base is the count's compare, select and add per entry plus the per-row shift (target,
    guard, fold, selects): 21 ops per body in the current form. A bound, so that a costlier form
    of the shift does not slip back in."""
    base, stable = (triton_ops.op_counts(**triton_ops.VARIANTS[n]) for n in ("base", "stable"))
    extra = triton_ops.difference(base, stable)
    assert extra.get("arith.cmpf") == BODIES * 3  # the entry's compare, ties > 1, over > 0
    assert "arith.fptosi" not in extra and "arith.andi" not in extra  # floor in one op, no r_m ≠ 0 test
    assert BODIES * 15 <= sum(extra.values()) <= BODIES * 22


def test_fa2_exps_are_the_ftz_instruction():
    """"fa2" (``Policy.exp_ftz``): the forward's exps — P̄ per entry and α per row, in each body —
    are one inline ``ex2.approx.ftz.f32`` each, and libdevice's exp2 (whose subnormal handling costs
    a compare and two multiplies per entry) is gone; the stable shift adds no exp."""
    for kind in ("base", "stable"):
        text = triton_ops.module_text(**triton_ops.VARIANTS[kind])
        assert text.count("ex2.approx.ftz.f32") == BODIES * 2, kind
        assert "__nv_exp" not in text, kind


def _mulf_by_shape(text):
    return collections.Counter(re.findall(r"= arith\.mulf [^:]*: tensor<([0-9x]+)xf32>", text))


def test_scale_late_moves_the_scale_into_the_exponent():
    """``scale_late``: the scores stay unscaled q·kᵀ, and each body multiplies them by the scale in
    the exponent's argument instead (scale·s − m: one FMA after ptxas), so the per-entry multiplies
    per body stay one; the scale moves onto the row max (one multiply per row and body), and the
    scores computed ahead of the loop (``prefetch_scores``) lose theirs. At D = 32 the [64, 32]
    accumulator's multiplies are apart from the [64, 64] score tile's."""
    shape = (1, 1024, 1, 32)
    early, late = (_mulf_by_shape(triton_ops.module_text(shape, **triton_ops.VARIANTS[n]))
                   for n in ("base-late", "base+late"))
    assert early["64x64"] == BODIES + 1 and late["64x64"] == BODIES
    assert late["64"] == early["64"] + BODIES
    assert late["64x32"] == early["64x32"] == BODIES  # acc·α, untouched


def _model_modules(kind: str, **constants):
    """The Triton modules of the model's Pallas GELU (``kind="gelu"``: forward, input gradient)
    or loss (``"loss"``: the training forward), lowered with the kernel module's constants set to
    ``constants``."""
    import importlib

    import jax
    import jax.numpy as jnp
    import pytest

    pytest.importorskip("flax")  # the model package's dependency
    mod = importlib.import_module(f"models.{kind}_kernels")
    # a new function each time: jit's caches would return the first lowering
    if kind == "gelu":
        f = jax.value_and_grad(lambda h: jnp.sum(mod.gelu(h).astype(jnp.float32)))
        args = (jax.ShapeDtypeStruct((64, 3072), jnp.bfloat16),)
    else:
        f = jax.value_and_grad(lambda x, t: mod.cross_entropy(x, t))
        args = (jax.ShapeDtypeStruct((64, 50304), jnp.bfloat16),
                jax.ShapeDtypeStruct((64,), jnp.int32))
    old = {k: getattr(mod, k) for k in constants}
    try:
        for k, v in constants.items():
            setattr(mod, k, v)
        texts = triton_ops.lowered_modules(f, *args)
    finally:
        for k, v in old.items():
            setattr(mod, k, v)
    assert len(texts) == (2 if kind == "gelu" else 1)
    return texts


def test_gelu_quotient_is_one_reciprocal():
    """The Pallas GELU's kernels with ``RCP_QUOTIENT``: the erf's quotient is one inline
    ``rcp.approx.ftz.f32`` and a product instead of an FP32 division (whose expansion adds two
    range checks and two scalings per entry); the halvings stay divisions by 2 (a product once
    compiled)."""
    rcp, div = (_model_modules("gelu", RCP_QUOTIENT=v) for v in (True, False))
    for a, b in zip(rcp, div):
        assert a.count("rcp.approx.ftz.f32") == 1 and "rcp.approx" not in b
        assert a.count("arith.divf") == b.count("arith.divf") - 1


def test_gelu_backward_exp_is_the_instruction():
    """``EX2_APPROX``: the input gradient's φ is one inline ``ex2.approx.ftz.f32`` in place of
    libdevice's expf (about eight instructions an entry once compiled); the forward has no exp."""
    (fwd, bwd), (_, lib) = (_model_modules("gelu", EX2_APPROX=v) for v in (True, False))
    assert bwd.count("ex2.approx.ftz.f32") == 1 and "__nv_expf" not in bwd
    assert "ex2.approx" not in lib and lib.count("__nv_expf") == 1
    assert "ex2" not in fwd and "__nv_exp" not in fwd


def test_loss_exps_are_the_instruction():
    """``loss_kernels.EX2_APPROX``: every exp of the loss's training kernel (the chunk's entries and
    the running sum's rescaling, per loop and remainder piece; the gradient's) is one inline
    ``ex2.approx.ftz.f32``, none libdevice's expf; without it, all are."""
    ((ex2,),), ((lib,),) = ((_model_modules("loss", EX2_APPROX=v),) for v in (True, False))
    assert ex2.count("ex2.approx.ftz.f32") == lib.count("__nv_expf") >= 4
    assert "__nv_expf" not in ex2 and "ex2.approx" not in lib


def test_loss_target_fixup_drops_the_compare():
    """``loss_kernels.TARGET_FIXUP``: the gradient's walk has no integer compare (the target's) and
    the kernel one more store (each row's target entry) behind one barrier."""
    ((fix,),), ((mask,),) = ((_model_modules("loss", TARGET_FIXUP=v),) for v in (True, False))
    assert "arith.cmpi" not in fix and mask.count("arith.cmpi") >= 2
    assert fix.count("tt.store") == mask.count("tt.store") + 1 and fix.count("gpu.barrier") == 1
