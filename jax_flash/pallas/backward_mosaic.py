"""Executor 2, backward, on Hopper: Mosaic GPU (Pallas ``plgpu``) dK/dV and dQ kernels for "fa2".

The same contract as ``backward.py``'s Triton dK/dV kernel — dK (times sm_scale) and dV of each key,
summed over the query blocks in increasing order, P recomputed from the saved L, δ = rowsum(dO∘O)
given — with Hopper's data movement and dots. Each program owns 128 keys: two compute warpgroups of
64 keys each (wgmma's M) hold K, V and the FP32 dK, dV accumulators; a producer warpgroup streams the
query blocks' Q, dO (64 rows) and their L, δ rows by TMA into a ring of shared-memory stages with
ready / free barriers. Per query block, four MMAs: Sᵀ = K·Qᵀ, dV += bf16(Pᵀ)·dO, dPᵀ = V·dOᵀ,
dK += bf16(dSᵀ)·Q, with Pᵀ and dSᵀ ``tile.py``'s arithmetic (``p_tile``, ``ds_tile``, checked against
``tile.backward_tile_dkdv`` in tests/test_backward_mosaic.py). Causal: query blocks above a
warpgroup's keys are skipped, the diagonal block is masked with ``tile.tile_mask(transposed=True)``,
the rest run without a mask; under a window only the query blocks that see the keys are streamed
(``tile.q_block_bounds``), the edge blocks masked. Under GQA a program owns keys of one key/value
head and streams the query blocks of its group's query heads one head after the other.

The dQ kernel (``dq_mosaic``, same contract as the Triton dQ kernel) has the forward's structure:
128 query rows per program in two compute warpgroups, K and V tiles streamed by a producer
warpgroup; per key tile S = Q·Kᵀ, dP = dO·Vᵀ, dQ += bf16(dS)·K; on 128-key tiles a warpgroup's last
tile may run on its first 64 keys, as the forward's (``mosaic_common.half_last``). Chosen by
``Launch.bwd_kernel``: "mosaic" (both kernels) or "mosaic_dkdv" (dQ stays Triton's);
``jax_flash.plan`` runs the Triton kernels instead where ``check`` says these do not cover the call,
or raises if the caller asked for them.

Imports of ``jax.experimental.pallas.mosaic_gpu`` stay inside functions: this module must import on
any JAX the package supports (0.10.2 on CPU), written against the API of jax 0.11.2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .. import tile
from ..rounding import cast_rounded, native_casts
from ..spec import Numerics, check_mosaic_regs
from . import mosaic_common
from .mosaic_common import Stream, stream_ring, unsupported_masks
from .mosaic_common import exp2_backend as _exp2

KEYS_PER_WG = 64  # wgmma's M: the keys of one compute warpgroup
COMPUTE_WGS = 2
KEYS = KEYS_PER_WG * COMPUTE_WGS  # keys per program
Q_TILE = 64  # query rows per streamed block (the reduction dimension of dK, dV: numerics-neutral)
DQ_KEY_TILE = 64  # keys per streamed tile of the dQ kernel (its reduction dimension)
# the dQ kernel's key tiles (``Launch.mosaic_dq_keys``): dQ sums the tiles' dS·K in the same key
# order either way, as one accumulator's successive products; with 128-key tiles its K/V ring
# takes ``DQ128_STAGES`` (two at head_dim 128 is what fits beside Q and dO)
DQ_KEY_TILES = (64, 128)
DQ128_STAGES = {64: 4, 128: 2}
HEAD_DIMS = (64, 128)
# Shared-memory stages of the streamed ring (dK/dV: Q, dO; dQ: K, V): 32 KiB per stage at D = 128
# (3 stages: 96 KiB, plus 64 KiB resident), 16 KiB at D = 64, with 64-key or 64-row tiles (the
# dQ kernel's 128-key tiles: DQ128_STAGES).
STAGES = {64: 4, 128: 3}
COMPUTE_REGS, PRODUCER_REGS = 232, 40


# ------------------------------------------------------------------------------------- coverage
def check(cfg: Numerics, shape, dtype, out_dtype=None, k_shape=None) -> str | None:
    """Why the Mosaic dK/dV kernel cannot run this call (None: it can). ``shape``: q's padded
    ``[B, T, H, D]``, as ``backward`` receives it; ``out_dtype``: the gradients' dtype."""
    if cfg.policy.name != "fa2" or not cfg.policy.log2_units:
        return f"policy {cfg.policy.name!r} (only 'fa2')"
    if cfg.delta != "o":
        return f"delta {cfg.delta!r} (only 'o')"
    if len(shape) != 4:
        return f"rank {len(shape)} (expected [B, T, H, D])"
    unsupported = unsupported_masks(cfg)
    if unsupported:
        return unsupported
    _, t, _, d = shape
    if k_shape is not None and tuple(k_shape) != mosaic_common.kv_shape(shape, cfg.groups):
        return (f"k shape {tuple(k_shape)} is not q's {tuple(shape)} with {cfg.groups} query "
                "heads per key/value head")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name} (bfloat16 or float16 only)"
    if jnp.dtype(cfg.policy.operand_dtype) != jnp.dtype(dtype) or \
            jnp.dtype(cfg.policy.p_dtype) != jnp.dtype(dtype):
        return f"policy operand/P dtypes differ from the inputs' {jnp.dtype(dtype).name}"
    if out_dtype is not None and jnp.dtype(out_dtype) != jnp.dtype(dtype):
        return f"out_dtype {jnp.dtype(out_dtype).name} differs from the inputs' {jnp.dtype(dtype).name}"
    if d not in HEAD_DIMS:
        return f"head_dim {d} (supported: {HEAD_DIMS})"
    if cfg.q_len != cfg.kv_len or cfg.kv_len > t:
        return (f"q_len {cfg.q_len}, kv_len {cfg.kv_len}, padded length {t} (self-attention only: "
                "q_len = kv_len, padded up to it)")
    if t % KEYS or t % Q_TILE:
        return f"length {t} not a multiple of {KEYS} keys"
    return None


