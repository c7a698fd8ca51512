"""The reproduction's PyTorch twin: nanoGPT's training recipe in PyTorch, fed the JAX run's own
init, data order and probe batch.

    python -m experiments.gpu.torch_train --arm torch-flash --seed 1 --steps 4000 --out /tmp/runs
    python -m experiments.gpu.torch_train --arm torch-standard --seed 1 --steps 4000 --out /tmp/runs

Why: a PyTorch reference run of nanoGPT's model in the same setting (not in this repository) differs
from the JAX runs in more than the framework (its corpus build, document order, init draws and probe
windows are its own), so it cannot tell whether the framework or the kernels make a difference.
Training PyTorch on *our* init (``--init jax``: the JAX model of the same seed, copied tensor by
tensor), *our* batches (``train.data.BatchSampler`` with the same seed) and *our* probe windows
leaves the framework and the kernels as the only differences from ``experiments.reproduce run --arm
fa2|standard --seed S``.

Recipe (nanoGPT's): ``experiments.torch_parity.TorchGPT`` (its CPU parity with
models/gpt2.py is checked in docs/results/torch-parity-cpu.json), FP32 master weights, bf16
autocast, ``torch.compile`` on CUDA, fused AdamW (0.9, 0.95), eps 1e-8, wd 0, grad-norm clip 1,
nanoGPT's lr schedule with the small-gpu preset's values (1e-3, 500 warmup, cosine over 600 k
steps). Attention: ``flash`` = SDPA's FlashAttention-2 backend (CUDA only); ``standard`` =
nanoGPT's manual path (bf16 q·kᵀ, softmax in FP32 under autocast, P·V in bf16); ``flash-o`` and
``flash-dpp`` = FA2's forward kernel with its backward written out in PyTorch, δ from the stored O
(the kernel's) or δ = rowsum(dP∘P) (``experiments.torch_parity.FlashWithDelta``; off CUDA the
forward is computed in FP32). That backward runs eagerly, outside the compiled model, unless
``--compile-backward 1`` puts it through ``torch.compile`` too (opt-in, recorded in config.json).

Probe every ``--probe-every`` steps on the same 8 held-out windows as the JAX probe, written under
the JAX probe's metric names (train/probes.py) so ``experiments.reproduce table`` and
``experiments.plot_run`` read both: per layer max causal logit (S in FP32 from the model's bf16 q,
k), tie fraction (rows whose max is reached by ≥ 2 entries with bf16(exp(S − max)) == 1, and on
bf16-rounded S), per-head ‖W_Q‖₂ and ‖W_K‖₂ (exact SVD), and the probe loss. Output:
``OUT/torch-<attn>-s<seed>/{config.json, metrics.jsonl, summary.json}``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # JAX only builds the init here; the GPU is torch's

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from experiments.arms import TORCH_ARMS  # noqa: E402
from experiments.torch_parity import GPT2_SMALL, TorchGPT, flatten, load_into_torch, nanogpt_lr  # noqa: E402


def jax_init(mc: dict, seed: int) -> dict[str, np.ndarray]:
    """Our JAX model's init for ``seed`` (what experiments.reproduce trains), as flat numpy arrays."""
    from flax import nnx

    from models.gpt2 import GPT, GPTConfig
    from train.gpt2 import split_model

    _, params = split_model(GPT(GPTConfig(**mc), rngs=nnx.Rngs(seed)))
    return flatten(params)


