"""experiments/reproduce.py on CPU with a micro model: a run, its resumption to more steps (the way
experiments/gpu/repro_seq.sh chains 10-minute GPU commands), and the table over runs."""

import json
from pathlib import Path

import numpy as np
import pytest

from experiments import reproduce as R
from helpers import Tokens

MICRO = ["model.vocab_size=512", "model.n_layer=2", "model.n_head=4", "model.n_embd=64",
         "model.block_size=32", "data.batch_size=4", "optim.warmup_steps=2", "data.eval_batches=1"]


@pytest.mark.slow  # experiment tooling, 15–30 s: JAX_FLASH_SLOW=1 (make test-all)
def test_run_resume_and_table(tmp_path, capsys):
    tok = Tokens()
    data = tmp_path / "tok.npz"
    np.savez_compressed(data, train=tok.train, val=tok.val, meta=np.array(json.dumps({"train_tokens": len(tok.train), "val_tokens": len(tok.val)})))
    args = ["run", "--arm", "fa2", "--seed", "3", "--probe-every", "2", "--data", str(data),
            "--out", str(tmp_path / "runs"), "--checkpoint-every", "2", "--resume", "auto"]
    R.main(args + ["--steps", "4"] + MICRO)
    run = tmp_path / "runs" / "fa2-s3"
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["seed"] == 3 and cfg["model"]["attention"]["kind"] == "flash"
    R.main(args + ["--steps", "6", "--snapshot-steps", "6"] + MICRO)  # continues from step 4
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == 4
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs if "loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == 6  # no step twice, none lost
    assert [r["step"] for r in recs if "max_logit/L1" in r] == [2, 4, 6]
    from train.probes import load_layer_tensors

    snap = load_layer_tensors(run / "tensors" / "L1_step6.npz")  # L1's q, k, v, dO at step 6
    assert snap["step"] == 6 and snap["q"].shape == snap["do"].shape == (1, 32, 4, 16)
    capsys.readouterr()
    R.main(["table", str(tmp_path / "runs"), "--md", str(tmp_path / "t.md"), "--loss-window", "3-6"])
    table = (tmp_path / "t.md").read_text()
    row = next(l for l in table.splitlines() if l.startswith("| fa2-s3"))
    assert "| 6 |" in row and "none by 6" in row
    cols = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    cell = dict(zip(cols, (c.strip() for c in row.strip("|").split("|"))))
    losses = [r["loss"] for r in recs if "loss" in r and 3 <= r["step"] <= 6]
    assert float(cell["mean loss 3–6"]) == float(f"{sum(losses) / 4:.4g}")
    peak = max((r for r in recs if "max_logit/L1" in r), key=lambda r: r["max_logit/L1"])
    assert float(cell["L1 max logit, largest probe"]) == float(f"{peak['max_logit/L1']:.4g}")
    assert cell["largest probe at"] == str(peak["step"])
    low = min((r for r in recs if "val_loss" in r), key=lambda r: r["val_loss"])
    assert cell["val loss min at"] == str(low["step"])
    # an archived batch in a sub-folder is found and labelled by its relative path
    import shutil

    shutil.copytree(run, tmp_path / "runs" / "archive" / "fa2-s3")
    R.main(["table", str(tmp_path / "runs"), "--md", str(tmp_path / "t2.md")])
    assert any(l.startswith("| archive/fa2-s3 |") for l in (tmp_path / "t2.md").read_text().splitlines())
    capsys.readouterr()
    R.main(["probes", str(run), "--steps", "4,6"])
    rows = [l for l in capsys.readouterr().out.splitlines() if l.startswith(f"| {run} |")]
    assert [l.split("|")[2].strip() for l in rows] == ["4", "6"]
    # the tied rows' δ error and the W_Q-gradient error are there (numbers, not "—") in new runs
    assert all("—" not in l.split("|")[-3] and "—" not in l.split("|")[-2] for l in rows), rows
    R.main(["probes", str(run), "--head", "2", "--steps", "6"])
    rows = [l.split("|") for l in capsys.readouterr().out.splitlines() if l.startswith(f"| {run} |")]
    recs6 = next(r for r in recs if r["step"] == 6 and "max_logit/L1/H2" in r)
    assert len(rows) == 1 and float(rows[0][3]) == float(f"{recs6['max_logit/L1/H2']:.4g}")
    implied = -recs6["wq_grad_err/L1/H2"] / recs6["delta_err/L1/H2"]
    assert float(rows[0][8]) == float(f"{implied:.3g}")
    R.main(["probe-stats", str(run), "--layers", "0,1"])
    lines = capsys.readouterr().out.splitlines()
    col = [c.strip() for c in lines[0].split("|")].index("probes")
    rows = [l.split("|") for l in lines if l.startswith(f"| {run} |")]
    assert [(r[2].strip(), r[col].strip()) for r in rows] == [("L0", "3"), ("L1", "3")]  # probes at 2, 4, 6


