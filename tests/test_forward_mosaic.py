"""The Mosaic GPU forward (jax_flash/pallas/forward_mosaic.py) on the CPU.

Its tile arithmetic against tile.py's, op for op (any JAX); the selection switch; and, where JAX has
a Mosaic GPU interpreter (jax ≥ 0.11: ``plgpu.InterpretGPUParams``), the whole kernel — TMA ring,
barriers, warpgroup ping-pong, causal skipping — interpreted against the jnp executor and float64.
The interpreter lacks two things the compiled kernel uses (a register operand of wgmma, the
accumulator initialised from registers): there P̄ goes through shared memory and acc·α + P̄·V is
added after the MMA — the same values. The compiled kernel runs in tests/test_gpu.py (-k mosaic).
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash as jf
from jax_flash import jnp_impl, tile
from jax_flash.pallas import forward_mosaic as fm
from jax_flash.pallas import mosaic_common
from jax_flash.pallas.mosaic_common import interpret_params
from jax_flash.policy import make_policy

BF16 = jnp.bfloat16


def make_cfg(t, d, *, causal=True, stable=False, block_k=64, beta=2.0):
    return tile.Config(policy=make_policy("fa2", BF16), causal=causal, stable=stable, beta=beta,
                       sm_scale=d ** -0.5, delta="o", block_q=64, block_k=block_k, q_len=t,
                       kv_len=t)


def tied_qkv(rng, shape, score=8.0, pairs=((3, 5),)):
    """Random inputs whose queries all point along one direction, and pairs of identical keys along
    it: rows that see a pair have a tied maximum of about ``score``."""
    q, k, v = (np.asarray(rng.standard_normal(shape), np.float32) for _ in range(3))
    d = shape[-1]
    direction = rng.standard_normal(d).astype(np.float32)
    direction /= np.linalg.norm(direction)
    q = q * 0.3 + direction * 4.0
    key = direction * score * np.sqrt(d) / 4.0
    for a, b in pairs:
        k[:, a] = key
        k[:, b] = key
    return tuple(jnp.asarray(x, BF16) for x in (q, k, v))


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


# ------------------------------------------------------------------------------------ selection
def test_selection_is_off_by_default_and_cpu_safe(monkeypatch):
    cfg = make_cfg(1024, 64)
    shape = (2, 1024, 4, 64)
    monkeypatch.delenv(fm.ENV_VAR, raising=False)
    assert not fm.use_mosaic_forward(cfg, shape, BF16)
    assert fm.check(cfg, shape, BF16, BF16) is None
    assert "policy" in fm.check(tile.Config(**{**cfg.__dict__, "policy": make_policy("paper", BF16)}),
                                shape, BF16)
    assert "head_dim" in fm.check(cfg, (2, 1024, 4, 32), BF16)
    assert "q_len" in fm.check(make_cfg(1000, 64), shape, BF16)
    assert "multiple" in fm.check(make_cfg(1088, 64), (2, 1088, 4, 64), BF16)
    with pytest.raises(ValueError, match="does not cover"):
        fm.forward_mosaic(*(jnp.zeros((1, 1088, 1, 64), BF16),) * 3, make_cfg(1088, 64),
                          o_dtype=BF16)
    if jax.default_backend() != "gpu":
        monkeypatch.setenv(fm.ENV_VAR, "mosaic")  # no GPU: the Triton/interpret kernel runs
        mosaic_common._WARNED.clear()
        with pytest.warns(UserWarning, match="no GPU"):
            chosen = fm.use_mosaic_forward(cfg, shape, BF16)
        assert not chosen
        with fm.force(True), pytest.raises(ValueError, match="forced"):
            fm.use_mosaic_forward(cfg, shape, BF16)
        with fm.force(False):
            assert not fm.use_mosaic_forward(cfg, shape, BF16)


def test_tuning_table_chooses_it_only_where_it_may(monkeypatch):
    """``"fwd_kernel": "mosaic"`` in a tuning entry reaches the Config; it is honoured only on a
    Hopper GPU under the JAX it is tested on, never for a call it does not cover (silently: the
    Triton kernel is the default), and JAX_FLASH_FWD=triton overrides it."""
    import dataclasses

    from jax_flash import api
    from jax_flash.pallas import tuning

    monkeypatch.delenv(fm.ENV_VAR, raising=False)
    x = jnp.zeros((1, 1024, 2, 64), BF16)
    monkeypatch.setattr(api.jax, "default_backend", lambda: "gpu")  # the table is read on GPUs only
    with tuning.override({"block_q": 64, "block_k": 64, "fwd_kernel": "mosaic"}):
        cfg, impl = api._make_config(x, x, x, causal=True, stable=False, beta=2.0, sm_scale=None,
                                     policy="fa2", delta="o", impl="pallas", block_q=None,
                                     block_k=None)
    assert impl == "pallas" and cfg.fwd_kernel == "mosaic"
    shape = (2, 1024, 4, 64)

    class Dev:
        compute_capability = "9.0"

    monkeypatch.setattr(fm.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(fm.jax, "devices", lambda: [Dev()])
    monkeypatch.setattr(fm.jax, "__version__", mosaic_common.TESTED_JAX + "2")
    assert fm.use_mosaic_forward(cfg, shape, BF16)
    assert not fm.use_mosaic_forward(dataclasses.replace(cfg, fwd_kernel="triton"), shape, BF16)
    assert not fm.use_mosaic_forward(cfg, (2, 1024, 4, 32), BF16)  # not covered: no warning
    monkeypatch.setenv(fm.ENV_VAR, "triton")
    assert not fm.use_mosaic_forward(cfg, shape, BF16)
    monkeypatch.delenv(fm.ENV_VAR)
    Dev.compute_capability = "8.0"
    assert "Hopper" in mosaic_common.table_may_choose() and not fm.use_mosaic_forward(cfg, shape, BF16)
    Dev.compute_capability = "9.0"
    monkeypatch.setattr(fm.jax, "__version__", "0.12.0")
    assert "tested" in mosaic_common.table_may_choose() and not fm.use_mosaic_forward(cfg, shape, BF16)


# ------------------------------------------------------------------------- interpreted kernel
needs_interpreter = pytest.mark.skipif(
    interpret_params() is None or jax.default_backend() == "gpu",
    reason="needs JAX's Mosaic GPU interpreter (jax >= 0.11: plgpu.InterpretGPUParams) on a CPU")


def assert_matches_jnp(o, lse, oj, lj, min_same=0.99):
    """An interpreted kernel's (O, L) against the jnp executor's under the same Config: O bitwise in
    ≥ ``min_same`` of its elements, the rest within 4 BF16 ulps of the row's largest output (an FP32
    last bit of a score or r_m moves a shifted row's m, β·r_m, and with it the rounding of every P̄ of
    the row; a wrong tile or mask moves O by O), L within FP32 rounding."""
    assert np.mean(o == oj) >= min_same
    row_max = np.max(np.maximum(np.abs(o), np.abs(oj)), axis=-1, keepdims=True)
    assert np.all(np.abs(o - oj) <= 2 ** -5 * row_max)
    np.testing.assert_allclose(lse, np.asarray(lj), rtol=1e-6, atol=1e-5)


def _interpreted(q, k, v, cfg):
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as interp

    interp.gpu_callbacks.reset_gpu_interpret_mode_state()
    o, lse = fm.forward_mosaic(q, k, v, cfg, o_dtype=q.dtype, interpret=interpret_params())
    o, lse = np.asarray(o, np.float32), np.asarray(lse)
    assert not interp.get_races().races_found
    return o, lse


@needs_interpreter
@pytest.mark.parametrize("shape,block_k", [((1, 256, 2, 64), 64), ((1, 384, 1, 128), 128),
                                           ((2, 256, 1, 128), 64)],
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("stable", [False, True])
def test_interpreted_kernel_matches_jnp_executor(rng, shape, block_k, causal, stable):
    """The kernel, interpreted: O and L as the jnp executor's up to the last bit of a few elements
    (the interpreter's wgmma sums in another order than XLA's dot), as accurate against float64."""
    q, k, v = tied_qkv(rng, shape, pairs=((3, 5), (130, 140)))
    cfg = make_cfg(shape[1], shape[-1], causal=causal, stable=stable, block_k=block_k)
    o, lse = _interpreted(q, k, v, cfg)
    oj, lj = jnp_impl.forward(q, k, v, cfg)
    oj = np.asarray(jnp.asarray(oj).astype(BF16), np.float32)
    ref = jf.reference_numpy(q, k, v, causal=causal)
    same = np.mean(o == oj)
    err, err_j = (float(np.linalg.norm(x - ref) / np.linalg.norm(ref)) for x in (o, oj))
    print(f"{shape} bk={block_k} causal={causal} stable={stable}: bitwise {100 * same:.3f} %, "
          f"max |Δ| {np.abs(o - oj).max():.2e}, rel err {err:.3e} (jnp {err_j:.3e})")
    assert_matches_jnp(o, lse, oj, lj)  # (seen: single rows, most outputs 1–2 ulps apart)
    assert err <= 1.05 * err_j + 1e-6


@needs_interpreter
@pytest.mark.parametrize("stable", [False, True])
def test_interpreted_scale_late_matches_jnp_executor(rng, stable):
    """``scale_late`` inside the kernel (the accumulator's unscaled scores: the row max scaled after
    the reduction, the tie threshold divided by the scale, scale·s − m for the exps): O and L as the
    jnp executor's with the same Config, as in test_interpreted_kernel_matches_jnp_executor, but
    fewer of them bitwise: XLA fuses scale·s − m into one FMA in one program and not always in the
    other (the compiled GPU kernels always do), so P̄'s last bits differ in a few rows."""
    import dataclasses

    shape = (1, 256, 2, 64)
    q, k, v = tied_qkv(rng, shape, score=20.0, pairs=((3, 5), (130, 140)))
    cfg = dataclasses.replace(make_cfg(256, 64, stable=stable), scale_late=True)
    o, lse = _interpreted(q, k, v, cfg)
    oj, lj = jnp_impl.forward(q, k, v, cfg)
    oj = np.asarray(jnp.asarray(oj).astype(BF16), np.float32)
    assert_matches_jnp(o, lse, oj, lj, min_same=0.9)
    ref = jf.reference_numpy(q, k, v, causal=True)
    err, err_j = (float(np.linalg.norm(x - ref) / np.linalg.norm(ref)) for x in (o, oj))
    assert err <= 1.05 * err_j + 1e-6
    if stable:  # the shift fired: tied rows differ from the unshifted forward
        o_b, _ = jnp_impl.forward(q, k, v, dataclasses.replace(cfg, stable=False))
        assert np.any(np.asarray(jnp.asarray(o_b).astype(BF16), np.float32) != oj)


