"""``lab.same_lowering`` tells whether two revisions' Mosaic GPU kernels lower to the same CUDA
modules (on a CPU, jax >= 0.11): identical for the same code, a launch option's change seen in the
kernel it reaches and nowhere else."""

import jax
import pytest

from lab import ab, same_lowering

pytestmark = pytest.mark.skipif(jax.__version_info__ < (0, 11),
                                reason="Mosaic GPU lowers for CUDA on a CPU from jax 0.11 on")

SHAPE = (1, 256, 2, 64)


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return ab.prepare("HEAD", tmp_path_factory.mktemp("ab"))


def test_verdicts():
    assert same_lowering.verdict("a\nb", "a\nb") == ("identical", 0)
    assert same_lowering.verdict("a\nb\nb", "b\na\nb") == ("reordered", 0)
    assert same_lowering.verdict("a\nb", "a\nc\nc") == ("differs", 3)


def test_the_same_code_lowers_identically(head):
    rows = same_lowering.compare(head, SHAPE, masks=(True,))
    assert [r["kernel"] for r in rows] == ["fwd", "dkdv", "dq", "dq"]
    assert all(r["verdict"] == "identical" for r in rows), rows


def test_a_launch_option_is_seen_where_it_lowers(head):
    """The forward's persistent programs (a loop over blocks, two Q buffers) differ there only."""
    rows = same_lowering.compare(head, SHAPE, masks=(True,), new_kw={"fwd": {"programs": 7}})
    assert {r["kernel"]: r["verdict"] for r in rows if r["kernel"] != "dq"} == {
        "fwd": "differs", "dkdv": "identical"}
    assert all(r["verdict"] == "identical" for r in rows if r["kernel"] == "dq")
    assert next(r["lines"] for r in rows if r["kernel"] == "fwd") > 0