# ------------------------------------------------------------------------------- tile arithmetic
def p_tile(s_t, lse_b, mask_t, cfg: Numerics):
    """Pᵀ (FP32) from the raw product K·Qᵀ (``s_t``, FP32, unscaled) and L broadcast to the tile
    (``[keys, queries]``; ``mask_t`` None: nothing masked): ``tile.backward_tile_dkdv``'s
    expressions — ``tile.scores`` for "fa2", then ``tile._p_from_scores`` — with L broadcast
    explicitly (Mosaic GPU broadcasts a row vector with ``broadcast_in_dim`` from its layout)."""
    return tile._p_from_scores(s_t * cfg.score_scale, lse_b, mask_t, cfg.policy)


def ds_tile(p_t, dp_t, delta_b):
    """dSᵀ = Pᵀ∘(dPᵀ − δ), δ broadcast to the tile: ``tile.backward_tile_dkdv``'s expression."""
    return p_t * (dp_t - delta_b)


# ----------------------------------------------------------------------------------- the kernel
def _query_vector(ref, query_axis: int, interpret: bool):
    """L or δ of a tile's queries from shared memory, laid out as the WGMMA tile reduced over keys
    (the tile's other axis), so it broadcasts along the keys with no shuffle."""
    if interpret:
        return ref[...]
    plgpu = mosaic_common.plgpu()
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(1 - query_axis))


def _along_keys(vec, shape, query_axis: int):
    return lax.broadcast_in_dim(vec, shape, [query_axis])


