"""Pieces shared by the Mosaic GPU kernels (forward_mosaic.py, backward_mosaic.py).

Imports of ``jax.experimental.pallas.mosaic_gpu`` stay inside functions: the package must import on
any JAX it supports (0.10.2 on CPU); the kernels are written against jax 0.11.2's ``plgpu``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .. import tile

TESTED_JAX = "0.11."  # the plgpu API the kernels are written against (GPU tests: jax 0.11.2)


def plgpu():
    from jax.experimental.pallas import mosaic_gpu

    return mosaic_gpu


def swizzled():
    """The shared-memory transforms of every 16-bit operand tile of the Mosaic kernels: a
    128-byte swizzle, one 64-element bf16 row of a tile per swizzle period, as wgmma reads it."""
    gpu = plgpu()
    return gpu.TilingTransform((8, 64)), gpu.SwizzleTransform(128)


def unavailable() -> str | None:
    """Why the Mosaic GPU kernels cannot run on this machine (None: they can): they are written
    against jax 0.11's ``plgpu`` API and compiled for Hopper only."""
    if jax.default_backend() != "gpu":
        return "no GPU (Mosaic GPU compiles for Hopper)"
    if not jax.__version__.startswith(TESTED_JAX):
        return f"jax {jax.__version__} (the Mosaic GPU kernels are tested on {TESTED_JAX}x)"
    cc = str(getattr(jax.devices()[0], "compute_capability", ""))
    if not cc.startswith("9."):
        return f"compute capability {cc or '?'} (Hopper, 9.x, only)"
    return None


# Shared memory a Hopper thread block may use (227 KiB of the SM's 228)
SMEM_LIMIT = 227 * 1024


# Mosaic GPU puts each shared-memory buffer on a 1 KiB boundary (what a 128-byte swizzle needs) and
# gives each barrier 8 bytes; the lowering may add scratch of its own: 2 KiB in the forward as
# compiled by jax 0.11.2 (its reported totals: 233,704 bytes for the dK/dV kernel's ring of 5,
# 232,568 for the forward's ring of 3 at head_dim 128 with 128-key tiles, when the forward still
# staged L in a buffer of its own).
SMEM_ALIGN = 1024
BARRIER_BYTES = 8
LOWERING_RESERVE = 2048


