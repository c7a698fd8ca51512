"""lab.ab on a CPU: variants, entries, the archived revision beside the working tree, paired ratios.
Speed itself is measured on the GPU, never asserted here."""

import contextlib
import importlib
import json
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash.pallas import mosaic_common
from lab import ab

backward = importlib.import_module("jax_flash.pallas.backward")  # (the package exports a function)

RECORD_KEYS = {"impl", "policy", "stable", "variant", "shape", "causal", "pass", "ms", "tflops",
               "jax_version", "device", "rounds_ms"}


def test_parse_variant():
    assert ab.parse_variant("new") == ("new", None, False)
    assert ab.parse_variant("mosaic@e:stable") == ("mosaic", "e", True)
    assert ab.parse_variant("mgpu") == ("mgpu", None, False)
    assert ab.parse_variant("cudnn_det") == ("cudnn_det", None, False)
    for bad in ("new:fast", "newer", "cudnn@t16", "mgpu:stable", "cudnn_det:stable"):
        with pytest.raises(ValueError):
            ab.parse_variant(bad)


def test_deterministic_cudnn_compiles_with_xlas_option():
    """``cudnn_det``'s programs, and only its, are compiled with ``xla_gpu_deterministic_ops``: the
    option reaches XLA (an unknown option in its place fails the compilation)."""
    import jax.numpy as jnp

    from bench.attention import _jax_pass

    assert ab.compiler_options("cudnn_det") == {"xla_gpu_deterministic_ops": True}
    assert ab.compiler_options("cudnn") is None and ab.compiler_options("new:stable") is None
    f = lambda q, k, v: q * k + v
    x = jnp.ones((2, 3), jnp.float32)
    for pss in ("fwd", "fwd+bwd", "bwd"):
        _jax_pass(f, pss, ab.compiler_options("cudnn_det"))(x, x, x)
        with pytest.raises(Exception, match="xla_no_such_option"):
            _jax_pass(f, pss, {"xla_no_such_option": True})(x, x, x)


def test_entries_split_into_tiles_and_a_launch():
    """An entry's tiles are call arguments, the rest its launch (``launch=``); ``mosaic`` adds the
    Mosaic GPU forward to it; without an entry the shipped table chooses (``launch=None``)."""
    entries = {"e": {"block_q": 128, "block_k": 64, "fwd": {"num_warps": 8, "num_stages": 3},
                     "prefetch_rows": True}}
    assert ab.split_entry(entries["e"]) == ({"block_q": 128, "block_k": 64},
                                            {"fwd": {"num_warps": 8, "num_stages": 3},
                                             "prefetch_rows": True})
    assert ab.call_kwargs("new", entries) == dict(causal=True, policy="fa2", stable=False,
                                                  launch=None)
    assert ab.call_kwargs("new@e:stable", entries, policy="paper") == dict(
        causal=True, policy="paper", stable=True, block_q=128, block_k=64,
        launch={"fwd": {"num_warps": 8, "num_stages": 3}, "prefetch_rows": True})
    assert ab.call_kwargs("mosaic", entries)["launch"] == {"fwd_kernel": "mosaic"}
    assert ab.call_kwargs("mosaic@e", entries)["launch"]["fwd_kernel"] == "mosaic"
    with pytest.raises(KeyError):
        ab.call_kwargs("new@nope", entries)


def test_mosaic_variant_asks_for_the_mosaic_forward_and_only_it_does(monkeypatch):
    """On a GPU where the Mosaic GPU kernels cannot run (faked), the ``mosaic`` variant, which asks
    for them explicitly, fails instead of timing the Triton kernel; ``new`` plans the same call."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(mosaic_common, "unavailable", lambda: "not on this GPU")
    x = jax.ShapeDtypeStruct((1, 256, 1, 64), jnp.bfloat16)
    assert jax_flash.plan(x, x, x, **ab.call_kwargs("new", {})).launch.fwd_kernel == "triton"
    with pytest.raises(ValueError, match="not on this GPU"):
        jax_flash.plan(x, x, x, **ab.call_kwargs("mosaic", {}))


def test_candidate_entries_are_launches_that_fit(monkeypatch):
    """Every candidate of lab/entries.json splits into tiles and a valid ``jax_flash.Launch``, and on
    a (faked) Hopper GPU the plan of a 4×8192×16×128 call keeps that launch as given (a Mosaic
    kernel it does not cover would raise) and its resident blocks fit the tiles — or its A/B would
    time something else."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(mosaic_common, "unavailable", lambda: None)
    x = jax.ShapeDtypeStruct((4, 8192, 16, 128), jnp.bfloat16)
    entries = ab.candidate_entries()
    assert entries
    for name, entry in entries.items():
        tiles, fields = ab.split_entry(entry)
        p = jax_flash.plan(x, x, x, **ab.call_kwargs(f"new@{name}", entries))
        assert p.executor == "pallas", name
        assert p.launch == jax_flash.Launch.from_dict(fields), name
        assert {f: getattr(p.numerics, f) for f in tiles} == tiles, name
        for field in ("bwd_block", "dq_block"):
            if field in entry:
                assert backward.resident_block(entry[field], p.numerics, 8192, 8192) \
                    == entry[field], (name, field)


