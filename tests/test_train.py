"""train/: config overrides and their validation, schedule, optimizers, the jitted step, the loop
(metrics, divergence stop, checkpoint/resume bitwise, resume policy, exit status) and data
parallelism (a subprocess with 4 host devices). The checkpoint store itself: tests/test_checkpoint.py."""

import dataclasses
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.gpt2 import AttentionSpec
from train import config as C
from train import gpt2 as T
from train.checkpoint import CheckpointError, CheckpointStore

from helpers import MICRO, Tokens, micro_cfg

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- fixtures


def tokens_npz(path) -> Path:
    """Tokens() as a token file train.data.load_tokens reads (for runs started from the CLI)."""
    t = Tokens()
    meta = {"train_tokens": len(t.train), "val_tokens": len(t.val)}
    np.savez(path, train=t.train, val=t.val, meta=np.array(json.dumps(meta)))
    return Path(path)


def _wq_probe(seen):
    """A probe that records the steps it is called at and reports the norm of layer 1's W_Q."""
    def probe(step, model, batch):
        seen.append(step)
        x, y = batch
        assert x.shape == (4, 32)
        return {"wq_norm_l1": float(jnp.linalg.norm(model.blocks[1].attn.wq.kernel[...]))}

    return probe


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The uninterrupted 8-step micro run, with a probe every 3 steps and its batches recorded
    (neither changes the trajectory; one compiled run serves the loop, replay and resume tests):
    (run_dir, summary, the steps the probe saw)."""
    run = tmp_path_factory.mktemp("full") / "run"
    seen = []
    summary = T.train(micro_cfg(run, "probe_every=3", "data.record=true"), tokens=Tokens(),
                      probes=[_wq_probe(seen)])
    assert summary["resumed_from"] is None and summary["steps"] == 8
    return run, summary, seen


@pytest.fixture(scope="module")
def full_run(full):
    """The uninterrupted run's metrics: what every resumed run must reproduce."""
    return T.read_metrics(full[0])


@pytest.fixture(scope="module")
def ckpt_run(tmp_path_factory):
    """The same run from the token file with checkpoints every 2 steps, stopped after step 4
    (checkpoints 2 and 4). Started with resume=auto, which starts fresh when there is nothing."""
    d = tmp_path_factory.mktemp("ckpt")
    cfg = micro_cfg(d / "run", "checkpoint_every=2", f"data.path={tokens_npz(d / 'tokens.npz')}",
                    "resume=auto")
    summary = T.train(cfg, stop_after=4)
    assert summary["resumed_from"] is None and summary["steps"] == 4
    return d / "run", cfg


def copy_run(ckpt_run, dest):
    run, cfg = ckpt_run
    shutil.copytree(run, dest)
    return dest, dataclasses.replace(cfg, run_dir=str(dest))


# ----------------------------------------------------------------------------- config & CLI


def test_overrides_are_typed_and_nested():
    cfg = C.apply_overrides(
        C.get_preset("tiny-cpu"),
        [
            "model.n_layer=2",
            "attention.stable=true",
            "attention.kind=flash",
            "attention.beta=7",
            "optim.lr=3e-4",
            "optim.clip=none",
            "data.seq_len=64",
            "run_dir=/tmp/x",
            "progress=no",
            "model.attention_overrides=((1, 'standard'), (1, (0, 3), {'kind': 'flash', 'policy': 'fp32'}))",
        ],
    )
    assert cfg.model.n_layer == 2 and isinstance(cfg.model.n_layer, int)
    assert cfg.model.attention == AttentionSpec("flash", stable=True, beta=7.0)
    assert cfg.optim.lr == 3e-4 and cfg.optim.clip is None and cfg.data.seq_len == 64
    assert cfg.progress is False and cfg.run_dir == "/tmp/x"
    assert cfg.model.head_specs(1)[1] == AttentionSpec("standard")
    assert cfg.model.head_specs(1)[3] == AttentionSpec("flash", policy="fp32")
    # JSON round trip
    again = C.from_dict(json.loads(C.to_json(cfg)))
    assert again == cfg
    # a config written with a since-removed model option loads if it asked for what runs now
    stored = json.loads(C.to_json(cfg))
    stored["model"]["fused_qkv"] = False
    assert C.from_dict(stored) == cfg
    stored["model"]["fused_qkv"] = True
    with pytest.raises(ValueError, match="fused_qkv was removed"):
        C.from_dict(stored)


@pytest.mark.parametrize(
    "override, match",
    [
        ("model.n_layers=2", "unknown config key"),
        ("nope=1", "unknown config key"),
        ("optim.lr.x=1", "no sub-fields"),
        ("model.n_layer=two", "bad value"),
        ("attention.stable=maybe", "bad value"),
        ("optim.warmup_steps=none", "bad value"),  # not optional
        ("model.attention_overrides=(1,", "bad value"),
        ("model.n_head=5", "divisible"),  # GPTConfig validation surfaces as a bad value
        ("optim", "key=value"),
        ("model=1", "is a group"),
    ],
)
def test_override_errors(override, match):
    with pytest.raises(ValueError, match=match):
        C.apply_overrides(C.get_preset("tiny-cpu"), [override])


