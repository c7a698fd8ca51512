"""The Mosaic GPU backward (jax_flash/pallas/backward_mosaic.py: dK/dV and dQ kernels) on the CPU.

Their tile arithmetic against tile.backward_tile_dkdv / backward_tile_dq, op for op (any JAX); the
selection switch and the hook in backward.py; and, where JAX has a Mosaic GPU interpreter (jax ≥
0.11: ``plgpu.InterpretGPUParams``), the whole kernels — TMA ring, ready/free barriers, two compute
warpgroups, causal skipping and the masked diagonal — interpreted with race detection against the
jnp executor's gradients and float64. The interpreter lacks a register operand of wgmma and
``run_state``: there Pᵀ, dSᵀ (dS) go through shared memory and dV + Pᵀ·dO (etc.) is added after the
MMA (as tile.py writes it). The compiled kernels run in tests/test_gpu.py (-k mosaic).
"""

import dataclasses
import importlib

import chex
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash as jf
from helpers import BF16, f64, grad_bounds, jitted, ulp_of_max
from jax_flash import jnp_impl, spec, tile
from jax_flash.pallas import backward_mosaic as bm
from jax_flash.pallas import mosaic_common
from jax_flash.pallas.mosaic_common import interpret_params
from jax_flash.policy import make_policy

pb = importlib.import_module("jax_flash.pallas.backward")  # the package exports its function


def make_cfg(t, d, *, causal=True, stable=False, block_q=64, block_k=64, delta="o", policy="fa2"):
    return spec.Numerics(policy=make_policy(policy, BF16), causal=causal, stable=stable, beta=2.0,
                         sm_scale=d ** -0.5, delta=delta, block_q=block_q, block_k=block_k, q_len=t,
                         kv_len=t)


# ------------------------------------------------------------------------------ tile arithmetic
@pytest.mark.parametrize("masked", [False, True])
def test_kernel_step_is_backward_tile_dkdv(rng, masked):
    """The kernel's step — raw K·Qᵀ and V·dOᵀ, ``p_tile``, ``ds_tile`` with L and δ broadcast to the
    tile, the MMAs' dV + bf16(Pᵀ)·dO and dK + bf16(dSᵀ)·Q — == tile.backward_tile_dkdv, bitwise,
    over three query blocks (the diagonal one masked when ``masked``)."""
    bq, bk, d = 64, 64, 32
    cfg = make_cfg(256, d, causal=masked)
    pol = cfg.policy
    k, v = (jnp.asarray(rng.standard_normal((bk, d)), BF16) for _ in range(2))
    key0 = 64
    ours = theirs = (jnp.zeros((bk, d), jnp.float32),) * 2
    for i in (1, 2, 3):
        q, do = (jnp.asarray(rng.standard_normal((bq, d)), BF16) for _ in range(2))
        s = np.asarray(tile.scores(q, k, cfg))
        lse = jnp.asarray(np.log2(np.exp2(s).sum(1)) + rng.uniform(-0.1, 0.1, bq), jnp.float32)
        dlt = jnp.asarray(rng.standard_normal(bq), jnp.float32)
        mask_t = (tile.tile_mask(i * bq, key0, bq, bk, cfg, transposed=True)
                  if masked and i == 1 else None)
        s_t = tile.dot_nt(k, q, pol)
        dp_t = tile.dot_nt(v, do, pol)
        bcast = lambda x: jax.lax.broadcast_in_dim(x, (bk, bq), [1])
        p_t = bm.p_tile(s_t, bcast(lse), mask_t, cfg)
        ds_t = bm.ds_tile(p_t, dp_t, bcast(dlt))
        dk, dv = ours
        dv = dv + tile.dot_nn(p_t.astype(BF16), do, pol)
        dk = dk + tile.dot_nn(ds_t.astype(BF16), q, pol)
        ours = (dk, dv)
        theirs = tile.backward_tile_dkdv(*theirs, q, k, v, do, lse, dlt, mask_t, cfg)
        for a, b in zip(ours, theirs):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if masked:  # the diagonal block's mask has masked and unmasked entries
        diag = np.asarray(tile.tile_mask(bq, key0, bq, bk, cfg, transposed=True))
        assert np.any(~diag) and np.any(diag)
    assert np.all(np.isfinite(np.asarray(ours[0]))) and np.any(np.asarray(ours[0]) != 0)