def _fake_pre_launch_revision(monkeypatch, seen):
    """A package shaped like a revision from before ``launch=``: tiles and launches through
    ``pallas.tuning.override``, the Mosaic forward through ``pallas.forward_mosaic.force``."""

    def recorder(kind):
        @contextlib.contextmanager
        def cm(arg):
            seen.append((kind, arg))
            yield

        return cm

    name = "jax_flash_pre_launch"
    old = types.ModuleType(name)
    old.attention = lambda q, k, v, **kw: seen.append(("attention", kw)) or q
    for sub, attr in (("tuning", "override"), ("forward_mosaic", "force")):
        module = types.ModuleType(f"{name}.pallas.{sub}")
        setattr(module, attr, recorder(attr))
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(sys.modules, f"{name}.pallas", types.ModuleType(f"{name}.pallas"))
    monkeypatch.setitem(sys.modules, name, old)
    return old


def test_a_revision_before_launch_gets_its_entry_through_override(monkeypatch):
    seen = []
    old = _fake_pre_launch_revision(monkeypatch, seen)
    entries = {"e": {"block_q": 16, "fwd": {"num_warps": 4, "num_stages": 2}}}
    ab._attention_fn("old@e:stable", {"old": old}, entries, True, "fa2")(1, 2, 3)
    ab._attention_fn("mosaic", {"new": old}, entries, False, "paper")(1, 2, 3)
    assert seen == [("override", entries["e"]),
                    ("attention", dict(causal=True, policy="fa2", stable=True)),
                    ("force", True), ("attention", dict(causal=False, policy="paper", stable=False))]


@pytest.mark.slow  # an archived revision imported and timed end to end
def test_ab_times_an_archived_revision_beside_the_working_tree(tmp_path):
    """lab.ab imports ``jax_flash/`` of a git revision as its own package (not the working tree's
    modules under another name) and times every variant of one case in one interleaved run; the
    working tree's records name the launch that ran (the defaults off the GPU)."""
    root = ab.prepare("HEAD", out=tmp_path / "rev")
    old = ab.load_old(root, name="jax_flash_ab_probe")
    assert old.__file__.startswith(str(tmp_path)) and old.tile is not jax_flash.tile
    assert old.tile.__name__ == "jax_flash_ab_probe.tile"
    entries = {"t16": {"block_q": 16, "block_k": 16}}
    variants = ["old", "new", "new:stable", "new@t16:stable"]
    recs = ab.run(root, [(1, 64, 2, 32)], ["fwd+bwd"], variants, rounds=2, reps=1,
                  entries=entries, log=lambda _: None, out=tmp_path / "ab.json")
    assert [(r["variant"], r["impl"], r["stable"]) for r in recs] == [
        ("old", "jax_flash@old", False), ("new", "jax_flash@new", False),
        ("new:stable", "jax_flash@new", True), ("new@t16:stable", "jax_flash@new", True)]
    assert all(RECORD_KEYS <= set(r) and r["ms"] > 0 and len(r["rounds_ms"]) == 2 for r in recs)
    assert "launch" not in recs[0] and all(r["launch"] == {} for r in recs[1:])
    assert len(json.loads((tmp_path / "ab.json").read_text())) == 4
    table = ab.markdown([("run1", recs)])
    assert table.splitlines()[0] == "| run | shape | pass | old | new | new:stable | new@t16:stable |"
    assert "| run1 | 1×64×2×32 | fwd+bwd | " in table and "(×1.000)" in table
    with pytest.raises(KeyError):
        ab.run(root, [(1, 64, 2, 32)], ["fwd"], ["new@nope"], rounds=1, reps=1)