def _kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, dlt_ref, dk_ref, dv_ref, scratch, *,
            cfg: Numerics, nq: int, stages: int, interpret: bool,
            regs: tuple[int, int] = (COMPUTE_REGS, PRODUCER_REGS)):
    from jax.experimental import pallas as pl

    plgpu = mosaic_common.plgpu()
    (q_smem, do_smem, lse_smem, dlt_smem, k_smem, v_smem, q_ready, do_ready, lse_ready, dlt_ready,
     free, k_ready, v_ready, *staging) = scratch
    bq, bk, d = Q_TILE, KEYS_PER_WG, q_ref.shape[-1]
    wg = lax.axis_index("wg")
    # the program's key/value head; its group's query heads head·g … head·g + g − 1 come one after
    # the other, each with its query blocks in increasing order (the Triton kernel's order)
    g = cfg.groups
    batch, head = lax.axis_index("batch"), lax.axis_index("head")
    key0 = lax.axis_index("kblk") * KEYS  # causal: the first programs have the most query blocks
    # the program streams the query blocks [p_lo, p_hi) that see its keys (tile.q_block_bounds: the
    # causal diagonal, a window's edges), per query head of its group
    p_lo, _, _, p_hi = tile.q_block_bounds(key0, bq, KEYS, nq, cfg)
    n_steps = p_hi - p_lo

    def wgmma_layout(x):
        return x if interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(regs[0], action="increase")
        k_tile, v_tile = k_smem.at[wg], v_smem.at[wg]
        keys = key0 + wg * bk
        kv = (batch, pl.ds(keys, bk), head)
        plgpu.copy_gmem_to_smem(k_ref.at[kv], k_tile, k_ready.at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[kv], v_tile, v_ready.at[wg])
        # query blocks [lo, hi) see this warpgroup's keys, [full_lo, full_hi) see all of them
        lo, full_lo, full_hi, hi = tile.q_block_bounds(keys, bq, bk, nq, cfg)
        plgpu.barrier_wait(k_ready.at[wg])
        plgpu.barrier_wait(v_ready.at[wg])

        def wait_ready(slot):
            plgpu.barrier_wait(q_ready.at[slot])
            plgpu.barrier_wait(do_ready.at[slot])
            plgpu.barrier_wait(lse_ready.at[slot])
            plgpu.barrier_wait(dlt_ready.at[slot])

        def skip(b, _, base=0):
            slot = lax.rem(base + b - p_lo, stages)
            wait_ready(slot)
            plgpu.barrier_arrive(free.at[slot])

        def step(b, carry, masked: bool, base=0):  # b: the query block; base + b − p_lo: ring step
            dk, dv = carry
            slot = lax.rem(base + b - p_lo, stages)
            q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]
            plgpu.barrier_wait(q_ready.at[slot])
            plgpu.barrier_wait(lse_ready.at[slot])
            # L is read before Sᵀ's product is issued, under its wait; δ after dV's and dPᵀ's wait
            # (read before them it holds registers across both products: more spills, slower)
            lse_v = _query_vector(lse_smem.at[slot], 1, interpret)

            def sk(acc_ref):
                plgpu.wgmma(acc_ref, k_tile, q_tile.T)
                return acc_ref[...]

            s_t = pl.run_scoped(sk, plgpu.ACC((bk, bq), jnp.float32))
            mask_t = (tile.tile_mask(b * bq, keys, bq, bk, cfg, transposed=True)
                      if masked else None)
            pol = cfg.policy
            p_t = p_tile(s_t, _along_keys(lse_v, (bk, bq), 1), mask_t, cfg)
            plgpu.barrier_wait(do_ready.at[slot])
            if not interpret:  # Pᵀ from registers; dV and dPᵀ issued together, one wait
                p_op = cast_rounded(p_t, pol.p_dtype)

                def dv_dp(refs):
                    dv_ref, dp_ref = refs
                    plgpu.wgmma(dv_ref, p_op, do_tile)
                    plgpu.wgmma(dp_ref, v_tile, do_tile.T)

                zeros = wgmma_layout(jnp.zeros((bk, bq), jnp.float32))
                dv, dp_t = pl.run_state(dv_dp)((plgpu.ACC.init(dv), plgpu.ACC.init(zeros)))
            else:
                # jax 0.11's GPU interpreter has neither run_state nor a register wgmma operand:
                # Pᵀ goes through shared memory, and the sum is tile.py's dv + (Pᵀ·dO)
                p_stage = staging[0].at[wg]
                p_stage[...] = cast_rounded(p_t, pol.p_dtype)
                plgpu.commit_smem()

                def dv_dp(dv_ref, dp_ref):
                    plgpu.wgmma(dv_ref, p_stage, do_tile)
                    plgpu.wgmma(dp_ref, v_tile, do_tile.T)
                    return dv_ref[...], dp_ref[...]

                pdo, dp_t = pl.run_scoped(dv_dp, plgpu.ACC((bk, d), jnp.float32),
                                          plgpu.ACC((bk, bq), jnp.float32))
                dv = dv + pdo
            plgpu.barrier_wait(dlt_ready.at[slot])
            dlt_v = _query_vector(dlt_smem.at[slot], 1, interpret)
            ds_t = ds_tile(p_t, dp_t, _along_keys(dlt_v, (bk, bq), 1))
            ds_stage = staging[1].at[wg] if interpret else None
            dk = mosaic_common.mma_into(dk, cast_rounded(ds_t, pol.p_dtype), q_tile, ds_stage,
                                        interpret)
            plgpu.barrier_arrive(free.at[slot])
            return dk, dv

        def one_head(i, carry):  # query head head·g + i: its n_steps query blocks
            base = i * n_steps
            # above the diagonal, a window's upper edge; the window's lower edge (without one,
            # full_hi = hi = p_hi)
            # keys at or past a padded length see only masked blocks: the trailing loop runs them
            return mosaic_common.visit_tiles(
                functools.partial(step, base=base), functools.partial(skip, base=base), carry,
                (p_lo, p_hi), (lo, full_lo, full_hi, hi),
                masked_first=cfg.causal or cfg.window is not None,
                masked_last=cfg.window is not None or cfg.kv_len < q_ref.shape[1])

        zeros = wgmma_layout(jnp.zeros((bk, d), jnp.float32))
        carry = (zeros, zeros)
        dk, dv = one_head(0, carry) if g == 1 else lax.fori_loop(0, g, one_head, carry)
        k_tile[...] = (dk * cfg.sm_scale).astype(k_tile.dtype)
        v_tile[...] = dv.astype(v_tile.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_tile, dk_ref.at[kv])
        plgpu.copy_smem_to_gmem(v_tile, dv_ref.at[kv])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _produce():
        plgpu.set_max_registers(regs[1], action="decrease")

        if g == 1:
            rows = lambda s: pl.ds((p_lo + s) * bq, bq)
            qh = lambda s: head
        else:  # ring step s: query head head·g + s // n_steps, its block p_lo + s mod n_steps
            rows = lambda s: pl.ds((p_lo + lax.rem(s, n_steps)) * bq, bq)
            qh = lambda s: head * g + s // n_steps
        # one free barrier per slot covers all four: the consumers release a step's Q, dO, L and δ at once
        stream_ring([Stream(lambda s: q_ref.at[batch, rows(s), qh(s)], q_smem, q_ready, free),
                     Stream(lambda s: lse_ref.at[batch, qh(s), rows(s)], lse_smem, lse_ready, None),
                     Stream(lambda s: do_ref.at[batch, rows(s), qh(s)], do_smem, do_ready, None),
                     Stream(lambda s: dlt_ref.at[batch, qh(s), rows(s)], dlt_smem, dlt_ready, None)],
                    stages, g * n_steps)


