"""The Mosaic GPU forward (jax_flash/pallas/forward_mosaic.py) on the CPU.

Its tile arithmetic against tile.py's, op for op (any JAX); the selection switch; and, where JAX has
a Mosaic GPU interpreter (jax ≥ 0.11: ``plgpu.InterpretGPUParams``), the whole kernel — TMA ring,
barriers, warpgroup ping-pong, causal skipping — interpreted against the jnp executor and float64.
The interpreter lacks two things the compiled kernel uses (a register operand of wgmma, the
accumulator initialised from registers): there P̄ goes through shared memory and acc·α + P̄·V is
added after the MMA — the same values. The compiled kernel runs in tests/test_gpu.py (-k mosaic).
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
from helpers import BF16, f64, jitted, lse_bound, o_bound, tied_inputs, ulp_of_max
from jax_flash import jnp_impl, spec, tile
from jax_flash.pallas import forward_mosaic as fm
from jax_flash.pallas import mosaic_common
from jax_flash.pallas.mosaic_common import interpret_params
from jax_flash.policy import make_policy


def make_cfg(t, d, *, causal=True, stable=False, block_k=64, beta=2.0, scale_late=False):
    return spec.Numerics(policy=make_policy("fa2", BF16), causal=causal, stable=stable, beta=beta,
                         sm_scale=d ** -0.5, delta="o", block_q=64, block_k=block_k, q_len=t,
                         kv_len=t, scale_late=scale_late)


# ------------------------------------------------------------------------------ tile arithmetic
def _score_tile(rng, bq=16, bk=32):
    """Scores with every stable_shift branch: tied maxima > 0 (β·r_m), folded (β·r_m far past the
    guard), < 0 (shift 0), = 0, untied rows and empty (−inf) rows."""
    s = rng.standard_normal((bq, bk)).astype(np.float32) * 3
    r = np.arange(bq)
    tops = np.array([5.0, 60.0, 1e4, 3e8, -2.0, 0.0, 7.5, 1e-3] * (bq // 8), np.float32)
    s[r, 0] = tops
    s[r, 1] = np.where(r % 3 == 2, tops - 1.0, tops)  # every third row untied
    s = np.minimum(s, tops[:, None])
    s[r % 8 == 7] = -np.inf
    return jnp.asarray(s)


@pytest.mark.parametrize("beta", [2.0, 7.0])
def test_stable_shift_folds_with_a_truncation_that_is_floor(rng, beta):
    """The Mosaic forward gives tile.stable_shift floor as ``tile.floor_positive`` (a truncation:
    Mosaic GPU has no floor) — floor itself wherever the fold uses it (y > 0, up to FP32's largest
    values)."""
    y = np.concatenate([rng.uniform(0, 4, 1000), rng.uniform(0, 1, 100) * 2.0 ** rng.integers(0, 127, 100),
                        [1e-30, 0.5, 1.0, 2.0 ** 23 - 0.5, 2.0 ** 23, 2.0 ** 31, 3e38]]).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(tile.floor_positive(jnp.asarray(y))), np.floor(y))
    cfg = make_cfg(256, 64, stable=True, beta=beta)
    s = _score_tile(rng)
    r_m = jnp.max(s, axis=1)
    shift = np.asarray(tile.stable_shift(s, None, r_m, cfg, floor=tile.floor_positive))
    over = np.asarray(jnp.where(r_m > 0, beta * r_m, 0.0) - r_m - cfg.max_shift)
    assert np.any(over > 0) and np.any(shift != np.asarray(r_m))  # the fold and the shift ran
    moved = (np.asarray(tile.tie_count(s, None, r_m, cfg)) > 1) & (over > 0) & np.isfinite(over)
    over_m = over[moved]
    folded = np.asarray(r_m)[moved] + cfg.max_shift / 2 + np.mod(over_m, cfg.max_shift / 2)
    assert moved.sum() >= 2
    np.testing.assert_allclose(shift[moved], folded, rtol=1e-6)


@pytest.mark.parametrize("stable", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_kernel_step_is_forward_tile(rng, stable, masked):
    """The kernel's step — tile.softmax_update, then the wgmma's acc·α + P̄·V with no rounding in
    between — == tile.forward_tile_from_scores for "fa2", bitwise, over three tiles (it would not be
    for a policy whose ``tile.accumulate`` rounds)."""
    bq, bk, d = 16, 32, 16
    cfg = make_cfg(256, d, stable=stable)
    ours = theirs = tile.init_carry(bq, d, cfg)
    for j in range(3):
        s = _score_tile(rng, bq, bk) if j != 1 else jnp.asarray(rng.standard_normal((bq, bk)),
                                                                jnp.float32)
        v = jnp.asarray(rng.standard_normal((bk, d)), BF16)
        mask = tile.tile_mask(0, j * bk, bq, bk, cfg) if masked else None
        m, l, alpha, p_bar, _ = tile.softmax_update(ours, s, mask, cfg)
        ours = tile.Carry(m, l, ours.acc * alpha[:, None] + tile.dot_nn(p_bar, v, cfg.policy), None)
        theirs = tile.forward_tile_from_scores(theirs, s, v, mask, cfg)
        for a, b in zip(ours[:3], theirs[:3]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.all(np.isfinite(np.asarray(ours.acc)))


# ------------------------------------------------------------------------------------- coverage
def test_check_says_what_it_does_not_cover():
    cfg = make_cfg(1024, 64)
    shape = (2, 1024, 4, 64)
    assert fm.check(cfg, shape, BF16, BF16) is None
    assert fm.check(make_cfg(1024, 128, block_k=128), (1, 1024, 1, 128), BF16) is None
    paper = spec.Numerics(**{**cfg.__dict__, "policy": make_policy("paper", BF16)})
    assert "policy" in fm.check(paper, shape, BF16)
    assert "head_dim" in fm.check(cfg, (2, 1024, 4, 32), BF16)
    assert "block_k" in fm.check(make_cfg(1024, 64, block_k=32), shape, BF16)
    assert "dtype" in fm.check(cfg, shape, jnp.float32)
    assert fm.check(make_cfg(1000, 64), shape, BF16) is None  # a length padded up to 1024
    assert "q_len" in fm.check(dataclasses.replace(cfg, q_len=512), shape, BF16)  # cross-attention
    assert "q_len" in fm.check(make_cfg(1100, 64), shape, BF16)
    assert "multiple" in fm.check(make_cfg(1088, 64), (2, 1088, 4, 64), BF16)
    with pytest.raises(ValueError, match="does not cover"):
        fm.forward_mosaic(*(jnp.zeros((1, 1088, 1, 64), BF16),) * 3, make_cfg(1088, 64),
                          o_dtype=BF16)


def test_unavailable_off_hopper(monkeypatch):
    """The Mosaic kernels need a Hopper GPU under the JAX they are written against."""
    if jax.default_backend() != "gpu":
        assert "no GPU" in mosaic_common.unavailable()

    class Dev:
        compute_capability = "9.0"

    monkeypatch.setattr(mosaic_common.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(mosaic_common.jax, "devices", lambda: [Dev()])
    monkeypatch.setattr(mosaic_common.jax, "__version__", mosaic_common.TESTED_JAX + "2")
    assert mosaic_common.unavailable() is None
    Dev.compute_capability = "8.0"
    assert "Hopper" in mosaic_common.unavailable()
    Dev.compute_capability = "9.0"
    monkeypatch.setattr(mosaic_common.jax, "__version__", "0.12.0")
    assert "tested" in mosaic_common.unavailable()


def test_plan_keeps_the_table_choice_only_where_it_covers(monkeypatch):
    """A tuning entry's ``fwd_kernel="mosaic"`` stays in the plan where the kernel can run the call
    (availability faked), and becomes "triton" silently where it cannot (head_dim 32); asked for
    explicitly there, it raises."""
    from jax_flash.pallas import tuning

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(mosaic_common, "unavailable", lambda: None)
    monkeypatch.setattr(tuning, "lookup_entry", lambda *a: (None, jf.Launch(fwd_kernel="mosaic")))
    x = jax.ShapeDtypeStruct((1, 1024, 2, 64), BF16)
    assert jf.plan(x, x, x).launch.fwd_kernel == "mosaic"
    y = jax.ShapeDtypeStruct((1, 1024, 2, 32), BF16)
    assert jf.plan(y, y, y).launch.fwd_kernel == "triton"
    with pytest.raises(ValueError, match="head_dim 32"):
        jf.plan(y, y, y, launch={"fwd_kernel": "mosaic"})


def test_forward_entry_runs_it_when_the_launch_says_so(monkeypatch):
    """``pallas.forward`` hands the call to ``forward_mosaic`` for ``Launch(fwd_kernel="mosaic")``
    (same arguments, the residual dtype), and never otherwise."""
    pf = importlib.import_module("jax_flash.pallas.forward")
    cfg = make_cfg(128, 64)
    x = jnp.ones((1, 128, 1, 64), BF16)
    seen = []

    def fake(q, k, v, cfg, *, o_dtype, interpret=None, stages=None, programs=None):
        seen.append((q, k, v, cfg, o_dtype, stages, programs))
        return jnp.full(q.shape, 3.0, o_dtype), jnp.zeros((1, 1, 128), jnp.float32)

    monkeypatch.setattr(fm, "forward_mosaic", fake)
    monkeypatch.setattr(mosaic_common, "sm_count", lambda: 7)
    pf.forward(x, x, x, cfg, jf.Launch(), o_dtype=BF16)
    assert not seen
    o, _ = pf.forward(x, x, x, cfg, jf.Launch(fwd_kernel="mosaic", mosaic_fwd_stages=3), o_dtype=BF16)
    assert len(seen) == 1 and all(a is x for a in seen[0][:3])
    assert seen[0][3:] == (cfg, BF16, 3, None)
    assert np.all(f64(o) == 3)
    pf.forward(x, x, x, cfg, jf.Launch(fwd_kernel="mosaic", mosaic_fwd_persistent=True),
               o_dtype=BF16)
    assert seen[1][5:] == (None, 7)  # a persistent program per SM


@pytest.mark.parametrize("n_items, programs", [(12, 5), (12, 4), (7, 7), (3, 5), (4096, 132)])
def test_persistent_loop_takes_every_item_once_a_wave_at_a_time(n_items, programs):
    """``mosaic_common.persistent_loop``: over the programs, every item exactly once; the items of
    wave w are w·P … w·P + P − 1 (what runs side by side is the grid's neighbours); program p
    takes position p on even waves and P − 1 − p on odd ones."""

    def program(_):
        def body(item, c):
            seen, wave, pos, w = c
            return (seen.at[item].add(1), wave.at[item].set(w), pos.at[item].set(
                jax.lax.axis_index("prog")), w + 1)

        init = (jnp.zeros(n_items, jnp.int32), jnp.full(n_items, -1), jnp.full(n_items, -1),
                jnp.int32(0))
        return mosaic_common.persistent_loop(n_items, programs, body, init)[:3]

    seen, wave, prog = jax.vmap(program, axis_name="prog")(jnp.arange(programs))
    np.testing.assert_array_equal(np.asarray(seen).sum(0), np.ones(n_items))
    item = np.arange(n_items)
    wave, prog = np.asarray(wave).max(0), np.asarray(prog).max(0)
    np.testing.assert_array_equal(wave, item // programs)
    pos = item % programs
    np.testing.assert_array_equal(prog, np.where(wave % 2 == 0, pos, programs - 1 - pos))


def test_persistent_programs_are_at_most_the_items():
    assert mosaic_common.persistent_programs(None, (2, 3, 4)) is None
    assert mosaic_common.persistent_programs(132, (2, 3, 4)) == 24
    assert mosaic_common.persistent_programs(5, (2, 3, 4)) == 5
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="programs must be a positive int"):
            mosaic_common.persistent_programs(bad, (2, 3, 4))


# ------------------------------------------------------------------------- interpreted kernel
needs_interpreter = pytest.mark.skipif(
    interpret_params() is None or jax.default_backend() == "gpu",
    reason="needs JAX's Mosaic GPU interpreter (jax >= 0.11: plgpu.InterpretGPUParams) on a CPU")


def _interpreted(q, k, v, cfg, stages=None, programs=None):
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as interp

    interp.gpu_callbacks.reset_gpu_interpret_mode_state()
    # compiled once per test (the race detector runs inside it too)
    o, lse = jitted(fm.forward_mosaic, q, k, v, cfg=cfg, o_dtype=q.dtype, interpret=interpret_params(),
                    stages=stages, programs=programs)
    jax.block_until_ready((o, lse))  # the interpreter's state is global: finish before reading it
    assert not interp.get_races().races_found
    return o, lse


def check_interpreted(assert_close, q, k, v, cfg):
    """The interpreted Mosaic kernel's O and L against the Triton kernel interpreted (Pallas
    interpret mode) and the jnp executor under the same Numerics — each within twice the policy's
    bound of the other, as each is within the bound of the exact result — and O against float64."""
    pf = importlib.import_module("jax_flash.pallas.forward")
    o, lse = _interpreted(q, k, v, cfg)
    chex.assert_shape(o, q.shape)
    chex.assert_type([o, lse], [BF16, jnp.float32])
    o_t, l_t = jitted(pf.forward, q, k, v, cfg=cfg, launch=jf.Launch(), o_dtype=BF16)
    o_j, l_j = jitted(jnp_impl.forward, q, k, v, cfg=cfg)
    bound, terms = o_bound(q, k, v, cfg)
    lb = lse_bound(terms, f64(l_j))
    for name, o_other, l_other in (("Triton", o_t, l_t), ("jnp", o_j, l_j)):
        assert_close(o, o_other, 2 * bound, f"O vs {name}")
        assert_close(lse, l_other, 2 * lb, f"L vs {name}")
    assert_close(o, jf.reference_numpy(q, k, v, causal=cfg.causal), bound, "O vs float64")
    print(f"bitwise vs Triton: {np.mean(f64(o) == f64(o_t)):.4f}")
    return f64(o)


@needs_interpreter
@pytest.mark.parametrize("shape,block_k", [((1, 256, 2, 64), 64), ((1, 384, 1, 128), 128),
                                           ((2, 256, 1, 128), 64)],
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("stable", [False, True])
def test_interpreted_kernel_matches_triton_and_jnp(rng, assert_close, shape, block_k, causal, stable):
    """The whole kernel (TMA ring, barriers, ping-pong, causal skipping) interpreted with race
    detection."""
    q, k, v = tied_inputs(rng, shape, pairs=((3, 5), (130, 140)))
    check_interpreted(assert_close, q, k, v, make_cfg(shape[1], shape[-1], causal=causal,
                                                     stable=stable, block_k=block_k))


@needs_interpreter
@pytest.mark.parametrize("stable", [False, True])
def test_interpreted_scale_late(rng, assert_close, stable):
    """``Numerics.scale_late`` inside the kernel (the accumulator's unscaled scores: the row max
    scaled after the reduction, the tie threshold divided by the scale, scale·s − m in the exps)."""
    shape = (1, 256, 2, 64)
    q, k, v = tied_inputs(rng, shape, score=20.0, pairs=((3, 5), (130, 140)))
    check_interpreted(assert_close, q, k, v, make_cfg(256, 64, stable=stable, scale_late=True))


@needs_interpreter
def test_interpreted_stable_shifts_tie_rows(rng, assert_close):
    """stable=True on tied rows: the kernel's O differs from its unshifted O on those rows (the
    shift ran inside the kernel) and matches the other executors'."""
    shape = (1, 256, 1, 64)
    q, k, v = tied_inputs(rng, shape, score=20.0)
    o_s = check_interpreted(assert_close, q, k, v, make_cfg(256, 64, stable=True))
    o_b = f64(_interpreted(q, k, v, make_cfg(256, 64, stable=False))[0])
    assert np.any(o_s[:, 5:64] != o_b[:, 5:64])


