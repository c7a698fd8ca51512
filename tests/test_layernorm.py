"""models/layernorm.py: the Pallas LayerNorm (interpret mode here) against flax's two-pass LayerNorm
in float64, within bounds from the FP32 sums' lengths, and lowered to Triton for CUDA."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import (LN_LAUNCHES, assert_add_layer_norm_is_the_pair,
                     assert_ln_launch_within_the_sums_bounds, assert_ln_within_the_sums_bounds,
                     launch_id, ln_inputs)
from models import layernorm
from models.layernorm import add_layer_norm, chunk_width, layer_norm

U = 2.0 ** -24  # FP32 unit roundoff
EPS = 1e-5


def _grads(fn, x, w, dy):
    y, vjp = jax.vjp(fn, x, w)
    return (y,) + vjp(dy)


@pytest.mark.parametrize("n,d,offset", [
    (64, 768, 0.0), (48, 96, 0.0), (32, 768, 100.0), (2, 96, 0.0)],
    ids=["gpt2-width", "odd-chunks", "offset-100", "two-rows"])
def test_matches_float64_within_the_sums_bounds(rng, assert_close, n, d, offset):
    x, w, dy = ln_inputs(rng, n, d, offset)
    y, dx, dw = _grads(layer_norm, *(jnp.asarray(a, jnp.float32) for a in (x, w)),
                       jnp.asarray(dy, jnp.float32))
    assert_ln_within_the_sums_bounds(assert_close, x, w, dy, y, dx, dw)


@pytest.mark.parametrize("launch", LN_LAUNCHES, ids=launch_id)
def test_every_launch_matches_float64_within_the_sums_bounds(rng, assert_close, launch):
    """``helpers.assert_ln_launch_within_the_sums_bounds``, interpreted."""
    assert_ln_launch_within_the_sums_bounds(rng, assert_close, launch)


@pytest.mark.parametrize("launch", [dict(reload=True), dict(reload=True, sub=2, rows=32)],
                         ids=launch_id)
def test_backward_reload_changes_no_bit(rng, launch):
    """``reload``: the backward reads a step's rows again for the input gradient instead of
    holding them, through the same expressions: dx, d(scale) and the fused pair's ds, dr bitwise
    those of the same launch without it."""
    n, d = 64, 768
    x, w, dy = (jnp.asarray(a, jnp.float32) for a in ln_inputs(rng, n, d, 3.0))
    gs = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    _, mean, rstd = layernorm._forward(x, w, EPS, jnp.dtype(jnp.float32))
    held = {k: v for k, v in launch.items() if k != "reload"}
    for f in (lambda **kw: layernorm._backward(x, w, mean, rstd, dy, **kw),
              lambda **kw: layernorm._add_backward(x, w, mean, rstd, dy.astype(jnp.bfloat16), gs,
                                                   jnp.dtype(jnp.bfloat16), **kw)):
        chex.assert_trees_all_equal(f(**launch), f(**held))


def test_an_unknown_launch_setting_is_an_error():
    x = jnp.ones((16, 96), jnp.float32)
    with pytest.raises(TypeError, match="unknown launch settings \\['row'\\]"):
        layernorm._forward(x, jnp.ones(96), EPS, jnp.dtype(jnp.float32), row=8)


def test_agrees_with_flax_layernorm_and_rounds_to_the_output_dtype(rng):
    """The model's default LayerNorm (flax, two-pass variance) and this one give the same values to
    FP32 noise; asked for bf16, the output is the FP32 result rounded once."""
    x, w, dy = ln_inputs(rng, 32, 768)
    ln = nnx.LayerNorm(768, epsilon=EPS, use_bias=False, dtype=jnp.float32, use_fast_variance=False,
                       rngs=nnx.Rngs(0))
    ln.scale[...] = jnp.asarray(w, jnp.float32)
    xf = jnp.asarray(x, jnp.float32)
    ours = layer_norm(xf, ln.scale[...])
    chex.assert_trees_all_close(ours, ln(xf), atol=4 * 768 * U * 8, rtol=0)
    bf = layer_norm(xf, ln.scale[...], EPS, jnp.bfloat16)
    chex.assert_type(bf, jnp.bfloat16)
    chex.assert_trees_all_equal(bf, ours.astype(jnp.bfloat16))


def test_leading_axes_and_jit(rng):
    """[batch, seq, d] in, the same shape out, under jit, with the gradient in x's dtype."""
    x, w, dy = ln_inputs(rng, 2 * 24, 96)
    x3 = jnp.asarray(x.reshape(2, 24, 96), jnp.float32)
    f = jax.jit(lambda x, w: layer_norm(x, w, EPS, jnp.bfloat16).astype(jnp.float32).sum())
    dx, dw = jax.grad(f, argnums=(0, 1))(x3, jnp.asarray(w, jnp.float32))
    chex.assert_shape(dx, (2, 24, 96))
    chex.assert_type(dx, jnp.float32)
    chex.assert_shape(dw, (96,))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_add_layer_norm_is_the_addition_then_the_layer_norm(rng, jit):
    """``helpers.assert_add_layer_norm_is_the_pair`` on this device, eager and compiled."""
    x, r = assert_add_layer_norm_is_the_pair(rng, jit)
    with pytest.raises(ValueError, match="out_dtype"):
        add_layer_norm(x, r.astype(jnp.float32), jnp.ones(x.shape[-1]), EPS, jnp.bfloat16)


