"""`python -m laplace_jax.eval.compare LABEL=RESULTS.json ... --out FIG.png`

MQAR recall of several evaluated runs side by side: one PNG (accuracy per distance bucket, a line per
run) and a Markdown table on stdout (EVAL.md's tables come from here).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from laplace_jax.eval.plots import mqar_png


def table(results: dict[str, dict]) -> str:
    """Markdown: one row per distance bucket, one accuracy column per run."""
    buckets = sorted({(b["lo"], b["hi"]) for r in results.values() for b in r["buckets"]})
    head = "| distance | " + " | ".join(results) + " |\n|---|" + "---:|" * len(results)
    rows = []
    for lo, hi in buckets:
        cells = []
        for r in results.values():
            b = next((b for b in r["buckets"] if (b["lo"], b["hi"]) == (lo, hi)), None)
            cells.append(f"{b['accuracy']:.3f} ({b['queries']})" if b else "")
        rows.append(f"| {lo}-{hi - 1} | " + " | ".join(cells) + " |")
    rows.append("| all | " + " | ".join(f"{r['accuracy']:.3f} ({r['queries']})" for r in results.values()) + " |")
    return "\n".join([head, *rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m laplace_jax.eval.compare", description=__doc__.split("\n\n")[1])
    ap.add_argument("runs", nargs="+", help="LABEL=path/to/results.json (from python -m laplace_jax.eval)")
    ap.add_argument("--out", required=True, help="PNG path")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    results = {}
    for item in args.runs:
        label, sep, path = item.partition("=")
        try:
            if not sep:
                raise ValueError("expected LABEL=PATH")
            results[label] = json.loads(Path(path).read_text())["tasks"]["mqar"]
        except (OSError, ValueError, KeyError) as e:
            print(f"error: {item!r}: not LABEL=results.json with an mqar task ({type(e).__name__}: {e})",
                  file=sys.stderr)
            return 1
    mqar_png(results, args.out, args.title)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
