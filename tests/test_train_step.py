"""bench.train_step on a CPU: the results file of a tiny model (our arms with the jnp executor, cuDNN's
failure recorded), the run order and time budget, the timing loop on a simulated device, the MFU
formula against a hand computation, nanoGPT's step (bench/nanogpt_step.py) when a PyTorch is at hand,
and the op-family grouping of lab.trace_split on a hand-written HLO module and trace and on a real
CPU capture. Speed itself is measured on a GPU, never asserted here.

nanoGPT's step needs PyTorch, which the project's environment leaves out: the test runs when this
interpreter imports torch or when TORCH_PYTHON names one that does (e.g. a venv with
`pip install torch numpy`), and is skipped otherwise. It uses nanoGPT's model.py when `make nanogpt`
has fetched it into third_party/nanoGPT, else a stand-in with nanoGPT's interface written here.
"""

import gzip
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench import step_timing
from bench import train_step as ts
from lab import trace_split as tsp

ROOT = Path(__file__).resolve().parent.parent
# Sizes small enough for a CPU; the vocabulary (384) is no other axis's size, as the grouping needs.
TINY = ["--preset", "tiny-cpu", "--set", "model.n_layer=1", "--set", "model.n_embd=32",
        "--set", "model.n_head=2", "--set", "model.block_size=32", "--set", "model.vocab_size=384",
        "--set", "attention.impl=jnp"]
TOP_KEYS = {"command", "date", "git_rev", "git_tree", "preset", "model", "seq_len", "n_params_non_embedding",
            "flops_per_token", "flops_formula", "timing", "steps", "warmup", "batches", "versions",
            "device", "runs", "total_s"}
RUN_KEYS = {"arm", "batch", "framework", "status", "step_ms", "step_times_ms", "back_to_back_ms",
            "tokens_per_step", "tokens_per_s", "mfu", "peak_memory_bytes", "compile_s", "device",
            "loss_last", "grad_accum"}


# ----------------------------------------------------------------------------- MFU and timing


def test_flops_and_mfu_by_hand():
    """GPT-2 small: N without position embeddings = 12·(12·768² + 2·768) + 768 (ln_f) + 50304·768
    (tied wte) = 84,953,088 + 768 + 38,633,472 = 123,587,328; FLOPs per token 6N + 12·L·d·T =
    741,523,968 + 12·12·768·1024 (= 113,246,208) = 854,770,176. At 64 ms per 32×1024 tokens:
    512,000 tokens/s and MFU 854,770,176 × 512,000 / 989e12 = 0.44251…"""
    from models.gpt2 import GPTConfig
    from train.gpt2 import flops_per_token

    assert GPTConfig().num_params(non_embedding=True) == 123_587_328
    fpt = flops_per_token(GPTConfig(), 1024)
    assert fpt == 854_770_176
    run = {"step_ms": {"median": 64.0}, "back_to_back_ms": 62.5, "tokens_per_step": 32 * 1024,
           "device": "NVIDIA H200", "platform": "gpu", "n_devices": 1}
    peaks = {}
    ts.derive(run, fpt, peaks)
    assert run["tokens_per_s"] == pytest.approx(512_000, rel=1e-12)
    assert run["mfu"] == pytest.approx(854_770_176 * 512_000 / 989e12, rel=1e-12)
    assert 0.4425 < run["mfu"] < 0.4426
    assert run["back_to_back_tokens_per_s"] == pytest.approx(524_288, rel=1e-12)
    assert peaks == {"NVIDIA H200": 989e12}
    cpu = {"step_ms": {"median": 5.0}, "tokens_per_step": 64, "device": "cpu", "platform": "cpu"}
    ts.derive(cpu, fpt, {})
    assert cpu["tokens_per_s"] == pytest.approx(12_800) and cpu["mfu"] is None


class SimulatedDevice:
    """A host clock and a device that runs dispatched steps in order: dispatch costs the host
    ``dispatch`` ms, each step occupies the device ``work[i]`` ms."""

    def __init__(self, dispatch, work):
        self.t, self.free, self.dispatch, self.work, self.i = 0.0, 0.0, dispatch, work, 0

    def clock(self):
        return self.t / 1e3  # seconds, as time.perf_counter

    def step(self):
        self.t += self.dispatch
        self.free = max(self.free, self.t) + self.work[self.i]
        self.i += 1
        return self.i

    def sync(self, handle):
        self.t = max(self.t, self.free)


def test_timing_loop_on_a_simulated_device():
    """Waited-for steps cost dispatch + work each; back to back, the dispatch of a step overlaps the
    device's work on the one before (work > dispatch), so the window is dispatch + Σ work."""
    warm, timed = [100.0, 9.0], [10.0, 11.0, 12.0, 13.0]
    dev = SimulatedDevice(0.5, warm + timed + timed)
    got = step_timing.time_steps(dev.step, dev.sync, warmup=2, steps=4, clock=dev.clock)
    assert got["first_ms"] == pytest.approx(100.5)
    assert got["step_times_ms"] == pytest.approx([10.5, 11.5, 12.5, 13.5])
    assert got["step_ms"]["median"] == pytest.approx(12.0)
    assert (got["step_ms"]["min"], got["step_ms"]["max"]) == pytest.approx((10.5, 13.5))
    assert (got["step_ms"]["q1"], got["step_ms"]["q3"]) == pytest.approx((11.25, 12.75))
    assert got["back_to_back_ms"] == pytest.approx((0.5 + sum(timed)) / 4)
    assert got["call_ms"] == pytest.approx(0.5)  # the call returns once dispatched
    assert dev.i == 10


def test_timing_loop_reports_its_phases_wall_clock_bounds():
    dev = SimulatedDevice(0.5, [1.0] * 6)
    walls = iter([100.0, 200.0, 300.0])
    got = step_timing.time_steps(dev.step, dev.sync, warmup=2, steps=2, clock=dev.clock,
                                 wall=lambda: next(walls))
    assert got["phases_wall_s"] == {"waited": [100.0, 200.0], "back_to_back": [200.0, 300.0]}


def test_gpu_samples_summarised_over_a_window(monkeypatch):
    """Samples inside [t0, t1] only; the event-reason bits 0x4 (power cap) and 0x20/0x40
    (thermal) counted as shares; rows that do not parse left out."""
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    mon = step_timing.GpuMonitor()
    assert not mon.available and mon.summary(0, 1) is None
    mon.samples = [(0.5, ["1980", "300.1", "40", "0x0000000000000000"]),
                   (1.0, ["1755", "699.0", "52", "0x0000000000000004"]),
                   (1.5, ["1830", "650.0", "55", "0x0000000000000024"]),
                   (1.7, ["[N/A]", "650.0", "55", "0x0"]),
                   (2.0, ["1800", "640.0", "54", "0x0000000000000000"]),
                   (2.5, ["1980", "200.0", "41", "0x0000000000000004"])]
    got = mon.summary(1.0, 2.0)
    assert got == {"samples": 3, "sm_mhz_median": 1800.0, "sm_mhz_min": 1755.0,
                   "power_w_median": 650.0, "power_w_max": 699.0, "temp_c_max": 55.0,
                   "power_cap_share": pytest.approx(2 / 3), "thermal_share": pytest.approx(1 / 3)}
    mon.close()


