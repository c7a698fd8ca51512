"""Training configuration: dataclasses, named presets and ``key=value`` overrides.

    cfg = get_preset("tiny-cpu")
    cfg = apply_overrides(cfg, ["model.n_layer=2", "attention.stable=true", "optim.lr=3e-4"])

Keys are dotted paths into ``TrainConfig``; ``attention.*`` is short for ``model.attention.*``.
Values are parsed by the field's type: int, float, bool (true/false/1/0/yes/no), str, ``none`` for
optional fields, and Python literals for tuples (``model.attention_overrides='((1, "flash"),)'``,
where a spec may be a kind name or a dict of AttentionSpec fields).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import types
import typing
from typing import Any

from models.gpt2 import AttentionSpec, GPTConfig


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
    keep_checkpoints: int = 2
    resume: bool = False  # restore the latest checkpoint in <run_dir>/checkpoints
    probe_every: int = 0  # call the probes every N steps (0: never)
    divergence_factor: float = 3.0  # stop if loss > factor * running min after warmup; 0 disables
    progress: bool = True  # tqdm bar


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
    # MEASURED.md: GPT-2 small, 32 x 1024 per step, lr 1e-3, 500 warmup, cosine over 600k steps.
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
    # PAPER.md §5: 524,288 tokens/step (32 x 1024 x 4 accumulation x 4 GPUs), warmup 2000 to 1e-3,
    # cosine to 1e-5. Accumulation = 524288 / (32 * 1024 * n_devices), 16 on one device.
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
        raise ValueError(
            f"unknown config key {full_key!r}: {type(obj).__name__} has fields {names}"
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
    return cfg


# ----------------------------------------------------------------------------- JSON


def to_dict(cfg: Any) -> Any:
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (tuple, list)):
        return [to_dict(x) for x in cfg]
    return cfg


def from_dict(d: dict) -> TrainConfig:
    m = dict(d["model"])
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
