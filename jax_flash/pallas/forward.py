"""Executor 2, forward: a Pallas kernel whose body is ``tile.forward_tile`` in a loop over key tiles.

Grid (query block, batch, head); each program keeps (m, ℓ, acc) for one query block and walks the key
tiles in order, from the first to the last one with a visible key (``tile.kv_tile_bounds``: the
causal diagonal, a window and per-batch lengths bound the loop; fully masked tiles are skipped). Triton backend on
GPU, interpret mode on CPU. Inputs arrive padded to whole blocks in the layout ``[B, T, H, D]``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .. import tile
from ..spec import Launch, Numerics
from . import forward_mosaic, mosaic_common
from .common import compiler_params, interpret_mode, kernel_body


def _num_kv_tiles(i, cfg: Numerics, nk: int):
    """Key tiles query block i visits without a window or lengths (the causal diagonal ends the
    loop early): ``tile.kv_tile_bounds``' hi."""
    return tile.kv_tile_bounds(i * cfg.block_q, cfg.block_q, cfg.block_k, nk, cfg)[3]


def _num_full_kv_tiles(i, cfg: Numerics, nk: int):
    """Leading key tiles that need no mask for query block i (no window or lengths): inside kv_len
    and, when causal, entirely at or below the block's first row: ``tile.kv_tile_bounds``'
    full_hi."""
    return tile.kv_tile_bounds(i * cfg.block_q, cfg.block_q, cfg.block_k, nk, cfg)[2]


def kv_loop(i, cfg: Numerics, nk: int, body, init, split_diagonal: bool = False, lengths=None):
    """``fori_loop`` of ``body(j, carry, mask)`` over the key tiles query block i visits, in order
    (``tile.kv_tile_bounds``: tiles outside the causal diagonal, the window or the lengths are
    skipped); ``mask`` is the tile's mask, or None for the tiles that need none when
    ``split_diagonal``. ``lengths``: this batch element's (q_len, kv_len), or None."""
    bq, bk = cfg.block_q, cfg.block_k
    masked = lambda j, c: body(j, c, tile.tile_mask(i * bq, j * bk, bq, bk, cfg, lengths=lengths))
    lo, full_lo, full_hi, hi = tile.kv_tile_bounds(i * bq, bq, bk, nk, cfg, lengths)
    if not split_diagonal:
        return lax.fori_loop(lo, hi, masked, init)
    # only a window's left edge has masked tiles before the unmasked ones: no loop for it otherwise
    carry = lax.fori_loop(lo, full_lo, masked, init) if cfg.window is not None else init
    carry = lax.fori_loop(full_lo, full_hi, lambda j, c: body(j, c, None), carry)
    return lax.fori_loop(full_hi, hi, masked, carry)


def kv_head(hh, groups: int):
    """The key/value head of query head ``hh`` (an index map's grid index)."""
    return hh if groups == 1 else hh // groups


def at_slot(spec: pl.BlockSpec, slot: int) -> pl.BlockSpec:
    """``spec`` of a ``[B, T, H, D]`` operand, for that operand as slot ``slot`` of a packed
    ``[B, T, 3, H, D]`` array (Q, K, V side by side): the same block, the slot's index inserted."""
    bs, index = tuple(spec.block_shape), spec.index_map
    return pl.BlockSpec((*bs[:2], None, *bs[2:]),
                        lambda *g: (*index(*g)[:2], slot, *index(*g)[2:]))


def unpacked_shape(qkv_shape):
    """``[B, T, H, D]`` of one slot of a packed ``[B, T, 3, H, D]`` shape."""
    b, t, _, h, d = qkv_shape
    return (b, t, h, d)


def read_lengths(cfg: Numerics, refs):
    """(q_len, kv_len) of this program's batch element from its two length refs (``seq_lengths``),
    and the refs that follow them; None and ``refs`` otherwise."""
    if not cfg.seq_lengths:
        return None, refs
    return (refs[0][...], refs[1][...]), refs[2:]


def length_specs(cfg: Numerics, batch_axis: int):
    """BlockSpecs of the per-batch q and kv lengths (int32 ``[B]``): one scalar per program, from the
    grid axis ``batch_axis``."""
    if not cfg.seq_lengths:
        return []
    spec = pl.BlockSpec((None,), lambda *idx: (idx[batch_axis],))
    return [spec, spec]


