"""Executor 2, forward, on Hopper: a Mosaic GPU (Pallas ``plgpu``) kernel for the "fa2" policy.

The same algorithm and rounding points as ``forward.py``'s Triton kernel — the per-tile softmax is
``tile.py``'s arithmetic on the register tiles — with Hopper's data movement and dots: TMA copies into
a ring of shared-memory stages, ``wgmma`` for Q·Kᵀ and P̄·V, and warpgroup specialisation. Each program
owns 128 query rows: two compute warpgroups of 64 rows each (wgmma's M) and one producer warpgroup
that streams the key tiles K_j, V_j for both, in order, only those its rows see (the causal
diagonal, a window's edges: ``tile.kv_tile_bounds``); under GQA a query head reads its group's K, V.
A warpgroup whose rows see none of its last 128-key tile's second half runs that tile on its first
64 keys (``mosaic_common.half_last``): the same values, less work on the causal diagonal.
With ``Launch.mosaic_fwd_persistent`` (the head_dim-128 tuning entries) one program per SM takes
those blocks in turn, its K/V ring running on across them and the next block's Q loaded early.

The two compute warpgroups take turns ("ping-pong", as in FlashAttention-3): one's softmax runs while
the other's MMAs use the tensor cores. Compiled, a warpgroup does not wait for its P̄·V: the next
tile's QKᵀ is issued behind it and the two are awaited together, so the tensor cores see no gap
between them (the same products, so the same bits). Chosen by ``Launch.fwd_kernel == "mosaic"``
(the tuning table or the caller); ``jax_flash.plan`` runs the Triton kernel instead where ``check``
says this one does not cover the call, or raises if the caller asked for it.

Imports of ``jax.experimental.pallas.mosaic_gpu`` stay inside functions: this module must import on
any JAX the package supports (0.10.2 on CPU), written against the API of jax 0.11.2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .. import tile
from ..rounding import native_casts
from ..spec import Numerics
from . import mosaic_common
from .mosaic_common import exp2_backend as _exp2, half_last, unsupported_masks

ROWS_PER_WG = 64  # wgmma's M: the query rows of one compute warpgroup
COMPUTE_WGS = 2
ROWS = ROWS_PER_WG * COMPUTE_WGS  # query rows per program
HEAD_DIMS = (64, 128)
KEY_TILES = (64, 128)  # cfg.block_k: the key tile is the numerics' (online softmax, tie count)
# Shared-memory stages of the K/V ring per key tile width: 64-wide tiles are short MMAs, so more
# of them in flight (4 stages at D = 128: 128 KiB of K/V plus 32 KiB of Q/O, within 227 KiB).
STAGES = {64: 4, 128: 2}
PINGPONG = True
# Registers per thread after warpgroup specialisation: 2·128·232 + 128·40 ≤ 65,536 per SM.
COMPUTE_REGS, PRODUCER_REGS = 232, 40


# ------------------------------------------------------------------------------------- coverage
def check(cfg: Numerics, shape, dtype, o_dtype=None) -> str | None:
    """Why the Mosaic forward cannot run this call (None: it can). ``shape``: q's padded
    ``[B, T, H, D]``, as ``forward`` receives it."""
    if cfg.policy.name != "fa2" or not cfg.policy.log2_units:
        return f"policy {cfg.policy.name!r} (only 'fa2')"
    if len(shape) != 4:
        return f"rank {len(shape)} (expected [B, T, H, D])"
    unsupported = unsupported_masks(cfg)
    if unsupported:
        return unsupported
    _, t, _, d = shape
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name} (bfloat16 or float16 only)"
    if o_dtype is not None and jnp.dtype(o_dtype) != jnp.dtype(dtype):
        return f"o_dtype {jnp.dtype(o_dtype).name} differs from the inputs' {jnp.dtype(dtype).name}"
    if d not in HEAD_DIMS:
        return f"head_dim {d} (supported: {HEAD_DIMS})"
    if cfg.block_k not in KEY_TILES:
        return f"block_k {cfg.block_k} (supported: {KEY_TILES})"
    if cfg.q_len != cfg.kv_len or cfg.kv_len > t:
        return (f"q_len {cfg.q_len}, kv_len {cfg.kv_len}, padded length {t} (self-attention only: "
                "q_len = kv_len, padded up to it)")
    if t % ROWS or t % cfg.block_k:
        return f"length {t} not a multiple of {ROWS} query rows and of block_k {cfg.block_k}"
    return None


# ----------------------------------------------------------------------------------- the kernel
def _kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, scratch, *, cfg: Numerics, nk: int, stages: int,
            interpret: bool, programs: int | None = None):
    from jax.experimental import pallas as pl

    plgpu = mosaic_common.plgpu()
    (qo_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_free, v_free, turn, *rest) = scratch
    persistent = programs is not None
    q_free = rest.pop(0) if persistent else None
    p_smem = rest[0] if rest else None
    bk, d = cfg.block_k, q_ref.shape[-1]
    wg = lax.axis_index("wg")
    # a warpgroup skips the streamed tiles only the other one's rows see
    items = mosaic_common.query_block_items(programs, q_ref.shape, ROWS, bk, nk, cfg)

    def take_turn():  # both compute warpgroups meet here; each call pairs with one of the other's
        if PINGPONG:
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

    def q_buffer(n, g):
        """Warpgroup g's Q (then O) buffer for the program's n-th item: its own, or (persistent)
        one of two it alternates between, so that the producer loads the next item's Q early."""
        return g if not persistent else lax.rem(n, 2) * COMPUTE_WGS + g

    def compute(it, base, n):
        batch, head, row0, p_lo, p_hi = it
        buf = q_buffer(n, wg)
        qo = qo_smem.at[buf]
        rows = row0 + wg * ROWS_PER_WG
        # tiles [lo, hi) hold what the rows see, [full_lo, full_hi) need no mask
        lo, full_lo, full_hi, hi = tile.kv_tile_bounds(rows, ROWS_PER_WG, bk, nk, cfg)
        if not persistent:
            plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(rows, ROWS_PER_WG), head], qo,
                                    q_ready.at[buf])
        plgpu.barrier_wait(q_ready.at[buf])
        # warpgroup 1 starts one turn behind, so that the two alternate from the first tile
        pl.when(wg == 1)(take_turn)

        acc_ref = None  # compiled: the walk's O accumulator, each P̄·V left in flight (``walk``)

        def step(j, carry, masked: bool, half: bool = False):
            # j: the key tile; base + j − p_lo: its place in the ring; half: its first bk / 2 keys
            slot = ring_slot(base, j - p_lo)
            keys = bk // 2 if half else bk
            k_tile, v_tile = (r.at[slot, pl.ds(0, keys)] for r in (k_smem, v_smem))
            plgpu.barrier_wait(k_ready.at[slot])

            def qk(s_ref):
                plgpu.wgmma(s_ref, qo, k_tile.T)
                take_turn()  # the QKᵀ is issued: the other warpgroup's softmax may end
                return s_ref[...]  # waits for every product: the last tile's P̄·V too

            s = pl.run_scoped(qk, plgpu.ACC((ROWS_PER_WG, keys), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            if acc_ref is not None:  # the last tile's P̄·V has completed: its V slot is free
                pl.when(j > lo)(lambda: plgpu.barrier_arrive(v_free.at[ring_slot(base,
                                                                                  j - 1 - p_lo)]))
            if not cfg.scale_late:  # tile.forward_scores for "fa2"
                s = s * cfg.score_scale
            mask = tile.tile_mask(rows, j * bk, ROWS_PER_WG, keys, cfg) if masked else None
            m_new, l_new, alpha, p_bar, _ = tile.softmax_update(carry, s, mask, cfg,
                                                                floor=tile.floor_positive)
            # "fa2": tile.accumulate is acc·α + P̄·V, unrounded
            if acc_ref is not None:
                acc_ref[...] = acc_ref[...] * alpha[:, None]
            else:
                acc = carry.acc * alpha[:, None]
            if PINGPONG:
                plgpu.barrier_arrive(turn)  # softmax done; the tensor cores are the other's turn
            plgpu.barrier_wait(v_ready.at[slot])
            if PINGPONG:
                plgpu.barrier_wait(turn)

            # P̄ from registers, acc·α as the accumulator: acc·α + P̄·V in the MMA
            if acc_ref is not None:
                # not awaited: the next tile's QKᵀ queues behind it, with no wait between the two
                plgpu.wgmma(acc_ref, p_bar, v_tile)
                return tile.Carry(m_new, l_new, None, None)
            p_stage = p_smem.at[wg, :, pl.ds(0, keys)] if interpret else None
            acc = mosaic_common.mma_into(acc, p_bar, v_tile, p_stage, interpret)
            plgpu.barrier_arrive(v_free.at[slot])
            return tile.Carry(m_new, l_new, acc, None)

        def skip(j, _):
            # tiles outside this warpgroup's rows' view that the other one needs: release them only
            # after they arrived, so that each release counts towards this tile's phase of the barrier
            slot = ring_slot(base, j - p_lo)
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])
            take_turn()
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            take_turn()

        def flush(carry):  # the last P̄·V completes; its V slot is released before any skip waits
            acc = acc_ref[...]
            pl.when(hi > lo)(lambda: plgpu.barrier_arrive(v_free.at[ring_slot(base,
                                                                               hi - 1 - p_lo)]))
            return carry._replace(acc=acc)

        def walk(ref=None):
            nonlocal acc_ref
            acc_ref = ref
            carry = tile.init_carry(ROWS_PER_WG, d, cfg)
            if ref is not None:
                carry = carry._replace(acc=None)
            # a window's left edge (without one, p_lo = lo = full_lo = 0); the diagonal or the
            # window's right edge
            # the last tile is masked under a causal diagonal, a window's right edge or a length
            # that ends inside a tile (the tiles past the length are not streamed)
            bounds = (lo, full_lo, full_hi, hi)
            carry = mosaic_common.visit_tiles(
                step, skip, carry, (p_lo, p_hi), bounds, masked_first=cfg.window is not None,
                masked_last=cfg.causal or cfg.window is not None or cfg.kv_len % bk != 0,
                half_last=half_last(rows, ROWS_PER_WG, bk, cfg, bounds),
                flush=flush if ref is not None else None)
            pl.when(wg == 0)(take_turn)  # the turn warpgroup 1 took before its first tile
            store(carry)

        def store(carry):
            o, lse = tile.finish(carry, cfg)
            qo[...] = o.astype(qo.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo, o_ref.at[batch, pl.ds(rows, ROWS_PER_WG), head])
            # L straight from registers: 256 bytes a warpgroup, not worth the shared memory a TMA
            # store needs (1 KiB with alignment, the margin a third K/V stage needs at head_dim 128)
            lse_ref.at[batch, head, pl.ds(rows, ROWS_PER_WG)][...] = lse
            # persistent: once O is read out, the producer may load an item's Q into the buffer
            plgpu.wait_smem_to_gmem(0, wait_read_only=persistent)
            if persistent:
                plgpu.barrier_arrive(q_free.at[buf])

        if interpret:  # the interpreter has no run_state: each P̄·V awaited (mma_into)
            walk()
        else:
            zeros = plgpu.layout_cast(jnp.zeros((ROWS_PER_WG, d), jnp.float32),
                                      plgpu.Layout.WGMMA)
            pl.run_state(walk)(plgpu.ACC.init(zeros))

    def ring_slot(base, j):  # the ring position of an item's j-th streamed tile
        return lax.rem(base + j if persistent else j, stages)

    def load_q(it, n):
        """Persistent: the producer loads item n's Q for both warpgroups, into buffers whose item
        n − 2 is read out, so it arrives while the warpgroups still work on item n − 1."""
        batch, head, row0, _, _ = it
        for g in range(COMPUTE_WGS):
            buf = q_buffer(n, g)
            pl.when(n >= 2)(lambda buf=buf: plgpu.barrier_wait(q_free.at[buf]))
            rows = pl.ds(row0 + g * ROWS_PER_WG, ROWS_PER_WG)
            plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], qo_smem.at[buf], q_ready.at[buf])

    def last_q_waits(count):  # the releases of the last two items' buffers, never waited for else
        for back in (2, 1):
            for g in range(COMPUTE_WGS):
                pl.when(count >= back)(
                    lambda back=back, g=g: plgpu.barrier_wait(q_free.at[q_buffer(count - back, g)]))

    pl.when(wg < COMPUTE_WGS)(
        lambda: mosaic_common.run_consumer(items, compute, COMPUTE_REGS, persistent))
    pl.when(wg == COMPUTE_WGS)(lambda: mosaic_common.run_kv_producer(
        items, k_ref, v_ref, cfg.groups, bk, (k_smem, k_ready, k_free), (v_smem, v_ready, v_free),
        stages, PRODUCER_REGS, persistent, before=load_q if persistent else None,
        after=last_q_waits if persistent else None))


