"""Training configuration: dataclasses, named presets and ``key=value`` overrides.

    cfg = get_preset("tiny-cpu")
    cfg = apply_overrides(cfg, ["model.n_layer=2", "attention.stable=true", "optim.lr=3e-4"])

Keys are dotted paths into ``TrainConfig``; ``attention.*`` is short for ``model.attention.*``.
Values are parsed by the field's type: int, float, bool (true/false/1/0/yes/no), str, ``none`` for
optional fields, and Python literals for tuples (``model.attention_overrides='((1, "flash"),)'``,
where a spec may be a kind name or a dict of AttentionSpec fields).

Values are checked as they are set (each config class's ``__post_init__``: positive sizes, finite
learning rates, known names) and the whole config once more at the end (``validate``: attention
kinds, policies, deltas and impls, and the checks that involve two fields), so a config that cannot
train is refused before a run directory exists. Unknown names come with a "did you mean".

``resume_config`` decides what a resumed run may change: ``RESUME_SAFE`` keys only.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import json
import math
import types
import typing
from typing import Any

from models.gpt2 import AttentionSpec, GPTConfig, check_attention_spec, choice_error


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    name: str = "adamw"  # "adamw" or "muon" (Muon on hidden 2-D matrices, AdamW elsewhere)
    lr: float = 1e-3  # peak lr (AdamW, and Muon's AdamW part)
    min_lr: float = 1e-5  # cosine end value
    warmup_steps: int = 2000  # linear warmup, nanoGPT style: lr*(step+1)/(warmup+1)
    decay_steps: int | None = None  # step at which the cosine reaches min_lr; None: max_steps
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip: float | None = 1.0  # global-norm clip; none/0 disables
    muon_lr: float | None = None  # Muon's lr for hidden matrices; None: 0.02 * lr / 1e-3
    muon_beta: float = 0.95
    # parameters and Adam moments held as one array per shape (train/stacked.py): 22 arrays a
    # GPT-2 small step instead of 301; the same formulas, moments within a rounding of the tree's
    stack_params: bool = False

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise choice_error("name", self.name, OPTIMIZERS)
        if not isinstance(self.stack_params, bool):
            raise ValueError(f"stack_params must be true or false, got {self.stack_params!r}")
        if self.stack_params and self.name != "adamw":
            raise ValueError(f"stack_params needs name=adamw: {self.name} updates each matrix as a "
                             f"whole, and a stack of matrices is not one")
        _positive_float("lr", self.lr)
        _nonneg_float("min_lr", self.min_lr)
        _nonneg_int("warmup_steps", self.warmup_steps)
        if self.decay_steps is not None:
            _positive_int("decay_steps", self.decay_steps)
        for name in ("b1", "b2", "muon_beta"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 <= v < 1):
                raise ValueError(f"{name} must be in [0, 1), got {v!r}")
        _positive_float("eps", self.eps)
        _nonneg_float("weight_decay", self.weight_decay)
        if self.clip is not None:
            _nonneg_float("clip", self.clip)  # 0 disables, like none
        if self.muon_lr is not None:
            _positive_float("muon_lr", self.muon_lr)


OPTIMIZERS = ("adamw", "muon")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive_int(name, v):
    if not (_is_int(v) and v > 0):
        raise ValueError(f"{name} must be an integer > 0, got {v!r}")


def _nonneg_int(name, v):
    if not (_is_int(v) and v >= 0):
        raise ValueError(f"{name} must be an integer >= 0, got {v!r}")


def _positive_float(name, v):
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {v!r}")


def _nonneg_float(name, v):
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    path: str = "data/full"  # a token directory or .npz (train.data.load_tokens)
    batch_size: int = 8  # micro-batch per device
    seq_len: int | None = None  # None: model.block_size
    grad_accum: int = 1  # micro-batches per optimizer step (ignored if tokens_per_step set)
    tokens_per_step: int | None = (
        None  # global tokens per optimizer step; accumulation follows from it
    )
    seed: int = 0  # data order seed
    replay: str | None = None  # a recorded order to replay (train.data.ReplaySampler)
    record: bool = False  # record the data order to <run_dir>/order.* (train.data)
    eval_batches: int = 4  # micro-batches of val windows per eval (fixed, seed 1234)

    def __post_init__(self):
        if not self.path:
            raise ValueError("path must name a token directory or .npz")
        _positive_int("batch_size", self.batch_size)
        if self.seq_len is not None:
            _positive_int("seq_len", self.seq_len)
        _positive_int("grad_accum", self.grad_accum)
        if self.tokens_per_step is not None:
            _positive_int("tokens_per_step", self.tokens_per_step)
        _nonneg_int("seed", self.seed)
        _nonneg_int("eval_batches", self.eval_batches)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: GPTConfig = GPTConfig()
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    run_dir: str = "runs/default"
    max_steps: int = 1000
    seed: int = 0  # parameter init and the training RNG
    # > 0: another execution of the same run — the initial parameters nudged by one ulp up or down
    # (drawn from this number), the size of the GPU backward's run-to-run reduction noise
    # (docs/REPRODUCTION.md); with deterministic GPU ops each replicate is itself repeatable.
    replicate: int = 0
    eval_every: int = 250  # 0 disables; an eval also runs at the last step
    checkpoint_every: int = 0  # 0 disables; a checkpoint is also written at the end when enabled
    keep_checkpoints: int = 2  # rotation never deletes the newest complete checkpoint
    # "false": a new run (refused if run_dir holds checkpoints); "true": continue from the newest
    # intact checkpoint (refused if there is none); "auto": continue if there is one, else start fresh
    resume: str = "false"
    resume_step: int | None = None  # with resume=true: this checkpoint exactly, or stop
    probe_every: int = 0  # call the probes every N steps (0: never)
    # stop when loss > factor * the running min of all earlier losses (from the second step on,
    # warmup included) or loss / gradient norm / saved state is non-finite; 0 disables the ratio
    divergence_factor: float = 3.0
    progress: bool = True  # tqdm bar

    def __post_init__(self):
        resume = self.resume
        if isinstance(resume, bool):
            resume = "true" if resume else "false"
        low = str(resume).strip().lower()
        low = "true" if low in _TRUE else "false" if low in _FALSE else low
        if low not in RESUME_MODES:
            raise choice_error("resume", resume, RESUME_MODES)
        object.__setattr__(self, "resume", low)
        if self.resume_step is not None:
            _positive_int("resume_step", self.resume_step)
        if not self.run_dir:
            raise ValueError("run_dir must not be empty")
        if not (_is_int(self.max_steps) and self.max_steps >= 1):
            raise ValueError(f"max_steps must be an integer >= 1, got {self.max_steps!r}: "
                             f"a run of zero steps would train nothing")
        for name in ("seed", "replicate", "eval_every", "checkpoint_every", "probe_every"):
            _nonneg_int(name, getattr(self, name))
        _positive_int("keep_checkpoints", self.keep_checkpoints)
        f = self.divergence_factor
        if not (isinstance(f, (int, float)) and math.isfinite(f) and (f == 0 or f > 1)):
            raise ValueError(f"divergence_factor must be 0 (ratio rule off) or a finite number > 1, "
                             f"got {f!r}")


RESUME_MODES = ("false", "true", "auto")


def _tiny_cpu() -> TrainConfig:
    return TrainConfig(
        model=GPTConfig(vocab_size=50304, block_size=128, n_layer=4, n_head=4, n_embd=128),
        optim=OptimConfig(lr=1e-3, warmup_steps=50, min_lr=1e-4),
        data=DataConfig(path="data/small", batch_size=8),
        run_dir="runs/tiny-cpu",
        max_steps=300,
        eval_every=100,
    )


def _small_gpu() -> TrainConfig:
    # docs/REPRODUCTION.md's setting: GPT-2 small, 32 x 1024 per step, lr 1e-3, 500 warmup,
    # cosine over 600k steps.
    return TrainConfig(
        model=GPTConfig(),
        optim=OptimConfig(lr=1e-3, warmup_steps=500, decay_steps=600_000, min_lr=1e-5),
        data=DataConfig(batch_size=32, grad_accum=1),
        run_dir="runs/small-gpu",
        max_steps=10_000,
        eval_every=250,
        checkpoint_every=1000,
    )


def _gpt2_small_paper() -> TrainConfig:
    # Qiu & Yao's setting: 524,288 tokens/step (32 x 1024 x 4 accumulation x 4 GPUs), warmup
    # 2000 to 1e-3, cosine to 1e-5. Accumulation = 524288 / (32 * 1024 * n_devices), 16 on one
    # device.
    return TrainConfig(
        model=GPTConfig(),
        optim=OptimConfig(lr=1e-3, warmup_steps=2000, min_lr=1e-5),
        data=DataConfig(batch_size=32, tokens_per_step=524_288),
        run_dir="runs/gpt2-small-paper",
        max_steps=20_000,
        eval_every=250,
        checkpoint_every=500,
    )


PRESETS = {
    "tiny-cpu": _tiny_cpu,
    "small-gpu": _small_gpu,
    "gpt2-small-paper": _gpt2_small_paper,
}


def get_preset(name: str) -> TrainConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]()


# ----------------------------------------------------------------------------- overrides

ALIASES = {"attention": "model.attention"}

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _parse_value(raw: str, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and raw.strip().lower() in ("none", "null"):
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _parse_value(raw, inner[0], key)
        raise ValueError(f"{key}: unsupported type {tp}")
    try:
        if tp is bool:
            low = raw.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError(f"not a bool (use true/false): {raw!r}")
        if tp is int:
            return int(raw)
        if tp is float:
            return float(raw)
        if tp is str:
            return raw
        if origin is tuple or tp is tuple:
            val = ast.literal_eval(raw)
            if isinstance(val, list):
                val = tuple(val)
            if not isinstance(val, tuple):
                raise ValueError(f"not a tuple literal: {raw!r}")
            return val
    except (ValueError, SyntaxError) as e:
        raise ValueError(f"bad value for {key}: {raw!r} ({e})") from None
    raise ValueError(f"{key}: unsupported type {tp}")


def _set_path(obj: Any, path: list[str], raw: str, full_key: str) -> Any:
    if not dataclasses.is_dataclass(obj):
        raise ValueError(f"unknown config key {full_key!r}: {type(obj).__name__} has no sub-fields")
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    name = path[0]
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown config key {full_key!r}{hint} ({type(obj).__name__} has fields {names})"
        )
    current = getattr(obj, name)
    if len(path) == 1:
        if dataclasses.is_dataclass(current):
            raise ValueError(
                f"{full_key!r} is a group; set one of its fields, e.g. {full_key}.{dataclasses.fields(current)[0].name}=..."
            )
        value = _parse_value(raw, hints[name], full_key)
    else:
        value = _set_path(current, path[1:], raw, full_key)
    try:
        return dataclasses.replace(obj, **{name: value})
    except (ValueError, TypeError) as e:
        raise ValueError(f"bad value for {full_key}: {raw!r} ({e})") from None


def apply_overrides(cfg: TrainConfig, overrides: list[str] | tuple[str, ...]) -> TrainConfig:
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override must be key=value, got {item!r}")
        key, raw = item.split("=", 1)
        key = key.strip()
        head = key.split(".")[0]
        if head in ALIASES:
            key = ALIASES[head] + key[len(head) :]
        cfg = _set_path(cfg, key.split("."), raw, key)
    validate(cfg)
    return cfg


def validate(cfg: TrainConfig) -> TrainConfig:
    """The checks a single field cannot make: attention specs (kinds, policies, deltas, impls) and
    relations between fields. Raises ValueError naming the key; returns cfg."""
    m = cfg.model
    try:
        check_attention_spec(m.attention)
    except ValueError as e:
        raise ValueError(f"bad value for attention.{e}") from None
    for i, ov in enumerate(m.attention_overrides):
        try:
            check_attention_spec(ov[-1])
        except ValueError as e:
            raise ValueError(f"bad value in model.attention_overrides[{i}]: {e}") from None
    seq = cfg.data.seq_len
    if seq is not None and seq > m.block_size:
        raise ValueError(f"data.seq_len={seq} exceeds model.block_size={m.block_size}")
    if cfg.resume_step is not None and cfg.resume != "true":
        raise ValueError(f"resume_step={cfg.resume_step} needs resume=true (resume={cfg.resume})")
    return cfg


# ----------------------------------------------------------------------------- resume policy

# Keys a resumed run may change: when and what it logs, evaluates, probes and saves, and how long it
# runs. Everything else shapes the training trajectory (model, data, optimizer, seeds) and stays as
# the checkpoint's config recorded it.
RESUME_SAFE = frozenset({
    "run_dir", "max_steps", "eval_every", "checkpoint_every", "keep_checkpoints", "resume",
    "resume_step", "probe_every", "divergence_factor", "progress", "data.eval_batches",
})


def _flat(d: dict, prefix: str = "") -> dict:
    """{dotted key: value}, model.attention.* written as the CLI's attention.* alias."""
    out = {}
    for k, v in d.items():
        key = prefix + k
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key.replace("model.attention.", "attention.", 1)] = v
    return out


