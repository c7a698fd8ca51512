"""Fixtures of the test suite: fixed seeds, the opt-in seed sweep, and bound recording.

Every random input comes from the ``rng`` fixture, seeded with 0: two runs give the same inputs and
the same pass/fail list. ``JAX_FLASH_SEED=<s>`` replays another seed. ``--sweep-seeds N`` (``make
test-sweep SEEDS=N``) runs every test that records a tolerance (``record_bound`` / ``assert_close``)
once per seed 0 … N − 1 in one process, and prints per test and quantity the worst observed error as
a fraction of its bound (a ratio above 1 is a failure).
"""

import collections
import json
import os
import shutil
import sys
import tempfile

import chex
import jax
import numpy as np
import pytest

SLOW = os.environ.get("JAX_FLASH_SLOW") == "1"

DEFAULT_SEED = 0
_RATIOS = collections.defaultdict(list)  # (test, quantity) -> [(seed, ratio)]


def pytest_configure(config):
    # A program compiled again in this process (each training run jits its own step) loads from an
    # on-disk cache of this process's compilations: on a CPU (no autotuning) the same executable.
    if jax.default_backend() == "cpu" and not jax.config.jax_compilation_cache_dir:
        config._jax_cache_dir = tempfile.mkdtemp(prefix="jax-flash-tests-xla-")
        jax.config.update("jax_compilation_cache_dir", config._jax_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    if getattr(config, "_jax_cache_dir", None):
        shutil.rmtree(config._jax_cache_dir, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption("--sweep-seeds", type=int, default=0, metavar="N",
                     help="run every bound-recording test over seeds 0..N-1 and print the worst "
                          "error / bound per test")
    parser.addoption("--sweep-out", default=None, metavar="FILE",
                     help="with --sweep-seeds: also write the table as Markdown to FILE (and each "
                          "ratio as it is recorded to FILE.jsonl)")
    parser.addoption("--sweep-start", type=int, default=0, metavar="S",
                     help="with --sweep-seeds N: seeds S..S+N-1")


def _sweep(config) -> int:
    return config.getoption("--sweep-seeds", default=0) or 0


def _records_bounds(fixturenames) -> bool:
    return "record_bound" in fixturenames or "assert_close" in fixturenames


def pytest_generate_tests(metafunc):
    n = _sweep(metafunc.config)
    if n and "seed" in metafunc.fixturenames and _records_bounds(metafunc.fixturenames):
        start = metafunc.config.getoption("--sweep-start")
        metafunc.parametrize("seed", range(start, start + n), ids=lambda s: f"seed{s}")


def pytest_collection_modifyitems(config, items):
    on_gpu = jax.default_backend() == "gpu"
    skip_gpu = pytest.mark.skip(reason="needs a GPU (run `pytest -m gpu` on the H200)")
    skip_slow = pytest.mark.skip(reason="slow; run with JAX_FLASH_SLOW=1 (a fast subset runs by default)")
    if _sweep(config):  # a sweep runs the bound-recording tests only
        keep = [it for it in items if _records_bounds(getattr(it, "fixturenames", ()))]
        config.hook.pytest_deselected(items=[it for it in items if it not in keep])
        # seed-major: every test at seed 0, then at seed 1, …, so a partial sweep covers every test
        keep.sort(key=lambda it: getattr(getattr(it, "callspec", None), "params", {}).get("seed", 0))
        items[:] = keep
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not SLOW:
            item.add_marker(skip_slow)


@pytest.fixture
def seed():
    """The seed of this run of a test: 0, ``JAX_FLASH_SEED`` if set, or the sweep's."""
    return int(os.environ.get("JAX_FLASH_SEED", DEFAULT_SEED))


@pytest.fixture
def rng(seed):
    """NumPy generator for the test's random inputs (see ``seed``)."""
    return np.random.default_rng(seed)


def _test_name(node) -> str:
    name = node.nodeid
    # one row per test, not per seed: the sweep's seed parameter leaves the id
    if "[" in name:
        base, params = name[:-1].split("[", 1)
        params = "-".join(p for p in params.split("-") if not p.startswith("seed"))
        name = f"{base}[{params}]" if params else base
    return name


@pytest.fixture
def record_bound(request, seed):
    """``record_bound(err, bound, what)``: assert ``err <= bound`` (arrays: elementwise) and record
    max(err / bound) for the sweep's table. Bounds come from the arithmetic, never from observed
    errors; ``what`` names the quantity."""
    name = _test_name(request.node)

    def check(err, bound, what=""):
        err = np.asarray(err, np.float64)
        bound = np.broadcast_to(np.asarray(bound, np.float64), err.shape)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(err == 0, 0.0, err / bound)
        worst = float(np.nanmax(ratio)) if ratio.size else 0.0
        if np.isnan(err).any():
            worst = float("inf")
        _RATIOS[name, what].append((seed, worst))
        out = request.config.getoption("--sweep-out", default=None)
        if out and _sweep(request.config):  # kept as it comes: a crashed sweep keeps its seeds
            with open(out + ".jsonl", "a") as f:
                f.write(json.dumps([name, what, seed, worst]) + "\n")
        bad = ~(err <= bound)
        assert not bad.any(), (f"{what}: {int(bad.sum())} of {err.size} beyond the bound, worst "
                               f"error/bound {worst:.3g} (seed {seed})")
        return worst

    return check


@pytest.fixture
def assert_close(record_bound):
    """``assert_close(actual, desired, bound, what)``: chex.assert_trees_all_close within the
    elementwise ``bound`` (compared in float64, in units of the bound: a 16-bit difference is not
    rounded again), the ratio recorded as by ``record_bound``."""

    def check(actual, desired, bound, what=""):
        a = np.asarray(np.asarray(actual, np.float32), np.float64)
        d = np.asarray(np.asarray(desired, np.float64), np.float64)
        chex.assert_equal_shape([a, d])
        bound = np.broadcast_to(np.asarray(bound, np.float64), d.shape)
        worst = record_bound(np.abs(a - d), bound, what)
        # in units of the bound (chex's atol is a scalar): within 1 everywhere
        chex.assert_trees_all_close(a / bound, d / bound, rtol=0.0, atol=1.0)
        return worst

    return check


def sweep_table(ratios) -> list[str]:
    """Markdown rows: per (test, quantity), the seeds run, the worst error / bound and its seed, and
    how many seeds exceeded the bound."""
    rows = []
    for (test, what), seen in sorted(ratios.items()):
        worst_seed, worst = max(seen, key=lambda x: x[1])
        over = len({s for s, r in seen if r > 1})
        rows.append((test, what, len({s for s, _ in seen}), worst, worst_seed, over))
    lines = ["| test | quantity | seeds | worst error / bound | at seed | seeds over |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    return lines + [f"| `{t}` | {w or '–'} | {n} | {r:.3g} | {s} | {o} |" for t, w, n, r, s, o in rows]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _sweep(config) or not _RATIOS:
        return
    lines = sweep_table(_RATIOS)
    terminalreporter.write_sep("=", f"seed sweep: {_sweep(config)} seeds")
    for line in lines:
        terminalreporter.write_line(line)
    out = config.getoption("--sweep-out")
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    # python tests/conftest.py [--per-test] FILE.jsonl …: the table of one or more (partial) sweeps;
    # --per-test: one row per test, its worst quantity
    per_test = "--per-test" in sys.argv
    ratios = collections.defaultdict(list)
    for path in (a for a in sys.argv[1:] if a != "--per-test"):
        for line in open(path):
            test, what, seed, worst = json.loads(line)
            ratios[test, what].append((seed, worst))
    if per_test:
        worst_what = {}
        for (test, what), seen in ratios.items():
            r = max(x for _, x in seen)
            if test not in worst_what or r > worst_what[test][1]:
                worst_what[test] = (what, r)
        ratios = {(t, f"{w} (worst of its quantities)" if sum(1 for k in ratios if k[0] == t) > 1
                   else w): ratios[t, w] for t, (w, _) in worst_what.items()}
    print("\n".join(sweep_table(ratios)))
