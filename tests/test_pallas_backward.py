"""The Pallas backward kernels (jax_flash/pallas/backward.py: δ, dK/dV, dQ), run in interpret mode on
the CPU, against the jnp executor: each within the policy's gradient bound of the exact gradients
(helpers.grad_bounds), so the two within twice it; every launch field the backward reads
(split_diagonal, bwd_block, dq_block, prefetch_rows, the dQ launch) changes no value beyond that,
and reaches the kernel it names."""

import importlib

import chex
import jax
import jax.numpy as jnp
import pytest

import jax_flash as jf
from helpers import BF16, default_and_slow, grad_bounds, make_qkv, numerics, run, tied_inputs

backward = importlib.import_module("jax_flash.pallas.backward")  # the package exports its function


def compare_gradients(assert_close, q, k, v, do, launch=None, **kw):
    cfg = numerics(q, k, v, **kw)
    a = run(q, k, v, do, impl="jnp", **kw)
    b = run(q, k, v, do, impl="pallas", launch=launch, **kw)
    chex.assert_trees_all_equal_shapes_and_dtypes(a, b)
    for name, x, y, bound in zip(("dQ", "dK", "dV"), a[1:], b[1:], grad_bounds(q, k, v, do, cfg)):
        chex.assert_type(y, q.dtype)  # the kernels write the input dtype directly
        assert_close(y, x, 2 * bound, name)


@pytest.mark.parametrize("policy", ["fa2", "paper", "fp32"])
@pytest.mark.parametrize("delta", ["o", "o_hp", "dpp"])
def test_gradients_match_jnp_executor(rng, assert_close, policy, delta):
    q, k, v = tied_inputs(rng, (1, 40, 2, 32))
    do = make_qkv(rng, q.shape, n=1)[0]
    compare_gradients(assert_close, q, k, v, do, policy=policy, stable=True, delta=delta,
                      block_q=16, block_k=16)


LAUNCH_FAST = [("fa2", True, (16, 16), {"bwd_block": 32}),
               ("fa2", True, (16, 32), {"bwd_block": 64, "split_diagonal": True}),
               ("paper", True, (32, 16), {"bwd_block": 64}),
               ("fa2", False, (16, 16), {"bwd_block": 64}),
               ("fa2", True, (16, 16), {"dq_block": 32}),
               ("fa2", True, (16, 16), {"bwd_block": 32, "dq_block": 16}),
               ("fa2", True, (16, 16), {"prefetch_rows": True}),
               ("fa2", True, (16, 32), {"prefetch_rows": True, "split_diagonal": True}),
               ("fa2", True, (32, 16), {"split_diagonal": True}),
               ("fa2", True, (16, 16), {"heavy_first": True, "dq_block": 32})]
LAUNCH_ALL = [(p, c, t, launch) for p in ("fa2", "paper", "fp32") for c in (True, False)
              for t in ((16, 16), (32, 16), (16, 32))
              for launch in ({"split_diagonal": True}, {"bwd_block": 2 * max(t)},
                             {"bwd_block": 2 * max(t), "split_diagonal": True},
                             {"dq_block": 2 * max(t)}, {"prefetch_rows": True},
                             {"prefetch_rows": True, "bwd_block": 2 * max(t)},
                             {"heavy_first": True})]


# the default subset: every launch feature at least once, in combination (bwd_block with
# split_diagonal and with dq_block, prefetching with split_diagonal), "paper", non-causal, dpp
CASES_FAST = [(*LAUNCH_FAST[i], "o") for i in (1, 2, 3, 5, 7, 9)] + [(*LAUNCH_FAST[i], "dpp")
                                                                    for i in (7, 9)]
CASES_ALL = [(*c, d) for c in LAUNCH_FAST + LAUNCH_ALL for d in ("o", "dpp")]


@pytest.mark.parametrize("policy,causal,tiles,launch,delta", default_and_slow(CASES_FAST, CASES_ALL))
def test_launch_changes_no_gradient(rng, assert_close, policy, causal, tiles, launch, delta):
    """Resident blocks (dK/dV programs keeping ``bwd_block`` keys, dQ programs ``dq_block`` queries,
    over the same streamed tiles), mask-free loops, the prefetched L, δ rows and dQ programs taking
    the query blocks last first: on tied rows under
    the stable shift with a kv tail (T = 50), δ from O and from dP∘P, dQ, dK, dV as the jnp
    executor's."""
    q, k, v = tied_inputs(rng, (1, 50, 1, 32))
    do = make_qkv(rng, q.shape, n=1)[0]
    compare_gradients(assert_close, q, k, v, do, launch=launch, policy=policy, causal=causal,
                      stable=True, delta=delta, block_q=tiles[0], block_k=tiles[1])


def test_dq_launch_and_block_reach_the_dq_kernel_only(monkeypatch):
    """The dQ kernel takes ``Launch.dq`` / ``dq_block`` where set, the dK/dV kernel keeps ``bwd`` /
    ``bwd_block``: the grids and the launch each pallas_call is built with."""
    x = jnp.zeros((1, 64, 1, 32), BF16)
    lse = jnp.zeros((1, 1, 64), jnp.float32)
    cfg = numerics(x, x, x, block_q=16, block_k=16, impl="pallas")
    launches = []
    monkeypatch.setattr(backward, "compiler_params", lambda launch, d, bq, bk, **kw: launches.append(
        (launch, bq, bk)))

    def grids(launch):
        launches.clear()
        jaxpr = jax.make_jaxpr(lambda *a: backward.backward(*a, cfg, launch))(x, x, x, x, lse, lse)
        return [e.params["grid_mapping"].grid[0] for e in jaxpr.jaxpr.eqns
                if e.primitive.name == "pallas_call"]

    assert grids(jf.Launch()) == [4, 4]  # dK/dV over 4 key tiles, dQ over 4 query blocks
    assert grids(jf.Launch(bwd=(4, 2), dq=(8, 3), dq_block=32)) == [4, 2]
    assert launches == [((4, 2), 16, 16), ((8, 3), 32, 16)]
    assert grids(jf.Launch(bwd_block=32, dq_block=16)) == [2, 4]
    assert grids(jf.Launch(bwd_block=32)) == [2, 2]  # one block for both
    assert launches == [(None, 32, 32)]


def test_resident_block_falls_back_where_it_does_not_fit():
    """A resident block that is no multiple of the tiles, or does not divide the padded lengths, is
    not used (the kernels then keep one tile per program)."""
    x = jax.ShapeDtypeStruct((1, 64, 1, 32), BF16)
    cfg = numerics(x, x, x, block_q=16, block_k=32)
    assert backward.resident_block(64, cfg, 128, 128) == 64
    assert backward.resident_block(48, cfg, 96, 96) is None  # not a multiple of 32
    assert backward.resident_block(64, cfg, 96, 96) is None  # 96 % 64
    assert backward.resident_block(None, cfg, 128, 128) is None
