"""Side-by-side attention speed on one GPU: jax-flash policies vs cuDNN, XLA, JAX's Pallas mha and
PyTorch's flash kernel, plus compiled memory footprints.

    python -m bench.attention [--shapes 32x1024x12x64,8x2048x16x128,4x8192x16x128] [--reps 30]
        [--rounds 5] [--non-causal] [--warm-ms 300] [--sample-ms 100]
        [--memory-lengths 8192,16384] [--out FILE.json] [--md OUT.md] [--plot OUT.png]
    python -m bench.attention --from-json bench/results/FILE.json --md OUT.md   # re-render, no GPU
    python -m bench.attention --dropin [--reps 30] [--rounds 5] [--out FILE.json]
        # jax_flash.dot_product_attention on GQA and a sliding window beside cuDNN (DROPIN_CASES)

Method: bfloat16 inputs; every implementation compiled and warmed up, then timed in one process,
the JAX ones of each case interleaved over ``--rounds`` rounds (``timed_interleaved``; each
sample of the implementations compared — "fa2" with and without the shift, cuDNN, cuDNN
deterministic — after
``--warm-ms`` of the same calls back to back, untimed), ≥ ``--reps`` calls each, or for a slow
reference implementation as many as fill ``--sample-ms`` a round; a figure is the median. FLOPs
count the two matrix products of the forward, 4·B·H·T²·D (half of it causal), and the backward as
2.5 forwards (fwd+bwd: 3.5×), so every implementation is divided by the same work whatever it
computes. Interpretation of the results: docs/PERFORMANCE.md.
Records:
``{"impl", "policy", "stable", "shape", "causal", "pass", "ms", "tflops", "jax_version", "device",
"sync", "calls", "rounds_ms", ...}`` (``warm_ms`` on the records that had the warm-up)
with impl in jax_flash, cudnn, cudnn_deterministic, xla, jax_pallas_mha, torch_flash (the last two
when importable). Memory
(``…-memory.json`` beside it): ``{"impl", "pass": "fwd+bwd", "shape", "temp_bytes", ...}`` from the
compiled executable's ``memory_analysis()`` — flash attention should need nothing quadratic in T.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash as jf


def _timed(f, args, reps, sync=jax.block_until_ready, calls=1):
    """Median ms of ``reps`` samples; a sample is ``calls`` calls dispatched back to back, then one
    sync, divided by ``calls``."""
    sync(f(*args))  # compile + warm-up
    sync(f(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sync([f(*args) for _ in range(calls)])
        times.append((time.perf_counter() - t0) / calls)
    return float(np.median(times)) * 1e3


def timed_interleaved(fns, args, reps, rounds, log=print, sync="call", per_round=None,
                      warm_ms=0.0, warm=None, sample_ms=0.0, calls=None):
    """{name: median ms} of every compiled fn in ``fns``, timed in ``rounds`` interleaved rounds of
    ``reps`` calls each. Interleaving spreads the host's and the GPU's drift over all of them alike
    (timed one after another, a fn inherits whatever state the GPU was in during its turn, e.g. its
    clocks falling as it warms). Odd rounds run the fns in reverse order, so that no fn always
    follows the same one (a heavy neighbour slows what runs right after it). A fn that fails to
    compile is logged and left out.

    ``sync="call"``: every call is a sample, waited for on its own (``rounds × reps`` samples; each
    includes the per-call dispatch and sync on the host).
    ``sync="round"``: a round's ``reps`` calls are dispatched back to back and waited for once; the
    sample is their mean (``rounds`` samples) — the kernels' throughput, as inside a jitted step.
    ``args``: one tuple for every fn, or a dict name → tuple (e.g. float16 inputs for a kernel that
    takes no bfloat16). ``per_round``: a dict that receives, per fn, each round's ms (the median of
    its calls, or the round's mean under ``sync="round"``) — paired samples for ``python -m lab.ab
    ratio``.

    ``warm_ms``: before each sample, a fn runs back to back, untimed, for at least this long, so
    that every sample is taken in the state the fn's own sustained load brings the GPU to. Under a
    power cap a kernel timed right after a slow, low-power neighbour runs its first ~100 ms at
    higher clocks; without a warm-up that favours whatever follows the slow implementations.
    ``warm``: the names that get it (None: all), e.g. only the implementations being compared, since
    each of them is warmed whatever ran before it.

    ``sample_ms``: a fn slower than ``sample_ms / reps`` a call takes as many calls a sample as fill
    that long (at least one), so that a slow reference implementation does not take most of a run's
    time; a fn's call time is that of its waited second call. ``calls``: a dict that receives each
    fn's calls a sample."""
    arg_of = args if isinstance(args, dict) else {name: args for name in fns}
    if sync not in ("call", "round"):
        raise ValueError(f"sync must be 'call' or 'round', got {sync!r}")
    ready, call_ms = {}, {}  # call_ms: a fn's last measured time of one call, for its warm-ups
    for name, f in fns.items():
        args = arg_of[name]
        try:  # compile + warm-up
            jax.block_until_ready(f(*args))
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            call_ms[name] = (time.perf_counter() - t0) * 1e3
        except Exception as e:  # unavailable for this shape/backend: say why, go on
            log(f"{name}: failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        ready[name] = f
    times = {name: [] for name in ready}
    rounds_ms = {name: [] for name in ready}
    n_of = {name: reps if sample_ms <= 0 else
            min(reps, max(1, math.ceil(sample_ms / call_ms[name]))) for name in ready}
    if calls is not None:
        calls.update(n_of)
    for r in range(rounds):
        # odd rounds in reverse order (A B … B A): what runs right after a heavy neighbour, or early in
        # a round on a GPU the previous round left hot, changes from round to round
        for name, f in (reversed(ready.items()) if r % 2 else ready.items()):
            args, n = arg_of[name], n_of[name]
            if warm is None or name in warm:
                _warm(f, args, warm_ms, call_ms[name])
            if sync == "round":
                t0 = time.perf_counter()
                jax.block_until_ready([f(*args) for _ in range(n)])
                times[name].append((time.perf_counter() - t0) / n)
                rounds_ms[name].append(times[name][-1] * 1e3)
            else:
                for _ in range(n):
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(*args))
                    times[name].append(time.perf_counter() - t0)
                rounds_ms[name].append(float(np.median(times[name][-n:])) * 1e3)
            call_ms[name] = rounds_ms[name][-1]
    if per_round is not None:
        per_round.update(rounds_ms)
    return {name: float(np.median(t)) * 1e3 for name, t in times.items()}


