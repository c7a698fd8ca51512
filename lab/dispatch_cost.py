"""What a jitted, donated step costs the host per array it takes: the same bytes of state in 3, 30
or 300 arrays, each step an elementwise update of every array (and optionally a chain of matrix
products to keep the device busy), timed as ``bench.train_step`` times a training step: each step
waited for, then steps dispatched back to back.

    python -m lab.dispatch_cost [--arrays 3,30,300] [--mib 512] [--matmuls 0,100]
        [--modes donated,kept,read] [--steps 30] [--out FILE.json]

A waited step pays the host's work before the device starts (flattening the arguments, the
runtime's per-buffer bookkeeping, a CUDA graph's update); back to back hides it behind the previous
step. So ``waited - back to back`` against the number of arrays says how much of a training step's
waited time is its argument count (GPT-2 small's state is about 300 arrays).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def make_state(n: int, mib: float, matmul_dim: int, seed: int = 0):
    """``n`` FP32 arrays of about ``mib`` MiB together (sizes spread over a factor of 8, as a
    model's are), plus a bf16 square matrix for the products."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    weights = rng.uniform(1.0, 8.0, n)
    elems = np.maximum(1, (weights / weights.sum() * mib * 2**20 / 4).astype(int))
    arrays = {f"a{i:03d}": jnp.asarray(rng.standard_normal(int(m)), jnp.float32)
              for i, m in enumerate(elems)}
    mat = jnp.asarray(rng.standard_normal((matmul_dim, matmul_dim)) / matmul_dim**0.5, jnp.bfloat16)
    return {"arrays": arrays, "mat": mat}, int(elems.sum())


MODES = ("donated", "kept", "read")


def make_step(matmuls: int, mode: str = "donated"):
    """``donated``: the state updated and returned, its buffers donated (a training step);
    ``kept``: the same without donation (every output a new buffer); ``read``: every array read,
    only the scalar returned (the arguments' cost without the outputs')."""
    import jax
    import jax.numpy as jnp

    def step(state):
        m = state["mat"]
        x = m
        for _ in range(matmuls):
            x = jnp.tanh(x @ m)
        new = {k: a * 0.999 + 1e-3 for k, a in state["arrays"].items()}
        metric = jnp.sum(x.astype(jnp.float32)) + sum(a[0] for a in new.values())
        return {"arrays": new, "mat": m}, metric

    if mode == "read":
        return jax.jit(lambda s: step(s)[1])
    return jax.jit(step, donate_argnums=0 if mode == "donated" else ())


def count_entry_ops(hlo: str) -> dict:
    """Fusions and custom calls of the optimized HLO's entry computation (each a kernel launch on
    a GPU), and all its instructions."""
    entry = hlo[hlo.index("\nENTRY "):] if "\nENTRY " in hlo else hlo
    body = entry[entry.index("{") + 1:]
    body = body[:body.index("\n}")] if "\n}" in body else body
    lines = [line for line in body.splitlines() if " = " in line]
    return {"entry_fusions": sum(" fusion(" in line for line in lines),
            "entry_custom_calls": sum(" custom-call(" in line for line in lines),
            "entry_instructions": len(lines)}


def measure(n: int, mib: float, matmuls: int, steps: int, warmup: int, matmul_dim: int,
            mode: str = "donated") -> dict:
    import time

    import jax

    from bench.step_timing import time_steps

    state, elems = make_state(n, mib, matmul_dim)
    compiled = make_step(matmuls, mode).lower(state).compile()
    # the device program's size: with the arrays may go kernels (and CUDA-graph nodes to update)
    kernels = count_entry_ops(compiled.as_text())
    held = {"state": state}
    del state
    dispatch = []

    def step():
        t0 = time.perf_counter()
        if mode == "read":
            metric = compiled(held["state"])
        else:
            held["state"], metric = compiled(held["state"])
        dispatch.append((time.perf_counter() - t0) * 1e3)
        return metric

    timing = time_steps(step, jax.block_until_ready, warmup=warmup, steps=steps)
    waited = timing["step_ms"]["median"]
    b2b = timing["back_to_back_ms"]
    # the calls' own return times: the waited steps' (after the warm-up), then the back-to-back ones
    d_waited = dispatch[warmup:warmup + steps]
    return {"mode": mode, "arrays": n, "elements": elems, "matmuls": matmuls, **kernels,
            "waited_ms": waited,
            "back_to_back_ms": b2b, "waited_minus_b2b_ms": waited - b2b,
            "call_return_ms_waited": float(np.median(d_waited)),
            "call_return_ms_b2b": float(np.median(dispatch[warmup + steps:]))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arrays", default="3,30,300")
    ap.add_argument("--mib", type=float, default=512.0)
    ap.add_argument("--matmuls", default="0,100", help="products a step (device work, 4096²)")
    ap.add_argument("--matmul-dim", type=int, default=4096)
    ap.add_argument("--modes", default="donated", help=f"comma-separated, of {MODES}")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    import jax
    import jaxlib

    rows = []
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        ap.error(f"--modes: expected some of {MODES}, got {args.modes!r}")
    cases = [(md, mm, n) for md in modes for mm in (int(x) for x in args.matmuls.split(","))
             for n in (int(x) for x in args.arrays.split(","))]
    for mode, mm, n in cases:
        r = measure(n, args.mib, mm, args.steps, args.warmup, args.matmul_dim, mode)
        rows.append(r)
        print(f"{mode:7s} matmuls {mm:4d} arrays {n:4d} ({r['entry_fusions']} fusions): waited {r['waited_ms']:8.3f} ms, "
              f"back to back {r['back_to_back_ms']:8.3f}, "
              f"difference {r['waited_minus_b2b_ms']:7.3f}; "
              f"call returns after {r['call_return_ms_waited']:.3f} ms (waited), "
              f"{r['call_return_ms_b2b']:.3f} (back to back)", flush=True)
    if args.out:
        meta = {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
                "device": jax.devices()[0].device_kind, "argv": sys.argv[1:] if argv is None
                else list(argv)}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