@pytest.mark.parametrize("masked", [False, True])
def test_dq_step_is_backward_tile_dq(rng, masked):
    """The dQ kernel's step — raw Q·Kᵀ and dO·Vᵀ, ``ds_tile_dq`` with L and δ broadcast to the tile,
    the MMA's dQ + bf16(dS)·K — == tile.backward_tile_dq, bitwise, over three key tiles (the
    diagonal one masked when ``masked``)."""
    bq, bk, d = 64, 64, 32
    cfg = make_cfg(256, d, causal=masked)
    pol = cfg.policy
    q, do = (jnp.asarray(rng.standard_normal((bq, d)), BF16) for _ in range(2))
    rows = 128
    lse = jnp.asarray(rng.uniform(2.0, 6.0, bq), jnp.float32)
    dlt = jnp.asarray(rng.standard_normal(bq), jnp.float32)
    bcast = lambda x: jax.lax.broadcast_in_dim(x, (bq, bk), [0])
    ours = theirs = jnp.zeros((bq, d), jnp.float32)
    for j in (0, 1, 2):
        k, v = (jnp.asarray(rng.standard_normal((bk, d)), BF16) for _ in range(2))
        mask = tile.tile_mask(rows, j * bk, bq, bk, cfg) if masked and j == 2 else None
        ds = bm.ds_tile_dq(tile.dot_nt(q, k, pol), tile.dot_nt(do, v, pol), bcast(lse), bcast(dlt),
                           mask, cfg)
        ours = ours + tile.dot_nn(ds.astype(BF16), k, pol)
        theirs = tile.backward_tile_dq(theirs, q, k, v, do, lse, dlt, mask, cfg)
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert np.all(np.isfinite(np.asarray(ours))) and np.any(np.asarray(ours) != 0)


# ------------------------------------------------------------------------------------- coverage
def test_check_says_what_it_does_not_cover():
    cfg = make_cfg(1024, 64)
    shape = (2, 1024, 4, 64)
    assert bm.check(cfg, shape, BF16, BF16, shape) is None
    assert bm.check(make_cfg(1024, 128, block_q=128, block_k=128), (1, 1024, 1, 128), BF16) is None
    assert "policy" in bm.check(make_cfg(1024, 64, policy="paper"), shape, BF16)
    assert "delta" in bm.check(make_cfg(1024, 64, delta="dpp"), shape, BF16)
    assert "head_dim" in bm.check(cfg, (2, 1024, 4, 32), BF16)
    assert "out_dtype" in bm.check(cfg, shape, BF16, jnp.float32)
    assert bm.check(make_cfg(1000, 64), shape, BF16) is None  # a length padded up to 1024
    assert "q_len" in bm.check(dataclasses.replace(cfg, q_len=512), shape, BF16)  # cross-attention
    assert "q_len" in bm.check(make_cfg(1100, 64), shape, BF16)
    assert "multiple" in bm.check(make_cfg(1088, 64), (2, 1088, 4, 64), BF16)
    assert "k shape" in bm.check(cfg, shape, BF16, BF16, (2, 2048, 4, 64))
    x = jnp.zeros((1, 1088, 1, 64), BF16)
    rows = jnp.zeros((1, 1, 1088), jnp.float32)
    with pytest.raises(ValueError, match="does not cover"):
        bm.dkdv_mosaic(x, x, x, x, rows, rows, make_cfg(1088, 64), out_dtype=BF16)


