"""The markdown tables (Laplace and the peer side by side, Laplace/peer ratios), the SLO lines and
the latency-throughput plot of a call's rows (report.py's rows)."""
import math
from pathlib import Path
from typing import Optional

from online.report import SLO_TPOT_MS, SLO_TTFT_MS, _ms, _num, hit_rate, max_rate_under_slo, rate_of
from online.workloads import rate_text

PEER = "llama"


def measured(rows: list[dict], server: str, workload: str, shape: Optional[str] = None) -> list[dict]:
    """The measured rows (no warm-up, not skipped, not failed) of one server and workload (and shape),
    by rate."""
    got = [r for r in rows if r["server"] == server and r["workload"] == workload and not failed(r)
           and (shape is None or r["shape"] == shape)]
    return sorted(got, key=rate_of)


def failed(row: dict) -> bool:
    """A warm-up, skipped or failed row (a client error, or not every request completed): not in the tables."""
    return bool(row.get("warmup") or "skipped" in row or row.get("error") or not row.get("completed")
                or row["completed"] != row["requested"])


def _ratio(a, b) -> str:
    ok = all(isinstance(v, (int, float)) and math.isfinite(v) for v in (a, b)) and b > 0
    return f" ({a / b:.2f}x)" if ok else ""


def _pair(a: Optional[dict], b: Optional[dict], key: str, fmt=_ms, ratio: bool = True) -> str:
    """'L / P (L/P x)' of `key` in rows a (Laplace) and b (peer)."""
    va, vb = (r.get(key) if r else None for r in (a, b))
    return f"{fmt(va)} / {fmt(vb)}" + (_ratio(va, vb) if ratio else "")


def general_server(rows: list[dict]) -> str:
    """The Laplace server that ran the sweep / shapes / single workloads (the first Laplace server)."""
    for r in rows:
        if r["model"] == "laplace" and r["workload"] not in ("prefix", "multiturn"):
            return r["server"]
    return next((r["server"] for r in rows if r["model"] == "laplace"), "laplace")