@pytest.mark.parametrize(
    "override, match",
    [
        ("data.batch_size=0", "batch_size must be an integer > 0"),
        ("data.grad_accum=0", "grad_accum must be an integer > 0"),
        ("data.seq_len=4096", "exceeds model.block_size"),
        ("model.n_head=0", "n_head must be an integer > 0"),
        ("model.n_layer=-1", "n_layer must be an integer > 0"),
        ("model.dtype=bf16", "did you mean 'bfloat16'"),
        ("optim.lr=nan", "lr must be a finite number > 0"),
        ("optim.lr=inf", "lr must be a finite number > 0"),
        ("optim.lr=0", "lr must be a finite number > 0"),
        ("optim.min_lr=-1e-5", "min_lr must be a finite number >= 0"),
        ("optim.b2=1.0", r"b2 must be in \[0, 1\)"),
        ("optim.warmup_steps=-1", "warmup_steps must be an integer >= 0"),
        ("optim.name=adam", "did you mean 'adamw'"),
        ("max_steps=0", "max_steps must be an integer >= 1"),
        ("keep_checkpoints=0", "keep_checkpoints must be an integer > 0"),
        ("divergence_factor=1", "divergence_factor must be 0 .* or a finite number > 1"),
        ("divergence_factor=nan", "divergence_factor"),
        ("resume=atuo", "did you mean 'auto'"),
        ("resume_step=4", "resume_step=4 needs resume=true"),
        ("attention.kind=flsh", "attention.kind: unknown value 'flsh'; did you mean 'flash'"),
        ("attention.policy=fa3", "attention.policy: unknown value 'fa3'; did you mean 'fa2'"),
        ("attention.delta=o_hpp", "did you mean 'o_hp'"),
        ("attention.impl=palas", "did you mean 'pallas'"),
        ("attention.beta=1", "beta must be a finite number > 1"),
        ("model.attention_overrides=((1, {'kind': 'flash', 'policy': 'papr'}),)",
         r"attention_overrides\[0\]: policy: .*did you mean 'paper'"),
        ("optim.lrr=1e-3", "unknown config key 'optim.lrr'; did you mean 'lr'"),
    ],
)
def test_bad_values_are_refused_while_parsing(override, match):
    with pytest.raises(ValueError, match=match):
        C.apply_overrides(C.get_preset("tiny-cpu"), [override])


def test_resume_values():
    base = C.get_preset("tiny-cpu")
    for raw, want in [("true", "true"), ("yes", "true"), ("1", "true"), ("false", "false"),
                      ("auto", "auto"), ("AUTO", "auto")]:
        assert C.apply_overrides(base, [f"resume={raw}"]).resume == want
    assert dataclasses.replace(base, resume=True).resume == "true"  # a bool from Python code
    assert C.apply_overrides(base, ["resume=true", "resume_step=5"]).resume_step == 5


def test_bad_values_stop_before_the_run_dir_exists(tmp_path, capsys):
    run = tmp_path / "run"
    for bad, says in [("data.batch_size=0", "batch_size"), ("optim.lr=nan", "finite"),
                      ("attention.kind=flsh", "did you mean 'flash'"), ("max_steps=0", "max_steps")]:
        with pytest.raises(SystemExit) as e:
            T.parse_args([f"run_dir={run}", bad])
        assert e.value.code == 2 and says in capsys.readouterr().err
    # configs built in code are checked by train() too (AttentionSpec itself accepts any name)
    cfg = micro_cfg(run)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, attention=AttentionSpec("flash", policy="fa3")))
    with pytest.raises(ValueError, match="did you mean 'fa2'"):
        T.train(cfg, tokens=Tokens())
    assert not run.exists()


def test_cli_parsing(capsys):
    cfg = T.parse_args(["--preset", "small-gpu", "optim.lr=2e-3"])
    assert cfg.optim.lr == 2e-3 and cfg.model.n_layer == 12
    with pytest.raises(SystemExit) as e:
        T.parse_args(["--preset", "tiny-cpu", "optim.lrr=1"])
    assert e.value.code == 2 and "unknown config key" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        T.parse_args(["--preset", "tiny-cpu", "--print-config", "model.n_layer=3"])
    assert e.value.code == 0 and json.loads(capsys.readouterr().out)["model"]["n_layer"] == 3


def test_presets():
    tiny = C.get_preset("tiny-cpu")
    assert 5e6 < tiny.model.num_params(non_embedding=False) < 1e7
    small = C.get_preset("small-gpu")
    assert T.grad_accum_steps(small, 1) == 1 and small.optim.warmup_steps == 500
    assert small.optim.decay_steps == 600_000 and small.model.n_layer == 12
    paper = C.get_preset("gpt2-small-paper")
    for n_dev, accum in [(1, 16), (4, 4), (16, 1)]:
        assert T.grad_accum_steps(paper, n_dev) == accum
        assert accum * n_dev * paper.data.batch_size * paper.model.block_size == 524_288
    with pytest.raises(ValueError, match="multiple"):
        T.grad_accum_steps(paper, 3)
    with pytest.raises(ValueError, match="unknown preset"):
        C.get_preset("huge")