@pytest.mark.parametrize("kernel", ["mosaic", "mosaic_dkdv"])
def test_plan_keeps_the_table_choice_only_where_it_covers(monkeypatch, kernel):
    """A tuning entry's ``bwd_kernel`` stays in the plan where the kernels can run the call
    (availability faked), and becomes "triton" silently where they cannot (δ from dP∘P); asked for
    explicitly there, it raises."""
    from jax_flash.pallas import tuning

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(mosaic_common, "unavailable", lambda: None)
    monkeypatch.setattr(tuning, "lookup_entry",
                        lambda *a: ("fa2/d64/t1024/causal", jf.Launch(bwd_kernel=kernel)))
    x = jax.ShapeDtypeStruct((1, 1024, 2, 64), BF16)
    p = jf.plan(x, x, x, stable=True)
    assert p.launch.bwd_kernel == kernel and p.launch.fwd_kernel == "triton"
    assert jf.plan(x, x, x, delta="dpp").launch.bwd_kernel == "triton"
    with pytest.raises(ValueError, match="delta 'dpp'"):
        jf.plan(x, x, x, delta="dpp", launch={"bwd_kernel": kernel})


@pytest.mark.parametrize("with_dq", [True, False])
def test_hook_in_backward_runs_them(monkeypatch, with_dq):
    """backward.py's hook: for ``Launch.bwd_kernel`` "mosaic" / "mosaic_dkdv" dK and dV are the
    Mosaic kernel's (given q, k, v, dO, L, δ as the Triton kernel gets them, the gradients' dtype,
    the launch's ring depth and register split), dQ the Mosaic dQ kernel's (and its key tile)
    or (dK/dV only) still the Triton kernel's; for "triton" nothing of it runs."""
    shape = (1, 128, 1, 64)
    cfg = make_cfg(128, 64)
    q, k, v, do = (jnp.asarray(np.random.default_rng(i).standard_normal(shape), BF16)
                   for i in range(4))
    lse = jnp.zeros((1, 1, 128), jnp.float32) + 7.0
    dlt = jnp.ones((1, 1, 128), jnp.float32)
    seen = []

    def fake(fill):
        def kernel(q, k, v, do, lse, dlt, cfg, *, out_dtype, interpret=None, stages=None,
                   regs=None, keys=None):
            seen.append(((q, k, v, do, lse, dlt), cfg, out_dtype, stages, regs, keys))
            out = tuple(jnp.full(shape, x, out_dtype) for x in fill)
            return out if len(out) > 1 else out[0]
        return kernel

    monkeypatch.setattr(bm, "dkdv_mosaic", fake((1.0, 2.0)))
    monkeypatch.setattr(bm, "dq_mosaic", fake((3.0,)))
    base = pb.backward(q, k, v, do, lse, dlt, cfg, jf.Launch(), out_dtype=BF16)
    assert not seen
    launch = jf.Launch(bwd_kernel="mosaic" if with_dq else "mosaic_dkdv", mosaic_bwd_stages=2,
                       mosaic_bwd_regs=(240, 24), mosaic_dq_keys=128)
    dq, dk, dv = pb.backward(q, k, v, do, lse, dlt, cfg, launch, out_dtype=BF16)
    assert len(seen) == (2 if with_dq else 1)
    # the dK/dV kernel is called first; the dQ kernel takes the key tile
    assert [s[-1] for s in seen] == [None, 128][:len(seen)]
    for args, got_cfg, out_dtype, stages, regs, *_ in seen:
        for a, b in zip(args, (q, k, v, do, lse, dlt)):
            assert a is b
        assert got_cfg == cfg and out_dtype == BF16 and stages == 2 and regs == (240, 24)
    assert np.all(np.asarray(dk, np.float32) == 1) and np.all(np.asarray(dv, np.float32) == 2)
    if with_dq:
        assert np.all(np.asarray(dq, np.float32) == 3)
    else:
        chex.assert_trees_all_equal(dq, base[0])


