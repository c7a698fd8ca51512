"""One-off GPU checks, printed as tables (run on the GPU machine).

    python -m lab.gpu_checks order   # where do kernel and jnp executor part in the gradients?
    python -m lab.gpu_checks dropin  # the drop-in's kernels (GQA, lengths, windows) against jnp
    python -m lab.gpu_checks same=build/ab/REV  # this tree's kernels bitwise another revision's?

``order``: the same call (fa2, random inputs) through the jnp executor and through the kernels
under each backward kernel family, per output the share of elements within one BF16 ulp and
bitwise — to tell a kernel-specific difference (one family parts, the other does not) from the
structural one (both part alike: FP32 order inside products flips BF16 roundings of dS, and dQ,
a cancellation, shows it most).

``same=DIR``: forward and gradients of this tree's kernels against those of the revision under DIR
(``python -m lab.ab prepare REV``), the Mosaic and the Triton launch at head_dim 128 and the table's
at 64, causal or not — a change that should move no bit shows 100 % bitwise.

``dropin``: ``jax_flash.dot_product_attention`` with implementation "pallas" against "jnp" on the
same arguments (forward and gradients), and both against ``jax.nn``'s XLA attention in FP32 on the
same BF16 inputs.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash as jf

EPS = float(jnp.finfo(jnp.bfloat16).eps)


def stats(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    mag = np.maximum(np.abs(a), np.abs(b))
    ulp = EPS * 2.0 ** np.floor(np.log2(np.where(mag > 0, mag, 1.0)))
    d = np.abs(a - b)
    scale = max(float(np.max(np.abs(b))), 1e-30)
    return (100 * float(np.mean(d == 0)), 100 * float(np.mean(d <= ulp)),
            float(np.max(d)) / scale)


def randn(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.bfloat16)


def grads(f, q, k, v, do):
    o, vjp = jax.vjp(f, q, k, v)
    return (o,) + vjp(do)


def order():
    print("| shape | bwd kernel | out | bitwise % | ≤ 1 ulp % | max diff / max |ref| |")
    print("|---|---|---|---|---|---|")
    for shape in [(1, 2048, 2, 128), (1, 8192, 2, 128), (1, 8192, 2, 64), (1, 2048, 2, 64)]:
        q, k, v, do = (randn(s, shape) for s in (1, 2, 3, 4))
        ref = jax.jit(lambda q, k, v, do: grads(
            lambda q, k, v: jf.attention(q, k, v, impl="jnp"), q, k, v, do))(q, k, v, do)
        for bwd in ("triton", "mosaic"):
            if bwd == "mosaic" and shape[-1] != 128:
                continue
            launch = jf.Launch(bwd_kernel=bwd)
            try:
                out = jax.jit(lambda q, k, v, do: grads(
                    lambda q, k, v: jf.attention(q, k, v, impl="pallas", launch=launch),
                    q, k, v, do))(q, k, v, do)
            except Exception as e:  # a family that cannot run this shape says so
                print(f"| {shape} | {bwd} | — | {type(e).__name__}: {str(e)[:80]} | | |")
                continue
            for name, a, b in zip(("O", "dQ", "dK", "dV"), out, ref):
                bw, w1, md = stats(a, b)
                print(f"| {shape} | {bwd} | {name} | {bw:.3f} | {w1:.4f} | {md:.2e} |")
        sys.stdout.flush()


DROPIN = [  # (name, q shape, kv shape, kwargs)
    ("gqa 8/2", (2, 1024, 8, 64), (2, 1024, 2, 64), dict(is_causal=True)),
    ("mqa d128", (2, 1024, 8, 128), (2, 1024, 1, 128), dict(is_causal=True)),
    ("q<kv causal", (2, 256, 4, 64), (2, 1024, 4, 64), dict(is_causal=True)),
    ("q<kv full", (2, 256, 4, 64), (2, 1024, 4, 64), dict()),
    ("lengths", (3, 1024, 4, 64), (3, 1024, 4, 64),
     dict(is_causal=True, query_seq_lengths=jnp.array([1024, 700, 1]),
          key_value_seq_lengths=jnp.array([1024, 513, 1]))),
    ("window 127,0", (2, 2048, 4, 64), (2, 2048, 4, 64), dict(is_causal=True, local_window_size=(127, 0))),
    ("window 64,64", (2, 1024, 4, 128), (2, 1024, 4, 128), dict(local_window_size=64)),
    ("head_dim 80", (2, 1024, 4, 80), (2, 1024, 4, 80), dict(is_causal=True)),
    ("gqa window", (2, 2048, 8, 128), (2, 2048, 2, 128), dict(is_causal=True, local_window_size=(255, 0))),
]


def dropin():
    print("| case | executor / kernels | out | pallas=jnp bitwise % | ≤ 1 ulp % | max diff/max | "
          "pallas vs xla-f32 | jnp vs xla-f32 |")
    print("|---|---|---|---|---|---|---|---|")
    for name, qs, ks, kw in DROPIN:
        q, k, v = randn(1, qs), randn(2, ks), randn(3, ks)
        do = randn(4, qs)
        plan = jf.dot_product_attention_plan(q, k, v, implementation="pallas", **kw)
        ran = f"{plan.executor} {plan.launch.fwd_kernel}/{plan.launch.bwd_kernel}"
        f = lambda impl: jax.jit(lambda q, k, v, do: grads(
            lambda q, k, v: jf.dot_product_attention(q, k, v, implementation=impl, **kw),
            q, k, v, do))(q, k, v, do)
        try:
            p = f("pallas")
        except Exception as e:
            print(f"| {name} | {ran} | — | {type(e).__name__}: {str(e)[:100]} | | | | |")
            continue
        j = f("jnp")
        f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
        x = jax.jit(lambda q, k, v, do: grads(
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw),
            q, k, v, do))(*f32)
        for out, a, b, r in zip(("O", "dQ", "dK", "dV"), p, j, x):
            bw, w1, md = stats(a, b)
            rp, rj = stats(a, r)[2], stats(b, r)[2]
            ok = np.all(np.isfinite(np.asarray(a, np.float32)))
            print(f"| {name} | {ran} | {out} | {bw:.3f} | {w1:.4f} | {md:.2e} | {rp:.2e} | "
                  f"{rj:.2e}{'' if ok else ' NON-FINITE'} |")
        sys.stdout.flush()


SAME_SHAPES = [(1, 2048, 2, 128), (2, 8192, 2, 128), (4, 1024, 4, 64)]


def same(old_dir):
    from lab.ab import load_old

    old = load_old(old_dir)
    print(f"this tree against {old_dir}")
    print("| shape | causal | launch | out | bitwise % | max diff / max |")
    print("|---|---|---|---|---|---|")
    for shape in SAME_SHAPES:
        q, k, v, do = (randn(s, shape) for s in (1, 2, 3, 4))
        launches = ({"fwd_kernel": "mosaic", "bwd_kernel": "mosaic"}, {}) if shape[-1] == 128 \
            else (None,)
        for causal in (True, False):
            for launch in launches:
                outs = [jax.jit(lambda q, k, v, do, m=m: grads(
                    lambda q, k, v: m.attention(q, k, v, causal=causal, impl="pallas",
                                                launch=launch), q, k, v, do))(q, k, v, do)
                        for m in (jf, old)]
                for name, a, b in zip(("O", "dQ", "dK", "dV"), *outs):
                    bw, _, md = stats(a, b)
                    print(f"| {shape} | {causal} | {launch} | {name} | {bw:.3f} | {md:.2e} |")
                sys.stdout.flush()


if __name__ == "__main__":
    print("jax", jax.__version__, jax.devices()[0].device_kind)
    for what in sys.argv[1:] or ["order", "dropin"]:
        if what.startswith("same="):
            same(what.split("=", 1)[1])
        else:
            {"order": order, "dropin": dropin}[what]()