def test_gpu_monitor_reads_a_running_nvidia_smi(tmp_path, monkeypatch):
    """Through a stand-in ``nvidia-smi`` on PATH: the power limit from its one-shot query, then its
    looping query read line by line in the background, each line stamped as it arrives; close
    stops it."""
    import time

    exe = tmp_path / "nvidia-smi"
    exe.write_text("#!/bin/sh\n"
                   "case \"$*\" in *power.limit*) echo 700.00; exit 0;; esac\n"
                   "while true; do echo '1755, 690.5, 55, 0x0000000000000004'; sleep 0.02; done\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    t0 = time.time()
    mon = step_timing.GpuMonitor(interval_ms=20)
    try:
        assert mon.available and mon.power_limit_w == 700.0
        deadline = time.time() + 10
        while len(mon.samples) < 3 and time.time() < deadline:
            time.sleep(0.02)
        got = mon.summary(t0, time.time())
    finally:
        mon.close()
    assert got["samples"] >= 3 and got["sm_mhz_median"] == 1755.0 and got["power_cap_share"] == 1.0
    assert mon.proc.poll() is not None  # stopped


def test_clock_and_power_table_when_runs_have_samples():
    one = {"samples": 10, "sm_mhz_median": 1755.0, "sm_mhz_min": 1650.0, "power_w_median": 690.0,
           "power_w_max": 700.0, "temp_c_max": 60.0, "power_cap_share": 0.9, "thermal_share": 0.0}
    run = {"arm": "fa2-stable", "batch": 16, "status": "ok", "tokens_per_s": 1.0,
           "step_ms": {"median": 1.0, "q1": 1.0, "q3": 1.0}, "back_to_back_ms": 1.0,
           "gpu": {"waited": one, "back_to_back": dict(one, sm_mhz_median=1710.0)}}
    table = ts.markdown({"device": "NVIDIA H200", "seq_len": 1024, "steps": 30, "warmup": 5,
                         "command": "c", "runs": [run], "power_limit_w": 700.0})
    assert "power limit 700 W" in table
    assert ("| fa2-stable | 16 | 10 / 10 | 1755 / 1710 | 1650 / 1650 | 690 / 690 | 700 / 700 | "
            "60 / 60 | 90% / 90% | 0% / 0% |") in table


def test_git_tree_is_the_commit_tree_exactly_when_the_files_are_the_commits(tmp_path):
    """``git_tree``: a copied checkout whose HEAD is stale still names the files it ran."""
    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a],
                                    cwd=tmp_path, check=True, capture_output=True, text=True).stdout
    git("init", "-q")
    (tmp_path / ".gitignore").write_text("data/\n")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "-A")
    git("commit", "-qm", "one")
    first = git("rev-parse", "HEAD^{tree}").strip()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "big.npz").write_text("ignored")
    assert ts.git_tree(tmp_path) == first
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "b.py").write_text("y = 1\n")  # untracked, not ignored: part of what ran
    changed = ts.git_tree(tmp_path)
    assert changed not in (None, first)
    assert git("diff", "--cached", "--name-only") == ""  # the real index left alone
    git("add", "-A")
    git("commit", "-qm", "two")
    assert changed == git("rev-parse", "HEAD^{tree}").strip()


def test_synthetic_batches_are_the_same_for_every_framework():
    a = step_timing.synthetic_batches(0, 2, 1, 3, 8, 50304)
    b = step_timing.synthetic_batches(0, 2, 1, 3, 8, 50304)
    assert a.shape == (2, 1, 3, 9) and (a == b).all()
    assert a.max() < step_timing.GPT2_TOKENS
    assert step_timing.synthetic_batches(0, 1, 1, 2, 8, 100).max() < 100


# ----------------------------------------------------------------------------- orchestration


def test_run_order_puts_the_judged_comparison_first():
    order = ts.plan(["fa2", "fa2-stable", "cudnn"], [32, 16], "fa2-stable", True)
    assert order == [("jax", "fa2-stable", 32, 0), ("torch", "nanogpt", 32, 0),
                     ("jax", "fa2-stable", 16, 0), ("torch", "nanogpt", 16, 0), ("jax", "fa2", 32, 0),
                     ("jax", "cudnn", 32, 0), ("jax", "fa2", 16, 0), ("jax", "cudnn", 16, 0)]
    assert ts.plan(["fa2"], [8], "fa2", False) == [("jax", "fa2", 8, 0)]


def test_rounds_repeat_the_plan_with_the_judged_pair_taking_turns():
    order = ts.plan(["fa2-stable", "fa2"], [16], "fa2-stable", True, rounds=3)
    assert order == [("jax", "fa2-stable", 16, 0), ("torch", "nanogpt", 16, 0), ("jax", "fa2", 16, 0),
                     ("torch", "nanogpt", 16, 1), ("jax", "fa2-stable", 16, 1), ("jax", "fa2", 16, 1),
                     ("jax", "fa2-stable", 16, 2), ("torch", "nanogpt", 16, 2), ("jax", "fa2", 16, 2)]


def test_ratios_pair_runs_of_one_round_and_summarise_over_rounds():
    def run(arm, rnd, ms, b2b):
        return {"arm": arm, "batch": 16, "round": rnd, "tokens_per_s": 1000 / ms,
                "back_to_back_tokens_per_s": 1000 / b2b}

    runs = [run("nanogpt", 0, 33.0, 33.0), run("g", 0, 30.0, 30.0),
            run("nanogpt", 1, 36.0, 34.0), run("g", 1, 32.0, 31.0),
            run("nanogpt", 2, 34.0, 34.0), run("g", 2, 31.0, 30.0)]
    ts.compare(runs)
    got = [r["vs_nanogpt"] for r in runs if r["arm"] == "g"]
    assert got == pytest.approx([33 / 30, 36 / 32, 34 / 31])  # each against its own round's
    table = ts.over_rounds(runs)
    med = sorted(got)[1]
    assert f"| g | 16 | {med:.3f} ({min(got):.3f}–{max(got):.3f}) |" in table
    assert table.rstrip().endswith("| 3 |")
    runs += [run("h", 0, 29.0, 29.0), run("h", 1, 32.0, 31.0)]  # a lever beside g, two rounds
    ts.compare(runs, primary="g")
    assert [r["vs_primary"] for r in runs if r["arm"] == "h"] == pytest.approx([30 / 29, 1.0])
    assert "vs_primary" not in runs[1] and "vs_primary" not in runs[0]  # g itself, nanoGPT
    assert "| h | 16 |" in ts.over_rounds(runs, "vs_primary", "g's")
    assert ts.over_rounds([run("nanogpt", 0, 1.0, 1.0)]) == ""


class FakeRuns:
    """Stands in for the worker processes: writes a result per spec, advances a fake clock."""

    def __init__(self, ms, seconds, fail=()):
        self.ms, self.seconds, self.fail, self.now, self.calls = ms, seconds, fail, 0.0, []
        self.profile_dirs = []

    def profile(self, spec, batch):
        """A profile whose families scale with the arm's step time (matmuls half of it)."""
        from lab.trace_split import FAMILIES

        self.profile_dirs.append(spec["profile"])
        ms = self.ms[(spec["arm"], batch)]
        fam = {k: 0.0 for k in FAMILIES}
        fam.update(matmul=ms / 2, elementwise=ms / 2)
        return {"total_ms": ms, "families_ms": fam, "steps": 3}

    def clock(self):
        return self.now

    def launch(self, cmd, env, timeout, log_path):
        spec = json.loads(Path(cmd[-1]).read_text())
        kind = "torch" if "bench.nanogpt_step" in cmd else "jax"
        batch = spec["micro_batch"] if kind == "torch" else spec["config"]["data"]["batch_size"]
        self.calls.append((spec["arm"], batch, timeout))
        self.now += self.seconds["profile" if spec.get("profile") else kind]
        if spec["arm"] in self.fail:
            Path(log_path).write_text("Traceback …\nRuntimeError: cuDNN is not detected.\n")
            return 1, self.seconds["profile" if spec.get("profile") else kind]
        ms = self.ms[(spec["arm"], batch)]
        Path(spec["result"]).write_text(json.dumps({
            "step_ms": step_timing.spread([ms, ms + 1, ms - 1]), "step_times_ms": [ms, ms + 1, ms - 1],
            "back_to_back_ms": ms - 2, "first_ms": 1.0, "compile_s": 40.0, "loss_last": 10.9,
            "tokens_per_step": batch * 1024, "grad_accum": 1, "n_devices": 1, "peak_memory_bytes": 3 << 30,
            "n_params_non_embedding": 123_587_328, "device": "NVIDIA H200",
            "platform": "cuda" if kind == "torch" else "gpu",
            **({"profile": self.profile(spec, batch)} if spec.get("profile") else {}),
            "versions": {"torch": "2.11"} if kind == "torch" else {"jax": "0.11.2"}}))
        return 0, self.seconds["profile" if spec.get("profile") else kind]


