"""GPT-2 training step time: our step per attention arm and nanoGPT's own step, side by side in one call.

    python -m bench.train_step [--steps 30] [--warmup 5] [--batch 32[,16]] [--arms fa2,fa2-stable,cudnn]
        [--primary fa2-stable] [--preset small-gpu] [--set KEY=VALUE ...] [--nanogpt third_party/nanoGPT]
        [--profile DIR] [--budget SECONDS] [--out FILE.json]
    python -m bench.train_step --from-json FILE.json        # its table as markdown (no GPU)

Our step is train/gpt2.py's ``train_step`` built and jitted as ``train.gpt2.train`` builds it (state
donated, replicated over a 1-D data mesh), with the preset's model and optimizer plus the arm's
overrides (experiments/arms.py) and ``--set``'s; nanoGPT's is its train.py step on its model.py
(bench/nanogpt_step.py), of the same sizes, micro-batch, accumulation and optimizer settings.

Each (arm, micro-batch) runs in a fresh process of its own: peak device memory is that run's alone
(JAX's allocator cannot reset its peak), XLA and PyTorch never share a GPU's memory, and a crash or a
time-out loses one run. The JAX runs share XLA's autotuning cache (a persistent compilation cache
directory that stores no executables), so later arms reuse the GEMM autotuning of the first. Order:
the primary arm and nanoGPT at each micro-batch first, then the other arms, so that a call cut short
by ``--budget`` still holds the comparison the target is judged on. The results file is rewritten
after every run.

Timing (bench/step_timing.py, the same loop for both frameworks): batches on the device before
timing, ``--warmup`` steps, then ``--steps`` steps each waited for (median and spread of these are the
step time), then ``--steps`` dispatched back to back and waited for once. tokens/s = tokens per step
/ median step time. MFU = FLOPs per token (nanoGPT's estimate 6N + 12·L·d·T, N the parameters without
position embeddings, ``train.gpt2.flops_per_token``, the same for every arm) × tokens/s / the device's
dense bf16 peak (``train.gpt2.PEAK_BF16_FLOPS``: 989 TFLOP/s for an H200). Peak memory: JAX's
``peak_bytes_in_use``, PyTorch's ``max_memory_allocated``.

``--profile DIR`` traces ``--profile-steps`` steps of the primary arm at the first micro-batch (back to
back, after its timing) and writes DIR/profile.md (kernel time per op family, ``lab.trace_split``),
DIR/trace.json.gz (the perfetto trace) and DIR/hlo.txt.gz (the step's optimized HLO, which the
grouping reads); ``python -m lab.trace_split --families DIR/trace.json.gz --hlo DIR/hlo.txt.gz``
groups them again without a GPU. ``--profile-arms A,B,…`` profiles those arms instead, each into
DIR/<arm as a file name>/, and writes DIR/compare.md: the families of every profiled arm side by
side, so that what an option moves is read in one table. ``nanogpt`` among them profiles nanoGPT's
step under PyTorch's profiler (its trace and profile.md; kernels judged by name alone,
``lab.trace_split.torch_families``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ARMS = "fa2,fa2-stable,cudnn"
# Guesses of a run's seconds (start, compile, steps) used to decide whether the next one still fits
# the budget, until a run of the same kind has been timed; once the other framework's has, twice
# its longest where that is less (both start a process, compile the same model, time the same steps)
FIRST_GUESS_S = {"jax": 90.0, "torch": 120.0}
OTHER_KIND_FACTOR = 2.0
_clock = time.perf_counter  # the parent's clock for the budget (tests replace it)


# ----------------------------------------------------------------------------- worker (JAX)


@dataclasses.dataclass
class JaxStep:
    """Our step as the benchmark times it, compiled: ``step()`` runs one on the next device batch
    (the state donated and kept in ``held``) and returns its metrics."""

    cfg: object
    compiled: object
    step: object
    held: dict
    batches: list
    devices: list
    accum: int
    micro: int
    seq: int
    compile_s: float


def build_jax_step(spec: dict) -> JaxStep:
    """``train.gpt2.train_step`` for ``spec``'s config, jitted as training jits it (state donated,
    replicated over a 1-D data mesh), on ``spec['batches']`` synthetic device batches."""
    import functools

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from bench.step_timing import synthetic_batches
    from train import config as config_lib
    from train.gpt2 import (grad_accum_steps, init_state, make_model, make_optimizer, split_model,
                            train_step)

    cfg = config_lib.validate(config_lib.from_dict(spec["config"]))
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("data",))
    replicated, data_sharding = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "data"))
    accum = grad_accum_steps(cfg, len(devices))
    seq = cfg.data.seq_len or cfg.model.block_size
    micro = cfg.data.batch_size * len(devices)

    graphdef, params = split_model(make_model(cfg))
    tx, schedule = make_optimizer(cfg)
    state = jax.device_put(init_state(cfg, params, tx), replicated)
    del params
    n_batches = spec.get("batches", BENCH_SETTINGS["batches"])
    toks = synthetic_batches(spec["seed"], n_batches, accum, micro, seq,
                             cfg.model.vocab_size).astype(np.int32)
    batches = [jax.device_put((t[..., :-1], t[..., 1:]), data_sharding) for t in toks]
    step_fn = jax.jit(functools.partial(train_step, graphdef=graphdef, tx=tx, schedule=schedule,
                                        mesh=mesh),
                      donate_argnums=0, out_shardings=(replicated, replicated))
    t0 = time.perf_counter()
    compiled = step_fn.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - t0
    held = {"state": state, "i": 0}
    del state

    def step():
        b = batches[held["i"] % n_batches]
        held["i"] += 1
        held["state"], metrics = compiled(held["state"], b)
        return metrics  # one executable: its outputs are ready together

    return JaxStep(cfg, compiled, step, held, batches, devices, accum, micro, seq, compile_s)


def jax_worker(spec: dict) -> dict:
    """Time our step as ``spec`` says (one arm, one micro-batch); optionally profile it."""
    import jax
    import numpy as np

    from bench.step_timing import time_steps

    t_start = time.perf_counter()
    js = build_jax_step(spec)
    cfg, compiled, step, devices = js.cfg, js.compiled, js.step, js.devices
    accum, micro, seq, compile_s = js.accum, js.micro, js.seq, js.compile_s
    timing = time_steps(step, jax.block_until_ready, warmup=spec["warmup"], steps=spec["steps"])
    loss = float(step()["loss"])
    stats = devices[0].memory_stats() or {}
    try:
        ma = compiled.memory_analysis()
        analysis = {k: getattr(ma, f"{k}_size_in_bytes") for k in ("argument", "output", "alias", "temp")}
    except Exception:  # not every backend reports it
        analysis = None
    import flax
    import jaxlib
    import optax

    out = {
        **timing,
        "compile_s": compile_s,
        "loss_last": loss,
        "n_params_non_embedding": cfg.model.num_params(non_embedding=True),
        "tokens_per_step": accum * micro * seq,
        "grad_accum": accum,
        "n_devices": len(devices),
        "peak_memory_bytes": stats.get("peak_bytes_in_use"),
        "compiled_memory_bytes": analysis,
        "device": devices[0].device_kind,
        "platform": devices[0].platform,
        "versions": {"python": sys.version.split()[0], "jax": jax.__version__,
                     "jaxlib": jaxlib.__version__, "flax": flax.__version__, "optax": optax.__version__,
                     "numpy": np.__version__},
    }
    if spec.get("profile"):
        try:
            out["profile"] = _profile(step, compiled, cfg, spec)
        except Exception as e:  # the timing above stands without it
            out["profile"] = {"error": f"{type(e).__name__}: {e}"}
    out["wall_s"] = time.perf_counter() - t_start
    return out


def _profile(step, compiled, cfg, spec) -> dict:
    import jax

    from lab import trace_split

    pdir = Path(spec["profile"])
    pdir.mkdir(parents=True, exist_ok=True)
    n = spec["profile_steps"]
    with tempfile.TemporaryDirectory(prefix="step-trace-") as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            handle = None
            for _ in range(n):
                handle = step()
            jax.block_until_ready(handle)
        trace = trace_split.trace_file(tmp)
        events = trace_split.load_trace(trace)
        files = []
        if os.path.getsize(trace) <= trace_split.MAX_PROFILE_FILE:
            shutil.copy(trace, pdir / "trace.json.gz")
            files.append("trace.json.gz")
    hlo = compiled.as_text()
    index = trace_split.HloIndex(hlo)
    res = trace_split.families(events, index, steps=n, vocab=cfg.model.vocab_size)
    packed = gzip.compress(hlo.encode())
    if len(packed) <= trace_split.MAX_PROFILE_FILE:
        (pdir / "hlo.txt.gz").write_bytes(packed)
        files.append("hlo.txt.gz")
    title = (f"Kernel time of one training step by op family: arm {spec['arm']}, micro-batch "
             f"{cfg.data.batch_size}, {jax.devices()[0].device_kind}, jax {jax.__version__} "
             f"(`python -m bench.train_step … --profile DIR`)")
    return trace_split.profile_record(pdir, res, title, files)


# ----------------------------------------------------------------------------- the parent


def _arm_parts(spec: str) -> tuple[str, list[str]]:
    name, _, extra = spec.partition("[")
    if extra and not extra.endswith("]"):
        raise ValueError(f"arm {spec!r}: expected NAME or NAME[KEY=VALUE;...]")
    return name, [o for o in extra[:-1].split(";") if o]


def arm_overrides(spec: str) -> list[str]:
    """Config overrides of an arm as ``--arms`` names it: an experiments/arms.py name, optionally
    with more overrides in brackets, ``;``-separated — e.g. ``fa2-stable[model.logits_dtype=bfloat16]``
    (a named option timed beside the arm itself). Entries that start with ``--xla_`` are XLA flags
    for that arm's process (``arm_xla_flags``), those that start with ``bench.`` settings of the
    timing (``arm_bench_settings``), not overrides."""
    from experiments import arms as arms_lib

    name, extra = _arm_parts(spec)
    return arms_lib.overrides(name) + [o for o in extra if not o.startswith(("--xla_", "bench."))]


def arm_xla_flags(spec: str) -> list[str]:
    """The XLA flags an arm's brackets name, e.g. ``fa2-stable[--xla_gpu_enable_command_buffer=]``:
    added to ``XLA_FLAGS`` for that arm's process alone, so that what a compiler setting moves is
    timed beside the arm without it."""
    return [o for o in _arm_parts(spec)[1] if o.startswith("--xla_")]


BENCH_SETTINGS = {"batches": 2}  # distinct device batches the timed steps cycle through


def arm_bench_settings(spec: str) -> dict:
    """The timing's settings an arm's brackets name, e.g. ``fa2-stable[bench.batches=1]`` (every
    step reads the same batch buffer, so no input's address changes between steps): the defaults
    of ``BENCH_SETTINGS`` with those given."""
    out = dict(BENCH_SETTINGS)
    for o in _arm_parts(spec)[1]:
        if not o.startswith("bench.") or o.startswith(TUNING_SETTING):
            continue
        key, eq, value = o[len("bench."):].partition("=")
        if key not in BENCH_SETTINGS or not eq:
            raise ValueError(f"arm {spec!r}: {o!r}: expected bench.KEY=VALUE, KEY one of "
                             f"{', '.join(BENCH_SETTINGS)}")
        out[key] = int(value)
        if out[key] < 1:
            raise ValueError(f"arm {spec!r}: {o!r} must be at least 1")
    return out


TUNING_SETTING = "bench.tuning="


def arm_tuning(spec: str) -> str | None:
    """The tuning table an arm's brackets name, e.g. ``fa2-stable[bench.tuning=my.json]``: set as
    ``JAX_FLASH_TUNING`` for that arm's process alone, so that a candidate launch (launch fields
    only: no value changes) is timed in the step beside the shipped one; None if none is named."""
    named = [o[len(TUNING_SETTING):] for o in _arm_parts(spec)[1] if o.startswith(TUNING_SETTING)]
    if len(named) > 1 or (named and not Path(named[0]).is_file()):
        raise ValueError(f"arm {spec!r}: bench.tuning names one table file that exists, "
                         f"got {named}")
    if named:
        from jax_flash.pallas import tuning

        tuning.load(Path(named[0]))  # launch fields only, checked before any run
    return named[0] if named else None


def _configs(args):
    """(cfg of the preset with --set applied, {arm: cfg}) — the parent's view, no device touched."""
    from train import config as config_lib

    base = config_lib.apply_overrides(config_lib.get_preset(args.preset), args.set)
    per_arm = {}
    for arm in args.arms:
        arm_tuning(arm), arm_bench_settings(arm)  # a bad setting fails before any run
        per_arm[arm] = config_lib.apply_overrides(
            config_lib.get_preset(args.preset), arm_overrides(arm) + list(args.set))
    return base, per_arm


