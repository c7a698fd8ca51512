"""nanoGPT's own training step, timed: the worker ``bench.train_step --nanogpt DIR`` runs in a process
of its own (PyTorch only: this module imports no JAX, so no two allocators share a GPU).

    python -m bench.nanogpt_step SPEC.json      # written by bench.train_step; writes SPEC["result"]

``DIR/model.py`` is nanoGPT's file, fetched by ``make nanogpt`` into the ignored ``third_party/`` (never
committed). The step is the one nanoGPT's train.py runs: its ``GPT`` (bias=False, dropout 0) wrapped in
``torch.compile`` on CUDA; the forward and loss under bf16 autocast (the model's compute dtype; none on
a CPU, as nanoGPT); ``loss / accum`` backward per micro-batch; ``clip_grad_norm_``; the AdamW of its
``configure_optimizers`` (decay on ≥ 2-D tensors, fused on CUDA) with our optimizer's betas, eps,
weight decay and lr; ``zero_grad(set_to_none=True)``; the lr set on the host every step as its loop
does; TF32 allowed as it allows it. Sizes, batch and tokens come from the spec, i.e. from our preset.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

from bench.step_timing import synthetic_batches, time_steps


def load_nanogpt(directory: str):
    """nanoGPT's model.py from ``directory``, imported under a name of its own."""
    path = Path(directory) / "model.py"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: `make nanogpt` fetches nanoGPT's model.py there")
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, hashlib.sha256(path.read_bytes()).hexdigest()


def run(spec: dict) -> dict:
    import torch

    t_start = time.perf_counter()
    mod, sha = load_nanogpt(spec["nanogpt"])
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(spec["seed"])
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    m, o = spec["model"], spec["optim"]
    conf = mod.GPTConfig(block_size=m["block_size"], vocab_size=m["vocab_size"], n_layer=m["n_layer"],
                         n_head=m["n_head"], n_embd=m["n_embd"], dropout=0.0, bias=False)
    model = mod.GPT(conf).to(device)
    opt = model.configure_optimizers(weight_decay=o["weight_decay"], learning_rate=o["lr"],
                                     betas=(o["b1"], o["b2"]), device_type=device)
    for g in opt.param_groups:
        g["eps"] = o["eps"]
    compiled = spec["compile"] == "on" or (spec["compile"] == "auto" and cuda)
    fwd = torch.compile(model) if compiled else model
    amp = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(spec["dtype"])
    ctx = torch.amp.autocast(device_type=device, dtype=amp) if (cuda and amp) else contextlib.nullcontext()

    accum, micro, seq = spec["accum"], spec["micro_batch"], spec["seq_len"]
    toks = torch.from_numpy(synthetic_batches(spec["seed"], 2, accum, micro, seq, m["vocab_size"])).to(device)
    xs, ys = toks[..., :-1].contiguous(), toks[..., 1:].contiguous()
    count = [0]

    def step():
        i = count[0]
        count[0] += 1
        lr = o["lr"] * min(1.0, (i + 1) / (o["warmup_steps"] + 1))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = xs[i % 2], ys[i % 2]
        for a in range(accum):
            with ctx:
                _, loss = fwd(x[a], y[a])
                loss = loss / accum
            loss.backward()
        if o["clip"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o["clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    sync = (lambda h: torch.cuda.synchronize()) if cuda else (lambda h: None)
    timing = time_steps(step, sync, warmup=spec["warmup"], steps=spec["steps"])
    loss = float(step().detach()) * accum
    profiled = {}
    if spec.get("profile"):
        try:
            profiled = {"profile": _profile(step, sync, spec, torch)}
        except Exception as e:  # the timing stands without it
            profiled = {"profile": {"error": f"{type(e).__name__}: {e}"}}
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        **timing,
        "compile_s": timing["first_ms"] / 1e3 if compiled else None,
        "compiled": compiled,
        "loss_last": loss,
        "n_params_non_embedding": model.get_num_params(non_embedding=True),
        "tokens_per_step": accum * micro * seq,
        "n_devices": 1,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "platform": device,
        "nanogpt_model_sha256": sha,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "triton": triton_version, "cuda": torch.version.cuda, "numpy": np.__version__},
        **profiled,
        "wall_s": time.perf_counter() - t_start,
    }


def _profile(step, sync, spec: dict, torch) -> dict:
    """``spec["profile_steps"]`` steps under PyTorch's profiler: the trace (gzipped) and
    ``profile.md``, kernel time by op family as ``bench.train_step`` gives it for a JAX arm (judged
    by kernel name: ``lab.trace_split.torch_families``)."""
    import gzip
    import os

    from lab import trace_split

    pdir = Path(spec["profile"])
    pdir.mkdir(parents=True, exist_ok=True)
    n = spec["profile_steps"]
    # kernels only on a GPU (a small trace); a CPU run has only its ops to show
    acts = [torch.profiler.ProfilerActivity.CUDA if torch.cuda.is_available()
            else torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n):
            step()
        sync(None)
    raw = pdir / "trace.json"
    prof.export_chrome_trace(str(raw))
    events = json.loads(raw.read_text())["traceEvents"]
    packed = gzip.compress(raw.read_bytes())
    os.remove(raw)
    files = []
    if len(packed) <= trace_split.MAX_PROFILE_FILE:
        (pdir / "trace.json.gz").write_bytes(packed)
        files.append("trace.json.gz")
    res = trace_split.torch_families(events, steps=n)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    title = (f"Kernel time of one training step by op family: nanoGPT's step, micro-batch "
             f"{spec['micro_batch']}, {device}, torch {torch.__version__} (`python -m "
             f"bench.train_step … --profile DIR --profile-arms …,nanogpt`; kernels judged by name)")
    return trace_split.profile_record(pdir, res, title, files)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    Path(spec["result"]).write_text(json.dumps(run(spec), indent=1))


if __name__ == "__main__":
    main()