def test_lr_schedule_nanogpt():
    cfg = C.apply_overrides(
        C.get_preset("tiny-cpu"),
        ["optim.lr=1e-3", "optim.min_lr=1e-5", "optim.warmup_steps=10", "optim.decay_steps=110"],
    )
    s = T.lr_schedule(cfg)
    np.testing.assert_allclose(float(s(0)), 1e-3 / 11, rtol=1e-6)
    np.testing.assert_allclose(float(s(9)), 1e-3 * 10 / 11, rtol=1e-6)
    np.testing.assert_allclose(float(s(10)), 1e-3, rtol=1e-6)
    np.testing.assert_allclose(float(s(60)), (1e-3 + 1e-5) / 2, rtol=1e-5)
    np.testing.assert_allclose(float(s(110)), 1e-5, rtol=1e-5)
    np.testing.assert_allclose(float(s(500)), 1e-5, rtol=1e-5)


def test_device_peak_table():
    class Dev:
        platform, device_kind = "gpu", "NVIDIA H200"

    assert T.device_peak_flops(Dev()) == 989e12
    assert T.device_peak_flops(jax.devices("cpu")[0]) is None


# ----------------------------------------------------------------------------- step functions


def _setup(cfg):
    graphdef, params = T.split_model(T.make_model(cfg))
    tx, schedule = T.make_optimizer(cfg)
    step = jax.jit(
        functools.partial(T.train_step, graphdef=graphdef, tx=tx, schedule=schedule),
        donate_argnums=0,
    )
    return graphdef, T.init_state(cfg, params, tx), step


@pytest.fixture(scope="module")
def constant_lr_step():
    """The micro model at a constant lr of 1e-2 (no warmup): its config, initial state and jitted
    step, compiled once for the tests that call the step directly (it donates its state: each test
    steps a copy)."""
    cfg = micro_cfg("/unused", "optim.warmup_steps=0", "optim.lr=1e-2", "optim.min_lr=1e-2")
    _, state, step = _setup(cfg)
    return cfg, state, step


def test_overfits_one_batch(constant_lr_step):
    cfg, state, step = constant_lr_step
    vocab = cfg.model.vocab_size
    state = jax.tree.map(jnp.copy, state)
    x = np.random.default_rng(0).integers(0, vocab, (1, 4, 33))
    batch = (jnp.asarray(x[..., :-1], jnp.int32), jnp.asarray(x[..., 1:], jnp.int32))
    losses = []
    for _ in range(25):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert abs(losses[0] - math.log(vocab)) < 0.1, losses[0]
    # below the batch's own unigram entropy (~ln 128, 128 targets): it learnt more than counts
    assert losses[-1] < 4.0, losses
    assert int(state["step"]) == 25


def test_grad_accumulation_matches_big_batch():
    # eps=1 makes Adam's first update ~ lr*g (smooth in g) instead of ~ lr*sign(g), whose entries
    # with g ~ 0 flip on rounding noise
    cfg = micro_cfg("/unused", "model.dtype=float32", "optim.eps=1.0")
    _, state, step = _setup(cfg)
    x = np.random.default_rng(1).integers(0, 512, (8, 33))
    xb, yb = jnp.asarray(x[:, :-1], jnp.int32), jnp.asarray(x[:, 1:], jnp.int32)
    with jax.default_matmul_precision("highest"):  # no TF32 on GPU
        s1, m1 = step(jax.tree.map(jnp.copy, state), (xb[None], yb[None]))
        s2, m2 = step(state, (xb.reshape(2, 4, 32), yb.reshape(2, 4, 32)))
    np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m1["grad_norm"]), float(m2["grad_norm"]), rtol=1e-5)
    p0 = jax.tree.leaves(_setup(cfg)[1]["params"])
    for a, b, c in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(s2["params"]), p0):
        upd = np.abs(np.asarray(a) - np.asarray(c)).max()
        # 0.1 % of the update, plus the ulp that adding it to the FP32 parameter may round away
        ulp = float(np.spacing(np.float32(np.abs(np.asarray(c)).max())))
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-3 * upd + ulp)


