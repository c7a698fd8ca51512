"""Side-by-side attention speed on one GPU: jax-flash policies vs cuDNN / XLA attention.

    python -m bench.attention [--shapes 32x1024x12x64,4x8192x16x128] [--reps 30] [--out FILE.json]

Method (../shared/ANCHORS.md): bf16, median of ``--reps`` timed runs after warm-up, all impls in one
process; FLOPs = 4·B·H·T²·D non-causal, half that causal; fwd+bwd counted as 3.5× fwd. Records:
``{"impl", "policy", "stable", "shape", "causal", "pass", "ms", "tflops", "jax_version", "device"}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash as jf


def _timed(f, args, reps):
    out = f(*args)
    jax.block_until_ready(out)  # compile + warm-up
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def _impls(causal):
    yield "jax_flash", "fa2", False, lambda q, k, v: jf.attention(q, k, v, causal=causal)
    yield "jax_flash", "fa2", True, lambda q, k, v: jf.attention(q, k, v, causal=causal, stable=True)
    yield "jax_flash", "paper", False, lambda q, k, v: jf.attention(q, k, v, causal=causal,
                                                                     policy="paper")
    yield "jax_flash", "paper", True, lambda q, k, v: jf.attention(q, k, v, causal=causal,
                                                                    policy="paper", stable=True)
    for impl in ("cudnn", "xla"):
        yield impl, None, None, lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation=impl)


def run(shapes, reps, causal_modes=(True,), passes=("fwd", "fwd+bwd"), skip=()):
    records = []
    dev = jax.devices()[0].device_kind
    for shape in shapes:
        b, t, h, d = shape
        rng = np.random.default_rng(0)
        q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3))
        for causal in causal_modes:
            flops = 4.0 * b * h * t * t * d * (0.5 if causal else 1.0)
            for impl, policy, stable, f in _impls(causal):
                if (impl, policy) in skip:
                    continue
                for pss in passes:
                    if pss == "fwd":
                        g, fl = jax.jit(f), flops
                    else:
                        loss = lambda q, k, v, f=f: jnp.sum(f(q, k, v).astype(jnp.float32))
                        g, fl = jax.jit(jax.grad(loss, argnums=(0, 1, 2))), 3.5 * flops
                    try:
                        ms = _timed(g, (q, k, v), reps)
                    except Exception as e:  # an impl unavailable for this shape: record why
                        print(f"{impl} {policy} {shape} {pss}: failed: {type(e).__name__}: "
                              f"{str(e)[:200]}")
                        continue
                    rec = dict(impl=impl, policy=policy, stable=stable, shape=list(shape),
                               causal=causal, **{"pass": pss}, ms=ms, tflops=fl / ms / 1e9,
                               jax_version=jax.__version__, device=dev)
                    records.append(rec)
                    print(f"{'x'.join(map(str, shape)):>16} causal={causal!s:5} {pss:8} "
                          f"{impl:10} {str(policy):6} stable={str(stable):5} {ms:9.3f} ms "
                          f"{rec['tflops']:7.1f} TFLOP/s", flush=True)
    return records


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="32x1024x12x64,8x2048x16x128,4x8192x16x128")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--non-causal", action="store_true", help="also time causal=False")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    modes = (True, False) if args.non_causal else (True,)
    records = run(shapes, args.reps, modes)
    out = args.out or (f"bench/results/{datetime.date.today()}-"
                       f"{jax.devices()[0].device_kind.replace(' ', '_')}.json")
    with open(out, "w") as f:
        json.dump(records, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
