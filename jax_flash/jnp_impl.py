"""Executor 1: the tiled algorithm in plain XLA — the fast CPU path and the oracle for the kernels.

Inputs arrive padded to whole blocks in the kernels' layout ``[B, T, H, D]`` (K and V with
``H / Numerics.groups`` heads). They are viewed as blocks: queries ``[B, Hkv, G·nq, bq, D]`` (the G
query heads of a key/value head and their query blocks along one axis, head-major), keys and values
``[B, Hkv, nk, bk, D]``. The per-tile functions of ``tile.py`` run under ``vmap`` over (batch,
key/value head, block) and a ``fori_loop`` walks the other block axis in the same order as the
kernels. Key/value tiles are broadcast to the query blocks of their group, never repeated in memory.
Tiles that the masks cover entirely are visited too, and rows (keys, in the dK/dV pass) that see
nothing in a tile keep their state, which is what the kernels compute by skipping such tiles: the
same bits for finite inputs, and a non-finite value stays out of rows that never see it.

Every vmapped argument carries all three batch axes (shared tiles are broadcast, not left unbatched):
vmapping a dot over an unbatched operand would merge the blocks into one larger matmul, for which
XLA:CPU may pick another GEMM strategy with another summation order — and other bits.

Extras (``Extras``): per-batch lengths, and the dense mask and bias this executor alone takes,
broadcast to ``[B, H, T, S]`` (padded) — the size of the logits an XLA attention forms anyway.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from . import tile
from .rounding import cast_rounded
from .spec import Numerics


class Extras(NamedTuple):
    """A call's array arguments beyond q, k, v (each None when absent). ``q_lens``, ``kv_lens``:
    int32 ``[B]``, clipped to [0, T] and [0, S]; ``mask``: bool and ``bias``: float, both
    broadcastable to ``[B, H, T, S]`` (the jnp executor only)."""

    q_lens: jax.Array | None = None
    kv_lens: jax.Array | None = None
    mask: jax.Array | None = None
    bias: jax.Array | None = None


def _blocks(x, b, groups=1):
    """[B, T, H, D] -> [B, H/G, G·T/b, b, D] (head h = kv·G + g; block axis (g, i), g-major)."""
    bsz, t, h, d = x.shape
    x = x.reshape(bsz, t // b, b, h, d).transpose(0, 3, 1, 2, 4)
    return x.reshape(bsz, h // groups, groups * (t // b), b, d)


def _unblocks(x, groups=1):
    """[B, H/G, G·n, b, D] -> [B, n·b, H, D]."""
    bsz, hk, gn, b, d = x.shape
    n = gn // groups
    x = x.reshape(bsz, hk * groups, n, b, d)
    return x.transpose(0, 2, 3, 1, 4).reshape(bsz, n * b, hk * groups, d)


def _rows(x, b, groups=1):
    """[B, H, T] -> [B, H/G, G·T/b, b]."""
    bsz, h, t = x.shape
    return x.reshape(bsz, h // groups, groups * (t // b), b)


def _unrows(x, groups=1):
    """[B, H/G, G·n, b] -> [B, H, n·b]."""
    bsz, hk, gn, b = x.shape
    return x.reshape(bsz, hk * groups, (gn // groups) * b)


def _over_tiles(f):
    """vmap ``f`` over three leading axes (batch, head, block) of every argument."""
    for _ in range(3):
        f = jax.vmap(f)
    return f


def _spread(x, n):
    """A tile shared by all n blocks, [B, H, ...] -> [B, H, n, ...]."""
    return jnp.broadcast_to(x[:, :, None], x.shape[:2] + (n,) + x.shape[2:])


def _starts(block, n, lead, groups=1):
    """Start offsets of the blocks along a block axis of ``groups`` runs of n, broadcast to
    [B, H, groups·n]."""
    starts = jnp.tile(jnp.arange(n, dtype=jnp.int32) * block, groups)
    return jnp.broadcast_to(starts, lead + (groups * n,))


def _per_batch(x, shape):
    """[B] lengths broadcast to ``shape`` (batch first)."""
    return jnp.broadcast_to(x.reshape((-1,) + (1,) * (len(shape) - 1)), shape)


def _inputs(q, k, v, do, cfg):
    pol, g = cfg.policy, cfg.groups
    qb = _blocks(q.astype(pol.operand_dtype), cfg.block_q, g)
    kb = _blocks(k.astype(pol.operand_dtype), cfg.block_k)
    vb = _blocks(v.astype(pol.operand_dtype), cfg.block_k)
    dob = None if do is None else _blocks(do.astype(pol.operand_dtype), cfg.block_q, g)
    return qb, kb, vb, dob


def _dense(x, shape, fill):
    """A mask or bias broadcastable to [B, H, T, S] -> [B, H/G, G·nq, bq, nk, bk] at the padded
    lengths of ``shape`` = (B, H, Tp, Sp, G, bq, bk); padding takes ``fill``."""
    bsz, h, tp, sp, g, bq, bk = shape
    t, s = x.shape[2], x.shape[3]
    pad_t = tp - t if t > 1 else 0
    pad_s = sp - s if s > 1 else 0
    if pad_t or pad_s:
        x = jnp.pad(x, ((0, 0), (0, 0), (0, pad_t), (0, pad_s)), constant_values=fill)
    x = jnp.broadcast_to(x, (bsz, h, tp, sp))
    return x.reshape(bsz, h // g, g * (tp // bq), bq, sp // bk, bk)


def _extras(ex: Extras | None, cfg: Numerics, bsz, h, tp, sp):
    """(lengths, mask blocks, bias blocks): lengths as [B] pairs or None; mask, bias as ``_dense``."""
    if ex is None:
        return None, None, None
    shape = (bsz, h, tp, sp, cfg.groups, cfg.block_q, cfg.block_k)
    lengths = (ex.q_lens, ex.kv_lens) if cfg.seq_lengths else None
    mask = _dense(ex.mask, shape, False) if cfg.mask else None
    bias = _dense(ex.bias.astype(jnp.float32), shape, 0.0) if cfg.bias else None
    return lengths, mask, bias


def _seen_only(new, old, mask):
    """Rows of a tile that see no key (or, transposed, keys no query sees) keep their state. With
    every entry masked a step adds exact zeros — but 0·∞ is NaN, so a non-finite value in a masked
    tile would reach rows that never see it; the kernels skip such tiles."""
    seen = jnp.any(mask, axis=1)
    keep = lambda n, o: jnp.where(seen.reshape(seen.shape + (1,) * (n.ndim - 1)), n, o)
    return jax.tree.map(keep, new, old)


def _step_mask(cfg, bq, bk, q_start, k_start, lens, dense, transposed=False):
    mask = tile.tile_mask(q_start, k_start, bq, bk, cfg, transposed=transposed, lengths=lens)
    return mask if dense is None else mask & dense


def _kv_column(x, j, nq_all):
    """Column j of key tiles of a ``_dense`` array, [B, Hk, G·nq, bq, bk] (None stays None)."""
    return None if x is None else x[:, :, :, :, j]


def _q_row(x, t, nk):
    """Query block t of a ``_dense`` array, transposed per key tile: [B, Hk, nk, bk, bq]."""
    return None if x is None else x[:, :, t].transpose(0, 1, 3, 4, 2)


def forward(q, k, v, cfg: Numerics, ex: Extras | None = None):
    """Returns O (FP32, policy-rounded) ``[B, T, H, D]`` and L ``[B, H, T]``."""
    bq, bk, g = cfg.block_q, cfg.block_k, cfg.groups
    qb, kb, vb, _ = _inputs(q, k, v, None, cfg)
    bsz, hk, nqg, _, d = qb.shape
    lengths, mask, bias = _extras(ex, cfg, bsz, hk * g, q.shape[1], k.shape[1])
    lead = (bsz, hk, nqg)
    q_starts = _starts(bq, nqg // g, (bsz, hk), g)
    lens = None if lengths is None else tuple(_per_batch(x, lead) for x in lengths)

    def step(carry, q_i, k_j, v_j, q_start, k_start, lens, m, b):
        mask = _step_mask(cfg, bq, bk, q_start, k_start, lens, m)
        return _seen_only(tile.forward_tile(carry, q_i, k_j, v_j, mask, cfg, bias=b), carry, mask)

    step = _over_tiles(step)

    def body(j, carry):
        k_start = jnp.full(lead, j * bk, jnp.int32)
        return step(carry, qb, _spread(kb[:, :, j], nqg), _spread(vb[:, :, j], nqg), q_starts,
                    k_start, lens, _kv_column(mask, j, nqg), _kv_column(bias, j, nqg))

    init = jax.tree.map(lambda c: jnp.broadcast_to(c, lead + c.shape), tile.init_carry(bq, d, cfg))
    carry = lax.fori_loop(0, kb.shape[2], body, init)
    o, lse = _over_tiles(lambda c: tile.finish(c, cfg))(carry)
    return _unblocks(o, g), _unrows(lse, g)


def delta(q, k, v, o, do, lse, cfg: Numerics, ex: Extras | None = None):
    """δ ``[B, H, T]`` for the configured δ mode."""
    if cfg.delta == "o":
        return tile.delta_from_o(o, do).transpose(0, 2, 1)
    bq, bk, g = cfg.block_q, cfg.block_k, cfg.groups
    qb, kb, vb, dob = _inputs(q, k, v, do, cfg)
    lb = _rows(lse, bq, g)
    bsz, hk, nqg, _, d = qb.shape
    lengths, mask, bias = _extras(ex, cfg, bsz, hk * g, q.shape[1], k.shape[1])
    lead = (bsz, hk, nqg)
    q_starts = _starts(bq, nqg // g, (bsz, hk), g)
    lens = None if lengths is None else tuple(_per_batch(x, lead) for x in lengths)

    def step(acc, q_i, do_i, l_i, k_j, v_j, q_start, k_start, lens, m, b):
        mask = _step_mask(cfg, bq, bk, q_start, k_start, lens, m)
        return _seen_only(tile.delta_tile(acc, q_i, k_j, v_j, do_i, l_i, mask, cfg, bias=b), acc,
                          mask)

    step = _over_tiles(step)

    def body(j, acc):
        k_start = jnp.full(lead, j * bk, jnp.int32)
        return step(acc, qb, dob, lb, _spread(kb[:, :, j], nqg), _spread(vb[:, :, j], nqg), q_starts,
                    k_start, lens, _kv_column(mask, j, nqg), _kv_column(bias, j, nqg))

    zeros = jnp.zeros(lead + (bq,), jnp.float32)
    acc = (zeros,) if cfg.delta == "dpp" else (jnp.zeros(lead + (bq, d), jnp.float32), zeros)
    acc = lax.fori_loop(0, kb.shape[2], body, acc)
    out = _over_tiles(lambda a, do_i: tile.delta_finish(a, do_i, cfg))(acc, dob)
    return _unrows(out, g)


def backward(q, k, v, do, lse, dlt, cfg: Numerics, out_dtype=jnp.float32,
             ex: Extras | None = None):
    """(dQ, dK, dV): dQ ``[B, T, H, D]``, dK and dV ``[B, S, H/G, D]``, accumulated in FP32 and
    rounded once to ``out_dtype``; the sm_scale is applied here."""
    return backward_with_ds(q, k, v, do, lse, dlt, cfg, out_dtype, ex)[:3]


def backward_with_ds(q, k, v, do, lse, dlt, cfg: Numerics, out_dtype=jnp.float32,
                     ex: Extras | None = None):
    """``backward``'s (dQ, dK, dV) and dS ``[B, H, T, S]`` FP32 — the gradient of the logits, for a
    bias — where ``Numerics.bias``, else None."""
    bq, bk, g = cfg.block_q, cfg.block_k, cfg.groups
    qb, kb, vb, dob = _inputs(q, k, v, do, cfg)
    lb, db = _rows(lse, bq, g), _rows(dlt, bq, g)
    bsz, hk, nqg, _, d = qb.shape
    nk = kb.shape[2]
    lengths, mask, bias = _extras(ex, cfg, bsz, hk * g, q.shape[1], k.shape[1])
    q_lead, k_lead = (bsz, hk, nqg), (bsz, hk, nk)
    q_starts, k_starts = _starts(bq, nqg // g, (bsz, hk), g), _starts(bk, nk, (bsz, hk))
    nq = nqg // g

    # dK, dV: vmap over key tiles, loop over the group's heads and their query blocks, head-major
    # (as the dK/dV kernel does).
    k_lens = None if lengths is None else tuple(_per_batch(x, k_lead) for x in lengths)

    def kv_step(acc, k_j, v_j, k_start, lens, q_i, do_i, l_i, d_i, q_start, m, b):
        mask = _step_mask(cfg, bq, bk, q_start, k_start, lens, m, transposed=True)
        new = tile.backward_tile_dkdv(*acc, q_i, k_j, v_j, do_i, l_i, d_i, mask, cfg, bias_t=b)
        return _seen_only(new, acc, mask)

    kv_step = _over_tiles(kv_step)

    def kv_body(t, acc):
        shared = [_spread(x[:, :, t], nk) for x in (qb, dob, lb, db)]
        q_start = jnp.full(k_lead, (t % nq) * bq, jnp.int32)
        return kv_step(acc, kb, vb, k_starts, k_lens, *shared, q_start, _q_row(mask, t, nk),
                       _q_row(bias, t, nk))

    zeros_k = jnp.zeros((bsz, hk, nk, bk, d), jnp.float32)
    dk, dv = lax.fori_loop(0, nqg, kv_body, (zeros_k, zeros_k))

    # dQ: vmap over query blocks, loop over key tiles (as the dQ kernel does).
    q_lens = None if lengths is None else tuple(_per_batch(x, q_lead) for x in lengths)

    def q_step(acc, q_i, do_i, l_i, d_i, q_start, lens, k_j, v_j, k_start, m, b):
        mask = _step_mask(cfg, bq, bk, q_start, k_start, lens, m)
        out = tile.backward_tile_dq(acc, q_i, k_j, v_j, do_i, l_i, d_i, mask, cfg, bias=b,
                                    with_ds=cfg.bias)
        return (_seen_only(out[0], acc, mask), out[1]) if cfg.bias else _seen_only(out, acc, mask)

    q_step = _over_tiles(q_step)

    def q_args(j):
        k_start = jnp.full(q_lead, j * bk, jnp.int32)
        return (qb, dob, lb, db, q_starts, q_lens, _spread(kb[:, :, j], nqg),
                _spread(vb[:, :, j], nqg), k_start, _kv_column(mask, j, nqg),
                _kv_column(bias, j, nqg))

    zeros_q = jnp.zeros((bsz, hk, nqg, bq, d), jnp.float32)
    ds = None
    if cfg.bias:  # the logits' gradient, tile by tile: [nk, B, Hk, G·nq, bq, bk]
        dq, ds = lax.scan(lambda acc, j: q_step(acc, *q_args(j)), zeros_q, jnp.arange(nk))
        ds = ds.transpose(1, 2, 3, 4, 0, 5).reshape(bsz, hk * g, nq * bq, nk * bk)
    else:
        dq = lax.fori_loop(0, nk, lambda j, acc: q_step(acc, *q_args(j)), zeros_q)
    scale = cfg.sm_scale
    grads = tuple(cast_rounded(x * s, out_dtype)  # rounded as the kernels write them, XLA or not
                  for x, s in ((_unblocks(dq, g), scale), (_unblocks(dk), scale),
                               (_unblocks(dv), 1.0)))
    return grads + (ds,)