def test_paired_ratio_cancels_the_drift_the_rounds_share():
    """``paired_ratio`` divides the two variants' times round by round: a drift both see cancels,
    and the median ratio lies in its 90 % interval; records without per-round times are refused."""
    rng = np.random.default_rng(1)
    base = 8.0 + rng.normal(0, 0.5, 20)  # a drifting GPU: the pairs share each round's drift
    stable = base * 1.025 * (1 + rng.normal(0, 1e-3, 20))
    records = [dict(variant=v, shape=[4, 8192, 16, 128], **{"pass": "fwd+bwd"}, rounds_ms=list(t))
               for v, t in (("new", base), ("new:stable", stable))]
    med, (lo, hi), n = ab.paired_ratio(records, "new:stable", "new", (4, 8192, 16, 128), "fwd+bwd")
    # the ratios' spread is that of the 1e-3 noise, not the 0.5 ms drift (6 % of the times)
    assert n == 20 and lo <= med <= hi and abs(med - 1.025) < 2e-3 and hi - lo < 4e-3
    assert "×1.02" in ab.ratio_lines(records, "new:stable", "new")
    with pytest.raises(KeyError):
        ab.paired_ratio([{k: v for k, v in r.items() if k != "rounds_ms"} for r in records],
                        "new:stable", "new", (4, 8192, 16, 128), "fwd+bwd")


def test_ratio_over_runs_gives_each_and_their_range(tmp_path, capsys):
    """``lab.ab ratio`` on several files: one row per run, then the runs' median, range and count of
    runs at ×1 or above; one file keeps the one-run table."""
    def run_of(ratio):
        base = [8.0, 8.1, 7.9, 8.2]
        return [dict(variant="new", shape=[4, 8192, 16, 128], rounds_ms=base, **{"pass": "fwd"}),
                dict(variant="cudnn", shape=[4, 8192, 16, 128], **{"pass": "fwd"},
                     rounds_ms=[t * ratio for t in base])]

    files = []
    for i, ratio in enumerate((0.99, 1.02, 1.005)):
        files.append(tmp_path / f"r{i}.json")
        files[-1].write_text(json.dumps(run_of(ratio)))
    ab.main(["ratio", *map(str, files), "--variant", "cudnn", "--base", "new"])
    rows = capsys.readouterr().out.splitlines()
    assert rows[2].startswith("| r0.json | 4×8192×16×128 | fwd | ×0.9900 |")
    assert rows[-1] == ("| 3 runs | 4×8192×16×128 | fwd | median ×1.0050 | "
                        "×0.9900 … ×1.0200 (range) | 2 of 3 ≥ ×1 |")
    ab.main(["ratio", str(files[1]), "--variant", "cudnn", "--base", "new"])
    assert capsys.readouterr().out.splitlines()[2].startswith("| 4×8192×16×128 | fwd | ×1.0200 |")


@pytest.mark.parametrize("flag,causal", [([], True), (["--non-causal"], False)])
def test_run_command_passes_the_mask(monkeypatch, flag, causal):
    """``lab.ab run`` times causal calls unless ``--non-causal`` is given."""
    seen = {}
    monkeypatch.setattr(ab, "run", lambda *a, **kw: seen.update(kw))
    ab.main(["run", "--variants", "new", "--shapes", "1x256x2x64", *flag])
    assert seen["causal"] is causal


def test_run_command_repeats_whole_runs_to_numbered_files(monkeypatch):
    """``lab.ab run --repeat N --out F.json``: N whole runs, one after the other, to F-1.json …
    F-N.json; without ``--repeat``, one run to F.json; below 1 refused."""
    outs = []
    monkeypatch.setattr(ab, "run", lambda *a, **kw: outs.append(kw["out"]))
    ab.main(["run", "--variants", "new,cudnn", "--repeat", "3", "--out", "d/two.json"])
    assert outs == ["d/two-1.json", "d/two-2.json", "d/two-3.json"]
    outs.clear()
    ab.main(["run", "--variants", "new,cudnn", "--out", "d/two.json"])
    assert outs == ["d/two.json"]
    with pytest.raises(SystemExit):
        ab.main(["run", "--repeat", "0"])
