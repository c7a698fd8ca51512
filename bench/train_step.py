"""GPT-2 small training throughput on one GPU, attention arms side by side in one process.

    python -m bench.train_step [--steps 30] [--batch 32] [--arms flash,flash-stable,cudnn]
        [--out FILE.json]

Synthetic uniform tokens (throughput does not depend on the text), the small-gpu preset (GPT-2
small, 1024 context, bf16 compute, AdamW). Reports tokens/s (median step time after the compiled
first step) and MFU (nanoGPT's 6N + 12·L·d·T FLOPs per token over the H200's 989 TFLOP/s dense bf16).
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax
import numpy as np

from train import config as config_lib
from train.gpt2 import read_metrics, train

ARMS = {
    "flash": ["attention.kind=flash"],
    "flash-stable": ["attention.kind=flash", "attention.stable=true"],
    "cudnn": ["attention.kind=cudnn"],
    "standard": ["attention.kind=standard"],
    "flash-paper": ["attention.kind=flash", "attention.policy=paper"],
}


class Synthetic:
    def __init__(self, n, vocab=50257, seed=0):
        rng = np.random.default_rng(seed)
        self.train = rng.integers(0, vocab, n, dtype=np.uint16)
        self.val = rng.integers(0, vocab, 1 << 16, dtype=np.uint16)
        self.meta = {"synthetic": True}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--arms", default="flash,flash-stable,cudnn")
    ap.add_argument("--out", default="throughput.json")
    args = ap.parse_args(argv)
    tokens = Synthetic(20_000_000)
    results = []
    for arm in args.arms.split(","):
        cfg = config_lib.apply_overrides(config_lib.get_preset("small-gpu"), ARMS[arm] + [
            f"max_steps={args.steps}", "eval_every=0", "checkpoint_every=0", "progress=false",
            f"data.batch_size={args.batch}", f"run_dir=runs/throughput/{arm}"])
        summary = train(cfg, tokens=tokens)
        recs = read_metrics(cfg.run_dir)[2:]  # step 1 compiles; step 2 may still warm up
        step_s = statistics.median(r["step_time_s"] for r in recs)
        res = dict(arm=arm, overrides=ARMS[arm], batch=args.batch, seq_len=1024,
                   tokens_per_s=summary["tokens_per_step"] / step_s, step_ms=step_s * 1e3,
                   mfu=statistics.median(r["mfu"] for r in recs) if recs[0]["mfu"] else None,
                   final_loss=summary["final_loss"], steps=args.steps,
                   jax_version=jax.__version__, device=jax.devices()[0].device_kind)
        results.append(res)
        print(f"{arm:14s} {res['tokens_per_s']:10.0f} tokens/s  {res['step_ms']:7.1f} ms/step  "
              f"MFU {res['mfu'] or 0:.3f}  loss {res['final_loss']:.3f}", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
