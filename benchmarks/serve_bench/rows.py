"""The result rows (printed, appended to DIR/serve_rows.txt as they come, kept for the table and the
JSON) and the timestamped log."""
import json
import math
import threading
import time
from pathlib import Path

_T0 = time.time()


def log(msg: str) -> None:
    print(f"[serve_bench {time.time() - _T0:7.1f}s] {msg}", flush=True)


ROW_JSON = "ROWJSON "   # a child's row on its stdout, for the parent (full precision, types kept)


class Rows:
    """Result rows: printed, appended to DIR/serve_rows.txt at once, kept for the table/JSON.

    `forward` (a comparison's child): each row is also printed as one `ROWJSON {...}` line, which the
    parent reads from the pipe as it comes, instead of the `ROW` log line it would repeat."""

    def __init__(self, out: Path, forward: bool = False):
        self.path = out / "serve_rows.txt"
        self.rows = []
        self.forward = forward
        self.path.write_text("")

    def add(self, name: str, value, unit: str = "") -> None:
        row = {"name": name, "value": value, "unit": unit}
        self.rows.append(row)
        text = f"{value:.6g}" if isinstance(value, float) else str(value)
        line = f"{name} | {text} | {unit}"
        with open(self.path, "a") as f:
            f.write(line + "\n")
        if self.forward:
            print(ROW_JSON + json.dumps(row), flush=True)
        else:
            log("ROW " + line)


class Heartbeat:
    """Prints 'still running' every `every` seconds while a phase runs."""

    def __init__(self, what: str, every: float = 30.0):
        self.what, self.every = what, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        t0 = time.time()
        while not self._stop.wait(self.every):
            log(f"... {self.what}: {time.time() - t0:.0f}s")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()


def rows_table(rows: Rows) -> str:
    table = ["| measurement | value | unit |", "| --- | --- | --- |"]
    for r in rows.rows:
        v = r["value"]
        table.append(f"| {r['name']} | {f'{v:.4g}' if isinstance(v, float) else v} | {r['unit']} |")
    return "\n".join(table) + "\n"


def all_finite(rows: Rows) -> bool:
    return not [r for r in rows.rows if isinstance(r["value"], float) and not math.isfinite(r["value"])]

