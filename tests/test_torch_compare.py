"""experiments/gpu/torch_compare.py on CPU: the comparison numbers against hand-computed ones, and the
training probe's plumbing with the PyTorch kernel replaced by our jnp executor (PyTorch flash itself
needs CUDA; the GPU run is in docs/REPRODUCTION.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_flash as jf
from experiments.gpu import torch_compare as TC
from models import gpt2 as G
from helpers import micro_cfg


def _four(rng, shape):
    return [rng.standard_normal(shape) for _ in range(4)]


def test_compare_metrics_against_hand_computed_values(rng):
    shape = (2, 5, 3, 4)
    do = rng.standard_normal(shape)
    ref = _four(rng, shape)
    noise = [1e-2 * rng.standard_normal(shape) for _ in range(4)]
    theirs = [r + n for r, n in zip(ref, noise)]
    # ours == theirs: bitwise equal, identical errors
    m = TC.compare_metrics(do, ref, theirs, [t.copy() for t in theirs])
    assert m["o_bitwise_eq"] == 1.0 and m["delta_err_cos"] == pytest.approx(1.0)
    want_delta = np.einsum("bthd,bthd->bht", do, noise[0]).mean()
    assert m["delta_err_ours"] == pytest.approx(want_delta) and m["delta_err_theirs"] == pytest.approx(want_delta)
    for i, g in enumerate(("dq", "dk", "dv"), start=1):
        want = np.linalg.norm(noise[i]) / np.linalg.norm(ref[i])
        assert m[f"{g}_rel_err_ours"] == pytest.approx(want)
        assert m[f"{g}_rel_diff"] == 0.0 and m[f"{g}_err_cos"] == pytest.approx(1.0)
    # ours exact, theirs noisy: no agreement, zero error for ours, opposite-signed noise → cos −1
    m = TC.compare_metrics(do, ref, ref, theirs)
    assert m["o_bitwise_eq"] == 0.0 and m["delta_err_ours"] == 0.0
    mirrored = [r - n for r, n in zip(ref, noise)]
    m = TC.compare_metrics(do, ref, mirrored, theirs)
    assert m["dq_err_cos"] == pytest.approx(-1.0) and m["delta_err_cos"] == pytest.approx(-1.0)
    assert m["dk_rel_diff"] == pytest.approx(2 * np.linalg.norm(noise[2]) / np.linalg.norm(ref[2]))


@pytest.mark.slow  # experiment tooling, 15–30 s: JAX_FLASH_SLOW=1 (make test-all)
def test_probe_compares_every_layer_at_the_chosen_steps(tmp_path):
    cfg = micro_cfg(tmp_path / "run", "attention.kind=flash")
    model = G.GPT(cfg.model, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    x = rng.integers(0, cfg.model.vocab_size, (2, cfg.model.block_size))
    y = rng.integers(0, cfg.model.vocab_size, x.shape)

    def jnp_kernel(q, k, v, do):  # stands in for PyTorch flash: the other executor, same numerics
        f = lambda q, k, v: jf.attention(q, k, v, policy="fa2", impl="jnp")
        o, vjp = jax.vjp(f, *(jnp.asarray(a) for a in (q, k, v)))
        return [np.asarray(a) for a in (o, *vjp(jnp.asarray(do)))]

    probe = TC.TorchFlashCompare((x, y), steps=(3,), layers=(0, 1), other=jnp_kernel)
    assert probe(2, model, None) == {}
    m = probe(3, model, None)
    assert {k.rsplit("/", 1)[1] for k in m} == {"L0", "L1"}
    fn = probe._tensors
    assert probe(3, model, None).keys() == m.keys() and probe._tensors is fn  # compiled once
    for l in (0, 1):
        assert m[f"tcmp/o_bitwise_eq/L{l}"] > 0.99  # the two executors agree to ≤ 1 ulp
        for g in ("dq", "dk", "dv"):
            assert 0 < m[f"tcmp/{g}_rel_err_ours/L{l}"] < 2e-2  # bf16 kernels vs FP32 attention
            assert m[f"tcmp/{g}_rel_diff/L{l}"] < 0.5 * m[f"tcmp/{g}_rel_err_ours/L{l}"]
