"""Train GPT-2 (models/gpt2.py) on a token corpus: jitted step, metrics, checkpoints, divergence stop.

    python -m train.gpt2 --preset tiny-cpu data.path=data/gpt2 max_steps=300 attention.kind=flash

One jitted call is one optimizer step: the micro-batches of a step are accumulated with ``lax.scan``
inside it, and the state (params, optimizer state, step, rng) is donated. Data parallel over every
local device: a 1-D mesh "data", the batch sharded on its batch dimension, the state replicated,
each device computing the loss and gradient of its own rows (``per_device``).

Files in ``run_dir``: ``config.json``; ``metrics.jsonl`` (one record per step: step, loss, grad_norm,
lr, tokens_per_s, step_time_s, mfu, and val_loss / probe outputs on the steps that have them);
``summary.json`` (always written at the end; ``diverged_at`` / ``reason`` / ``last_good_checkpoint``
when the run was stopped); ``checkpoints/`` (train/checkpoint.py: Orbax, sealed by checksums). Step
numbers are 1-based: record ``step=s`` is the s-th optimizer update, its ``loss`` the training loss
of that update's batch (before the update), its ``lr`` the lr used.

Metrics are fetched one step late (nanodo style) so the host never waits on the device between
steps, except on steps that evaluate, probe or checkpoint.

Divergence (``divergence_reason``): the run stops at the first step whose loss or gradient norm is
non-finite, or whose loss exceeds ``divergence_factor`` (default 3) times the minimum of all earlier
losses — from the second step on, warmup included. Before every checkpoint the whole state is
checked too: a non-finite parameter or optimizer moment stops the run instead of being saved. A
stopped run saves nothing from the bad step on; its newest checkpoint is the last good one.

Resume (``resume=true|auto``, ``resume_step``): the newest intact checkpoint (or the one asked for),
with the checkpoint's own config; only ``config.RESUME_SAFE`` keys may differ. ``config.json`` is
rewritten only once the restore succeeded.

Stopping (SIGTERM, SIGINT — a job scheduler's time limit, ``timeout``, Ctrl-C): the step in flight
is finished, recorded and checkpointed (when checkpoints are on), and the run ends with
``stopped_by`` in its summary; a resume continues it bitwise. A second signal stops at once.

Exit status of ``python -m train.gpt2``: 0 done, 2 refused before training (bad value, conflicting
or impossible resume, damaged checkpoint asked for), 3 diverged, 4 stopped by a signal.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.gpt2 import GPT, GPTConfig, count_params, cross_entropy
from train import config as config_lib
from train import stacked
from train.checkpoint import CheckpointError, CheckpointStore, code_version
from train.config import TrainConfig

Probe = Callable[[int, GPT, tuple], dict]

EXIT_REFUSED = 2  # also argparse's status for a bad argument
EXIT_DIVERGED = 3
EXIT_STOPPED = 4


class _StopOnSignal:
    """While active, SIGTERM and SIGINT ask the training loop to stop after the step in flight
    (``self.signal`` names the first); a second one gets the previous handler, so it stops at once.
    Handlers can only be set from the main thread: elsewhere this does nothing."""

    SIGNALS = ("SIGTERM", "SIGINT")

    def __init__(self):
        self.signal = None
        self._previous = {}

    def _handle(self, signum, frame):
        import signal

        if self.signal is not None:  # asked twice: the previous behaviour
            self.__exit__()
            signal.raise_signal(signum)
            return
        self.signal = signal.Signals(signum).name
        print(f"{self.signal}: stopping after the step in flight (checkpointed when checkpoints are "
              "on); send it again to stop at once", file=sys.stderr, flush=True)

    def __enter__(self):
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name)
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


class RunError(RuntimeError):
    """The run was refused before training: nothing in its directory was changed."""

# Peak dense bf16 FLOP/s per device, by a substring of jax's device_kind.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12, "B200": 2250e12}


# ----------------------------------------------------------------------------- model & optimizer


def make_model(cfg: TrainConfig | GPTConfig, seed: int | None = None) -> GPT:
    mcfg = cfg.model if isinstance(cfg, TrainConfig) else cfg
    if seed is None:
        seed = cfg.seed if isinstance(cfg, TrainConfig) else 0
    return GPT(mcfg, rngs=nnx.Rngs(seed))


def split_model(model: GPT):
    """(graphdef, params) with params a plain nested dict of arrays (layer keys are ints)."""
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """nanoGPT's schedule: lr*(t+1)/(warmup+1) during warmup, then cosine to min_lr at decay_steps,
    then min_lr. t is the 0-based update count (optax's count)."""
    o = cfg.optim
    peak, floor, warm = o.lr, o.min_lr, o.warmup_steps
    decay = o.decay_steps if o.decay_steps is not None else cfg.max_steps

    def schedule(count):
        t = jnp.asarray(count, jnp.float32)
        warm_lr = peak * (t + 1) / (warm + 1)
        frac = jnp.clip((t - warm) / max(decay - warm, 1), 0.0, 1.0)
        cos_lr = floor + 0.5 * (1.0 + jnp.cos(jnp.pi * frac)) * (peak - floor)
        return jnp.where(t < warm, warm_lr, cos_lr)

    return schedule


def _is_hidden_matrix(path, x) -> bool:
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    return x.ndim == 2 and keys[0] == "blocks"


def muon_dimension_numbers(params):
    """Muon for the 2-D kernels inside the blocks; None (AdamW) for embeddings/head and LayerNorms."""
    from optax.contrib import MuonDimensionNumbers

    return jax.tree_util.tree_map_with_path(
        lambda path, x: MuonDimensionNumbers() if _is_hidden_matrix(path, x) else None, params
    )


def make_optimizer(cfg: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    o = cfg.optim
    schedule = lr_schedule(cfg)
    if o.name == "adamw":
        tx = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay)
    elif o.name == "muon":
        muon_lr = o.muon_lr if o.muon_lr is not None else 0.02
        ratio = muon_lr / o.lr
        tx = optax.contrib.muon(
            learning_rate=lambda c: schedule(c) * ratio,
            beta=o.muon_beta,
            eps=o.eps,
            weight_decay=o.weight_decay,
            adam_b1=o.b1,
            adam_b2=o.b2,
            adam_weight_decay=o.weight_decay,
            adam_learning_rate=schedule,
            muon_weight_dimension_numbers=muon_dimension_numbers,
        )
    else:
        raise ValueError(f"unknown optimizer {o.name!r} (adamw, muon)")
    if o.clip:
        # stacked parameters: the norm over the leaves as the tree has them, in the tree's order
        clip = stacked.clip_by_global_norm if o.stack_params else optax.clip_by_global_norm
        tx = optax.chain(clip(o.clip), tx)
    return tx, schedule


def nudge_params(params, replicate: int):
    """Every floating-point parameter moved one ulp up, one down or not at all (a third each, drawn
    from ``replicate``): the same init and data, a different execution. Replicate 0: unchanged."""
    if not replicate:
        return params
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(replicate), len(leaves))
    out = []
    for key, p in zip(keys, leaves):
        p = jnp.asarray(p)
        if not jnp.issubdtype(p.dtype, jnp.floating):
            out.append(p)
            continue
        step = jax.random.randint(key, p.shape, -1, 2)  # −1, 0, +1 ulp
        toward = jnp.where(step > 0, jnp.inf, -jnp.inf).astype(p.dtype)
        out.append(jnp.where(step == 0, p, jnp.nextafter(p, toward)))
    return jax.tree_util.tree_unflatten(treedef, out)