@needs_interpreter
def test_interpreted_stable_shifts_tie_rows(rng):
    """stable=True on tied rows: the same shifted result as the jnp executor, and different from the
    unshifted kernel on those rows (the shift ran inside the kernel)."""
    shape = (1, 256, 1, 64)
    q, k, v = tied_qkv(rng, shape, score=20.0)
    o_s, _ = _interpreted(q, k, v, make_cfg(256, 64, stable=True))
    o_b, _ = _interpreted(q, k, v, make_cfg(256, 64, stable=False))
    oj, _ = jnp_impl.forward(q, k, v, make_cfg(256, 64, stable=True))
    oj = np.asarray(jnp.asarray(oj).astype(BF16), np.float32)
    # MMA summation order apart from the jnp executor (over 40 seeds: ≥ 98.4 % bitwise, ≤ 0.005 of
    # the row's largest |O|); without the shift ≈ 26 % of the tied rows' outputs would differ
    diff, row = np.abs(o_s - oj), np.abs(oj).max(-1, keepdims=True)
    assert np.mean(diff == 0) >= 0.97 and np.all(diff <= 2.0 ** -6 * row)
    assert np.any(o_s[:, 5:64] != o_b[:, 5:64])


@needs_interpreter
def test_interpreted_tie_count_int_same_values(rng):
    """``tie_count_int`` (the tie count summed in int32) inside the kernel: bitwise the same O and L
    as the FP32 count on tied rows, where the count decides the shift."""
    import dataclasses

    shape = (1, 256, 1, 64)
    q, k, v = tied_qkv(rng, shape, score=20.0, pairs=((3, 5), (130, 140)))
    cfg = make_cfg(256, 64, stable=True)
    o_f, l_f = _interpreted(q, k, v, cfg)
    o_i, l_i = _interpreted(q, k, v, dataclasses.replace(cfg, tie_count_int=True))
    np.testing.assert_array_equal(o_i, o_f)
    np.testing.assert_array_equal(l_i, l_f)