@needs_interpreter
@pytest.mark.parametrize("kv_heads", [2, pytest.param(1, marks=pytest.mark.slow)], ids=["gqa", "mqa"])
def test_interpreted_gqa_reads_the_groups_kv_head(rng, kv_heads):
    """GQA/MQA: four query heads on ``kv_heads`` key/value heads, never repeated in memory: O and L
    bitwise the kernel's own on K and V repeated to four heads (a query head computes the same
    arithmetic on the same values wherever its K and V come from). Stable, on tied rows."""
    shape, g = (1, 256, 4, 64), 4 // kv_heads
    q, k, v = tied_inputs(rng, shape, score=20.0, pairs=((3, 5), (130, 140)))
    k, v = k[:, :, ::g], v[:, :, ::g]
    cfg = make_cfg(256, 64, stable=True)
    ours = _interpreted(q, k, v, dataclasses.replace(cfg, groups=g))
    chex.assert_shape(ours, [q.shape, (1, 4, 256)])
    repeated = _interpreted(q, jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2), cfg)
    chex.assert_trees_all_equal(ours, repeated)


@needs_interpreter
@pytest.mark.parametrize("window,causal", [
    ((127, 0), True), pytest.param((100, 30), True, marks=pytest.mark.slow), ((64, 64), False)],
    ids=["sliding-127", "left-100-right-30", "both-64"])
