"""The Pallas forward kernel (jax_flash/pallas/forward.py), run in interpret mode on the CPU, against
the jnp executor (jax_flash/jnp_impl.py): the same Numerics give the same O and L up to the FP32
summation order inside dots, which XLA:CPU picks per problem size — so each executor is within the
policy's bound of the exact result and the two within twice it (helpers.o_bound). Every launch field
the forward reads (split_diagonal, prefetch_scores) changes no value beyond that."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash as jf
from helpers import (BF16, attention_with_lse, default_and_slow, f64, jitted, lse_bound, make_qkv,
                     numerics, o_bound, tied_inputs)


def compare_forward(assert_close, q, k, v, launch=None, **kw):
    """O and L of the interpreted kernel (with ``launch``) and of the jnp executor, each pair within
    twice the policy's bound of each other (each is within the bound of the exact values)."""
    cfg = numerics(q, k, v, **kw)
    o_j, l_j = attention_with_lse(q, k, v, impl="jnp", **kw)
    o_p, l_p = attention_with_lse(q, k, v, impl="pallas", launch=launch, **kw)
    chex.assert_trees_all_equal_shapes_and_dtypes((o_j, l_j), (o_p, l_p))
    bound, terms = o_bound(q, k, v, cfg)
    assert_close(o_p, o_j, 2 * bound, "O")
    assert_close(l_p, l_j, 2 * lse_bound(terms, f64(l_j)), "L")
    print(f"bitwise: O {np.mean(f64(o_p) == f64(o_j)):.4f}, L {np.mean(f64(l_p) == f64(l_j)):.4f}")


EXECUTOR_FAST = [(BF16, p, st) for p in ("fa2", "paper", "fp32", "paper_fp32acc") for st in (False, True)] + [
    (jnp.float16, "fa2", True), (jnp.float16, "paper", True), (jnp.float32, "fa2", True),
    (jnp.float32, "fp32", True)]
EXECUTOR_ALL = [(d, p, st) for d in (BF16, jnp.float16, jnp.float32)
                for p in ("fa2", "paper", "fp32", "paper_fp32acc") for st in (False, True)]


@pytest.mark.parametrize("dtype,policy,stable", EXECUTOR_FAST + [
    pytest.param(*c, marks=pytest.mark.slow) for c in EXECUTOR_ALL if c not in EXECUTOR_FAST])
def test_kernel_matches_jnp_executor(rng, assert_close, dtype, policy, stable):
    q, k, v = tied_inputs(rng, (1, 50, 2, 32), dtype)
    compare_forward(assert_close, q, k, v, policy=policy, stable=stable, block_q=16, block_k=16)


@pytest.mark.parametrize("policy", ["fa2_sr", "paper_sr", "paper_sr_all"])
def test_stochastic_rounding_is_the_same_dither(rng, policy):
    """The SR dither is a hash of value and position: both executors round alike, bitwise."""
    q, k, v = make_qkv(rng, (1, 40, 2, 32))
    kw = dict(policy=policy, block_q=16, block_k=16)
    # each executor compiled whole: op by op, each of the jnp executor's ops compiled its own program
    chex.assert_trees_all_equal(jitted(jf.attention, q, k, v, impl="jnp", **kw),
                                jitted(jf.attention, q, k, v, impl="pallas", **kw))


LAUNCH_FAST = [("fa2", True, (16, 16), {"split_diagonal": True}),
               ("fa2", False, (16, 32), {"split_diagonal": True}),
               ("fa2", True, (16, 16), {"prefetch_scores": True}),
               ("fa2", True, (32, 16), {"split_diagonal": True, "prefetch_scores": True}),
               ("paper", False, (32, 16), {"prefetch_scores": True}),
               ("paper", True, (16, 16), {"split_diagonal": True}),
               ("fa2", True, (16, 16), {"split_diagonal": True, "prefetch_scores": True})]
LAUNCH_ALL = [(p, c, t, launch) for p in ("fa2", "paper", "fp32") for c in (True, False)
              for t in ((16, 16), (32, 16), (16, 32))
              for launch in ({"split_diagonal": True}, {"prefetch_scores": True},
                             {"split_diagonal": True, "prefetch_scores": True})]


# the default subset: each launch field alone and together, causal and not, "paper" (the rest of
# LAUNCH_FAST and LAUNCH_ALL with JAX_FLASH_SLOW=1)
LAUNCH_DEFAULT = [LAUNCH_FAST[i] for i in (1, 3, 4, 5, 6)]


@pytest.mark.parametrize("policy,causal,tiles,launch",
                         default_and_slow(LAUNCH_DEFAULT, LAUNCH_FAST + LAUNCH_ALL))
def test_launch_changes_no_value(rng, assert_close, policy, causal, tiles, launch):
    """``Launch.split_diagonal`` (mask-free loops over the tiles below the causal diagonal and inside
    kv_len) and ``Launch.prefetch_scores`` (the next key tile's scores a loop step ahead): on tied
    rows under the stable shift, with a kv tail (T = 50), O and L as the jnp executor's."""
    q, k, v = tied_inputs(rng, (1, 50, 1, 32))
    compare_forward(assert_close, q, k, v, launch=launch, policy=policy, causal=causal, stable=True,
                    block_q=tiles[0], block_k=tiles[1])


def test_vmap_adds_a_grid_axis(rng):
    q, k, v = make_qkv(rng, (2, 1, 20, 1, 32))
    f = lambda q, k, v: jf.attention(q, k, v, impl="pallas", block_q=16, block_k=16)
    out = jax.vmap(f)(q, k, v)
    one = jax.jit(f)  # compiled once for both slices: called op by op, each compiled its own
    chex.assert_trees_all_equal([out[i] for i in range(2)], [one(q[i], k[i], v[i]) for i in range(2)])


def test_kv_loop_splits_at_the_diagonal():
    """``kv_loop``: the tiles query block i visits, and (split_diagonal) how many of them need no
    mask — inside kv_len and at or below the block's first row."""
    import importlib

    forward = importlib.import_module("jax_flash.pallas.forward")  # the package exports the function
    x = jax.ShapeDtypeStruct((1, 100, 1, 32), BF16)
    for causal, bq, bk in ((True, 16, 16), (True, 32, 16), (True, 16, 32), (False, 16, 32)):
        cfg = numerics(x, x, x, causal=causal, block_q=bq, block_k=bk)
        nk = -(-100 // bk)
        for i in range(-(-100 // bq)):
            n = int(forward._num_kv_tiles(i, cfg, nk))
            full = int(forward._num_full_kv_tiles(i, cfg, nk))
            keys_seen = min(100, (i + 1) * bq) if causal else 100
            assert n == -(-keys_seen // bk)
            # a full tile: all its keys < kv_len and (causal) ≤ the block's first row
            want = sum(1 for j in range(nk) if (j + 1) * bk <= 100
                       and (not causal or (j + 1) * bk - 1 <= i * bq))
            assert full == min(want, n), (causal, bq, bk, i)
