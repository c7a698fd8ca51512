"""Executor 2, backward: the FA2 backward as Pallas kernels built on ``tile.py``.

* δ: for ``delta="o"`` one fused FP32 rowsum(dO ∘ O) in XLA; for "dpp" / "o_hp" a kernel that walks
  the key tiles like the forward.
* dK/dV: grid (key tile, batch, key/value head); loops over the group's query heads and, for each,
  over the query blocks that see the tile (``tile.q_block_bounds``: from the causal diagonal on,
  inside a window and the lengths).
* dQ: grid (query block, batch, head); loops over the key tiles the block sees (as the forward).
P is recomputed from the saved L, so nothing quadratic in T is stored.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .. import tile
from ..spec import Launch, Numerics
from . import backward_mosaic
from .common import compiler_params, interpret_mode, kernel_body, resident_block
from .forward import at_slot, kv_head, kv_loop, length_specs, read_lengths, unpacked_shape


def query_block(i, n, heavy_first: bool):
    """The query block of program ``i`` of ``n`` along the grid's first axis: the last first when
    ``heavy_first`` (``Launch.heavy_first``), else the i-th. Which program owns a block changes no
    value."""
    return n - 1 - i if heavy_first else i


# Grids are (block, batch, head): the block index varies fastest, so the programs running at once
# mostly share one (batch, head) and its full-length operands stay in L2 (as in JAX's Pallas mha).
def _row_spec(b_rows, order=lambda i: i):
    return pl.BlockSpec((None, None, b_rows), lambda i, b, hh: (b, hh, order(i)))


def _full_rows_spec(t):
    return pl.BlockSpec((None, None, t), lambda i, b, hh: (b, hh, 0))


def _block_spec(b_rows, d, order=lambda i: i):
    """Block ``order(i)`` of rows of a ``[B, T, H, D]`` array for program (i, b, hh)."""
    return pl.BlockSpec((None, b_rows, None, d), lambda i, b, hh: (b, order(i), hh, 0))


def _full_spec(t, d, groups=1):
    return pl.BlockSpec((None, t, None, d), lambda i, b, hh: (b, 0, kv_head(hh, groups), 0))


def _group_spec(t, d, groups):
    """All ``groups`` query heads of key/value head hh, full length: [T, G, D] per program."""
    if groups == 1:
        return _full_spec(t, d)
    return pl.BlockSpec((None, t, groups, d), lambda i, b, hh: (b, 0, hh, 0))


def _slots_spec(b_rows, d, order=lambda i: i):
    """A block of rows of all three slots of a packed ``[B, T, 3, H, D]`` array: [rows, 3, D]."""
    return pl.BlockSpec((None, b_rows, 3, None, d), lambda i, b, hh: (b, order(i), 0, hh, 0))


def _into_slots(kernel, slots):
    """``kernel`` with its last outputs written into ``slots`` of one packed output block (the
    last ref); any refs between the kernel's inputs and that output (an aliased buffer) unused."""
    def wrapped(*refs, n_in):
        kernel(*refs[:n_in], *(refs[-1].at[:, s] for s in slots))

    return wrapped


def _group_rows_spec(t, groups):
    if groups == 1:
        return _full_rows_spec(t)
    return pl.BlockSpec((None, groups, t), lambda i, b, hh: (b, hh, 0))


def _name(kind, cfg):
    return f"jax_flash_{kind}_{cfg.policy.name}"


# ------------------------------------------------------------------------------------------------ δ
@kernel_body
def _delta_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, *refs, cfg: Numerics, launch: Launch,
                  nk: int):
    lengths, (out_ref,) = read_lengths(cfg, refs)
    pol, bq, bk = cfg.policy, cfg.block_q, cfg.block_k
    i = query_block(pl.program_id(0), pl.num_programs(0), launch.heavy_first)
    q = q_ref[...].astype(pol.operand_dtype)
    do = do_ref[...].astype(pol.operand_dtype)
    lse = lse_ref[...]

    def body(j, acc, mask):
        k = k_ref[pl.ds(j * bk, bk), :].astype(pol.operand_dtype)
        v = v_ref[pl.ds(j * bk, bk), :].astype(pol.operand_dtype)
        return tile.delta_tile(acc, q, k, v, do, lse, mask, cfg)

    zeros = jnp.zeros((bq,), jnp.float32)
    init = (zeros,) if cfg.delta == "dpp" else (jnp.zeros(q.shape, jnp.float32), zeros)
    acc = kv_loop(i, cfg, nk, body, init, launch.split_diagonal, lengths)
    out_ref[...] = tile.delta_finish(acc, do, cfg)