def test_results_file_with_stand_in_runs(tmp_path, monkeypatch):
    (tmp_path / "nanoGPT").mkdir()
    (tmp_path / "nanoGPT" / "model.py").write_text("# stand-in: the runs are faked\n")
    ms = {(a, b): m for a, m in (("nanogpt", 64.0), ("fa2-stable", 80.0), ("fa2", 79.0))
          for b in (32, 16)}
    fake = FakeRuns({k: (v if k[1] == 32 else v / 2) for k, v in ms.items()},
                    {"jax": 50.0, "torch": 70.0}, fail=("cudnn",))
    monkeypatch.setattr(ts, "_launch", fake.launch)
    monkeypatch.setattr(ts, "_clock", fake.clock)
    out = tmp_path / "r.json"
    res = ts.main(["--batch", "32,16", "--nanogpt", str(tmp_path / "nanoGPT"), "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(res))
    assert TOP_KEYS <= set(saved) and saved["device"] == "NVIDIA H200"
    assert saved["versions"] == {"jax": "0.11.2", "torch": "2.11"}
    assert saved["flops_per_token"] == 854_770_176 and saved["n_params_non_embedding"] == 123_587_328
    runs = {(r["arm"], r["batch"]): r for r in saved["runs"]}
    assert [(r["arm"], r["batch"]) for r in saved["runs"]] == [
        (a, b) for _, a, b, _ in ts.plan(["fa2", "fa2-stable", "cudnn"], [32, 16], "fa2-stable",
                                          True)]
    for key in [k for k in runs if k[0] != "cudnn"]:
        assert RUN_KEYS <= set(runs[key]) and runs[key]["status"] == "ok"
    stable, nano = runs[("fa2-stable", 32)], runs[("nanogpt", 32)]
    assert stable["tokens_per_s"] == pytest.approx(32768 / 0.080)
    assert stable["vs_nanogpt"] == pytest.approx(64.0 / 80.0)
    assert stable["vs_nanogpt_back_to_back"] == pytest.approx(62.0 / 78.0)
    assert nano["mfu"] == pytest.approx(854_770_176 * 32768 / 0.064 / 989e12)
    assert runs[("fa2", 16)]["vs_nanogpt"] == pytest.approx(32.0 / 39.5)
    assert "vs_nanogpt" not in nano and "warning" not in nano
    cudnn = runs[("cudnn", 32)]
    assert cudnn["status"] == "failed" and "cuDNN is not detected" in cudnn["error"]
    table = ts.markdown(saved)
    assert "| fa2-stable | 32 | 409,600 | 80.00 (79.50–80.50) | 78.00 |" in table
    assert "| cudnn | 16 | failed |" in table and table.count("\n") == 4 + len(saved["runs"])


def test_earlier_results_files_still_render():
    old = ROOT / "docs" / "results" / "2026-11-30-gpt2-small-throughput-H200-v17.json"
    if not old.is_file():
        pytest.skip("no file of the earlier form here")
    table = ts.markdown(json.loads(old.read_text()))
    assert table.splitlines()[2].startswith("| flash | 32 | ") and table.count("\n") == 2 + 3


def test_budget_skips_what_would_not_fit(tmp_path, monkeypatch):
    """Guesses of 90 s (JAX) and 120 s (PyTorch) until a run of the kind has been timed (the
    profiled run counts for JAX only until a plain one has); each run's time limit is what is left
    of the budget."""
    (tmp_path / "nanoGPT").mkdir()
    (tmp_path / "nanoGPT" / "model.py").write_text("")
    fake = FakeRuns({(a, b): 50.0 for a in ("nanogpt", "fa2-stable", "fa2", "cudnn") for b in (32, 16)},
                    {"jax": 50.0, "torch": 70.0, "profile": 80.0})
    monkeypatch.setattr(ts, "_launch", fake.launch)
    monkeypatch.setattr(ts, "_clock", fake.clock)
    res = ts.main(["--batch", "32,16", "--nanogpt", str(tmp_path / "nanoGPT"), "--budget", "260",
                   "--profile", str(tmp_path / "prof"), "--out", str(tmp_path / "r.json")])
    # 0 + 90 ≤ 260; 80 + 120 ≤ 260; 150 + 80 ≤ 260; 200 + 70 > 260; 200 + 50 ≤ 260; 250 + 50 > 260 …
    assert fake.calls == [("fa2-stable", 32, 260.0), ("nanogpt", 32, 180.0), ("fa2-stable", 16, 110.0),
                          ("fa2", 32, 60.0)]
    status = [(r["arm"], r["batch"], r["status"]) for r in res["runs"]]
    assert [s for *_, s in status] == ["ok", "ok", "ok", "skipped", "ok", "skipped", "skipped", "skipped"]
    assert "budget" in res["runs"][3]["error"]
    assert res["profile"]["arm"] == "fa2-stable" and res["profile"]["batch"] == 32


def test_budget_guesses_a_first_run_from_the_other_frameworks(tmp_path, monkeypatch):
    """Before a PyTorch run has been timed, twice the longest JAX run is its guess where that is
    less than 120 s: a 24 s JAX run leaves room for nanoGPT's in a budget of 100 s."""
    (tmp_path / "nanoGPT").mkdir()
    (tmp_path / "nanoGPT" / "model.py").write_text("")
    fake = FakeRuns({("fa2-stable", 16): 32.0, ("nanogpt", 16): 36.0}, {"jax": 24.0, "torch": 30.0})
    monkeypatch.setattr(ts, "_launch", fake.launch)
    monkeypatch.setattr(ts, "_clock", fake.clock)
    res = ts.main(["--batch", "16", "--arms", "fa2-stable", "--nanogpt", str(tmp_path / "nanoGPT"),
                   "--budget", "100", "--out", str(tmp_path / "r.json")])
    assert [r["status"] for r in res["runs"]] == ["ok", "ok"]  # 24 + 2·24 ≤ 100
    assert fake.calls == [("fa2-stable", 16, 100.0), ("nanogpt", 16, 76.0)]
    fake.seconds["jax"] = 40.0
    res = ts.main(["--batch", "16", "--arms", "fa2-stable", "--nanogpt", str(tmp_path / "nanoGPT"),
                   "--budget", "110", "--out", str(tmp_path / "r2.json")])
    assert [r["status"] for r in res["runs"]] == ["ok", "skipped"]  # 40 + 2·40 > 110
    assert "about 80 s" in res["runs"][1]["error"]


def test_profile_arms_side_by_side(tmp_path, monkeypatch):
    """--profile-arms: each named arm profiled at the first micro-batch into a folder of its own,
    the primary's kept as the file's profile, and compare.md sets the families side by side with
    each arm's difference from the first profiled."""
    arms = ["fa2-stable", "fa2-stable[model.logits_dtype=bfloat16]", "fa2"]
    fake = FakeRuns({(a, b): m for a, m in zip(arms, (80.0, 70.0, 79.0)) for b in (4, 2)},
                    {"jax": 1.0, "profile": 2.0})
    monkeypatch.setattr(ts, "_launch", fake.launch)
    prof = tmp_path / "prof"
    res = ts.main(["--arms", ",".join(arms), "--batch", "4,2", "--profile", str(prof),
                   "--profile-arms", ",".join(arms[:2]), "--out", str(tmp_path / "r.json")])
    assert fake.profile_dirs == [str(prof / "fa2-stable"),
                                 str(prof / "fa2-stable_model.logits_dtype=bfloat16_")]
    assert [p["arm"] for p in res["profiles"]] == arms[:2] and res["profile"]["arm"] == "fa2-stable"
    table = (prof / "compare.md").read_text()
    assert "| `fa2-stable` | `fa2-stable[model.logits_dtype=bfloat16]` (Δ) |" in table
    assert "| matmuls | 40.00 | 35.00 (-5.00) |" in table
    assert "| **all kernels** | 80.00 | 70.00 (-10.00) |" in table
    with pytest.raises(SystemExit):
        ts.main(["--arms", "fa2", "--profile", str(prof), "--profile-arms", "cudnn",
                 "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit):  # nanoGPT's step is profiled only where it runs
        ts.main(["--arms", "fa2", "--profile", str(prof), "--profile-arms", "fa2,nanogpt",
                 "--out", str(tmp_path / "x.json")])


def test_nanogpt_profiled_beside_an_arm(tmp_path, monkeypatch):
    """--profile-arms ARM,nanogpt: nanoGPT's worker gets a profile folder of its own, and compare.md
    sets its families beside the arm's."""
    (tmp_path / "nano").mkdir()
    (tmp_path / "nano" / "model.py").write_text("")
    fake = FakeRuns({("fa2-stable", 4): 80.0, ("nanogpt", 4): 64.0}, {"jax": 1.0, "torch": 1.0,
                                                                        "profile": 2.0})
    monkeypatch.setattr(ts, "_launch", fake.launch)
    prof = tmp_path / "prof"
    res = ts.main(["--arms", "fa2-stable", "--batch", "4", "--nanogpt", str(tmp_path / "nano"),
                   "--profile", str(prof), "--profile-arms", "fa2-stable,nanogpt",
                   "--out", str(tmp_path / "r.json")])
    assert fake.profile_dirs == [str(prof / "fa2-stable"), str(prof / "nanogpt")]
    assert [p["arm"] for p in res["profiles"]] == ["fa2-stable", "nanogpt"]
    assert "| **all kernels** | 80.00 | 64.00 (-16.00) |" in (prof / "compare.md").read_text()


def test_missing_nanogpt_is_recorded_not_fatal(tmp_path, monkeypatch):
    fake = FakeRuns({("fa2", 4): 10.0}, {"jax": 1.0, "torch": 1.0})
    monkeypatch.setattr(ts, "_launch", fake.launch)
    res = ts.main(["--arms", "fa2", "--batch", "4", "--nanogpt", str(tmp_path / "absent"),
                   "--out", str(tmp_path / "r.json")])
    (run, nano) = res["runs"]
    assert run["status"] == "ok" and nano["status"] == "missing" and "make nanogpt" in nano["error"]
    assert [c[0] for c in fake.calls] == ["fa2"]


def test_terminated_call_keeps_what_finished(tmp_path, monkeypatch):
    """An outer time limit's SIGTERM during a run: the run is recorded as interrupted next to the
    finished ones."""
    fake = FakeRuns({("fa2", 4): 10.0}, {"jax": 1.0})

    def launch(cmd, env, timeout, log_path):
        if json.loads(Path(cmd[-1]).read_text())["arm"] == "cudnn":
            ts._stop(15, None)
        return fake.launch(cmd, env, timeout, log_path)

    monkeypatch.setattr(ts, "_launch", launch)
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit):
        ts.main(["--arms", "fa2,cudnn", "--batch", "4", "--out", str(out)])
    runs = json.loads(out.read_text())["runs"]
    assert [(r["arm"], r["status"]) for r in runs] == [("fa2", "ok"), ("cudnn", "interrupted")]


def test_unknown_arm_is_refused():
    with pytest.raises(SystemExit):
        ts.main(["--arms", "fa2,flash-stabel", "--out", "/dev/null"])
    with pytest.raises(SystemExit):  # an override the config does not have
        ts.main(["--arms", "fa2[model.logits_dtyp=bfloat16]", "--out", "/dev/null"])


def test_an_arms_xla_flags_reach_only_its_process(tmp_path, monkeypatch):
    """``--xla_…`` entries in an arm's brackets are XLA flags for that arm's worker (added to the
    caller's XLA_FLAGS), not config overrides; the other arms run without them."""
    arm = "fa2[model.layernorm=pallas;--xla_gpu_enable_command_buffer=]"
    assert ts.arm_overrides(arm) == ts.arm_overrides("fa2") + ["model.layernorm=pallas"]
    assert ts.arm_xla_flags(arm) == ["--xla_gpu_enable_command_buffer="]
    fake = FakeRuns({("fa2", 4): 10.0, (arm, 4): 9.0}, {"jax": 1.0})
    seen = {}

    def launch(cmd, env, timeout, log_path):
        seen[json.loads(Path(cmd[-1]).read_text())["arm"]] = env.get("XLA_FLAGS")
        return fake.launch(cmd, env, timeout, log_path)

    monkeypatch.setattr(ts, "_launch", launch)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    res = ts.main(["--arms", f"fa2,{arm}", "--batch", "4", "--out", str(tmp_path / "r.json")])
    assert seen == {"fa2": "--xla_dump_to=/tmp/x",
                    arm: "--xla_dump_to=/tmp/x --xla_gpu_enable_command_buffer="}
    assert [r.get("xla_flags") for r in res["runs"]] == [None, ["--xla_gpu_enable_command_buffer="]]


def test_an_arms_bench_settings_reach_only_its_worker(tmp_path, monkeypatch):
    """``bench.KEY=VALUE`` entries set the timing of that arm's worker (here one batch buffer for
    every step), are neither overrides nor XLA flags, and are recorded with its run."""
    arm = "fa2[bench.batches=1]"
    assert ts.arm_overrides(arm) == ts.arm_overrides("fa2") and ts.arm_xla_flags(arm) == []
    assert ts.arm_bench_settings(arm) == {"batches": 1}
    assert ts.arm_bench_settings("fa2") == ts.BENCH_SETTINGS == {"batches": 2}
    for bad in ("fa2[bench.batch=1]", "fa2[bench.batches]", "fa2[bench.batches=0]"):
        with pytest.raises(ValueError):
            ts.arm_bench_settings(bad)
    fake = FakeRuns({("fa2", 4): 10.0, (arm, 4): 9.0}, {"jax": 1.0})
    seen = {}

    def launch(cmd, env, timeout, log_path):
        spec = json.loads(Path(cmd[-1]).read_text())
        seen[spec["arm"]] = spec.get("batches")
        return fake.launch(cmd, env, timeout, log_path)

    monkeypatch.setattr(ts, "_launch", launch)
    res = ts.main(["--arms", f"fa2,{arm}", "--batch", "4", "--out", str(tmp_path / "r.json")])
    assert seen == {"fa2": 2, arm: 1}
    assert [r.get("bench_settings") for r in res["runs"]] == [None, {"batches": 1}]


def test_an_arms_tuning_table_reaches_only_its_process(tmp_path, monkeypatch):
    """``bench.tuning=FILE`` sets JAX_FLASH_TUNING for that arm's worker alone and records the
    table with its run; a missing file or a table with a numerics field stops the run first."""
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"fa2/d64/t1024/causal": {"bwd_block": 128}}))
    arm = f"fa2[bench.tuning={table}]"
    assert ts.arm_overrides(arm) == ts.arm_overrides("fa2") and ts.arm_xla_flags(arm) == []
    assert ts.arm_bench_settings(arm) == ts.BENCH_SETTINGS and ts.arm_tuning(arm) == str(table)
    assert ts.arm_tuning("fa2") is None
    fake = FakeRuns({("fa2", 4): 10.0, (arm, 4): 9.0}, {"jax": 1.0})
    seen = {}

    def launch(cmd, env, timeout, log_path):
        seen[json.loads(Path(cmd[-1]).read_text())["arm"]] = env.get("JAX_FLASH_TUNING")
        return fake.launch(cmd, env, timeout, log_path)

    monkeypatch.setattr(ts, "_launch", launch)
    monkeypatch.delenv("JAX_FLASH_TUNING", raising=False)
    res = ts.main(["--arms", f"fa2,{arm}", "--batch", "4", "--out", str(tmp_path / "r.json")])
    assert seen == {"fa2": None, arm: str(table.resolve())}
    assert [r.get("tuning") for r in res["runs"]] == [
        None, {"file": str(table), "entries": {"fa2/d64/t1024/causal": {"bwd_block": 128}}}]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"fa2/d64/t1024/causal": {"block_k": 128}}))
    for spec in (f"fa2[bench.tuning={tmp_path / 'none.json'}]", f"fa2[bench.tuning={bad}]"):
        with pytest.raises(SystemExit):
            ts.main(["--arms", spec, "--batch", "4", "--out", str(tmp_path / "r2.json")])