def _warm(f, args, warm_ms, call_ms):
    """Run ``f`` back to back until ``warm_ms`` have passed: as many calls as ``call_ms`` (its last
    measured time of one call) says fill what is left, then one wait, again if that fell short; a
    fn slower than ``warm_ms`` runs once. Only the last call's result is kept: hundreds of results
    held at once (one per call of a fast fn) would fill the GPU's memory; the calls run in order on
    one stream, so waiting for the last waits for all."""
    t0 = time.perf_counter()
    while (left := warm_ms - (time.perf_counter() - t0) * 1e3) > 0:
        for _ in range(max(1, math.ceil(left / max(call_ms, 1e-3)))):
            out = f(*args)
        jax.block_until_ready(out)


# XLA options an implementation's programs are compiled with: under xla_gpu_deterministic_ops XLA
# asks cuDNN for its deterministic attention backward (its default one sums dQ in no fixed order)
COMPILER_OPTIONS = {"cudnn_deterministic": {"xla_gpu_deterministic_ops": True}}


def _jax_impls(causal):
    """(impl, policy, stable, fn) for every JAX implementation (``COMPILER_OPTIONS``: how some of
    them are compiled)."""
    for policy in ("fa2", "paper"):
        for stable in (False, True):
            yield "jax_flash", policy, stable, (
                lambda q, k, v, p=policy, s=stable: jf.attention(q, k, v, causal=causal, policy=p,
                                                                  stable=s))
    for impl in ("cudnn", "cudnn_deterministic", "xla"):
        yield impl, None, None, lambda q, k, v, impl=impl.partition("_")[0]: (
            jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl))
    try:
        from jax.experimental.pallas.ops.gpu import attention as pallas_mha
    except ImportError:
        return
    blocks = pallas_mha.BlockSizes(block_q=64, block_k=64, block_q_dkv=64, block_kv_dkv=64,
                                   block_q_dq=64, block_kv_dq=64)
    yield "jax_pallas_mha", None, None, lambda q, k, v: pallas_mha.mha(
        q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=causal, block_sizes=blocks)


def kernels(q, causal, policy, stable, pss="fwd") -> dict:
    """The kernels ``jf.attention`` runs for this call and pass (``jax_flash.plan``):
    ``{"fwd_kernel": ...}`` and for "fwd+bwd" also ``"bwd_kernel"`` — "mosaic", "mosaic_dkdv"
    (Mosaic dK/dV, Triton dQ) or "triton", as the tuning table's launch chooses them; "jnp" where
    the call runs on the jnp executor (off the GPU). Recorded, since the table changes them."""
    plan = jf.plan(q, q, q, causal=causal, stable=stable, policy=policy)
    names = (plan.launch.fwd_kernel, plan.launch.bwd_kernel) if plan.executor == "pallas" else \
        (plan.executor, plan.executor)
    return {"fwd_kernel": names[0], **({"bwd_kernel": names[1]} if pss != "fwd" else {})}