def smem_bytes(scratch) -> int:
    """Shared memory a kernel's compiled scratch (``plgpu.SMEM`` buffers, ``plgpu.Barrier`` arrays)
    takes as Mosaic GPU lays it out, with the lowering's reserve: the number its limit is checked on."""
    total = LOWERING_RESERVE
    for s in scratch:
        if hasattr(s, "num_barriers"):
            n = s.num_barriers
            total += BARRIER_BYTES * math.prod(n if isinstance(n, tuple) else (n,))
        else:
            size = math.prod(s.shape) * jnp.dtype(s.dtype).itemsize
            total += -(-size // SMEM_ALIGN) * SMEM_ALIGN
    return total


def ring_stages(make_scratch: Callable[[int], tuple], asked: int | None, default: int, steps: int,
                kernel: str, least: int = 1) -> int:
    """The depth of a kernel's shared-memory ring: ``asked`` (a launch's) or ``default``, at most
    ``steps`` (the tiles a program streams). ``make_scratch(stages)``: the kernel's compiled scratch
    at that depth; a ring that does not fit raises, naming the deepest that would."""
    stages = min(asked or default, steps)
    if stages < least:
        raise ValueError(f"the Mosaic GPU {kernel} kernel needs ≥ {least} stages, got {stages}")
    need = smem_bytes(make_scratch(stages))
    if need > SMEM_LIMIT:
        most = max((n for n in range(least, stages) if smem_bytes(make_scratch(n)) <= SMEM_LIMIT),
                   default=None)
        raise ValueError(f"the Mosaic GPU {kernel} kernel: {stages} stages need {need:,} bytes of "
                         f"shared memory, more than {SMEM_LIMIT:,} ({SMEM_LIMIT // 1024} KiB); "
                         + (f"at most {most} fit this shape" if most else "no depth fits this shape"))
    return stages


def exp2_backend(interpret) -> str:
    """``tile.exp2_backend`` of a Mosaic GPU kernel body: compiled with ``approx_math``, its exp2 is
    already ``ex2.approx.ftz.f32``; interpreted, XLA's."""
    return "mosaic" if interpret is None else "xla"


def interpret_params():
    """``plgpu.InterpretGPUParams(detect_races=True)`` where this JAX has the Mosaic GPU interpreter
    (jax ≥ 0.11), else None: how the tests run the kernels on a CPU."""
    try:
        mg = plgpu()
    except ImportError:
        return None
    params = getattr(mg, "InterpretGPUParams", None)
    return params(detect_races=True) if params is not None else None


class Stream(NamedTuple):
    """One input a producer warpgroup streams through a ring of shared-memory slots."""

    src: Callable  # j -> the GMEM window of tile j
    ring: object  # SMEM [stages, ...]
    ready: object  # barriers [stages]: the TMA of tile j arrives on ready[j % stages]
    free: object | None  # barriers [stages] the consumers release a slot on; None: an earlier
    # stream's free barrier already covers this slot


def visit_tiles(step, skip, carry, program, bounds, *, masked_first: bool, masked_last: bool,
                half_last=None, flush=None):
    """A consumer's walk over the program's tiles ``program = (p_lo, p_hi)``: with
    ``bounds = (lo, full_lo, full_hi, hi)``, tiles [p_lo, lo) and [hi, p_hi) only release their ring
    slot (``skip(j, None)``), [lo, full_lo) and [full_hi, hi) run ``step(j, carry, masked=True)``,
    [full_lo, full_hi) ``masked=False``. ``masked_first`` / ``masked_last``: whether the leading /
    trailing edge can hold masked or unseen tiles at all (without, those loops are not emitted).
    ``half_last``: ``tile.kv_half_last`` (traced 0 or 1), tile hi − 1 then runs
    ``step(j, carry, masked=True, half=True)``, on the first half of its keys. ``flush(carry)``:
    after the last step, before the trailing skips (a step's product still in flight ends there)."""
    p_lo, p_hi = program
    lo, full_lo, full_hi, hi = bounds
    if masked_first:
        lax.fori_loop(p_lo, lo, skip, None)
        carry = lax.fori_loop(lo, full_lo, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
    if masked_last:
        end = hi if half_last is None else hi - half_last
        carry = lax.fori_loop(full_hi, end, functools.partial(step, masked=True), carry)
        if half_last is not None:  # a loop of 0 or 1 steps: one code path, no branch to merge
            carry = lax.fori_loop(end, hi, functools.partial(step, masked=True, half=True), carry)
    if flush is not None:
        carry = flush(carry)
    if masked_last:
        lax.fori_loop(hi, p_hi, skip, None)
    return carry


# A warpgroup's last tile runs on its first half of keys where its rows see none of the second
# (tile.kv_half_last): wgmma takes 64 keys, so only 128-key tiles are halved. The same values in the
# same order (tests flip this to compare); saves a causal diagonal's masked half
HALF_LAST = True


def mma_into(acc, a, b, stage, interpret: bool):
    """acc + a·b by one wgmma, ``a`` a value in registers. Compiled, ``acc`` is the product's
    accumulator (the sum inside the MMA). jax 0.11's GPU interpreter has neither run_state nor a
    register operand: there ``a`` goes through the shared-memory ``stage`` and the product is added
    to ``acc`` apart (tile.py's sum)."""
    from jax.experimental import pallas as pl

    gpu = plgpu()
    if not interpret:
        def accumulate(acc_ref):
            gpu.wgmma(acc_ref, a, b)

        return pl.run_state(accumulate)(gpu.ACC.init(acc))
    stage[...] = a
    gpu.commit_smem()

    def product(acc_ref):
        gpu.wgmma(acc_ref, stage, b)
        return acc_ref[...]

    return acc + pl.run_scoped(product, gpu.ACC(acc.shape, jnp.float32))


def half_last(rows, bq: int, bk: int, cfg, bounds):
    """``visit_tiles``' ``half_last`` for a warpgroup's rows [rows, rows + bq): None where no tile is
    halved (tiles under 128 keys, or ``HALF_LAST`` off)."""
    if not HALF_LAST or bk < 128:
        return None
    return tile.kv_half_last(rows, bq, bk, cfg, bounds)


def stream_ring(streams, stages: int, n):
    """The producer's side of a ring of ``stages`` slots: tiles j = 0 … n − 1 of every stream, in
    order, tile j into slot j % stages. The first ``stages`` tiles go out at once; tile j ≥ stages
    waits, stream by stream, until the consumers released tile j − stages; then ``drain_ring``."""
    from jax.experimental import pallas as pl

    mg = plgpu()

    def issue(j, slot, wait_free):
        for s in streams:
            if wait_free and s.free is not None:
                mg.barrier_wait(s.free.at[slot])
            mg.copy_gmem_to_smem(s.src(j), s.ring.at[slot], s.ready.at[slot])

    for j in range(stages):  # fill the ring (a causal program may need fewer tiles)
        pl.when(j < n)(lambda j=j: issue(j, j, False))

    def refill(j, _):
        issue(j, lax.rem(j, stages), True)

    lax.fori_loop(stages, n, refill, None)
    drain_ring(streams, stages, n)


def drain_ring(streams, stages: int, n):
    """The producer's last waits on a ring that carried ``n`` tiles: the consumers' releases of the
    last ``stages`` of them (nothing needs them on the GPU, but a barrier should end with every
    phase observed: the interpreter checks it)."""
    mg = plgpu()

    def drain(j, _):
        for s in streams:
            if s.free is not None:
                mg.barrier_wait(s.free.at[lax.rem(j, stages)])

    lax.fori_loop(jnp.maximum(n, stages), n + stages, drain, None)


def stream_ring_on(streams, stages: int, n, base):
    """``stream_ring`` for one work item of a persistent program, whose ring runs on from item to
    item: the item's tiles j = 0 … n − 1 are the ring's tiles ``base + j`` (slot (base + j) %
    stages), so the next item's loads start while the consumers finish this one. No drain: the
    program calls ``drain_ring`` once, after its last item."""
    from jax.experimental import pallas as pl

    mg = plgpu()

    def issue(j, _):
        g = base + j
        slot = lax.rem(g, stages)
        for s in streams:
            if s.free is not None:
                pl.when(g >= stages)(lambda s=s: mg.barrier_wait(s.free.at[slot]))
            mg.copy_gmem_to_smem(s.src(j), s.ring.at[slot], s.ready.at[slot])

    lax.fori_loop(0, n, issue, None)


def sm_count() -> int:
    """The programs of a persistent Mosaic kernel: one per SM of the default device (132 on an H100
    SXM or H200); 132 where the device does not say (the CPU interpreter)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def persistent_programs(programs, grid: tuple) -> int | None:
    """A kernel's persistent programs, at most one per item of its ``grid``; None: the grid."""
    if programs is None:
        return None
    if not (isinstance(programs, int) and not isinstance(programs, bool) and programs >= 1):
        raise ValueError(f"programs must be a positive int, got {programs!r}")
    return min(programs, math.prod(grid))


def query_block_items(programs: int | None, q_shape, rows: int, bk: int, nk: int, cfg):
    """The walk over the work items of a kernel whose items are (batch, head, block of ``rows``
    queries) and which streams key tiles of ``bk`` (the forward, dQ): each item as (batch, head,
    first row, p_lo, p_hi), [p_lo, p_hi) the key tiles its rows see (``tile.kv_tile_bounds``: the
    causal diagonal, a window's edges), which the producer streams. Causal, the heaviest query
    blocks come first: the short ones then fill the last wave. Returns ``run(body)``, which calls
    ``body(item, ring, n)`` for each item of the program, ``ring`` the count of tiles streamed
    before it and ``n`` the program's items before it, and returns both counts after the last
    (None for the grid's one item, at 0, 0). ``programs`` None: one item per program of the grid
    (batch, head, qblk); else a ``persistent_loop`` over the grid's items, in its order (the last
    axis fastest)."""
    bsz, t, h = q_shape[:3]

    def item(batch, head, blk):
        if cfg.causal:
            blk = t // rows - 1 - blk
        row0 = blk * rows
        p_lo, _, _, p_hi = tile.kv_tile_bounds(row0, rows, bk, nk, cfg)
        return batch, head, row0, p_lo, p_hi

    if programs is None:
        only = item(*(lax.axis_index(n) for n in ("batch", "head", "qblk")))

        def run(body):
            body(only, 0, 0)

        return run

    def run(body):
        def visit(index, counts):
            ring, n = counts
            blk, index = lax.rem(index, t // rows), lax.div(index, t // rows)
            head = lax.rem(index, h)
            it = item(lax.div(index, h), head, blk)
            body(it, ring, n)
            return ring + it[4] - it[3], n + 1

        return persistent_loop(bsz * h * (t // rows), programs, visit,
                               (jnp.int32(0), jnp.int32(0)))

    return run


def persistent_loop(n_items: int, programs: int, body, carry):
    """A persistent program's walk over work items 0 … n_items − 1 (in the order of the
    non-persistent grid), ``carry = body(item, carry)`` for each of its own: wave w gives the
    programs items w·P … w·P + P − 1, program p taking position p on even waves and P − 1 − p on
    odd ones, so that neighbouring items (one head's query or key blocks, which share their
    K/V or Q/dO in L2) run at the same time and a program's heavy and light causal blocks even out.
    ``lax.axis_index("prog")`` is p."""
    p = lax.axis_index("prog")
    full, rem = divmod(n_items, programs)
    pos = lambda w: jnp.where(lax.rem(w, 2) == 0, p, programs - 1 - p)
    last = p if full % 2 == 0 else programs - 1 - p  # the position on the partial wave
    waves = full + (last < rem).astype(jnp.int32)
    return lax.fori_loop(0, waves, lambda w, c: body(w * programs + pos(w), c), carry)


def run_consumer(items, compute, regs: int, persistent: bool):
    """A compute warpgroup's part: ``regs`` registers a thread, then ``compute`` over its items.
    In a persistent program each item waits for its output's store only until the buffer is read
    (the next item refills it), and the program at its end until the last store is written."""
    mg = plgpu()
    mg.set_max_registers(regs, action="increase")
    items(compute)
    if persistent:
        mg.wait_smem_to_gmem(0)


def run_kv_producer(items, k_ref, v_ref, groups: int, bk: int, k_ring, v_ring, stages: int,
                    regs: int, persistent: bool, before=None, after=None):
    """The producer warpgroup of a kernel that walks key tiles (the forward, dQ): ``regs``
    registers a thread, then for each item ``(batch, head, row0, p_lo, p_hi)`` its K and V tiles
    [p_lo, p_hi) of (batch, head // groups) — GQA: the group's query heads read their key/value
    head, never a copy — through rings that run on across a persistent program's items.
    ``before(item, n)``: what else the producer loads for the program's n-th item, first;
    ``after(count)``: its last waits, after the program's ``count`` items (persistent only)."""
    plgpu().set_max_registers(regs, action="decrease")

    def produce(it, ring, n):
        batch, head, _, p_lo, p_hi = it
        if before is not None:
            before(it, n)
        produce_kv(k_ref, v_ref, batch, head // groups, bk, k_ring, v_ring, stages, p_hi - p_lo,
                   first=p_lo, base=ring if persistent else None)

    counts = items(produce)
    if persistent:
        drain_ring([Stream(None, None, None, k_ring[2]), Stream(None, None, None, v_ring[2])],
                   stages, counts[0])
        if after is not None:
            after(counts[1])


def kv_shape(q_shape, groups: int) -> tuple:
    """K's and V's shape for queries ``[B, T, H, D]`` with ``groups`` query heads per key/value head."""
    b, t, h, d = q_shape
    return (b, t, h // groups, d)


def produce_kv(k_ref, v_ref, batch, head, bk: int, k_ring, v_ring, stages: int, n, first=0,
               base=None):
    """The producer warpgroup of a kernel that walks key tiles (the forward, dQ): K and V tiles
    first … first + n − 1 of (batch, head), ``head`` a key/value head, ``bk`` keys each, through
    their rings (tile first + j into slot j % stages); ``k_ring``, ``v_ring``: (SMEM ring, ready
    barriers, free barriers). ``base``: a persistent program's ring count before this work item
    (``stream_ring_on``); None: the ring holds this item only."""
    from jax.experimental import pallas as pl

    keys = lambda j: (batch, pl.ds((first + j) * bk, bk), head)
    streams = [Stream(lambda j: k_ref.at[keys(j)], *k_ring),
               Stream(lambda j: v_ref.at[keys(j)], *v_ring)]
    if base is None:
        stream_ring(streams, stages, n)
    else:
        stream_ring_on(streams, stages, n, base)


def unsupported_masks(cfg) -> str | None:
    """Why the Mosaic GPU kernels cannot run ``cfg``'s masking (None: they can): they implement the
    causal diagonal, windows, a length padded up to the tiles (q_len = kv_len) and GQA/MQA
    (``cfg.groups`` query heads reading one key/value head)."""
    if cfg.seq_lengths:
        return "per-batch sequence lengths"
    if cfg.mask or cfg.bias:
        return "a dense mask or bias"
    return None
