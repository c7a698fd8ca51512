"""Whether a table's order biases it under the GPU's power cap: ``bench.attention``'s JAX
implementations at one shape (all but the slow "paper" policy and cuDNN deterministic), timed
interleaved as the table times them, alternately without and with a warm-up before each sample
(``timed_interleaved``'s ``warm_ms``), each setting run ``--repeats`` times in one process.

    python -m lab.warm_order [--shape 4x8192x16x128] [--warm-ms 300] [--repeats 2]
        [--rounds 10] [--reps 6] [--non-causal] [--out FILE.json]
    python -m lab.warm_order --from-json FILE.json   # its summary again, no GPU

Prints per run cuDNN's time over fa2's paired by round (``bench.attention.paired_median``) and each
one's per-round times: without a warm-up, a kernel timed right after a slow neighbour (XLA's
attention, the Pallas mha) gets the GPU at clocks the cap has not yet lowered, and its rounds
alternate with the order; with one, each sample is taken in its own sustained state.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from bench import attention as ba

FA2, CUDNN = str(("jax_flash", "fa2", False)), str(("cudnn", None, None))


def run(shape, warm_ms, repeats, rounds, reps, causal=True, log=print):
    """{"device", "jax_version", "shape", ..., "runs": {warm: [{"ms", "rounds_ms"}, ...]}}, keys
    of ``ms`` the implementations' (impl, policy, stable) as strings."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3))
    fns = {str((impl, policy, stable)): ba._jax_pass(f, "fwd+bwd")
           for impl, policy, stable, f in ba._jax_impls(causal)
           if policy != "paper" and impl not in ba.COMPILER_OPTIONS}  # as the experiment ran
    log(f"{jax.devices()[0].device_kind} {list(fns)}")
    runs = {}
    for warm in (0.0, float(warm_ms)) * repeats:
        per_round = {}
        ms = ba.timed_interleaved(fns, (q, k, v), reps, rounds, sync="round", per_round=per_round,
                                  warm_ms=warm, log=log)
        med, (lo, hi) = ba.paired_median(per_round[CUDNN], per_round[FA2])
        log(f"warm {warm:5.0f}: cudnn/fa2 paired {med:.3f} ({lo:.3f} … {hi:.3f}); "
            + "; ".join(f"{name}: {t:.3f}" for name, t in ms.items()))
        for name in (FA2, CUDNN):
            log(f"  {name} rounds {[round(x, 2) for x in per_round[name]]}")
        runs.setdefault(str(warm), []).append({"ms": ms, "rounds_ms": per_round})
    return {"device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
            "shape": list(shape), "causal": causal, "pass": "fwd+bwd", "sync": "round",
            "reps": reps, "rounds": rounds, "runs": runs}


def summary(result) -> str:
    """A markdown line per run: warm-up, cuDNN/fa2 paired by round with its 90 % interval, and the
    spread of each one's per-round times."""
    lines = ["| warm-up ms | cuDNN/fa2, paired | fa2 rounds ms | cuDNN rounds ms |",
             "|---|---|---|---|"]
    for warm, runs in result["runs"].items():
        for one in runs:
            fa2, cud = one["rounds_ms"][FA2], one["rounds_ms"][CUDNN]
            med, (lo, hi) = ba.paired_median(cud, fa2)
            lines.append(f"| {float(warm):.0f} | {med:.3f} ({lo:.3f} … {hi:.3f}) | "
                         f"{min(fa2):.2f} … {max(fa2):.2f} | {min(cud):.2f} … {max(cud):.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="4x8192x16x128")
    ap.add_argument("--warm-ms", type=float, default=300.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--non-causal", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--from-json", default=None, help="print a result file's summary (no GPU)")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            print(summary(json.load(f)), end="")
        return
    result = run(tuple(int(x) for x in args.shape.split("x")), args.warm_ms, args.repeats,
                 args.rounds, args.reps, causal=not args.non_causal)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(summary(result), end="")


if __name__ == "__main__":
    main()
