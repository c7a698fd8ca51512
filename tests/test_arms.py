"""experiments/arms.py: the one registry of arms."""

import pytest

import jax_flash as jf
from experiments import arms
from jax_flash.api import DELTAS
from train import config as config_lib


@pytest.mark.parametrize("preset", ["tiny-cpu", "small-gpu", "gpt2-small-paper"])
def test_every_arm_is_a_valid_config(preset):
    """Each arm's overrides apply to every preset and name a known policy and δ mode, so a typo
    cannot cost a device call."""
    for name in arms.ARMS:
        cfg = config_lib.apply_overrides(config_lib.get_preset(preset), arms.overrides(name))
        att = cfg.model.attention
        assert att.policy in jf.POLICIES and att.delta in DELTAS, name


def test_attention_kwargs_of_flash_arms():
    assert arms.attention_kwargs("fa2") == {"policy": "fa2"}
    assert arms.attention_kwargs("fa2-stable-b7") == {"policy": "fa2", "stable": True, "beta": 7.0}
    assert arms.attention_kwargs("paper-dpp") == {"policy": "paper", "delta": "dpp"}
    with pytest.raises(ValueError, match="not flash"):
        arms.attention_kwargs("standard")
    with pytest.raises(ValueError, match="not flash"):
        arms.attention_kwargs("flash-l2-only")


def test_unknown_arm_suggests_the_nearest():
    with pytest.raises(KeyError, match="did you mean 'fa2-stable'"):
        arms.overrides("fa2-stabel")


def test_shell_form_prints_one_override_a_line(capsys):
    arms.main(["flash-l2-only"])
    assert capsys.readouterr().out.splitlines() == list(arms.ARMS["flash-l2-only"])


def test_twin_args_follow_the_settings_it_can_and_refuse_the_rest():
    """The PyTorch twin gets a setting's model sizes, warmup and micro-batch as its own flags; an
    override it has no equivalent for is refused, never dropped."""
    from experiments import search

    assert arms.twin_args(search.overrides("l6")) == ["--model", '{"n_layer":6}']
    assert arms.twin_args(["model.n_layer=4", "data.batch_size=16", "optim.warmup_steps=250"]) == [
        "--model", '{"n_layer":4}', "--batch-size", "16", "--warmup-steps", "250"]
    assert arms.twin_args([]) == []
    for item in ("model.logits_dtype=bfloat16", "optim.lr=2e-3", "model.n_layer"):
        with pytest.raises(ValueError, match="twin has no equivalent|not a KEY=VALUE"):
            arms.twin_args([item])
