"""Tune the GPU kernels' launch on the GPU; write jax_flash/pallas/tuning.json.

    python -m bench.tune [--shapes 32x1024x12x64,4x8192x16x128] [--policies fa2]
        [--masks causal,full] [--reps 20] [--budget-s 480] [--out jax_flash/pallas/tuning.json]
        [--log FILE.json]

Only launch fields are searched (``jax_flash.Launch``: none of them changes a computed value); the
tiles are the call's defaults (``jax_flash.plan``), since they are numerics. Per shape, policy and
mask (``--masks``: causal, full or both, the default; bfloat16, stable off — the stable kernels
are the same kernels):

1. the forward, timed on the forward pass: each Triton ``(num_warps, num_stages)`` of ``LAUNCHES``
   without and with ``prefetch_scores``, and the Mosaic GPU forward where it covers the call (its
   ring of K/V tiles at the default depth and at each of ``MOSAIC_STAGES``);
2. with the fastest forward, the backward, timed on forward+backward: each Triton launch without
   and with ``prefetch_rows``, the Mosaic GPU dK/dV kernel beside the Triton dQ kernel under each
   launch, and the Mosaic GPU backward (its rings at the default depth and at each of
   ``MOSAIC_STAGES``, its register split at each of ``MOSAIC_REGS``, its dQ kernel on 128-key
   tiles with the default and each split), where they cover the call;
3. the ``FINALISTS`` fastest of step 2, each also with ``split_diagonal`` (mask-free loops below the
   causal diagonal) where a Triton kernel runs, timed again in ``ROUNDS`` interleaved rounds
   (``bench.attention.timed_interleaved``): one-shot timings of one configuration drift by more
   than the differences between good candidates, so the lowest median of the interleaved calls wins.

A candidate the plan refuses (a Mosaic GPU kernel that does not cover the call) or that fails to
compile (e.g. shared memory) is skipped and logged. The winner is merged into the table under
``tuning.key(...)`` with where it was measured (``device``, ``arch``, ``jax_version``) and its ``ms``
(fwd+bwd); the table then applies on GPUs of that architecture. Resident blocks (``bwd_block``,
``dq_block``), ``heavy_first`` and a dQ launch of its own are not searched: compare such candidates
with ``python -m lab.ab`` first. A table written elsewhere (``--out my.json``) is used in place of
the shipped entries of the same keys with ``JAX_FLASH_TUNING=my.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash as jf
from jax_flash.pallas import tuning

from .attention import _jax_pass, _timed, timed_interleaved

LAUNCHES = [(4, 2), (4, 3), (8, 2), (8, 3)]  # Triton (num_warps, num_stages)
MOSAIC_STAGES = (2, 3, 4)  # ring depths of the Mosaic kernels tried beside their defaults
MOSAIC_REGS = ((240, 24),)  # Mosaic backward (compute, producer) register splits beside the default
FINALISTS, ROUNDS = 3, 3
WARPS_STAGES = ("fwd", "bwd", "dq")  # launch fields written as {"num_warps", "num_stages"}


def forward_candidates() -> list[jf.Launch]:
    return ([jf.Launch(fwd=ws, prefetch_scores=ps) for ws in LAUNCHES for ps in (False, True)]
            + [jf.Launch(fwd_kernel="mosaic", mosaic_fwd_stages=n) for n in (None, *MOSAIC_STAGES)])


def backward_candidates(fwd: jf.Launch) -> list[jf.Launch]:
    """``fwd`` (the forward's winner) with each backward launch."""
    plus = lambda **kw: dataclasses.replace(fwd, **kw)
    return ([plus(bwd=ws, prefetch_rows=pr) for ws in LAUNCHES for pr in (False, True)]
            + [plus(bwd_kernel="mosaic_dkdv", bwd=ws) for ws in LAUNCHES]  # ws: the Triton dQ's
            + [plus(bwd_kernel="mosaic", mosaic_bwd_stages=n) for n in (None, *MOSAIC_STAGES)]
            + [plus(bwd_kernel="mosaic", mosaic_bwd_regs=r) for r in MOSAIC_REGS]
            + [plus(bwd_kernel="mosaic", mosaic_dq_keys=128, mosaic_bwd_regs=r)
               for r in (None, *MOSAIC_REGS)])


def finalists(launches: list[jf.Launch]) -> list[jf.Launch]:
    """Each launch, and after it the same with ``split_diagonal`` where a Triton kernel runs."""
    out = []
    for launch in launches:
        out.append(launch)
        if launch.fwd_kernel == "triton" or launch.bwd_kernel != "mosaic":
            out.append(dataclasses.replace(launch, split_diagonal=True))
    return list(dict.fromkeys(out))


def table_entry(launch: jf.Launch, ms: float, device: str, arch: str | None,
                jax_version: str) -> dict:
    """A tuning-table entry: the launch's fields (those off their defaults) and where it was
    measured; checked by ``tuning.entry_launch``, which refuses anything else."""
    entry = {k: {"num_warps": v[0], "num_stages": v[1]} if k in WARPS_STAGES else v
             for k, v in launch.to_dict().items()}
    entry.update(device=device, arch=arch, jax_version=jax_version, ms=round(float(ms), 3))
    if tuning.entry_launch(entry) != launch:
        raise AssertionError(f"{entry} does not read back as {launch}")
    return entry


def _pass_fn(policy: str, launch: jf.Launch, pss: str, causal: bool = True):
    """One candidate's jitted pass: attention with the call's default tiles under ``launch``."""
    return _jax_pass(lambda q, k, v: jf.attention(q, k, v, policy=policy, causal=causal,
                                                  impl="pallas", launch=launch), pss)


def tune_one(shape, policy, reps, deadline, log, causal=True):
    """((ms, launch) of the winner or None, every trial as a record) for one shape and policy."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3))
    num = jf.plan(q, k, v, policy=policy, causal=causal, impl="pallas").numerics
    case = dict(shape=list(shape), policy=policy, causal=causal, block_q=num.block_q,
                block_k=num.block_k)
    name = f"{'x'.join(map(str, shape))} {policy}{'' if causal else ' full'}"
    trials = []

    def ranked(candidates, pss):
        """(ms, launch) of the candidates that ran on pass ``pss``, fastest first."""
        out = []
        for launch in candidates:
            if time.time() > deadline:
                break
            try:
                jf.plan(q, k, v, policy=policy, causal=causal, impl="pallas", launch=launch)
                ms = _timed(_pass_fn(policy, launch, pss, causal), (q, k, v), reps)
            except Exception as e:  # not covered, or does not compile: not a candidate
                log(f"{name} {launch.to_dict()}: skipped ({type(e).__name__}: {str(e)[:120]})")
                continue
            trials.append(dict(case, launch=launch.to_dict(), **{"pass": pss}, ms=ms))
            log(f"{name} {pss} {launch.to_dict()}: {ms:.3f} ms")
            out.append((ms, launch))
        return sorted(out, key=lambda x: x[0])

    fwd = ranked(forward_candidates(), "fwd")
    both = ranked(backward_candidates(fwd[0][1]), "fwd+bwd") if fwd else []
    if not both:
        return None, trials
    # the final rounds run even past the deadline: these few timings are the answer
    final = finalists([launch for _, launch in both[:FINALISTS]])
    per_round = {}
    ms = timed_interleaved({i: _pass_fn(policy, launch, "fwd+bwd", causal)
                            for i, launch in enumerate(final)},
                           (q, k, v), reps, ROUNDS, log=log, per_round=per_round)
    for i, t in ms.items():
        trials.append(dict(case, launch=final[i].to_dict(), **{"pass": "fwd+bwd"}, ms=t,
                           final=True, rounds_ms=per_round[i]))
        log(f"final {name} {final[i].to_dict()}: median {t:.3f} ms")
    if not ms:
        return None, trials
    best = min(ms, key=ms.get)
    return (ms[best], final[best]), trials


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="32x1024x12x64,4x8192x16x128")
    ap.add_argument("--policies", default="fa2")
    ap.add_argument("--masks", default="causal,full", help="causal, full, or causal,full")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=480)
    ap.add_argument("--out", default=str(tuning.TABLE_PATH))
    ap.add_argument("--log", default="tune_log.json")
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        raise SystemExit("bench.tune times the GPU kernels: it needs a GPU (the table is unused "
                         "elsewhere)")
    start = time.time()
    out = Path(args.out)
    table = json.loads(out.read_text()) if out.exists() else {}
    device, arch = jax.devices()[0].device_kind, tuning.device_arch()
    all_trials = []
    masks = args.masks.split(",")
    if not masks or set(masks) - {"causal", "full"}:
        raise SystemExit(f"--masks: causal, full or both, not {args.masks!r}")
    combos = list(itertools.product(
        [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")],
        args.policies.split(","), [m == "causal" for m in masks]))
    for i, (shape, policy, causal) in enumerate(combos):
        # an equal share of what is left, so the first shape cannot starve the others
        deadline = time.time() + (start + args.budget_s - time.time()) / (len(combos) - i)
        best, trials = tune_one(shape, policy, args.reps, deadline, print, causal)
        all_trials += trials
        if best:
            key = tuning.key(policy, shape[3], shape[1], causal)
            table[key] = table_entry(best[1], best[0], device, arch, jax.__version__)
            print(f"best {key}: {table[key]}")
    out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    tuning.load(out)  # every entry as the library will read it
    Path(args.log).write_text(json.dumps(all_trials, indent=1))
    print("wrote", out, "and", args.log)


if __name__ == "__main__":
    main()
