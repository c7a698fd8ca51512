"""Launch parameters of the Triton kernels per (policy, head_dim, sequence length, causal).

`tuning.json` beside this file is written by `python -m bench.tune` on a GPU and shipped with the
package; a missing entry means the built-in defaults (64×64 tiles for "fa2"/"fp32", 32×512 for
"paper"; 4 warps, or 8 for large tiles; 2 stages). `override` lets the tuner try candidates.
Entries: ``{"block_q", "block_k", "fwd": {"num_warps", "num_stages"}, "bwd": {...}, "split_diagonal",
"bwd_block"}`` and optionally ``"dq": {...}``, ``"dq_block"``, ``"prefetch_rows"``, ``"prefetch_scores"`` (tiles shared by
all kernels of a call; ``split_diagonal``: mask-free loops below the causal diagonal; ``bwd_block``:
rows a backward program keeps resident; ``dq`` / ``dq_block``: the dQ kernel's own launch and
resident block; ``prefetch_rows``: the dK/dV kernel loads L and δ a block ahead; ``prefetch_scores``: the
forward computes the next key tile's scores before this tile's softmax — all the same
values, see ``tile.Config``; ``fwd_kernel``: ``"mosaic"`` runs the Hopper forward of
``forward_mosaic.py``; ``bwd_kernel``: ``"mosaic"`` / ``"mosaic_dkdv"`` the Hopper backward of
``backward_mosaic.py`` (both kernels / dK/dV only) — the same rounding points, MMA summation
orders their own; ``tie_count_int``: the stable forward counts ties in int32 — the same counts; ``shift_factor``: the
stable shift as a per-row factor after the exps — equal in real arithmetic, see ``tile.Config``;
``tie_top2``: "≥ 2 ties" from the row's two largest scores — the same decisions; ``exp2_ftz``: the
Triton forward's exps without the subnormal fix-up; ``scale_late``: the forward's scores unscaled,
the scale folded into the exps' FMA — last bits, see ``tile.Config`` and docs/NUMERICS.md). The key tile size changes the numerics (the online-softmax
rescaling); the tuner keeps "paper" at its 512-wide key tiles.
"""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path

TABLE_PATH = Path(__file__).with_name("tuning.json")
_OVERRIDE: list[dict] = []


def key(policy: str, head_dim: int, seq_len: int, causal: bool) -> str:
    bucket = min(max(1 << (max(seq_len, 1) - 1).bit_length(), 512), 16384)
    return f"{policy}/d{head_dim}/t{bucket}/{'causal' if causal else 'full'}"


@functools.cache
def _table() -> dict:
    return json.loads(TABLE_PATH.read_text()) if TABLE_PATH.exists() else {}


def lookup(policy: str, head_dim: int, seq_len: int, causal: bool) -> dict:
    """The entry for this call ({} if none)."""
    if _OVERRIDE:
        return _OVERRIDE[-1]
    return _table().get(key(policy, head_dim, seq_len, causal), {})


@contextlib.contextmanager
def override(entry: dict):
    """Use ``entry`` for every call traced inside the block (for the tuner)."""
    _OVERRIDE.append(entry)
    try:
        yield
    finally:
        _OVERRIDE.pop()