def test_an_arm_with_more_overrides():
    """NAME[KEY=VALUE;...]: the arm's own overrides, then these — a named option timed beside it."""
    base = ts.arm_overrides("fa2-stable")
    assert ts.arm_overrides("fa2-stable[model.logits_dtype=bfloat16;optim.clip=none]") == \
        base + ["model.logits_dtype=bfloat16", "optim.clip=none"]
    with pytest.raises(ValueError, match="NAME"):
        ts.arm_overrides("fa2-stable[model.logits_dtype=bfloat16")


# ----------------------------------------------------------------------------- on this CPU


@pytest.mark.slow  # experiment tooling, 15–20 s: JAX_FLASH_SLOW=1 (make test-all)
def test_results_file_and_profile_on_cpu(tmp_path):
    """The real thing on a CPU: each arm in its own process; fa2 (jnp executor) timed and profiled,
    cuDNN's failure recorded with its reason while the run goes on."""
    out, prof = tmp_path / "r.json", tmp_path / "prof"
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "bench.train_step", *TINY, "--arms", "fa2,cudnn",
                           "--primary", "fa2", "--batch", "2", "--steps", "3", "--warmup", "1",
                           "--profile", str(prof), "--profile-steps", "2", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert TOP_KEYS <= set(res) and res["device"] == "cpu"
    assert {"jax", "jaxlib", "flax", "optax", "python"} <= set(res["versions"])
    fa2, cudnn = res["runs"]
    assert RUN_KEYS <= set(fa2) and fa2["status"] == "ok" and fa2["overrides"][0] == "attention.kind=flash"
    assert fa2["tokens_per_step"] == 2 * 32
    assert fa2["tokens_per_s"] == pytest.approx(64 / (fa2["step_ms"]["median"] / 1e3))
    assert len(fa2["step_times_ms"]) == 3 and fa2["mfu"] is None and fa2["peak_memory_bytes"] is None
    assert math.isfinite(fa2["loss_last"]) and abs(fa2["loss_last"] - math.log(384)) < 1.0
    assert fa2["n_params_non_embedding"] == res["n_params_non_embedding"]
    assert cudnn["status"] == "failed" and "cuDNN" in cudnn["error"]
    p = res["profile"]
    assert (p["arm"], p["batch"], p["steps"]) == ("fa2", 2, 2)
    assert set(p["files"]) == {"profile.md", "trace.json.gz", "hlo.txt.gz"}
    assert all((prof / f).is_file() for f in p["files"])
    fam = p["families_ms"]
    assert sum(fam.values()) == pytest.approx(p["total_ms"]) and p["total_ms"] > 0
    for k in ("matmul", "attention", "layernorm", "logits_ce", "optimizer", "elementwise"):
        assert fam[k] > 0, k  # a real step has each of them, and the rules find them on XLA:CPU
    assert p["attributed_ms"]["kernel name only"] == 0.0  # every XLA:CPU op found in the HLO
    assert "| layer norms |" in (prof / "profile.md").read_text()
    again = tsp.families(tsp.load_trace(str(prof / "trace.json.gz")),
                         tsp.HloIndex(gzip.decompress((prof / "hlo.txt.gz").read_bytes()).decode()),
                         steps=2, vocab=384)
    assert again["families_ms"] == pytest.approx(fam)


