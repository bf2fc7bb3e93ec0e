"""PNG figures of the results (matplotlib, headless Agg backend)."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def length_png(result: Mapping, path: str | Path, title: str = "") -> Path:
    """Mean next-token loss per position bucket, a line at the training length."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.asarray(result["bucket_start"]) + result["bucket"] / 2
    ax.plot(x, result["mean_nll"], marker=".")
    ax.axvline(result["seq_len"], color="gray", ls="--", label=f"training length {result['seq_len']}")
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel("mean loss (nats)")
    ax.set_title(title or f"loss by position, {result['sequences']} sequences ({result['mode']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def passkey_png(result: Mapping, path: str | Path, title: str = "") -> Path:
    """Heat-map of the rank score per (length, depth)."""
    plt = _pyplot()
    lengths = sorted({c["length"] for c in result["cells"]})
    depths = sorted({c["depth"] for c in result["cells"]})
    grid = np.full((len(depths), len(lengths)), np.nan)
    for c in result["cells"]:
        grid[depths.index(c["depth"]), lengths.index(c["length"])] = c["rank_score"]
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2.5, 0.6 * len(depths) + 2))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", color="w" if grid[i, j] < 0.6 else "k")
    ax.set_xticks(range(len(lengths)), [str(x) for x in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title or f"passkey rank score (chance 0.5, {result['candidates']} candidates)")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def mqar_png(results: Mapping[str, Mapping], path: str | Path, title: str = "") -> Path:
    """Accuracy per distance bucket, one line per labelled result, and chance."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, r in results.items():
        b = r["buckets"]
        ax.plot([np.sqrt(x["lo"] * x["hi"]) for x in b], [x["accuracy"] for x in b], marker="o", label=label)
    chance = next(iter(results.values()))["chance_accuracy"]
    ax.axhline(chance, color="gray", ls=":", label=f"chance {chance:.3f}")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("key-query distance (tokens, bucket centre)")
    ax.set_ylabel("recall accuracy")
    ax.set_title(title or "MQAR recall by distance")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
