"""The one registry of experiment arms: name → training-config overrides.

Every runner takes arms by these names and the preset as its own argument (``--preset``): training
(``experiments.reproduce run``, ``bench.train_step``, the demo, the GPU shell scripts) applies the
overrides; kernel-level experiments (``experiments.wq_chain``, ``experiments.real_chain``) take the
arm's attention arguments (``attention_kwargs``); the PyTorch twin takes the ``torch-*`` arms.

    python -m experiments.arms            # list them
    python -m experiments.arms fa2-stable # one arm's overrides, one a line (for shell scripts)
    python -m experiments.arms twin-args model.n_layer=6   # the PyTorch twin's arguments for overrides
"""

from __future__ import annotations

ARMS: dict[str, tuple[str, ...]] = {
    # attention computed outside flash: softmax in FP32 over materialised scores, P·V in BF16
    "standard": ("attention.kind=standard",),
    # jax.nn.dot_product_attention's cuDNN kernel (GPU only)
    "cudnn": ("attention.kind=cudnn",),
    # flash attention in production FA2 numerics, and the fixes
    "fa2": ("attention.kind=flash", "attention.policy=fa2"),
    "fa2-stable": ("attention.kind=flash", "attention.policy=fa2", "attention.stable=true"),
    "fa2-stable-b7": ("attention.kind=flash", "attention.policy=fa2", "attention.stable=true",
                      "attention.beta=7.0"),
    "fa2-dpp": ("attention.kind=flash", "attention.policy=fa2", "attention.delta=dpp"),
    "fa2-ohp": ("attention.kind=flash", "attention.policy=fa2", "attention.delta=o_hp"),
    # the authors' BF16-accumulating kernel, and ablations of it
    "paper": ("attention.kind=flash", "attention.policy=paper"),
    "paper-stable": ("attention.kind=flash", "attention.policy=paper", "attention.stable=true"),
    "paper-dpp": ("attention.kind=flash", "attention.policy=paper", "attention.delta=dpp"),
    "paper-fp32acc": ("attention.kind=flash", "attention.policy=paper_fp32acc"),
    "paper-fp32acc-stable": ("attention.kind=flash", "attention.policy=paper_fp32acc",
                             "attention.stable=true"),
    # FP32-accurate attention: IEEE FP32 dots (slow on GPUs) or BF16 pieces on the tensor cores
    "fp32-attn": ("attention.kind=flash", "attention.policy=fp32"),
    "fp32x6-attn": ("attention.kind=flash", "attention.policy=fp32_bf16x6"),
    # the FP32 control of the CPU demo: FP32 model and FP32 attention
    "fp32-control": ("attention.kind=flash", "attention.policy=fp32", "model.dtype=float32"),
    # flash in layer 2 only (0-based layer 1), or everywhere but there
    "flash-l2-only": ("attention.kind=standard", "model.attention_overrides=((1, 'flash'),)"),
    "standard-l2-only": ("attention.kind=flash", "model.attention_overrides=((1, 'standard'),)"),
    # Muon on the hidden matrices instead of AdamW
    "fa2-muon": ("attention.kind=flash", "optim.name=muon"),
    "standard-muon": ("attention.kind=standard", "optim.name=muon"),
}

# The PyTorch twin (experiments/gpu/torch_train.py): arm → its --attn
# (flash-o / flash-dpp: FA2's forward kernel, its backward written out in PyTorch with δ from O or
# δ = rowsum(dP∘P): experiments.torch_parity.FlashWithDelta)
TORCH_ARMS = {"torch-flash": "flash", "torch-standard": "standard", "torch-flash-o": "flash-o",
              "torch-flash-dpp": "flash-dpp"}

_ATTENTION_KEYS = {"policy": str, "stable": lambda s: s == "true", "beta": float, "delta": str}


def overrides(name: str) -> list[str]:
    """The arm's config overrides (``train.config.apply_overrides`` syntax)."""
    if name not in ARMS:
        import difflib

        near = difflib.get_close_matches(name, list(ARMS), n=1)
        raise KeyError(f"unknown arm {name!r}" + (f"; did you mean {near[0]!r}?" if near else "")
                       + f" (known: {', '.join(ARMS)})")
    return list(ARMS[name])


def attention_kwargs(name: str) -> dict:
    """``jax_flash.attention`` keyword arguments of a flash arm (policy, stable, beta, delta)."""
    items = dict(o.split("=", 1) for o in overrides(name))
    if items.get("attention.kind") != "flash" or "model.attention_overrides" in items:
        raise ValueError(f"arm {name!r} is not flash attention in every layer")
    kw = {"policy": "fa2"}
    for key, value in items.items():
        field = key.removeprefix("attention.")
        if field in _ATTENTION_KEYS:
            kw[field] = _ATTENTION_KEYS[field](value)
    return kw


_TWIN_MODEL_KEYS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")
_TWIN_FLAGS = {"optim.warmup_steps": "--warmup-steps", "data.batch_size": "--batch-size"}


def twin_args(config_overrides) -> list[str]:
    """The PyTorch twin's command-line arguments for a setting's config overrides (the model's
    sizes, warmup steps, micro-batch); an override the twin cannot follow raises ValueError, so a
    twin execution never runs another setting silently."""
    import json

    model, args = {}, []
    for item in config_overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"not a KEY=VALUE override: {item!r}")
        field = key.removeprefix("model.")
        if key.startswith("model.") and field in _TWIN_MODEL_KEYS:
            model[field] = int(value)
        elif key in _TWIN_FLAGS:
            args += [_TWIN_FLAGS[key], str(int(value))]
        else:
            raise ValueError(f"the PyTorch twin has no equivalent of {item!r} (it follows "
                             f"{', '.join(['model.' + k for k in _TWIN_MODEL_KEYS] + list(_TWIN_FLAGS))})")
    if model:
        args = ["--model", json.dumps(model, separators=(",", ":"))] + args
    return args


def main(argv=None):
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["twin-args"]:  # twin-args OVERRIDE...: the PyTorch twin's arguments, one a line
        try:
            print("\n".join(twin_args(argv[1:])))
        except ValueError as e:
            sys.exit(str(e))
        return
    if argv:
        try:
            print("\n".join(overrides(argv[0])))
        except KeyError as e:
            sys.exit(str(e))
        return
    for name, ovr in ARMS.items():
        print(f"{name:22s} {' '.join(ovr)}")
    for name, attn in TORCH_ARMS.items():
        print(f"{name:22s} PyTorch twin, --attn {attn}")


if __name__ == "__main__":
    main()