def test_interpreted_window(rng, assert_close, window, causal):
    """Windows: a program streams only the key tiles its rows see (``tile.kv_tile_bounds``), a
    warpgroup skips those only the other one sees, the edge tiles are masked. O and L against the
    Triton kernel interpreted and the jnp executor under the same Numerics (``stable``, tied rows
    inside the windows), and O against the kernel's own unwindowed output where the window hides
    nothing (the first rows of a causal sliding window)."""
    shape = (1, 384, 1, 64)
    q, k, v = tied_inputs(rng, shape, score=20.0, pairs=((3, 5), (250, 255)))
    cfg = dataclasses.replace(make_cfg(384, 64, causal=causal, stable=True), window=window)
    pf = importlib.import_module("jax_flash.pallas.forward")
    o, lse = _interpreted(q, k, v, cfg)
    o_t, l_t = jitted(pf.forward, q, k, v, cfg=cfg, launch=jf.Launch(), o_dtype=BF16)
    o_j, l_j = jitted(jnp_impl.forward, q, k, v, cfg=cfg)
    o_j = o_j.astype(BF16)  # the executor's FP32 O, stored in the inputs' dtype as the kernels store it
    for name, o_other, l_other in (("Triton", o_t, l_t), ("jnp", o_j, l_j)):
        assert_close(o, o_other, ulp_of_max(o_other), f"O vs {name}")
        # L = m + log₂ℓ: the same m, ℓ summed in another FP32 order: a few FP32 ulps of |L| + 1
        chex.assert_trees_all_close(lse, l_other, rtol=8 * 2.0 ** -24, atol=8 * 2.0 ** -24)
    if causal and window[1] == 0:
        plain = _interpreted(q, k, v, dataclasses.replace(cfg, window=None))[0]
        rows = window[0] + 1  # rows 0 … left see every key the causal mask leaves them
        chex.assert_trees_all_equal(o[:, :rows], plain[:, :rows])
        assert np.any(f64(o[:, rows:]) != f64(plain[:, rows:]))