# ------------------------------------------------------------------------- interpreted kernel
needs_interpreter = pytest.mark.skipif(
    interpret_params() is None or jax.default_backend() == "gpu",
    reason="needs JAX's Mosaic GPU interpreter (jax >= 0.11: plgpu.InterpretGPUParams) on a CPU")


def _inputs(rng, shape, cfg, tied=False):
    """q, k, v, dO and the forward's stored O, L and δ = rowsum(dO∘O) (the jnp executor's)."""
    q, k, v, do = (np.asarray(rng.standard_normal(shape), np.float32) for _ in range(4))
    if tied:  # queries along one direction, identical keys along it: tied maxima (stable shifts)
        d = shape[-1]
        u = rng.standard_normal(d).astype(np.float32)
        u /= np.linalg.norm(u)
        q = q * 0.3 + u * 4.0
        for a in (3, 5, 130, 140):
            k[:, a] = u * 8.0 * np.sqrt(d) / 4.0
    q, k, v, do = (jnp.asarray(x, BF16) for x in (q, k, v, do))
    o, lse = jitted(jnp_impl.forward, q, k, v, cfg=cfg)
    o = jnp.asarray(o).astype(BF16)
    dlt = jitted(jnp_impl.delta, q, k, v, o, do, lse, cfg=cfg)
    return q, k, v, do, o, lse, dlt


def _interpreted(q, k, v, do, lse, dlt, cfg, stages=None, dq_keys=None):
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as interp

    interp.gpu_callbacks.reset_gpu_interpret_mode_state()
    # each kernel compiled once per test (the race detector runs inside it too)
    dk, dv = jitted(bm.dkdv_mosaic, q, k, v, do, lse, dlt, cfg=cfg, out_dtype=q.dtype,
                    interpret=interpret_params(), stages=stages)
    jax.block_until_ready((dk, dv))  # the interpreter's state is global: finish before reading it
    assert not interp.get_races().races_found
    interp.gpu_callbacks.reset_gpu_interpret_mode_state()
    dq = jitted(bm.dq_mosaic, q, k, v, do, lse, dlt, cfg=cfg, out_dtype=q.dtype,
                interpret=interpret_params(), stages=stages, keys=dq_keys)
    jax.block_until_ready((dq))  # the interpreter's state is global: finish before reading it
    assert not interp.get_races().races_found
    return dq, dk, dv


