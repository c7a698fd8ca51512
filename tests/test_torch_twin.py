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
    TT.main(["--arm", "torch-standard", "--seed", str(seed), "--steps", str(steps), "--probe-every", "6",
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


def _reference_grads(q, k, v, do):
    """Causal attention's gradients by autograd in float64."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    t = q.shape[2]
    s = s.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool)), float("-inf"))
    (torch.softmax(s, -1) @ v).backward(do.double())
    return q.grad, k.grad, v.grad


def _delta_grads(q, k, v, do, delta):
    from experiments.torch_parity import FlashWithDelta

    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    FlashWithDelta.apply(q, k, v, delta).backward(do)
    return q.grad, k.grad, v.grad


def test_written_out_backward_is_attentions_gradient_and_delta_is_the_only_switch():
    """In float64 (nothing rounded) both δ give autograd's gradients — rowsum(dP∘P) = rowsum(dO∘O)
    in exact arithmetic — across several row chunks and a partial last chunk; in bf16 they differ,
    and only through δ: dV (no δ in it) is bitwise the same."""
    from experiments import torch_parity

    g = torch.Generator().manual_seed(0)
    shape = (2, 3, torch_parity.DELTA_CHUNK * 2 + 40, 16)
    q, k, v, do = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(4))
    want = _reference_grads(q, k, v, do)
    for delta in ("o", "dpp"):
        for got, ref in zip(_delta_grads(q, k, v, do, delta), want):
            torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    bf = [x.to(torch.bfloat16) for x in (q, k, v, do)]
    o_grads, dpp_grads = _delta_grads(*bf, "o"), _delta_grads(*bf, "dpp")
    assert torch.equal(o_grads[2], dpp_grads[2])
    assert not torch.equal(o_grads[0], dpp_grads[0]) and not torch.equal(o_grads[1], dpp_grads[1])
    with pytest.raises(ValueError, match="delta"):
        _delta_grads(q, k, v, do, "x")


def test_compiled_backward_is_opt_in_and_routed_through_the_compiled_function(monkeypatch):
    """``compiled=True`` takes the gradients from ``compiled_written_out_grads()`` (here a spy that
    runs the eager function, so the result must be bitwise the eager one); the default never
    calls it; a TorchGPT built with ``compiled_backward`` passes the switch to every layer."""
    from experiments import torch_parity as TP

    calls = []

    def spy(*args):
        calls.append(args[6])  # δ
        return TP.written_out_grads(*args)

    monkeypatch.setattr(TP, "compiled_written_out_grads", lambda: spy)
    g = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn((1, 2, 40, 8), generator=g).to(torch.bfloat16) for _ in range(4))
    eager = _delta_grads(q, k, v, do, "dpp")
    assert calls == []
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    TP.FlashWithDelta.apply(q2, k2, v2, "dpp", True).backward(do)
    assert calls == ["dpp"]
    for got, want in zip((q2.grad, k2.grad, v2.grad), eager):
        assert torch.equal(got, want)
    model = TP.TorchGPT(dict(MODEL), kind="flash-o", compiled_backward=True)
    assert all(b.attn.compiled_backward for b in model.h)
    assert not any(b.attn.compiled_backward for b in TP.TorchGPT(dict(MODEL), kind="flash-o").h)
