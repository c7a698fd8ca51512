"""Autotune the Triton kernels' tiles and launch parameters on the GPU; write jax_flash/pallas/tuning.json.

    python -m bench.tune [--shapes 32x1024x12x64,4x8192x16x128] [--policies fa2,paper] [--reps 20]
        [--budget-s 480] [--out jax_flash/pallas/tuning.json] [--log FILE.json]

For each shape and policy: first the forward launch (num_warps, num_stages) per tile pair, timed on the
forward; then, with each tile pair's best forward, the backward launch, timed on forward+backward;
last, the three fastest of those, each without and with ``split_diagonal`` (mask-free loops below
the causal diagonal), timed again in three interleaved rounds. The lowest median of those rounds
wins and is merged into the table under `tuning.key(...)` (causal, bf16, stable off — the stable
kernels are the same kernels). Candidates that do not compile (shared memory)
are skipped and logged. "paper" keeps its 512-wide key tiles (they define its numerics).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash as jf
from jax_flash.pallas import tuning

from .attention import _jax_pass, _timed

TILES = {"fa2": [(64, 32), (64, 64), (128, 64), (64, 128), (128, 128)],
         "fp32": [(32, 32), (64, 32), (64, 64)],
         "paper": [(16, 512), (32, 512), (64, 512)]}
LAUNCHES = [(4, 2), (4, 3), (8, 2), (8, 3)]
FINALISTS, ROUNDS = 3, 3


def tune_one(shape, policy, reps, deadline, log):
    b, t, h, d = shape
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3))
    f = lambda q, k, v: jf.attention(q, k, v, policy=policy, impl="pallas")
    trials = []
    launch_of = lambda launch: dict(zip(("num_warps", "num_stages"), launch))

    def time_entry(entry, pss, **extra):
        """ms of one candidate on pass `pss`, logged; None if it does not compile."""
        try:
            with tuning.override(entry):
                ms = _timed(_jax_pass(f, pss), (q, k, v), reps)
        except Exception as e:  # e.g. shared memory exceeded: not a candidate
            log(f"{shape} {policy} {entry}: skipped ({type(e).__name__})")
            return None
        trials.append(dict(shape=list(shape), policy=policy, **entry, **{"pass": pss}, ms=ms, **extra))
        log(f"{'x'.join(map(str, shape))} {policy} {pss} {entry}: {ms:.3f} ms")
        return ms

    def best_of(entries, pss):
        """Time each candidate entry on pass `pss`; (ms, entry) of the fastest, None if none ran."""
        best = None
        for entry in entries:
            if time.time() > deadline:
                break
            ms = time_entry(entry, pss)
            if ms is not None and (best is None or ms < best[0]):
                best = (ms, entry)
        return best

    finalists = []  # (ms, entry): each tile pair's best forward+backward
    for bq, bk in TILES[policy]:
        fwd = best_of([{"block_q": bq, "block_k": bk, "fwd": launch_of(lc)} for lc in LAUNCHES], "fwd")
        if fwd is None:
            continue
        both = best_of([dict(fwd[1], bwd=launch_of(lc)) for lc in LAUNCHES], "fwd+bwd")
        if both is not None:
            finalists.append(both)
    # One-shot timings of the same ~1-ms configuration spread by up to 17 % on the H200 (0.967 and
    # 1.137 ms in bench/results/2026-11-29-NVIDIA_H200-tune-log.json), so the best FINALISTS, each without and with mask-free interior loops, are timed again
    # in ROUNDS interleaved rounds and ranked by their median (even past the deadline: these few
    # trials are the answer, and the table's split_diagonal needs them).
    top = [e for _, e in sorted(finalists, key=lambda x: x[0])[:FINALISTS]]
    final = [dict(e, split_diagonal=split) for e in top for split in (False, True)]
    times: dict[int, list[float]] = {i: [] for i in range(len(final))}
    for r in range(ROUNDS):
        for i, entry in enumerate(final):
            ms = time_entry(entry, "fwd+bwd", round=r)
            if ms is not None:
                times[i].append(ms)
    ranked = sorted((float(np.median(t)), i) for i, t in times.items() if t)
    for ms, i in ranked:
        log(f"final {'x'.join(map(str, shape))} {policy} {final[i]}: median {ms:.3f} ms of "
            + ", ".join(f"{x:.3f}" for x in times[i]))
    best = (ranked[0][0], final[ranked[0][1]]) if ranked else None
    return best, trials


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="32x1024x12x64,4x8192x16x128")
    ap.add_argument("--policies", default="fa2")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=480)
    ap.add_argument("--out", default=str(tuning.TABLE_PATH))
    ap.add_argument("--log", default="tune_log.json")
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        raise SystemExit("bench.tune times the Triton kernels: it needs a GPU (the table is unused elsewhere)")
    start = time.time()
    table = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    all_trials = []
    combos = list(itertools.product(
        [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")], args.policies.split(",")))
    for i, (shape, policy) in enumerate(combos):
        # an equal share of what is left, so the first shape cannot starve the others
        deadline = time.time() + (start + args.budget_s - time.time()) / (len(combos) - i)
        best, trials = tune_one(shape, policy, args.reps, deadline, print)
        all_trials += trials
        if best:
            key = tuning.key(policy, shape[3], shape[1], True)
            table[key] = dict(best[1], ms=best[0], jax_version=jax.__version__,
                              device=jax.devices()[0].device_kind)
            print(f"best {key}: {table[key]}")
    with open(args.out, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    with open(args.log, "w") as f:
        json.dump(all_trials, f, indent=1)
    print("wrote", args.out, "and", args.log)


if __name__ == "__main__":
    main()
