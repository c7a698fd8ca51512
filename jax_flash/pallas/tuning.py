"""Launch parameters of the GPU kernels per (policy, head_dim, sequence length, causal).

``tuning.json`` beside this file is written by ``python -m bench.tune`` on a GPU. An entry holds
launch fields only (``spec.Launch``: kernel family, warps and stages, resident blocks, prefetching)
plus where it was measured (``device``, ``arch``, ``jax_version``, ``ms``; ``revised``, where a
field was changed after the search: what, and the run that measured it); it applies on GPUs of the
architecture it was measured on, at its length bucket and, where that has no entry, the buckets
beside it (half and twice the length). Nothing in it can change a computed value: tile sizes and
numerics flags are arguments of the call (``jax_flash.plan`` shows both).

``JAX_FLASH_TUNING`` (an environment variable, read at the first lookup) names a table of the same
format, e.g. one ``bench.tune --out FILE`` measured on your GPU: its entries replace the shipped
ones of the same key.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import jax

from ..spec import Launch

TABLE_PATH = Path(__file__).with_name("tuning.json")
ENV_VAR = "JAX_FLASH_TUNING"
META_FIELDS = ("device", "arch", "jax_version", "ms")  # every entry's provenance
PROVENANCE = (*META_FIELDS, "revised")


def key(policy: str, head_dim: int, seq_len: int, causal: bool) -> str:
    bucket = min(max(1 << (max(seq_len, 1) - 1).bit_length(), 512), 16384)
    return f"{policy}/d{head_dim}/t{bucket}/{'causal' if causal else 'full'}"


def entry_launch(entry: dict) -> Launch:
    """The launch an entry sets; a field that is neither a launch field nor provenance raises."""
    return Launch.from_dict({k: v for k, v in entry.items() if k not in PROVENANCE})


def load(path: Path = TABLE_PATH) -> dict[str, tuple[str | None, Launch]]:
    """key -> (arch, launch) for every entry of a table, each checked by ``entry_launch``."""
    raw = json.loads(Path(path).read_text()) if Path(path).exists() else {}
    table = {}
    for k, entry in raw.items():
        try:
            table[k] = (entry.get("arch"), entry_launch(entry))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: entry {k!r}: {e}") from None
    return table


def load_all(env: str | None = None) -> dict[str, tuple[str | None, Launch]]:
    """The shipped table with the entries of the table ``env`` names (default: the environment
    variable ``JAX_FLASH_TUNING``) in place of the shipped ones of the same key."""
    env = os.environ.get(ENV_VAR) if env is None else env
    if not env:
        return load()
    path = Path(env).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{ENV_VAR}={env}: no such file (a table bench.tune --out wrote)")
    return {**load(), **load(path)}


@functools.cache
def _table() -> dict:
    return load_all()


@functools.cache
def device_arch() -> str | None:
    """"sm_90" and the like for the default device; None off GPUs."""
    if jax.default_backend() != "gpu":
        return None
    cc = str(getattr(jax.devices()[0], "compute_capability", ""))
    return f"sm_{cc.replace('.', '')}" if cc else None


def lookup_entry(policy: str, head_dim: int, seq_len: int, causal: bool) -> tuple[str | None, Launch]:
    """(the key of the entry that applies, its launch) for this call on this GPU: the entry of the
    call's length bucket, else of a bucket one step away (half or twice the length; the longer where
    both exist); (None, the defaults) where none does. Only entries measured on this GPU's
    architecture apply."""
    table = _table()
    own = key(policy, head_dim, seq_len, causal)
    bucket = int(own.split("/")[2][1:])
    for b in (bucket, 2 * bucket, bucket // 2):
        k = key(policy, head_dim, b, causal)
        arch, launch = table.get(k, (None, None))
        if launch is not None and (arch is None or arch == device_arch()):
            return k, launch
    return None, Launch()


def lookup(policy: str, head_dim: int, seq_len: int, causal: bool) -> Launch:
    """The launch ``lookup_entry`` finds for this call."""
    return lookup_entry(policy, head_dim, seq_len, causal)[1]