@needs_interpreter
@pytest.mark.parametrize("causal", [True, False])
def test_interpreted_padded_length(rng, assert_close, causal):
    """A length inside a tile (300 keys and queries, padded to 384): the program streams no tile
    past the length and masks the tile holding it, whatever the padding holds (large random values
    here, whose scores would dominate a row that saw them). O and L of the 300 rows against the
    Triton kernel interpreted and the jnp executor under the same Numerics, O against float64 on the
    unpadded inputs; L finite on the padding rows too (the backward reads it)."""
    n, shape = 300, (1, 384, 2, 64)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), BF16) for _ in range(3))
    junk = lambda x: x.at[:, n:].multiply(8.0)
    q, k, v = junk(q), junk(k), junk(v)
    cfg = make_cfg(n, 64, causal=causal)
    pf = importlib.import_module("jax_flash.pallas.forward")
    o, lse = _interpreted(q, k, v, cfg)
    assert np.all(np.isfinite(f64(lse)))
    o_t, l_t = jitted(pf.forward, q, k, v, cfg=cfg, launch=jf.Launch(), o_dtype=BF16)
    o_j, l_j = jitted(jnp_impl.forward, q, k, v, cfg=cfg)
    o_j = o_j.astype(BF16)
    for name, o_other, l_other in (("Triton", o_t, l_t), ("jnp", o_j, l_j)):
        assert_close(o[:, :n], o_other[:, :n], ulp_of_max(o_other[:, :n]), f"O vs {name}")
        # the same m, ℓ summed in another FP32 order: a few FP32 ulps of |L| + 1
        chex.assert_trees_all_close(lse[..., :n], l_other[..., :n], rtol=8 * 2.0 ** -24,
                                    atol=8 * 2.0 ** -24)
    q, k, v = q[:, :n], k[:, :n], v[:, :n]
    bound, _ = o_bound(q, k, v, cfg)
    assert_close(o[:, :n], jf.reference_numpy(q, k, v, causal=causal), bound, "O vs float64")