@kernel_body
def _forward_kernel(q_ref, k_ref, v_ref, *refs, cfg: Numerics, launch: Launch, nk: int):
    lengths, (o_ref, lse_ref) = read_lengths(cfg, refs)
    pol, bq, bk = cfg.policy, cfg.block_q, cfg.block_k
    i = pl.program_id(0)
    q = q_ref[...].astype(pol.operand_dtype)
    d = q.shape[-1]

    load = lambda ref, j: ref[pl.ds(j * bk, bk), :].astype(pol.operand_dtype)

    def body(j, carry, mask):
        return tile.forward_tile(carry, q, load(k_ref, j), load(v_ref, j), mask, cfg)

    lo, _, _, hi = tile.kv_tile_bounds(i * bq, bq, bk, nk, cfg, lengths)

    def body_prefetch(j, carry, mask):
        # tile j's scores came with the carry; tile j + 1's are computed first (the last tile
        # recomputes its own, unused), so their MMA can overlap tile j's softmax
        state, s = carry
        s_next = tile.forward_scores(q, load(k_ref, jnp.minimum(j + 1, hi - 1)), cfg)
        return tile.forward_tile_from_scores(state, s, load(v_ref, j), mask, cfg), s_next

    split = launch.split_diagonal
    if launch.prefetch_scores:
        first = jnp.minimum(lo, nk - 1)  # (read even when the block visits no tile; unused then)
        init = (tile.init_carry(bq, d, cfg), tile.forward_scores(q, load(k_ref, first), cfg))
        carry = kv_loop(i, cfg, nk, body_prefetch, init, split, lengths)[0]
    else:
        carry = kv_loop(i, cfg, nk, body, tile.init_carry(bq, d, cfg), split, lengths)
    o, lse = tile.finish(carry, cfg)
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = lse


def forward(q, k, v, cfg: Numerics, launch: Launch, *, o_dtype, lengths=None, packed=False):
    """Returns O ``[B, Tq, H, D]`` in ``o_dtype`` and L ``[B, H, Tq]`` (FP32). K and V have
    ``H / cfg.groups`` heads; ``lengths``: (q_lens, kv_lens) int32 ``[B]`` when ``cfg.seq_lengths``.
    ``packed``: q, k and v are one ``[B, T, 3, H, D]`` array (``groups`` 1, Triton kernel), read
    in place."""
    if launch.fwd_kernel == "mosaic" and not packed:  # the plan checked that it covers this call
        programs = mosaic_common.sm_count() if launch.mosaic_fwd_persistent else None
        return forward_mosaic.forward_mosaic(q, k, v, cfg, o_dtype=o_dtype,
                                             stages=launch.mosaic_fwd_stages, programs=programs)
    bsz, tq, h, d = unpacked_shape(q.shape) if packed else q.shape
    tk = k.shape[1]
    bq, bk, g = cfg.block_q, cfg.block_k, cfg.groups
    nq, nk = tq // bq, tk // bk
    kernel = functools.partial(_forward_kernel, cfg=cfg, launch=launch, nk=nk)
    # grid (query block, batch, head): the query block varies fastest, so the programs in flight
    # mostly read one (batch, head)'s K and V, which then stay in L2 (as in JAX's Pallas mha); a
    # group's query heads read their key/value head's K and V (head // groups), never a copy
    q_spec = pl.BlockSpec((None, bq, None, d), lambda i, b, hh: (b, i, hh, 0))
    kv_spec = pl.BlockSpec((None, tk, None, d), lambda i, b, hh: (b, 0, kv_head(hh, g), 0))
    in_specs = [q_spec, kv_spec, kv_spec]
    if packed:
        in_specs = [at_slot(spec, slot) for slot, spec in enumerate(in_specs)]
    return pl.pallas_call(
        kernel,
        grid=(nq, bsz, h),
        in_specs=[*in_specs, *length_specs(cfg, 1)],
        out_specs=[q_spec, pl.BlockSpec((None, None, bq), lambda i, b, hh: (b, hh, i))],
        out_shape=[jax.ShapeDtypeStruct((bsz, tq, h, d), o_dtype),
                   jax.ShapeDtypeStruct((bsz, h, tq), jnp.float32)],
        interpret=interpret_mode(),
        compiler_params=compiler_params(launch.fwd, d, bq, bk, itemsize=q.dtype.itemsize),
        name=f"jax_flash_fwd_{cfg.policy.name}{'_stable' if cfg.stable else ''}",
    )(q, k, v, *(lengths if cfg.seq_lengths else ()))