# ----------------------------------------------------------------------------- nanoGPT (PyTorch)

STAND_IN = textwrap.dedent('''
    """A stand-in with nanoGPT's model.py interface (GPTConfig, GPT.configure_optimizers,
    GPT.get_num_params, forward(idx, targets) -> (logits, loss)) for testing the harness."""
    import dataclasses, torch
    from torch import nn
    from torch.nn import functional as F

    @dataclasses.dataclass
    class GPTConfig:
        block_size: int = 1024
        vocab_size: int = 50304
        n_layer: int = 12
        n_head: int = 12
        n_embd: int = 768
        dropout: float = 0.0
        bias: bool = True

    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            d, self.h = c.n_embd, c.n_head
            self.ln1, self.ln2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
            self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
            self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = (z.view(b, t, self.h, -1).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(d, 2))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            x = x + self.o(a)
            return x + self.down(F.gelu(self.up(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(c.vocab_size, c.n_embd), nn.Embedding(c.block_size, c.n_embd)
            self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
            self.ln_f = nn.LayerNorm(c.n_embd, bias=False)
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, 0.0, 0.02)

        def get_num_params(self, non_embedding=True):
            return sum(p.numel() for p in self.parameters()) - non_embedding * self.wpe.weight.numel()

        def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
            ps = list(self.parameters())
            groups = [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": weight_decay},
                      {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]
            return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")

        def forward(self, idx, targets=None):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for blk in self.blocks:
                x = blk(x)
            logits = self.ln_f(x) @ self.wte.weight.T
            return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())
''')


def _torch_python():
    if importlib.util.find_spec("torch") is not None:
        return sys.executable
    cand = os.environ.get("TORCH_PYTHON")
    if cand and subprocess.run([cand, "-c", "import torch, numpy"], capture_output=True).returncode == 0:
        return cand
    return None