def delta(q, k, v, o, do, lse, cfg: Numerics, launch: Launch, lengths=None, packed=False):
    """δ ``[B, H, Tq]`` (FP32) for the configured δ mode; ``packed`` as ``forward``'s."""
    if cfg.delta == "o":
        return tile.delta_from_o(o, do).transpose(0, 2, 1)
    bsz, tq, h, d = unpacked_shape(q.shape) if packed else q.shape
    tk = k.shape[1]
    bq, bk = cfg.block_q, cfg.block_k
    g = cfg.groups
    qi = functools.partial(query_block, n=tq // bq, heavy_first=launch.heavy_first)
    qkv = [_block_spec(bq, d, qi), _full_spec(tk, d, g), _full_spec(tk, d, g)]
    if packed:
        qkv = [at_slot(spec, slot) for slot, spec in enumerate(qkv)]
    return pl.pallas_call(
        functools.partial(_delta_kernel, cfg=cfg, launch=launch, nk=tk // bk),
        grid=(tq // bq, bsz, h),
        in_specs=[*qkv, _block_spec(bq, d, qi), _row_spec(bq, qi), *length_specs(cfg, 1)],
        out_specs=_row_spec(bq, qi),
        out_shape=jax.ShapeDtypeStruct((bsz, h, tq), jnp.float32),
        interpret=interpret_mode(),
        compiler_params=compiler_params(launch.bwd, d, bq, bk, backward=True,
                                        itemsize=q.dtype.itemsize),
        name=_name("delta", cfg),
    )(q, k, v, do, lse, *(lengths if cfg.seq_lengths else ()))


# ---------------------------------------------------------------------------------------- dK and dV
@kernel_body
def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg: Numerics,
                 launch: Launch, nq: int):
    lengths, (dk_ref, dv_ref) = read_lengths(cfg, refs)
    pol, bq, bk, groups = cfg.policy, cfg.block_q, cfg.block_k, cfg.groups
    j = pl.program_id(0)
    k = k_ref[...].astype(pol.operand_dtype)
    v = v_ref[...].astype(pol.operand_dtype)
    d = k.shape[-1]
    # query head g of this key/value head's group: [T, D] and [T] slices (one head when G = 1)
    block_of = (lambda ref, g, rows: ref[rows, :]) if groups == 1 else \
        (lambda ref, g, rows: ref[rows, g, :])
    rows_of_ref = (lambda ref, g, rows: ref[rows]) if groups == 1 else \
        (lambda ref, g, rows: ref[g, rows])

    def rows_of(g, i):  # L and δ of query block i (clamped: the last prefetch reads a block unused)
        rows = pl.ds(jnp.clip(i, 0, nq - 1) * bq, bq)
        return rows_of_ref(lse_ref, g, rows), rows_of_ref(delta_ref, g, rows)

    def body(g, i, acc, mask):
        rows = pl.ds(i * bq, bq)
        q = block_of(q_ref, g, rows).astype(pol.operand_dtype)
        do = block_of(do_ref, g, rows).astype(pol.operand_dtype)
        if launch.prefetch_rows:  # this block's L, δ came with the carry; the next block's load now
            dk, dv, lse, dlt = acc
            nxt = rows_of(g, i + 1)
            return (*tile.backward_tile_dkdv(dk, dv, q, k, v, do, lse, dlt, mask, cfg), *nxt)
        lse, dlt = rows_of(g, i)
        return tile.backward_tile_dkdv(*acc, q, k, v, do, lse, dlt, mask, cfg)

    mask_of = lambda i: tile.tile_mask(i * bq, j * bk, bq, bk, cfg, transposed=True,
                                       lengths=lengths)
    # the query blocks that see this key tile (tile.q_block_bounds); with split_diagonal those that
    # see all of it run without mask arithmetic, in the same order
    lo, full_lo, full_hi, hi = tile.q_block_bounds(j * bk, bq, bk, nq, cfg, lengths)

    def one_head(g, dkdv):
        masked = lambda i, acc: body(g, i, acc, mask_of(i))
        acc = (*dkdv, *rows_of(g, lo)) if launch.prefetch_rows else dkdv
        if not launch.split_diagonal:
            return lax.fori_loop(lo, hi, masked, acc)[:2]
        acc = lax.fori_loop(lo, full_lo, masked, acc)
        acc = lax.fori_loop(full_lo, full_hi, lambda i, acc: body(g, i, acc, None), acc)
        return lax.fori_loop(full_hi, hi, masked, acc)[:2]

    zeros = jnp.zeros((bk, d), jnp.float32)
    # the group's heads in order, each head's blocks in order (the jnp executor's order)
    dk, dv = one_head(0, (zeros, zeros)) if groups == 1 else \
        lax.fori_loop(0, groups, one_head, (zeros, zeros))
    dk_ref[...] = (dk * cfg.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ---------------------------------------------------------------------------------------------- dQ
@kernel_body
def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg: Numerics,
               launch: Launch, nk: int):
    lengths, (dq_ref,) = read_lengths(cfg, refs)
    pol, bq, bk = cfg.policy, cfg.block_q, cfg.block_k
    i = query_block(pl.program_id(0), pl.num_programs(0), launch.heavy_first)
    q = q_ref[...].astype(pol.operand_dtype)
    do = do_ref[...].astype(pol.operand_dtype)
    lse, dlt = lse_ref[...], delta_ref[...]

    def body(j, dq, mask):
        k = k_ref[pl.ds(j * bk, bk), :].astype(pol.operand_dtype)
        v = v_ref[pl.ds(j * bk, bk), :].astype(pol.operand_dtype)
        return tile.backward_tile_dq(dq, q, k, v, do, lse, dlt, mask, cfg)

    dq = kv_loop(i, cfg, nk, body, jnp.zeros(q.shape, jnp.float32), launch.split_diagonal,
                 lengths)
    dq_ref[...] = (dq * cfg.sm_scale).astype(dq_ref.dtype)


def backward(q, k, v, do, lse, dlt, cfg: Numerics, launch: Launch, out_dtype=jnp.float32,
             lengths=None, packed=False):
    """(dQ, dK, dV) ``[B, T, H, D]`` (dK, dV with K's heads), accumulated in FP32 and rounded once
    to ``out_dtype`` as the kernels write them (writing bf16 directly saves an FP32 round trip
    through memory). ``lengths``: (q_lens, kv_lens) int32 ``[B]`` when ``cfg.seq_lengths``.
    ``packed`` (as ``forward``'s): q, k, v are one ``[B, T, 3, H, D]`` array and the result is its
    gradient, one array of that shape: the dK/dV kernel writes slots 1 and 2 and the dQ kernel
    slot 0 of the same buffer, so no concatenation follows."""
    bsz, tq, h, d = unpacked_shape(q.shape) if packed else q.shape
    tk, hk, g = (tq, h, 1) if packed else (k.shape[1], k.shape[2], cfg.groups)
    lens = tuple(lengths) if cfg.seq_lengths else ()
    nq = tq // cfg.block_q
    # dK/dV programs keep `big_k` keys, dQ programs `big_q` queries; the streamed tiles are unchanged
    big_k = resident_block(launch.bwd_block, cfg, tq, tk)
    big_q = resident_block(launch.dq_block, cfg, tq, tk) if launch.dq_block is not None else big_k
    dkdv_cfg = dataclasses.replace(cfg, block_k=big_k) if big_k else cfg
    dq_cfg = dataclasses.replace(cfg, block_q=big_q) if big_q else cfg
    bq, bk = dq_cfg.block_q, dkdv_cfg.block_k
    itemsize = q.dtype.itemsize
    if launch.dq is None and launch.dq_block is None:  # one launch for both kernels
        params = dq_params = compiler_params(launch.bwd, d, bq, bk, backward=True, itemsize=itemsize)
    else:
        params = compiler_params(launch.bwd, d, cfg.block_q, bk, backward=True, itemsize=itemsize)
        dq_params = compiler_params(launch.dq or launch.bwd, d, bq, cfg.block_k,
                                    backward=True, itemsize=itemsize)
    # the plan checked that Mosaic kernels cover the call; a packed call runs the Triton ones
    mosaic = launch.bwd_kernel in ("mosaic", "mosaic_dkdv") and not packed
    dkdv_ins = [_group_spec(tq, d, g), _block_spec(bk, d), _block_spec(bk, d)]
    qi = functools.partial(query_block, n=tq // bq, heavy_first=launch.heavy_first)
    dq_ins = [_block_spec(bq, d, qi), _full_spec(tk, d, g), _full_spec(tk, d, g)]
    if packed:
        dkdv_ins = [at_slot(spec, slot) for slot, spec in enumerate(dkdv_ins)]
        dq_ins = [at_slot(spec, slot) for slot, spec in enumerate(dq_ins)]
    dkdv_ins += [_group_spec(tq, d, g), _group_rows_spec(tq, g), _group_rows_spec(tq, g),
                 *length_specs(cfg, 1)]
    dq_ins += [_block_spec(bq, d, qi), _row_spec(bq, qi), _row_spec(bq, qi),
               *length_specs(cfg, 1)]
    dkdv_kernel = functools.partial(_dkdv_kernel, cfg=dkdv_cfg, launch=launch, nq=nq)
    dq_kernel = functools.partial(_dq_kernel, cfg=dq_cfg, launch=launch, nk=tk // cfg.block_k)
    operands = (q, k, v, do, lse, dlt, *lens)
    if packed:
        out = jax.ShapeDtypeStruct(q.shape, out_dtype)
        dqkv = pl.pallas_call(
            functools.partial(_into_slots(dkdv_kernel, (1, 2)), n_in=len(operands)),
            grid=(tk // bk, bsz, hk), in_specs=dkdv_ins, out_specs=_slots_spec(bk, d),
            out_shape=out, interpret=interpret_mode(), compiler_params=params,
            name=_name("dkdv", cfg),
        )(*operands)
        return pl.pallas_call(  # dQ into slot 0 of the same buffer
            functools.partial(_into_slots(dq_kernel, (0,)), n_in=len(operands)),
            grid=(tq // bq, bsz, h), in_specs=[*dq_ins, _slots_spec(bq, d, qi)],
            out_specs=_slots_spec(bq, d, qi), out_shape=out,
            input_output_aliases={len(operands): 0}, interpret=interpret_mode(),
            compiler_params=dq_params, name=_name("dq", cfg),
        )(*operands, dqkv)
    if mosaic:
        dk, dv = backward_mosaic.dkdv_mosaic(q, k, v, do, lse, dlt, cfg, out_dtype=out_dtype,
                                             stages=launch.mosaic_bwd_stages,
                                             regs=launch.mosaic_bwd_regs)
    else:
        dk, dv = pl.pallas_call(
            dkdv_kernel,
            grid=(tk // bk, bsz, hk),
            in_specs=dkdv_ins,
            out_specs=[_block_spec(bk, d), _block_spec(bk, d)],
            out_shape=[jax.ShapeDtypeStruct(k.shape, out_dtype),
                       jax.ShapeDtypeStruct(v.shape, out_dtype)],
            interpret=interpret_mode(),
            compiler_params=params,
            name=_name("dkdv", cfg),
        )(*operands)
    if launch.bwd_kernel == "mosaic":
        dq = backward_mosaic.dq_mosaic(q, k, v, do, lse, dlt, cfg, out_dtype=out_dtype,
                                       stages=launch.mosaic_bwd_stages,
                                       regs=launch.mosaic_bwd_regs, keys=launch.mosaic_dq_keys)
    else:
        dq = pl.pallas_call(
            dq_kernel,
            grid=(tq // bq, bsz, h),
            in_specs=dq_ins,
            out_specs=_block_spec(bq, d, qi),
            out_shape=jax.ShapeDtypeStruct(q.shape, out_dtype),
            interpret=interpret_mode(),
            compiler_params=dq_params,
            name=_name("dq", cfg),
        )(*operands)
    return dq, dk, dv
