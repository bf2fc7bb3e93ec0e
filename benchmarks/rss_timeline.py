"""Host memory of a command over its run, beside what it logged (issue 34 item 4: which phase of the
trainer holds the memory):

    python benchmarks/rss_timeline.py [--every 0.25] [--out rss.tsv] -- python -m laplace_jax.train ...

Samples the command's resident set (Linux VmRSS) every --every seconds while passing its stderr
through. At the end prints each stderr line (progress-bar updates dropped) with the RSS when it
came and the highest RSS since the line before, then the peak and the line it followed. --out
writes every sample (seconds, GiB). Exits with the command's status.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

GIB = 2 ** 30


def rss_bytes(pid: int) -> int | None:
    """VmRSS of process `pid` in bytes, or None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _pump(stream, lines: list[tuple[float, str]], t0: float) -> None:
    """Echo `stream` to stderr; keep its lines (split at newlines and carriage returns) with their times."""
    for raw in stream:
        sys.stderr.write(raw)
        for part in raw.replace("\r", "\n").splitlines():
            if part.strip() and not part.rstrip().endswith(("it/s]", "step/s]", "s/step]")):   # progress bars
                lines.append((time.perf_counter() - t0, part.strip()))


def run(cmd: list[str], every: float) -> tuple[int, list[tuple[float, int]], list[tuple[float, str]]]:
    """Run `cmd`; (exit status, RSS samples (s, bytes), stderr lines (s, text))."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, bufsize=1)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=_pump, args=(proc.stderr, lines, t0), daemon=True)
    reader.start()
    samples = []
    while proc.poll() is None:
        rss = rss_bytes(proc.pid)
        if rss is not None:
            samples.append((time.perf_counter() - t0, rss))
        time.sleep(every)
    reader.join(timeout=10)
    return proc.returncode, samples, lines


def _at(samples: list[tuple[float, int]], t: float) -> int:
    earlier = [r for s, r in samples if s <= t]
    return earlier[-1] if earlier else 0


def report(samples: list[tuple[float, int]], lines: list[tuple[float, str]]) -> str:
    """Each line with the RSS at it and the peak since the line before; then the overall peak."""
    out, prev = [], 0.0
    for t, text in lines:
        now = _at(samples, t)
        window = [r for s, r in samples if prev <= s <= t] or [now]
        out.append(f"{t:8.1f} s  rss {now / GIB:6.2f} GiB  peak since {max(window) / GIB:6.2f} GiB  {text[:110]}")
        prev = t
    if samples:
        t_peak, peak = max(samples, key=lambda s: s[1])
        before = [text for t, text in lines if t <= t_peak]
        out.append(f"peak RSS {peak / GIB:.2f} GiB at {t_peak:.1f} s, after: {before[-1][:110] if before else '-'}")
        tail = [r for s, r in samples if s > (lines[-1][0] if lines else 0)]
        if tail:
            out.append(f"after the last line: peak {max(tail) / GIB:.2f} GiB")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--every", type=float, default=0.25, help="seconds between samples")
    ap.add_argument("--out", default=None, help="write the samples here (seconds, GiB; tab-separated)")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command")
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("give the command after --")
    status, samples, lines = run(cmd, a.every)
    if a.out:
        Path(a.out).write_text("".join(f"{t:.2f}\t{r / GIB:.3f}\n" for t, r in samples))
    print(report(samples, lines))
    return status


if __name__ == "__main__":
    sys.exit(main())