@pytest.mark.slow  # experiment tooling, 15–30 s: JAX_FLASH_SLOW=1 (make test-all)
def test_lanes_pack_outputs_and_deadline_skips_arms(tmp_path):
    """experiments/gpu/lanes.sh: one GPU index and OUT folder per lane, a lane past the time is killed
    but the archive is still written; repro_seq.sh skips an arm that cannot finish before DEADLINE."""
    import subprocess
    import tarfile

    out = tmp_path / "out"
    lanes = ["echo hi > $OUT/a.txt; echo gpu=$CUDA_VISIBLE_DEVICES deadline=$DEADLINE",
             "DEADLINE=$(date +%s) bash experiments/gpu/repro_seq.sh 100 fa2:0:10",
             "sleep 60; echo never"]
    env = dict(__import__("os").environ, OUT=str(out), RUNS=str(tmp_path / "runs"), JAX_PLATFORMS="cpu")
    res = subprocess.run(["bash", "experiments/gpu/lanes.sh", "35", *lanes], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    with tarfile.open(out / "lanes.tgz") as tar:
        names = set(tar.getnames())
        log = {i: tar.extractfile(f"./g{i}.log").read().decode() for i in range(3)}
    assert "./g0/a.txt" in names
    assert "gpu=0 deadline=" in log[0]
    assert "fa2-s0: skipped" in log[1]
    assert "never" not in log[2]  # killed 20 s before the total


def test_probe_stats_reads_bias_scale_and_tied_share():
    rng = np.random.default_rng(0)
    n = 12
    err = rng.normal(3e-5, 1e-5, n)  # a planted bias well out of the scatter
    grad = rng.normal(0, 4e-3, n)
    delta = rng.normal(0, 1e-5, n)
    tie = 0.25 * delta  # the tied rows carry a quarter of every probe's δ error
    recs = [{"step": 10 * i, "loss": 3.0} for i in range(n)]  # plain steps have no probe metrics
    recs += [{"step": 10 * i + 5, "wq_grad_err/L1": float(err[i]), "wq_grad/L1": float(grad[i]),
              "delta_err/L1": float(delta[i]), "delta_err_tie/L1": float(tie[i]),
              "wq_grad_err_delta/L1": float(0.5 * err[i])} for i in range(n)]
    st = R.probe_stats(recs, "L1")
    assert st["probes"] == n
    np.testing.assert_allclose(st["wq_grad_err mean"], err.mean(), rtol=1e-12)
    np.testing.assert_allclose(st["t"], err.mean() / (err.std(ddof=1) / np.sqrt(n)), rtol=1e-10)
    np.testing.assert_allclose(st["wq_grad_err rms"], np.sqrt(np.mean(err ** 2)), rtol=1e-12)
    np.testing.assert_allclose(st["err/grad rms"], np.sqrt(np.mean(err ** 2) / np.mean(grad ** 2)),
                               rtol=1e-10)
    np.testing.assert_allclose(st["tied share of Σ δ err (abs)"], 0.25, rtol=1e-12)
    np.testing.assert_allclose(st["via δ rms"], 0.5 * st["wq_grad_err rms"], rtol=1e-12)
    assert st["t"] > 4  # the planted bias stands out
    assert R.probe_stats(recs, "L0") is None  # a layer (or an old run) without the metric
    away = rng.normal(-2e-6, 1e-6, n)
    ob = R.o_bias_stats([{"step": i, "o_err_away/L1": float(a)} for i, a in enumerate(away)], "L1")
    np.testing.assert_allclose(ob["O err away mean"], away.mean(), rtol=1e-12)
    np.testing.assert_allclose(ob["t (O)"], away.mean() / (away.std(ddof=1) / np.sqrt(n)), rtol=1e-10)
    assert R.o_bias_stats(recs, "L1") == {}


def test_rerun_diff_finds_where_two_executions_part():
    base = [{"step": s, "loss": 3.0 - 0.01 * s} for s in range(1, 9)]
    other = [dict(r) for r in base[2:]]  # resumed at step 3
    other[3]["loss"] += 1e-4  # step 6 differs, and a probe at 6 and at 8
    for recs, logits in ((base, (20.0, 30.0)), (other, (21.0, 90.0))):
        recs[5 - (8 - len(recs))].update({"max_logit/L1": logits[0]})
        recs[-1].update({"max_logit/L1": logits[1]})
    d = R.rerun_diff(base, other)
    assert d["steps"] == (3, 8) and d["first differing step"] == 6
    assert abs(d["max |Δ loss|"] - 1e-4) < 1e-9
    assert d["max logit (a, b)"] == [(6, 20.0, 21.0), (8, 30.0, 90.0)]
    assert R.rerun_diff(base, base)["first differing step"] is None


def _fake_run(d, logits, every=500):
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("\n".join(
        json.dumps({"step": every * (i + 1), "max_logit/L1": v}) for i, v in enumerate(logits)) + "\n")


def test_execution_cells_count_complete_executions_against_the_seeds_control(tmp_path, capsys):
    """`reproduce executions`: execution i is roots[i]/<arm>-s<seed>; a cell is the L1 max logit at
    the horizon, compared with the seed's control at the same step; only executions that reached the
    horizon are counted, and one below 10× is not."""
    rng = np.random.default_rng(0)
    base = rng.uniform(20, 40, size=8)
    e1, e2 = tmp_path / "e1", tmp_path / "e2"
    _fake_run(e1 / "standard-s0", base)
    _fake_run(e1 / "standard-s1", base[:6])  # control ended early: compared at its last probe
    _fake_run(e1 / "fa2-s0", [*base[:7], base[7] * 10.5])      # ≥ 10× at 4,000
    _fake_run(e2 / "fa2-s0", [*base[:7], base[7] * 2.0])       # < 10×, < 100
    _fake_run(e1 / "fa2-s1", [*base[:5], 150.0, 400.0, 4000.0])  # > 100 at 3,000
    _fake_run(e2 / "fa2-s1", [*base[:5], 5000.0])              # ended at 3,000: not counted
    cells, counts = R.execution_cells([e1, e2], ["fa2", "standard", "fa2-dpp"], [0, 1])
    assert counts == {"fa2": (3, 2, 2), "standard": (1, 0, 0)}
    c = cells[("fa2", 0)]
    assert c[0]["complete"] and abs(c[0]["ratio"] - 10.5) < 1e-9 and abs(c[1]["ratio"] - 2.0) < 1e-9
    assert cells[("fa2", 1)][0]["first_above_100"] == 3000
    assert abs(cells[("fa2", 1)][0]["ratio"] - 4000.0 / base[5]) < 1e-9
    assert not cells[("fa2", 1)][1]["complete"] and cells[("fa2", 1)][1]["step"] == 3000
    assert cells[("fa2-dpp", 0)] == [None, None] and cells[("standard", 0)][1] is None
    R.main(["executions", str(e1), str(e2), "--arms", "fa2,standard", "--seeds", "0,1",
            "--md", str(tmp_path / "x.md"), "--plot", str(tmp_path / "x.png"),
            "--compare", "fa2:standard"])
    md = (tmp_path / "x.md").read_text()
    assert "> 100 by 4,000: fa2 2 of 3 vs standard 0 of 1; one-sided Fisher exact p = 0.5" in md
    assert "≥ 10× standard by 4,000: fa2 2 of 3 vs standard 0 of 1; one-sided Fisher exact p = 0.5" in md
    # the two endpoints can differ: at 11× the ratio counts and "> 100" does not
    R.main(["executions", str(e1), str(e2), "--arms", "fa2,standard", "--seeds", "0,1",
            "--factor", "11", "--md", str(tmp_path / "y.md"), "--compare", "fa2:standard"])
    md = (tmp_path / "y.md").read_text()
    assert "≥ 11× standard by 4,000: fa2 1 of 3 vs standard 0 of 1; one-sided Fisher exact p = 0.75" in md
    assert "> 100 by 4,000: fa2 2 of 3 vs standard 0 of 1" in md
    # the hypergeometric tail against a brute-force count over all ways to place the events
    import itertools

    for ka, na, kb, nb in ((4, 8, 0, 4), (2, 5, 1, 6), (0, 3, 2, 3)):
        k, n = ka + kb, na + nb
        ways = list(itertools.combinations(range(n), k))
        tail = sum(sum(i < na for i in w) >= ka for w in ways) / len(ways)
        assert abs(R.fisher_one_sided(ka, na, kb, nb) - tail) < 1e-12
    row = next(l for l in (tmp_path / "x.md").read_text().splitlines() if l.startswith("| fa2 |"))
    assert row.endswith("| 2 of 3 executions | 2 of 3 |") and "**4,000** (> 100 at 3,000)" in row
    assert "at 3,000" in row and (tmp_path / "x.png").stat().st_size > 0
    # replicates without a control of their own take it from another folder, and only with it
    rep = tmp_path / "rep"
    _fake_run(rep / "fa2-s0", [*base[:7], base[7] * 12.0])
    assert R.execution_cells([rep], ["fa2"], [0])[1] == {}
    cells, counts = R.execution_cells([rep], ["fa2"], [0], control_roots=[e1])
    assert counts == {"fa2": (1, 1, int(base[7] * 12.0 > 100))}
    assert abs(cells[("fa2", 0)][0]["ratio"] - 12.0) < 1e-9


def test_execution_cells_count_a_diverged_execution_on_both_endpoints(tmp_path):
    """An execution the divergence stop ended before the horizon failed at the loss: it is counted
    (not dropped as incomplete) and counts on both endpoints, even with its last probe low; one
    that diverged after the horizon is judged at the horizon like any other."""
    base = [30.0] * 8
    _fake_run(tmp_path / "standard-s0", base)
    _fake_run(tmp_path / "paper-s0", base[:5])  # last probe 30 at 2,500, then diverged
    (tmp_path / "paper-s0" / "summary.json").write_text(json.dumps({"diverged_at": 2593}))
    _fake_run(tmp_path / "paper-s1", base[:5])  # ended early without diverging: not counted
    _fake_run(tmp_path / "standard-s1", base)
    _fake_run(tmp_path / "fa2-s0", base[:6])
    (tmp_path / "fa2-s0" / "summary.json").write_text(json.dumps({"diverged_at": 3500}))
    cells, counts = R.execution_cells([tmp_path], ["paper", "fa2"], [0, 1], horizon=3000)
    assert counts == {"paper": (1, 1, 1), "fa2": (1, 0, 0)}
    c = cells[("paper", 0)][0]
    assert c["complete"] and c["diverged_at"] == 2593 and c["first_above_100"] is None
    assert cells[("paper", 1)][0]["complete"] is False
    assert cells[("fa2", 0)][0]["diverged_at"] is None and cells[("fa2", 0)][0]["complete"]
    R.main(["executions", str(tmp_path), "--arms", "paper,standard", "--seeds", "0",
            "--horizon", "3000", "--md", str(tmp_path / "x.md"), "--compare", "paper:standard"])
    md = (tmp_path / "x.md").read_text()
    assert "**30.0** at 2,500, diverged at 2,593" in md
    assert "≥ 10× standard by 3,000: paper 1 of 1 vs standard 0 of 1" in md


RP, CF = "results/repro", "results/confirm/l6"
COUNT_TABLES = {  # each committed count table and the command its index gives for it
    f"{RP}/executions.md": [RP, f"{RP}/exec2", f"{RP}/r1", f"{RP}/r2", f"{RP}/r3", f"{RP}/r4",
                           "--compare", "fa2,fa2-stable:fa2-dpp", "--compare", "fa2:fa2-stable",
                           "--compare", "fa2:standard"],
    f"{RP}/replicates.md": [f"{RP}/r1", f"{RP}/r2", f"{RP}/r3", f"{RP}/r4", "--seeds", "1",
                           "--control-from", RP, "--compare", "fa2,fa2-stable:fa2-dpp",
                           "--compare", "fa2:fa2-stable"],
    f"{RP}/design2_count.md": [f"{RP}/r1", f"{RP}/r2", f"{RP}/r3", "--arms", "fa2,standard",
                              "--seeds", "0,2", "--control-from", RP],
    "results/confirm/l6_count.md": [CF, "--arms", "paper,paper-stable,fa2,fa2-stable,fa2-dpp,standard",
                                    "--seeds", "9,10,11,12,13,14,15,16", "--horizon", "3000",
                                    "--compare", "paper:paper-stable", "--compare", "fa2:fa2-stable",
                                    "--compare", "fa2:fa2-dpp"],
    "results/confirm/l6_twin_count.md": [CF, "--arms", "torch-flash-o,torch-flash-dpp,standard",
                                         "--seeds", "9,10,11,12", "--horizon", "3000",
                                         "--compare", "torch-flash-o:torch-flash-dpp"],
}


@pytest.mark.parametrize("table", sorted(COUNT_TABLES))
def test_committed_count_tables_are_what_their_command_writes(table, tmp_path, capsys):
    """Every committed count table equals what its command writes from the raw metrics now: a
    table left behind when executions land (or a count edited by hand) fails here."""
    out = tmp_path / "table.md"
    R.main(["executions", *COUNT_TABLES[table], "--md", str(out)])
    capsys.readouterr()
    assert out.read_text() == Path(table).read_text(), f"regenerate {table} (results INDEX)"


def test_committed_loss_table_is_what_its_command_writes(tmp_path, capsys):
    """results/confirm/l6_loss.md, the loss failure of every execution reported beside the design's
    endpoint, equals what `python -m experiments.search verdict results/confirm/l6/*-s*/` writes."""
    from experiments import search

    runs = sorted(str(p) for p in Path(CF).glob("*-s*") if p.is_dir())
    out = tmp_path / "loss.md"
    search.main(["verdict", *runs, "--md", str(out)])
    capsys.readouterr()
    assert out.read_text() == Path("results/confirm/l6_loss.md").read_text(), \
        "regenerate results/confirm/l6_loss.md (results/confirm/INDEX.md)"