def _jax_pass(f, pss, compiler_options=None):
    """``pss``: "fwd" (O), "fwd+bwd" (the gradients of sum(O)) or "bwd" — the backward alone, from
    residuals the forward saved once per input (the same cotangent as "fwd+bwd"): with "fwd" beside
    it, it splits a fwd+bwd time into its parts, e.g. to see whether a faster forward reaches it.
    ``compiler_options``: XLA options for the timed programs alone (``jax.jit``'s)."""
    jit = functools.partial(jax.jit, compiler_options=compiler_options)
    if pss == "fwd":
        return jit(f)
    if pss == "bwd":
        step = jit(lambda vjp, do: vjp(do))  # vjp: a pytree (jax.tree_util.Partial) of residuals
        saved = {}

        def bwd(q, k, v):
            key = (id(q), id(k), id(v))
            if key not in saved:  # forward once per input, outside the timed calls
                o, vjp = jax.vjp(f, q, k, v)
                saved.clear()
                saved[key] = (vjp, jnp.ones(o.shape, o.dtype), (q, k, v))  # keep q, k, v: ids stay theirs
            vjp, do, _ = saved[key]
            return step(vjp, do)

        return bwd
    if pss != "fwd+bwd":
        raise ValueError(f"pass {pss!r}: fwd, fwd+bwd or bwd")
    loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32))
    return jit(jax.grad(loss, argnums=(0, 1, 2)))


def pass_flops(shape, causal, pss):
    """FLOPs of one call: 4·B·H·T²·D (Q·Kᵀ and P·V), half of it causal; fwd+bwd counted as 3.5× fwd
    (so the backward alone as 2.5×: five matrix products against the forward's two)."""
    b, t, h, d = shape
    fwd = 4.0 * b * h * t * t * d * (0.5 if causal else 1.0)
    return fwd * {"fwd": 1.0, "fwd+bwd": 3.5, "bwd": 2.5}[pss]


