"""jax_flash/pallas/tuning.py: the shipped table holds launch fields only, a table with a numerics
field does not load, and entries apply on the architecture they were measured on."""

import json

import jax
import pytest

import jax_flash as jf
from jax_flash.pallas import tuning


def test_shipped_table_loads_with_launch_fields_only():
    table = tuning.load()
    assert table, "the package ships tuning.json"
    for key, (arch, launch) in table.items():
        assert isinstance(launch, jf.Launch) and arch and arch.startswith("sm_"), key
        policy, d, t, mask = key.split("/")
        assert d.startswith("d") and t.startswith("t") and mask in ("causal", "full")
    raw = json.loads(tuning.TABLE_PATH.read_text())
    names = {f for entry in raw.values() for f in entry} - set(tuning.PROVENANCE)
    assert names <= set(jf.Launch.__dataclass_fields__), names


@pytest.mark.parametrize("field,value", [("block_k", 128), ("block_q", 64), ("scale_late", True),
                                         ("exp2_ftz", True), ("shift_factor", True)])
def test_table_with_a_numerics_field_does_not_load(tmp_path, field, value):
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"fa2/d64/t1024/causal": {"arch": "sm_90", "prefetch_rows": True,
                                                         field: value}}))
    with pytest.raises(ValueError, match=f"entry 'fa2/d64/t1024/causal': not launch fields: \\['{field}'\\]"):
        tuning.load(path)


def test_revised_note_is_provenance_not_launch(tmp_path):
    """``revised`` (a field changed after the search, and the run that measured it) is provenance:
    the entry's launch is the same without it; any other unknown field still raises."""
    entry = {"arch": "sm_90", "device": "d", "jax_version": "0", "ms": 1.0, "mosaic_dq_keys": 128}
    noted = tuning.entry_launch({**entry, "revised": "mosaic_dq_keys 128: run F"})
    assert noted == tuning.entry_launch(entry) and noted.mosaic_dq_keys == 128
    with pytest.raises(ValueError, match="not launch fields"):
        tuning.entry_launch({**entry, "revision": "a misspelt note"})


def test_env_table_replaces_the_shipped_entries_of_its_keys(tmp_path, monkeypatch):
    """``JAX_FLASH_TUNING`` names a table whose entries take the place of the shipped ones of the
    same key; the other shipped entries stay; a table with a numerics field or a missing file
    raises."""
    shipped = tuning.load()
    key = "fa2/d64/t1024/causal"
    assert key in shipped
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({key: {"arch": "sm_80", "bwd_block": 128},
                                "fa2/d64/t4096/full": {"arch": "sm_80", "split_diagonal": True}}))
    monkeypatch.setenv(tuning.ENV_VAR, str(path))
    table = tuning.load_all()
    assert table[key] == ("sm_80", jf.Launch(bwd_block=128))
    assert table["fa2/d64/t4096/full"] == ("sm_80", jf.Launch(split_diagonal=True))
    assert {k: v for k, v in table.items() if k not in (key, "fa2/d64/t4096/full")} == \
        {k: v for k, v in shipped.items() if k != key}
    monkeypatch.delenv(tuning.ENV_VAR)
    assert tuning.load_all() == shipped
    with pytest.raises(FileNotFoundError, match="JAX_FLASH_TUNING"):
        tuning.load_all(str(tmp_path / "none.json"))
    path.write_text(json.dumps({key: {"block_k": 128}}))
    with pytest.raises(ValueError, match="not launch fields"):
        tuning.load_all(str(path))


def test_missing_table_is_empty(tmp_path):
    assert tuning.load(tmp_path / "none.json") == {}


def test_key_buckets_sequence_lengths():
    assert tuning.key("fa2", 64, 1000, True) == "fa2/d64/t1024/causal"
    assert tuning.key("fa2", 64, 1024, False) == "fa2/d64/t1024/full"
    assert tuning.key("paper", 128, 3, True) == "paper/d128/t512/causal"  # smallest bucket
    assert tuning.key("fa2", 128, 10 ** 6, True) == "fa2/d128/t16384/causal"  # largest


