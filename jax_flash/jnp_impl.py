"""Executor 1: the tiled algorithm in plain XLA — the fast CPU path and the oracle for the kernels.

Inputs arrive padded to whole blocks in the kernels' layout ``[B, T, H, D]``. They are viewed as
blocks ``[B, H, n, b, D]``; the per-tile functions of ``tile.py`` run under ``vmap`` over (batch, head,
block) and a ``fori_loop`` walks the other block axis in the same order as the kernels. Tiles that the
causal mask covers entirely are visited too: with every entry masked a step is an exact no-op (α = 1,
P̄ = 0), so the bits equal those of the kernels, which skip them.

Every vmapped argument carries all three batch axes (shared tiles are broadcast, not left unbatched):
vmapping a dot over an unbatched operand would merge the blocks into one larger matmul, for which
XLA:CPU may pick another GEMM strategy with another summation order — and other bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import tile
from .rounding import cast_rounded
from .spec import Numerics


def _blocks(x, b):
    """[B, T, H, D] -> [B, H, T/b, b, D]."""
    bsz, t, h, d = x.shape
    return x.reshape(bsz, t // b, b, h, d).transpose(0, 3, 1, 2, 4)


def _unblocks(x):
    """[B, H, n, b, D] -> [B, n·b, H, D]."""
    bsz, h, n, b, d = x.shape
    return x.transpose(0, 2, 3, 1, 4).reshape(bsz, n * b, h, d)


def _rows(x, b):
    """[B, H, T] -> [B, H, T/b, b]."""
    return x.reshape(*x.shape[:2], x.shape[2] // b, b)


def _over_tiles(f):
    """vmap ``f`` over three leading axes (batch, head, block) of every argument."""
    for _ in range(3):
        f = jax.vmap(f)
    return f


def _spread(x, n):
    """A tile shared by all n blocks, [B, H, ...] -> [B, H, n, ...]."""
    return jnp.broadcast_to(x[:, :, None], x.shape[:2] + (n,) + x.shape[2:])


def _starts(block, n, lead):
    """Start offsets of n blocks, broadcast to [B, H, n]."""
    return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) * block, lead + (n,))


def _inputs(q, k, v, do, cfg):
    pol = cfg.policy
    qb = _blocks(q.astype(pol.operand_dtype), cfg.block_q)
    kb = _blocks(k.astype(pol.operand_dtype), cfg.block_k)
    vb = _blocks(v.astype(pol.operand_dtype), cfg.block_k)
    dob = None if do is None else _blocks(do.astype(pol.operand_dtype), cfg.block_q)
    return qb, kb, vb, dob


def forward(q, k, v, cfg: Numerics):
    """Returns O (FP32, policy-rounded) ``[B, T, H, D]`` and L ``[B, H, T]``."""
    bq, bk = cfg.block_q, cfg.block_k
    qb, kb, vb, _ = _inputs(q, k, v, None, cfg)
    bsz, h, nq, _, d = qb.shape
    q_starts = _starts(bq, nq, (bsz, h))

    def step(carry, q_i, k_j, v_j, q_start, k_start):
        mask = tile.tile_mask(q_start, k_start, bq, bk, cfg)
        return tile.forward_tile(carry, q_i, k_j, v_j, mask, cfg)

    step = _over_tiles(step)

    def body(j, carry):
        k_start = jnp.full((bsz, h, nq), j * bk, jnp.int32)
        return step(carry, qb, _spread(kb[:, :, j], nq), _spread(vb[:, :, j], nq), q_starts, k_start)

    init = jax.tree.map(lambda c: jnp.broadcast_to(c, (bsz, h, nq) + c.shape), tile.init_carry(bq, d, cfg))
    carry = lax.fori_loop(0, kb.shape[2], body, init)
    o, lse = _over_tiles(lambda c: tile.finish(c, cfg))(carry)
    return _unblocks(o), lse.reshape(bsz, h, nq * bq)


def delta(q, k, v, o, do, lse, cfg: Numerics):
    """δ ``[B, H, T]`` for the configured δ mode."""
    if cfg.delta == "o":
        return tile.delta_from_o(o, do).transpose(0, 2, 1)
    bq, bk = cfg.block_q, cfg.block_k
    qb, kb, vb, dob = _inputs(q, k, v, do, cfg)
    lb = _rows(lse, bq)
    bsz, h, nq, _, d = qb.shape
    q_starts = _starts(bq, nq, (bsz, h))

    def step(acc, q_i, do_i, l_i, k_j, v_j, q_start, k_start):
        mask = tile.tile_mask(q_start, k_start, bq, bk, cfg)
        return tile.delta_tile(acc, q_i, k_j, v_j, do_i, l_i, mask, cfg)

    step = _over_tiles(step)

    def body(j, acc):
        k_start = jnp.full((bsz, h, nq), j * bk, jnp.int32)
        return step(acc, qb, dob, lb, _spread(kb[:, :, j], nq), _spread(vb[:, :, j], nq), q_starts,
                    k_start)

    zeros = jnp.zeros((bsz, h, nq, bq), jnp.float32)
    acc = (zeros,) if cfg.delta == "dpp" else (jnp.zeros((bsz, h, nq, bq, d), jnp.float32), zeros)
    acc = lax.fori_loop(0, kb.shape[2], body, acc)
    out = _over_tiles(lambda a, do_i: tile.delta_finish(a, do_i, cfg))(acc, dob)
    return out.reshape(bsz, h, nq * bq)


def backward(q, k, v, do, lse, dlt, cfg: Numerics, out_dtype=jnp.float32):
    """(dQ, dK, dV) ``[B, T, H, D]``, accumulated in FP32 and rounded once to ``out_dtype``; the
    sm_scale is applied here."""
    bq, bk = cfg.block_q, cfg.block_k
    qb, kb, vb, dob = _inputs(q, k, v, do, cfg)
    lb, db = _rows(lse, bq), _rows(dlt, bq)
    bsz, h, nq, _, d = qb.shape
    nk = kb.shape[2]
    q_starts, k_starts = _starts(bq, nq, (bsz, h)), _starts(bk, nk, (bsz, h))

    # dK, dV: vmap over key tiles, loop over query blocks (as the dK/dV kernel does).
    def kv_step(acc, k_j, v_j, k_start, q_i, do_i, l_i, d_i, q_start):
        mask = tile.tile_mask(q_start, k_start, bq, bk, cfg, transposed=True)
        return tile.backward_tile_dkdv(*acc, q_i, k_j, v_j, do_i, l_i, d_i, mask, cfg)

    kv_step = _over_tiles(kv_step)

    def kv_body(i, acc):
        shared = [_spread(x[:, :, i], nk) for x in (qb, dob, lb, db)]
        q_start = jnp.full((bsz, h, nk), i * bq, jnp.int32)
        return kv_step(acc, kb, vb, k_starts, *shared, q_start)

    zeros_k = jnp.zeros((bsz, h, nk, bk, d), jnp.float32)
    dk, dv = lax.fori_loop(0, nq, kv_body, (zeros_k, zeros_k))

    # dQ: vmap over query blocks, loop over key tiles (as the dQ kernel does).
    def q_step(acc, q_i, do_i, l_i, d_i, q_start, k_j, v_j, k_start):
        mask = tile.tile_mask(q_start, k_start, bq, bk, cfg)
        return tile.backward_tile_dq(acc, q_i, k_j, v_j, do_i, l_i, d_i, mask, cfg)

    q_step = _over_tiles(q_step)

    def q_body(j, acc):
        k_start = jnp.full((bsz, h, nq), j * bk, jnp.int32)
        return q_step(acc, qb, dob, lb, db, q_starts, _spread(kb[:, :, j], nq),
                      _spread(vb[:, :, j], nq), k_start)

    dq = lax.fori_loop(0, nk, q_body, jnp.zeros((bsz, h, nq, bq, d), jnp.float32))
    scale = cfg.sm_scale
    return tuple(cast_rounded(g * s, out_dtype)  # rounded as the kernels write them, XLA or not
                 for g, s in ((_unblocks(dq), scale), (_unblocks(dk), scale), (_unblocks(dv), 1.0)))
