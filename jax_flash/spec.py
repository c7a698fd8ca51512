"""What a call computes (``Numerics``) apart from how it runs (``Launch``).

``Numerics`` fixes every value: the policy's rounding points, the tiles of the online softmax, the
stable shift, δ. It comes from the call's arguments and the documented defaults below, the same on
every device and executor. ``Launch`` says how the Pallas kernels run on a GPU — kernel family,
warps, stages, resident blocks, prefetching — and is all a tuning table may choose. Within one
executor a launch reorders no rounded value; what it may change is the order of FP32 additions inside
matrix instructions (each kernel family has its own MMA shapes), which moves an output by at most
one ulp of its dtype, on a few elements.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from .policy import LOG2E, Policy, max_shift_nats

# Key and query tiles per policy: the key tile is the online softmax's (where rows rescale and where
# the stable shift counts ties); the query tile is the block over which the backward sums dK and dV.
# "fa2" takes 128-key tiles at head_dim 128, where the Hopper kernels run them fastest.
_TILES = {"paper": (32, 512)}


def default_tiles(policy: str, head_dim: int) -> tuple[int, int]:
    """(block_q, block_k) of ``policy`` at ``head_dim`` when the call does not set them."""
    base = policy.split("_")[0]
    if base in _TILES:
        return _TILES[base]
    if base == "fa2" and head_dim == 128:
        return 64, 128
    return 64, 64


def default_scale_late(policy: Policy, head_dim: int) -> bool:
    """Whether the forward folds the score scale into the exponent (see ``Numerics.scale_late``):
    on for "fa2" at head_dim 128, where the Hopper forward saves a multiply per score with it."""
    return policy.log2_units and not policy.round_scores and head_dim == 128


@dataclasses.dataclass(frozen=True)
class Numerics:
    """Everything that decides the values of one attention call (hashable: a static argument)."""

    policy: Policy
    causal: bool
    stable: bool
    beta: float
    sm_scale: float
    delta: str  # "o" | "o_hp" | "dpp"
    block_q: int
    block_k: int
    q_len: int  # true (unpadded) lengths; tails beyond them are masked
    kv_len: int
    # The forward keeps q·kᵀ unscaled: the row max is scale·max(q·kᵀ) (the same value: rounding is
    # monotone), the exps take scale·s − m (one FMA on a GPU), and the tie test compares q·kᵀ with the
    # threshold divided by the scale. Last bits of O and L differ from scaling first.
    scale_late: bool = False
    # Which (query, key) pairs are visible, beyond kv_len and causal (key ≤ query, top-left aligned
    # as in jax.nn: query i sees keys 0..i whatever the lengths): ``window`` (left, right) keeps keys
    # i − left ≤ j ≤ i + right; ``seq_lengths``: per-batch query and key lengths arrive as arrays
    # (rows and keys past them are masked, their tiles skipped); ``mask``/``bias``: a dense boolean
    # mask / additive bias on the scores (jnp executor only).
    window: tuple[int, int] | None = None
    seq_lengths: bool = False
    mask: bool = False
    bias: bool = False
    # query heads per key/value head (GQA/MQA): the dK/dV of a key tile sums the group's heads in
    # order, each head's query blocks in order
    groups: int = 1

    def __post_init__(self):
        if self.scale_late and (self.policy.round_scores or self.policy.round_shifted):
            raise ValueError(f"scale_late needs unrounded scores; policy {self.policy.name!r} "
                             "rounds them")
        if self.scale_late and self.bias:
            raise ValueError("scale_late keeps q·kᵀ unscaled, which a bias cannot be added to")
        if self.window is not None and (
                len(self.window) != 2 or not all(type(w) is int for w in self.window)):
            raise ValueError(f"window must be (left, right) Python ints, got {self.window!r}")
        if type(self.groups) is not int or self.groups < 1:
            raise ValueError(f"groups must be a positive int, got {self.groups!r}")

    @property
    def score_scale(self) -> float:
        """Multiplier from raw q·k to the policy's score units."""
        return self.sm_scale * (LOG2E if self.policy.log2_units else 1.0)

    @property
    def score_scale_inv(self) -> float:
        """1 / score_scale rounded to FP32 (the tie test under ``scale_late``)."""
        return float(np.float32(1.0 / self.score_scale))

    @property
    def max_shift(self) -> float:
        return max_shift_nats(self.policy.p_dtype) * (LOG2E if self.policy.log2_units else 1.0)