def _torch_records(shape, causal, passes, reps, base, rounds=1):
    """PyTorch SDPA restricted to its FlashAttention-2 backend, [B, H, T, D] layout."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    b, t, h, d = shape
    q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = []
    for pss in passes:
        def run():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = sdpa(q, k, v, is_causal=causal)
                if pss != "fwd":
                    o.float().sum().backward()
            return o

        # sync="round" (base["sync"]): `rounds` samples of reps/rounds back-to-back calls, as the JAX ones
        n, calls = (rounds, max(1, -(-reps // rounds))) if base.get("sync") == "round" else (reps, 1)
        ms = _timed(lambda: run(), (), n, sync=lambda _: torch.cuda.synchronize(), calls=calls)
        fl = pass_flops(shape, causal, pss)
        out.append(dict(base, impl="torch_flash", policy=None, stable=None, **{"pass": pss}, ms=ms,
                        tflops=fl / ms / 1e9, torch_version=torch.__version__))
    return out


def run(shapes, reps, causal_modes=(True,), passes=("fwd", "fwd+bwd"), log=print, rounds=5,
        sync="call", warm_ms=0.0, sample_ms=0.0):
    """Records for every implementation; per (shape, causal, pass) the JAX ones are timed interleaved
    (``timed_interleaved``: ``rounds`` rounds, ≥ ``reps`` calls each in all; each sample of the
    implementations compared (``ORDER_CHECKED``: "fa2" with and without the shift, cuDNN, cuDNN
    deterministic) after ``warm_ms`` of the same calls; a slower one's samples of about
    ``sample_ms``), PyTorch's after them. A record's ``calls`` is its calls a sample, ``warm_ms``
    there where it had the warm-up."""
    records = []
    dev = jax.devices()[0].device_kind
    per_round = max(1, -(-reps // rounds))
    for shape in shapes:
        rng = np.random.default_rng(0)
        q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3))
        for causal in causal_modes:
            base = dict(shape=list(shape), causal=causal, jax_version=jax.__version__, device=dev,
                        sync=sync, **({"sample_ms": sample_ms} if sample_ms else {}))
            impls = {(impl, policy, stable): f for impl, policy, stable, f in _jax_impls(causal)}
            for pss in passes:
                fns = {key: _jax_pass(f, pss, COMPILER_OPTIONS.get(key[0]))
                       for key, f in impls.items()}
                rounds_ms, calls = {}, {}
                ms = timed_interleaved(fns, (q, k, v), per_round, rounds, sync=sync,
                                       per_round=rounds_ms, warm_ms=warm_ms, warm=COMPARED,
                                       sample_ms=sample_ms, calls=calls,
                                       log=lambda m, p=pss, sh=shape: log(f"{sh} {p} {m}"))
                for (impl, policy, stable), t in ms.items():
                    key = (impl, policy, stable)
                    extra = kernels(q, causal, policy, stable, pss) if impl == "jax_flash" else {}
                    if warm_ms and key in COMPARED:
                        extra["warm_ms"] = warm_ms
                    records.append(dict(base, impl=impl, policy=policy, stable=stable,
                                        **{"pass": pss}, ms=t, calls=calls[key], **extra,
                                        tflops=pass_flops(shape, causal, pss) / t / 1e9,
                                        rounds_ms=rounds_ms[key]))
                    _log_record(records[-1], log)
            for rec in _torch_records(shape, causal, passes, reps, base, rounds):
                records.append(rec)
                _log_record(rec, log)
    return records


def _log_record(rec, log):
    log(f"{'x'.join(map(str, rec['shape'])):>16} causal={rec['causal']!s:5} {rec['pass']:8} "
        f"{rec['impl']:14} {str(rec['policy']):6} stable={str(rec['stable']):5} {rec['ms']:9.3f} ms "
        f"{rec['tflops']:7.1f} TFLOP/s")


def memory(lengths, batch=1, heads=16, head_dim=128, log=print):
    """Temp bytes of the compiled fwd+bwd at long sequence lengths: flash vs XLA softmax attention."""
    out = []
    for t in lengths:
        shape = (batch, t, heads, head_dim)
        args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)] * 3
        for impl, f in (("jax_flash", lambda q, k, v: jf.attention(q, k, v)),
                        ("xla", lambda q, k, v: jax.nn.dot_product_attention(
                            q, k, v, is_causal=True, implementation="xla"))):
            try:
                mem = _jax_pass(f, "fwd+bwd").lower(*args).compile().memory_analysis()
                temp = int(mem.temp_size_in_bytes)
            except Exception as e:
                log(f"memory {impl} T={t}: failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            out.append(dict(impl=impl, shape=list(shape), **{"pass": "fwd+bwd"}, temp_bytes=temp,
                            quadratic_bytes=batch * heads * t * t * 4))
            log(f"memory T={t:6d} {impl:10} temp {temp / 2**20:10.1f} MiB "
                f"(one FP32 T×T score matrix: {batch * heads * t * t * 4 / 2**20:.0f} MiB)")
    return out


def markdown(records, mem=()):
    """A table per shape: impl rows × (fwd, fwd+bwd) TFLOP/s, plus the memory table."""
    lines = []
    keyf = lambda r: (r["impl"], str(r["policy"]), str(r["stable"]))
    for shape in dict.fromkeys(tuple(r["shape"]) for r in records):
        for causal in dict.fromkeys(r["causal"] for r in records):
            rows = [r for r in records if tuple(r["shape"]) == shape and r["causal"] == causal]
            if not rows:
                continue
            lines += [f"\n### {'×'.join(map(str, shape))}, {'causal' if causal else 'non-causal'}",
                      "| impl | policy | stable | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |",
                      "|---|---|---|---|---|---|---|"]
            for key in dict.fromkeys(keyf(r) for r in rows):
                got = {r["pass"]: r for r in rows if keyf(r) == key}
                cells = []
                for pss in ("fwd", "fwd+bwd"):
                    r = got.get(pss)
                    cells += [f"{r['ms']:.3f}", f"{r['tflops']:.0f}"] if r else ["—", "—"]
                lines.append("| " + " | ".join(list(key) + cells) + " |")
    if mem:
        lines += ["\n### Compiled fwd+bwd temp memory", "| impl | shape | temp MiB | T×T FP32 MiB |",
                  "|---|---|---|---|"]
        lines += [f"| {m['impl']} | {'×'.join(map(str, m['shape']))} | {m['temp_bytes'] / 2**20:.1f} "
                  f"| {m['quadratic_bytes'] / 2**20:.0f} |" for m in mem]
    return "\n".join(lines) + "\n"


def _record(records, shape, causal, pss, impl, policy=None, stable=None):
    for r in records:
        if (tuple(r["shape"]), r["causal"], r["pass"], r["impl"]) == (shape, causal, pss, impl) and (
                impl != "jax_flash" or (r["policy"], r["stable"]) == (policy, stable)):
            return r
    return None


def _ms(records, shape, causal, pss, impl, policy=None, stable=None):
    r = _record(records, shape, causal, pss, impl, policy, stable)
    return r["ms"] if r else None


def paired_median(a_rounds, b_rounds, n_boot=10000, seed=0):
    """Median over rounds of a/b, the rounds pairing the two (an interleaved round ran both on the
    same GPU state), and its 90 % bootstrap interval."""
    ratios = np.asarray(a_rounds, np.float64) / np.asarray(b_rounds, np.float64)
    boot = np.random.default_rng(seed).choice(ratios, (n_boot, len(ratios)))
    lo, hi = np.percentile(np.median(boot, axis=1), [5, 95])
    return float(np.median(ratios)), (float(lo), float(hi))


def _paired(a, b):
    """``paired_median`` of records a and b's per-round times; None where either has none."""
    if a and b and a.get("rounds_ms") and b.get("rounds_ms"):
        return paired_median(a["rounds_ms"], b["rounds_ms"])
    return None