def _regs(regs) -> tuple[int, int]:
    if regs is None:
        return COMPUTE_REGS, PRODUCER_REGS
    regs = tuple(regs)
    check_mosaic_regs(regs, "regs")
    return regs


def _require_covered(kernel: str, cfg: Numerics, q, k, v, do, out_dtype):
    reason = check(cfg, q.shape, q.dtype, out_dtype, k.shape)
    if reason is None and not (k.shape == v.shape == mosaic_common.kv_shape(q.shape, cfg.groups)
                               and do.shape == q.shape
                               and q.dtype == k.dtype == v.dtype == do.dtype):
        reason = (f"q {q.shape} {q.dtype}, k {k.shape} {k.dtype}, v {v.shape} {v.dtype}, "
                  f"do {do.shape} {do.dtype} differ")
    if reason is not None:
        raise ValueError(f"the Mosaic GPU {kernel} kernel does not cover this call: {reason}")


def dkdv_scratch(d, dtype, stages):
    """The dK/dV kernel's compiled shared-memory scratch with a Q/dO ring of ``stages``."""
    plgpu = mosaic_common.plgpu()
    layout = mosaic_common.swizzled()
    return (
        plgpu.SMEM((stages, Q_TILE, d), dtype, transforms=layout),  # Q ring
        plgpu.SMEM((stages, Q_TILE, d), dtype, transforms=layout),  # dO ring
        plgpu.SMEM((stages, Q_TILE), jnp.float32),  # L ring
        plgpu.SMEM((stages, Q_TILE), jnp.float32),  # δ ring
        plgpu.SMEM((COMPUTE_WGS, KEYS_PER_WG, d), dtype, transforms=layout),  # K, then dK
        plgpu.SMEM((COMPUTE_WGS, KEYS_PER_WG, d), dtype, transforms=layout),  # V, then dV
        plgpu.Barrier(num_barriers=stages),  # Q arrived
        plgpu.Barrier(num_barriers=stages),  # dO arrived
        plgpu.Barrier(num_barriers=stages),  # L arrived
        plgpu.Barrier(num_barriers=stages),  # δ arrived
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),  # slot free
        plgpu.Barrier(num_barriers=COMPUTE_WGS),  # K arrived, per warpgroup
        plgpu.Barrier(num_barriers=COMPUTE_WGS),  # V arrived, per warpgroup
    )