FWD_KERNELS = ("triton", "mosaic")
BWD_KERNELS = ("triton", "mosaic", "mosaic_dkdv")  # "mosaic_dkdv": Mosaic dK/dV, Triton dQ


# A Mosaic kernel of two compute warpgroups and one producer (384 threads) starts with the
# register file's even share, 65,536 / 384 rounded down to 8: 168 a thread. setmaxnreg moves
# registers between warpgroups in steps of 8 within 24 … 256, and the three together cannot ask
# for more than they hold.
MOSAIC_THREAD_REGS = 168


def check_mosaic_regs(regs, name: str) -> None:
    """Raise unless ``regs`` is a (compute, producer) register split the 384-thread Mosaic kernels
    can take: multiples of 8 in 24 … 256, producer ≤ 168 ≤ compute, 2·compute + producer ≤ 3·168."""
    ok = (isinstance(regs, tuple) and len(regs) == 2
          and all(isinstance(x, int) and not isinstance(x, bool) for x in regs))
    if ok:
        comp, prod = regs
        ok = (all(24 <= x <= 256 and x % 8 == 0 for x in regs)
              and prod <= MOSAIC_THREAD_REGS <= comp and 2 * comp + prod <= 3 * MOSAIC_THREAD_REGS)
    if not ok:
        raise ValueError(f"{name} must be (compute, producer) registers a thread, multiples of 8 in "
                         f"24 … 256 with producer ≤ {MOSAIC_THREAD_REGS} ≤ compute and "
                         f"2·compute + producer ≤ {3 * MOSAIC_THREAD_REGS}, got {regs!r}")


