"""experiments/queue.py: which executions of a design are made, the next call's command, and the
copy of what a call returns — never over an execution already kept."""

import json
import subprocess
import tarfile

import pytest

from experiments import queue as Q


def _run(d, last_step, diverged_at=None, summary=True):
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0}) + "\n"
                                             for s in range(250, last_step + 1, 250)))
    if summary:
        (d / "summary.json").write_text(json.dumps({"steps": last_step, "diverged_at": diverged_at}))


def _queue(remake_cut):
    return Q.Queue(design="d.md", root="unused", setting="l6", remake_cut=remake_cut,
                   items=(("paper", 0, 3000, 295), ("paper", 1, 3000, 295), ("paper", 2, 3000, 295),
                          ("standard", 0, 3000, 400), ("standard", 1, 3000, 400)))


def test_status_reads_how_each_execution_ended(tmp_path):
    _run(tmp_path / "paper-s0", 3000)
    _run(tmp_path / "paper-s1", 2500, diverged_at=2593)
    _run(tmp_path / "paper-s2", 1750, summary=False)  # cut by its limit
    _run(tmp_path / "standard-s1", 4500)  # a longer execution of an earlier stage covers it
    rows = Q.status(_queue(remake_cut=False), tmp_path)
    ends = [(r["run"], r["state"] and r["state"]["end"], r["pending"]) for r in rows]
    assert ends == [("paper-s0", "complete", False), ("paper-s1", "diverged", False),
                    ("paper-s2", "cut", False), ("standard-s0", None, True),
                    ("standard-s1", "complete", False)]
    # a design that makes a cut execution again has it pending, once
    rows = Q.status(_queue(remake_cut=True), tmp_path)
    assert [r["run"] for r in rows if r["pending"]] == ["paper-s2", "standard-s0"]
    md = Q.status_markdown(_queue(True), rows)
    assert "| paper-s2 | 3,000 | 295 | cut at 1,750: to be made again |" in md
    assert "| paper-s1 | 3,000 | 295 | diverged at 2,593 |" in md
    assert "| standard-s1 | 3,000 | 400 | complete (4,500 steps) |" in md
    (tmp_path / "cut" / "paper-s2").mkdir(parents=True)
    assert not Q.status(_queue(True), tmp_path)[2]["pending"]


def test_next_call_packs_the_design_order_into_the_time(tmp_path):
    q = _queue(remake_cut=False)
    rows = Q.status(q, tmp_path)  # nothing made
    one = Q.plan_call(rows, gpus=1, seconds=590)
    assert [[r["run"] for r in lane] for lane in one] == [["paper-s0", "paper-s1"]]
    assert Q.command(q, one) == ("OUT=$OUT bash experiments/gpu/setting_seq.sh l6 295 "
                                 "paper:0:3000 paper:1:3000")
    four = Q.plan_call(rows, gpus=4, seconds=590)
    assert [[r["run"] for r in lane] for lane in four] == [
        ["paper-s0", "paper-s1"], ["paper-s2"], ["standard-s0"], ["standard-s1"]]
    cmd = Q.command(q, four)
    assert cmd.startswith("OUT=$OUT bash experiments/gpu/lanes.sh 600 ")
    assert cmd.count("setting_seq.sh l6") == 4 and '"bash experiments/gpu/setting_seq.sh l6 400 standard:1:3000"' in cmd
    assert len(Q.command(Q.get("confirm"), Q.plan_call(Q.status(Q.get("confirm"), tmp_path), 8))) < 2000
    # the order holds: nothing after an execution that does not fit
    assert [[r["run"] for r in lane] for lane in Q.plan_call(rows, 1, 300)] == [["paper-s0"]]
    assert Q.plan_call(rows, 1, 200) == []


def test_the_command_runs_repro_seq_in_the_setting(tmp_path):
    """setting_seq.sh hands repro_seq.sh the setting's overrides (a stand-in repro_seq.sh)."""
    gpu = tmp_path / "experiments" / "gpu"
    gpu.mkdir(parents=True)
    src = Q.Path(Q.__file__).parent / "gpu" / "setting_seq.sh"
    (gpu / "setting_seq.sh").write_text(src.read_text())
    (gpu / "repro_seq.sh").write_text('echo "VARIANT=$VARIANT OVERRIDES=$OVERRIDES CKPT=$CKPT_EVERY ARGS=$*"\n')
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python3").write_text("#!/bin/sh\nprintf 'model.n_layer=6\\n'\n")
    (shim / "python3").chmod(0o755)
    out = subprocess.run(["bash", str(gpu / "setting_seq.sh"), "l6", "295", "paper:7:3000"],
                         capture_output=True, text=True, env={"PATH": f"{shim}:/usr/bin:/bin"})
    assert out.stdout.strip() == "VARIANT=l6 OVERRIDES=model.n_layer=6  CKPT=0 ARGS=295 paper:7:3000"


