"""The Triton kernels lowered for a CUDA GPU on a machine without one: JAX lowers a jitted function
for another platform, and Pallas' Triton lowering writes each kernel's Triton IR then, so a kernel
that uses an operation the lowering does not support fails here, not first on the GPU. (Compiling
that IR to GPU code happens on the GPU.)"""

import sys

import jax
import jax.numpy as jnp
import pytest

import jax_flash as jf
import jax_flash.pallas  # noqa: F401  (the package's forward/backward names are functions)
from jax_flash.pallas import common
from models import gelu_kernels, layernorm, loss_kernels

TRITON_CALL = "__gpu$xla.gpu.triton"


@pytest.fixture
def compiled_mode(monkeypatch):
    """The kernels built as for the GPU (Triton compiler parameters, no interpret mode)."""
    off = lambda: False  # noqa: E731
    monkeypatch.setattr(common, "interpret_mode", off)
    for name in ("jax_flash.pallas.forward", "jax_flash.pallas.backward"):
        monkeypatch.setattr(sys.modules[name], "interpret_mode", off)
    monkeypatch.setattr(layernorm, "_interpret", off)
    monkeypatch.setattr(gelu_kernels, "interpret_mode", off)
    monkeypatch.setattr(loss_kernels, "interpret_mode", off)


def _triton_calls(f, *args) -> int:
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return text.count(TRITON_CALL)


def _grad_of_sum(f):
    return jax.grad(lambda *a: sum(jnp.sum(o.astype(jnp.float32)) for o in jax.tree.leaves(f(*a))),
                    argnums=0)


QKV = jax.ShapeDtypeStruct((2, 256, 3, 4, 64), jnp.bfloat16)


@pytest.mark.parametrize("kw,calls", [
    ({}, 3),  # forward, dK/dV, dQ (δ from O in XLA)
    ({"stable": True}, 3),
    ({"delta": "dpp"}, 4),  # and δ's kernel
    ({"policy": "paper"}, 3),
    ({"stable": True, "launch": jf.Launch(fwd=(8, 3), split_diagonal=True, prefetch_scores=True)},
     3),
])
def test_attention_kernels_lower_for_triton(compiled_mode, kw, calls):
    sliced = lambda x: jf.attention(x[:, :, 0], x[:, :, 1], x[:, :, 2], impl="pallas", **kw)
    packed = lambda x: jf.attention_qkvpacked(x, impl="pallas", **kw)
    assert _triton_calls(_grad_of_sum(sliced), QKV) == calls
    assert _triton_calls(_grad_of_sum(packed), QKV) == calls


def test_model_kernels_lower_for_triton(compiled_mode):
    x = jax.ShapeDtypeStruct((64, 768), jnp.float32)
    r = jax.ShapeDtypeStruct((64, 768), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((768,), jnp.float32)
    ln = lambda x, w: layernorm.layer_norm(x, w, 1e-5, jnp.bfloat16)
    add_ln = lambda x, r, w: layernorm.add_layer_norm(x, r, w, 1e-5, jnp.bfloat16)
    assert _triton_calls(jax.grad(lambda x, w: jnp.sum(ln(x, w).astype(jnp.float32)),
                                  argnums=(0, 1)), x, w) == 2
    assert _triton_calls(_grad_of_sum(add_ln), x, r, w) == 2
    logits = jax.ShapeDtypeStruct((64, 50304), jnp.bfloat16)
    targets = jax.ShapeDtypeStruct((64,), jnp.int32)
    assert _triton_calls(jax.value_and_grad(loss_kernels.cross_entropy), logits,
                         targets) == 1
    h = jax.ShapeDtypeStruct((64, 3072), jnp.bfloat16)
    assert _triton_calls(jax.value_and_grad(
        lambda h: jnp.sum(gelu_kernels.gelu(h).astype(jnp.float32))), h) == 2