def resume_config(stored: TrainConfig, requested: TrainConfig) -> tuple[TrainConfig, list[str]]:
    """The config a resumed run continues with, and notes to print.

    ``requested`` may differ from the checkpoint's ``stored`` config only in RESUME_SAFE keys;
    otherwise ValueError names every other key that differs, in one line. The cosine's end is part
    of the trajectory: where ``optim.decay_steps`` is none (the end is max_steps) and max_steps
    changes, decay_steps is pinned to the end the checkpoint was trained towards, so the coming
    steps keep that schedule instead of jumping onto a re-stretched cosine.
    """
    a, b = _flat(to_dict(stored)), _flat(to_dict(requested))
    bad = [k for k in sorted(a.keys() | b.keys())
           if a.get(k) != b.get(k) and k not in RESUME_SAFE and k != "optim.decay_steps"]
    stored_end = stored.optim.decay_steps or stored.max_steps
    asked_end = requested.optim.decay_steps
    if asked_end is not None and asked_end != stored_end:
        bad.append("optim.decay_steps")
        a["optim.decay_steps"] = stored_end
    if bad:
        diffs = ", ".join(f"{k} ({a.get(k)!r} -> {b.get(k)!r})" for k in bad)
        raise ValueError(f"resume cannot change {diffs}: the checkpoint was trained with the "
                         f"former; resume without them, or start a new run_dir")
    notes = []
    if asked_end is None and requested.max_steps != stored_end:
        requested = dataclasses.replace(
            requested, optim=dataclasses.replace(requested.optim, decay_steps=stored_end))
        notes.append(f"max_steps={requested.max_steps}: optim.decay_steps pinned to {stored_end}, "
                     f"where the checkpoint's cosine schedule ends")
    return requested, notes