@needs_interpreter
def test_interpreted_ring_depth_changes_no_bit(rng):
    """``Launch.mosaic_fwd_stages`` only decides how far the K/V loads run ahead: O and L with a
    ring of 2 equal the default ring's (4 at 64-key tiles) bit for bit, races checked."""
    shape = (1, 384, 1, 64)
    q, k, v = tied_inputs(rng, shape, pairs=((3, 5), (130, 140)))
    cfg = make_cfg(shape[1], shape[-1], causal=True, stable=True, block_k=64)
    base = _interpreted(q, k, v, cfg)
    chex.assert_trees_all_equal(_interpreted(q, k, v, cfg, stages=2), base)


@needs_interpreter
@pytest.mark.parametrize("causal,window", [
    (True, None), pytest.param(False, (300, 40), marks=pytest.mark.slow)], ids=["causal", "window"])
def test_interpreted_half_last_tile_changes_no_bit(rng, monkeypatch, causal, window):
    """A warpgroup's last 128-key tile run on its first 64 keys where its rows see none of the rest
    (``mosaic_common.HALF_LAST``: warpgroup 0's causal diagonal, a window's right edge) gives O and
    L equal to the whole tile's bit for bit, stable shift on tied rows, races checked: the unseen
    half's exps are zeros, left off the end of every sum. Halving a tile whose second half some
    row sees fails it."""
    shape = (1, 384, 1, 128)
    q, k, v = tied_inputs(rng, shape, pairs=((3, 5), (130, 140)))
    cfg = make_cfg(shape[1], shape[-1], causal=causal, stable=True, block_k=128)
    cfg = dataclasses.replace(cfg, window=window)
    out = {}
    for half in (True, False):
        monkeypatch.setattr(mosaic_common, "HALF_LAST", half)
        monkeypatch.setattr(helpers, "_COMPILED", {})  # traced again under each setting
        out[half] = _interpreted(q, k, v, cfg)
    chex.assert_trees_all_equal(out[True], out[False])


