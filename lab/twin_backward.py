"""The PyTorch twin's written-out attention backward, eager against ``torch.compile``: time per call
and how far the compiled gradients are from the eager ones, at one layer's shape.

    python -m lab.twin_backward --shape 32x12x1024x64 --out twin_backward.json

Why: the twin (``experiments.gpu.torch_train``, arms ``torch-flash-o`` / ``torch-flash-dpp``) runs
this backward eagerly, outside its compiled model, and its step takes about twice a JAX step of the
same model. Compiling it would fuse the elementwise work between the matrix products, but may
round differently in the last FP32 bits (fused exp, contracted multiply-adds, reordered row sums);
Inductor's ``emulate_precision_casts`` keeps the BF16 roundings of P and dS that the twin's
arithmetic is about (``--no-emulate-casts`` shows what moves without it). This measures speed and
distance before anything uses it. Compiles on CUDA; on a CPU only with ``--compile-on-cpu``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from experiments.torch_parity import (DELTA_CHUNK, compiled_written_out_grads, fa2_forward,
                                      written_out_grads)


def _inputs(shape, seed=0, device="cuda"):
    b, h, t, d = shape
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v, do = (torch.randn((b, h, t, d), generator=g).to(device, torch.bfloat16)
                   for _ in range(4))
    scale = d ** -0.5
    return (q, k, v, *fa2_forward(q, k, v, scale), do, scale)


def _time(fn, reps, sync):
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2], times[0]


def _diff(got, want):
    got, want = got.float(), want.float()
    scale = want.abs().max().item() or 1.0
    return {"max_abs": (got - want).abs().max().item(),
            "max_abs_over_max_ref": (got - want).abs().max().item() / scale,
            "frac_bitwise_equal": (got == want).float().mean().item()}


def run(shape, reps=10, chunk=DELTA_CHUNK, compile_=True, deltas=("o", "dpp"), on_cpu=False,
        emulate_casts=True) -> dict:
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    q, k, v, o, lse, do, scale = _inputs(shape, device=dev)
    torch.backends.cuda.matmul.allow_tf32 = True  # as FlashWithDelta.backward sets it
    out = {"what": "the twin's written-out attention backward, eager vs torch.compile (lab.twin_backward)",
           "shape_bhtd": list(shape), "chunk": chunk, "reps": reps,
           "torch_version": torch.__version__, "python": platform.python_version(),
           "device": torch.cuda.get_device_name() if cuda else "cpu", "deltas": {}}
    compiled = None
    if compile_ and (cuda or on_cpu):
        compiled = compiled_written_out_grads(emulate_casts)
        out["emulate_precision_casts"] = emulate_casts
    for delta in deltas:
        row = {}
        eager = lambda: written_out_grads(q, k, v, o, lse, do, delta, scale, chunk)
        want = eager()
        row["eager_ms_median"], row["eager_ms_min"] = _time(eager, reps, sync)
        if compiled is not None:
            comp = lambda: compiled(q, k, v, o, lse, do, delta, scale, chunk)
            t0 = time.perf_counter()
            got = comp()
            sync()
            row["compile_s"] = time.perf_counter() - t0
            row["compiled_ms_median"], row["compiled_ms_min"] = _time(comp, reps, sync)
            row["speedup"] = row["eager_ms_median"] / row["compiled_ms_median"]
            row["compiled_vs_eager"] = {n: _diff(g, w) for n, g, w in zip(("dq", "dk", "dv"), got, want)}
        out["deltas"][delta] = row
        print(delta, json.dumps(row), flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lab.twin_backward", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="32x12x1024x64", help="BxHxTxD of one layer's attention")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--chunk", type=int, default=DELTA_CHUNK)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--deltas", default="o,dpp", help="which δ: o, dpp or both")
    ap.add_argument("--compile-on-cpu", action="store_true", help="compile without CUDA too")
    ap.add_argument("--no-emulate-casts", action="store_true",
                    help="compile without Inductor's emulate_precision_casts")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    shape = tuple(int(x) for x in a.shape.split("x"))
    res = run(shape, a.reps, a.chunk, not a.no_compile, tuple(a.deltas.split(",")),
              a.compile_on_cpu, not a.no_emulate_casts)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