def _stable_extra(records, shape, pss, causal=True):
    """The stable kernel's extra time: paired by round where the records carry per-round times
    (median of the rounds' ratios, 90 % interval), else the ratio of the two medians."""
    get = functools.partial(_record, records, shape, causal, pss, "jax_flash", "fa2")
    s, b = get(True), get(False)
    if not (s and b):
        return "—"
    if paired := _paired(s, b):
        med, (lo, hi) = paired
        return f"{100 * (med - 1):+.1f} % ({100 * (lo - 1):+.1f} … {100 * (hi - 1):+.1f})"
    return f"{100 * (s['ms'] / b['ms'] - 1):+.1f} %"


def _paired_speed(records, shape, pss, causal=True, impl="cudnn"):
    """``impl``'s time (cuDNN's) over ours (fa2, baseline) paired by round: the median of the
    rounds' ratios and its 90 % interval, "—" where the records carry no per-round times."""
    paired = _paired(_record(records, shape, causal, pss, impl),
                     _record(records, shape, causal, pss, "jax_flash", "fa2", False))
    if not paired:
        return "—"
    med, (lo, hi) = paired
    return f"{med:.3f}× ({lo:.3f} … {hi:.3f})"


def targets(records):
    """The speed targets as ratios within this run, per shape and mask (rows without the causal mask
    say so): "fa2" fwd+bwd speed over cuDNN's and over JAX's Pallas mha (and the forward's over
    cuDNN's), the stable kernel's extra time over the baseline (fwd+bwd, fwd), and fwd+bwd over
    cuDNN's default and deterministic backwards paired by round (a 90 % interval where the records
    have per-round times)."""
    lines = ["\n### Targets (ratios within this run; speed ratio = other's ms / ours)",
             "| shape | fa2 vs cuDNN, fwd+bwd | fa2 vs Pallas mha, fwd+bwd | stable extra time, fwd+bwd "
             "| stable extra time, fwd | fa2 vs PyTorch FA2, fwd+bwd | fa2 vs cuDNN, fwd "
             "| fa2 vs cuDNN, fwd+bwd, paired by round "
             "| fa2 vs cuDNN deterministic, fwd+bwd, paired by round |",
             "|---|---|---|---|---|---|---|---|---|"]
    fmt_x = lambda a, b: f"{a / b:.2f}×" if a and b else "—"
    cases = dict.fromkeys((tuple(r["shape"]), r["causal"]) for r in records)
    for shape, causal in sorted(cases, key=lambda c: not c[1]):  # the causal rows first
        ms = functools.partial(_ms, records, shape, causal)
        fa2 = ms("fwd+bwd", "jax_flash", "fa2", False)
        lines.append("| " + " | ".join([
            "×".join(map(str, shape)) + ("" if causal else ", no mask"),
            fmt_x(ms("fwd+bwd", "cudnn"), fa2),
            fmt_x(ms("fwd+bwd", "jax_pallas_mha"), fa2),
            _stable_extra(records, shape, "fwd+bwd", causal),
            _stable_extra(records, shape, "fwd", causal),
            fmt_x(ms("fwd+bwd", "torch_flash"), fa2),
            fmt_x(ms("fwd", "cudnn"), ms("fwd", "jax_flash", "fa2", False)),
            _paired_speed(records, shape, "fwd+bwd", causal),
            _paired_speed(records, shape, "fwd+bwd", causal, "cudnn_deterministic")]) + " |")
    lines.append("\nTargets: fa2 ≥ 1.0× cuDNN, forward and fwd+bwd, at every shape (≥ 1.05× fwd+bwd at "
                 "32×1024×12×64); the stable shift ≤ +4 % fwd+bwd.")
    return "\n".join(lines) + "\n"


ORDER_CHECKED = (("fa2", "jax_flash", "fa2", False), ("fa2 stable", "jax_flash", "fa2", True),
                 ("cuDNN", "cudnn", None, None),
                 ("cuDNN deterministic", "cudnn_deterministic", None, None))
# (impl, policy, stable) of the implementations the targets compare
COMPARED = frozenset(tuple(key) for _, *key in ORDER_CHECKED)


