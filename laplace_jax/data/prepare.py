"""Tokenize text into uint16 GPT-2 token shards with a held-out split and a JSON manifest.

    python -m laplace_jax.data.prepare --input PATH [PATH ...] --out DIR \
        [--val-fraction 0.02] [--workers 2] [--shard-tokens 100000000] [--force] [--quiet]

Inputs: ``.txt``, ``.jsonl`` (``text`` field), ``.parquet`` (``text`` column, FineWeb-edu layout;
needs pyarrow), ``.json`` (the demo corpus layout), directories of those, or ``demo`` (the built-in
corpus). See `laplace_jax.data.corpus` for what counts as a document.

Output in DIR:

* ``train_00000.bin``, ``train_00001.bin``, ... and ``val_00000.bin``, ...: raw little-endian uint16
  token ids; every document is followed by ``<|endoftext|>`` (50256). A split's shards concatenated
  are one token stream; a shard holds exactly ``shard_tokens`` tokens except the split's last one
  (documents may straddle shards).
* ``manifest.json``: tokenizer, vocab size, dtype, token/document counts per split and per shard,
  source paths with sizes and mtimes, and the settings.

The held-out split is by document and deterministic: with f = val_fraction, document i (0-based, in
input order, after skipping whitespace-only ones) is held out iff ceil(i f) != ceil((i + 1) f), i.e.
document 0 and then every ~1/f-th document, ceil(n f) in all.

Re-running with the same inputs (same paths, sizes, mtimes) and settings is a no-op; a folder holding a
dataset of other inputs or settings is replaced only with ``--force``, and a non-empty folder that is
not a prepared dataset (a run dir, a source folder) is never written into. A run writes
into a temporary folder inside DIR and moves the files into place only after it finished; the
manifest is written last, so an interrupted run never leaves a folder that looks valid.
"""
from __future__ import annotations

import collections
import fcntl
import json
import math
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from laplace_jax.cli import EXIT_USAGE, Parser, positive_int
from laplace_jax.data.corpus import DEMO_CREDIT, DataError, demo_corpus_path, expand_inputs, iter_pieces

MANIFEST = "manifest.json"
FORMAT = "laplace_jax.tokens/v1"
DTYPE = "uint16"
SPLITS = ("train", "val")
DEFAULT_SHARD_TOKENS = 100_000_000
DEFAULT_VAL_FRACTION = 0.02
_CHUNK_CHARS = 1 << 20   # characters of text per tokenization task
_CHUNK_PIECES = 512


# ----------------------------------------------------------------------------- tokenization

def _init_worker() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process


