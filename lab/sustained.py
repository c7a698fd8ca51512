"""Does a variant slow down when it runs long, back to back? Clocks and power per variant.

    python -m lab.sustained [--shape 4x8192x16x128] [--pass fwd+bwd] [--variants new,cudnn]
        [--seconds 6] [--rounds 2] [--out F.json]

Variants as in ``lab.ab`` (``new``, ``new@ENTRY``, ``:stable``, ``cudnn``). Each round runs every
variant in two phases: calls back to back for ``--seconds`` (one wait every 10 calls), then as many
calls each waited alone. ``nvidia-smi`` is sampled every 100 ms throughout
(``bench.step_timing.GpuMonitor``). Per variant, round and phase: the median time per call (ms),
and over the phase's samples the SM clock's median (MHz), the power's median (W) and the share of
samples with the software power cap active. What it answers: whether a variant that is level per
call falls behind back to back because it draws more power, so that the cap lowers its clock.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

CHUNK = 10  # calls between waits back to back


def _phase(g, args, seconds: float | None, n: int | None, waited: bool, monitor):
    import jax

    t0, times, calls = time.time(), [], 0
    while (calls < n) if n is not None else (time.time() - t0 < seconds):
        c0 = time.perf_counter()
        if waited:
            jax.block_until_ready(g(*args))
            times.append((time.perf_counter() - c0) * 1e3)
            calls += 1
        else:
            out = [g(*args) for _ in range(CHUNK)]
            jax.block_until_ready(out)
            times.append((time.perf_counter() - c0) * 1e3 / CHUNK)
            calls += CHUNK
    t1 = time.time()
    return calls, {"ms": float(np.median(times)), "calls": calls, "seconds": t1 - t0,
                   "smi": monitor.summary(t0, t1)}


def run(shape, pss, variants, seconds, rounds):
    import jax
    import jax.numpy as jnp

    import jax_flash
    from bench.attention import _jax_pass
    from bench.step_timing import GpuMonitor
    from lab import ab

    rng = np.random.default_rng(0)
    args = tuple(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3))
    fns = {v: _jax_pass(ab._attention_fn(v, {"new": jax_flash}, ab.candidate_entries(), True,
                                         "fa2"), pss, ab.compiler_options(v)) for v in variants}
    for g in fns.values():  # compile and warm up outside the phases
        jax.block_until_ready([g(*args) for _ in range(3)])
    monitor = GpuMonitor()
    rows = []
    try:
        for r in range(rounds):
            for v, g in fns.items():
                n, b2b = _phase(g, args, seconds, None, False, monitor)
                _, alone = _phase(g, args, None, n, True, monitor)
                rows.append({"variant": v, "round": r, "back_to_back": b2b, "waited": alone})
                print(f"round {r} {v}: back to back {b2b['ms']:.3f} ms {b2b['smi']}; "
                      f"waited {alone['ms']:.3f} ms {alone['smi']}", flush=True)
    finally:
        monitor.close()
    return {"shape": list(shape), "pass": pss, "jax_version": jax.__version__,
            "device": jax.devices()[0].device_kind, "power_limit_w": monitor.power_limit_w,
            "seconds": seconds, "rows": rows}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="4x8192x16x128")
    p.add_argument("--pass", dest="pss", default="fwd+bwd", choices=("fwd", "bwd", "fwd+bwd"))
    p.add_argument("--variants", default="new,cudnn")
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    got = run(tuple(int(x) for x in a.shape.split("x")), a.pss, a.variants.split(","), a.seconds,
              a.rounds)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(got, f, indent=1)


if __name__ == "__main__":
    main()