@torch.no_grad()
def probe(model: TorchGPT, px: torch.Tensor, py: torch.Tensor, autocast) -> dict:
    """The JAX probe's core metrics (same names) on the probe batch, eager (not compiled)."""
    t0 = time.perf_counter()
    c = model.c
    d, n_head = c["n_embd"], c["n_head"]
    hd = d // n_head
    caps = []
    hooks = [blk.attn.c_attn.register_forward_hook(lambda m, i, o: caps.append(o))
             for blk in model.h]
    try:
        with autocast():
            loss = model(px, py, full=False)
    finally:
        for h in hooks:
            h.remove()
    b, t = px.shape
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=px.device))
    m = {"probe_loss": float(loss)}
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # S in full FP32
    try:
        for l, (qkv, blk) in enumerate(zip(caps, model.h)):
            q, k, _ = qkv.split(d, dim=2)  # the model's own (bf16) q, k
            q, k = (z.view(b, t, n_head, hd).transpose(1, 2).float() for z in (q, k))
            s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
            s = s.masked_fill(~causal, float("-inf"))  # [b, H, t, t]
            r_m = s.amax(dim=-1, keepdim=True)
            ties = ((torch.exp(s - r_m).to(torch.bfloat16) == 1).sum(-1) >= 2).float()  # [b, H, t]
            sb = s.to(torch.bfloat16)
            ties_b = ((sb == sb.amax(dim=-1, keepdim=True)).sum(-1) >= 2).float()
            w = blk.attn.c_attn.weight.float()  # [3d, d]: rows q | k | v, head-major
            norms = {name: torch.linalg.matrix_norm(w[j * d:(j + 1) * d].view(n_head, hd, d), ord=2)
                     for j, name in enumerate(("wq_norm", "wk_norm"))}
            tag = f"L{l}"
            ml = s.amax(dim=(0, 2, 3)).cpu().numpy()
            tf = ties.mean(dim=(0, 2)).cpu().numpy()
            for name, v in norms.items():
                v = v.cpu().numpy()
                for h in range(n_head):
                    m[f"{name}/{tag}/H{h}"] = float(v[h])
                m[f"{name}_max/{tag}"] = float(v.max())
            m[f"max_logit/{tag}"] = float(ml.max())
            m[f"tie_frac/{tag}"] = float(tf.mean())
            m[f"tie_frac_bf16s/{tag}"] = float(ties_b.mean())
            for h in range(n_head):
                m[f"max_logit/{tag}/H{h}"] = float(ml[h])
                m[f"tie_frac/{tag}/H{h}"] = float(tf[h])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    m["probe_time_s"] = time.perf_counter() - t0
    return m