def test_lookup_applies_on_the_measured_architecture_only(monkeypatch):
    monkeypatch.setattr(tuning, "_table", lambda: {
        "fa2/d64/t1024/causal": ("sm_90", jf.Launch(prefetch_rows=True)),
        "fa2/d64/t2048/causal": (None, jf.Launch(split_diagonal=True))})
    monkeypatch.setattr(tuning, "device_arch", lambda: "sm_90")
    assert tuning.lookup("fa2", 64, 1000, True) == jf.Launch(prefetch_rows=True)
    assert tuning.lookup("fa2", 64, 2000, True) == jf.Launch(split_diagonal=True)  # no arch: any
    assert tuning.lookup("fa2", 64, 1000, False) == jf.Launch()  # no entry
    monkeypatch.setattr(tuning, "device_arch", lambda: "sm_80")
    assert tuning.lookup("fa2", 64, 500, True) == jf.Launch()  # its bucket's entry is sm_90's
    assert tuning.lookup("fa2", 64, 2000, True) == jf.Launch(split_diagonal=True)


def test_lookup_takes_the_next_bucket_where_its_own_has_no_entry(monkeypatch):
    mosaic = jf.Launch(fwd_kernel="mosaic", bwd_kernel="mosaic")
    monkeypatch.setattr(tuning, "_table", lambda: {
        "fa2/d128/t2048/causal": ("sm_90", jf.Launch(prefetch_rows=True)),
        "fa2/d128/t8192/causal": ("sm_90", mosaic),
        "fa2/d64/t1024/causal": ("sm_80", jf.Launch(split_diagonal=True))})
    monkeypatch.setattr(tuning, "device_arch", lambda: "sm_90")
    assert tuning.lookup("fa2", 128, 4096, True) == mosaic  # both beside it: the longer
    assert tuning.lookup("fa2", 128, 3000, True) == mosaic
    assert tuning.lookup("fa2", 128, 1024, True) == jf.Launch(prefetch_rows=True)  # twice: 2048
    assert tuning.lookup("fa2", 128, 16384, True) == mosaic  # half: 8192
    assert tuning.lookup("fa2", 128, 512, True) == jf.Launch()  # two buckets away: none
    assert tuning.lookup("fa2", 128, 4096, False) == jf.Launch()  # another mask: none
    assert tuning.lookup("paper", 128, 4096, True) == jf.Launch()  # another policy: none
    assert tuning.lookup("fa2", 64, 2048, True) == jf.Launch()  # measured on another arch


def test_device_arch_is_none_off_gpus():
    if jax.default_backend() != "gpu":
        assert tuning.device_arch() is None


def test_shipped_table_gives_gqa_at_4096_the_mosaic_kernels_on_hopper(monkeypatch):
    """The benchmark's GQA case (4×4096, head_dim 128, causal) has no entry of its own; the 8192
    entry beside it applies."""
    monkeypatch.setattr(tuning, "device_arch", lambda: "sm_90")
    launch = tuning.lookup("fa2", 128, 4096, True)
    assert (launch.fwd_kernel, launch.bwd_kernel) == ("mosaic", "mosaic")


def test_plan_says_when_a_neighbouring_entry_applies(monkeypatch):
    """On a GPU (faked) a call at 4096 runs the 8192 entry's launch, and the plan's notes say so;
    a call at 8192, its own entry, adds no note."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(tuning, "device_arch", lambda: "sm_90")
    monkeypatch.setattr(tuning, "_table", lambda: {
        "fa2/d128/t8192/causal": ("sm_90", jf.Launch(prefetch_rows=True))})
    x = jax.ShapeDtypeStruct((1, 4096, 2, 128), jax.numpy.bfloat16)
    p = jf.plan(x, x, x)
    assert p.launch == jf.Launch(prefetch_rows=True)
    assert "launch: tuning entry fa2/d128/t8192/causal (none measured at fa2/d128/t4096/causal)" in p.notes
    y = jax.ShapeDtypeStruct((1, 8192, 2, 128), jax.numpy.bfloat16)
    assert not any(n.startswith("launch:") for n in jf.plan(y, y, y).notes)