def order_check(records, pss="fwd+bwd"):
    """Per case, each of ``ORDER_CHECKED``'s median time over the rounds run in the listed order
    (the even ones) against the rounds run in reverse (``timed_interleaved``): far from 1 means the
    implementation's time depended on what ran just before it, e.g. a slow neighbour under a power
    cap (what ``--warm-ms`` is for). "—" without per-round times (or fewer than 4 rounds)."""
    head = " | ".join(label for label, *_ in ORDER_CHECKED)
    lines = [f"\n### Order check ({pss}: median of the forward-order rounds over the reversed"
             " ones)",
             f"| shape | {head} |", "|---" * (len(ORDER_CHECKED) + 1) + "|"]
    cases = dict.fromkeys((tuple(r["shape"]), r["causal"]) for r in records)
    for shape, causal in sorted(cases, key=lambda c: not c[1]):
        cells = []
        for _, impl, policy, stable in ORDER_CHECKED:
            r = _record(records, shape, causal, pss, impl, policy, stable)
            rounds = (r or {}).get("rounds_ms") or []
            cells.append(f"×{np.median(rounds[0::2]) / np.median(rounds[1::2]):.3f}"
                         if len(rounds) >= 4 else "—")
        lines.append(f"| {'×'.join(map(str, shape))}{'' if causal else ', no mask'} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


SERIES = (("jax-flash fa2", "jax_flash", "fa2", False), ("jax-flash fa2 stable", "jax_flash", "fa2", True),
          ("jax-flash paper", "jax_flash", "paper", False), ("cuDNN", "cudnn", None, None),
          ("cuDNN deterministic", "cudnn_deterministic", None, None),
          ("PyTorch FA2", "torch_flash", None, None), ("JAX Pallas mha", "jax_pallas_mha", None, None),
          ("XLA", "xla", None, None))


def plot_series(records, pss):
    """The bars of one panel: the causal shapes in record order and, per implementation that has
    any, its TFLOP/s per shape (None where it has no record)."""
    shapes = list(dict.fromkeys(tuple(r["shape"]) for r in records if r["causal"]))
    series = {}
    for label, impl, policy, stable in SERIES:
        vals = []
        for shape in shapes:
            ms = _ms(records, shape, True, pss, impl, policy, stable)
            vals.append(pass_flops(shape, True, pss) / ms / 1e9 if ms else None)
        if any(v is not None for v in vals):
            series[label] = vals
    return shapes, series


def plot(records, path, title=""):
    """Grouped bars, causal fwd and fwd+bwd TFLOP/s per shape and implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2), sharey=True)
    for ax, pss in zip(axes, ("fwd", "fwd+bwd")):
        shapes, series = plot_series(records, pss)
        width = 0.8 / max(len(series), 1)
        for i, (label, vals) in enumerate(series.items()):
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(shapes))]
            bars = ax.bar(xs, [v or 0 for v in vals], width, label=label)
            ax.bar_label(bars, labels=[f"{v:.0f}" if v else "" for v in vals], fontsize=6)
        ax.set_xticks(range(len(shapes)), ["×".join(map(str, s)) for s in shapes])
        ax.set_title(f"causal {pss}")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("TFLOP/s")
    axes[1].legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    from experiments.plot_run import save_png

    save_png(fig, path, dpi=130)
    print("wrote", path)


def write_markdown(path, records, mem, source, device, version, date):
    with open(path, "w") as f:
        f.write(f"# Attention benchmarks\n\n`python -m bench.attention` on {device}, jax {version}, "
                f"{date} (`{source}`; timing: {timing_line(records)}).\n" + markdown(records, mem)
                + targets(records) + order_check(records))
    print("wrote", path)


def timing_line(records):
    """How a results file's samples were taken, in words."""
    sync = records[0].get("sync", "call") if records else "call"
    warmed = [r for r in records if r.get("warm_ms")]
    if not warmed:
        warm = ", no warm-up"
    elif all(r.get("warm_ms") for r in records if r["impl"] != "torch_flash"):
        warm = f", each sample after {warmed[0]['warm_ms']:g} ms of its own calls"
    else:
        keys = {(r["impl"], r["policy"], r["stable"]) for r in warmed}
        names = [label for label, *key in ORDER_CHECKED if tuple(key) in keys] or ["some"]
        listed = ", ".join(names[:-1]) + " and " * (len(names) > 1) + names[-1]
        warm = (f", each sample of {listed} after {warmed[0]['warm_ms']:g} ms of its own calls,"
                " the others' without")
    sample = records[0].get("sample_ms") if records else None
    if sample:
        n = max(r.get("calls", 0) for r in records)
        warm += (f"; up to {n} call{'s' * (n != 1)} a sample, a slower implementation's as many as"
                 f" fill {sample:g} ms (at least one)")
    return f"sync per {sync}{warm}"


# ----------------------------------------------------- dot_product_attention beside cuDNN
# (name, shape [B, T, N, H], kv heads, window (left, right) or None), causal, bfloat16. A window of
# 1,024 keys is (1023, 0): query i sees keys i − 1023 … i, what cuDNN's sliding_window_length = 1024
# is (jax.nn passes it left + 1).
DROPIN_CASES = (
    ("gqa", (4, 4096, 32, 128), 8, None),
    ("window1024", (2, 8192, 16, 128), 16, (1023, 0)),
    ("causal_full", (2, 8192, 16, 128), 16, None),  # the window's causal baseline
)


def visible_pairs(t, window):
    """(query, key) pairs a causal call sees at length t, with ``window`` (left, right) or None."""
    if window is None:
        return t * (t + 1) / 2
    left = window[0]
    return sum(min(i, left) + 1 for i in range(t))


def dropin_flops(shape, window, pss):
    """4·B·N·D per visible pair (Q·Kᵀ and P·V), fwd+bwd as 3.5× fwd (``pass_flops``' convention)."""
    b, t, n, d = shape
    return 4.0 * b * n * d * visible_pairs(t, window) * {"fwd": 1.0, "fwd+bwd": 3.5, "bwd": 2.5}[pss]


MOSAIC = jf.Launch(fwd_kernel="mosaic", bwd_kernel="mosaic")


def _dropin_impls(kv_heads, window, n_heads, q=None, k=None):
    """(impl, stable, fn(q, k, v)) for one case: jax-flash's drop-in (default and stable), cuDNN and
    XLA through jax.nn, for GQA jax-flash with K/V repeated by hand (what a user did before), and
    where the Hopper kernels cover the case (given ``q``, ``k`` to ask the plan) jax-flash with them
    asked for explicitly — the same numerics, another launch."""
    kw = dict(is_causal=True, local_window_size=window)
    for stable in (False, True):
        yield "jax_flash", stable, (lambda q, k, v, st=stable: jf.dot_product_attention(
            q, k, v, stable=st, **kw))
    if q is not None:
        try:
            plan = jf.dot_product_attention_plan(q, k, k, launch=MOSAIC, implementation="pallas", **kw)
        except ValueError:  # not covered, or no Hopper GPU here
            plan = None
        chosen = jf.dot_product_attention_plan(q, k, k, **kw).launch
        if plan is not None and (chosen.fwd_kernel, chosen.bwd_kernel) != ("mosaic", "mosaic"):
            for stable in (False, True):
                yield "jax_flash_mosaic", stable, (lambda q, k, v, st=stable: jf.dot_product_attention(
                    q, k, v, stable=st, launch=MOSAIC, **kw))
    for impl in ("cudnn", "xla"):
        yield impl, None, (lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
            q, k, v, implementation=impl, **kw))
    if kv_heads != n_heads and window is None:
        g = n_heads // kv_heads
        yield "jax_flash_repeat_kv", False, (lambda q, k, v: jf.attention(
            q, jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)))