# ----------------------------------------------------------------------------- JSON


def to_dict(cfg: Any) -> Any:
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (tuple, list)):
        return [to_dict(x) for x in cfg]
    return cfg


# model options that were removed, with the one value that computes what this version does: a stored
# config holding that value still loads; any other value names a computation this version cannot do
RETIRED_MODEL_OPTIONS = {"fused_qkv": False}


def from_dict(d: dict) -> TrainConfig:
    m = dict(d["model"])
    for name, kept in RETIRED_MODEL_OPTIONS.items():
        if name in m and m.pop(name) != kept:
            raise ValueError(f"model.{name} was removed (only {name}={kept!r} is computed now); "
                             "this config needs the version of the code that wrote it")
    m["attention"] = AttentionSpec(**m["attention"])
    m["attention_overrides"] = tuple(
        (ov[0], AttentionSpec(**ov[-1]))
        if len(ov) == 2
        else (ov[0], tuple(ov[1]), AttentionSpec(**ov[2]))
        for ov in m.get("attention_overrides", ())
    )
    rest = {k: v for k, v in d.items() if k not in ("model", "optim", "data")}
    return TrainConfig(
        model=GPTConfig(**m), optim=OptimConfig(**d["optim"]), data=DataConfig(**d["data"]), **rest
    )


def to_json(cfg: TrainConfig) -> str:
    return json.dumps(to_dict(cfg), indent=2)