@needs_interpreter
@pytest.mark.parametrize("shape,causal,stable", [
    ((1, 256, 2, 64), True, False), pytest.param((1, 256, 2, 64), False, False, marks=pytest.mark.slow),
    pytest.param((1, 384, 1, 128), True, False, marks=pytest.mark.slow), ((1, 384, 1, 128), False, True),
    ((2, 384, 1, 64), True, True)],
    ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_interpreted_kernels_match_triton_and_jnp(rng, assert_close, shape, causal, stable):
    """The kernels, interpreted with race detection, given the jnp forward's L and δ: dQ, dK, dV
    against the Triton kernels interpreted (Pallas interpret mode) and the jnp executor's backward
    with the same L and δ — each within twice the policy's gradient bound of the other, as each is
    within the bound of the exact gradients — and against float64. ``stable``: L from the stable
    forward on tied inputs (the backward itself is the same)."""
    cfg = make_cfg(shape[1], shape[-1], causal=causal, stable=stable)
    q, k, v, do, o, lse, dlt = _inputs(rng, shape, cfg, tied=stable)
    ours = _interpreted(q, k, v, do, lse, dlt, cfg)
    triton = jitted(pb.backward, q, k, v, do, lse, dlt, cfg=cfg, launch=jf.Launch(), out_dtype=BF16)
    jnp_g = jitted(jnp_impl.backward, q, k, v, do, lse, dlt, cfg=cfg, out_dtype=BF16)
    exact = jf.reference_numpy(q, k, v, do, causal=causal)[1:]
    bounds = grad_bounds(q, k, v, do, cfg)
    for i, name in enumerate(("dQ", "dK", "dV")):
        chex.assert_type(ours[i], BF16)
        assert_close(ours[i], triton[i], 2 * bounds[i], f"{name} vs Triton")
        assert_close(ours[i], jnp_g[i], 2 * bounds[i], f"{name} vs jnp")
        assert_close(ours[i], exact[i], bounds[i], f"{name} vs float64")


@needs_interpreter
def test_interpreted_ring_depth_changes_no_bit(rng):
    """``Launch.mosaic_bwd_stages`` only decides how far the streamed loads run ahead: dQ, dK, dV
    with a ring of 1 (each load waits for its slot to be read) equal the default ring's (4 at
    head_dim 64) bit for bit, races checked."""
    shape = (1, 256, 1, 64)
    cfg = make_cfg(shape[1], shape[-1], causal=True)
    q, k, v, do, o, lse, dlt = _inputs(rng, shape, cfg)
    base = _interpreted(q, k, v, do, lse, dlt, cfg)
    chex.assert_trees_all_equal(_interpreted(q, k, v, do, lse, dlt, cfg, stages=1), base)


@needs_interpreter
@pytest.mark.parametrize("shape,causal,stable", [
    ((1, 256, 2, 64), True, False), ((1, 384, 1, 128), False, True),
    pytest.param((1, 384, 1, 128), True, True, marks=pytest.mark.slow)],
    ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_interpreted_dq_key_tiles(rng, assert_close, shape, causal, stable):
    """``Launch.mosaic_dq_keys=128``: the dQ kernel streams 128-key tiles, races checked. Compiled,
    each tile's dS·K continues the same accumulator in the same key order as two 64-key tiles; the
    interpreter adds each tile's product to dQ apart, so here the two are held to twice the
    policy's bound of each other and of the jnp executor, and to the bound of float64."""
    cfg = make_cfg(shape[1], shape[-1], causal=causal, stable=stable)
    q, k, v, do, o, lse, dlt = _inputs(rng, shape, cfg, tied=stable)
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as interp

    def dq(keys):
        interp.gpu_callbacks.reset_gpu_interpret_mode_state()
        out = jitted(bm.dq_mosaic, q, k, v, do, lse, dlt, cfg=cfg, out_dtype=q.dtype,
                     interpret=interpret_params(), keys=keys)
        jax.block_until_ready(out)
        assert not interp.get_races().races_found
        return out

    wide, narrow = dq(128), dq(64)
    jnp_dq = jitted(jnp_impl.backward, q, k, v, do, lse, dlt, cfg=cfg, out_dtype=BF16)[0]
    exact = jf.reference_numpy(q, k, v, do, causal=causal)[1]
    bound = grad_bounds(q, k, v, do, cfg)[0]
    chex.assert_type(wide, BF16)
    assert_close(wide, narrow, 2 * bound, "dQ 128-key vs 64-key tiles")
    assert_close(wide, jnp_dq, 2 * bound, "dQ vs jnp")
    assert_close(wide, exact, bound, "dQ vs float64")
    print(f"bitwise with 64-key tiles: {np.mean(f64(wide) == f64(narrow)):.4f}")


@needs_interpreter
@pytest.mark.parametrize("causal,window", [
    (True, None), pytest.param(False, (300, 40), marks=pytest.mark.slow)], ids=["causal", "window"])
def test_interpreted_dq_half_last_tile_changes_no_bit(rng, monkeypatch, causal, window):
    """The dQ kernel on 128-key tiles: a warpgroup's last tile run on its first 64 keys where its
    rows see none of the rest (``mosaic_common.HALF_LAST``) gives dQ equal to the whole tile's bit
    for bit, races checked: the unseen half's dS is zero, left off the end of the product."""
    shape = (1, 384, 1, 128)
    cfg = dataclasses.replace(make_cfg(shape[1], shape[-1], causal=causal, stable=True),
                              window=window)
    q, k, v, do, o, lse, dlt = _inputs(rng, shape, cfg, tied=True)
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as interp

    out = {}
    for half in (True, False):
        monkeypatch.setattr(mosaic_common, "HALF_LAST", half)
        monkeypatch.setattr(helpers, "_COMPILED", {})  # traced again under each setting
        interp.gpu_callbacks.reset_gpu_interpret_mode_state()
        out[half] = jitted(bm.dq_mosaic, q, k, v, do, lse, dlt, cfg=cfg, out_dtype=q.dtype,
                           interpret=interpret_params(), keys=128)
        jax.block_until_ready(out[half])
        assert not interp.get_races().races_found
    chex.assert_trees_all_equal(out[True], out[False])


def test_dq_key_tiles_are_checked():
    x = jnp.zeros((1, 256, 1, 64), BF16)
    rows = jnp.zeros((1, 1, 256), jnp.float32)
    with pytest.raises(ValueError, match="key tiles of \\(64, 128\\), got 32"):
        bm.dq_mosaic(x, x, x, x, rows, rows, make_cfg(256, 64), out_dtype=BF16, keys=32)
    with pytest.raises(ValueError, match="mosaic_dq_keys must be 64 or 128"):
        jf.Launch(mosaic_dq_keys=256)


def test_ring_that_cannot_fit_raises():
    """A ring deeper than shared memory holds raises before any lowering, naming the largest that
    fits (dK/dV at head_dim 128: 33 KiB a stage beside 64 KiB of K and V; a ring of 5 compiled to
    233,704 bytes, over the 232,448 a block may take)."""
    x = jnp.zeros((1, 1024, 1, 128), BF16)
    rows = jnp.zeros((1, 1, 1024), jnp.float32)
    cfg = make_cfg(1024, 128)
    with pytest.raises(ValueError, match=r"dK/dV kernel: 5 stages need .* at most 4 fit"):
        bm.dkdv_mosaic(x, x, x, x, rows, rows, cfg, out_dtype=BF16, stages=5)
    with pytest.raises(ValueError, match=r"dQ kernel: 5 stages need .* at most 4 fit"):
        bm.dq_mosaic(x, x, x, x, rows, rows, cfg, out_dtype=BF16, stages=5)


def test_smem_accounting_covers_what_the_compiler_reported():
    """The dK/dV kernel with a ring of 5 at head_dim 128 compiled to 233,704 bytes of shared memory
    (jax 0.11.2, H200): its buffers on 1 KiB boundaries and 8 bytes a barrier give exactly that,
    and the check adds the lowering's reserve on top."""
    need = mosaic_common.smem_bytes(bm.dkdv_scratch(128, BF16, 5))
    assert need - mosaic_common.LOWERING_RESERVE == 233_704


@needs_interpreter
# GQA with a window runs by default (test_interpreted_window_kernels); these with JAX_FLASH_SLOW=1
@pytest.mark.parametrize("kv_heads,causal", [pytest.param(2, True, marks=pytest.mark.slow),
                                            pytest.param(1, False, marks=pytest.mark.slow)],
                         ids=["gqa-causal", "mqa-full"])
def test_interpreted_gqa_kernels(rng, assert_close, kv_heads, causal):
    """GQA/MQA: four query heads on ``kv_heads`` key/value heads. dQ bitwise the kernel's own on K
    and V repeated to four heads (the same arithmetic per query head); dK, dV — the group's query
    heads summed in FP32 before one rounding, as the Triton kernel and the jnp executor sum them —
    against both within twice, and against float64 within, the group's summed per-head bounds."""
    shape, g = (1, 256, 4, 64), 4 // kv_heads
    cfg_rep = make_cfg(256, 64, causal=causal)
    cfg = dataclasses.replace(cfg_rep, groups=g)
    q, do = (jnp.asarray(rng.standard_normal(shape), BF16) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((1, 256, kv_heads, 64)), BF16) for _ in range(2))
    k_rep, v_rep = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    o, lse = jitted(jnp_impl.forward, q, k, v, cfg=cfg)
    o = jnp.asarray(o).astype(BF16)
    dlt = jitted(jnp_impl.delta, q, k, v, o, do, lse, cfg=cfg)
    ours = _interpreted(q, k, v, do, lse, dlt, cfg)
    chex.assert_shape(ours, [q.shape, k.shape, v.shape])
    rep = _interpreted(q, k_rep, v_rep, do, lse, dlt, cfg_rep)
    chex.assert_trees_all_equal(ours[0], rep[0])
    triton = jitted(pb.backward, q, k, v, do, lse, dlt, cfg=cfg, launch=jf.Launch(), out_dtype=BF16)
    jnp_g = jitted(jnp_impl.backward, q, k, v, do, lse, dlt, cfg=cfg, out_dtype=BF16)
    group_sum = lambda x: np.asarray(x, np.float64).reshape(1, 256, kv_heads, g, 64).sum(3)
    exact = jf.reference_numpy(q, k_rep, v_rep, do, causal=causal)[1:]
    bounds = grad_bounds(q, k_rep, v_rep, do, cfg_rep)
    for i, name in ((1, "dK"), (2, "dV")):
        bound = group_sum(bounds[i])
        assert_close(ours[i], triton[i], 2 * bound, f"{name} vs Triton")
        assert_close(ours[i], jnp_g[i], 2 * bound, f"{name} vs jnp")
        assert_close(ours[i], group_sum(exact[i]), bound, f"{name} vs float64")


@needs_interpreter
@pytest.mark.parametrize("window,causal,kv_heads,dq_keys", [
    ((127, 0), True, 1, None), ((100, 30), True, 2, None), ((100, 30), True, 2, 128),
    pytest.param((64, 64), False, 2, None, marks=pytest.mark.slow)],
                         ids=["sliding-127", "left-100-right-30-gqa", "left-100-right-30-gqa-dq128",
                              "both-64-gqa"])
def test_interpreted_window_kernels(rng, assert_close, window, causal, kv_heads, dq_keys):
    """Windows: the dQ kernel streams the key tiles its rows see (64 keys, or 128:
    ``Launch.mosaic_dq_keys``), the dK/dV kernel the query blocks that see its keys
    (``tile.q_block_bounds``), per query head of the group; edge tiles masked. dQ, dK, dV against
    the Triton kernels interpreted and the jnp executor's backward under the same Numerics and the
    same L and δ."""
    shape, g = (1, 384, 2, 64), 2 // kv_heads
    cfg = dataclasses.replace(make_cfg(384, 64, causal=causal), window=window, groups=g)
    q, do = (jnp.asarray(rng.standard_normal(shape), BF16) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((1, 384, kv_heads, 64)), BF16) for _ in range(2))
    _against_triton_and_jnp(assert_close, q, k, v, do, cfg, dq_keys=dq_keys)


