"""jax_flash.spec: Numerics (what a call computes), Launch (how the kernels run), Plan, and the
per-(policy, head_dim) defaults."""

import dataclasses
import json

import jax
import pytest

import jax_flash as jf
from helpers import BF16
from jax_flash import spec
from jax_flash.policy import make_policy


def test_default_tiles_and_scale_late():
    assert spec.default_tiles("fa2", 128) == (64, 128)
    for d in (16, 32, 64, 256):
        assert spec.default_tiles("fa2", d) == (64, 64)
    for name in ("paper", "paper_sr", "paper_sr_all", "paper_fp32acc"):
        assert spec.default_tiles(name, 64) == spec.default_tiles(name, 128) == (32, 512)
    assert spec.default_tiles("fp32", 128) == spec.default_tiles("fa2_sr", 64) == (64, 64)
    assert spec.default_scale_late(make_policy("fa2", BF16), 128)
    assert not spec.default_scale_late(make_policy("fa2", BF16), 64)
    assert not spec.default_scale_late(make_policy("paper", BF16), 128)  # rounds its scores
    assert not spec.default_scale_late(make_policy("fp32", BF16), 128)  # natural-log units


def _numerics(**kw):
    base = dict(policy=make_policy("fa2", BF16), causal=True, stable=False, beta=2.0, sm_scale=0.125,
                delta="o", block_q=64, block_k=64, q_len=256, kv_len=256)
    return spec.Numerics(**{**base, **kw})


def test_numerics_is_frozen_hashable_and_refuses_scale_late_on_rounded_scores():
    num = _numerics()
    assert hash(num) == hash(_numerics()) and num == _numerics()
    with pytest.raises(dataclasses.FrozenInstanceError):
        num.block_k = 128
    for name in ("paper", "paper_sr", "paper_fp32acc"):
        with pytest.raises(ValueError, match="scale_late needs unrounded scores"):
            _numerics(policy=make_policy(name, BF16), scale_late=True)
    assert num.score_scale == pytest.approx(0.125 * 1.4426950408889634)
    assert _numerics(policy=make_policy("fp32", BF16)).score_scale == 0.125


def test_launch_fields_and_validation():
    assert jf.Launch().to_dict() == {}
    full = jf.Launch(fwd_kernel="mosaic", bwd_kernel="mosaic_dkdv", fwd=(4, 3), bwd=(8, 2),
                     dq=(4, 2), split_diagonal=True, bwd_block=128, dq_block=64, prefetch_rows=True,
                     prefetch_scores=True, mosaic_fwd_stages=3, mosaic_bwd_stages=4,
                     mosaic_bwd_regs=(240, 24),
                     mosaic_fwd_persistent=True, heavy_first=True)
    assert jf.Launch.from_dict(full.to_dict()) == full
    assert jf.Launch.from_dict(json.loads(json.dumps(full.to_dict()))) == full  # lists → tuples
    assert jf.Launch.from_dict({"fwd": {"num_warps": 4, "num_stages": 3}}).fwd == (4, 3)
    assert jf.Launch.from_dict({"bwd": [8, 2]}).bwd == (8, 2)
    for bad, msg in (({"fwd_kernel": "cuda"}, "fwd_kernel"), ({"bwd_kernel": "x"}, "bwd_kernel"),
                     ({"fwd": (4,)}, "num_warps"), ({"dq": (0, 2)}, "num_warps"),
                     ({"bwd_block": 48}, "power of two"), ({"dq_block": 8}, "power of two"),
                     ({"bwd_block": 96}, "bwd_block"),
                     ({"mosaic_fwd_stages": 0}, "mosaic_fwd_stages"),
                     ({"mosaic_bwd_stages": 9}, "mosaic_bwd_stages"),
                     ({"mosaic_bwd_stages": 2.0}, "mosaic_bwd_stages"),
                     ({"mosaic_fwd_persistent": "yes"}, "mosaic_fwd_persistent"),
                     ({"mosaic_fwd_persistent": 1}, "mosaic_fwd_persistent"),
                     ({"heavy_first": 1}, "heavy_first"),
                     # not multiples of 8; under setmaxnreg's 24; more than the three warpgroups
                     # hold (2·248 + 24 > 3·168); the producer above the even share
                     ({"mosaic_bwd_regs": (236, 40)}, "mosaic_bwd_regs"),
                     ({"mosaic_bwd_regs": (240, 16)}, "mosaic_bwd_regs"),
                     ({"mosaic_bwd_regs": (248, 24)}, "mosaic_bwd_regs"),
                     ({"mosaic_bwd_regs": (168, 176)}, "mosaic_bwd_regs"),
                     ({"mosaic_bwd_regs": (240,)}, "mosaic_bwd_regs"),
                     ({"mosaic_bwd_regs": (240.0, 24)}, "mosaic_bwd_regs"),
                     ({"mosaic_bwd_regs": {"compute": 240}}, "mosaic_bwd_regs")):
        with pytest.raises(ValueError, match=msg):
            jf.Launch.from_dict(bad)


@pytest.mark.parametrize("field", ["block_q", "block_k", "scale_late", "stable", "beta", "policy",
                                   "exp2_ftz", "shift_factor", "tie_top2", "tie_count_int"])
def test_launch_from_dict_rejects_numerics_fields(field):
    """A launch (the tuning table's, or the caller's ``launch=``) cannot carry anything that
    changes values: numerics fields and the removed flags raise, naming the launch fields."""
    with pytest.raises(ValueError, match=f"not launch fields: \\['{field}'\\]"):
        jf.Launch.from_dict({"fwd_kernel": "triton", field: 1})


def test_plan_record_is_json():
    x = jax.ShapeDtypeStruct((2, 100, 4, 64), BF16)
    p = jf.plan(x, x, x, stable=True, impl="pallas", launch={"split_diagonal": True})
    assert isinstance(p, jf.Plan) and p.executor == "pallas"
    record = json.loads(json.dumps(p.to_dict()))
    assert record["policy"] == "fa2" and record["stable"] is True and record["q_len"] == 100
    assert record["launch"] == {"split_diagonal": True}
    assert (record["block_q"], record["block_k"]) == (64, 64)
