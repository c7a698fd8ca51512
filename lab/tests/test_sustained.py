"""``lab.sustained``: a back-to-back phase runs whole chunks of calls for its time, the waited phase
as many calls each waited alone, and each phase's clock summary covers its own window."""

import jax.numpy as jnp
import pytest

from lab import sustained


class Windows:
    """A stand-in for ``GpuMonitor``: records the windows it is asked to summarise."""

    def __init__(self):
        self.windows = []

    def summary(self, t0, t1):
        self.windows.append((t0, t1))
        return {"window": len(self.windows)}


def test_phases_count_their_calls_and_windows():
    calls = []

    def g(x):
        calls.append(x)
        return jnp.zeros(())

    mon = Windows()
    n, b2b = sustained._phase(g, (1,), 0.05, None, False, mon)
    assert n > 0 and n % sustained.CHUNK == 0 and len(calls) == n == b2b["calls"]
    _, alone = sustained._phase(g, (1,), None, n, True, mon)
    assert alone["calls"] == n and len(calls) == 2 * n
    assert b2b["smi"] == {"window": 1} and alone["smi"] == {"window": 2}
    (a0, a1), (b0, b1) = mon.windows
    assert a0 < a1 <= b0 < b1


@pytest.mark.slow
def test_runs_end_to_end_on_a_cpu(tmp_path):
    out = tmp_path / "s.json"
    sustained.main(["--shape", "1x128x2x32", "--variants", "new,new:stable", "--seconds", "0.2",
                    "--rounds", "1", "--out", str(out)])
    import json

    got = json.loads(out.read_text())
    assert [r["variant"] for r in got["rows"]] == ["new", "new:stable"]
    assert all(r["waited"]["calls"] == r["back_to_back"]["calls"] > 0 for r in got["rows"])
