"""lab.warm_order on the CPU with stand-in implementations on a fake clock: which ones it times,
the settings it alternates, and the summary it prints."""

import numpy as np

from bench import attention as ba
from lab import warm_order


def test_times_all_but_paper_without_and_with_warm_up(monkeypatch):
    """Each setting (no warm-up, W ms) runs ``repeats`` times; "paper" is left out; cuDNN's
    stand-in takes twice fa2's, so every run's paired ratio reads 2 and the summary says so."""
    now, called = [0.0], set()
    monkeypatch.setattr(ba.time, "perf_counter", lambda: now[0])

    def takes(name, seconds):
        def f(q, k, v):
            called.add(name)
            now[0] += seconds
            return q
        return f

    impls = [("jax_flash", "fa2", False, takes("fa2", 0.004)),
             ("jax_flash", "paper", False, takes("paper", 0.5)),
             ("cudnn", None, None, takes("cudnn", 0.008))]
    monkeypatch.setattr(ba, "_jax_impls", lambda causal: iter(impls))
    monkeypatch.setattr(ba, "_jax_pass", lambda f, pss: f)
    result = warm_order.run((1, 16, 1, 8), warm_ms=20, repeats=2, rounds=3, reps=2,
                            log=lambda m: None)
    assert called == {"fa2", "cudnn"}
    runs = result["runs"]
    assert list(runs) == ["0.0", "20.0"] and all(len(r) == 2 for r in runs.values())
    for one in runs["0.0"] + runs["20.0"]:
        cudnn, fa2 = (np.asarray(one["rounds_ms"][n]) for n in (warm_order.CUDNN, warm_order.FA2))
        np.testing.assert_allclose(cudnn / fa2, 2.0)
    rows = warm_order.summary(result).splitlines()[2:]
    assert [r.split(" | ")[0] for r in rows] == ["| 0", "| 0", "| 20", "| 20"]
    assert all("2.000 (2.000 … 2.000)" in r for r in rows)