def plan(arms: list[str], batches: list[int], primary: str, nanogpt: bool,
         rounds: int = 1) -> list[tuple[str, str, int, int]]:
    """(kind, arm, micro-batch, round) in run order: per micro-batch the primary arm and nanoGPT,
    then the other arms per micro-batch; all of it ``rounds`` times, the primary and nanoGPT taking
    turns to go first (so that neither always runs on the GPU the other left)."""
    order = []
    for r in range(rounds):
        for b in batches:
            pair = [("jax", primary, b, r)] + ([("torch", "nanogpt", b, r)] if nanogpt else [])
            order += pair[::-1] if r % 2 else pair
        order += [("jax", a, b, r) for b in batches for a in arms if a != primary]
    return order


_running: list[subprocess.Popen] = []  # the worker in flight, for _stop


def _launch(cmd: list[str], env: dict, timeout: float | None, log_path: Path) -> tuple[int | None, float]:
    """Run ``cmd`` in its own process group; (exit status or None on time-out, seconds)."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        _running.append(proc)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its compile workers too
            proc.wait()
            rc = None
        finally:
            _running.remove(proc)
    return rc, time.perf_counter() - t0


def _stop(signum, frame):
    """Terminated (an outer time limit): take the worker in flight down too; the results file holds
    every run finished so far."""
    for proc in list(_running):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise SystemExit(128 + signum)


def _tail(path: Path, n: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def _git_rev():
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev + ("+dirty" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None


def git_tree(root=ROOT) -> str | None:
    """The git tree hash of the working tree as it is (tracked and untracked files, ignored ones
    left out), staged into a throwaway index: equal to ``git rev-parse COMMIT^{tree}`` exactly when
    the files are that commit's, whatever HEAD a copied checkout's metadata says."""
    with tempfile.TemporaryDirectory(prefix="tree-index-") as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": os.path.join(tmp, "index")}
        try:
            for cmd in (["git", "add", "-A"], ["git", "write-tree"]):
                res = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                                     timeout=60)
                if res.returncode:
                    return None
            return res.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None


def derive(run: dict, flops_per_token: float, peak_flops: dict) -> None:
    """tokens/s and MFU of a finished run, from its median and back-to-back step times."""
    from train.gpt2 import PEAK_BF16_FLOPS

    med = (run.get("step_ms") or {}).get("median")
    if not med:
        return
    peak = None
    for name, value in sorted(PEAK_BF16_FLOPS.items(), key=lambda kv: -len(kv[0])):
        if run.get("platform") in ("gpu", "cuda") and name in (run.get("device") or ""):
            peak = value * run.get("n_devices", 1)
            break
    tps = run["tokens_per_step"] / (med / 1e3)
    run["tokens_per_s"] = tps
    run["mfu"] = flops_per_token * tps / peak if peak else None
    if run.get("back_to_back_ms"):
        run["back_to_back_tokens_per_s"] = run["tokens_per_step"] / (run["back_to_back_ms"] / 1e3)
        run["back_to_back_mfu"] = (flops_per_token * run["back_to_back_tokens_per_s"] / peak
                                   if peak else None)
    if peak:
        peak_flops[run["device"]] = peak / run.get("n_devices", 1)


def compare(runs: list[dict], primary: str | None = None) -> None:
    """Each ok run's tokens/s over nanoGPT's at the same micro-batch in the same round (median and
    back to back): ``vs_nanogpt``; with ``primary``, each other JAX run's over the primary arm's
    the same way: ``vs_primary``."""
    key = lambda r: (r["batch"], r.get("round", 0))
    for ref_arm, field in (("nanogpt", "vs_nanogpt"), (primary, "vs_primary")):
        if ref_arm is None:
            continue
        ref = {key(r): r for r in runs if r["arm"] == ref_arm and r.get("tokens_per_s")}
        for r in runs:
            n = ref.get(key(r))
            if r["arm"] not in ("nanogpt", ref_arm) and r.get("tokens_per_s") and n:
                r[field] = r["tokens_per_s"] / n["tokens_per_s"]
                if r.get("back_to_back_tokens_per_s") and n.get("back_to_back_tokens_per_s"):
                    r[field + "_back_to_back"] = (r["back_to_back_tokens_per_s"]
                                                  / n["back_to_back_tokens_per_s"])


def run_all(args) -> dict:
    from train import config as config_lib
    from train.gpt2 import flops_per_token, grad_accum_steps

    base, per_arm = _configs(args)

    seq = base.data.seq_len or base.model.block_size
    fpt = flops_per_token(base.model, seq)
    nanogpt = args.nanogpt is not None
    order = plan(args.arms, args.batch, args.primary, nanogpt, args.rounds)
    result = {
        "what": "GPT-2 training step time per arm (bench.train_step)",
        "command": "python -m bench.train_step " + " ".join(args.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "git_rev": _git_rev(),
        "git_tree": git_tree(),
        "preset": args.preset, "set": list(args.set),
        "model": {k: getattr(base.model, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size",
                                                         "block_size", "dtype", "logits_dtype")},
        "seq_len": seq, "n_params_non_embedding": base.model.num_params(non_embedding=True),
        "flops_per_token": fpt,
        "flops_formula": "6N + 12*L*d*T (nanoGPT's estimate; N without position embeddings)",
        "mfu_peak": "dense bf16 peak of the device (train.gpt2.PEAK_BF16_FLOPS), per device",
        "peak_flops": {},
        "timing": (f"{args.warmup} warm-up steps, then {args.steps} steps each waited for (step_ms: "
                   f"median, quartiles, range), then {args.steps} back to back waited for once "
                   "(back_to_back_ms); tokens/s from the median; each run a fresh process"),
        "steps": args.steps, "warmup": args.warmup, "batches": args.batch, "primary": args.primary,
        "rounds": args.rounds,
        "versions": {}, "device": None, "runs": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, out)

    work = Path(tempfile.mkdtemp(prefix="train-step-"))
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    if not args.no_compile_cache:
        # a cache directory turns on XLA's per-fusion autotuning cache under it; executables
        # themselves (never the same twice here) are not written
        env.setdefault("JAX_COMPILATION_CACHE_DIR", str(work / "jax-cache"))
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1e9")
        (Path(env["JAX_COMPILATION_CACHE_DIR"]) / "xla_gpu_per_fusion_autotune_cache_dir").mkdir(
            parents=True, exist_ok=True)
    monitor = None
    if args.smi:
        from bench.step_timing import GpuMonitor

        monitor = GpuMonitor()
        result["power_limit_w"] = monitor.power_limit_w
    previous = signal.signal(signal.SIGTERM, _stop)
    t_begin = _clock()
    took: dict[str, list[float]] = {"jax": [], "torch": [], "profile": []}
    try:
        for i, (kind, arm, batch, rnd) in enumerate(order):
            run = {"arm": arm, "batch": batch, "round": rnd, "framework": kind}
            if kind == "jax":
                cfg = config_lib.apply_overrides(per_arm[arm], [f"data.batch_size={batch}"])
                run["overrides"] = arm_overrides(arm)
                if arm_bench_settings(arm) != BENCH_SETTINGS:
                    run["bench_settings"] = arm_bench_settings(arm)
            else:  # one GPU
                cfg = config_lib.apply_overrides(base, [f"data.batch_size={batch}"])
                run.update(nanogpt=args.nanogpt, grad_accum=grad_accum_steps(cfg, 1))
            profile = (bool(args.profile) and arm in args.profile_arms and batch == args.batch[0]
                       and rnd == 0)
            result["runs"].append(run)
            elapsed = _clock() - t_begin
            # the profiled run takes longer than the others: a guess for them only without another
            guess = max(took[kind] or (took["profile"] if kind == "jax" else []) or [FIRST_GUESS_S[kind]])
            other = took["torch"] if kind == "jax" else took["jax"] + took["profile"]
            if not took[kind] and other:
                guess = min(guess, OTHER_KIND_FACTOR * max(other))
            if args.budget and elapsed + guess > args.budget:
                run.update(status="skipped", error=f"budget: {elapsed:.0f} s spent, a run takes "
                           f"about {guess:.0f} s, {args.budget:.0f} s allowed")
                print(f"[{arm} b{batch}] skipped ({run['error']})", flush=True)
                save()
                continue
            if kind == "torch" and not (Path(args.nanogpt) / "model.py").is_file():
                run.update(status="missing", error=f"{args.nanogpt}/model.py not found: run "
                           "`make nanogpt` (docs/PERFORMANCE.md) and carry third_party/nanoGPT")
                print(f"[{arm} b{batch}] {run['error']}", flush=True)
                save()
                continue
            spec = {"arm": arm, "seed": args.seed, "warmup": args.warmup, "steps": args.steps,
                    "result": str(work / f"result-{i}.json")}
            if kind == "jax":
                spec["config"] = config_lib.to_dict(cfg)
                spec.update(arm_bench_settings(arm))
                if profile:
                    spec.update(profile=profile_dir(args, arm), profile_steps=args.profile_steps)
                cmd = [sys.executable, "-m", "bench.train_step", "--worker", str(work / f"spec-{i}.json")]
            else:
                o, mc = cfg.optim, cfg.model
                spec.update(nanogpt=str(Path(args.nanogpt).resolve()), compile=args.nanogpt_compile,
                            model={k: getattr(mc, k) for k in ("n_layer", "n_head", "n_embd",
                                                               "vocab_size", "block_size")},
                            dtype=mc.dtype, seq_len=seq, micro_batch=batch, accum=run["grad_accum"],
                            optim={"lr": o.lr, "b1": o.b1, "b2": o.b2, "eps": o.eps,
                                   "weight_decay": o.weight_decay, "clip": o.clip or 0.0,
                                   "warmup_steps": o.warmup_steps})
                if profile:
                    spec.update(profile=profile_dir(args, arm), profile_steps=args.profile_steps)
                cmd = [args.torch_python, "-m", "bench.nanogpt_step", str(work / f"spec-{i}.json")]
            (work / f"spec-{i}.json").write_text(json.dumps(spec))
            timeout = args.worker_timeout
            if args.budget:
                timeout = min(timeout, max(args.budget - elapsed, 1.0))
            print(f"[{arm} b{batch}] started at {elapsed:.0f} s (time limit {timeout:.0f} s)", flush=True)
            log = work / f"log-{i}.txt"
            flags = arm_xla_flags(arm) if kind == "jax" else []
            arm_env = dict(env)
            if flags:
                run["xla_flags"] = flags
                arm_env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *flags]).strip()
            table = arm_tuning(arm) if kind == "jax" else None
            if table:
                run["tuning"] = {"file": table, "entries": json.loads(Path(table).read_text())}
                arm_env["JAX_FLASH_TUNING"] = str(Path(table).resolve())
            rc, secs = _launch(cmd, arm_env, timeout, log)
            took["profile" if profile else kind].append(secs)
            for line in _tail(log, args.log_lines if rc == 0 else max(args.log_lines, 200)):
                print(f"[{arm} b{batch}] {line}", flush=True)
            run["process_s"] = secs
            res_path = Path(spec["result"])
            if rc == 0 and res_path.is_file():
                run.update(json.loads(res_path.read_text()), status="ok")
                for k, v in run.pop("versions", {}).items():
                    result["versions"].setdefault(k, v)
                result["device"] = result["device"] or run.get("device")
                derive(run, fpt, result["peak_flops"])
                if monitor is not None and monitor.available and run.get("phases_wall_s"):
                    run["gpu"] = {k: monitor.summary(*w) for k, w in run["phases_wall_s"].items()}
                if kind == "torch" and run.get("n_params_non_embedding") != result["n_params_non_embedding"]:
                    run["warning"] = "nanoGPT's parameter count differs from ours"
                if run.get("profile"):
                    prof = {"arm": arm, "batch": batch, **run.pop("profile")}
                    result.setdefault("profiles", []).append(prof)
                    if arm == args.primary:
                        result["profile"] = prof
                    if len(args.profile_arms) > 1:
                        Path(args.profile).mkdir(parents=True, exist_ok=True)
                        (Path(args.profile) / "compare.md").write_text(
                            compare_profiles(result["profiles"], result.get("device")))
                print(_line(run), flush=True)
            else:
                run.update(status="timeout" if rc is None else "failed", exit_status=rc,
                           error="\n".join(_tail(log, 30)))
                print(f"[{arm} b{batch}] {run['status']} after {secs:.0f} s", flush=True)
            compare(result["runs"], args.primary)
            save()
    except SystemExit:
        for r in result["runs"]:
            r.setdefault("status", "interrupted")
        save()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(work, ignore_errors=True)
        if monitor is not None:
            monitor.close()
    result["total_s"] = _clock() - t_begin
    save()
    print(markdown(result), flush=True)
    return result


def _line(r: dict) -> str:
    s = r["step_ms"]
    mfu = f"MFU {r['mfu']:.3f}" if r.get("mfu") is not None else "MFU —"
    mem = f"{r['peak_memory_bytes'] / 2**30:.1f} GiB" if r.get("peak_memory_bytes") else "— GiB"
    call = f"{r['call_ms']:.2f}" if r.get("call_ms") is not None else "—"
    return (f"[{r['arm']} b{r['batch']}] {r['tokens_per_s']:,.0f} tokens/s  {s['median']:.2f} ms/step "
            f"(q1 {s['q1']:.2f}, q3 {s['q3']:.2f}, range {s['min']:.2f}–{s['max']:.2f})  back to back "
            f"{r['back_to_back_ms']:.2f} ms  call returns {call} ms  {mfu}  "
            f"peak {mem}  compile {r.get('compile_s') or 0:.0f} s")


def profile_dir(args, arm: str) -> str:
    """Where an arm's profile goes: DIR itself when only one arm is profiled, else DIR/<arm> with
    the characters a file name should not hold replaced."""
    if len(args.profile_arms) == 1:
        return args.profile
    safe = "".join(c if c.isalnum() or c in "-_.=" else "_" for c in arm)
    return str(Path(args.profile) / safe)


def regroup(result: dict, root: str) -> list[dict]:
    """The profiles of a results file with their families computed again (``lab.trace_split`` as it
    is now) from the trace and HLO each left in ``root``/<its folder's name> — or in ``root`` itself
    when one arm was profiled. A profile whose files are not there raises."""
    from lab import trace_split

    out = []
    for p in result.get("profiles") or ([result["profile"]] if result.get("profile") else []):
        if "families_ms" not in p:
            continue
        d = Path(root) / Path(p["dir"]).name
        d = d if (d / "trace.json.gz").is_file() else Path(root)
        trace, hlo = d / "trace.json.gz", d / "hlo.txt.gz"
        if p["arm"] == "nanogpt":  # PyTorch's trace: kernels judged by name
            if not trace.is_file():
                raise FileNotFoundError(f"no trace.json.gz of 'nanogpt' in {d}")
            res = trace_split.torch_families(
                json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"], steps=p["steps"])
            out.append({"arm": p["arm"], "batch": p["batch"], **res})
            continue
        if not (trace.is_file() and hlo.is_file()):
            raise FileNotFoundError(f"no trace.json.gz and hlo.txt.gz of {p['arm']!r} in {d}")
        index = trace_split.HloIndex(gzip.decompress(hlo.read_bytes()).decode())
        res = trace_split.families(trace_split.load_trace(str(trace)), index, steps=p["steps"],
                                   vocab=result["model"]["vocab_size"])
        out.append({"arm": p["arm"], "batch": p["batch"], **res})
    return out


def compare_profiles(profiles: list[dict], device: str | None = None) -> str:
    """Kernel time per op family (ms per step) of several profiled arms side by side, with each
    arm's difference from the first."""
    from lab.trace_split import FAMILIES

    ok = [p for p in profiles if "families_ms" in p]
    if not ok:
        return "no profile completed\n"
    base = ok[0]
    head = " | ".join(f"`{p['arm']}`" + ("" if p is base else " (Δ)") for p in ok)
    lines = [f"Kernel time per op family, ms per step, micro-batch {base['batch']}"
             f"{', ' + device if device else ''} (`python -m bench.train_step … --profile-arms`; "
             f"Δ: against `{base['arm']}`)", "", f"| family | {head} |", "|---|" + "---|" * len(ok)]

    def cell(p, ms, ref):
        return f"{ms:.2f}" if p is base else f"{ms:.2f} ({ms - ref:+.2f})"

    for key, label in FAMILIES.items():
        ref = base["families_ms"][key]
        lines.append(f"| {label} | " + " | ".join(cell(p, p["families_ms"][key], ref) for p in ok) + " |")
    lines.append("| **all kernels** | " + " | ".join(cell(p, p["total_ms"], base["total_ms"])
                                                   for p in ok) + " |")
    failed = [p["arm"] for p in profiles if "families_ms" not in p]
    if failed:
        lines += ["", "Not profiled (error): " + ", ".join(f"`{a}`" for a in failed)]
    return "\n".join(lines) + "\n"