def init_state(cfg: TrainConfig, params, tx) -> dict:
    """The state a step takes: params (``stacked.Stacked`` with ``optim.stack_params``), the
    optimizer's state of them, the step count and the rng key."""
    if cfg.optim.stack_params:
        params = stacked.stack(params)
    return {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "opt_state": tx.init(params),
        "rng": jax.random.PRNGKey(cfg.seed),  # raw uint32[2] key: checkpoints as a plain array
    }


# ----------------------------------------------------------------------------- step functions


def loss_fn(params, graphdef, x, y):
    model = nnx.merge(graphdef, stacked.view(params))
    return cross_entropy(model(x), y, model.config.cross_entropy)


def per_device(f, mesh):
    """``f(params, *batches)`` on each device's share of the batches (their axis 1, the batch axis of
    ``[accum or n, batch, seq]``), the params replicated, its outputs averaged over devices; ``f``
    itself when ``mesh`` is None or one device (the same computation as without it).

    The model's Pallas kernels have no partitioning rule: under plain jit XLA would run each on the
    whole batch, gathered, on every device. Inside ``shard_map`` each device runs them on its own
    rows, as data parallel means; the average over devices is one more FP32 rounding order."""
    if mesh is None or mesh.size == 1:
        return f
    batch = P(None, "data")

    def local(params, *batches):
        return jax.lax.pmean(f(params, *batches), "data")

    return lambda params, *batches: jax.shard_map(
        local, mesh=mesh, in_specs=(P(),) + (batch,) * len(batches), out_specs=P(),
        check_vma=False)(params, *batches)  # the scan's zero carries are not typed per device