@needs_interpreter
@pytest.mark.parametrize("causal, window, kv_heads", [
    (True, None, 2), pytest.param(False, (100, 0), 1, marks=pytest.mark.slow)],
    ids=["causal", "window-gqa"])
def test_interpreted_persistent_programs_change_no_bit(rng, causal, window, kv_heads):
    """``Launch.mosaic_fwd_persistent``: programs that take the (batch, head, query block) items in
    turn, one K/V ring running on across them and two Q/O buffers a warpgroup (the producer loads
    the next item's Q), give O and L equal to a program per item's bit for bit, races checked: 1
    program (every item in one ring), 5 (items left over on the last wave, odd waves taken in
    reverse). An item that miscounts the ring's position hangs the interpreter; a Q load that does
    not wait for its buffer, or a program that leaves the last buffers' releases unobserved, fails
    it."""
    shape = (2, 384, 2, 64)
    q, k, v = tied_inputs(rng, shape, pairs=((3, 5), (130, 140)))
    k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
    cfg = make_cfg(shape[1], shape[-1], causal=causal, stable=True, block_k=64)
    cfg = dataclasses.replace(cfg, window=window, groups=shape[2] // kv_heads)
    base = _interpreted(q, k, v, cfg)
    for programs in (1, 5):
        chex.assert_trees_all_equal(_interpreted(q, k, v, cfg, programs=programs), base)


def test_ring_that_cannot_fit_or_run_raises():
    """A ring deeper than shared memory holds, or the forward's below 2, raises before any
    lowering, naming the largest that fits: at head_dim 128 with 128-key tiles a ring of 3 fits
    (231,544 bytes as counted; with a 1 KiB buffer for L, since stored from registers, it compiled
    to 232,568, over the 232,448 a block may take: jax 0.11.2, H200), a ring of 4 does not."""
    x = jnp.zeros((1, 1024, 1, 128), BF16)
    cfg = make_cfg(1024, 128, block_k=128)
    assert mosaic_common.smem_bytes(fm.forward_scratch(128, 128, BF16, 3)) == 232_568 - 1024
    with pytest.raises(ValueError, match=r"4 stages need 297,112 bytes .* \(227 KiB\); at most 3 fit"):
        fm.forward_mosaic(x, x, x, cfg, o_dtype=BF16, stages=4)
    with pytest.raises(ValueError, match="needs ≥ 2 stages"):
        fm.forward_mosaic(x, x, x, cfg, o_dtype=BF16, stages=1)


def test_persistent_ring_that_fits():
    """Persistent, each warpgroup has a second Q/O buffer: at head_dim 128 with 128-key tiles a ring
    of 2 takes 198,792 bytes as counted (the figure docs/KERNELS.md gives), a ring of 3 does not
    fit."""
    x = jnp.zeros((1, 1024, 1, 128), BF16)
    cfg = make_cfg(1024, 128, block_k=128)
    assert mosaic_common.smem_bytes(fm.forward_scratch(128, 128, BF16, 2, persistent=True)) \
        == 198_792
    with pytest.raises(ValueError, match=r"3 stages need 264,360 bytes .*; at most 2 fit"):
        fm.forward_mosaic(x, x, x, cfg, o_dtype=BF16, stages=3, programs=7)