def train(args) -> dict:
    from train import data as data_lib
    from train.config import get_preset

    cfg = get_preset("small-gpu")
    mc = dict(GPT2_SMALL, **json.loads(args.model or "{}"))
    oc = cfg.optim
    if args.warmup_steps is not None:
        oc = dataclasses.replace(oc, warmup_steps=args.warmup_steps)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.attn == "flash" and device != "cuda":
        raise SystemExit("--attn flash needs CUDA (SDPA's FlashAttention backend); use standard on "
                         "CPU (or flash-o / flash-dpp, whose forward is computed in FP32 there)")
    name = f"torch-{args.attn}-s{args.seed}"
    run_dir = Path(args.out) / name
    run_dir.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(args.seed)
    compiled_backward = bool(args.compile_backward and args.compile and device == "cuda")
    model = TorchGPT(mc, kind=args.attn, compiled_backward=compiled_backward)
    if args.init == "jax":
        load_into_torch(model, jax_init(mc, args.seed))
    else:
        model.init_nanogpt()
    model.to(device)
    fused = device == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=oc.lr, betas=(oc.b1, oc.b2), eps=oc.eps,
                            weight_decay=oc.weight_decay, fused=fused)
    step_fn = torch.compile(model) if (args.compile and device == "cuda") else model
    autocast = lambda: torch.autocast(device, dtype=torch.bfloat16)

    tokens = data_lib.load_tokens(args.data)
    seq = mc["block_size"]
    sampler = data_lib.BatchSampler(tokens.train, args.batch_size, seq, args.seed)
    px, py = data_lib.fixed_batch(tokens.val, 8, seq, seed=7)  # the JAX probe's windows
    to_dev = lambda a: torch.from_numpy(np.asarray(a, np.int64)).to(device)
    px, py = to_dev(px), to_dev(py)

    config = {
        "framework": "torch", "torch_version": torch.__version__, "attn": args.attn,
        "init": args.init, "seed": args.seed, "steps": args.steps, "batch_size": args.batch_size,
        "model": mc, "optim": {k: getattr(oc, k) for k in
                               ("lr", "min_lr", "warmup_steps", "decay_steps", "b1", "b2", "eps",
                                "weight_decay", "clip")},
        "compile": bool(args.compile and device == "cuda"), "compile_backward": compiled_backward,
        "data": args.data,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
    }
    (run_dir / "config.json").write_text(json.dumps(config, indent=2))
    metrics_path = run_dir / "metrics.jsonl"
    metrics_path.write_text("")

    pending = []  # (step, loss, grad_norm, lr) tensors not yet fetched: no sync every step
    t_start = time.perf_counter()
    t_ref = t_start
    diverged, step = None, 0
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def flush():
        nonlocal t_ref, diverged
        if not pending:
            return
        vals = torch.stack([torch.stack([lo, gn]) for _, lo, gn, _ in pending]).float().cpu().numpy()
        now = time.perf_counter()
        dt = (now - t_ref) / len(pending)
        t_ref = now
        with metrics_path.open("a") as f:
            for (s, _, _, lr), (lo, gn) in zip(pending, vals):
                rec = {"step": s, "loss": float(lo), "grad_norm": float(gn), "lr": lr,
                       "step_time_s": dt}
                f.write(json.dumps(rec) + "\n")
                if diverged is None and not math.isfinite(float(lo)):
                    diverged = s
        pending.clear()

    for step in range(1, args.steps + 1):
        lr = nanogpt_lr(step - 1, oc.lr, oc.warmup_steps, oc.decay_steps, oc.min_lr)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = sampler.next()
        with autocast():
            loss = step_fn(to_dev(x), to_dev(y), full=False)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), oc.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        pending.append((step, loss.detach(), gn.detach(), lr))
        last = step == args.steps or (time.perf_counter() - t_start > args.max_seconds)
        if step % args.probe_every == 0 or last or len(pending) >= 50:
            sync()
            flush()
            if step % args.probe_every == 0:
                rec = probe(model, px, py, autocast)
                with metrics_path.open("a") as f:
                    f.write(json.dumps({"step": step, **rec}) + "\n")
                t_ref = time.perf_counter()  # probe time is not step time
                print(f"step {step}: loss {rec['probe_loss']:.3f}  L1 max logit "
                      f"{rec['max_logit/L1']:.1f}  L1 max-head |W_Q| {rec['wq_norm_max/L1']:.2f}  "
                      f"L1 tie {100 * rec['tie_frac/L1']:.2f} %", flush=True)
        if diverged or last:
            break
    summary = {"steps": step, "diverged_at": diverged, "time_s": time.perf_counter() - t_start,
               **{k: config[k] for k in ("framework", "torch_version", "device")}}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", choices=sorted(TORCH_ARMS), default="torch-flash",
                    help="experiments/arms.py TORCH_ARMS")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--probe-every", type=int, default=250)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--init", choices=("jax", "torch"), default="jax",
                    help="jax: the JAX run's init of this seed; torch: nanoGPT init from torch's RNG")
    ap.add_argument("--data", default="data/full.npz")
    ap.add_argument("--out", default="results/repro")
    ap.add_argument("--max-seconds", type=float, default=float("inf"),
                    help="stop cleanly (metrics and summary written) after this much wall time")
    ap.add_argument("--model", default=None, help='JSON overrides of GPT2_SMALL, e.g. \'{"n_layer": 2}\'')
    ap.add_argument("--warmup-steps", type=int, default=None, help="default: the small-gpu preset's")
    ap.add_argument("--device", default=None)
    ap.add_argument("--compile", type=int, default=1)
    ap.add_argument("--compile-backward", type=int, default=0,
                    help="flash-o / flash-dpp: the written-out backward through torch.compile too "
                         "(CUDA with --compile 1; off: the twin's runs so far are eager there)")
    args = ap.parse_args(argv)
    args.attn = TORCH_ARMS[args.arm]
    print(json.dumps(train(args), indent=2))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
