"""The model's row kernels (the fused LayerNorm's backward, the Pallas loss, the GELU) timed alone at the GPT-2
step's shapes, variants interleaved in one process.

    python -m lab.row_kernels [--tokens 32768] [--variants SPEC,...] [--rounds 6] [--reps 20]
        [--out FILE.json]                               # on the GPU
    python -m lab.row_kernels --from-json FILE.json     # the table again (any machine)
    python -m lab.row_kernels --pick FILE.json ... [--write]  # the faster launch constants

A variant is ``KIND`` or ``KIND:key=value;key=value`` with KIND one of
- ``ln-fwd``, ``ln-bwd``: ``models.layernorm``'s fused residual addition and LayerNorm, forward
  and backward, ``[tokens, 768]`` (keys: ``rows``, rows a program; ``sub``, rows a step of its
  loop; ``warps``; ``stages``, Triton's pipeline depth; ``reload=1``, the backward's second pass
  reading the rows again instead of holding them);
- ``ce-fwd``, ``ce-fused``: ``models.loss_kernels``' statistics kernel, and the statistics and
  gradient in one kernel (the training forward's), on bf16 logits ``[tokens, 50304]`` (keys:
  ``rows``, ``chunk``, ``warps``, ``stages``; ``ex2=0``, exp by ``jnp.exp`` instead of
  ``EX2_APPROX``'s instruction, other last bits; ``fixup=1``, ce-fused's gradient walk without
  the target's compare, each target entry written after it, ``TARGET_FIXUP``: no value changes);
- ``gelu-fwd``, ``gelu-bwd``: ``models.gelu_kernels`` (the erf-form GELU and its input
  gradient) on bf16 ``[tokens, 3072]`` (keys: ``rows``, ``warps``; ``rcp=0``, the quotient as a
  division instead of ``RCP_QUOTIENT``'s reciprocal; elementwise: no value changes; ``ex2=0``, the
  backward's φ by libdevice's expf instead of ``EX2_APPROX``'s instruction, other last bits);
- ``xla-ce``: XLA's loss of the bf16 logits, forward and backward (``models.gpt2.cross_entropy``),
  ``xla-ln-fwd``, ``xla-ln-bwd``: XLA's residual addition and LayerNorm, forward and backward,
  ``xla-gelu-fwd`` and ``xla-gelu-bwd``: XLA's fusions of the model's erf-form GELU and its
  gradient.
Keys left out take the shipped constants. ``rows``, ``chunk``, ``sub`` and ``warps`` change the
order of FP32 sums (the reduction tree follows the layout), so a kernel's constant is chosen by
such a run and then fixed; ``stages`` does not change a value. ``--pick`` names, for the LayerNorm
passes and the loss, the launch faster than the shipped one by ``--margin`` in every run given, and
``--write`` writes it into the module's constants: a new documented default of the option.

Each round times every variant ``--reps`` calls back to back, then waits; a variant's figure is the
median over rounds, with the bytes it must move (each input read and each output written once)
over that time as the effective bandwidth.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import numpy as np

DEFAULT_VARIANTS = (
    "ln-fwd,ln-fwd:rows=64;sub=8,xla-ln-fwd,"
    "ln-bwd,ln-bwd:warps=4,ln-bwd:sub=2,ln-bwd:sub=4;warps=8,ln-bwd:sub=8;warps=8,xla-ln-bwd,"
    "ce-fwd,ce-fwd:warps=2,ce-fwd:rows=2;warps=2,ce-fwd:chunk=512,ce-fwd:chunk=2048;warps=2,"
    "ce-fwd:stages=1,ce-fwd:stages=3,ce-fused,ce-fused:warps=2,ce-fused:rows=2;warps=2,"
    "ce-fused:chunk=512,ce-fused:chunk=2048;warps=2,ce-fused:stages=1,ce-fused:stages=3,xla-ce,"
    "xla-gelu-fwd,gelu-fwd,gelu-fwd:rows=8,gelu-fwd:rows=32,xla-gelu-bwd,gelu-bwd,"
    "gelu-bwd:rows=16,gelu-bwd:rows=4")
D_MODEL, VOCAB = 768, 50304


def parse(spec: str) -> tuple[str, dict]:
    kind, _, rest = spec.partition(":")
    kw = {}
    for item in filter(None, rest.split(";")):
        k, _, v = item.partition("=")
        kw[k] = None if v == "none" else int(v) if v.lstrip("-").isdigit() else v
    return kind, kw


# each kind's launch keys (``parse``'s) and how each value is read; XLA's kinds take none
KEYS = {"ln-fwd": ("rows", "sub", "warps", "stages"),
        "ln-bwd": ("rows", "sub", "warps", "stages", "reload"),
        "ce-fwd": ("rows", "chunk", "warps", "stages", "ex2"),
        "ce-fused": ("rows", "chunk", "warps", "stages", "ex2", "fixup"),
        "gelu-fwd": ("rows", "warps", "rcp"), "gelu-bwd": ("rows", "warps", "rcp", "ex2")}
FLAGS = ("reload", "ex2", "rcp", "fixup")


def launch_kwargs(kind: str, kw: dict) -> dict:
    """The kernel's keyword arguments for a variant's keys: switches as booleans, the rest as
    given; a key the kind does not take is an error (a silently dropped key would time the
    shipped kernel under the variant's name)."""
    unknown = set(kw) - set(KEYS.get(kind, ()))
    if unknown:
        raise ValueError(f"{kind} takes no {sorted(unknown)}; its keys: {KEYS.get(kind, ())}")
    return {k: bool(v) if k in FLAGS else v for k, v in kw.items()}


def build(spec: str, tokens: int, vocab: int = VOCAB):
    """(jitted function, its arguments, bytes it must move) for one variant (the loss's at
    ``vocab`` columns)."""
    import jax
    import jax.numpy as jnp

    from models import gpt2, layernorm, loss_kernels as lk

    kind, kw = parse(spec)
    launch = launch_kwargs(kind, kw)
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    # inputs made once per shape: every variant of a kind reads the same arrays (and the device
    # holds one copy of the 3.3 GB logits, not one a variant)
    cached = functools.partial(_cached, tokens)
    if kind in ("ln-bwd", "xla-ln-bwd", "ln-fwd", "xla-ln-fwd"):
        s, r, w, dy, gs = cached("ln", lambda: (
            jax.random.normal(k1, (tokens, D_MODEL), jnp.float32),
            jax.random.normal(k2, (tokens, D_MODEL), jnp.bfloat16),
            1.0 + 0.1 * jax.random.normal(k3, (D_MODEL,), jnp.float32),
            jax.random.normal(k4, (tokens, D_MODEL), jnp.bfloat16),
            jax.random.normal(k1, (tokens, D_MODEL), jnp.float32)))
        if kind in ("ln-fwd", "xla-ln-fwd"):
            moved = tokens * D_MODEL * (4 + 2 + 4 + 2)  # x, r in; s, y out
            if kind == "ln-fwd":
                f = jax.jit(functools.partial(layernorm._add_forward, eps=1e-5,
                                              out_dtype=jnp.dtype(jnp.bfloat16), **launch))
                return f, (s, r, w), moved
            return jax.jit(_xla_add_ln), (s, r, w), moved
        moved = tokens * D_MODEL * (4 + 2 + 4 + 4 + 2)  # s, dy, gs in; ds, dr out
        if kind == "ln-bwd":
            _, _, mean, rstd = jax.jit(layernorm._add_forward, static_argnums=(3, 4))(
                s, r, w, 1e-5, jnp.dtype(jnp.bfloat16))
            f = jax.jit(functools.partial(layernorm._add_backward, r_dtype=jnp.bfloat16,
                                          **launch))
            return f, (s, w, mean, rstd, dy, gs), moved

        def xla(x, r, w, dy, gs):
            _, vjp = jax.vjp(lambda x, r: _xla_add_ln(x, r, w), x, r)
            return vjp((gs, dy))

        return jax.jit(xla), (s, r, w, dy, gs), moved
    if kind in ("gelu-fwd", "gelu-bwd", "xla-gelu-fwd", "xla-gelu-bwd"):
        from models import gelu_kernels as gk

        h, g = cached("gelu", lambda: (
            jax.random.normal(k1, (tokens, 4 * D_MODEL), jnp.bfloat16) * 2,
            jax.random.normal(k2, (tokens, 4 * D_MODEL), jnp.bfloat16)))
        one = tokens * 4 * D_MODEL * 2
        if kind == "gelu-fwd":
            launch = dict(rows=gk.FWD_ROWS, warps=gk.FWD_WARPS) | launch
            f = functools.partial(gk._blocks, gk._fwd_kernel, "model_gelu_fwd", h.dtype, **launch)
            return jax.jit(f), (h,), 2 * one
        if kind == "gelu-bwd":
            launch = dict(rows=gk.BWD_ROWS, warps=gk.BWD_WARPS) | launch
            f = functools.partial(gk._blocks, gk._bwd_kernel, "model_gelu_bwd", h.dtype, **launch)
            return jax.jit(f), (h, g), 3 * one
        fwd = jax.jit(functools.partial(gpt2._gelu, form="erf"))
        if kind == "xla-gelu-fwd":
            return fwd, (h,), 2 * one
        bwd = jax.jit(lambda h, g: jax.vjp(
            functools.partial(gpt2.gelu_from_input, form="erf"), h)[1](g)[0])
        return bwd, (h, g), 3 * one
    logits, targets = cached(f"ce{vocab}", lambda: (
        jax.random.normal(k1, (tokens, vocab), jnp.bfloat16) * 3,
        jax.random.randint(k2, (tokens,), 0, vocab)))
    n_bytes = tokens * vocab * 2
    if kind == "ce-fwd":
        return jax.jit(functools.partial(lk.row_stats, **launch)), (logits, targets), n_bytes
    g_rows = jnp.full((tokens,), 1.0 / tokens, jnp.float32)
    if kind == "ce-fused":
        f = jax.jit(functools.partial(lk.row_stats_and_grad, **launch))
        return f, (logits, targets, g_rows), 2 * n_bytes
    if kind == "xla-ce":
        f = jax.jit(jax.value_and_grad(lambda x, t: gpt2.cross_entropy(x, t, "xla")))
        return f, (logits, targets), 2 * n_bytes
    raise ValueError(f"unknown variant kind {kind!r} in {spec!r}")


_INPUTS: dict = {}


def _cached(tokens, group, make):
    if (group, tokens) not in _INPUTS:
        _INPUTS[(group, tokens)] = make()
    return _INPUTS[(group, tokens)]


def _xla_ln(x, w, eps=1e-5):
    import jax.numpy as jnp

    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * (1.0 / jnp.sqrt(var + eps)) * w


def _xla_add_ln(x, r, w):
    """XLA's residual addition (r upcast) and LayerNorm in bf16: the sum and the normalised row."""
    import jax.numpy as jnp

    t = x + r.astype(jnp.float32)
    return t, _xla_ln(t, w).astype(jnp.bfloat16)


def run(variants, tokens, rounds, reps):
    import jax

    built, failed = {}, {}
    for spec in variants:
        try:
            f, args, moved = build(spec, tokens)
            jax.block_until_ready(f(*args))  # compile, warm
            built[spec] = (f, args, moved)
        except Exception as e:  # noqa: BLE001  (a variant the compiler refuses is reported)
            failed[spec] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            print(f"[{spec}] failed: {failed[spec]}", file=sys.stderr, flush=True)
    times = {spec: [] for spec in built}
    for _ in range(rounds):
        for spec, (f, args, _) in built.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                out = f(*args)
            jax.block_until_ready(out)
            times[spec].append((time.perf_counter() - t0) / reps * 1e3)
    dev = jax.devices()[0]
    recs = [{"variant": spec, "ms": float(np.median(t)), "ms_rounds": t,
             "gb_per_s": built[spec][2] / (np.median(t) * 1e-3) / 1e9, "bytes": built[spec][2]}
            for spec, t in times.items()]
    return {"what": "model row kernels timed alone (lab.row_kernels)", "tokens": tokens,
            "rounds": rounds, "reps": reps, "jax_version": jax.__version__,
            "device": dev.device_kind, "records": recs, "failed": failed}


# each kind whose launch lives in module constants: the module, and its constant for each key
CONSTANTS = {"ln-fwd": ("layernorm", {"rows": "BLOCK_ROWS", "sub": "FWD_SUB_ROWS",
                                      "warps": "NUM_WARPS", "stages": "FWD_NUM_STAGES"}),
             "ln-bwd": ("layernorm", {"rows": "BWD_BLOCK_ROWS", "sub": "BWD_SUB_ROWS",
                                      "warps": "BWD_NUM_WARPS", "stages": "BWD_NUM_STAGES",
                                      "reload": "BWD_RELOAD"}),
             # the loss's constants serve its statistics kernel too
             "ce-fused": ("loss_kernels", {"rows": "BLOCK_ROWS", "chunk": "CHUNK",
                                           "warps": "NUM_WARPS", "stages": "NUM_STAGES"})}


def shipped(kind: str) -> dict:
    """The launch ``kind`` runs with now, read from its module's constants."""
    import importlib

    module, names = CONSTANTS[kind]
    mod = importlib.import_module(f"models.{module}")
    return {key: getattr(mod, name) for key, name in names.items()}


def pick(results, kind: str, margin: float = 0.03):
    """The variant of ``kind`` whose worst speed-up over the shipped launch (the bare ``kind``)
    across ``results`` (runs at several token counts) is largest, if that is at least ``1 +
    margin``: (spec, its whole launch, worst speed-up per run); else None. Variants missing from
    a run, or setting keys that are not launch constants (``ex2``, ``fixup``), do not count."""
    base, keys = shipped(kind), CONSTANTS[kind][1]
    ms = [{r["variant"]: r["ms"] for r in res["records"]} for res in results]
    if not all(kind in m for m in ms):
        raise ValueError(f"pick: every run needs the shipped variant {kind!r}")
    best = None
    for spec in ms[0]:
        parsed_kind, launch = parse(spec)
        if (parsed_kind != kind or spec == kind or not set(launch) <= set(keys)
                or not all(spec in m for m in ms)):
            continue
        gains = [m[kind] / m[spec] for m in ms]
        if best is None or min(gains) > min(best[2]):
            best = (spec, {**base, **launch}, gains)
    if best is None or min(best[2]) < 1 + margin:
        return None
    return best


def write_constants(kind: str, launch: dict, path=None) -> str:
    """Rewrite the constants of ``kind`` in its module (``models/<module>.py``) to ``launch``;
    returns the text."""
    import re
    from pathlib import Path

    module, names = CONSTANTS[kind]
    path = Path(path or Path(__file__).resolve().parents[1] / "models" / f"{module}.py")
    text = path.read_text()
    for key, name in names.items():
        value = bool(launch[key]) if key == "reload" else int(launch[key])
        text, n = re.subn(rf"^{name} = (\d+|True|False)\b", f"{name} = {value}", text,
                          flags=re.M)
        if n != 1:
            raise ValueError(f"{name} is not assigned once in {path}")
    path.write_text(text)
    return text


def table(res) -> str:
    lines = [f"Row kernels alone, {res['tokens']} tokens, {res['device']}, jax {res['jax_version']}"
             f" (median of {res['rounds']} rounds of {res['reps']} calls)", "",
             "| variant | ms | GB/s moved |", "|---|---|---|"]
    for r in res["records"]:
        lines.append(f"| `{r['variant']}` | {r['ms']:.4f} | {r['gb_per_s']:,.0f} |")
    for spec, why in res.get("failed", {}).items():
        lines.append(f"| `{spec}` | failed: {why} | |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lab.row_kernels",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    ap.add_argument("--from-json")
    ap.add_argument("--pick", nargs="+", metavar="FILE.json",
                    help="runs at several token counts: the LayerNorm and loss launches faster "
                         "than the shipped ones in every run by --margin (no GPU)")
    ap.add_argument("--margin", type=float, default=0.03)
    ap.add_argument("--write", action="store_true",
                    help="with --pick: write them into the modules' constants")
    args = ap.parse_args(argv)
    if args.from_json:
        print(table(json.load(open(args.from_json))))
        return
    if args.pick:
        results = [json.load(open(f)) for f in args.pick]
        for kind in CONSTANTS:
            if not all(any(r["variant"] == kind for r in res["records"]) for res in results):
                continue  # not timed
            best = pick(results, kind, args.margin)
            if best is None:
                print(f"{kind}: the shipped launch stays (nothing faster by {args.margin:.0%} "
                      "in every run)")
                continue
            spec, launch, gains = best
            print(f"{kind}: {spec} ({launch}), speed-up " + ", ".join(
                f"x{g:.3f} at {r['tokens']} tokens" for g, r in zip(gains, results)))
            if args.write:
                write_constants(kind, launch)
        return
    res = run(args.variants.split(","), args.tokens, args.rounds, args.reps)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(table(res))


if __name__ == "__main__":
    main()
