"""lab.dispatch_cost on the CPU: the state holds the bytes asked for in the arrays asked for, a
step updates every array in place of the donated ones, and a run writes a row per case."""

import json

import numpy as np

from lab import dispatch_cost


def test_state_splits_the_bytes_over_the_arrays():
    state, elems = dispatch_cost.make_state(30, 1.0, 16)
    sizes = [a.size for a in state["arrays"].values()]
    assert len(sizes) == 30 and sum(sizes) == elems
    assert abs(elems * 4 - 2**20) <= 30 * 4  # 1 MiB of FP32 but for the rounding of each array
    assert max(sizes) > 2 * min(sizes)  # spread, not one size


def test_step_updates_every_array():
    state, _ = dispatch_cost.make_state(3, 0.01, 8)
    before = {k: np.asarray(a) for k, a in state["arrays"].items()}
    new, metric = dispatch_cost.make_step(1)(state)
    for k, a in new["arrays"].items():
        np.testing.assert_allclose(np.asarray(a), before[k] * 0.999 + 1e-3, rtol=1e-6)
    assert np.isfinite(float(metric))
    # every updated array may take its donated input's buffer
    hlo = dispatch_cost.make_step(1).lower(new).as_text()
    assert hlo.count("tf.aliasing_output") >= len(new["arrays"])


def test_modes_return_what_they_say():
    state, _ = dispatch_cost.make_state(3, 0.01, 8)
    assert np.ndim(dispatch_cost.make_step(0, "read")(state)) == 0
    new, _ = dispatch_cost.make_step(0, "kept")(state)
    assert not any(a.is_deleted() for a in state["arrays"].values())  # not donated
    assert new["arrays"].keys() == state["arrays"].keys()


def test_run_writes_a_row_per_case(tmp_path):
    out = tmp_path / "dc.json"
    rows = dispatch_cost.main(["--arrays", "2,4", "--mib", "0.01", "--matmuls", "0,1",
                               "--matmul-dim", "8", "--steps", "2", "--warmup", "1",
                               "--modes", "donated,read", "--out", str(out)])
    assert [(r["mode"], r["matmuls"], r["arrays"]) for r in rows] == [
        (m, mm, n) for m in ("donated", "read") for mm in (0, 1) for n in (2, 4)]
    assert all(r["entry_instructions"] > 0 for r in rows)
    saved = json.loads(out.read_text())
    assert saved["rows"] == rows and saved["meta"]["device"]


def test_entry_ops_are_counted_in_the_entry_computation_only():
    hlo = """HloModule m

%fused (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  ROOT %n = f32[2]{0} fusion(%p), kind=kLoop, calls=%inner
}

ENTRY %main (a: f32[2]) -> f32[2] {
  %a = f32[2]{0} parameter(0)
  %f = f32[2]{0} fusion(%a), kind=kLoop, calls=%fused
  %c = f32[2]{0} custom-call(%f), custom_call_target="x"
  ROOT %g = f32[2]{0} fusion(%c), kind=kLoop, calls=%fused
}
"""
    assert dispatch_cost.count_entry_ops(hlo) == {
        "entry_fusions": 2, "entry_custom_calls": 1, "entry_instructions": 4}