def _against_triton_and_jnp(assert_close, q, k, v, do, cfg, n=None, dq_keys=None):
    """The interpreted kernels' dQ, dK, dV (rows and keys below ``n``) against the Triton kernels
    interpreted and the jnp executor's backward, given the jnp forward's L and δ: within one ulp of
    the largest element (the same numerics, FP32 sums in other orders). Returns the kernels'."""
    o, lse = jitted(jnp_impl.forward, q, k, v, cfg=cfg)
    o = jnp.asarray(o).astype(BF16)
    dlt = jitted(jnp_impl.delta, q, k, v, o, do, lse, cfg=cfg)
    ours = _interpreted(q, k, v, do, lse, dlt, cfg, dq_keys=dq_keys)
    chex.assert_shape(ours, [q.shape, k.shape, v.shape])
    triton = jitted(pb.backward, q, k, v, do, lse, dlt, cfg=cfg, launch=jf.Launch(), out_dtype=BF16)
    jnp_g = jitted(jnp_impl.backward, q, k, v, do, lse, dlt, cfg=cfg, out_dtype=BF16)
    cut = lambda x: x[:, :n]
    for i, name in enumerate(("dQ", "dK", "dV")):
        for other, who in ((triton[i], "Triton"), (jnp_g[i], "jnp")):
            assert_close(cut(ours[i]), cut(other), ulp_of_max(cut(other)), f"{name} vs {who}")
    return ours