def over_rounds(runs: list[dict], field: str = "vs_nanogpt", against: str = "nanoGPT's") -> str:
    """Per (arm, micro-batch): the median over rounds of a ratio of tokens/s taken within each
    round (``field``: ``vs_nanogpt`` or ``vs_primary``), its range and how many rounds carry it;
    waited and back to back. Empty when no run has the ratio."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in runs:
        if r.get(field) is not None:
            groups.setdefault((r["arm"], r["batch"]), []).append(r)
    if not groups:
        return ""
    lines = [f"Over rounds, tokens/s over {against} in the same round: median (range), rounds", "",
             "| arm | micro-batch | waited | back to back | rounds |", "|---|---|---|---|---|"]

    def cell(vals):
        vals = sorted(v for v in vals if v is not None)
        if not vals:
            return "—"
        return f"{statistics.median(vals):.3f} ({vals[0]:.3f}–{vals[-1]:.3f})"

    for (arm, batch), rs in groups.items():
        lines.append(f"| {arm} | {batch} | {cell(r[field] for r in rs)} | "
                     f"{cell(r.get(field + '_back_to_back') for r in rs)} | {len(rs)} |")
    return "\n".join(lines) + "\n"


def markdown(result: dict | list) -> str:
    """The results as a markdown table (one row per run, in run order). Files of the earlier form
    (a list of per-arm records: median step time, tokens/s, MFU) give those columns."""
    fmt = lambda x, f: "—" if x is None else format(x, f)
    if isinstance(result, list):
        lines = ["| arm | micro-batch | tokens/s | ms/step | MFU | device |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['arm']} | {r.get('batch', '—')} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.2f} | "
                  f"{fmt(r.get('mfu'), '.3f')} | {r.get('device', '—')} |" for r in result]
        return "\n".join(lines) + "\n"
    lines = [f"GPT-2 step, {result.get('device') or '?'}, {result['seq_len']} tokens per sequence, "
             f"{result['steps']} timed steps after {result['warmup']} (`{result['command']}`)", "",
             "| arm | micro-batch | tokens/s | ms/step median (q1–q3) | back to back ms | MFU | "
             "peak memory GiB | compile s | vs nanoGPT |", "|---|---|---|---|---|---|---|---|---|"]
    rounds = max([r.get("round", 0) for r in result["runs"]], default=0) + 1
    for r in result["runs"]:
        name = r["arm"] + (f" (round {r.get('round', 0) + 1})" if rounds > 1 else "")
        if r.get("status") != "ok":
            lines.append(f"| {name} | {r['batch']} | {r.get('status')} | | | | | | |")
            continue
        s = r["step_ms"]
        mem = r["peak_memory_bytes"] / 2**30 if r.get("peak_memory_bytes") else None
        lines.append(f"| {name} | {r['batch']} | {r['tokens_per_s']:,.0f} | {s['median']:.2f} "
                     f"({s['q1']:.2f}–{s['q3']:.2f}) | {fmt(r.get('back_to_back_ms'), '.2f')} | "
                     f"{fmt(r.get('mfu'), '.3f')} | {fmt(mem, '.1f')} | {fmt(r.get('compile_s'), '.0f')} | "
                     f"{fmt(r.get('vs_nanogpt'), '.3f')} |")
    if rounds > 1:
        primary = result.get("primary") or "the primary arm"
        for table in (over_rounds(result["runs"]),
                      over_rounds(result["runs"], "vs_primary", f"`{primary}`'s")):
            if table:
                lines += ["", table]
    gpu = [r for r in result["runs"] if r.get("status") == "ok" and r.get("gpu")]
    if gpu:
        limit = result.get("power_limit_w")
        lines += ["", "The GPU while each run's steps were timed (nvidia-smi every 100 ms; waited / "
                  f"back to back; power limit {fmt(limit, '.0f')} W):", "",
                  "| arm | micro-batch | samples | SM MHz median | SM MHz min | W median | W max | "
                  "°C max | power-capped | thermal |", "|---|---|---|---|---|---|---|---|---|---|"]

        def pair(r, key, f):
            return " / ".join(fmt((r["gpu"].get(k) or {}).get(key), f)
                              for k in ("waited", "back_to_back"))

        for r in gpu:
            lines.append(f"| {r['arm']} | {r['batch']} | {pair(r, 'samples', 'd')} | "
                         f"{pair(r, 'sm_mhz_median', '.0f')} | {pair(r, 'sm_mhz_min', '.0f')} | "
                         f"{pair(r, 'power_w_median', '.0f')} | {pair(r, 'power_w_max', '.0f')} | "
                         f"{pair(r, 'temp_c_max', '.0f')} | {pair(r, 'power_cap_share', '.0%')} | "
                         f"{pair(r, 'thermal_share', '.0%')} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="timed steps (and as many back to back)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every (arm, micro-batch) this many times, each round a fresh process "
                         "per run; ratios to nanoGPT pair runs of one round")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (>= 1)")
    ap.add_argument("--batch", default="32", help="micro-batches, comma-separated, e.g. 32,16")
    ap.add_argument("--arms", default=DEFAULT_ARMS,
                    help="experiments/arms.py names, each optionally NAME[KEY=VALUE;...] (more "
                         "overrides; entries starting --xla_ are XLA flags for that arm alone)")
    ap.add_argument("--primary", default=None,
                    help="arm run first at each micro-batch and profiled (default fa2-stable if listed)")
    ap.add_argument("--preset", default="small-gpu")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every arm and for nanoGPT's sizes (repeatable)")
    ap.add_argument("--nanogpt", default=None, metavar="DIR", help="time nanoGPT's step from DIR/model.py")
    ap.add_argument("--nanogpt-compile", default="auto", choices=("auto", "on", "off"),
                    help="torch.compile nanoGPT's model (auto: on CUDA only)")
    ap.add_argument("--torch-python", default=sys.executable, help="interpreter of the nanoGPT run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default=None, metavar="DIR", help="profile the primary arm into DIR")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--profile-arms", default=None, metavar="A,B,…",
                    help="profile these arms (at the first micro-batch) instead of the primary only; "
                         "DIR/compare.md sets their families side by side")
    ap.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                    help="skip runs that would not finish within this many seconds of the start")
    ap.add_argument("--worker-timeout", type=float, default=600.0, metavar="SECONDS")
    ap.add_argument("--no-compile-cache", action="store_true",
                    help="no persistent JAX compilation cache shared by the runs")
    ap.add_argument("--log-lines", type=int, default=20,
                    help="last lines of each run's log to print (of a failed run's: at least 200)")
    ap.add_argument("--no-smi", dest="smi", action="store_false",
                    help="do not sample the GPU's clock and power (nvidia-smi, every 100 ms)")
    ap.add_argument("--out", default="train_step.json")
    ap.add_argument("--from-json", default=None, metavar="FILE", help="print FILE's table (no GPU)")
    ap.add_argument("--regroup", default=None, metavar="DIR",
                    help="with --from-json: group FILE's profiled arms again from the traces and HLO "
                         "saved under DIR (its --profile folder) and print them side by side")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        Path(spec["result"]).write_text(json.dumps(jax_worker(spec), indent=1))
        return None
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        if args.regroup:
            print(compare_profiles(regroup(result, args.regroup), result.get("device")), end="")
        else:
            if isinstance(result, dict):  # files from before a ratio existed get it too
                compare(result["runs"], result.get("primary"))
            print(markdown(result), end="")
        return None
    args.argv = argv
    args.arms = [a for a in args.arms.split(",") if a]
    args.batch = [int(b) for b in str(args.batch).split(",") if b]
    if args.primary is None:
        args.primary = "fa2-stable" if "fa2-stable" in args.arms else args.arms[0]
    if args.primary not in args.arms:
        ap.error(f"--primary {args.primary} is not among --arms")
    args.profile_arms = ([a for a in args.profile_arms.split(",") if a] if args.profile_arms
                         else [args.primary])
    missing = [a for a in args.profile_arms
               if a not in args.arms and not (a == "nanogpt" and args.nanogpt)]
    if missing:
        ap.error(f"--profile-arms {','.join(missing)} not among --arms")
    if args.warmup < 1:
        ap.error("--warmup must be >= 1 (the first step compiles nanoGPT's model)")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    try:
        _configs(args)
    except (KeyError, ValueError) as e:
        ap.error(str(e))
    return run_all(args)


if __name__ == "__main__":
    main()
