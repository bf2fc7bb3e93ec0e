"""Is an exported folder whole and self-consistent? The readers of the one check every loader runs.

`export.torch_model.check_folder(path)` (there, beside the model whose shapes it compares with) reads
config.json strictly (every architecture key present and valid: a key
left out is an error, never the 3B default; the generic names transformers and vLLM read agree with
ours) and model.safetensors' header only (no tensor data: cheap at any size), and compares the
tensors' names and shapes with what the config's model holds. It raises `FolderError`, one line
naming the file, the key and the fix. Called by torch_model's `from_pretrained`, by the transformers
wrapper (hf_modeling) and by the vLLM model before any weight is allocated; shipped in every folder
as remote code, so it imports only the standard library and the spec; it imports no module of
export (torch_model imports it: one direction).
"""
import dataclasses
import json
import os
import struct
from typing import Any

from laplace_jax.spec import HF_GENERIC, JSON_RENAMED, Arch, ConfigError

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"

FIX = "re-export the checkpoint with `python -m export` (or restore the file)"
FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}


class FolderError(ValueError):
    """An exported folder that cannot be loaded as it is; one line naming file, key and fix."""


class FolderFileMissing(FolderError, FileNotFoundError):
    """config.json or model.safetensors is not there."""


def json_keys() -> dict[str, str]:
    """`spec.Arch` field → its config.json key."""
    return {f.name: JSON_RENAMED.get(f.name, f.name) for f in dataclasses.fields(Arch)}


def arch_from_json(d: dict, where: str) -> Arch:
    """The architecture a config.json dict names (`where`: the file, for messages): every key present,
    integers where the architecture counts, valid together, the generic names equal to ours."""
    theirs = json_keys()
    missing = [key for key in theirs.values() if key not in d]
    if missing:
        raise FolderError(f"{where}: lacks {missing[0]} (the architecture is not guessed): add it or {FIX}")
    ints = [theirs[f.name] for f in dataclasses.fields(Arch) if f.type in (int, "int")]
    bad = next((k for k in ints if isinstance(d[k], bool) or not isinstance(d[k], int)), None)
    if bad is not None:
        raise FolderError(f"{where}: {bad}={d[bad]!r}: must be an integer: edit it or {FIX}")
    try:
        arch = Arch(**{ours: d[key] for ours, key in theirs.items()})
    except (ConfigError, TypeError) as e:
        raise FolderError(f"{where}: {str(e).replace('model.', '')}: edit it or {FIX}") from None
    for generic, ours in HF_GENERIC.items():
        if generic in d and d[generic] != getattr(arch, ours):
            raise FolderError(f"{where}: {generic}={d[generic]!r} but {theirs[ours]}={getattr(arch, ours)!r} "
                              f"(vLLM and transformers read {generic}): make them equal")
    return arch


def read_arch(path: str) -> Arch:
    """The architecture config.json (at `path`) names (`arch_from_json`)."""
    try:
        with open(path, "rb") as f:
            d = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise FolderFileMissing(f"{path}: missing: {FIX}") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise FolderError(f"{path}: unreadable ({type(e).__name__}): {FIX}") from None
    if not isinstance(d, dict):
        raise FolderError(f"{path}: holds a JSON {type(d).__name__}, not an object: {FIX}")
    return arch_from_json(d, path)


def read_header(path: str) -> dict[str, Any]:
    """model.safetensors' tensor table {name: {"dtype", "shape", "data_offsets"}}, checked against the
    file's size (a file cut short is named here, not by a reader deep in a loader)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else size
            table = json.loads(f.read(n).decode("utf-8")) if n <= size - 8 else None
    except FileNotFoundError:
        raise FolderFileMissing(f"{path}: missing: {FIX}") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise FolderError(f"{path}: unreadable header ({type(e).__name__}): {FIX}") from None
    if table is None:
        raise FolderError(f"{path}: {size} bytes, not a safetensors file (or cut short): {FIX}")
    if not isinstance(table, dict):
        raise FolderError(f"{path}: its header is not a tensor table: {FIX}")
    table.pop("__metadata__", None)
    end = 0
    for name, t in table.items():
        ok = (isinstance(t, dict) and isinstance(t.get("shape"), list) and isinstance(t.get("data_offsets"), list)
              and len(t["data_offsets"]) == 2 and all(isinstance(x, int) for x in t["shape"] + t["data_offsets"]))
        if not ok:
            raise FolderError(f"{path}: the header's entry for {name} is malformed: {FIX}")
        if t.get("dtype") not in FLOAT_BYTES:
            raise FolderError(f"{path}: {name} has dtype {t.get('dtype')!r}, not a float: {FIX}")
        begin, stop = t["data_offsets"]
        if stop - begin != FLOAT_BYTES[t["dtype"]] * _prod(t["shape"]) or min(t["shape"], default=0) < 0:
            raise FolderError(f"{path}: {name}'s data offsets {t['data_offsets']} do not hold its "
                              f"{t['dtype']} shape {t['shape']}: {FIX}")
    for name, t in sorted(table.items(), key=lambda kv: kv[1]["data_offsets"]):
        if t["data_offsets"][0] != end:   # the tensors tile the data, without gaps or overlaps
            raise FolderError(f"{path}: {name}'s data offsets {t['data_offsets']} overlap or leave a gap: {FIX}")
        end = t["data_offsets"][1]
    if 8 + n + end != size:
        raise FolderError(f"{path}: {size} bytes, its header describes {8 + n + end}: the file is cut short "
                          f"or extended: {FIX}")
    return table


def _prod(shape: list[int]) -> int:
    out = 1
    for x in shape:
        out *= x
    return out