def dq_scratch(d, dtype, stages, keys: int = DQ_KEY_TILE):
    """The dQ kernel's compiled shared-memory scratch with a K/V ring of ``stages`` tiles of
    ``keys``."""
    plgpu = mosaic_common.plgpu()
    layout = mosaic_common.swizzled()
    rows = (COMPUTE_WGS, KEYS_PER_WG)
    return (
        plgpu.SMEM((*rows, d), dtype, transforms=layout),  # Q, then dQ
        plgpu.SMEM((*rows, d), dtype, transforms=layout),  # dO
        plgpu.SMEM(rows, jnp.float32),  # L
        plgpu.SMEM(rows, jnp.float32),  # δ
        plgpu.SMEM((stages, keys, d), dtype, transforms=layout),  # K ring
        plgpu.SMEM((stages, keys, d), dtype, transforms=layout),  # V ring
        *(plgpu.Barrier(num_barriers=COMPUTE_WGS),) * 4,  # Q, dO, L, δ arrived, per warpgroup
        plgpu.Barrier(num_barriers=stages),  # K_j arrived
        plgpu.Barrier(num_barriers=stages),  # V_j arrived
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),  # K slot free
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),  # V slot free
    )


def dkdv_mosaic(q, k, v, do, lse, dlt, cfg: Numerics, *, out_dtype, interpret=None, stages=None,
                regs=None):
    """(dK, dV) ``[B, T, K, D]`` in ``out_dtype`` (K = H / cfg.groups key/value heads; a group's
    query heads summed in FP32, one after the other), dK times sm_scale, as ``backward.backward``'s
    dK/dV kernel. ``lse``, ``dlt``: L (FP32, log2 units) and δ ``[B, H, T]``. ``interpret``: a
    ``plgpu.InterpretGPUParams`` to run on the CPU (jax ≥ 0.11; tests only). ``stages``: the depth
    of the Q/dO ring (``Launch.mosaic_bwd_stages``; None: ``STAGES``), which changes no value.
    ``regs``: ``Launch.mosaic_bwd_regs``, the (compute, producer) registers a thread (None:
    ``COMPUTE_REGS``, ``PRODUCER_REGS``), which changes where values live, not what they are."""
    _require_covered("dK/dV", cfg, q, k, v, do, out_dtype)
    plgpu = mosaic_common.plgpu()
    bsz, t, h, d = q.shape
    nq = t // Q_TILE
    layout = mosaic_common.swizzled()
    stages = mosaic_common.ring_stages(lambda n: dkdv_scratch(d, q.dtype, n), stages,
                                       STAGES[d], nq, "dK/dV")
    scratch = dkdv_scratch(d, q.dtype, stages)
    if interpret is not None:  # Pᵀ, dSᵀ staged for the interpreter's wgmma (see _kernel)
        scratch += (plgpu.SMEM((COMPUTE_WGS, KEYS_PER_WG, Q_TILE), q.dtype, transforms=layout),) * 2
    body = functools.partial(_kernel, cfg=cfg, nq=nq, stages=stages,
                             interpret=interpret is not None, regs=_regs(regs))

    def entry(*refs):
        from jax.experimental import pallas as pl

        # compiled: plain conversions round; interpreted, XLA runs the body: round_to's rounding
        with native_casts(interpret is None), tile.exp2_backend(_exp2(interpret)):
            pl.run_scoped(lambda *scr: body(*refs, scr), *scratch, collective_axes="wg")

    kwargs = {} if interpret is None else {"interpret": interpret}
    out = jax.ShapeDtypeStruct(k.shape, out_dtype)
    dk, dv = plgpu.kernel(
        entry,
        out_type=(out, out),
        # a program per key block and key/value head; the last axis is launched fastest, so a
        # head's key blocks run side by side and share its Q and dO in L2
        grid=(bsz, k.shape[2], t // KEYS),
        grid_names=("batch", "head", "kblk"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        kernel_name=f"jax_flash_dkdv_mosaic_{cfg.policy.name}",  # profilers filter on "jax_flash"
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **kwargs,
    )(q, k, v, do, lse, dlt)
    return dk, dv


# ---------------------------------------------------------------------------------------------- dQ
def ds_tile_dq(s, dp, lse_b, delta_b, mask, cfg: Numerics):
    """dS = P∘(dP − δ) of a query block × key tile (``s``: the raw Q·Kᵀ, FP32, unscaled; L, δ
    broadcast to ``[queries, keys]``): ``tile.backward_tile_dq``'s expressions."""
    return tile._p_from_scores(s * cfg.score_scale, lse_b, mask, cfg.policy) * (dp - delta_b)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, dlt_ref, dq_ref, scratch, *, cfg: Numerics,
               nk: int, stages: int, interpret: bool,
               regs: tuple[int, int] = (COMPUTE_REGS, PRODUCER_REGS), keys: int = DQ_KEY_TILE):
    from jax.experimental import pallas as pl

    plgpu = mosaic_common.plgpu()
    (q_smem, do_smem, lse_smem, dlt_smem, k_smem, v_smem, q_ready, do_ready, lse_ready, dlt_ready,
     k_ready, v_ready, k_free, v_free, *staging) = scratch
    rq, bk, d = KEYS_PER_WG, keys, q_ref.shape[-1]
    wg = lax.axis_index("wg")
    items = mosaic_common.query_block_items(None, q_ref.shape, KEYS, bk, nk, cfg)

    def compute(it, _ring, _n):
        batch, head, row0, p_lo, p_hi = it
        q_tile, do_tile = q_smem.at[wg], do_smem.at[wg]
        rows = row0 + wg * rq
        # tiles [lo, hi) hold what the rows see, [full_lo, full_hi) need no mask
        lo, full_lo, full_hi, hi = tile.kv_tile_bounds(rows, rq, bk, nk, cfg)
        mine = (batch, pl.ds(rows, rq), head)
        plgpu.copy_gmem_to_smem(q_ref.at[mine], q_tile, q_ready.at[wg])
        plgpu.copy_gmem_to_smem(do_ref.at[mine], do_tile, do_ready.at[wg])
        plgpu.copy_gmem_to_smem(lse_ref.at[batch, head, pl.ds(rows, rq)], lse_smem.at[wg],
                                lse_ready.at[wg])
        plgpu.copy_gmem_to_smem(dlt_ref.at[batch, head, pl.ds(rows, rq)], dlt_smem.at[wg],
                                dlt_ready.at[wg])
        for bar in (q_ready, do_ready, lse_ready, dlt_ready):
            plgpu.barrier_wait(bar.at[wg])
        # L and δ of the warpgroup's rows, read once per query block
        lse_v = _query_vector(lse_smem.at[wg], 0, interpret)
        dlt_v = _query_vector(dlt_smem.at[wg], 0, interpret)

        def step(j, dq, masked: bool, half: bool = False):
            # j: the key tile; j − p_lo: its place in the ring; half: its first bk / 2 keys
            slot = lax.rem(j - p_lo, stages)
            n = bk // 2 if half else bk
            k_tile, v_tile = (r.at[slot, pl.ds(0, n)] for r in (k_smem, v_smem))
            plgpu.barrier_wait(k_ready.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_tile, k_tile.T)
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((rq, n), jnp.float32))
            plgpu.barrier_wait(v_ready.at[slot])

            def dov(acc_ref):
                plgpu.wgmma(acc_ref, do_tile, v_tile.T)
                return acc_ref[...]

            dp = pl.run_scoped(dov, plgpu.ACC((rq, n), jnp.float32))
            plgpu.barrier_arrive(v_free.at[slot])
            mask = tile.tile_mask(rows, j * bk, rq, n, cfg) if masked else None
            lse_b, dlt_b = _along_keys(lse_v, (rq, n), 0), _along_keys(dlt_v, (rq, n), 0)
            ds = ds_tile_dq(s, dp, lse_b, dlt_b, mask, cfg)
            ds = cast_rounded(ds, cfg.policy.p_dtype)
            # dS from registers, dQ as the accumulator
            ds_stage = staging[0].at[wg, :, pl.ds(0, n)] if interpret else None
            dq = mosaic_common.mma_into(dq, ds, k_tile, ds_stage, interpret)
            plgpu.barrier_arrive(k_free.at[slot])
            return dq

        def skip(j, _):  # tiles outside this warpgroup's rows' view that the other one needs
            slot = lax.rem(j - p_lo, stages)
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])

        dq = jnp.zeros((rq, d), jnp.float32)
        dq = dq if interpret else plgpu.layout_cast(dq, plgpu.Layout.WGMMA)
        # a window's left edge (without one, p_lo = lo = full_lo = 0); the diagonal or the
        # window's right edge
        bounds = (lo, full_lo, full_hi, hi)
        dq = mosaic_common.visit_tiles(step, skip, dq, (p_lo, p_hi), bounds,
                                       masked_first=cfg.window is not None,
                                       masked_last=cfg.causal or cfg.window is not None
                                       or cfg.kv_len % bk != 0,
                                       half_last=mosaic_common.half_last(rows, rq, bk, cfg, bounds))
        q_tile[...] = (dq * cfg.sm_scale).astype(q_tile.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tile, dq_ref.at[mine])
        plgpu.wait_smem_to_gmem(0)

    pl.when(wg < COMPUTE_WGS)(lambda: mosaic_common.run_consumer(items, compute, regs[0], False))
    pl.when(wg == COMPUTE_WGS)(lambda: mosaic_common.run_kv_producer(
        items, k_ref, v_ref, cfg.groups, bk, (k_smem, k_ready, k_free), (v_smem, v_ready, v_free),
        stages, regs[1], False))