@needs_interpreter
def test_static_op_counts_see_the_tie_count():
    """experiments.mosaic_ops catches the kernel's per-thread module: the stable shift adds compares,
    selects and adds to it, and ``tie_count_int`` turns the count's selects into i1→i32 extensions
    and its FP32 adds into integer adds (the same number of ops: what ptxas makes of them is the GPU's
    to say)."""
    from experiments import mosaic_ops

    shape = (1, 256, 1, 64)
    base, stable, as_int = (mosaic_ops.op_counts(shape, **mosaic_ops.VARIANTS[n])
                            for n in ("base", "stable", "stable+int"))
    extra = mosaic_ops.difference(base, stable)
    assert extra["arith.cmpf"] > 0 and extra["arith.select"] > 0 and extra["arith.addf"] > 0
    assert as_int["arith.extui"] > stable["arith.extui"]
    assert as_int["arith.select"] < stable["arith.select"]
    assert as_int["arith.addi"] > stable["arith.addi"] and as_int["arith.addf"] < stable["arith.addf"]


def test_ab_mosaic_variant_selects_only_itself(monkeypatch):
    """bench.ab's ``mosaic`` variant selects the Mosaic forward while it is traced, and only then (an
    environment variable would leak into every variant traced later)."""
    import jax_flash
    from bench import ab

    monkeypatch.delenv(fm.ENV_VAR, raising=False)
    assert ab.parse_variant("mosaic@e:stable") == ("mosaic", "e", True)
    seen = []
    real = jax_flash.attention

    def spy(*args, **kwargs):
        seen.append(fm._FORCE.get())
        return real(*args, **kwargs)

    monkeypatch.setattr(jax_flash, "attention", spy)
    x = jnp.zeros((1, 256, 1, 64), BF16)
    for spec in ("mosaic", "new", "mosaic:stable"):
        jax.jit(ab._attention_fn(spec, {"new": jax_flash}, {}, True, "fa2")).lower(x, x, x)
    assert seen == [True, None, True] and fm._FORCE.get() is None
