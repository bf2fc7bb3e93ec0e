"""An export folder is whole or absent: written into a temporary sibling, renamed into place at the end.

`staged_folder(out, overwrite)` yields `.<name>.export-tmp-<pid>-<hex>` next to `out` (same parent,
so the final rename stays on one filesystem); when the block ends without an error the folder becomes
`out`, and on an error it is removed. A process killed while writing leaves only that hidden sibling
(removed by the next export to the same `out`, once its pid is gone) and no folder at `out` that looks
like a model.

Replacing (`overwrite`): `out` may be missing, an empty folder, or a Laplace export (its config.json
says model_type "laplace"); anything else is refused, so --overwrite never deletes a folder of other
files. The previous export stays whole at `out` until the new one is complete; then it is renamed
aside (`.<name>.export-old-<pid>-<hex>`), the new one renamed in, and the old one deleted. Killed
between those two renames, `out` is absent and the previous export is whole in that `-old-` sibling.
The whole folder is replaced: files someone added to the old export are not carried over.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import sys
import time
from pathlib import Path
from typing import Iterator

from export.torch_model import CONFIG_NAME

PAUSE_ENV = "LAPLACE_EXPORT_PAUSE_AT"   # tests only: see `pause_point`


class OutDirError(ValueError):
    """--out cannot take the export; the message names the folder and the fix."""


def pause_point(stage: str) -> None:
    """Tests kill an export at named stages (tests/serve/test_export_atomic.py): with LAPLACE_EXPORT_PAUSE_AT
    set to `stage`, say so on stderr and wait here to be killed. Does nothing otherwise."""
    if os.environ.get(PAUSE_ENV) == stage:
        print(f"export: paused at {stage}", file=sys.stderr, flush=True)
        while True:
            time.sleep(1)


def is_export(folder: Path) -> bool:
    """A folder whose config.json names the Laplace model type (what `python -m export` writes)."""
    try:
        return json.loads((folder / CONFIG_NAME).read_text()).get("model_type") == "laplace"
    except (OSError, ValueError, AttributeError):
        return False


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse an --out that is a file, a non-empty folder without --overwrite, or (with it) a non-empty
    folder that is not an export: before any parameter is read."""
    if out.exists() and not out.is_dir():
        raise OutDirError(f"--out {out}: exists and is not a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise OutDirError(f"--out {out}: directory is not empty; pass --overwrite or choose another")
    if not is_export(out):
        names = sorted(p.name for p in out.iterdir())
        raise OutDirError(f"--out {out}: holds files that are not a Laplace export ({', '.join(names[:3])}"
                          f"{', ...' if len(names) > 3 else ''}): --overwrite replaces only an earlier export; "
                          f"choose an empty or new folder")


def _sibling(out: Path, kind: str) -> Path:
    return out.parent / f".{out.name}.export-{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process
        return True
    return True


def _remove_stale(out: Path) -> None:
    """Temporary siblings of `out` left by killed exports (their process is gone). A killed replace's
    `-old-` folder is the previous export: kept, for its owner to move back."""
    for p in out.parent.glob(f".{out.name}.export-tmp-*"):
        pid = p.name.rsplit("-", 2)[-2]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def staged_folder(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield an empty temporary sibling of `out`; on success it becomes `out` (see module doc)."""
    out = Path(out).absolute()
    check_out_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(out)
    tmp = _sibling(out, "tmp")
    tmp.mkdir()   # the umask's mode, as a plain mkdir (not mkdtemp's 0700)
    try:
        pause_point("staged")
        yield tmp
        pause_point("written")
        _install(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _install(tmp: Path, out: Path, overwrite: bool) -> None:
    check_out_dir(out, overwrite)   # again: something may have appeared while we wrote
    if out.is_dir() and any(out.iterdir()):
        old = _sibling(out, "old")
        os.rename(out, old)
        pause_point("swapping")
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        if out.is_dir():
            out.rmdir()   # empty: a rename may replace it, but only on some filesystems
        os.rename(tmp, out)