def test_chunks_are_powers_of_two_dividing_the_width():
    assert [chunk_width(d) for d in (768, 1024, 96, 80, 7)] == [256, 256, 32, 16, 1]


@pytest.fixture
def triton_for_cuda(monkeypatch):
    """The kernels made to run compiled and the Triton lowering told it targets an sm_90 GPU, so
    that ``jax.export`` lowers them for CUDA on a CPU; returns the lowering registration module."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    class Sm90:
        compute_capability = "9.0"

    monkeypatch.setattr(layernorm, "_interpret", lambda: False)
    if hasattr(reg, "gpu_info_lib"):
        monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info", Sm90)
    return reg


def test_lowers_to_triton_for_cuda(monkeypatch, triton_for_cuda):
    """Forward and backward (and the fused addition's) lower to Triton modules for CUDA on a CPU
    (``jax.export``, ``triton_for_cuda``): Triton takes only power-of-two tensors, which the row
    chunks keep to at GPT-2's width."""
    reg = triton_for_cuda
    seen = []
    lower = reg.lowering.lower_jaxpr_to_triton_module

    def spy(*args, **kwargs):
        result = lower(*args, **kwargs)
        seen.append(str(result.module))
        return result

    monkeypatch.setattr(reg.lowering, "lower_jaxpr_to_triton_module", spy)
    x = jax.ShapeDtypeStruct((4, 1024, 768), jnp.float32)
    w = jax.ShapeDtypeStruct((768,), jnp.float32)
    f = jax.jit(jax.grad(lambda x, w: layer_norm(x, w, EPS, jnp.bfloat16).astype(jnp.float32).sum(),
                         argnums=(0, 1)))
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    jax.export.export(f, platforms=["cuda"], disabled_checks=checks)(x, w)
    assert len(seen) == 2 and all("tt.func" in m for m in seen)
    # the fused residual addition's two kernels too
    r = jax.ShapeDtypeStruct((4, 1024, 768), jnp.bfloat16)

    def fused_loss(x, r, w):
        s, y = add_layer_norm(x, r, w, EPS, jnp.bfloat16)
        return s.sum() + y.astype(jnp.float32).sum()

    g = jax.jit(jax.grad(fused_loss, argnums=(0, 1, 2)))
    jax.export.export(g, platforms=["cuda"], disabled_checks=checks)(x, r, w)
    assert len(seen) == 4 and all("tt.func" in m for m in seen)


def test_backward_stages_reach_the_triton_call_and_nothing_else(triton_for_cuda):
    """The fused backward's ``stages`` (a launch setting: how far Triton's pipeliner loads ahead)
    reaches the Triton call's parameters, and the lowered kernel is otherwise the same."""
    import functools
    import re
    rows = jax.ShapeDtypeStruct((4096, 768), jnp.float32)
    vec = jax.ShapeDtypeStruct((4096,), jnp.float32)
    args = (rows, jax.ShapeDtypeStruct((768,), jnp.float32), vec, vec,
            jax.ShapeDtypeStruct((4096, 768), jnp.bfloat16), rows)
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    stages = re.compile(r"num_stages = (\d+) : i32")
    texts = {}
    for st in (1, 3):
        f = jax.jit(functools.partial(layernorm._add_backward, r_dtype=jnp.bfloat16, stages=st))
        texts[st] = jax.export.export(f, platforms=["cuda"], disabled_checks=checks)(
            *args).mlir_module()
        assert stages.findall(texts[st]) == [str(st)]
    assert stages.sub("", texts[1]) == stages.sub("", texts[3])
