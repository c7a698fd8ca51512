"""train.probes.save_layer_tensors / load_layer_tensors and experiments/real_chain.py: the saved
tensors are training's, bit for bit, and the CPU re-run of an arm's kernel on them reproduces what
the training-time probe measured with that kernel (two independent computations of the same
W_Q-gradient error)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import real_chain as RC
from models import gpt2 as G
from train import probes as P


def bf16_flash_model(rng):
    cfg = G.GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=4, n_embd=64,
                      dtype="bfloat16", attention=G.AttentionSpec("flash"))
    model = G.GPT(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 16))))
    attn = model.blocks[1].attn  # scores of O(1) rather than ~0 as at init, so S̄ does not vanish
    for w in (attn.wq, attn.wk):
        w.kernel[...] = w.kernel[...] * 8.0
    x = rng.integers(0, 128, (2, 64)).astype(np.int32)
    y = rng.integers(0, 128, (2, 64)).astype(np.int32)
    return model, (x, y)


@pytest.mark.slow  # experiment tooling, 15–30 s: JAX_FLASH_SLOW=1 (make test-all)
def test_layer_tensors_round_trip_bitwise(rng, tmp_path):
    """The file holds exactly what the snapshot program computed (dtype and bits), and that is the
    probe's own q, k, v (bitwise) and dO (two separately compiled backward programs: XLA:CPU may
    order an FP32 sum differently, so a few dO rows differ in their last bits — 0.3 % of the
    elements seen, 1e-2 of the row's scale)."""
    model, (x, y) = bf16_flash_model(rng)
    path = P.save_layer_tensors(model, (x, y), 1, tmp_path / "t.npz", n_seq=2, step=7)
    got = P.load_layer_tensors(path)
    graphdef, state = nnx.split(model)
    saved = P._layer_tensors_fn(graphdef, 1)(nnx.to_pure_dict(state), jnp.asarray(x, jnp.int32),
                                              jnp.asarray(y, jnp.int32))
    _, layers = P.chain_tensors(model, jnp.asarray(x), jnp.asarray(y))
    assert got["layer"] == 1 and got["step"] == 7
    for name in ("q", "k", "v", "do"):
        want = layers[1][name]
        assert got[name].dtype == saved[name].dtype == want.dtype == jnp.bfloat16, name
        a = np.asarray(got[name], np.float32)
        np.testing.assert_array_equal(a, np.asarray(saved[name], np.float32), err_msg=name)
        b = np.asarray(want, np.float32)
        if name != "do":
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:
            assert np.mean(a == b) >= 0.99
            scale = np.max(np.abs(b), axis=-1, keepdims=True)  # per row and head
            assert np.all(np.abs(a - b) <= 1e-2 * scale + 1e-30)


@pytest.mark.slow  # experiment tooling, 15–20 s: JAX_FLASH_SLOW=1 (make test-all)
def test_cpu_rerun_matches_the_training_probe(rng):
    """The fa2 arm re-run on the probe's L1 tensors reproduces the probe's measurements for the same model
    and sequences: its dQ error along W_Q equals the one formed from the probe's own tensors
    (``chain_tensors``: the model's dQ, the FP32 shadow's), its δ part and the true component the
    jitted probe's ``wq_grad_err_delta`` and ``wq_grad`` (1 %: float64 vs FP32 shadow), and δ = dpp's
    δ part is orders of magnitude smaller. (The jitted probe's total is not compared: on a micro model
    it is dominated by dQ's BF16 output rounding, whose flips move with XLA's fusion — 15 % seen.)"""
    model, (x, y) = bf16_flash_model(rng)
    m = P.CausalChainProbe(n_seq=2)(1, model, (x, y))
    _, layers = P.chain_tensors(model, jnp.asarray(x), jnp.asarray(y))
    lay = layers[1]
    # the probe's own L1 tensors (the file holds these up to a few dO rows' last bits, which move
    # the total by percents on a micro model: test_layer_tensors_round_trip_bitwise)
    tensors = {name: lay[name] for name in ("q", "k", "v", "do")}
    fa2, dpp = RC.analyze(tensors, arms=("fa2", "fa2-dpp"))
    q = np.asarray(jnp.asarray(lay["q"], jnp.float32), np.float64)
    per_row = np.sum(q * (np.asarray(lay["dq_lp"], np.float64) - np.asarray(lay["dq_hp"], np.float64)), -1)
    want = per_row.sum()
    total = fa2["total, tied"] + fa2["total, tie-free"]
    via_delta = fa2["δ part, tied"] + fa2["δ part, tie-free"]
    assert abs(via_delta) > 1e-7
    # (the same function compiled twice: a BF16 flip in one row moves this sum of signed errors by
    # 0.14 % of itself — seed 505 — so the scale is the rows' absolute errors)
    assert abs(total - want) <= 1e-2 * np.abs(per_row).sum()
    np.testing.assert_allclose(via_delta, m["wq_grad_err_delta/L1"], rtol=2e-2)
    np.testing.assert_allclose(fa2["Σ q·dQ_hp"], m["wq_grad/L1"], rtol=2e-2)
    # δ = dpp's δ part against the rows' absolute errors, not fa2's signed sum, which cancels (seed
    # 29734332: 1 % of the rows' scale, dpp's part 1.5e-3 of it); over 7 seeds dpp's part was
    # ≤ 1.4e-5 of that scale, fa2's 0.7–12 %
    assert abs(dpp["δ part, tied"] + dpp["δ part, tie-free"]) < 1e-3 * np.abs(per_row).sum()
    assert fa2["rows"] == 2 * 4 * 64
    md = RC.markdown([fa2, dpp])
    assert md.count("\n") == 4 and "fa2-dpp" in md
    heads = RC.analyze(tensors, arms=("fa2",), by_head=True)  # the per-head rows sum to the whole
    assert [r["head"] for r in heads] == [0, 1, 2, 3]
    for col in ("rows", "Σ q·dQ_hp", "total, tie-free", "δ part, tie-free", "rest, tie-free"):
        np.testing.assert_allclose(sum(r[col] for r in heads), fa2[col], rtol=1e-9, atol=1e-12)
    assert max(r["max score"] for r in heads) == fa2["max score"]
