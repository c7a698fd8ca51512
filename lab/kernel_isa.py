"""Which matrix instructions do the compiled kernels use: Hopper's warpgroup MMAs or the older path?

Runs jax-flash forward+backward once with XLA dumping its GPU modules (``--xla_dump_to`` and
``--xla_gpu_dump_llvmir``), then counts, per dumped PTX or LLVM IR file (Triton writes its MMAs into
the LLVM IR as inline PTX, so both carry the instruction names) and per kernel entry, Hopper's
asynchronous warpgroup MMAs (``wgmma.mma_async``) against the older warp-level ``mma.sync`` /
``ldmatrix`` path, and the ``ex2`` exponentials.

    python -m lab.kernel_isa [--shape 4x8192x16x128] [--policy fa2] [--stable] \
        [--entry NAME] [--out FILE.json]

``--entry NAME``: a candidate of lab/entries.json (its launch, and its tiles as call arguments)
instead of the shipped table's launch, as ``lab.ab``'s ``new@NAME``.

``isa_counts`` (PTX text in, counts out) is what the CPU test exercises.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from pathlib import Path

PATTERNS = {
    "wgmma": r"\bwgmma\.mma_async\b",
    "mma_sync": r"\bmma\.sync\b",
    "ldmatrix": r"\bldmatrix\b",
    "ex2": r"\bex2\.approx\b",
}
# a PTX kernel entry, or an LLVM IR function definition
_ENTRY = re.compile(r"^\s*(?:\.visible\s+\.entry\s+(\w+)|define\b[^@\n]*@\"?([\w.$]+))", re.M)


def isa_counts(ptx: str) -> dict[str, dict[str, int]]:
    """{kernel entry name: {pattern: count}} for every PTX ``.entry`` or LLVM IR ``define`` in a
    module's text."""
    starts = [(m.start(), m.group(1) or m.group(2)) for m in _ENTRY.finditer(ptx)]
    out = {}
    for n, (pos, name) in enumerate(starts):
        body = ptx[pos:starts[n + 1][0] if n + 1 < len(starts) else len(ptx)]
        out[name] = {k: len(re.findall(p, body)) for k, p in PATTERNS.items()}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4x8192x16x128")
    ap.add_argument("--policy", default="fa2")
    ap.add_argument("--stable", action="store_true")
    ap.add_argument("--entry", default=None, help="a candidate of lab/entries.json")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dump = tempfile.mkdtemp(prefix="jf-xla-dump-")
    # must be set before jax initialises its backend
    # (the first GPU run found no *.ptx in a plain --xla_dump_to dump: ask for the LLVM IR too)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_dump_to={dump} --xla_gpu_dump_llvmir=true").strip()
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_flash as jf
    from lab import ab

    if jax.default_backend() != "gpu":
        raise SystemExit("kernel_isa inspects compiled GPU kernels: it needs a GPU")
    shape = tuple(int(x) for x in args.shape.split("x"))
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3))
    spec = "new" + (f"@{args.entry}" if args.entry else "") + (":stable" if args.stable else "")
    kw = ab.call_kwargs(spec, ab.candidate_entries(), policy=args.policy)
    loss = lambda q, k, v: jf.attention(q, k, v, impl="pallas", **kw).astype(jnp.float32).sum()
    jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))
    kernels = {}
    files = [f for f in sorted(Path(dump).rglob("*")) if f.suffix in (".ptx", ".ll")]
    for f in files:
        for name, counts in isa_counts(f.read_text(errors="replace")).items():
            if "jax_flash" in name or any(counts.values()):
                kernels[name] = dict(counts, file=f.name)
    for name, c in kernels.items():
        print(f"{name:60s} " + "  ".join(f"{k} {c[k]}" for k in PATTERNS))
    if not kernels:
        suffixes = sorted({f.suffix for f in Path(dump).rglob("*")})
        print(f"no PTX / LLVM IR with matrix instructions under {dump} ({len(files)} such files;"
              f" suffixes there: {suffixes})")
    rec = dict(shape=list(shape), policy=args.policy, stable=args.stable, entry=args.entry,
               plan=jf.plan(q, k, v, impl="pallas", **kw).to_dict(), kernels=kernels,
               jax_version=jax.__version__, device=jax.devices()[0].device_kind)
    if args.out:
        Path(args.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
