"""``lab.same_bits`` counts the elements two revisions compute differently: none for the same code
(here on the CPU, the jnp executor), and every one a perturbation moves."""

import jax_flash
import pytest

from lab import ab, same_bits

SHAPE = (1, 128, 2, 32)


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return ab.prepare("HEAD", tmp_path_factory.mktemp("ab"))


def test_the_same_code_differs_nowhere(head):
    rows = same_bits.compare(head, [SHAPE])
    assert len(rows) == 4  # causal and not, with and without the stable shift
    assert all(r["differing"] == {"o": 0, "dq": 0, "dk": 0, "dv": 0} for r in rows)


def test_a_moved_value_is_counted(head, monkeypatch):
    shipped = jax_flash.attention
    # O·(1 + 2⁻⁶): every nonzero bf16 output moves, and so do the gradients through it
    monkeypatch.setattr(jax_flash, "attention", lambda *a, **kw: shipped(*a, **kw) * 1.015625)
    assert same_bits.main(["--old", str(head), "--shapes", "x".join(map(str, SHAPE))]) == 1
    rows = same_bits.compare(head, [SHAPE], masks=(True,), stables=(False,))
    assert rows[0]["differing"]["o"] > rows[0]["elements"] // 2
    assert rows[0]["differing"]["dq"] > 0
