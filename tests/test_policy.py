"""jax_flash/policy.py: the presets' rounding points per input dtype, and the stochastic-rounding
variants (the same dither on both executors)."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash as jf
from helpers import BF16, f64, jitted, make_qkv, numerics, o_bound
from jax_flash.policy import POLICIES, make_policy


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("dtype", [BF16, jnp.float16, jnp.float32])
def test_presets_resolve_against_the_input_dtype(name, dtype):
    if name in ("paper_sr", "fa2_sr", "paper_sr_all") and dtype == jnp.float16:
        with pytest.raises(ValueError, match="bfloat16"):
            make_policy(name, dtype)
        return
    pol = make_policy(name, dtype)
    assert pol.name == name and hash(pol) == hash(make_policy(name, dtype))
    if name.startswith("fp32"):
        assert pol.operand_dtype == pol.p_dtype == pol.o_residual_dtype == np.dtype(np.float32)
        assert pol.fp32_dot == ("bf16x6" if name == "fp32_bf16x6" else "ieee")
    elif name.startswith("paper"):
        lp = np.dtype(dtype) if np.dtype(dtype).itemsize == 2 else np.dtype(BF16)
        assert pol.operand_dtype == pol.lp_dtype == lp and pol.round_scores and not pol.log2_units
        assert pol.lp_accumulators == (name != "paper_fp32acc") and pol.tile_sum_floor == 1e-10
    else:
        assert pol.operand_dtype == np.dtype(dtype) and pol.log2_units and pol.exp_ftz
    assert pol.exp_ftz == name.startswith("fa2")


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fp32_sr", BF16)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("bf16", BF16)


def test_sr_policy_names():
    """The SR presets are their base with stochastic rounding (FP16: refused)."""
    for name in ("paper", "fa2", "fp32"):
        assert not make_policy(name, BF16).stochastic_rounding
    for name in ("paper_sr", "fa2_sr", "paper_sr_all"):
        pol = make_policy(name, BF16)
        assert pol.stochastic_rounding and pol.name == name
        base = make_policy(name.split("_")[0], BF16)
        assert pol == base.__class__(**{**base.__dict__, "name": name, "stochastic_rounding": True,
                                        "stochastic_row_sum": name == "paper_sr_all"})
        with pytest.raises(ValueError, match="bfloat16"):
            make_policy(name, jnp.float16)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fp32_sr", BF16)


@pytest.mark.parametrize("name", ["paper_sr", "fa2_sr", "paper_sr_all"])
def test_sr_policies_within_their_bound(rng, assert_close, name):
    """Each SR preset: O within its bound of the exact result (each stochastic rounding errs by less
    than one ulp, 2u), and not round-to-nearest's O (the dither is used). Both executors draw the
    same dither: tests/test_pallas_forward.py."""
    q, k, v = make_qkv(rng, (1, 40, 2, 32))
    kw = dict(policy=name, block_q=16, block_k=16, impl="jnp")
    o = jitted(jf.attention, q, k, v, **kw)  # compiled whole, not op by op
    chex.assert_type(o, BF16)
    assert_close(o, jf.reference_numpy(q, k, v), o_bound(q, k, v, numerics(q, k, v, **kw))[0], "O")
    base = jitted(jf.attention, q, k, v, **{**kw, "policy": name.split("_")[0]})
    assert np.any(f64(o) != f64(base))
