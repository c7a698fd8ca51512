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
               clock: Callable[[], float] = time.perf_counter,
               wall: Callable[[], float] = time.time) -> dict:
    """``warmup`` steps, then ``steps`` steps each waited for (a sample each: dispatch to done), then
    ``steps`` more dispatched back to back and waited for once (the host's dispatch hidden behind the
    device, as in a training loop that never waits). Times in ms; ``first_ms`` is the first warm-up
    step's (for a lazily compiling framework, the compilation). ``call_ms``: the median time a
    waited step's call took to return, the host's share of it where the framework launches before
    returning (JAX's dispatch of its arguments and outputs). ``phases_wall_s``: the wall-clock
    (``time.time``) bounds of the waited and the back-to-back steps, for ``GpuMonitor.summary``."""
    first = None
    for i in range(warmup):
        t0 = clock()
        sync(step())
        if i == 0:
            first = (clock() - t0) * 1e3
    samples, calls = [], []
    w0 = wall()
    for _ in range(steps):
        t0 = clock()
        handle = step()
        calls.append((clock() - t0) * 1e3)
        sync(handle)
        samples.append((clock() - t0) * 1e3)
    w1 = wall()
    t0 = clock()
    handle = None
    for _ in range(steps):
        handle = step()
    sync(handle)
    back_to_back = (clock() - t0) * 1e3 / steps if steps else None
    return {"step_ms": spread(samples), "step_times_ms": samples, "back_to_back_ms": back_to_back,
            "call_ms": float(np.median(calls)) if calls else None,
            "first_ms": first, "phases_wall_s": {"waited": [w0, w1], "back_to_back": [w1, wall()]}}


# ----------------------------------------------------------------------------- clocks and power
SMI_FIELDS = ("clocks.sm", "power.draw", "temperature.gpu", "clocks_event_reasons.active")
POWER_CAP, THERMAL = 0x4, 0x20 | 0x40  # event reasons: software power cap; software, hardware thermal


class GpuMonitor:
    """``nvidia-smi`` sampled every ``interval_ms`` in the background, each sample stamped with the
    host's ``time.time()`` as it arrives: the SM clock, power and temperature over a window of a
    run (``summary``). On a machine without nvidia-smi it records nothing (``available`` False)."""

    def __init__(self, interval_ms: int = 100, gpu: int = 0):
        import shutil
        import subprocess
        import threading

        self.samples: list[tuple[float, list[str]]] = []
        self.power_limit_w = None
        self.proc = None
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return
        try:
            self.power_limit_w = float(subprocess.run(
                [exe, "-i", str(gpu), "--query-gpu=power.limit", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=20).stdout.split()[0])
        except (subprocess.SubprocessError, OSError, ValueError, IndexError):
            pass
        self.proc = subprocess.Popen(
            [exe, "-i", str(gpu), "--query-gpu=" + ",".join(SMI_FIELDS),
             "--format=csv,noheader,nounits", "-lms", str(interval_ms)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    @property
    def available(self) -> bool:
        return self.proc is not None

    def _read(self):
        for line in self.proc.stdout:
            self.samples.append((time.time(), [c.strip() for c in line.split(",")]))

    def summary(self, t0: float, t1: float) -> dict | None:
        """Over the samples between wall times t0 and t1: their count, the SM clock's median and
        minimum (MHz), the power's median and maximum (W), the temperature's maximum (°C) and the
        shares of samples with the power cap and with a thermal slowdown active."""
        return summarize_smi([r for t, r in list(self.samples) if t0 <= t <= t1])

    def close(self):
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except Exception:  # noqa: BLE001 - the sampler is best effort
                self.proc.kill()


def summarize_smi(rows: list[list[str]]) -> dict | None:
    """``GpuMonitor.summary`` of rows of ``SMI_FIELDS`` values (a row that does not parse is left
    out)."""
    parsed = []
    for r in rows:
        try:
            parsed.append((float(r[0]), float(r[1]), float(r[2]), int(r[3], 16)))
        except (ValueError, IndexError):
            continue
    if not parsed:
        return None
    mhz, watts, temp, why = zip(*parsed)
    n = len(parsed)
    return {"samples": n, "sm_mhz_median": statistics.median(mhz), "sm_mhz_min": min(mhz),
            "power_w_median": statistics.median(watts), "power_w_max": max(watts),
            "temp_c_max": max(temp), "power_cap_share": sum(1 for w in why if w & POWER_CAP) / n,
            "thermal_share": sum(1 for w in why if w & THERMAL) / n}