def rate_table(rows: list[dict], lap: str, workload: str, shape: str) -> str:
    """One line per rate: achieved req/s, output tok/s, TTFT/TPOT/ITL p50 and p99, JIT lines."""
    a, b = measured(rows, lap, workload, shape), measured(rows, PEER, workload, shape)
    rates = sorted({rate_of(r) for r in a + b})
    head = ("| rate | req/s | output tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | ITL p50 | ITL p99 "
            "| JIT lines |")
    lines = [f"{workload} {shape} (prompt/output tokens); each cell Laplace / Llama (ratio), times in ms", "",
             head, "|---" * 10 + "|"]
    for x in rates:
        ra, rb = (next((r for r in rs if rate_of(r) == x), None) for rs in (a, b))
        cells = [_pair(ra, rb, "request_throughput", lambda v: _num(v, ".1f"), False),
                 _pair(ra, rb, "output_throughput", lambda v: _num(v, ",.0f"))]
        cells += [_pair(ra, rb, f"{s}_{m}_ms") for m in ("ttft", "tpot", "itl") for s in ("median", "p99")]
        cells.append(_pair(ra, rb, "jit_lines", lambda v: _num(v, "d"), False))
        lines.append(f"| {rate_text(x)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def single_table(rows: list[dict], lap: str) -> str:
    """A lone request (client concurrency 1) per prompt length: TTFT p50/p99, TPOT p50, ITL p99."""
    a, b = measured(rows, lap, "single"), measured(rows, PEER, "single")
    lines = ["single: one request at a time; each cell Laplace / Llama (ratio), ms", "",
             "| prompt/output tokens | TTFT p50 | TTFT p99 | TPOT p50 | ITL p99 |", "|---" * 5 + "|"]
    for shape in dict.fromkeys(r["shape"] for r in a + b):
        ra = next((r for r in a if r["shape"] == shape), None)
        rb = next((r for r in b if r["shape"] == shape), None)
        cells = [_pair(ra, rb, k) for k in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_itl_ms")]
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _caching_cells(at: dict, key: str, on: Optional[str], off: Optional[str], multiturn: bool) -> list[str]:
    """The cells of one (shape, rate) of caching_table; `at` holds each server's row (or None)."""
    def each(k: str) -> str:
        return " / ".join(_ms(r.get(k)) if r else "n/a" for r in at.values())

    def ratio(a: Optional[str], b: Optional[str]) -> str:
        va, vb = ((at.get(s) or {}).get(key) if s else None for s in (a, b))
        return _ratio(va, vb).strip(" ()") or "n/a"

    rates = [hit_rate(r) if r else None for r in at.values()]
    hits = " / ".join("n/a" if h is None else f"{h:.0%}" for h in rates)
    return [each("median_ttft_ms"), each("p99_ttft_ms")] + ([each(key), each("median_itl_held_ms")] if multiturn
                                                              else []) + [ratio(on, off), ratio(on, PEER), hits]


def caching_table(rows: list[dict], workload: str) -> str:
    """Per rate: TTFT p50/p99 of Laplace with caching on, off and the peer; the ratios on/off and
    on/peer of the p50 (multiturn: of the later turns' p50); prefix-cache hit rates."""
    servers = list(dict.fromkeys(r["server"] for r in rows if r["workload"] == workload and r["model"] == "laplace"))
    series = {s: measured(rows, s, workload) for s in servers + [PEER]}
    on = next((s for s in servers if s.endswith("cache-on")), None)
    off = next((s for s in servers if s.endswith("cache-off")), None)
    mt = workload == "multiturn"
    key = "median_ttft_later_turns_ms" if mt else "median_ttft_ms"
    head = "| shape | rate | TTFT p50 | TTFT p99 | " + ("later turns TTFT p50 | held-step gap p50 | " if mt else "") + \
        "p50 on/off | p50 on/Llama | hits |"
    lines = [f"{workload}: each cell {' / '.join(servers + [PEER])}; ms; hits = prefix-cache hit tokens / queried "
             "tokens" + ("; held-step gap: a running turn's inter-token gap over 2x the median (a step that also "
                          "held a prefill)" if mt else ""), "", head, "|---" * (9 if mt else 7) + "|"]
    for shape, x in dict.fromkeys((r["shape"], rate_of(r)) for rs in series.values() for r in rs):
        at = {s: next((r for r in rs if r["shape"] == shape and rate_of(r) == x), None) for s, rs in series.items()}
        lines.append(f"| {shape} | {rate_text(x)} | " + " | ".join(_caching_cells(at, key, on, off, mt)) + " |")
    return "\n".join(lines) + "\n"


def slo_lines(rows: list[dict], lap: str) -> tuple[str, dict]:
    """Each model's max request rate under the SLO over its sweep rows; (text, {model: result})."""
    res = {m: max_rate_under_slo(measured(rows, s, "sweep")) for m, s in (("laplace", lap), (PEER, PEER))}
    text = [f"Max request rate under the SLO (p99 TTFT <= {SLO_TTFT_MS:.0f} ms, p99 TPOT <= {SLO_TPOT_MS:.0f} ms, "
            f"offered rate <= the server's rate-inf capacity, else achieved >= 0.9 x offered; sweep rows):"]
    for m, r in res.items():
        worse = (f"; not met at lower rate(s) {', '.join(map(rate_text, r['failing_below']))}"
                 if r["failing_below"] else "")
        cap = (f" (capacity {r['capacity']:.1f} req/s)" if r.get("capacity")
               else " (no rate-inf run: achieved >= 0.9 x offered)")
        text.append(f"- {m}: {rate_text(r['rate']) + ' req/s' if r['rate'] else 'none of the swept rates'}"
                    f"{cap}{worse}")
    a, b = res["laplace"]["rate"], res[PEER]["rate"]
    if a and b:
        text.append(f"- ratio laplace/{PEER}: {a / b:.2f}x")
    return "\n".join(text) + "\n", res


def markdown(rows: list[dict], servers: list[dict], header: str) -> tuple[str, dict]:
    """The whole report: header, every table of the workloads that ran, SLO lines, servers; (md, slo)."""
    lap = general_server(rows)
    parts = [header]
    for w in ("sweep", "shapes"):
        for shape in dict.fromkeys(r["shape"] for r in rows if r["workload"] == w and not r.get("warmup")):
            parts.append(rate_table(rows, lap, w, shape))
    if any(r["workload"] == "single" for r in rows):
        parts.append(single_table(rows, lap))
    for w in ("prefix", "multiturn"):
        if any(r["workload"] == w for r in rows):
            parts.append(caching_table(rows, w))
    slo_text, slo = slo_lines(rows, lap) if any(r["workload"] == "sweep" for r in rows) else ("", {})
    parts.append(slo_text)
    parts.append("| server | model runner | start s | status | JIT lines in its log |\n|---|---|---|---|---|\n"
                 + "\n".join(f"| {s['name']} | {s.get('runner', 'n/a')} | {_num(s.get('start_s'), '.1f')} | "
                             f"{s['status'][:200]} | {s.get('jit_lines', 'n/a')} |" for s in servers) + "\n")
    left = [r for r in rows if failed(r) and not r.get("warmup") or r.get("warmup") and "skipped" in r]
    if left:
        parts.append("Not in the tables: " + ", ".join(
            f"{r['server']} {r['workload']} {r['shape']} rate {rate_text(rate_of(r))} "
            f"({r.get('skipped') or r.get('error') or str(r['completed']) + '/' + str(r['requested']) + ' done'})"
            for r in left) + "\n")
    return "\n".join(p for p in parts if p), slo


def plot(rows: list[dict], path: Path) -> Optional[Path]:
    """PNG: TTFT p50, TTFT p99, TPOT p99, ITL p99 against achieved req/s, one line per model and shape
    of the rate-swept workloads (sweep, shapes); None when there is nothing to plot."""
    series = {}
    for r in rows:
        if r["workload"] in ("sweep", "shapes") and not r.get("warmup") and r.get("request_throughput"):
            series.setdefault((r["server"], r["shape"]), []).append(r)
    if not series:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [("median_ttft_ms", "TTFT p50 (ms)"), ("p99_ttft_ms", "TTFT p99 (ms)"),
              ("p99_tpot_ms", "TPOT p99 (ms)"), ("p99_itl_ms", "ITL p99 (ms)")]
    colors = {shape: f"C{i}" for i, shape in enumerate(dict.fromkeys(shape for _, shape in sorted(series)))}
    for ax, (key, title) in zip(axes.flat, panels):
        for (server, shape), rs in sorted(series.items()):      # a color per shape, a line style per model
            rs = sorted(rs, key=lambda r: r["request_throughput"])
            ys = [r[key] if isinstance(r.get(key), (int, float)) else math.nan for r in rs]
            ax.plot([r["request_throughput"] for r in rs], ys, color=colors[shape], marker="o" if server == PEER
                    else "s", linestyle="--" if server == PEER else "-", label=f"{server} {shape}")
        ax.set_yscale("log")
        ax.set_xlabel("achieved requests/s")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
