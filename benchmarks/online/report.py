"""Rows from the client results, the SLO figure, the markdown tables and the latency-throughput plot.

A row is a flat dict: server / model / mode, workload / shape / rate ("inf" for all-at-once), the
client's figures in `vllm bench serve`'s keys (request_throughput, output_throughput,
median_ttft_ms, p99_ttft_ms, ... for ttft, tpot, itl, e2el), requested / completed / failed,
jit_lines (JIT-monitor lines the server logged during the run), prefix_cache_hits / _queries (the
server's counters' increase over the run, in tokens; warm-up requests included).
"""
import math
from typing import Optional

from online.workloads import Run

METRICS = ("ttft", "tpot", "itl", "e2el")
KEYS = ("request_throughput", "output_throughput", "duration") + tuple(
    f"{s}_{m}_ms" for m in METRICS for s in ("median", "p99", "mean"))
MT_KEYS = tuple(f"{s}_ttft_{t}_ms" for t in ("first_turn", "later_turns") for s in ("median", "p99")) + (
    "median_itl_held_ms", "itl_held_count")
SLO_TTFT_MS, SLO_TPOT_MS = 1000.0, 50.0     # issue 32: p99 TTFT <= 1 s and p99 TPOT <= 50 ms
HELD_FRACTION = 0.9                          # without a rate-inf row: achieved >= 0.9 x offered


def rate_value(rate: float):
    """A rate as JSON holds it: the number, or "inf"."""
    return "inf" if math.isinf(rate) else rate


def rate_of(row: dict) -> float:
    return math.inf if row["rate"] == "inf" else float(row["rate"])


def make_row(server: str, model: str, mode: str, run: Run, res: dict, error: Optional[str], jit: int,
             counters: dict, seconds: float) -> dict:
    """The row of one run from its client result `res` (empty when the client failed: `error`)."""
    row = {"server": server, "model": model, "mode": mode, "workload": run.workload, "shape": run.shape,
           "rate": rate_value(run.rate), "label": run.label, "concurrency": run.concurrency, "warmup": run.warmup,
           "requested": res.get("num_prompts", run.prompts * run.turns), "completed": res.get("completed", 0),
           "failed": res.get("failed"), "error": error, "jit_lines": jit, "wall_s": round(seconds, 1),
           "prefix_cache_hits": counters.get("prefix_cache_hits", 0.0),
           "prefix_cache_queries": counters.get("prefix_cache_queries", 0.0), "cli": res.get("cli")}
    row.update({k: res.get(k) for k in KEYS + (MT_KEYS if run.workload == "multiturn" else ())})
    return row


def _num(v, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and math.isfinite(v) else "n/a"


def _ms(v) -> str:
    return _num(v, ",.0f") if isinstance(v, (int, float)) and abs(v) >= 100 else _num(v, ".1f")


def row_line(row: dict) -> str:
    """One line: achieved req/s, output tok/s, TTFT/TPOT/ITL p50/p99, JIT lines, cache hits."""
    if row.get("error"):
        return f"FAILED: {row['error']}"
    hit = hit_rate(row)
    return (f"{row['completed']}/{row['requested']} done, {_num(row['request_throughput'], '.2f')} req/s, "
            f"{_num(row['output_throughput'], ',.0f')} tok/s, TTFT {_ms(row['median_ttft_ms'])}/"
            f"{_ms(row['p99_ttft_ms'])} ms, TPOT {_ms(row['median_tpot_ms'])}/{_ms(row['p99_tpot_ms'])}, "
            f"ITL {_ms(row['median_itl_ms'])}/{_ms(row['p99_itl_ms'])} (p50/p99), JIT +{row['jit_lines']}"
            + (f", cache hits {hit:.0%}" if hit is not None else ""))


def hit_rate(row: dict) -> Optional[float]:
    """Prefix-cache hit tokens / queried tokens during the run; None when nothing was queried."""
    q = row.get("prefix_cache_queries") or 0.0
    return row["prefix_cache_hits"] / q if q > 0 else None


# ----------------------------------------------------------------------------- the SLO figure

def held(offered: float, achieved: float, capacity: Optional[float] = None,
         fraction: float = HELD_FRACTION) -> bool:
    """Whether a finite offered rate is one the server sustains.

    With `capacity` (the requests/s the same server completed in its rate-inf run: every request at
    t = 0, the most it finishes per second): offered <= capacity.  A short Poisson run cannot show
    this by itself: its achieved rate is n / (arrival span + the last requests' latency), below the
    offered rate for a server that keeps up (10.7 of 12 req/s on an H200, run S14), and above the
    server's capacity for a burst it absorbs by letting every request in and slowing them all (the
    Llama peer: 14.6 req/s achieved at 24 offered, its rate-inf capacity 14.8).  Without a capacity:
    achieved >= `fraction` x offered.  Rate inf offers no rate to hold."""
    if not math.isfinite(offered):
        return False
    return offered <= capacity if capacity is not None else achieved >= fraction * offered


def meets_slo(row: dict, ttft_ms: float = SLO_TTFT_MS, tpot_ms: float = SLO_TPOT_MS) -> bool:
    """p99 TTFT <= ttft_ms and p99 TPOT <= tpot_ms, every request completed."""
    ok = row.get("completed") == row.get("requested") and not row.get("error")
    t, p = row.get("p99_ttft_ms"), row.get("p99_tpot_ms")
    return bool(ok and t is not None and p is not None and t <= ttft_ms and p <= tpot_ms)


def capacity(rows: list[dict]) -> Optional[float]:
    """The achieved requests/s of the series' rate-inf run (all requests at t = 0), if it ran whole."""
    inf = [r for r in rows if "skipped" not in r and math.isinf(rate_of(r)) and not r.get("error")
           and r.get("completed") == r.get("requested") and r.get("request_throughput")]
    return max(r["request_throughput"] for r in inf) if inf else None


def max_rate_under_slo(rows: list[dict]) -> dict:
    """{"rate": the highest swept rate held and within the SLO (None if none), "failing_below": lower
    swept rates that were not (a JIT spike at a light load shows here), "capacity": the rate-inf
    run's requests/s that `held` measures against (None: no such run)} over `rows` of one series."""
    cap = capacity(rows)
    rated = sorted((r for r in rows if "skipped" not in r and math.isfinite(rate_of(r))), key=rate_of)
    good = [rate_of(r) for r in rated
            if held(rate_of(r), r.get("request_throughput") or 0.0, cap) and meets_slo(r)]
    best = max(good) if good else None
    below = [rate_of(r) for r in rated if best is not None and rate_of(r) < best and rate_of(r) not in good]
    return {"rate": best, "failing_below": below, "capacity": cap}
