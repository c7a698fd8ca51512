"""train/checkpoint.py: manifests (checksums, config, code version), damage detection (overwritten
bytes, truncated or missing file, interrupted save), fallback and its refusals, rotation, set-aside.
A small synthetic state stands in for a training state: no model is built here."""

import json
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train import checkpoint as K

SHARDING = jax.sharding.SingleDeviceSharding(jax.devices()[0])


def state_at(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {
        "step": jnp.asarray(step, jnp.int32),
        "params": {"w": jnp.asarray(rng.standard_normal((64, 48)), jnp.float32)},
        "opt_state": {"mu": jnp.asarray(rng.standard_normal((64, 48)), jnp.float32)},
    }


def make_store(tmp_path, steps=(2, 4, 6), keep=3) -> K.CheckpointStore:
    store = K.CheckpointStore(tmp_path, keep)
    for s in steps:
        store.save(s, state_at(s), {"step": s}, config={"max_steps": 8}, code=K.code_version())
    return store


def biggest_file(step_dir: Path) -> Path:
    """The largest array chunk: damage there is damage to values, not to metadata."""
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def overwrite_bytes(step_dir: Path):
    p = biggest_file(step_dir)
    data = bytearray(p.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])  # surely different bytes
    p.write_bytes(bytes(data))
    return p


def truncate(step_dir: Path):
    p = biggest_file(step_dir)
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    return p


def remove(step_dir: Path):
    p = biggest_file(step_dir)
    p.unlink()
    return p


def drop_manifest(step_dir: Path):
    (step_dir / K.MANIFEST).unlink()
    return None


DAMAGE = {
    "overwritten bytes": (overwrite_bytes, "does not match its sha256"),
    "truncated file": (truncate, "were written"),
    "missing file": (remove, "is missing"),
    "interrupted save": (drop_manifest, "no manifest.json"),
}


def test_manifest_seals_every_file_with_config_and_code_version(tmp_path):
    store = make_store(tmp_path, steps=(3,))
    m = store.manifest(3)
    files = {p.relative_to(store.step_dir(3)).as_posix() for p in store.step_dir(3).rglob("*")
             if p.is_file() and p.name != K.MANIFEST}
    assert set(m["files"]) == files and any(f.startswith("state/") for f in files)
    assert all(len(v["sha256"]) == 64 and v["bytes"] >= 0 for v in m["files"].values())
    assert m["step"] == 3 and m["config"] == {"max_steps": 8}
    head = subprocess.run(["git", "-C", str(Path(K.__file__).parent), "rev-parse", "HEAD"],
                          capture_output=True, text=True)
    assert m["code"]["git_commit"] == (head.stdout.strip() if head.returncode == 0 else None)
    assert m["code"]["packages"]["jax"] == jax.__version__
    assert store.verify(3) is None
    state, meta = store.restore(3, state_at(0), SHARDING)
    assert meta == {"step": 3}
    jax.tree.map(np.testing.assert_array_equal, state, state_at(3))


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_is_detected_and_the_newest_intact_checkpoint_chosen(tmp_path, damage):
    store = make_store(tmp_path)
    fn, phrase = DAMAGE[damage]
    hit = fn(store.step_dir(6))
    problem = store.verify(6)
    assert phrase in problem and (hit is None or hit.name in problem)
    assert "\n" not in problem
    assert store.verify(4) is None and store.verify(2) is None
    assert store.select() == (4, [(6, problem)])
    with pytest.raises(K.CheckpointError, match="asked for by resume_step, is damaged"):
        store.select(6)  # a step asked for by name: no fallback
    assert store.select(2) == (2, [])


def test_no_intact_or_absent_checkpoint_is_an_error(tmp_path):
    store = make_store(tmp_path, steps=(2, 4))
    with pytest.raises(K.CheckpointError, match="no checkpoint at step 3 .*steps there: 2, 4"):
        store.select(3)
    overwrite_bytes(store.step_dir(4))
    truncate(store.step_dir(2))
    with pytest.raises(K.CheckpointError, match="no intact checkpoint .*4: .*sha256.*; 2: "):
        store.select()
    with pytest.raises(K.CheckpointError, match="none there"):
        K.CheckpointStore(tmp_path / "empty", 2).select()


def test_rotation_keeps_the_newest_and_runs_only_after_a_complete_save(tmp_path, monkeypatch):
    store = make_store(tmp_path, steps=(1, 2, 3, 4, 5), keep=2)
    assert store.steps() == [4, 5]
    one = make_store(tmp_path / "one", steps=(1, 2, 3), keep=1)
    assert one.steps() == [3]

    def fail(step_dir):
        raise OSError("disk full")

    monkeypatch.setattr(K, "file_digests", fail)
    with pytest.raises(OSError):
        store.save(6, state_at(6), {"step": 6}, config={}, code={})
    # the failed save left an unsealed step 6 and deleted nothing
    assert store.steps() == [4, 5, 6] and "no manifest" in store.verify(6)
    assert store.select() == (5, [(6, store.verify(6))])


def test_set_aside_moves_and_never_overwrites(tmp_path):
    store = make_store(tmp_path, steps=(2, 4))
    dest = store.set_aside([4])
    assert store.steps() == [2] and (dest / "4" / K.MANIFEST).exists()
    store.save(4, state_at(4), {"step": 4}, config={}, code={})  # the step again, on a new branch
    store.set_aside([4])
    assert sorted(p.name for p in dest.iterdir()) == ["4", "4.1"]
    assert json.loads((dest / "4" / K.MANIFEST).read_text())["config"] == {"max_steps": 8}