def test_collect_copies_and_never_overwrites(tmp_path):
    q, root, ret = _queue(remake_cut=True), tmp_path / "root", tmp_path / "ret"
    _run(ret / "repro-l6" / "paper-s0", 3000)
    assert Q.collect(q, ret, root) == ["paper-s0"]
    assert Q.state(root / "paper-s0", 3000)["end"] == "complete"
    with pytest.raises(FileExistsError):  # the same execution again
        Q.collect(q, ret, root)
    # a cut execution the design makes again: the cut one moves to cut/, both kept
    _run(root / "paper-s2", 1500, summary=False)
    again = tmp_path / "again"
    _run(again / "g0" / "repro-l6" / "paper-s2", 3000)
    _run(again / "g1" / "repro-l6" / "standard-s0", 3000)
    (tmp_path / "lanes").mkdir()
    with tarfile.open(tmp_path / "lanes" / "lanes.tgz", "w:gz") as tar:
        tar.add(again / "g0", arcname="g0")
        tar.add(again / "g1", arcname="g1")
    assert Q.collect(q, tmp_path / "lanes", root) == ["paper-s2", "standard-s0"]
    assert Q.state(root / "cut" / "paper-s2", 3000)["end"] == "cut"
    assert Q.state(root / "paper-s2", 3000)["end"] == "complete"
    stray = tmp_path / "stray"
    _run(stray / "repro-l6" / "fa2-s5", 3000)
    with pytest.raises(ValueError, match="not an execution"):
        Q.collect(q, stray, root)
    with pytest.raises(FileNotFoundError):
        Q.collect(q, tmp_path / "nothing", root)


def test_the_shipped_queues_follow_their_designs():
    s6 = Q.get("stage6")
    assert [(a, s) for a, s, _, _ in s6.items if a == "paper"] == [("paper", s) for s in (0, 2, 3, 4, 5, 6, 7, 8)]
    assert {lim for a, _, _, lim in s6.items if a == "standard"} == {400} and not s6.remake_cut
    c = Q.get("confirm")
    assert len(c.items) == 6 * 8 + 2 * 4 and c.remake_cut
    assert [a for a, s, _, _ in c.items if s == 9] == [*Q.CONFIRM_ARMS, *Q.TWIN_ARMS]
    assert all(steps == 3000 for _, _, steps, _ in c.items)
    from experiments import arms

    assert all(a in arms.ARMS or a in arms.TORCH_ARMS for q in (s6, c) for a, *_ in q.items)
    with pytest.raises(KeyError):
        Q.get("stage7")


def test_refresh_writes_the_designs_tables_from_its_runs(tmp_path, capsys):
    """``refresh`` runs the queue's commands on the runs of its folder (not on cut/) and returns the
    files they wrote; each equals what the command writes when run by hand."""
    from experiments import search

    root = tmp_path / "l6"
    for name in ("standard-s0", "paper-s0"):
        _run(root / name, 3000)
        (root / name / "config.json").write_text(json.dumps({"optim": {"warmup_steps": 0}}))
    _run(root / "cut" / "paper-s1", 1000, summary=False)
    q = Q.Queue(design="d.md", root="unused", setting="l6", remake_cut=True, items=(),
                products=(("experiments.reproduce", ["executions", "{root}", "--arms", "paper,standard",
                                                     "--seeds", "0", "--horizon", "3000",
                                                     "--md", "{dir}/count.md"]),
                          ("experiments.search", ["verdict", "{runs}", "--md", "{dir}/loss.md"])))
    assert Q.refresh(q, root) == [f"{tmp_path}/count.md", f"{tmp_path}/loss.md"]
    search.main(["verdict", str(root / "paper-s0"), str(root / "standard-s0"),
                 "--md", str(tmp_path / "want.md")])
    capsys.readouterr()
    loss = (tmp_path / "loss.md").read_text()
    assert loss == (tmp_path / "want.md").read_text() and "paper-s1" not in loss
    assert "| paper |" in (tmp_path / "count.md").read_text()


def test_the_confirm_queue_refreshes_what_its_index_lists():
    """The confirm queue's tables are the files its results index names, made by the commands the
    index gives for them (the suite checks their contents against the raw metrics)."""
    from pathlib import Path

    index = Path("results/confirm/INDEX.md").read_text()
    c = Q.get("confirm")
    written = []
    for module, argv in c.products:
        args = [a.format(root=c.root, dir=str(Path(c.root).parent)) for a in argv if a != "{runs}"]
        written += [b for a, b in zip(args, args[1:]) if a in ("--md", "--plot", "--plot-loss")]
        if module == "experiments.reproduce" and "--md" in args:
            assert f"python -m {module} {' '.join(args)}" in index
    assert sorted(written) == sorted(f"results/confirm/{f}" for f in (
        "l6_count.md", "l6_twin_count.md", "l6_loss.md", "l6_L1.png", "l6_loss.png"))
    assert all(f"`{Path(f).name}`" in index for f in written)
