"""How far does another FP32 order inside the matrix products move the outputs, on any machine?

    python -m lab.product_order                      # T 2048 and 8192, head_dim 64 and 128
    python -m lab.product_order --shapes 1x2048x2x128

The jnp executor against itself with every tile product (S = Q·Kᵀ, dP = dO·Vᵀ, P̄·V, dS·K, …)
summed in another order: the contraction split in two halves, each an FP32 product, then added.
The numerics spec is unchanged (the same rounding points, tiles and flags), exactly as between the
jnp executor and a GPU kernel whose MMA orders its additions its own way. The table gives the same
shares as ``python -m lab.gpu_checks order`` (bitwise, within one BF16 ulp), so the two can be read
side by side: a share this check reproduces without any GPU is a property of the arithmetic, not of
a kernel.
"""

from __future__ import annotations

import argparse
import contextlib

import jax
import jax.numpy as jnp
from jax import lax

import jax_flash as jf
from jax_flash import tile
from lab.gpu_checks import grads, randn, stats


def _halves_dot(a, b, dims, pol):
    """``tile._dot`` with the contraction summed as two half-products added in FP32."""
    (ca, cb), batch = dims
    n = a.shape[ca[0]]
    if n < 2 or pol.fp32_dots:
        return _ORIGINAL(a, b, dims, pol)
    h = n // 2
    parts = []
    for lo, hi in ((0, h), (h, n)):
        sa = lax.slice_in_dim(a, lo, hi, axis=ca[0])
        sb = lax.slice_in_dim(b, lo, hi, axis=cb[0])
        parts.append(lax.dot_general(sa, sb, dims, preferred_element_type=jnp.float32))
    return parts[0] + parts[1]


_ORIGINAL = tile._dot


@contextlib.contextmanager
def reordered_products():
    tile._dot = _halves_dot
    try:
        yield
    finally:
        tile._dot = _ORIGINAL


def run(shape, causal=True, policy="fa2"):
    q, k, v, do = (randn(s, shape) for s in (1, 2, 3, 4))

    def f(q, k, v, do):
        return grads(lambda q, k, v: jf.attention(q, k, v, impl="jnp", causal=causal,
                                                  policy=policy), q, k, v, do)

    base = jax.jit(f)(q, k, v, do)
    with reordered_products():
        other = jax.jit(lambda *a: f(*a))(q, k, v, do)  # a new function: traced again, patched
    return [(name, *stats(a, b)) for name, a, b in zip(("O", "dQ", "dK", "dV"), other, base)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+",
                    default=["1x2048x2x64", "1x2048x2x128", "1x8192x2x64", "1x8192x2x128"])
    ap.add_argument("--policy", default="fa2")
    args = ap.parse_args(argv)
    print("jax", jax.__version__, jax.devices()[0].device_kind, "policy", args.policy, "causal")
    print("| shape | out | bitwise % | ≤ 1 ulp % | max diff / max |ref| |")
    print("|---|---|---|---|---|")
    for s in args.shapes:
        shape = tuple(int(x) for x in s.split("x"))
        for name, bw, w1, md in run(shape, policy=args.policy):
            print(f"| {shape} | {name} | {bw:.3f} | {w1:.4f} | {md:.2e} |", flush=True)


if __name__ == "__main__":
    main()