def _encode_chunk(pieces: list[tuple[str, bool]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces of documents (text, ends a document) → (uint16 tokens with EOS after each document's last
    piece, int64 tokens per piece incl. that EOS, bool per piece: ends a document)."""
    from laplace_jax.data.tokenizer import get_tokenizer
    tok = get_tokenizer()
    ids = tok.encode_batch([t for t, _ in pieces])
    ends = np.fromiter((e for _, e in pieces), dtype=bool, count=len(pieces))
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids)) + ends
    out = np.empty(int(lengths.sum()), dtype=np.uint16)
    stops = np.cumsum(lengths)
    for s, n, x, e in zip(stops - lengths, lengths, ids, ends):
        out[s:s + len(x)] = x
        if e:
            out[s + n - 1] = tok.eos_id
    return out, lengths, ends


def _chunks(pieces: Iterable[tuple[str, bool]]) -> Iterator[list[tuple[str, bool]]]:
    buf, size = [], 0
    for p in pieces:
        buf.append(p)
        size += len(p[0])
        if size >= _CHUNK_CHARS or len(buf) >= _CHUNK_PIECES:
            yield buf
            buf, size = [], 0
    if buf:
        yield buf


def _tokenize(pieces: Iterable[tuple[str, bool]], workers: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Tokenized chunks in input order; `workers` > 1 spreads chunks over spawned processes."""
    chunks = _chunks(pieces)
    if workers <= 1:
        for c in chunks:
            yield _encode_chunk(c)
        return
    # spawn, not fork: the parent may have started JAX / tokenizer threads.
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker) as pool:
        pending: collections.deque = collections.deque()
        for c in chunks:                      # bounded window keeps memory flat on huge corpora
            pending.append(pool.apply_async(_encode_chunk, (c,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# ----------------------------------------------------------------------------- writing

class _SplitWriter:
    """Appends uint16 tokens to `<split>_NNNNN.bin` files of at most `shard_tokens` tokens each."""

    def __init__(self, folder: Path, split: str, shard_tokens: int):
        self.folder, self.split, self.shard_tokens = folder, split, shard_tokens
        self.shards: list[dict] = []
        self.documents = 0
        self._f = None
        self._n = 0

    def write(self, tokens: np.ndarray) -> None:
        while tokens.size:
            if self._f is None:
                name = f"{self.split}_{len(self.shards):05d}.bin"
                self._f = open(self.folder / name, "wb")
                self.shards.append({"file": name, "tokens": 0})
                self._n = 0
            take = tokens[: self.shard_tokens - self._n]
            self._f.write(take.astype("<u2", copy=False).tobytes())
            self._n += take.size
            self.shards[-1]["tokens"] = self._n
            tokens = tokens[take.size:]
            if self._n == self.shard_tokens:
                self._close_file()

    def _close_file(self) -> None:
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            self._f = None

    def close(self) -> dict:
        self._close_file()
        return {"documents": self.documents, "tokens": sum(s["tokens"] for s in self.shards),
                "shards": self.shards}


def _is_val(i: int, frac: Fraction) -> bool:
    return frac > 0 and math.ceil(i * frac) != math.ceil((i + 1) * frac)


# ----------------------------------------------------------------------------- manifest

def _source_info(files: Sequence[Path]) -> list[dict]:
    out = []
    for f in files:
        st = f.stat()
        out.append({"path": str(f), "format": f.suffix.lstrip("."), "bytes": st.st_size,
                    "mtime_ns": st.st_mtime_ns})
    return out


def _fingerprint(sources: list[dict], val_fraction: float, shard_tokens: int) -> dict:
    from laplace_jax.data.tokenizer import TOKENIZER_NAME
    return {"format": FORMAT, "tokenizer": TOKENIZER_NAME, "val_fraction": float(val_fraction),
            "shard_tokens": int(shard_tokens), "sources": sources}


def _count(value, path: Path, key: str, fix: str) -> int:
    """A manifest field that must be a non-negative integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DataError(f"{path}: {key} is {value!r}, not a non-negative integer: {fix}")
    return value


def check_manifest(m, path: Path, fix: str) -> dict:
    """`m` (manifest.json's content at `path`) as the loader reads it, or a `DataError` naming the
    field and `fix`: the format and dtype, the splits' shard lists (<split>_00000.bin, ... in stream
    order, token counts that add up to the split's and the corpus's), max_token_id within the tokenizer's vocab.
    Unknown fields are kept (older or newer writers' extras). Reads no shard."""
    if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("dtype") != DTYPE:
        raise DataError(f"{path} is not a {FORMAT} manifest with dtype {DTYPE}: {fix}")
    if m.get("byte_order", "little") != "little":
        raise DataError(f"{path}: byte_order is {m.get('byte_order')!r}, the loader reads little-endian "
                        f"uint16: {fix}")
    splits, seen, total = m.get("splits"), set(), 0
    if not isinstance(splits, dict):
        raise DataError(f"{path}: splits is {splits!r}, not a mapping of {', '.join(SPLITS)}: {fix}")
    for split in SPLITS:
        info = splits.get(split)
        shards = info.get("shards") if isinstance(info, dict) else None
        if not isinstance(shards, list):
            raise DataError(f"{path}: splits.{split}.shards is missing or not a list: {fix}")
        tokens = 0
        for i, s in enumerate(shards):
            key = f"splits.{split}.shards[{i}]"
            name = s.get("file") if isinstance(s, dict) else None
            if name != f"{split}_{i:05d}.bin":   # as _SplitWriter names them: another split's shard (training
                # on held-out text), one listed twice or out of stream order is an edited list
                raise DataError(f"{path}: {key}.file is {name!r}, not {split}_{i:05d}.bin (a split's shards are "
                                f"numbered in stream order): {fix}")
            seen.add(name)
            tokens += _count(s.get("tokens"), path, f"{key}.tokens", fix)
        if _count(info.get("tokens"), path, f"splits.{split}.tokens", fix) != tokens:
            raise DataError(f"{path}: splits.{split}.tokens is {info['tokens']}, its shards hold {tokens}: {fix}")
        total += tokens
    if "tokens" in m and _count(m["tokens"], path, "tokens", fix) != total:
        raise DataError(f"{path}: tokens is {m['tokens']}, the splits hold {total}: {fix}")
    if m.get("max_token_id") is None:
        raise DataError(f"{path} lacks max_token_id, needed to check token ids against the model's vocab "
                        f"without reading every shard: {fix} (or add \"max_token_id\": <largest id in its "
                        f"shards> to it)")
    top = _count(m["max_token_id"], path, "max_token_id", fix)
    if "vocab_size" in m and top >= _count(m["vocab_size"], path, "vocab_size", fix):
        raise DataError(f"{path}: max_token_id {top} is not below the tokenizer's vocab_size {m['vocab_size']}: {fix}")
    stray = sorted(p.name for split in SPLITS for p in path.parent.glob(f"{split}_*.bin") if p.name not in seen)
    if stray:
        raise DataError(f"{path.parent} holds shard {stray[0]}, which {MANIFEST} does not list (another "
                        f"dataset's?): {fix}")
    return m


def read_manifest(out_dir: str | os.PathLike[str]) -> dict | None:
    """The manifest of a prepared folder, or None if absent/unreadable."""
    p = Path(out_dir) / MANIFEST
    try:
        m = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return m if isinstance(m, dict) and m.get("format") == FORMAT else None


def _intact(out: Path, manifest: dict) -> bool:
    """The manifest is whole (`check_manifest`) and its shards have their sizes."""
    try:
        check_manifest(manifest, out / MANIFEST, "")
        for split in SPLITS:
            for s in manifest["splits"][split]["shards"]:
                if (out / s["file"]).stat().st_size != 2 * s["tokens"]:
                    return False
    except (OSError, DataError):
        return False
    return True


# ----------------------------------------------------------------------------- prepare

def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def _ours(name: str) -> bool:
    """Files `prepare` itself puts in an output folder (an interrupted run may leave shards, no manifest)."""
    return (name in (MANIFEST, ".prepare.lock") or name.startswith(".prepare-tmp-")
            or any(name.startswith(f"{s}_") and name.endswith(".bin") for s in SPLITS))


def _check_out_dir(out: Path) -> None:
    """Refuse an --out that is a file, or a non-empty folder that is not a prepared dataset (a run dir,
    a source folder): nothing is written into it."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {str(out)!r} is a file: give a directory path")
    if not out.is_dir():
        return
    try:
        foreign = sorted(p.name for p in out.iterdir() if not _ours(p.name))
    except OSError as e:
        raise DataError(f"cannot read --out {str(out)!r} ({e.strerror}): choose a readable folder") from None
    if foreign:
        raise DataError(f"--out {str(out)!r} is not empty and is not a prepared dataset (it holds "
                        f"{', '.join(repr(n) for n in foreign[:3])}{', ...' if len(foreign) > 3 else ''}): "
                        f"give an empty or new folder")


def _difference(old: dict, new: dict) -> str:
    """What differs between two fingerprints, in words (for the refusal message)."""
    def paths(fp):   # a hand-edited manifest may hold anything
        sources = fp.get("sources") if isinstance(fp, dict) else None
        return [s.get("path") if isinstance(s, dict) else s for s in sources] if isinstance(sources, list) else []
    old = old if isinstance(old, dict) else {}
    if paths(old) != paths(new):
        return f"inputs ({', '.join(map(str, paths(old)[:2]))}{', ...' if len(paths(old)) > 2 else ''})"
    if old.get("sources") != new.get("sources"):
        return "versions of the inputs (sizes or modification times changed)"
    diff = [k for k in ("val_fraction", "shard_tokens", "tokenizer", "format") if old.get(k) != new.get(k)]
    return "settings (" + ", ".join(f"{k} {old.get(k)} -> {new.get(k)}" for k in diff) + ")"


def prepare(inputs, out_dir: str | os.PathLike[str], *, val_fraction: float = DEFAULT_VAL_FRACTION,
            workers: int = 2, shard_tokens: int = DEFAULT_SHARD_TOKENS, force: bool = False,
            progress: bool = True, replace: bool = False) -> dict:
    """Tokenize `inputs` (paths, see module doc) into shards in `out_dir`; returns the manifest.

    Idempotent: if `out_dir` already holds a manifest for the same inputs and settings (and its
    shards are intact), nothing is done and that manifest is returned; `force` tokenizes again anyway.
    A dataset of other inputs or settings is replaced only with `force` (or `replace`: a cache that is
    ours, like the demo's). Raises `DataError` (one line) on a missing/empty/malformed/non-UTF-8 input
    or an `out_dir` that is a file or a non-empty folder of something else; an existing output is never
    touched by a failed run.
    """
    if not 0 <= val_fraction < 1:
        raise DataError(f"--val-fraction {val_fraction}: must be in [0, 1)")
    if shard_tokens <= 0:
        raise DataError(f"--shard-tokens {shard_tokens}: must be positive")
    files = expand_inputs(inputs)
    for f in files:
        if f.stat().st_size == 0:
            raise DataError(f"input {str(f)!r} is empty: remove it from --input or fill it with text")
    sources = _source_info(files)
    fp = _fingerprint(sources, val_fraction, shard_tokens)
    out = Path(out_dir).expanduser()
    _check_out_dir(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = open(out / ".prepare.lock", "a")
    except OSError as e:
        raise DataError(f"cannot write to --out {str(out)!r} ({e.strerror}): choose a writable folder") from None
    quiet = not progress

    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # concurrent callers (e.g. 2 local processes) wait here
        old = read_manifest(out)
        if old is not None and old.get("fingerprint") == fp and _intact(out, old) and not force:
            _log(f"prepare: {out} is up to date ({old['splits']['train']['tokens']:,} train / "
                 f"{old['splits']['val']['tokens']:,} val tokens); nothing to do", quiet)
            return old
        if old is not None and old.get("fingerprint") != fp and not (force or replace):
            raise DataError(f"--out {str(out)!r} already holds a dataset prepared from other "
                            f"{_difference(old.get('fingerprint') or {}, fp)}: pass --force to replace it, "
                            f"or give another --out")
        for stale in out.glob(".prepare-tmp-*"):   # left by a killed run (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=".prepare-tmp-", dir=out))
        try:
            try:
                manifest = _write_shards(files, tmp, fp, val_fraction, workers, shard_tokens, progress)
            except OSError as e:   # e.g. the disk filled up: the previous dataset is still in place
                raise DataError(f"writing the token shards into {out} failed ({e.strerror}): free space or "
                                f"choose another --out; nothing in {out} was replaced") from None
            _install(tmp, out, manifest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _log(f"prepare: wrote {out}: {manifest['splits']['train']['tokens']:,} train tokens "
         f"({manifest['splits']['train']['documents']:,} docs), {manifest['splits']['val']['tokens']:,} "
         f"val tokens ({manifest['splits']['val']['documents']:,} docs)", quiet)
    return manifest


def _write_shards(files, tmp: Path, fp: dict, val_fraction: float, workers: int, shard_tokens: int,
                  progress: bool) -> dict:
    from laplace_jax.data import tokenizer as tkz   # constants only: workers build the tokenizer
    frac = Fraction(val_fraction).limit_denominator(1_000_000)
    writers = {s: _SplitWriter(tmp, s, shard_tokens) for s in SPLITS}
    t0 = time.time()
    bar = _progress_bar(progress)
    doc_index, total, max_id = 0, 0, -1
    try:
        for tokens, lengths, ends in _tokenize(iter_pieces(files), max(1, int(workers))):
            if tokens.size:
                max_id = max(max_id, int(tokens.max()))
            bounds = np.concatenate([[0], np.cumsum(lengths)])
            # a piece belongs to the document after the ones ended before it (a document may span chunks)
            doc_of = doc_index + np.concatenate([[0], np.cumsum(ends)[:-1]])
            split_of = ["val" if _is_val(int(d), frac) else "train" for d in doc_of]
            j = 0
            while j < len(lengths):   # consecutive pieces of the same split are written in one call
                k = j
                while k + 1 < len(lengths) and split_of[k + 1] == split_of[j]:
                    k += 1
                writers[split_of[j]].write(tokens[bounds[j]:bounds[k + 1]])
                writers[split_of[j]].documents += int(ends[j:k + 1].sum())
                j = k + 1
            done = int(ends.sum())
            doc_index += done
            total += tokens.size
            bar.update(done)
            bar.set_postfix_str(f"{total:,} tokens", refresh=False)
    finally:
        bar.close()
        splits = {s: w.close() for s, w in writers.items()}
    if doc_index == 0:
        raise DataError(f"the inputs hold no text ({', '.join(str(f) for f in files)}): "
                        f"give files with non-empty documents")
    if splits["train"]["tokens"] == 0:
        raise DataError(f"all {doc_index} document(s) went to the held-out split: "
                        f"lower --val-fraction or give more documents")
    if frac > 0 and splits["val"]["tokens"] == 0:  # cannot happen (document 0 is held out); kept as a guard
        raise DataError("the held-out split is empty: give at least 2 documents or pass --val-fraction 0")
    if max_id >= 2 ** 16:
        raise DataError(f"token id {max_id} does not fit uint16")
    dt = time.time() - t0
    return {
        "format": FORMAT,
        "tokenizer": tkz.TOKENIZER_NAME,
        "vocab_size": tkz.GPT2_VOCAB_SIZE,
        "eos_id": tkz.GPT2_EOS_ID,
        "dtype": DTYPE,
        "byte_order": "little",
        "max_token_id": max_id,
        "val_fraction": float(val_fraction),
        "shard_tokens": int(shard_tokens),
        "documents": doc_index,
        "tokens": total,
        "splits": splits,
        "sources": fp["sources"],
        "fingerprint": fp,
        "created_unix": round(time.time(), 3),
        "seconds": round(dt, 3),
        "demo_credit": DEMO_CREDIT if any(str(f) == str(_demo_or_none()) for f in files) else None,
    }


def _demo_or_none():
    try:
        return demo_corpus_path()
    except DataError:
        return None


def _progress_bar(enabled: bool):
    try:
        from tqdm.auto import tqdm
    except ModuleNotFoundError:  # tqdm is a dependency; fall back to a silent counter just in case
        enabled = False
        tqdm = None
    if not enabled or tqdm is None:
        class _Null:
            def update(self, n): pass
            def set_postfix_str(self, s, refresh=True): pass
            def close(self): pass
        return _Null()
    return tqdm(desc="tokenizing", unit=" docs", file=sys.stderr, dynamic_ncols=True)


def _install(tmp: Path, out: Path, manifest: dict) -> None:
    """Move finished shards from `tmp` into `out`; the manifest goes last (atomic rename)."""
    (out / MANIFEST).unlink(missing_ok=True)   # from here until the end `out` is visibly incomplete
    keep = set()
    for split in SPLITS:
        for s in manifest["splits"][split]["shards"]:
            os.replace(tmp / s["file"], out / s["file"])
            keep.add(s["file"])
    for split in SPLITS:   # stale shards of an earlier run with more shards
        for p in out.glob(f"{split}_*.bin"):
            if p.name not in keep:
                p.unlink()
    mtmp = tmp / MANIFEST
    mtmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(mtmp, out / MANIFEST)


# ----------------------------------------------------------------------------- demo corpus

def demo_cache_dir() -> Path:
    """`$LAPLACE_DATA_CACHE/demo_wiki`, default `~/.cache/laplace_jax/demo_wiki`."""
    root = os.environ.get("LAPLACE_DATA_CACHE") or Path.home() / ".cache" / "laplace_jax"
    return Path(root).expanduser() / "demo_wiki"


def ensure_demo_data(cache_dir: str | os.PathLike[str] | None = None, *,
                     val_fraction: float = DEFAULT_VAL_FRACTION, workers: int = 1,
                     progress: bool = True) -> Path:
    """Prepare the built-in demo corpus once (idempotent, process-safe); returns the shard folder.

    Cache folder: `cache_dir`, else `$LAPLACE_DATA_CACHE/demo_wiki`, else `~/.cache/laplace_jax/demo_wiki`.
    Tokenizes in-process by default (`workers=1`; HF tokenizers still uses its own threads, ~1 M tokens
    in a few seconds), so it is safe to call from any entry point, with or without a `__main__` guard.
    Concurrent callers (several local processes) serialize on a lock file; the first one prepares.
    """
    out = Path(cache_dir).expanduser() if cache_dir is not None else demo_cache_dir()
    prepare([demo_corpus_path()], out, val_fraction=val_fraction, workers=workers, progress=progress,
            replace=True)
    return out


# ----------------------------------------------------------------------------- CLI

def main(argv: Sequence[str] | None = None) -> int:
    ap = Parser(prog="python -m laplace_jax.data.prepare", description=__doc__.split("\n")[0])
    ap.add_argument("--input", nargs="+", required=True, metavar="PATH",
                    help=".txt/.jsonl/.parquet/.json files or directories, or `demo`")
    ap.add_argument("--out", required=True, metavar="DIR", help="output folder for shards + manifest.json")
    ap.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION,
                    help="fraction of documents held out (default %(default)s)")
    ap.add_argument("--workers", type=positive_int, default=2, help="tokenizer processes (default %(default)s)")
    ap.add_argument("--shard-tokens", type=positive_int, default=DEFAULT_SHARD_TOKENS,
                    help="tokens per shard file (default %(default)s)")
    ap.add_argument("--force", action="store_true",
                    help="tokenize again even if the output is up to date; replace a dataset of other inputs")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    try:
        prepare(args.input, args.out, val_fraction=args.val_fraction, workers=args.workers,
                shard_tokens=args.shard_tokens, force=args.force, progress=not args.quiet)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("error: interrupted; the output folder was left as it was", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