def train_step(state: dict, batch, *, graphdef, tx, schedule, mesh=None):
    """One optimizer step. batch = (x, y), int32 [accum, batch, seq]; returns (state, metrics).
    ``mesh``: the 1-D "data" mesh the batch is sharded over (``per_device``)."""
    x, y = batch
    params = state["params"]
    grad_fn = jax.value_and_grad(loss_fn)

    def grads_and_loss(params, x, y):
        def micro(carry, xy):
            g_sum, l_sum = carry
            loss, grads = grad_fn(params, graphdef, *xy)
            return (jax.tree.map(jnp.add, g_sum, grads), l_sum + loss), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        (grads, loss), _ = jax.lax.scan(micro, (zeros, jnp.zeros((), jnp.float32)), (x, y))
        n = x.shape[0]
        if n > 1:
            grads = jax.tree.map(lambda g: g / n, grads)
            loss = loss / n
        return grads, loss

    # stacked params: the gradient of the leaves as the model sees them, accumulated as on the
    # tree, then stacked for the optimizer (train/stacked.py)
    grads, loss = per_device(grads_and_loss, mesh)(stacked.view(params), x, y)
    grad_norm = optax.tree.norm(grads)
    if isinstance(params, stacked.Stacked):
        grads = stacked.stack(grads, params.layout)
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    new_state = {
        "step": state["step"] + 1,
        "params": optax.apply_updates(params, updates),
        "opt_state": opt_state,
        "rng": jax.random.split(state["rng"])[0],
    }
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state["step"])}
    return new_state, metrics


def eval_step(params, batches, *, graphdef, mesh=None):
    """Mean loss over batches = (x, y), int32 [n, batch, seq] (``mesh`` as ``train_step``'s)."""
    def mean_loss(params, x, y):
        return jnp.mean(jax.lax.map(lambda xy: loss_fn(params, graphdef, *xy), (x, y)))

    return per_device(mean_loss, mesh)(params, *batches)


# ----------------------------------------------------------------------------- helpers


def grad_accum_steps(cfg: TrainConfig, n_devices: int) -> int:
    d = cfg.data
    if d.tokens_per_step is None:
        return d.grad_accum
    seq = d.seq_len or cfg.model.block_size
    per = d.batch_size * n_devices * seq
    if d.tokens_per_step % per:
        raise ValueError(
            f"tokens_per_step={d.tokens_per_step} is not a multiple of batch_size*devices*seq_len={per}"
        )
    return d.tokens_per_step // per


def flops_per_token(mcfg: GPTConfig, seq_len: int) -> float:
    """nanoGPT's estimate: 6N (N without position embeddings) + 12*L*d*T for attention."""
    return 6 * mcfg.num_params(non_embedding=True) + 12 * mcfg.n_layer * mcfg.n_embd * seq_len


def device_peak_flops(device) -> float | None:
    if device.platform != "gpu":
        return None
    kind = getattr(device, "device_kind", "")
    for name, peak in sorted(PEAK_BF16_FLOPS.items(), key=lambda kv: -len(kv[0])):
        if name in kind:
            return peak
    return None


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    return x


def _default_sampler(tokens, batch_size, seq_len, seed, record_to=None):
    from train.data import BatchSampler

    return BatchSampler(tokens, batch_size, seq_len, seed, record_to=record_to)


def _load_tokens(path):
    from train.data import load_tokens

    return load_tokens(path)


def divergence_reason(loss: float, grad_norm: float, running_min: float, factor: float) -> str | None:
    """Why a step with this loss and gradient norm ends the run (None: it does not).

    Non-finite loss or gradient norm, or loss > factor x ``running_min`` (the minimum of all earlier
    losses; inf before the first) when factor > 0. No warmup exemption: a healthy run's loss stays
    far below 3x its running minimum from the first step on (a cross-entropy starts near ln(vocab)
    and falls), so the rule can act on the steps where a too-large learning rate first shows."""
    if not math.isfinite(loss):
        return f"non-finite loss {loss}"
    if not math.isfinite(grad_norm):
        return f"non-finite gradient norm {grad_norm} (loss {loss:.4f})"
    if factor and math.isfinite(running_min) and loss > factor * running_min:
        return f"loss {loss:.4f} > {factor:g} x running min {running_min:.4f} of the earlier steps"
    return None


