"""Executor 2, forward: a Pallas kernel whose body is ``tile.forward_tile`` in a loop over key tiles.

Grid (query block, batch, head); each program keeps (m, ℓ, acc) for one query block and walks the key
tiles in order, stopping at the causal diagonal (fully masked tiles are skipped). Triton backend on
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
from . import forward_mosaic
from .common import compiler_params, interpret_mode, kernel_body


def _num_kv_tiles(i, cfg: Numerics, nk: int):
    """Key tiles that query block i must visit (the causal diagonal ends the loop early)."""
    if not cfg.causal:
        return nk
    return jnp.minimum(nk, pl.cdiv((i + 1) * cfg.block_q, cfg.block_k))


def _num_full_kv_tiles(i, cfg: Numerics, nk: int):
    """Leading key tiles that need no mask for query block i: inside kv_len and, when causal,
    entirely at or below the block's first row (``Launch.split_diagonal`` runs them without mask
    arithmetic)."""
    full = cfg.kv_len // cfg.block_k
    if cfg.causal:
        full = jnp.minimum(full, (i * cfg.block_q + 1) // cfg.block_k)
    return jnp.minimum(full, nk)


def kv_loop(i, cfg: Numerics, nk: int, body, init, split_diagonal: bool = False):
    """``fori_loop`` of ``body(j, carry, mask)`` over the key tiles query block i visits, in order;
    ``mask`` is the tile's mask, or None for the tiles that need none when ``split_diagonal``."""
    bq, bk = cfg.block_q, cfg.block_k
    masked = lambda j, c: body(j, c, tile.tile_mask(i * bq, j * bk, bq, bk, cfg))
    n = _num_kv_tiles(i, cfg, nk)
    if not split_diagonal:
        return lax.fori_loop(0, n, masked, init)
    n_full = _num_full_kv_tiles(i, cfg, nk)
    carry = lax.fori_loop(0, n_full, lambda j, c: body(j, c, None), init)
    return lax.fori_loop(n_full, n, masked, carry)


@kernel_body
def _forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, cfg: Numerics, launch: Launch, nk: int):
    pol, bq, bk = cfg.policy, cfg.block_q, cfg.block_k
    i = pl.program_id(0)
    q = q_ref[...].astype(pol.operand_dtype)
    d = q.shape[-1]

    load = lambda ref, j: ref[pl.ds(j * bk, bk), :].astype(pol.operand_dtype)

    def body(j, carry, mask):
        return tile.forward_tile(carry, q, load(k_ref, j), load(v_ref, j), mask, cfg)

    def body_prefetch(j, carry, mask):
        # tile j's scores came with the carry; tile j + 1's are computed first (the last tile
        # recomputes its own, unused), so their MMA can overlap tile j's softmax
        state, s = carry
        s_next = tile.forward_scores(q, load(k_ref, jnp.minimum(j + 1, n - 1)), cfg)
        return tile.forward_tile_from_scores(state, s, load(v_ref, j), mask, cfg), s_next

    split = launch.split_diagonal
    if launch.prefetch_scores:
        n = _num_kv_tiles(i, cfg, nk)
        init = (tile.init_carry(bq, d, cfg), tile.forward_scores(q, load(k_ref, 0), cfg))
        carry = kv_loop(i, cfg, nk, body_prefetch, init, split)[0]
    else:
        carry = kv_loop(i, cfg, nk, body, tile.init_carry(bq, d, cfg), split)
    o, lse = tile.finish(carry, cfg)
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = lse


def forward(q, k, v, cfg: Numerics, launch: Launch, *, o_dtype):
    """Returns O ``[B, Tq, H, D]`` in ``o_dtype`` and L ``[B, H, Tq]`` (FP32)."""
    if launch.fwd_kernel == "mosaic":  # the plan checked that it covers this call
        return forward_mosaic.forward_mosaic(q, k, v, cfg, o_dtype=o_dtype)
    bsz, tq, h, d = q.shape
    tk = k.shape[1]
    bq, bk = cfg.block_q, cfg.block_k
    nq, nk = tq // bq, tk // bk
    kernel = functools.partial(_forward_kernel, cfg=cfg, launch=launch, nk=nk)
    # grid (query block, batch, head): the query block varies fastest, so the programs in flight
    # mostly read one (batch, head)'s K and V, which then stay in L2 (as in JAX's Pallas mha)
    q_spec = pl.BlockSpec((None, bq, None, d), lambda i, b, hh: (b, i, hh, 0))
    kv_spec = pl.BlockSpec((None, tk, None, d), lambda i, b, hh: (b, 0, hh, 0))
    return pl.pallas_call(
        kernel,
        grid=(nq, bsz, h),
        in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=[q_spec, pl.BlockSpec((None, None, bq), lambda i, b, hh: (b, hh, i))],
        out_shape=[jax.ShapeDtypeStruct((bsz, tq, h, d), o_dtype),
                   jax.ShapeDtypeStruct((bsz, h, tq), jnp.float32)],
        interpret=interpret_mode(),
        compiler_params=compiler_params(launch.fwd, d, bq, bk, itemsize=q.dtype.itemsize),
        name=f"jax_flash_fwd_{cfg.policy.name}{'_stable' if cfg.stable else ''}",
    )(q, k, v)
