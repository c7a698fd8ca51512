"""experiments/search.py: the loss-failure rule and the verdict from raw metrics."""

import json
import math

import pytest

from experiments import search


@pytest.mark.parametrize("losses,expect", [
    ([3.0] * 1000, None),  # flat: no failure
    ([3.0] * 600 + [5.0] * 400, 638),  # the 50-step mean crosses 1.5 × 3 once 38 fives are in it
    ([3.0] * 600 + [5.0] * 60 + [3.0] * 340, None),  # a spike shorter than 100 steps
    ([3.0] * 600 + [math.nan] + [3.0] * 399, 601),  # a non-finite loss
    ([10.0 - i / 100 for i in range(200)] + [8.0] * 800, None),  # warmup's fall sets no minimum
])
def test_loss_failure_rule(losses, expect):
    assert search.loss_failure(list(range(1, len(losses) + 1)), losses, warmup=100) == expect


def test_divergence_stop_counts_as_failure():
    assert search.loss_failure([1, 2, 3], [3.0, 3.0, 3.0], warmup=0, diverged_at=2) == 2


def _run(tmp_path, name, losses, logits, warmup=100):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"optim": {"warmup_steps": warmup}}))
    recs = [{"step": i + 1, "loss": x} for i, x in enumerate(losses)]
    for step, v in logits:
        recs[step - 1]["max_logit/L1"] = v
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return d


def test_verdict_ratios_to_the_same_seeds_standard_arm(tmp_path):
    fa2 = _run(tmp_path, "fa2-s1", [3.0] * 600 + [6.0] * 400, [(500, 40.0), (1000, 900.0)])
    std = _run(tmp_path, "standard-s1", [3.0] * 1000, [(500, 30.0), (1000, 30.0)])
    rows = {r["run"]: r for r in search.verdict([fa2, std])}
    assert rows["fa2-s1"]["loss_failure"] is not None and rows["standard-s1"]["loss_failure"] is None
    assert rows["fa2-s1"]["ratio_to_standard"] == pytest.approx(30.0)
    assert rows["fa2-s1"]["runaway"] and not rows["standard-s1"]["runaway"]
    assert "fa2-s1" in search.markdown(list(rows.values()))
    alone = search.verdict([fa2])[0]  # no standard execution of seed 1: not judged, not "no"
    assert alone["ratio_to_standard"] is None and not alone["runaway"]
    assert search.markdown([alone]).splitlines()[-1].endswith("| — | — |")
    assert search.markdown(list(rows.values())).splitlines()[2].endswith("| yes |")


def test_every_setting_applies_to_the_preset():
    from train import config

    for name in search.SETTINGS:
        config.apply_overrides(config.get_preset("small-gpu"), search.overrides(name))


def test_count_applies_the_reliability_rule(tmp_path):
    """stage4.md's decision from the runs: futility from two flat fa2 executions before any standard
    one; a runaway or loss-failure reproducer only with every execution made; a standard execution
    at or above 100 (or failing at the loss) sinks the setting."""
    flat = [(500, 40.0), (1000, 45.0)]
    high = [(500, 40.0), (1000, 2000.0)]
    fail = [3.0] * 600 + [6.0] * 400
    ok = [3.0] * 1000
    a = tmp_path / "a"
    a.mkdir()
    runs = [_run(a, "fa2-s0", ok, flat), _run(a, "fa2-s2", ok, flat), _run(a, "fa2-s3", ok, high)]
    res = search.count(search.verdict(runs), [0, 2, 3, 4])
    assert res["decision"] == "futility stop" and res["fa2_flat"] == 2 and res["standard_made"] == 0

    b = tmp_path / "b"
    b.mkdir()
    runs = [_run(b, f"fa2-s{x}", fail if x == 0 else ok, high) for x in (0, 2, 3)]
    runs += [_run(b, f"standard-s{x}", ok, [(500, 30.0), (1000, 30.0)]) for x in (0, 2)]
    assert search.count(search.verdict(runs), [0, 2, 3], runaway_need=3)["decision"] == "undecided"
    runs.append(_run(b, "standard-s3", ok, [(500, 30.0), (1000, 30.0)]))
    res = search.count(search.verdict(runs), [0, 2, 3], runaway_need=3)
    assert (res["fa2_runaways"], res["fa2_loss_failures"], res["decision"]) == (3, 1, "runaway reproducer")
    assert search.count(search.verdict(runs), [0, 2, 3], loss_need=1)["decision"] == \
        "loss-failure reproducer"
    assert search.count(search.verdict(runs), [0, 2, 3])["decision"] == "neither"

    c = tmp_path / "c"
    c.mkdir()
    runs = [_run(c, "fa2-s0", ok, high), _run(c, "standard-s0", ok, [(500, 30.0), (1000, 150.0)])]
    res = search.count(search.verdict(runs), [0], runaway_need=1)
    assert res["standard_failed"] == ["standard-s0"] and res["decision"].startswith("the standard")

    d = tmp_path / "d"  # another arm counted: only its executions, its name in the keys
    d.mkdir()
    runs = [_run(d, "paper-s0", ok, high), _run(d, "fa2-s0", ok, flat),
            _run(d, "standard-s0", ok, [(500, 30.0), (1000, 30.0)])]
    res = search.count(search.verdict(runs), [0], arm="paper", runaway_need=1)
    assert (res["paper_made"], res["paper_runaways"], res["decision"]) == (1, 1, "runaway reproducer")
    assert search.count(search.verdict(runs), [0], runaway_need=1)["decision"] == "neither"