def nonfinite_counts(state: dict) -> dict:
    """Number of non-finite values in the params and the optimizer state (jit it)."""

    def count(tree):
        leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
        return sum((jnp.sum(~jnp.isfinite(x), dtype=jnp.int32) for x in leaves), jnp.int32(0))

    return {"params": count(state["params"]), "opt_state": count(state["opt_state"])}


def _describe_nonfinite(counts: dict) -> str:
    names = {"params": "parameters", "opt_state": "optimizer state"}
    return ", ".join(f"{n} non-finite values in the {names[k]}" for k, n in counts.items() if n)


def _plan_resume(cfg: TrainConfig, store: CheckpointStore):
    """(start step, damaged [(step, problem)], effective cfg, notes) or None for a fresh run.
    Raises RunError / CheckpointError; reads the checkpoints, changes nothing."""
    steps = store.steps()
    if cfg.resume == "false":
        if steps:
            raise RunError(
                f"{store.dir} already holds checkpoints (steps {', '.join(map(str, steps))}): "
                f"resume=true continues that run; to start over, choose another run_dir or "
                f"delete {cfg.run_dir}")
        return None
    if not steps:
        if cfg.resume == "auto":
            print(f"resume=auto: no checkpoint in {store.dir}; starting a new run")
            return None
        raise RunError(f"resume=true, but {store.dir} holds no checkpoint to resume; "
                       f"resume=auto starts a new run when there is none")
    start, damaged = store.select(cfg.resume_step)
    stored = config_lib.from_dict(store.manifest(start)["config"])
    try:
        eff, notes = config_lib.resume_config(stored, cfg)
    except ValueError as e:
        raise RunError(f"checkpoint {start}: {e}") from None
    if start > eff.max_steps:
        raise RunError(f"checkpoint {start} is past max_steps={eff.max_steps}; raise max_steps")
    return start, damaged, eff, notes


# ----------------------------------------------------------------------------- the loop