@pytest.mark.parametrize("source", ["nanoGPT", "stand-in"])
def test_nanogpt_step_on_cpu(tmp_path, source):
    py = _torch_python()
    if py is None:
        pytest.skip("no PyTorch here (set TORCH_PYTHON to an interpreter that has torch and numpy)")
    from models.gpt2 import GPTConfig

    src = ROOT / "third_party" / "nanoGPT"
    if source == "stand-in":
        src = tmp_path / "stand-in"
        src.mkdir()
        (src / "model.py").write_text(STAND_IN)
    elif not (src / "model.py").is_file():
        pytest.skip("nanoGPT's model.py not fetched (make nanogpt)")
    model = {"n_layer": 1, "n_head": 2, "n_embd": 32, "vocab_size": 384, "block_size": 32}
    spec = {"arm": "nanogpt", "nanogpt": str(src), "compile": "auto", "model": model,
            "dtype": "bfloat16", "seq_len": 32, "micro_batch": 2, "accum": 2, "seed": 0, "warmup": 1,
            "steps": 3, "optim": {"lr": 1e-3, "b1": 0.9, "b2": 0.95, "eps": 1e-8, "weight_decay": 0.0,
                                  "clip": 1.0, "warmup_steps": 10},
            "result": str(tmp_path / "res.json")}
    if source == "nanoGPT":  # its profile too (CPU ops stand in for kernels)
        spec.update(profile=str(tmp_path / "profile"), profile_steps=2)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([py, "-c", "import sys, bench.nanogpt_step as m; m.main([sys.argv[1]]); "
                           "assert 'jax' not in sys.modules, 'the PyTorch worker imported JAX'",
                           str(tmp_path / "spec.json")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads((tmp_path / "res.json").read_text())
    assert r["n_params_non_embedding"] == GPTConfig(**model).num_params(non_embedding=True)
    assert r["tokens_per_step"] == 2 * 2 * 32 and r["compiled"] is False and r["platform"] == "cpu"
    assert len(r["step_times_ms"]) == 3 and r["step_ms"]["median"] > 0 and r["back_to_back_ms"] > 0
    assert abs(r["loss_last"] - math.log(384)) < 1.0
    assert r["versions"]["torch"] and len(r["nanogpt_model_sha256"]) == 64
    if source == "nanoGPT":
        prof = r["profile"]
        assert prof["files"] == ["trace.json.gz", "profile.md"] and prof["total_ms"] > 0, prof
        assert (tmp_path / "profile" / "profile.md").read_text().startswith(
            "Kernel time of one training step by op family: nanoGPT's step")
    else:
        assert "profile" not in r


# ----------------------------------------------------------------------------- op families


HLO = textwrap.dedent('''\
    HloModule jit_train_step, is_scheduled=true, entry_computation_layout={()->f32[]}

    FileNames
    1 "/repo/train/gpt2.py"
    2 "/repo/models/gpt2.py"
    3 "/site/flax/nnx/nn/normalization.py"
    4 "/site/optax/_src/transform.py"
    5 "/repo/jax_flash/api.py"
    6 "/site/flax/nnx/nn/linear.py"

    FunctionNames
    1 "train_step"
    2 "loss_fn"
    3 "GPT.__call__"
    4 "Block.__call__"
    5 "LayerNorm.__call__"
    6 "MLP.__call__"
    7 "cross_entropy"
    8 "scale_by_adam.<locals>.update_fn"
    9 "attend"
    10 "attention"
    11 "Linear.__call__"
    12 "Embed.__call__"
    13 "train_step.<locals>.micro"

    FileLocations
    1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=1 end_column=9}
    2 {file_name_id=1 function_name_id=2 line=20 end_line=20 column=1 end_column=9}
    3 {file_name_id=2 function_name_id=3 line=30 end_line=30 column=1 end_column=9}
    4 {file_name_id=2 function_name_id=4 line=40 end_line=40 column=1 end_column=9}
    5 {file_name_id=3 function_name_id=5 line=50 end_line=50 column=1 end_column=9}
    6 {file_name_id=2 function_name_id=6 line=60 end_line=60 column=1 end_column=9}
    7 {file_name_id=2 function_name_id=7 line=70 end_line=70 column=1 end_column=9}
    8 {file_name_id=4 function_name_id=8 line=80 end_line=80 column=1 end_column=9}
    9 {file_name_id=2 function_name_id=9 line=90 end_line=90 column=1 end_column=9}
    10 {file_name_id=5 function_name_id=10 line=100 end_line=100 column=1 end_column=9}
    11 {file_name_id=6 function_name_id=11 line=110 end_line=110 column=1 end_column=9}
    12 {file_name_id=6 function_name_id=12 line=120 end_line=120 column=1 end_column=9}
    13 {file_name_id=1 function_name_id=13 line=130 end_line=130 column=1 end_column=9}

    StackFrames
    1 {file_location_id=1 parent_frame_id=1}
    2 {file_location_id=13 parent_frame_id=2}
    3 {file_location_id=2 parent_frame_id=3}
    4 {file_location_id=3 parent_frame_id=4}
    5 {file_location_id=4 parent_frame_id=5}
    6 {file_location_id=5 parent_frame_id=6}
    7 {file_location_id=6 parent_frame_id=6}
    8 {file_location_id=11 parent_frame_id=8}
    9 {file_location_id=9 parent_frame_id=6}
    10 {file_location_id=10 parent_frame_id=10}
    11 {file_location_id=7 parent_frame_id=5}
    12 {file_location_id=8 parent_frame_id=2}
    13 {file_location_id=12 parent_frame_id=5}

    %add (a: f32[], b: f32[]) -> f32[] {
      %a = f32[] parameter(0)
      %b = f32[] parameter(1)
      ROOT %s = f32[] add(%a, %b)
    }

    %fused_ln (p0: f32[8,16,32]) -> f32[8,16] {
      %p0 = f32[8,16,32]{2,1,0} parameter(0)
      %c0 = f32[] constant(0)
      ROOT %r = f32[8,16]{1,0} reduce(%p0, %c0), dimensions={2}, to_apply=%add, metadata={op_name="jit(train_step)/reduce_sum" stack_frame_id=6}
    }

    %gemm_computation (p0.1: bf16[128,32], p1.1: bf16[96,32]) -> f32[128,96] {
      %p0.1 = bf16[128,32]{1,0} parameter(0)
      %p1.1 = bf16[96,32]{1,0} parameter(1)
      ROOT %dot.1 = f32[128,96]{1,0} dot(%p0.1, %p1.1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
    }

    %fused_gelu (p0.2: bf16[128,128]) -> bf16[128,128] {
      %p0.2 = bf16[128,128]{1,0} parameter(0)
      %cv = f32[128,128]{1,0} convert(%p0.2)
      %m = f32[128,128]{1,0} multiply(%cv, %cv)
      ROOT %cv2 = bf16[128,128]{1,0} convert(%m), metadata={stack_frame_id=7}
    }

    %fused_loss (p0.3: f32[128]) -> f32[] {
      %p0.3 = f32[128]{0} parameter(0)
      %c1 = f32[] constant(0)
      ROOT %l = f32[] reduce(%p0.3, %c1), dimensions={0}, to_apply=%add, metadata={stack_frame_id=11}
    }

    %fused_adam (p0.4: f32[32,32], p1.4: f32[32,32]) -> f32[32,32] {
      %p0.4 = f32[32,32]{1,0} parameter(0)
      %p1.4 = f32[32,32]{1,0} parameter(1)
      %sq = f32[32,32]{1,0} sqrt(%p1.4)
      %dv = f32[32,32]{1,0} divide(%p0.4, %sq)
      ROOT %up = f32[32,32]{1,0} add(%p0.4, %dv), metadata={op_name="jit(train_step)/add" stack_frame_id=12}
    }

    %fused_adam_wte (p0.11: f32[96,32]) -> f32[96,32] {
      %p0.11 = f32[96,32]{1,0} parameter(0)
      ROOT %sq2 = f32[96,32]{1,0} sqrt(%p0.11), metadata={stack_frame_id=12}
    }

    %fused_acc (p0.5: f32[32,32], p1.5: f32[32,32]) -> f32[32,32] {
      %p0.5 = f32[32,32]{1,0} parameter(0)
      %p1.5 = f32[32,32]{1,0} parameter(1)
      ROOT %acc = f32[32,32]{1,0} add(%p0.5, %p1.5), metadata={stack_frame_id=2}
    }

    %fused_inner_meta (p0.6: f32[32,32]) -> f32[32,32] {
      %p0.6 = f32[32,32]{1,0} parameter(0)
      ROOT %mu = f32[32,32]{1,0} multiply(%p0.6, %p0.6), metadata={stack_frame_id=12}
    }

    %wrapped_transpose_computation (p0.7: bf16[8,16,4,8]) -> bf16[8,4,16,8] {
      %p0.7 = bf16[8,16,4,8]{3,2,1,0} parameter(0)
      ROOT %tr = bf16[8,4,16,8]{3,2,1,0} transpose(%p0.7), dimensions={0,2,1,3}
    }

    %fused_gather (p0.8: f32[96,32], p1.8: s32[8,16,1]) -> f32[8,16,32] {
      %p0.8 = f32[96,32]{1,0} parameter(0)
      %p1.8 = s32[8,16,1]{2,1,0} parameter(1)
      ROOT %g = f32[8,16,32]{2,1,0} gather(%p0.8, %p1.8), offset_dims={2}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=2, slice_sizes={1,32}
    }

    %fused_delta (p0.9: bf16[8,16,4,8], p1.9: bf16[8,16,4,8]) -> f32[8,16,4] {
      %p0.9 = bf16[8,16,4,8]{3,2,1,0} parameter(0)
      %p1.9 = bf16[8,16,4,8]{3,2,1,0} parameter(1)
      %pr = bf16[8,16,4,8]{3,2,1,0} multiply(%p0.9, %p1.9)
      %cz = bf16[] constant(0)
      ROOT %rd = f32[8,16,4]{2,1,0} reduce(%pr, %cz), dimensions={3}, to_apply=%add, metadata={stack_frame_id=10}
    }

    %fused_sum (p0.10: f32[32,32]) -> f32[] {
      %p0.10 = f32[32,32]{1,0} parameter(0)
      %c2 = f32[] constant(0)
      ROOT %su = f32[] reduce(%p0.10, %c2), dimensions={0,1}, to_apply=%add
    }

    ENTRY %main.1 (x: f32[8,16,32], h: bf16[128,32], w1: bf16[32,128], wte16: bf16[96,32], a1: bf16[128,128], l: f32[128], m1: f32[32,32], g1: f32[32,32], q: bf16[8,16,4,8], wte: f32[96,32], idx: s32[8,16,1]) -> f32[] {
      %x = f32[8,16,32]{2,1,0} parameter(0)
      %h = bf16[128,32]{1,0} parameter(1)
      %w1 = bf16[32,128]{1,0} parameter(2)
      %wte16 = bf16[96,32]{1,0} parameter(3)
      %a1 = bf16[128,128]{1,0} parameter(4)
      %l = f32[128]{0} parameter(5)
      %m1 = f32[32,32]{1,0} parameter(6)
      %g1 = f32[32,32]{1,0} parameter(7)
      %q = bf16[8,16,4,8]{3,2,1,0} parameter(8)
      %wte = f32[96,32]{1,0} parameter(9)
      %idx = s32[8,16,1]{2,1,0} parameter(10)
      %input_reduce_fusion = f32[8,16]{1,0} fusion(%x), kind=kInput, calls=%fused_ln, metadata={op_name="jit(train_step)/reduce_sum" stack_frame_id=6}
      %custom-call.1 = (bf16[128,128]{1,0}, s8[1024]{0}) custom-call(%h, %w1), custom_call_target="__cublas$gemm", metadata={op_name="jit(train_step)/dot_general" stack_frame_id=8}, backend_config={"gemm_backend_config":{"alpha_real":1}}
      %gemm_fusion_dot.2 = f32[128,96]{1,0} fusion(%h, %wte16), kind=kCustom, calls=%gemm_computation, metadata={stack_frame_id=4}, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
      %loop_convert_fusion = bf16[128,128]{1,0} fusion(%a1), kind=kLoop, calls=%fused_gelu, metadata={stack_frame_id=7}
      %input_reduce_fusion.1 = f32[] fusion(%l), kind=kInput, calls=%fused_loss, metadata={stack_frame_id=11}
      %loop_add_fusion.3 = f32[32,32]{1,0} fusion(%m1, %g1), kind=kLoop, calls=%fused_adam, metadata={stack_frame_id=12}
      %custom-call.5 = bf16[8,16,4,8]{3,2,1,0} custom-call(%q, %q, %q), custom_call_target="__gpu$xla.gpu.triton", metadata={stack_frame_id=10}
      %input_multiply_reduce_fusion = f32[8,16,4]{2,1,0} fusion(%custom-call.5, %q), kind=kInput, calls=%fused_delta, metadata={stack_frame_id=10}
      %wrapped_transpose = bf16[8,4,16,8]{3,2,1,0} fusion(%q), kind=kLoop, calls=%wrapped_transpose_computation
      %copy.4 = f32[32,32]{1,0} copy(%m1)
      %loop_gather_fusion = f32[8,16,32]{2,1,0} fusion(%wte, %idx), kind=kLoop, calls=%fused_gather, metadata={stack_frame_id=13}
      %loop_add_fusion.9 = f32[32,32]{1,0} fusion(%m1, %g1), kind=kLoop, calls=%fused_acc, metadata={stack_frame_id=2}
      %loop_multiply_fusion.4 = f32[32,32]{1,0} fusion(%m1), kind=kLoop, calls=%fused_inner_meta
      %loop_sqrt_fusion = f32[96,32]{1,0} fusion(%wte), kind=kLoop, calls=%fused_adam_wte, metadata={stack_frame_id=12}
      %call.3 = f32[32,32]{1,0} call(%m1, %g1), to_apply=%fused_acc
      ROOT %input_reduce_fusion.2 = f32[] fusion(%m1), kind=kInput, calls=%fused_sum
    }
''')

# (kernel name, the trace's hlo_op, µs per step, family, how it is matched, the rule that placed it);
# an hlo_op that names a wrapper (call.3) or no instruction (command_buffer.7) leaves it to the name
KERNELS = [
    ("input_reduce_fusion", "input_reduce_fusion", 30.0, "layernorm", "hlo_op", "stack: LayerNorm"),
    ("nvjet_tst_128x64_64x4_1x2_h_bz_TNT", "custom-call.1", 100.0, "matmul", "hlo_op", "dot / GEMM"),
    ("gemm_fusion_dot_2", None, 80.0, "logits_ce", "kernel name = HLO op", "vocab-sized axis"),
    ("loop_convert_fusion", "loop_convert_fusion", 20.0, "elementwise", "hlo_op", "stack: MLP (GELU)"),
    ("input_reduce_fusion_1", "input_reduce_fusion.1", 5.0, "logits_ce", "hlo_op", "stack: cross_entropy"),
    ("loop_add_fusion_3", "loop_add_fusion.3", 12.0, "optimizer", "hlo_op", "stack: optax"),
    ("jax_flash_fwd_triton_kernel", "custom-call.5", 40.0, "attention", "hlo_op", "kernel name"),
    ("input_multiply_reduce_fusion", None, 6.0, "attention", "kernel name = HLO op", "stack: attend / jax_flash"),
    ("wrapped_transpose", "wrapped_transpose", 9.0, "copy", "hlo_op", "data movement / casts only"),
    ("copy_4", "copy.4", 3.0, "copy", "hlo_op", "data movement / casts only"),
    ("loop_gather_fusion", "loop_gather_fusion", 7.0, "other", "hlo_op", "embedding lookup / scatter"),
    ("loop_add_fusion_9", "call.3", 4.0, "optimizer", "kernel name = HLO op", "stack: train_step"),
    ("loop_multiply_fusion_4", "loop_multiply_fusion.4", 8.0, "optimizer", "hlo_op", "stack: optax"),
    ("loop_sqrt_fusion", "loop_sqrt_fusion", 15.0, "optimizer", "hlo_op", "stack: optax"),
    ("input_reduce_fusion_2", "command_buffer.7", 2.0, "other", "kernel name = HLO op",
     "reduction / control / custom"),
    ("MemcpyDtoD", None, 11.0, "copy", "kernel name only", "kernel name"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3_64x64x128", None, 50.0,
     "attention", "kernel name only", "kernel name"),
    ("mystery_kernel", None, 1.0, "other", "kernel name only", "no HLO op"),
    ("model_layernorm_bwd__1", None, 13.0, "layernorm", "kernel name only", "kernel name"),
]


def _gpu_trace(steps=2, gap=1.0):
    """Device events of ``steps`` steps, each kernel once per step, ``gap`` µs apart; plus a derived
    "XLA Ops" line and another module's kernel, which must not count."""
    ev = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
          {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "pid": 7, "tid": 3, "name": "thread_name", "args": {"name": "Stream #14(Compute)"}},
          {"ph": "M", "pid": 7, "tid": 101, "name": "thread_name", "args": {"name": "XLA Ops"}}]
    t = 1000.0
    for _ in range(steps):
        first = t
        for name, op, dur, *_ in KERNELS:
            args = {"hlo_module": "jit_train_step", "hlo_op": op} if op else {}
            ev.append({"ph": "X", "pid": 7, "tid": 3, "name": name, "ts": t, "dur": dur, "args": args})
            t += dur + gap
        ev.append({"ph": "X", "pid": 7, "tid": 101, "name": "fusion.9", "ts": first, "dur": t - first})
        ev.append({"ph": "X", "pid": 7, "tid": 3, "name": "loop_add_fusion_3", "ts": t, "dur": 500.0,
                   "args": {"hlo_module": "jit_other", "hlo_op": "loop_add_fusion.3"}})
        t += 600.0
    return ev


def test_hlo_index_reads_instructions_and_call_stacks():
    idx = tsp.HloIndex(HLO)
    assert idx.module == "jit_train_step"
    cc = idx.instrs["custom-call.1"]
    assert (cc["opcode"], cc["target"], cc["operands"]) == ("custom-call", "__cublas$gemm", ["h", "w1"])
    assert idx.instrs["gemm_fusion_dot.2"]["backend_kind"] == "__triton_gemm"
    assert [f for _, f in idx.info("custom-call.1")["stack"]] == [
        "Linear.__call__", "MLP.__call__", "Block.__call__", "GPT.__call__", "loss_fn",
        "train_step.<locals>.micro", "train_step"]
    assert idx.info("gemm_fusion_dot.2")["opcodes"] == {"parameter", "dot"}
    assert 96 in idx.info("gemm_fusion_dot.2")["dims"]  # via its operand and called computation
    assert [f for _, f in idx.info("loop_multiply_fusion.4")["stack"]][0].startswith("scale_by_adam")
    assert idx.lookup("gemm_fusion_dot_2") == "gemm_fusion_dot.2" and idx.lookup("nvjet_x") is None


def test_stack_frames_in_either_parent_numbering():
    """Printed parent = parent's id + 1 (root 1), as jax's modules print it; or the parent's id
    itself (root 0). The first frame, always a root, tells them apart."""
    a = tsp.HloIndex(HLO)
    b = tsp.HloIndex(re.sub(r"parent_frame_id=(\d+)", lambda m: f"parent_frame_id={int(m[1]) - 1}", HLO))
    for frame in range(1, 14):
        assert a.stack(frame) == b.stack(frame), frame
    assert len(a.stack(8)) == 7 and len(a.stack(1)) == 1 and len(a.stack(12)) == 2


def test_families_of_a_hand_written_step():
    idx = tsp.HloIndex(HLO)
    res = tsp.families(_gpu_trace(steps=2), idx, steps=2, vocab=96)
    want = {k: 0.0 for k in tsp.FAMILIES}
    how = {"hlo_op": 0.0, "kernel name = HLO op": 0.0, "kernel name only": 0.0}
    for _, _, dur, fam, via, _ in KERNELS:
        want[fam] += dur / 1e3
        how[via] += dur / 1e3
    assert res["families_ms"] == pytest.approx(want)
    assert res["attributed_ms"] == pytest.approx(how)
    total = sum(d for _, _, d, *_ in KERNELS) / 1e3
    assert res["total_ms"] == pytest.approx(total) and res["busy_ms"] == pytest.approx(total)
    # two steps of kernels 1 µs apart, 600 µs between the steps (where the other module's kernel runs)
    assert res["span_ms"] == pytest.approx((2 * total * 1e3 + 2 * len(KERNELS) - 1 + 600) / 1e3 / 2)
    assert res["foreign_events"] == 2  # the other module's kernel, once per step
    rules = {r["kernel"]: (r["family"], r["rule"], r["launches"]) for r in res["kernels"]}
    for name, _, _, fam, _, rule in KERNELS:
        assert rules[name] == (fam, rule, 1.0), name
    md = tsp.families_markdown(res, "step")
    assert f"| copies / casts / transposes | 0.02 | {100 * 0.023 / total:.1f} % |" in md
    assert "2 kernel events of other modules left out" in md


def test_families_by_kernel_name_alone():
    """Without the HLO only the names speak: our and cuDNN's attention kernels, GEMM libraries and
    copies; everything else is "other"."""
    res = tsp.families(_gpu_trace(steps=1), None, steps=1)
    by_name = {"attention": {"jax_flash_fwd_triton_kernel", "cudnn_generated_fort_native_sdpa_sm90_"
                             "flash_bprop_wgmma_f16_knob_3_64x64x128"},
               "matmul": {"nvjet_tst_128x64_64x4_1x2_h_bz_TNT", "gemm_fusion_dot_2"},
               "copy": {"wrapped_transpose", "copy_4", "MemcpyDtoD"},
               "layernorm": {"model_layernorm_bwd__1"}}
    dur = {name: d / 1e3 for name, _, d, *_ in KERNELS}
    for fam, names in by_name.items():
        assert res["families_ms"][fam] == pytest.approx(sum(dur[n] for n in names)), fam
    # no module to filter by without the HLO: the other module's 500 µs kernel counts, in "other"
    rest = sum(dur.values()) - sum(dur[n] for ns in by_name.values() for n in ns)
    assert res["families_ms"]["other"] == pytest.approx(rest + 0.5)
    assert res["attributed_ms"]["kernel name only"] == pytest.approx(res["total_ms"])
    # the fused residual addition's LayerNorm kernels count as layer norms too
    assert tsp.classify("model_add_layernorm_bwd__3", None) == ("layernorm", "kernel name")
    # and the Pallas loss kernels count as the loss, whatever their stack says
    assert tsp.classify("model_cross_entropy_fwd__2", None) == ("logits_ce", "kernel name")
    # and the Pallas GELU kernels as GELU / elementwise
    assert tsp.classify("model_gelu_bwd", None) == ("elementwise", "kernel name")


def test_torch_families_judge_pytorch_kernels_by_name():
    """nanoGPT's profile: Inductor's generated kernels are named after the ops they fused, ATen's
    and cuBLAS's after the op. Each family gets its kernels' time per step; CPU ops, Python frames and
    the CUDA runtime's calls are not kernel time; memcpy and memset are. cuDNN's attention passes
    beside its flash kernels (δ, the dQ conversion) count as attention."""
    def k(name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}

    ev = [k("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", 0, 400),
          k("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 400, 300),
          k("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", 700, 200),
          k("triton_per_fused__log_softmax__to_copy_view_0", 900, 120),
          k("triton_red_fused_add_native_layer_norm_native_layer_norm_backward_3", 1020, 60),
          k("triton_poi_fused_gelu_gelu_backward_view_5", 1080, 80),
          k("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", 1160, 30),
          k("triton_poi_fused_add_9", 1190, 10),
          k("Memcpy HtoD (Pageable -> Device)", 1200, 5, cat="gpu_memcpy"),
          k("triton_red_fused_sum_12", 1205, 15),
          k("void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*)", 1220, 10),
          k("aten::mm", 0, 2000, cat="cpu_op"), k("cudaLaunchKernel", 10, 5, cat="cuda_runtime")]
    res = tsp.torch_families(ev, steps=2)
    want = {"matmul": 700, "attention": 210, "logits_ce": 120, "layernorm": 60, "elementwise": 90,
            "optimizer": 30, "copy": 5, "other": 15}
    assert res["families_ms"] == pytest.approx({f: us / 2e3 for f, us in want.items()})
    assert res["total_ms"] == pytest.approx(1.23 / 2) and res["busy_ms"] == pytest.approx(1.23 / 2)
    assert res["kernels"][0]["kernel"].startswith("ampere") and res["kernels"][0]["launches"] == 0.5
    assert "| GELU / elementwise | 0.04 |" in tsp.families_markdown(res, "nanoGPT")
    # a CPU-only trace has no kernels: its innermost CPU ops stand in
    cpu = tsp.torch_families([k("aten::linear", 0, 100, "cpu_op"), k("aten::mm", 10, 80, "cpu_op")])
    assert [r["kernel"] for r in cpu["kernels"]] == ["aten::mm"]


def test_xla_cpu_ops_count_once():
    """On XLA:CPU a loop's event encloses its body's ops on the same thread: only the innermost count."""
    ev = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}}]
    op = lambda name, ts, dur, tid=5: {"ph": "X", "pid": 1, "tid": tid, "name": name, "ts": ts, "dur": dur,
                                       "args": {"hlo_op": name, "hlo_module": "jit_train_step"}}
    ev += [op("while.1", 0.0, 100.0), op("fusion.1", 10.0, 20.0), op("fusion.2", 40.0, 20.0),
           op("fusion.3", 5.0, 50.0, tid=6), {"ph": "X", "pid": 1, "tid": 5, "name": "end: fusion.1",
                                             "ts": 31.0, "dur": 0.5}]
    kept, foreign = tsp.kernel_events(ev)
    assert sorted(e["name"] for e in kept) == ["fusion.1", "fusion.2", "fusion.3"] and foreign == 0


