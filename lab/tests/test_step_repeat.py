"""lab.step_repeat on the CPU: the counts of differing elements, and its table."""

import numpy as np

from lab import step_repeat


def test_differing_counts_elements_and_takes_nans_as_equal():
    a = {"w": np.array([1.0, np.nan, 3.0]), "b": np.zeros(2)}
    b = {"w": np.array([1.0, np.nan, 3.5]), "b": np.zeros(2)}
    assert step_repeat.differing(a, b) == {"w": 1}
    assert step_repeat.differing(a, a) == {}


def test_table_names_each_mode_and_layout():
    mode = {"tree": {"repeats_differing": [{}, {"['wte']": 3}]},
            "stacked": {"repeats_differing": [{}, {}]}, "stacked_vs_tree": {"['wte']": 7}}
    rec = {"repeats": 3, "device": "cpu", "jax_version": "0", "modes": {"default": mode}}
    text = step_repeat.table(rec)
    assert "| default | tree | none / ['wte']: 3 |  |" in text
    assert "| default | stacked | none / none | ['wte']: 7 |" in text