@needs_interpreter
@pytest.mark.parametrize("causal,dq_keys", [(True, None), (False, None), (True, 128)])
def test_interpreted_padded_length_kernels(rng, assert_close, causal, dq_keys):
    """A length inside a tile (300, padded to 384): keys at or past the length see only masked
    blocks, the dQ kernel streams no key tile past it, whatever q, k, v hold there (large random
    values here; dO is zero there, as the call pads it). dQ, dK, dV of the 300 rows and keys against
    the Triton kernels interpreted and the jnp executor's backward under the same Numerics and the
    same L and δ; the padding's dK, dV exactly zero."""
    n, t = 300, 384
    cfg = make_cfg(n, 64, causal=causal)
    q, k, v = (jnp.asarray(rng.standard_normal((1, t, 2, 64)), BF16).at[:, n:].multiply(8.0)
               for _ in range(3))
    do = jnp.asarray(rng.standard_normal((1, t, 2, 64)), BF16).at[:, n:].set(0)
    _, dk, dv = _against_triton_and_jnp(assert_close, q, k, v, do, cfg, n, dq_keys)
    assert np.all(f64(dk[:, n:]) == 0) and np.all(f64(dv[:, n:]) == 0)


@pytest.mark.skipif(jax.__version_info__ < (0, 11), reason="Mosaic GPU lowers for CUDA on a CPU from jax 0.11")
@pytest.mark.parametrize("kv_heads,window,causal,length", [
    (4, None, True, 2048), (2, None, True, 2048), (4, (1023, 0), True, 2048),
    (1, (256, 256), False, 2048), (4, None, False, 2000)],
    ids=["plain", "gqa", "sliding-window", "mqa-window-both", "padded-length"])
