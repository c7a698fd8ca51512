"""Does an XLA flag change a bit on the CPU? Before a flag that speeds up compilation goes into the
test targets: the same programs (attention forward and gradients per policy, executor and stable
flag; a tiny GPT-2 loss and gradient) run in two processes, with XLA's defaults and with the flag,
and the SHA-256 of every output is compared. (LLVM's optimisation level 0 cuts the suite's time by
a third and changes bits in 13 of these 18 programs; level 1 changes none of them, yet three
bitwise tests of the suite — stochastic rounding's dither, the stored O's δ — fail under it.)

    PYTHONPATH=$PWD python -m lab.flag_bits --flag=--xla_backend_optimization_level=0
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys



def digests() -> dict[str, str]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_flash as jf

    def sha(tree) -> str:
        h = hashlib.sha256()
        for x in jax.tree_util.tree_leaves(tree):
            h.update(np.asarray(x).tobytes())
        return h.hexdigest()[:16]

    rng = np.random.default_rng(0)
    shape = (2, 200, 4, 64)
    q, k, v, do = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(4))
    out = {}
    for policy in ("fa2", "paper", "fp32", "fp32_bf16x6"):
        for impl in ("jnp", "pallas"):
            for stable in (False, True):
                f = lambda q, k, v: jf.attention(q, k, v, policy=policy, impl=impl, stable=stable,
                                                 causal=True)
                o, vjp = jax.vjp(jax.jit(f), q, k, v)
                out[f"attention {policy} {impl} stable={stable}"] = sha((o, vjp(do)))
    f32 = lambda x: x.astype(jnp.float32)
    o = jax.nn.dot_product_attention(f32(q), f32(k), f32(v), is_causal=True)
    out["jax.nn.dot_product_attention f32"] = sha(o)

    from flax import nnx

    from models.gpt2 import GPT, cross_entropy
    from train.config import get_preset

    cfg = get_preset("tiny-cpu").model
    model = GPT(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 65)), jnp.int32)

    @nnx.jit
    def loss_and_grad(model, tokens):
        return nnx.value_and_grad(lambda m: cross_entropy(m(tokens[:, :-1]), tokens[:, 1:]))(model)

    value, grads = loss_and_grad(model, tokens)
    out["tiny GPT-2 loss and gradient"] = sha((value, nnx.state(grads)))
    return out


def main() -> int:
    if "--child" in sys.argv:
        print(json.dumps(digests()))
        return 0
    flags = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--flag=")]
    if not flags:
        sys.exit("usage: python -m lab.flag_bits --flag=--xla_some_flag=value")
    flag = flags[0]
    base = os.environ.get("XLA_FLAGS", "").replace(flag, "").strip()
    runs = {}
    for name, xla_flags in (("default", base), ("flag", f"{flag} {base}".strip())):
        env = dict(os.environ, XLA_FLAGS=xla_flags)
        proc = subprocess.run([sys.executable, "-m", "lab.flag_bits", "--child"], env=env,
                              capture_output=True, text=True, check=True)
        runs[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    same = 0
    for key, digest in runs["default"].items():
        other = runs["flag"][key]
        print(f"{'same' if digest == other else 'DIFFERENT':9s} {key}: {digest} {other}")
        same += digest == other
    print(f"{same} of {len(runs['default'])} programs bitwise equal with {flag} and without")
    return 0 if same == len(runs["default"]) else 1


if __name__ == "__main__":
    sys.exit(main())
