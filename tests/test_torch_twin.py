"""experiments/gpu/torch_train.py (the PyTorch twin of the reproduction) against the JAX run it
twins, on CPU with a micro model: same init, same batches, same probe, so per-step losses and probe
metrics must agree to bf16 noise. Needs torch (not in the project's dependencies: skipped in CI; run
from a venv with torch, e.g. ``/work/torchvenv/bin/python -m pytest tests/test_torch_twin.py``)."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from experiments import reproduce as R  # noqa: E402
from experiments.gpu import torch_train as TT  # noqa: E402
from helpers import Tokens  # noqa: E402

MODEL = {"vocab_size": 512, "n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 32}


def _records(path):
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def test_torch_twin_tracks_the_jax_run(tmp_path):
    tok = Tokens()
    data = tmp_path / "tok.npz"
    np.savez_compressed(data, train=tok.train, val=tok.val,
                        meta=np.array(json.dumps({"train_tokens": len(tok.train), "val_tokens": len(tok.val)})))
    seed, steps = 2, 12
    R.main(["run", "--arm", "standard", "--seed", str(seed), "--steps", str(steps), "--probe-every", "6",
            "--data", str(data), "--out", str(tmp_path)]
           + [f"model.{k}={v}" for k, v in MODEL.items()] + ["data.batch_size=4", "optim.warmup_steps=3"])
    TT.main(["--attn", "standard", "--seed", str(seed), "--steps", str(steps), "--probe-every", "6",
             "--batch-size", "4", "--data", str(data), "--out", str(tmp_path), "--device", "cpu",
             "--model", json.dumps(MODEL), "--warmup-steps", "3"])
    jx = _records(tmp_path / f"standard-s{seed}" / "metrics.jsonl")
    th = _records(tmp_path / f"torch-standard-s{seed}" / "metrics.jsonl")
    loss_j = {r["step"]: r["loss"] for r in jx if "loss" in r}
    loss_t = {r["step"]: r["loss"] for r in th if "loss" in r}
    assert sorted(loss_t) == list(range(1, steps + 1)) == sorted(loss_j)
    # the loss falls (warmup 3, lr 1e-3): a twin on other batches or another init would not match
    assert loss_t[steps] < loss_t[1] - 0.05
    for s in loss_j:
        assert loss_t[s] == pytest.approx(loss_j[s], rel=2e-4), s
    pj = {r["step"]: r for r in jx if "max_logit/L1" in r}
    pt = {r["step"]: r for r in th if "max_logit/L1" in r}
    assert sorted(pj) == sorted(pt) == [6, 12]
    for s in pj:
        assert pt[s]["probe_loss"] == pytest.approx(pj[s]["probe_loss"], rel=2e-4)
        for l in range(MODEL["n_layer"]):
            for h in range(MODEL["n_head"]):
                for w in ("wq_norm", "wk_norm"):
                    # exact SVD vs power iteration (slow on a random init's nearly equal
                    # singular values), on weights that differ by bf16 noise
                    key = f"{w}/L{l}/H{h}"
                    assert pt[s][key] == pytest.approx(pj[s][key], rel=3e-3), key
            assert pt[s][f"max_logit/L{l}"] == pytest.approx(pj[s][f"max_logit/L{l}"], rel=2e-2)
            assert abs(pt[s][f"tie_frac/L{l}"] - pj[s][f"tie_frac/L{l}"]) < 0.05