@pytest.mark.slow  # experiment tooling, 5–15 s: JAX_FLASH_SLOW=1 (make test-all)
def test_muon_partition_and_step():
    cfg = micro_cfg("/unused", "optim.name=muon", "optim.muon_lr=0.02")
    graphdef, state, step = _setup(cfg)
    dims = T.muon_dimension_numbers(state["params"])
    assert dims["wte"]["embedding"] is None and dims["wpe"]["embedding"] is None
    assert dims["ln_f"]["scale"] is None and dims["blocks"][0]["ln_1"]["scale"] is None
    for name in ("wq", "wk", "wv", "wo"):
        assert dims["blocks"][1]["attn"][name]["kernel"] is not None
    assert dims["blocks"][0]["mlp"]["fc"]["kernel"] is not None
    x = np.random.default_rng(2).integers(0, 512, (1, 4, 33))
    batch = (jnp.asarray(x[..., :-1], jnp.int32), jnp.asarray(x[..., 1:], jnp.int32))
    before = jax.tree.map(np.asarray, state["params"])
    losses = []
    for _ in range(10):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0] - 0.5, losses
    # a Muon update of a hidden matrix is orthogonalised: its singular values are nearly equal
    # (Newton-Schulz), unlike AdamW's; check the first update direction of one W_Q
    _, s0, step1 = _setup(cfg)
    s1, _ = step1(s0, batch)
    dw = (
        np.asarray(s1["params"]["blocks"][0]["attn"]["wq"]["kernel"])
        - before["blocks"][0]["attn"]["wq"]["kernel"]
    )
    sv = np.linalg.svd(dw, compute_uv=False)
    assert np.median(sv) / sv.max() > 0.4, sv


def test_checkpoint_round_trip(tmp_path, constant_lr_step):
    cfg, state, step = constant_lr_step
    state = jax.tree.map(jnp.copy, state)
    x = np.random.default_rng(3).integers(0, 512, (1, 4, 33))
    state, _ = step(
        state, (jnp.asarray(x[..., :-1], jnp.int32), jnp.asarray(x[..., 1:], jnp.int32))
    )
    store = CheckpointStore(tmp_path, keep=2)
    meta = {"step": 1, "sampler": {"seed": 0, "step": 7}, "running_min": 5.5}
    store.save(1, state, meta, config=C.to_dict(cfg), code={})
    like = jax.tree.map(jnp.zeros_like, state)
    assert store.select() == (1, [])
    restored, meta2 = store.restore(1, like, None)
    assert meta2 == meta and C.from_dict(store.manifest(1)["config"]) == cfg
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    store.close()


# ----------------------------------------------------------------------------- the loop


