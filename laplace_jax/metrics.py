"""Where a run's per-step metrics go: hooks the trainer calls once per step (process 0 only).

- `JsonlLog`:       `RUN/metrics.jsonl`, one strict-JSON object per step (non-finite values as null);
- `TensorBoardLog`: `RUN/tensorboard/`, the scalars for TensorBoard;
- `ProgressBar`:    a tqdm bar on stderr, and the trainer's notes.

A resumed run restarts from its last checkpoint, so both logs drop what the killed run wrote past it:
`metrics.jsonl` is rewritten without those rows (atomically: a copy, then a rename), and the TensorBoard
writer starts with a purge marker at the restored step + 1, which TensorBoard's reader uses to hide the
older events of those steps (the event files are append-only). A step thus appears once in each.

The TensorBoard writer is `tensorboardX`: a few hundred kB of pure Python over protobuf, no TensorFlow
and no torch; it writes the standard event files that `tensorboard` (installed wherever the logs are
viewed) reads. Writing them with the `tensorboard` package itself would pull its server (grpcio,
werkzeug, the data server) into every training install.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol

# metrics.jsonl key -> TensorBoard tag
TB_TAGS = {"loss": "train/loss", "eval_loss": "eval/loss", "grad_norm": "train/grad_norm", "lr": "train/lr",
           "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu", "step_time_s": "perf/step_time_s"}


class MetricsHook(Protocol):
    def log(self, rec: dict[str, Any], show: bool) -> None: ...
    def close(self) -> None: ...


def finite_or_null(rec: dict[str, Any]) -> dict[str, Any]:
    """A metrics row as strict JSON: a non-finite float (nan, inf) is written as null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}


def parse_rows(text: str) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl's text; a torn line (a kill mid-write) is skipped."""
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def truncate_rows(path: Path, last_step: int) -> None:
    """Keep only the rows of steps <= `last_step` (a restored checkpoint's step, 0 for a fresh start);
    atomic: a reader sees the old file or the new one, never half of it."""
    if not path.exists():
        return
    text = path.read_text()
    keep = [r for r in parse_rows(text) if r["step"] <= last_step]
    if len(keep) == len(text.splitlines()) and text.endswith("\n"):
        return   # nothing to drop
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r, allow_nan=False) + "\n" for r in keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class JsonlLog:
    """Appends one line per step to `run_dir/metrics.jsonl`, dropping rows past `resumed_step` first."""

    def __init__(self, run_dir: Path, resumed_step: int):
        self.path = run_dir / "metrics.jsonl"
        truncate_rows(self.path, resumed_step)
        self.file = open(self.path, "a")

    def log(self, rec: dict[str, Any], show: bool) -> None:
        self.file.write(json.dumps(finite_or_null(rec), allow_nan=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardLog:
    """Scalars of `TB_TAGS` to `run_dir/tensorboard/`, written and flushed by the calling thread every
    step, so a kill loses nothing logged. (tensorboardX's SummaryWriter hands events to a background
    thread whose queue its `flush()` does not drain: a SIGKILL right after a step could lose that
    step's row.) The file is the one SummaryWriter writes: a version event, then, for a resumed run,
    a session START at the first new step, which tells TensorBoard to drop any later steps that
    earlier files hold (SummaryWriter's `purge_step`)."""

    def __init__(self, run_dir: Path, resumed_step: int):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        folder = run_dir / "tensorboard"
        folder.mkdir(parents=True, exist_ok=True)
        # the suffix keeps two writers started within one second (the name holds seconds) from sharing a file
        self.events = EventsWriter(str(folder / "events"), filename_suffix=f".{time.time_ns()}")
        self.events.write_event(Event(step=resumed_step + 1, session_log=SessionLog(status=SessionLog.START)))
        self.events.flush()

    def log(self, rec: dict[str, Any], show: bool) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import scalar

        for key, tag in TB_TAGS.items():
            v = rec.get(key)
            if isinstance(v, (int, float)) and math.isfinite(v):
                self.events.write_event(Event(wall_time=time.time(), step=rec["step"], summary=scalar(tag, v)))
        self.events.flush()

    def close(self) -> None:
        self.events.close()


class ProgressBar:
    """A tqdm bar with the latest loss, grad norm, LR, throughput and MFU; `note` prints above it."""

    def __init__(self, total: int, start: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr,
                        mininterval=1.0)

    def log(self, rec: dict[str, Any], show: bool) -> None:
        self.bar.update(1)
        if show:
            mfu = f" mfu {rec['mfu']:.1%}" if rec.get("mfu") is not None else ""
            self.bar.set_postfix_str(f"loss {rec['loss']:.3f} gnorm {rec['grad_norm']:.2f} lr {rec['lr']:.2e} "
                                     f"{rec['tokens_per_s']:,.0f} tok/s{mfu}", refresh=False)

    def note(self, msg: str) -> None:
        self.bar.write(msg, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()


class RunLog:
    """Fans a step's row out to every hook; an empty hook list (processes other than 0) does nothing."""

    def __init__(self, hooks: list[MetricsHook], bar: ProgressBar | None = None):
        self.hooks, self.bar = hooks, bar

    @classmethod
    def for_run(cls, run_dir: Path, total: int, resumed_step: int, enabled: bool) -> "RunLog":
        if not enabled:
            return cls([])
        bar = ProgressBar(total, resumed_step)
        return cls([JsonlLog(run_dir, resumed_step), TensorBoardLog(run_dir, resumed_step), bar], bar)

    def log(self, rec: dict[str, Any], show: bool) -> None:
        for h in self.hooks:
            h.log(rec, show)

    def note(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.note(msg)

    def close(self) -> None:
        for h in self.hooks:
            h.close()