def dropin(reps, rounds=5, passes=("fwd", "fwd+bwd"), log=print, sync="round", cases=DROPIN_CASES,
           warm_ms=0.0):
    """Records for ``DROPIN_CASES``: every implementation of a case and pass timed interleaved
    (``timed_interleaved``), with ``jax_flash.dot_product_attention_plan``'s executor, kernels and
    notes beside jax-flash's. Speed ratios: ``dropin_table``."""
    records = []
    dev = jax.devices()[0].device_kind
    per_round = max(1, -(-reps // rounds))
    for name, shape, kv_heads, window in cases:
        b, t, n, d = shape
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
        k, v = (jnp.asarray(rng.standard_normal((b, t, kv_heads, d)), jnp.bfloat16)
                for _ in range(2))
        plan = jf.dot_product_attention_plan(q, k, v, is_causal=True, local_window_size=window)
        ran = dict(executor=plan.executor, fwd_kernel=plan.launch.fwd_kernel,
                   bwd_kernel=plan.launch.bwd_kernel, notes=list(plan.notes))
        impls = {(impl, stable): f for impl, stable, f in _dropin_impls(kv_heads, window, n, q, k)}
        base = dict(case=name, shape=list(shape), kv_heads=kv_heads,
                    window=None if window is None else list(window), causal=True,
                    jax_version=jax.__version__, device=dev, sync=sync,
                    **({"warm_ms": warm_ms} if warm_ms else {}))
        for pss in passes:
            fns = {key: _jax_pass(f, pss) for key, f in impls.items()}
            rounds_ms = {}
            ms = timed_interleaved(fns, (q, k, v), per_round, rounds, sync=sync, per_round=rounds_ms,
                                   log=lambda m, p=pss: log(f"{name} {p} {m}"), warm_ms=warm_ms)
            for (impl, stable), t_ms in ms.items():
                rec = dict(base, impl=impl, policy="fa2" if impl.startswith("jax_flash") else None,
                           stable=stable, **{"pass": pss}, ms=t_ms,
                           tflops=dropin_flops(shape, window, pss) / t_ms / 1e9,
                           rounds_ms=rounds_ms[(impl, stable)],
                           **(ran if impl == "jax_flash" else {}))
                records.append(rec)
                log(f"{name:12} {pss:8} {impl:20} stable={str(stable):5} {t_ms:9.3f} ms "
                    f"{rec['tflops']:7.1f} TFLOP/s")
    return records


def dropin_table(records):
    """Markdown: per case and pass, every implementation's ms and cuDNN's ms over it (≥ 1: faster
    than cuDNN), with the paired-round median ratio where the records carry rounds."""
    lines = ["| case | pass | impl | stable | ms | cuDNN ms / ms |", "|---|---|---|---|---|---|"]
    for rec in records:
        cudnn = next((r for r in records if (r["case"], r["pass"], r["impl"]) ==
                      (rec["case"], rec["pass"], "cudnn")), None)
        ratio = "—"
        if cudnn and rec.get("rounds_ms") and cudnn.get("rounds_ms"):
            med, (lo, hi) = paired_median(cudnn["rounds_ms"], rec["rounds_ms"])
            ratio = f"{med:.2f} ({lo:.2f} … {hi:.2f})"
        elif cudnn:
            ratio = f"{cudnn['ms'] / rec['ms']:.2f}"
        lines.append(f"| {rec['case']} | {rec['pass']} | {rec['impl']} | {rec['stable']} | "
                     f"{rec['ms']:.3f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="32x1024x12x64,8x2048x16x128,4x8192x16x128")
    ap.add_argument("--reps", type=int, default=30, help="samples per implementation and case")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds they are spread over")
    ap.add_argument("--non-causal", action="store_true", help="also time causal=False")
    ap.add_argument("--masks", default=None, choices=("causal", "full", "causal,full"),
                    help="which masks to time (default causal; --non-causal: causal,full)")
    ap.add_argument("--sync", choices=("call", "round"), default="call",
                    help="call: wait for every call (each sample has the per-call host time in it); "
                         "round: dispatch a round's calls back to back, wait once (kernel throughput)")
    ap.add_argument("--warm-ms", type=float, default=300.0,
                    help="before each sample of fa2 (with and without the shift), cuDNN and "
                         "cuDNN deterministic, the same calls back to back, untimed, this long "
                         "(timed_interleaved: each sample in its own sustained state; 0: none)")
    ap.add_argument("--sample-ms", type=float, default=100.0,
                    help="an implementation slower than this over --reps / --rounds calls takes as "
                         "many calls a sample as fill it, at least one (0: all take the same)")
    ap.add_argument("--memory-lengths", default="8192,16384", help="'' to skip")
    ap.add_argument("--out", default=None)
    ap.add_argument("--md", default=None, help="also write the markdown tables here")
    ap.add_argument("--plot", default=None, help="also draw TFLOP/s bars (PNG) here")
    ap.add_argument("--dropin", action="store_true",
                    help="time DROPIN_CASES (jax_flash.dot_product_attention: GQA, a sliding "
                         "window) beside cuDNN and XLA instead of the shapes")
    ap.add_argument("--cases", default=None,
                    help="with --dropin: comma-separated DROPIN_CASES names (default: all)")
    ap.add_argument("--from-json", default=None,
                    help="re-render --md / --plot from a results file (and its -memory.json) without timing")
    args = ap.parse_args(argv)
    if args.from_json:
        records = json.load(open(args.from_json))
        if "case" in records[0]:  # a --dropin file: its own table
            text = dropin_table(records)
            if args.md:
                with open(args.md, "w") as f:
                    f.write(text)
            else:
                print(text)
            return
        mem_path = args.from_json.replace(".json", "-memory.json")
        mem = json.load(open(mem_path)) if os.path.exists(mem_path) else []
        r0 = records[0]
        if args.md:
            write_markdown(args.md, records, mem, args.from_json, r0["device"].replace(" ", "_"),
                           r0["jax_version"], os.path.basename(args.from_json)[:10])
        if args.plot:
            plot(records, args.plot, f"{r0['device']}, jax {r0['jax_version']} "
                                     f"({os.path.basename(args.from_json)})")
        return
    if args.dropin:
        cases = DROPIN_CASES
        if args.cases:
            names = args.cases.split(",")
            unknown = sorted(set(names) - {c[0] for c in DROPIN_CASES})
            if unknown:
                ap.error(f"--cases: unknown {unknown}; DROPIN_CASES has "
                         f"{[c[0] for c in DROPIN_CASES]}")
            cases = tuple(c for c in DROPIN_CASES if c[0] in names)
        records = dropin(args.reps, args.rounds, sync=args.sync, cases=cases, warm_ms=args.warm_ms)
        device = jax.devices()[0].device_kind.replace(" ", "_")
        out = args.out or f"bench/results/{datetime.date.today()}-{device}-dropin.json"
        with open(out, "w") as f:
            json.dump(records, f, indent=1)
        print(dropin_table(records))
        print("wrote", out)
        return
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    masks = args.masks or ("causal,full" if args.non_causal else "causal")
    modes = tuple(m == "causal" for m in masks.split(","))
    records = run(shapes, args.reps, modes, rounds=args.rounds, sync=args.sync,
                  warm_ms=args.warm_ms, sample_ms=args.sample_ms)
    mem = memory([int(t) for t in args.memory_lengths.split(",") if t])
    device = jax.devices()[0].device_kind.replace(" ", "_")
    out = args.out or f"bench/results/{datetime.date.today()}-{device}.json"
    with open(out, "w") as f:
        json.dump(records, f, indent=1)
    with open(out.replace(".json", "-memory.json"), "w") as f:
        json.dump(mem, f, indent=1)
    print("wrote", out, "and its -memory.json")
    if args.md:
        write_markdown(args.md, records, mem, out, device, jax.__version__, datetime.date.today())
    if args.plot:
        plot(records, args.plot, f"{device}, jax {jax.__version__} ({os.path.basename(out)})")


if __name__ == "__main__":
    main()