def test_regroup_computes_a_results_files_profiles_again_from_their_traces(tmp_path, capsys):
    """``--from-json FILE --regroup DIR``: each profiled arm's families from the trace and HLO saved
    in DIR/<its folder>, not the numbers the file holds; a profile without its files raises."""
    stale = {"total_ms": 1.0, "families_ms": {k: 0.0 for k in tsp.FAMILIES}, "steps": 2}
    result = {"device": "H", "model": {"vocab_size": 96},
              "profiles": [{"arm": "a", "batch": 4, "dir": "/remote/profile/a", **stale},
                           {"arm": "b[x=1]", "batch": 4, "dir": "/remote/profile/b_x=1_", **stale}]}
    for sub in ("a", "b_x=1_"):
        d = tmp_path / sub
        d.mkdir()
        (d / "trace.json.gz").write_bytes(gzip.compress(json.dumps(
            {"traceEvents": _gpu_trace(steps=2)}).encode()))
        (d / "hlo.txt.gz").write_bytes(gzip.compress(HLO.encode()))
    want = tsp.families(_gpu_trace(steps=2), tsp.HloIndex(HLO), steps=2, vocab=96)
    got = ts.regroup(result, str(tmp_path))
    assert [p["arm"] for p in got] == ["a", "b[x=1]"]
    for p in got:
        assert p["families_ms"] == pytest.approx(want["families_ms"])
        assert p["families_ms"]["layernorm"] > 0
    src = tmp_path / "results.json"
    src.write_text(json.dumps(result))
    ts.main(["--from-json", str(src), "--regroup", str(tmp_path)])
    out = capsys.readouterr().out
    assert f"| layer norms | {want['families_ms']['layernorm']:.2f} | " in out and "`b[x=1]` (Δ)" in out
    (tmp_path / "a" / "hlo.txt.gz").unlink()
    with pytest.raises(FileNotFoundError, match="'a'"):
        ts.regroup(result, str(tmp_path))