def test_poisson_interval_is_garwoods():
    # the exact 95 % interval for 0, 2 and 10 events (chi-square quantiles / 2)
    for k, want in {0: (0.0, 3.6889), 2: (0.2422, 7.2247), 10: (4.7954, 18.3904)}.items():
        lo, hi = search._poisson_interval(k)
        assert lo == pytest.approx(want[0], abs=1e-4) and hi == pytest.approx(want[1], abs=1e-4)


def test_onsets_and_the_constant_hazard_horizon():
    """Onsets at 2,000 and 3,000, two executions without one to 4,000, counted from step 1,000:
    2 events in 1,000 + 2,000 + 3,000 + 3,000 steps at risk."""
    rec = lambda name, probes: {"run": name, "probes": dict(probes)}
    records = [rec("a", [(1000, 50.0), (2000, 300.0), (3000, 5000.0)]),
               rec("b", [(2000, 40.0), (3000, 301.0), (4000, 80.0)]),
               rec("c", [(2000, 40.0), (4000, 299.9)]),
               rec("d", [(4000, 20.0)]),
               rec("e", [])]
    res = search.onsets(records, start=1000)
    assert [(r["run"], r["onset"]) for r in res["rows"]] == [("a", 2000), ("b", 3000), ("c", None),
                                                             ("d", None)]
    assert res["events"] == 2 and res["exposure_steps"] == 9000
    assert res["hazard"] == pytest.approx(2 / 9000)
    mid, early, late = res["horizons"][0.5]
    assert mid == pytest.approx(1000 + math.log(2) * 4500)
    assert early < mid < late
    assert late == pytest.approx(1000 + math.log(2) / (search._poisson_interval(2)[0] / 9000))


def test_series_reads_probes_losses_and_gradient_norms(tmp_path):
    """series: the probe values in step order, the loss mean and gradient norms per window, and a
    last shorter window; the markdown quotes them."""
    d = tmp_path / "fa2-s0"
    d.mkdir()
    recs = [{"step": s, "loss": float(s), "grad_norm": float(s % 7)} for s in range(1, 1201)]
    recs[499]["max_logit/L1"], recs[999]["max_logit/L1"] = 40.0, 2500.0
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    res = search.series(d, window=500)
    assert res["probes"] == [(500, 40.0), (1000, 2500.0)]
    assert [w["steps"] for w in res["windows"]] == [(1, 500), (501, 1000), (1001, 1200)]
    assert res["windows"][0]["loss"] == pytest.approx(250.5)
    assert res["windows"][2]["loss"] == pytest.approx(1100.5)
    assert res["windows"][0]["grad_norm_max"] == 6.0
    md = search.series_markdown([res])
    assert "from step 500 every 500: 40 2,500" in md and "per 500 steps: 250.50 750.50 1100.50" in md