def dq_mosaic(q, k, v, do, lse, dlt, cfg: Numerics, *, out_dtype, interpret=None, stages=None,
              regs=None, keys=None):
    """dQ ``[B, T, H, D]`` in ``out_dtype``, times sm_scale, as ``backward.backward``'s dQ kernel:
    128 query rows per program (two compute warpgroups of 64), key tiles of ``keys`` (64 or 128,
    ``Launch.mosaic_dq_keys``; None: 64) streamed by TMA, in increasing order up to the causal
    diagonal. Arguments as ``dkdv_mosaic`` (``stages``: of the K/V ring of 64-key tiles; 128-key
    tiles take ``DQ128_STAGES``)."""
    _require_covered("dQ", cfg, q, k, v, do, out_dtype)
    keys = keys or DQ_KEY_TILE
    if keys not in DQ_KEY_TILES:
        raise ValueError(f"the Mosaic GPU dQ kernel takes key tiles of {DQ_KEY_TILES}, got {keys}")
    plgpu = mosaic_common.plgpu()
    bsz, t, h, d = q.shape
    nk = t // keys
    layout = mosaic_common.swizzled()
    rows = (COMPUTE_WGS, KEYS_PER_WG)
    if keys != DQ_KEY_TILE:
        stages = DQ128_STAGES[d]
    stages = mosaic_common.ring_stages(lambda n: dq_scratch(d, q.dtype, n, keys), stages,
                                       STAGES[d], nk, "dQ")
    scratch = dq_scratch(d, q.dtype, stages, keys)
    if interpret is not None:  # dS staged for the interpreter's wgmma
        scratch += (plgpu.SMEM((*rows, keys), q.dtype, transforms=layout),)
    body = functools.partial(_dq_kernel, cfg=cfg, nk=nk, stages=stages,
                             interpret=interpret is not None, regs=_regs(regs), keys=keys)

    def entry(*refs):
        from jax.experimental import pallas as pl

        with native_casts(interpret is None), tile.exp2_backend(_exp2(interpret)):
            pl.run_scoped(lambda *scr: body(*refs, scr), *scratch, collective_axes="wg")

    kwargs = {} if interpret is None else {"interpret": interpret}
    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct(q.shape, out_dtype),
        grid=(bsz, h, t // KEYS),  # query blocks fastest: a head's K and V shared in L2
        grid_names=("batch", "head", "qblk"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        kernel_name=f"jax_flash_dq_mosaic_{cfg.policy.name}",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **kwargs,
    )(q, k, v, do, lse, dlt)