def test_kernels_lower_for_cuda(kv_heads, window, causal, length):
    """The forward, dK/dV and dQ kernels lower to Mosaic GPU's per-thread module for CUDA (what the
    GPU compiles; ``jax.export`` does it on a CPU) at a training shape: the interpreter does not run
    that lowering, which refuses ops Mosaic GPU lacks."""
    from jax_flash.pallas import forward_mosaic as fm

    t = 2048
    cfg = dataclasses.replace(make_cfg(length, 128, causal=causal), window=window,
                              groups=4 // kv_heads)
    q = jax.ShapeDtypeStruct((1, t, 4, 128), BF16)
    k = jax.ShapeDtypeStruct((1, t, kv_heads, 128), BF16)
    rows = jax.ShapeDtypeStruct((1, 4, t), jnp.float32)
    fwd_cfg = dataclasses.replace(cfg, block_k=128)  # the forward's key tile at head_dim 128
    for f, args in (
            (lambda q, k, v: fm.forward_mosaic(q, k, v, fwd_cfg, o_dtype=BF16), (q, k, k)),
            (lambda *a: bm.dkdv_mosaic(*a, cfg, out_dtype=BF16), (q, k, k, q, rows, rows)),
            (lambda *a: bm.dq_mosaic(*a, cfg, out_dtype=BF16), (q, k, k, q, rows, rows)),
            (lambda *a: bm.dq_mosaic(*a, cfg, out_dtype=BF16, keys=128),
             (q, k, k, q, rows, rows))):
        exported = jax.export.export(jax.jit(f), platforms=["cuda"])(*args)
        assert "cuda" in exported.platforms

