"""Does a variant's backward give the same bits on every run? Distinct results over repeated calls.

    python -m lab.determinism [--shape 4x8192x16x128] [--variants new,cudnn] [--repeats 6]
        [--non-causal] [--out F.json]

Variants as in ``lab.ab`` (``new``, ``new@ENTRY``, ``:stable``, ``cudnn``, ``cudnn_det``). Each
variant's dQ, dK and dV of sum(O∘G), G a fixed random cotangent, are computed ``--repeats`` times on
the same inputs in one process; per gradient the record gives how many distinct bit patterns came
back and the largest difference from the first call's. The process's ``XLA_FLAGS`` are recorded with
them: XLA asks cuDNN for its deterministic attention backward under
``--xla_gpu_deterministic_ops=true`` (for the whole process; ``cudnn_det`` sets the option for its
own programs only), and its default backward may add dQ's parts in any order. Ours sums every
gradient in a fixed order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import numpy as np


def distinct_runs(g, args, repeats: int) -> list[dict]:
    """Per output of ``g(*args)`` over ``repeats`` calls: the distinct bit patterns (``distinct``)
    and the largest |difference| from the first call's output (``max_abs_diff``)."""
    import jax

    if repeats < 2:
        raise ValueError(f"repeats must be at least 2, got {repeats}")
    first, seen, worst = None, None, None
    for _ in range(repeats):
        outs = [np.asarray(o) for o in jax.block_until_ready(g(*args))]
        if first is None:
            first, seen, worst = outs, [set() for _ in outs], [0.0] * len(outs)
        for i, o in enumerate(outs):
            seen[i].add(hashlib.sha256(o.tobytes()).hexdigest())
            diff = np.abs(o.astype(np.float32) - first[i].astype(np.float32))
            worst[i] = max(worst[i], float(np.max(diff)))
    return [{"distinct": len(s), "max_abs_diff": w} for s, w in zip(seen, worst)]


def gradient_fn(attn, compiler_options=None):
    """dQ, dK, dV of sum(attn(q, k, v)∘G) (FP32 sum), jitted with ``compiler_options``."""
    import jax
    import jax.numpy as jnp

    def loss(q, k, v, cot):
        return jnp.sum(attn(q, k, v).astype(jnp.float32) * cot)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)), compiler_options=compiler_options)


def run(shape, variants, repeats: int, causal: bool = True):
    import jax
    import jax.numpy as jnp

    import jax_flash
    from lab import ab

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3))
    cot = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    rows = []
    for name in variants:
        attn = ab._attention_fn(name, {"new": jax_flash}, ab.candidate_entries(), causal, "fa2")
        g = gradient_fn(attn, ab.compiler_options(name))
        got = dict(zip(("dq", "dk", "dv"), distinct_runs(g, (q, k, v, cot), repeats)))
        rows.append({"variant": name, **got})
        print(f"{name}: " + ", ".join(f"{n} {r['distinct']} distinct (max |diff| "
                                      f"{r['max_abs_diff']:.3g})" for n, r in got.items()),
              flush=True)
    return {"shape": list(shape), "causal": causal, "repeats": repeats,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax_version": jax.__version__,
            "device": jax.devices()[0].device_kind, "rows": rows}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="4x8192x16x128")
    p.add_argument("--variants", default="new,cudnn")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--non-causal", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    got = run(tuple(int(x) for x in a.shape.split("x")), a.variants.split(","), a.repeats,
              causal=not a.non_causal)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(got, f, indent=1)


if __name__ == "__main__":
    main()
