"""Checkpoints a run can trust: Orbax step directories, each sealed by a manifest of checksums.

Layout under ``<run_dir>``::

    checkpoints/<step>/            Orbax (state/, meta/, ...), written synchronously
    checkpoints/<step>/manifest.json
    checkpoints_set_aside/<step>/  damaged checkpoints, and those past a chosen resume step

``manifest.json`` is written after Orbax has finished the step directory: the size and sha256 of
every other file in it, the config that wrote the checkpoint and the code version (git commit,
whether the work tree had uncommitted changes, package versions). A checkpoint is *intact* when its
manifest is readable and every listed file exists with that size and digest; anything else
(overwritten bytes, a truncated or missing file, no manifest because the save was interrupted) makes
it *damaged*. Orbax's compressed chunks do not reliably detect overwritten bytes themselves, which
is why the digests are ours.

Rotation is done here, not by Orbax: only after a checkpoint and its manifest are complete are the
oldest beyond ``keep`` deleted, so the newest complete checkpoint is never removed. Damaged
checkpoints are moved aside, never deleted.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
from pathlib import Path

import jax

from train.data import sha256_file

MANIFEST = "manifest.json"
FORMAT = 1
SET_ASIDE = "checkpoints_set_aside"
_PACKAGES = ("jax-flash", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint")


class CheckpointError(RuntimeError):
    """No checkpoint can be used: the one asked for is damaged or absent, or none is intact."""


def code_version() -> dict:
    """The git commit of this checkout (None outside git), whether tracked files differ from it,
    and the versions of the packages that shape a checkpoint."""
    repo = Path(__file__).resolve().parents[1]

    def git(*args):
        try:
            out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                                 timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {"git_commit": commit, "git_dirty": bool(status) if status is not None else None,
            "packages": versions}


def file_digests(step_dir: Path) -> dict[str, dict]:
    """{relative path: {"bytes", "sha256"}} of every file under step_dir except the manifest."""
    out = {}
    for p in sorted(step_dir.rglob("*")):
        rel = p.relative_to(step_dir).as_posix()
        if p.is_file() and rel != MANIFEST:
            out[rel] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
    return out


def check_step_dir(step_dir: Path) -> str | None:
    """None if the checkpoint in step_dir is intact, else what is wrong with it (one phrase)."""
    try:
        manifest = json.loads((step_dir / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} (the save was interrupted, or it predates checksums)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable {MANIFEST} ({type(e).__name__})"
    if not files:
        return f"{MANIFEST} lists no files"
    for rel, want in files.items():
        p = step_dir / rel
        if not p.is_file():
            return f"{rel} is missing"
        size = p.stat().st_size
        if size != want["bytes"]:
            return f"{rel} has {size} bytes, {want['bytes']} were written"
        if sha256_file(p) != want["sha256"]:
            return f"{rel} does not match its sha256"
    return None


class CheckpointStore:
    """The checkpoints of one run directory (single host: process 0 writes the manifests)."""

    def __init__(self, run_dir: str | Path, keep: int):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / "checkpoints"
        self.keep = keep
        self._mngr = None

    # -- listing & verification (touch nothing on disk)

    def steps(self) -> list[int]:
        """Steps with a step directory, ascending (Orbax's temporary directories are not steps)."""
        if not self.dir.is_dir():
            return []
        return sorted(int(p.name) for p in self.dir.iterdir() if p.is_dir() and p.name.isdigit())

    def step_dir(self, step: int) -> Path:
        return self.dir / str(step)

    def verify(self, step: int) -> str | None:
        return check_step_dir(self.step_dir(step))

    def manifest(self, step: int) -> dict:
        return json.loads((self.step_dir(step) / MANIFEST).read_text())

    def select(self, requested: int | None = None) -> tuple[int, list[tuple[int, str]]]:
        """(step, damaged): the requested step if intact, else (requested None) the newest intact
        one; ``damaged`` lists (step, problem) of the newer ones passed over. Raises
        CheckpointError when the requested step is damaged or absent, or none is intact."""
        steps = self.steps()
        if requested is not None:
            if requested not in steps:
                raise CheckpointError(f"no checkpoint at step {requested} in {self.dir} "
                                      f"(steps there: {', '.join(map(str, steps)) or 'none'})")
            problem = self.verify(requested)
            if problem:
                raise CheckpointError(f"checkpoint {requested} in {self.dir}, asked for by "
                                      f"resume_step, is damaged: {problem}")
            return requested, []
        damaged = []
        for step in reversed(steps):
            problem = self.verify(step)
            if problem is None:
                return step, damaged
            damaged.append((step, problem))
        detail = "; ".join(f"{s}: {p}" for s, p in damaged)
        raise CheckpointError(f"no intact checkpoint in {self.dir} ({detail or 'none there'})")

    # -- writing

    def _manager(self):
        import orbax.checkpoint as ocp

        if self._mngr is None:
            # max_to_keep=None: rotation is ours (rotate), after the manifest is complete
            opts = ocp.CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=False)
            self._mngr = ocp.CheckpointManager(self.dir.absolute(), options=opts)
        return self._mngr

    def save(self, step: int, state, meta: dict, *, config: dict, code: dict) -> None:
        """Write the checkpoint, seal it with its manifest, then rotate the older ones."""
        import orbax.checkpoint as ocp

        mngr = self._manager()
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                meta=ocp.args.JsonSave(meta)), force=True)
        mngr.wait_until_finished()
        if jax.process_index() == 0:
            step_dir = self.step_dir(step)
            manifest = {"format": FORMAT, "step": step, "files": file_digests(step_dir),
                        "config": config, "code": code}
            tmp = step_dir / (MANIFEST + ".tmp")
            tmp.write_text(json.dumps(manifest, indent=1))
            os.replace(tmp, step_dir / MANIFEST)  # atomic: a manifest is whole or absent
            self.rotate(newest=step)

    def rotate(self, newest: int) -> list[int]:
        """Delete the oldest checkpoints before ``newest`` beyond ``keep`` (``newest`` included)."""
        older = [s for s in self.steps() if s < newest]
        drop = older[: max(0, len(older) - (self.keep - 1))]
        for s in drop:
            shutil.rmtree(self.step_dir(s))
        if drop and self._mngr is not None:
            self._mngr.reload()
        return drop

    def set_aside(self, steps: list[int]) -> Path | None:
        """Move these step directories to <run_dir>/checkpoints_set_aside/ (never deleted)."""
        if not steps:
            return None
        dest_root = self.run_dir / SET_ASIDE
        dest_root.mkdir(exist_ok=True)
        for s in steps:
            dest, n = dest_root / str(s), 1
            while dest.exists():  # the same step set aside again later
                dest, n = dest_root / f"{s}.{n}", n + 1
            shutil.move(str(self.step_dir(s)), str(dest))
        if self._mngr is not None:
            self._mngr.reload()
        return dest_root

    # -- reading

    def restore(self, step: int, like_state, sharding) -> tuple[dict, dict]:
        import orbax.checkpoint as ocp

        abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), like_state)
        out = self._manager().restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return out["state"], out["meta"]

    def close(self) -> None:
        if self._mngr is not None:
            self._mngr.close()
            self._mngr = None
