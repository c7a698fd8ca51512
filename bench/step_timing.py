"""The one timing loop and the one batch maker of ``bench.train_step``, for JAX and PyTorch steps alike
(standard library and numpy only, so that the PyTorch worker imports no JAX).

``step()`` dispatches one training step and returns something to wait on; ``sync(h)`` waits until
that step (and every step before it) is done on the device.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np

GPT2_TOKENS = 50257  # token ids are drawn below GPT-2's vocabulary (the model's is padded to 50304)


def synthetic_batches(seed: int, n: int, accum: int, micro: int, seq: int, vocab: int) -> np.ndarray:
    """``n`` batches of uniform token ids, int64 [n, accum, micro, seq + 1] (inputs ``[..., :-1]``,
    targets ``[..., 1:]``): the same ids for every framework and arm given the same arguments. Speed
    does not depend on the text, and data loading is no part of the step either side."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, min(vocab, GPT2_TOKENS), (n, accum, micro, seq + 1), dtype=np.int64)


def spread(samples_ms: list[float]) -> dict:
    """Median, quartiles, min and max of step times (ms)."""
    xs = sorted(samples_ms)
    if not xs:
        return {"n": 0, "median": None, "q1": None, "q3": None, "min": None, "max": None}
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
    return {"n": len(xs), "median": statistics.median(xs), "q1": q1, "q3": q3, "min": xs[0], "max": xs[-1]}


def time_steps(step: Callable, sync: Callable, *, warmup: int, steps: int,
               clock: Callable[[], float] = time.perf_counter) -> dict:
    """``warmup`` steps, then ``steps`` steps each waited for (a sample each: dispatch to done), then
    ``steps`` more dispatched back to back and waited for once (the host's dispatch hidden behind the
    device, as in a training loop that never waits). Times in ms; ``first_ms`` is the first warm-up
    step's (for a lazily compiling framework, the compilation)."""
    first = None
    for i in range(warmup):
        t0 = clock()
        sync(step())
        if i == 0:
            first = (clock() - t0) * 1e3
    samples = []
    for _ in range(steps):
        t0 = clock()
        sync(step())
        samples.append((clock() - t0) * 1e3)
    t0 = clock()
    handle = None
    for _ in range(steps):
        handle = step()
    sync(handle)
    back_to_back = (clock() - t0) * 1e3 / steps if steps else None
    return {"step_ms": spread(samples), "step_times_ms": samples, "back_to_back_ms": back_to_back,
            "first_ms": first}