def train(
    cfg: TrainConfig,
    *,
    tokens=None,
    sampler_fn: Callable | None = None,
    probes: Sequence[Probe] = (),
    stop_after: int | None = None,
) -> dict:
    """Train and return the summary dict (also written to <run_dir>/summary.json).

    tokens: an object with 1-D ``.train`` / ``.val`` token arrays (default: load cfg.data.path).
    sampler_fn(tokens_1d, batch_size, seq_len, seed, record_to) -> sampler with ``.next()`` and
      ``state_dict()/load_state_dict()`` (default: train.data.BatchSampler). It is asked for
      batch_size = micro-batch * devices * accumulation windows per optimizer step.
    probes: callables ``probe(step, model, (x, y)) -> dict`` called every cfg.probe_every steps on the
      model after that step's update and the step's first micro-batch; their outputs are merged into
      the step's metrics record. The model's arrays are donated by the next step: copy what you keep.
    stop_after: stop (as if interrupted) after this many steps, without evaluating at the end.

    Raises ValueError (bad config), RunError (a resume that is impossible or would change the
    trajectory, or a new run over existing checkpoints) or CheckpointError (the checkpoint asked for
    is damaged, or none is intact) before anything in run_dir is written.
    """
    config_lib.validate(cfg)
    run_dir = Path(cfg.run_dir)
    devices = jax.devices()
    n_dev = len(devices)
    try:
        accum = grad_accum_steps(cfg, n_dev)
    except ValueError as e:  # tokens_per_step that this many devices cannot split
        raise RunError(str(e)) from None

    store = CheckpointStore(run_dir, cfg.keep_checkpoints)
    plan = _plan_resume(cfg, store)
    start, damaged = 0, []
    if plan is not None:
        start, damaged, cfg, notes = plan
        for note in notes:
            print(note)
        if start == cfg.max_steps:
            print(f"checkpoint {start} is already at max_steps={cfg.max_steps}: nothing to train "
                  f"(raise max_steps to continue)")
            done = run_dir / "summary.json"
            return json.loads(done.read_text()) if done.exists() else {
                "steps": start, "diverged_at": None, "reason": None, "resumed_from": start}
    if tokens is None:
        tokens = _load_tokens(cfg.data.path)  # a missing corpus, too, stops before run_dir is made
    if plan is None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(config_lib.to_json(cfg))
    code = code_version() if cfg.checkpoint_every else None

    mesh = Mesh(np.array(devices), ("data",))
    replicated = NamedSharding(mesh, P())
    data_sharding = NamedSharding(mesh, P(None, "data"))

    seq_len = cfg.data.seq_len or cfg.model.block_size
    micro = cfg.data.batch_size * n_dev
    tokens_per_step = micro * accum * seq_len

    sampler_fn = sampler_fn or _default_sampler
    if cfg.data.replay:
        from train.data import ReplaySampler

        sampler = ReplaySampler(tokens.train, seq_len, cfg.data.replay)
        if sampler.batch_size != micro * accum:
            raise ValueError(
                f"{cfg.data.replay} has {sampler.batch_size} windows per step; this run "
                f"needs micro-batch x devices x accumulation = {micro * accum}"
            )
    else:
        record_to = str(run_dir / "data_order.bin") if cfg.data.record else None
        sampler = sampler_fn(tokens.train, micro * accum, seq_len, cfg.data.seed, record_to)

    model = make_model(cfg)
    graphdef, params = split_model(model)
    del model
    params = nudge_params(params, cfg.replicate)
    n_params = count_params(params)
    tx, schedule = make_optimizer(cfg)
    state = jax.device_put(init_state(cfg, params, tx), replicated)

    step_fn = jax.jit(
        functools.partial(train_step, graphdef=graphdef, tx=tx, schedule=schedule, mesh=mesh),
        donate_argnums=0,
        out_shardings=(replicated, replicated),
    )
    eval_fn = jax.jit(functools.partial(eval_step, graphdef=graphdef, mesh=mesh),
                      out_shardings=replicated)

    eval_data = None
    if cfg.eval_every and cfg.data.eval_batches and len(tokens.val) > seq_len + 1:
        from train.data import fixed_batch

        ex, ey = fixed_batch(tokens.val, micro * cfg.data.eval_batches, seq_len, seed=1234)
        shape = (cfg.data.eval_batches, micro, seq_len)
        eval_data = jax.device_put((ex.reshape(shape), ey.reshape(shape)), data_sharding)

    count_nonfinite = jax.jit(nonfinite_counts)

    # ---- resume: restore, check, and only then touch the run directory
    running_min = math.inf
    if plan is not None:
        state, meta = store.restore(start, state, replicated)
        bad = {k: int(v) for k, v in jax.device_get(count_nonfinite(state)).items()}
        if any(bad.values()):
            raise CheckpointError(f"checkpoint {start} in {store.dir} matches its checksums but "
                                  f"holds {_describe_nonfinite(bad)}; it cannot be resumed")
        sampler.load_state_dict(meta["sampler"])
        running_min = float(meta["running_min"])
        later = [s for s in store.steps() if s > start]
        aside = store.set_aside(later)
        if damaged:
            what = "; ".join(f"{s}: {p}" for s, p in damaged)
            print(f"damaged checkpoint{'s' * (len(damaged) > 1)} ({what}) moved to {aside}; "
                  f"resumed from step {start}, the newest intact one")
        elif later:
            print(f"resumed from step {start} as asked (resume_step); the later checkpoints "
                  f"{', '.join(map(str, later))} moved to {aside}")
        else:
            print(f"resumed from step {start} ({store.dir})")
        (run_dir / "config.json").write_text(config_lib.to_json(cfg))
    metrics_path = run_dir / "metrics.jsonl"
    if start and metrics_path.exists():  # drop records past the checkpoint
        kept = [
            l for l in metrics_path.read_text().splitlines() if l and json.loads(l)["step"] <= start
        ]
        metrics_path.write_text("".join(l + "\n" for l in kept))
    elif not start:
        metrics_path.write_text("")

    peak = device_peak_flops(devices[0])
    fpt = flops_per_token(cfg.model, seq_len)
    last_step = cfg.max_steps if stop_after is None else min(cfg.max_steps, start + stop_after)

    from tqdm.auto import tqdm

    bar = tqdm(total=cfg.max_steps, initial=start, disable=not cfg.progress, dynamic_ncols=True)
    status = {"diverged_at": None, "reason": None, "last": None, "last_val": None}
    times = {"ref": time.perf_counter(), "steps": [], "t0": time.perf_counter()}

    def record(step: int, m, extra: dict | None = None, done_at: float | None = None):
        """Fetch a step's metrics (blocks until it is done), log them, check for divergence."""
        nonlocal running_min
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        now = time.perf_counter() if done_at is None else done_at
        dt = now - times["ref"]
        times["ref"] = now
        if step > start + 1:  # the first step of a process includes compilation
            times["steps"].append(dt)
        rec = {
            "step": step,
            **m,
            "tokens_per_s": tokens_per_step / dt,
            "step_time_s": dt,
            "mfu": (fpt * tokens_per_step / dt / (peak * n_dev)) if peak else None,
        }
        if extra:
            rec.update(extra)
        loss = m["loss"]
        reason = divergence_reason(loss, m["grad_norm"], running_min, cfg.divergence_factor)
        if reason is not None:
            status.update(diverged_at=step, reason=reason)
        running_min = min(running_min, loss) if math.isfinite(loss) else running_min
        status["last"] = loss
        with metrics_path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        bar.update(step - bar.n)
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        return rec

    pending = None
    step = start
    # the loop's last step moves up when a signal asks the run to stop (_StopOnSignal)
    with _StopOnSignal() as stop:
        for step in range(start + 1, last_step + 1):
            x, y = sampler.next()
            x = np.asarray(x, np.int32).reshape(accum, micro, seq_len)
            y = np.asarray(y, np.int32).reshape(accum, micro, seq_len)
            batch = jax.device_put((x, y), data_sharding)
            state, m = step_fn(state, batch)
            if stop.signal is not None and step < last_step:
                last_step = step  # asked to stop: this step is recorded and checkpointed as the last
            if pending is not None:
                record(*pending)
                pending = None
                if status["diverged_at"] is not None:
                    break
            do_eval = eval_data is not None and (
                step % cfg.eval_every == 0 or (step == cfg.max_steps and stop_after is None)
            )
            do_probe = bool(probes) and cfg.probe_every and step % cfg.probe_every == 0
            do_ckpt = bool(cfg.checkpoint_every) and (
                step % cfg.checkpoint_every == 0 or step == last_step
            )
            if not (do_eval or do_probe or do_ckpt or step == last_step):
                pending = (step, m)
                continue
            jax.block_until_ready(m)
            done_at = time.perf_counter()  # before eval/probe work, which is not step time
            extra = {}
            if do_eval:
                extra["val_loss"] = float(eval_fn(state["params"], eval_data))
                status["last_val"] = extra["val_loss"]
            if do_probe:
                probe_model = nnx.merge(graphdef, stacked.view(state["params"]))
                for probe in probes:
                    extra.update(probe(step, probe_model, (x[0], y[0])) or {})
            record(step, m, extra, done_at)
            if status["diverged_at"] is not None:
                break
            if do_ckpt:
                bad = {k: int(v) for k, v in jax.device_get(count_nonfinite(state)).items()}
                if any(bad.values()):  # finite loss and gradient norm, yet not a state to keep
                    status.update(diverged_at=step, reason=_describe_nonfinite(bad))
                    break
                store.save(
                    step,
                    state,
                    _jsonable({"step": step, "sampler": sampler.state_dict(), "running_min": running_min}),
                    config=config_lib.to_dict(cfg),
                    code=code,
                )
            times["ref"] = time.perf_counter()  # eval/probe/checkpoint time is not step time
            if step >= last_step:  # a signal moved the last step up
                break
    if pending is not None:
        record(*pending)
    bar.close()

    last_good = (store.steps() or [None])[-1]
    if status["diverged_at"] is not None:
        print(f"stopping: diverged at step {status['diverged_at']}: {status['reason']}; nothing "
              f"saved from it on; last good checkpoint: {last_good}")
    steps_t = times["steps"]
    summary = {
        "steps": status["diverged_at"] or step,
        "final_loss": status["last"],
        "final_val_loss": status["last_val"],
        "diverged_at": status["diverged_at"],
        "reason": status["reason"],
        "last_good_checkpoint": last_good if status["diverged_at"] is not None else None,
        "time_s": time.perf_counter() - times["t0"],
        "tokens_per_s": (tokens_per_step * len(steps_t) / sum(steps_t)) if steps_t else None,
        "tokens_per_step": tokens_per_step,
        "grad_accum": accum,
        "n_devices": n_dev,
        "n_params": n_params,
        "resumed_from": start or None,
        "stopped_by": stop.signal,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    store.close()
    return summary


# A run's metrics as written, and as kept in results/: xz-compressed (about a quarter smaller than
# gzip, which older copies may still use).
METRICS_FILES = ("metrics.jsonl", "metrics.jsonl.xz", "metrics.jsonl.gz")


def has_metrics(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds a metrics file ``read_metrics`` can read (plain or compressed)."""
    return any((Path(run_dir) / f).exists() for f in METRICS_FILES)


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of ``run_dir/metrics.jsonl``, or of its compressed copy kept in results/."""
    import gzip
    import lzma

    for name in METRICS_FILES:
        path = Path(run_dir) / name
        if path.exists():
            raw = path.read_bytes()
            text = (lzma.decompress(raw) if name.endswith(".xz") else
                    gzip.decompress(raw) if name.endswith(".gz") else raw).decode()
            return [json.loads(l) for l in text.splitlines() if l.strip()]
    raise FileNotFoundError(f"no metrics in {run_dir}: none of {', '.join(METRICS_FILES)}")


def pack_metrics(run_dir: str | Path, dest_dir: str | Path) -> Path:
    """Copy ``run_dir/metrics.jsonl`` to ``dest_dir/metrics.jsonl.xz``, the form results/ keeps."""
    import lzma

    dest = Path(dest_dir) / "metrics.jsonl.xz"
    dest.write_bytes(lzma.compress((Path(run_dir) / "metrics.jsonl").read_bytes(), preset=9))
    return dest


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """The config of a command line. With resume=true/auto and no explicit --preset, the overrides
    apply to the run's stored ``<run_dir>/config.json`` (when there is one) instead of a preset, so
    ``run_dir=R resume=true max_steps=N`` continues run R as it was configured."""
    ap = argparse.ArgumentParser(
        prog="python -m train.gpt2",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="overrides: dotted key=value, e.g. model.n_layer=2 "
        "attention.kind=flash attention.stable=true optim.lr=3e-4; "
        "resume=true|auto continues <run_dir> (docs/TRAINING.md); "
        "exit status 0 done, 2 refused, 3 diverged, 4 stopped by a signal",
    )
    ap.add_argument("--preset", default=None, choices=sorted(config_lib.PRESETS),
                    help="default tiny-cpu; with resume and no --preset: the run's own config.json")
    ap.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    args = ap.parse_args(argv)
    try:
        cfg = config_lib.apply_overrides(
            config_lib.get_preset(args.preset or "tiny-cpu"), args.overrides
        )
        stored = Path(cfg.run_dir) / "config.json"
        if cfg.resume != "false" and args.preset is None and stored.exists():
            base = config_lib.from_dict(json.loads(stored.read_text()))
            # how the run was last started is not part of it: resume_step must not stick
            base = dataclasses.replace(base, resume="false", resume_step=None)
            cfg = config_lib.apply_overrides(base, args.overrides)
    except ValueError as e:
        ap.error(str(e))
    if args.print_config:
        print(config_lib.to_json(cfg))
        sys.exit(0)
    return cfg


def run_cli(cfg: TrainConfig, probes: Sequence[Probe] = ()) -> dict:
    """train() for a command line: a refusal is one line on stderr and exit status 2, a divergence
    exit status 3 (after the summary is printed)."""
    try:
        summary = train(cfg, probes=probes)
    except (RunError, CheckpointError) as e:
        print(f"refused: {e}", file=sys.stderr)
        sys.exit(EXIT_REFUSED)
    print(json.dumps(summary, indent=2))
    if summary.get("diverged_at") is not None:
        print(f"diverged at step {summary['diverged_at']}: {summary['reason']} (last good "
              f"checkpoint: {summary.get('last_good_checkpoint')})", file=sys.stderr)
        sys.exit(EXIT_DIVERGED)
    if summary.get("stopped_by") is not None:
        print(f"stopped by {summary['stopped_by']} after step {summary['steps']}; resume=true "
              "continues it", file=sys.stderr)
        sys.exit(EXIT_STOPPED)
    return summary


def main(argv: Sequence[str] | None = None) -> None:
    cfg = parse_args(argv)
    from train.probes import default_probes  # probe_every > 0 turns the causal-chain probe on

    run_cli(cfg, probes=default_probes(cfg))


if __name__ == "__main__":
    main()