def forward_scratch(bk, d, dtype, stages, persistent=False):
    """The forward's compiled shared-memory scratch: a K/V ring of ``stages`` tiles of ``bk`` keys;
    ``persistent``: two Q/O buffers a warpgroup, and barriers saying when each is free."""
    plgpu = mosaic_common.plgpu()
    layout = mosaic_common.swizzled()
    bufs = COMPUTE_WGS * (2 if persistent else 1)
    return (
        plgpu.SMEM((bufs, ROWS_PER_WG, d), dtype, transforms=layout),  # Q, then O
        plgpu.SMEM((stages, bk, d), dtype, transforms=layout),
        plgpu.SMEM((stages, bk, d), dtype, transforms=layout),
        plgpu.Barrier(num_barriers=bufs),  # Q arrived, per buffer
        plgpu.Barrier(num_barriers=stages),  # K_j arrived
        plgpu.Barrier(num_barriers=stages),  # V_j arrived
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),  # K slot free
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),  # V slot free
        plgpu.Barrier(num_arrivals=COMPUTE_WGS),  # the ping-pong turn
        *((plgpu.Barrier(num_barriers=bufs),) if persistent else ()),  # a Q/O buffer read out
    )


def forward_mosaic(q, k, v, cfg: Numerics, *, o_dtype, interpret=None, stages=None,
                   programs=None):
    """Returns O ``[B, T, H, D]`` in ``o_dtype`` and L ``[B, H, T]`` (FP32, log2 units), as
    ``forward.forward``. ``interpret``: a ``plgpu.InterpretGPUParams`` to run on the CPU (jax ≥ 0.11;
    tests only). ``stages``: the depth of the K/V ring (``Launch.mosaic_fwd_stages``, ≥ 2; None:
    ``STAGES``), which changes no value. ``programs``: None, a program per (batch, head, query
    block); else that many persistent programs (``Launch.mosaic_fwd_persistent``: one per SM),
    each taking those items in turn with one K/V ring across them: the same per-item arithmetic."""
    reason = check(cfg, q.shape, q.dtype, o_dtype)
    if reason is None and not (k.shape == v.shape == mosaic_common.kv_shape(q.shape, cfg.groups)
                               and q.dtype == k.dtype == v.dtype):
        reason = f"q {q.shape} {q.dtype}, k {k.shape} {k.dtype}, v {v.shape} {v.dtype} differ"
    if reason is not None:
        raise ValueError(f"the Mosaic GPU forward does not cover this call: {reason}")
    plgpu = mosaic_common.plgpu()
    bsz, t, h, d = q.shape
    bk = cfg.block_k
    nk = t // bk
    if nk < 2:
        raise ValueError(f"the Mosaic GPU forward needs ≥ 2 key tiles, got {nk}")
    layout = mosaic_common.swizzled()
    programs = mosaic_common.persistent_programs(programs, (bsz, h, t // ROWS))
    persistent = programs is not None
    stages = mosaic_common.ring_stages(lambda n: forward_scratch(bk, d, q.dtype, n, persistent),
                                       stages, STAGES[bk], nk, "forward", least=2)
    scratch = forward_scratch(bk, d, q.dtype, stages, persistent)
    if interpret is not None:  # P̄ staged for the interpreter's wgmma (see _kernel)
        scratch += (plgpu.SMEM((COMPUTE_WGS, ROWS_PER_WG, bk), q.dtype, transforms=layout),)
    body = functools.partial(_kernel, cfg=cfg, nk=nk, stages=stages,
                             interpret=interpret is not None, programs=programs)

    def entry(q_ref, k_ref, v_ref, o_ref, lse_ref):
        # compiled: plain conversions round (Mosaic GPU has no reduce_precision); interpreted,
        # XLA runs the body, so round_to's XLA-proof rounding
        with native_casts(interpret is None), tile.exp2_backend(_exp2(interpret)):
            pl_run_scoped(lambda *refs: body(q_ref, k_ref, v_ref, o_ref, lse_ref, refs), scratch)

    def pl_run_scoped(fn, types):
        from jax.experimental import pallas as pl

        return pl.run_scoped(fn, *types, collective_axes="wg")

    kwargs = {} if interpret is None else {"interpret": interpret}
    o, lse = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((bsz, t, h, d), o_dtype),
                  jax.ShapeDtypeStruct((bsz, h, t), jnp.float32)),
        # Mosaic GPU launches the last grid axis fastest: a head's query blocks run side by side
        # and read its K and V from L2, not each from DRAM
        grid=(bsz, h, t // ROWS) if programs is None else (programs,),
        grid_names=("batch", "head", "qblk") if programs is None else ("prog",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        kernel_name=f"jax_flash_fwd_mosaic_{cfg.policy.name}",  # profilers filter on "jax_flash"
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **kwargs,
    )(q, k, v)
    return o, lse