def test_train_loop_writes_metrics_summary_and_probes(full):
    run, summary, seen = full
    assert json.loads((run / "config.json").read_text())["model"]["n_layer"] == 2
    assert json.loads((run / "summary.json").read_text()) == summary
    ms = T.read_metrics(run)
    assert [m["step"] for m in ms] == list(range(1, 9))
    for m in ms:
        assert {"step", "loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "mfu"} <= m.keys()
        assert m["tokens_per_s"] > 0
        assert (m["mfu"] is None) == (jax.default_backend() == "cpu")
    assert [m["step"] for m in ms if "val_loss" in m] == [4, 8]
    assert seen == [3, 6] and [m["step"] for m in ms if "wq_norm_l1" in m] == [3, 6]
    np.testing.assert_allclose(ms[0]["lr"], 1e-2 / 3, rtol=1e-6)  # warmup 2: lr*(0+1)/3
    assert ms[-1]["loss"] < ms[0]["loss"] - 0.1
    assert summary["steps"] == 8 and summary["diverged_at"] is None
    assert (
        summary["final_loss"] == ms[-1]["loss"] and summary["final_val_loss"] == ms[-1]["val_loss"]
    )


def test_resume_is_bitwise(tmp_path, ckpt_run, full_run):
    part, cfg = copy_run(ckpt_run, tmp_path / "part")  # "interrupted" after step 4
    assert len(T.read_metrics(part)) == 4
    resumed = T.train(dataclasses.replace(cfg, resume=True))
    assert resumed["resumed_from"] == 4
    a, b = full_run, T.read_metrics(part)
    assert [m["step"] for m in b] == list(range(1, 9))
    assert [m["loss"] for m in a] == [m["loss"] for m in b]  # bitwise (floats from JSON)
    assert [m["grad_norm"] for m in a] == [m["grad_norm"] for m in b]
    assert [m.get("val_loss") for m in a] == [m.get("val_loss") for m in b]


def test_signal_stops_after_the_step_with_a_checkpoint_and_resumes_bitwise(tmp_path, full_run):
    """SIGTERM during step 3's probe: step 4 is finished, recorded and checkpointed, the run ends
    with stopped_by; the handler is put back; resume=true reproduces the uninterrupted run. (SIGINT
    takes the same path: test_a_second_signal_stops_at_once.)"""
    import os
    import signal

    signame = "SIGTERM"
    sig = signal.SIGTERM
    before = signal.getsignal(sig)
    tokens = Tokens()
    part = micro_cfg(tmp_path / "part", "checkpoint_every=100", "probe_every=1")

    def probe(step, model, batch):
        if step == 3:
            os.kill(os.getpid(), sig)  # delivered before the next Python bytecode
        return {}

    summary = T.train(part, tokens=tokens, probes=[probe])
    assert summary["stopped_by"] == signame and summary["steps"] == 4
    assert signal.getsignal(sig) is before
    assert [m["step"] for m in T.read_metrics(tmp_path / "part")] == [1, 2, 3, 4]
    assert CheckpointStore(tmp_path / "part", keep=2).steps() == [4]
    resumed = T.train(dataclasses.replace(part, resume=True), tokens=tokens)
    assert resumed["resumed_from"] == 4 and resumed["stopped_by"] is None
    b = T.read_metrics(tmp_path / "part")
    assert [m["step"] for m in b] == list(range(1, 9))
    assert [m["loss"] for m in full_run] == [m["loss"] for m in b]  # bitwise (floats from JSON)
    assert [m["grad_norm"] for m in full_run] == [m["grad_norm"] for m in b]


def test_a_second_signal_stops_at_once():
    import os
    import signal

    class Previous(Exception):
        pass

    def previous(signum, frame):
        raise Previous

    outer = signal.signal(signal.SIGINT, previous)
    try:
        with T._StopOnSignal() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.signal == "SIGINT"
            with pytest.raises(Previous):  # the second: the handler that was there before
                os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is previous
    finally:
        signal.signal(signal.SIGINT, outer)


def test_cli_exit_status_after_a_signal(tmp_path, monkeypatch, capsys):
    """python -m train.gpt2 stopped by a signal: exit status 4 and a line saying how to go on."""
    monkeypatch.setattr(T, "train", lambda cfg, probes=(): {"steps": 5, "stopped_by": "SIGTERM",
                                                             "diverged_at": None})
    with pytest.raises(SystemExit) as e:
        T.run_cli(micro_cfg(tmp_path / "r"))
    assert e.value.code == T.EXIT_STOPPED == 4
    assert "stopped by SIGTERM after step 5; resume=true" in capsys.readouterr().err


def _plant(monkeypatch, at_step, fn, key="loss"):
    """Replace metric `key` of step `at_step` (1-based) by fn(value); key "opt_state" applies fn to
    every floating-point leaf of the optimizer state that step leaves behind."""
    orig = T.train_step

    def planted(state, batch, **kw):
        new, m = orig(state, batch, **kw)
        hit = state["step"] == at_step - 1
        if key == "opt_state":
            new = dict(new, opt_state=jax.tree.map(
                lambda x: jnp.where(hit, fn(x), x) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                new["opt_state"]))
        else:
            m = dict(m, **{key: jnp.where(hit, fn(m[key]), m[key])})
        return new, m

    monkeypatch.setattr(T, "train_step", planted)


def test_divergence_stops_on_planted_nan(tmp_path, monkeypatch):
    _plant(monkeypatch, 3, lambda l: l * jnp.nan)
    summary = T.train(micro_cfg(tmp_path, "max_steps=20"), tokens=Tokens())
    assert summary["diverged_at"] == 3 and "non-finite" in summary["reason"]
    assert json.loads((tmp_path / "summary.json").read_text())["diverged_at"] == 3
    assert [m["step"] for m in T.read_metrics(tmp_path)] == [1, 2, 3]


def test_divergence_stops_on_loss_spike_after_warmup(tmp_path, monkeypatch):
    _plant(monkeypatch, 6, lambda l: l * 3.5)
    # max_steps 8 as the run below (the factor is checked on the host): one compiled step for both
    summary = T.train(micro_cfg(tmp_path, "max_steps=8", "eval_every=0"), tokens=Tokens())
    assert summary["diverged_at"] == 6 and "running min" in summary["reason"]
    # disabled factor: runs to the end
    summary = T.train(
        micro_cfg(tmp_path, "max_steps=8", "eval_every=0", "divergence_factor=0"), tokens=Tokens()
    )
    assert summary["diverged_at"] is None and summary["steps"] == 8


def test_divergence_reason():
    r = T.divergence_reason
    assert r(10.8, 1.0, math.inf, 3.0) is None  # the first step has nothing to compare with
    assert "non-finite loss nan" in r(math.nan, 1.0, 5.0, 3.0)
    assert "non-finite gradient norm nan" in r(5.0, math.nan, 5.0, 3.0)
    assert "non-finite gradient norm inf" in r(5.0, math.inf, 5.0, 3.0)
    assert r(15.0, 1.0, 5.0, 3.0) is None and "3 x running min 5.0000" in r(15.001, 1.0, 5.0, 3.0)
    assert r(1e6, 1.0, 5.0, 0.0) is None  # factor 0: only non-finite values stop


def test_packed_metrics_read_back_unchanged(tmp_path):
    """results/ keeps a run's metrics xz-compressed; read_metrics returns the records as written."""
    recs = [{"step": 1, "loss": 10.913906097412109}, {"step": 2, "max_logit/L1": [1.5, 2.25]}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    dest = tmp_path / "kept"
    dest.mkdir()
    assert T.pack_metrics(tmp_path, dest).name == "metrics.jsonl.xz"
    assert T.has_metrics(dest) and T.read_metrics(dest) == recs
    with pytest.raises(FileNotFoundError, match="no metrics"):
        T.read_metrics(tmp_path / "nothing")


def test_divergence_rule_on_the_committed_runs():
    """Replayed over every committed run's metrics (GPT-2 small on the H200, warmup included), the
    rule fires exactly where a recorded run was stopped and nowhere else: a healthy warmup's loss
    stays far below 3x its running minimum."""
    paths = sorted((REPO / "results").rglob("metrics.jsonl.xz"))
    assert paths, "no committed runs under results/"
    for path in paths:
        fired, running = None, math.inf
        for m in T.read_metrics(path.parent):
            if "loss" not in m:
                continue
            if T.divergence_reason(m["loss"], m.get("grad_norm", 0.0), running, 3.0):
                fired = m["step"]
                break
            running = min(running, m["loss"])
        summary = path.parent / "summary.json"
        stopped = json.loads(summary.read_text()).get("diverged_at") if summary.exists() else None
        assert fired == stopped, path


def test_nan_gradient_norm_at_a_checkpoint_step_is_not_saved(tmp_path, monkeypatch):
    """Finite loss, NaN gradient norm at checkpoint step 4, keep_checkpoints=1: the run stops at
    step 4 and step 2 stays on disk as the last good checkpoint (saving 4 would have rotated it
    away)."""
    _plant(monkeypatch, 4, lambda g: g * jnp.nan, key="grad_norm")
    summary = T.train(micro_cfg(tmp_path, "checkpoint_every=2", "keep_checkpoints=1",
                                "eval_every=0"), tokens=Tokens())
    assert summary["diverged_at"] == 4 and "non-finite gradient norm" in summary["reason"]
    assert summary["last_good_checkpoint"] == 2
    assert [m["step"] for m in T.read_metrics(tmp_path)] == [1, 2, 3, 4]
    store = CheckpointStore(tmp_path, 1)
    assert store.steps() == [2] and store.verify(2) is None


def test_nonfinite_optimizer_state_at_a_checkpoint_step_is_not_saved(tmp_path, monkeypatch):
    """Loss and gradient norm finite, but the optimizer moments after step 4 are not: the state
    check before the save stops the run instead."""
    _plant(monkeypatch, 4, lambda x: x * jnp.inf, key="opt_state")
    summary = T.train(micro_cfg(tmp_path, "checkpoint_every=2", "keep_checkpoints=1",
                                "eval_every=0"), tokens=Tokens())
    assert summary["diverged_at"] == 4
    assert "non-finite values in the optimizer state" in summary["reason"]
    assert "parameters" not in summary["reason"]  # the params after step 4 are still finite
    assert CheckpointStore(tmp_path, 1).steps() == [2] and summary["last_good_checkpoint"] == 2


def test_divergence_in_warmup_exits_3(tmp_path, capsys):
    """lr 1e3: the loss leaps at step 2, inside a 10-step warmup; the CLI exits with status 3 and
    names the step and the reason."""
    npz = tokens_npz(tmp_path / "tokens.npz")
    with pytest.raises(SystemExit) as e:
        T.main([*MICRO, f"run_dir={tmp_path / 'run'}", f"data.path={npz}", "optim.lr=1e3",
                "optim.warmup_steps=10", "checkpoint_every=1", "eval_every=0"])
    assert e.value.code == T.EXIT_DIVERGED == 3
    err = capsys.readouterr().err
    assert "diverged at step 2: loss" in err and "running min" in err
    assert "last good checkpoint: 1" in err
    assert CheckpointStore(tmp_path / "run", 2).steps() == [1]


def _tree_bytes(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_resume_refusals_change_nothing(tmp_path, ckpt_run):
    run, cfg = copy_run(ckpt_run, tmp_path / "run")
    before = _tree_bytes(run)
    cases = [
        (dataclasses.replace(cfg, resume="false"), T.RunError, "already holds checkpoints .*2, 4"),
        (C.apply_overrides(cfg, ["resume=true", "max_steps=12", "attention.kind=flash",
                                 "optim.warmup_steps=5"]),
         T.RunError, r"resume cannot change attention.kind \('standard' -> 'flash'\), "
                     r"optim.warmup_steps \(2 -> 5\): "),
        (C.apply_overrides(cfg, ["resume=true", "resume_step=3"]), CheckpointError,
         "no checkpoint at step 3"),
        (C.apply_overrides(cfg, ["resume=true", "max_steps=3"]), T.RunError, "past max_steps=3"),
    ]
    for bad, err, match in cases:
        with pytest.raises(err, match=match) as e:
            T.train(bad)
        assert "\n" not in str(e.value) and "max_steps (" not in str(e.value)
        assert _tree_bytes(run) == before
    # already at max_steps: nothing to train, nothing rewritten, the stored summary returned
    done = T.train(C.apply_overrides(cfg, ["resume=true", "max_steps=4"]))
    assert done == json.loads((run / "summary.json").read_text()) and done["steps"] == 4
    assert _tree_bytes(run) == before
    # the step asked for is damaged: stop, no fallback
    chunk = max((p for p in (run / "checkpoints/4").rglob("*") if p.is_file()),
                key=lambda p: p.stat().st_size)
    chunk.write_bytes(chunk.read_bytes()[:-1])  # truncated by one byte
    before = _tree_bytes(run)
    with pytest.raises(CheckpointError, match="checkpoint 4 .*asked for by resume_step, is damaged"):
        T.train(C.apply_overrides(cfg, ["resume=true", "resume_step=4"]))
    assert _tree_bytes(run) == before
    # nothing to resume
    with pytest.raises(T.RunError, match="holds no checkpoint to resume; resume=auto"):
        T.train(dataclasses.replace(cfg, run_dir=str(tmp_path / "none"), resume="true"))
    assert not (tmp_path / "none").exists()


def test_cli_resume_falls_back_from_a_damaged_checkpoint(tmp_path, ckpt_run, full_run, capsys):
    """16 bytes overwritten in checkpoint 4, then ``run_dir=R resume=true max_steps=6`` from the CLI:
    one line says checkpoint 4 is damaged and the run resumes from 2; the stored config is used
    (2 layers, not the tiny-cpu preset's 4); a trajectory key is refused with status 2; the cosine
    keeps ending at the stored max_steps=8, so every step equals the uninterrupted run's."""
    run, cfg = copy_run(ckpt_run, tmp_path / "run")
    chunk = max((p for p in (run / "checkpoints/4/state").rglob("*") if p.is_file()),
                key=lambda p: p.stat().st_size)
    data = bytearray(chunk.read_bytes())
    data[100:116] = bytes(b ^ 0xFF for b in data[100:116])
    chunk.write_bytes(bytes(data))
    config_before = (run / "config.json").read_bytes()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        T.main([f"run_dir={run}", "resume=true", "model.n_layer=3"])
    assert e.value.code == T.EXIT_REFUSED
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "refused" in err and "model.n_layer (2 -> 3)" in err
    assert (run / "config.json").read_bytes() == config_before

    T.main([f"run_dir={run}", "resume=true", "max_steps=6"])  # no SystemExit: status 0
    out = capsys.readouterr().out
    said = [l for l in out.splitlines() if "damaged" in l]
    assert len(said) == 1 and "4: " in said[0] and "sha256" in said[0]
    assert "resumed from step 2, the newest intact one" in said[0]
    assert "optim.decay_steps pinned to 8" in out
    assert (run / "checkpoints_set_aside" / "4").is_dir()
    stored = C.from_dict(json.loads((run / "config.json").read_text()))
    assert stored.model.n_layer == 2 and stored.max_steps == 6 and stored.optim.decay_steps == 8
    pick = lambda ms: [(m["step"], m["loss"], m["grad_norm"]) for m in ms if m["step"] <= 6]
    assert pick(T.read_metrics(run)) == pick(full_run)  # bitwise, as if never interrupted
    store = CheckpointStore(run, 2)
    assert store.steps() == [4, 6] and store.verify(6) is None
    assert store.manifest(6)["config"] == C.to_dict(stored)
    # resume_step is how one process started, not part of the run: the next resume drops it
    (run / "config.json").write_text(C.to_json(dataclasses.replace(stored, resume_step=2)))
    again = T.parse_args([f"run_dir={run}", "resume=true"])
    assert again.resume_step is None and again.max_steps == 6 and again.model.n_layer == 2


def test_data_parallel_matches_single_device(tmp_path):
    """4 host devices (global micro-batch 8 = 4 x 2) vs 1 device (8): same losses within FP32
    reduction-order noise. Measured at lr 3e-3: losses ~2e-7 relative, grad norms ~1e-6 (bf16
    compute: ~1e-5); Adam amplifies the noise on near-zero gradients, so it grows with lr and steps.
    On 4 devices the model is traced for each device's 2 rows (``per_device``: a kernel without a
    partitioning rule then runs on its own rows, not on the gathered batch)."""
    script = textwrap.dedent(f"""
      import json, sys
      sys.path.insert(0, {str(REPO)!r}); sys.path.insert(0, {str(Path(__file__).parent)!r})
      import jax
      from helpers import Tokens, micro_cfg
      from train import gpt2 as T
      n = jax.device_count()
      traced, loss_fn = [], T.loss_fn
      def recording(params, graphdef, x, y):
          traced.append(x.shape[0])
          return loss_fn(params, graphdef, x, y)
      T.loss_fn = recording
      cfg = micro_cfg({str(tmp_path)!r} + f"/run{{n}}", "model.dtype=float32",
                      f"data.batch_size={{8 // n}}", "max_steps=5", "optim.lr=3e-3")
      T.train(cfg, tokens=Tokens())
      print("TRACED", json.dumps(sorted(set(traced))))
      print("RESULT", json.dumps([n] + [[m["loss"], m["grad_norm"]] for m in T.read_metrics(cfg.run_dir)]))
  """)
    out = {}
    for n in (1, 4):
        if n == jax.device_count() == 1 and jax.default_backend() == "cpu":
            # the one-device run needs no process of its own here (a process start is ~10 s)
            cfg = micro_cfg(tmp_path / "run1", "model.dtype=float32", "data.batch_size=8",
                            "max_steps=5", "optim.lr=3e-3")
            T.train(cfg, tokens=Tokens())
            out[1] = np.array([[m["loss"], m["grad_norm"]] for m in T.read_metrics(cfg.run_dir)])
            continue
        env = dict(
            os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}", JAX_PLATFORMS="cpu"
        )
        proc = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1]
        res = json.loads(line.split(" ", 1)[1])
        assert res[0] == n
        traced = [l for l in proc.stdout.splitlines() if l.startswith("TRACED")][-1]
        assert json.loads(traced.split(" ", 1)[1]) == [8 // n]  # the rows one device holds
        out[n] = np.array(res[1:])
    assert json.loads((tmp_path / "run4" / "summary.json").read_text())["n_devices"] == 4
    np.testing.assert_allclose(out[4][:, 0], out[1][:, 0], rtol=1e-5)  # losses
    np.testing.assert_allclose(out[4][:, 1], out[1][:, 1], rtol=1e-4)  # grad norms
    assert not np.array_equal(out[1][0], out[1][-1])  # it trained


@pytest.mark.slow  # skipped unless JAX_FLASH_SLOW=1 (tests/conftest.py)
def test_tiny_cpu_preset_learns(tmp_path):
    """The tiny-cpu preset for 300 steps on the repeated synthetic corpus (minutes on 2 cores)."""
    cfg = C.apply_overrides(C.get_preset("tiny-cpu"), [f"run_dir={tmp_path}", "progress=false"])
    summary = T.train(cfg, tokens=Tokens(vocab=50304, n=20000))
    assert summary["diverged_at"] is None and summary["final_loss"] < 6.0


def test_recorded_data_order_replays_the_run(tmp_path, full):
    """The paper's record-and-replay: a run that records its batches (the uninterrupted run) and a
    run that replays the file (with a different sampler seed, which replay must ignore) train on the
    same data: same losses."""
    tokens = Tokens()
    run, rec, _ = full
    order = run / "data_order.bin"
    assert order.exists()
    rep = T.train(
        micro_cfg(tmp_path / "rep", f"data.replay={order}", "data.seed=99", "eval_every=0"),
        tokens=tokens,
    )
    a, b = T.read_metrics(run), T.read_metrics(tmp_path / "rep")
    assert rec["steps"] == rep["steps"] == len(a) == len(b)
    assert [m["loss"] for m in a] == [m["loss"] for m in b]
    # Without the replay file the other seed draws other batches: the replay was what matched.
    T.train(micro_cfg(tmp_path / "other", "data.seed=99", "eval_every=0"), tokens=tokens)
    assert [m["loss"] for m in T.read_metrics(tmp_path / "other")] != [m["loss"] for m in a]


@pytest.mark.slow  # experiment tooling, 20–30 s: JAX_FLASH_SLOW=1 (make test-all)
def test_replicate_nudges_the_init_by_one_ulp_and_is_repeatable(tmp_path):
    """``replicate=k``: the same init up to one ulp per parameter, so the run parts from replicate 0
    within a few steps, while two runs of one replicate stay bitwise equal (on CPU; on the GPU under
    deterministic ops)."""
    params = T.split_model(T.make_model(micro_cfg(tmp_path / "p")))[1]
    a, b = (jax.tree_util.tree_leaves(T.nudge_params(params, r)) for r in (0, 3))
    base = jax.tree_util.tree_leaves(params)
    assert all(x is y for x, y in zip(a, base))  # replicate 0: the very same arrays
    moved = total = 0
    for x, y in zip(base, b):
        x, y = np.asarray(x), np.asarray(y)
        ulp = np.abs(np.spacing(x))
        assert np.all(np.abs(y.astype(np.float64) - x) <= ulp * 1.0001), "more than one ulp"
        moved += int(np.sum(x != y))
        total += x.size
    assert 0.55 < moved / total < 0.78  # two thirds moved
    tokens = Tokens()
    runs = [T.train(micro_cfg(tmp_path / name, f"replicate={r}", "eval_every=0"), tokens=tokens)
            for name, r in (("r0", 0), ("r1", 1), ("r1b", 1))]
    assert runs[1]["final_loss"] == runs[2]["final_loss"]
    l0, l1, l1b = ([m["loss"] for m in T.read_metrics(tmp_path / n)] for n in ("r0", "r1", "r1b"))
    assert l1 == l1b and l0 != l1
    assert max(abs(x - y) for x, y in zip(l0, l1)) < 1e-2  # the same run, barely moved
