"""One trainer per run dir: an exclusive `flock` on `RUN_DIR/.lock`, held for the trainer's lifetime.

The lock belongs to the open file, so the kernel drops it when the process dies in any way (exit,
exception, SIGKILL, OOM kill): a crashed run never leaves the dir stuck, and there is no stale-lock
cleanup to get wrong. The file also holds the owner (pid, host, start time), only to name it in the
error a second trainer prints; the lock, not the file's content, decides. The file is never deleted
(deleting it would let a third trainer lock a fresh file while the second still holds the old one).

Multi-host runs: only process 0 takes the lock. It is the process that writes `config.yaml`,
`metrics.jsonl` and the checkpoint metadata, and the other processes of a run follow it (its verdict is
broadcast to them, so a second multi-host run stops on every host at once). On NFS, Linux emulates
`flock` with POSIX byte-range locks that the server arbitrates, so two hosts sharing a run dir see
each other's lock (NFSv4, or v3 with lockd); a filesystem without locks makes `flock` fail and the
trainer refuses to start rather than run unguarded.

Readers (`export`, `generate`) take no lock: a run dir being trained can be exported from at any time,
its committed checkpoints are complete.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
from pathlib import Path

LOCK_NAME = ".lock"


class RunDirBusy(RuntimeError):
    """Another live trainer holds the run dir; the message names it and the fix."""


class RunDirLock:
    """Holds `run_dir/.lock` until `release()` or process death."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> "RunDirLock":
        """Take the lock or raise `RunDirBusy` (one line; the holder's files are not touched)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirBusy(f"cannot create the run dir lock {self.path} ({e.strerror}): "
                             f"use a --run-dir in a writable folder") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            owner = _read_owner(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunDirBusy(f"run dir {self.path.parent} is in use by another trainer ({owner}): wait for it "
                                 f"to finish or stop it, or train in another --run-dir") from None
            raise RunDirBusy(f"cannot lock the run dir {self.path.parent} ({e.strerror}; its filesystem may not "
                             f"support locks): use a --run-dir on a local or lock-capable filesystem") from None
        started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        owner = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, owner + b"\n", 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)   # closing the file drops the flock
            self._fd = None


def _read_owner(fd: int) -> str:
    """The holder as words, from the lock file (best effort: it may be mid-write)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "owner unknown"