@dataclasses.dataclass(frozen=True)
class Launch:
    """How the Pallas kernels run on a GPU. None of it changes a rounded value (module docstring)."""

    fwd_kernel: str = "triton"  # "mosaic": the Hopper forward (pallas/forward_mosaic.py)
    bwd_kernel: str = "triton"  # "mosaic" | "mosaic_dkdv": the Hopper backward
    fwd: tuple[int, int] | None = None  # Triton (num_warps, num_stages); None: defaults
    bwd: tuple[int, int] | None = None
    dq: tuple[int, int] | None = None  # the dQ kernel's own, where it differs from ``bwd``
    split_diagonal: bool = False  # mask-free loops over the tiles below the causal diagonal
    bwd_block: int | None = None  # keys a dK/dV program keeps resident (a multiple of both tiles)
    dq_block: int | None = None  # queries a dQ program keeps resident
    prefetch_rows: bool = False  # dK/dV kernel: the next query block's L and δ a loop step ahead
    prefetch_scores: bool = False  # forward: the next key tile's scores before this tile's softmax
    # Triton δ (dP∘P) and dQ kernels: programs take the query blocks last first, so under a causal
    # mask the longest start first and the short ones fill the last wave (the forward's own order
    # timed faster at head_dim 64, so it keeps it)
    heavy_first: bool = False
    # depth of the Mosaic kernels' shared-memory rings (forward: K/V tiles; backward: the streamed
    # Q/dO and K/V tiles); None: the kernels' per-shape defaults. Only how far loads run ahead.
    mosaic_fwd_stages: int | None = None
    mosaic_bwd_stages: int | None = None
    # Mosaic backward kernels: registers a thread of each compute / producer warpgroup asks for
    # (setmaxnreg); None: (232, 40). Only where values live, so only whether the compiler spills.
    mosaic_bwd_regs: tuple[int, int] | None = None
    # Mosaic dQ kernel: keys a streamed K/V tile holds, 64 or 128 (None: 64); dQ sums the same
    # products in the same key order either way, only in longer MMAs and fewer ring steps
    mosaic_dq_keys: int | None = None
    # Mosaic forward: one program per SM, each taking (batch, head, query block) items in turn with
    # one K/V ring across them, so the next item's loads overlap this one's end. Only the schedule.
    mosaic_fwd_persistent: bool = False

    def __post_init__(self):
        if self.fwd_kernel not in FWD_KERNELS:
            raise ValueError(f"fwd_kernel {self.fwd_kernel!r}: expected one of {FWD_KERNELS}")
        if self.bwd_kernel not in BWD_KERNELS:
            raise ValueError(f"bwd_kernel {self.bwd_kernel!r}: expected one of {BWD_KERNELS}")
        for name in ("fwd", "bwd", "dq"):
            val = getattr(self, name)
            if val is not None and (len(val) != 2 or not all(isinstance(x, int) and x > 0
                                                             for x in val)):
                raise ValueError(f"{name} must be (num_warps, num_stages), got {val!r}")
        for name in ("mosaic_fwd_stages", "mosaic_bwd_stages"):
            val = getattr(self, name)
            if val is not None and (not isinstance(val, int) or isinstance(val, bool)
                                    or not 1 <= val <= 8):
                raise ValueError(f"{name} must be an int in 1 … 8, got {val!r}")
        for name in ("mosaic_fwd_persistent", "heavy_first"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.mosaic_bwd_regs is not None:
            check_mosaic_regs(self.mosaic_bwd_regs, "mosaic_bwd_regs")
        if self.mosaic_dq_keys not in (None, 64, 128):
            raise ValueError(f"mosaic_dq_keys must be 64 or 128, got {self.mosaic_dq_keys!r}")
        for name in ("bwd_block", "dq_block"):
            val = getattr(self, name)
            if val is not None and (not isinstance(val, int) or val < 16 or val & (val - 1)):
                raise ValueError(f"{name} must be a power of two >= 16, got {val!r}")

    @classmethod
    def from_dict(cls, entry: dict) -> Launch:
        """A launch from a tuning-table entry or a user's dict: launch fields only (``fwd``/``bwd``/
        ``dq`` as ``(warps, stages)`` or ``{"num_warps", "num_stages"}``); anything else raises."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(entry) - names)
        if unknown:
            raise ValueError(f"not launch fields: {unknown} (a launch may set only {sorted(names)};"
                             " tile sizes and numerics flags are arguments of the call)")
        kw = dict(entry)
        if isinstance(kw.get("mosaic_bwd_regs"), list):  # JSON has no tuples
            kw["mosaic_bwd_regs"] = tuple(kw["mosaic_bwd_regs"])
        for name in ("fwd", "bwd", "dq"):
            val = kw.get(name)
            if isinstance(val, dict):
                kw[name] = (val["num_warps"], val["num_stages"])
            elif val is not None:
                kw[name] = tuple(val)
        return cls(**kw)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default}


class Plan(NamedTuple):
    """What ``jax_flash.attention`` will compute and how: ``executor`` "pallas" or "jnp";
    ``notes``: what the plan substituted and why (another executor, the Triton kernels for Mosaic
    ones, a padded head_dim) — never other numerics."""

    numerics: Numerics
    launch: Launch
    executor: str
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """A JSON-ready record of the plan (for a run's metadata)."""
        num = {f.name: getattr(self.numerics, f.name) for f in dataclasses.fields(Numerics)
               if f.name != "policy"}
        if num["window"] is not None:
            num["window"] = list(num["window"])
        return {"policy": self.numerics.policy.name, **num, "executor": self.executor,
                "launch": self.launch.to_dict(), "notes": list(self.notes)}
