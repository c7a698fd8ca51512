"""lab/twin_backward.py on a CPU: the eager path times both δ and writes its record."""

import json

import pytest

torch = pytest.importorskip("torch")


def test_twin_backward_eager_record(tmp_path):
    from lab import twin_backward

    out = tmp_path / "tb.json"
    twin_backward.main(["--shape", "1x2x200x16", "--reps", "2", "--out", str(out)])
    rec = json.loads(out.read_text())
    assert rec["shape_bhtd"] == [1, 2, 200, 16] and rec["device"] == "cpu"
    for delta in ("o", "dpp"):
        assert rec["deltas"][delta]["eager_ms_median"] > 0
        assert "compiled_ms_median" not in rec["deltas"][delta]  # compiled on CUDA only
