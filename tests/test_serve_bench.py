"""export/serve_bench.py end to end on CPU (`--smoke`: tiny config, vLLM CPU, 4 short requests), plus
the entry-point record it writes where the project is not installed.  vLLM runs in its own process
(it starts worker processes), as in test_vllm.py.  About 1-2 min on 2 cores."""
import json
import math
import os
import subprocess
import sys
from importlib.metadata import distributions

import pytest

from conftest import ROOT, need  # noqa: E402

need("torch")
need("vllm")

from export import serve_bench  # noqa: E402


def _env(**extra):
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(extra)
    return env


def test_entry_point_dist_info(tmp_path):
    """The dist-info serve_bench writes declares vllm.general_plugins: laplace → the plugin."""
    serve_bench.write_entry_point_dist(tmp_path)
    eps = [e for d in distributions(path=[str(tmp_path)]) for e in d.entry_points
           if e.group == serve_bench.ENTRY_GROUP]
    assert [(e.name, e.value) for e in eps] == [("laplace", "export.vllm_plugin:register")]
    assert eps[0].load().__name__ == "register"


@pytest.mark.slow
def test_serve_bench_smoke(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "export.serve_bench", "--smoke", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(), cwd=ROOT)
    assert p.returncode == 0, f"serve_bench failed (rc={p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}"
    res = json.loads((out / "serve_bench.json").read_text())
    rows = {r["name"]: r["value"] for r in res["rows"]}
    a = res["args"]
    n, L, new, nl = a["requests"], a["prompt_len"], a["new_tokens"], a["long_requests"]
    assert (n, L, new) == (4, 24, 16)
    for name in ("end-to-end output throughput", "decode-phase output throughput", "decode step time",
                 "prefill throughput", f"tA: {n} x {L} prompt, {new} new tokens",
                 f"tB: {n} x {L} prompt, 1 new token",
                 f"decode cost per output token, {L}-token prompts ({nl} seqs)",
                 f"decode cost per output token, {a['long_prompt_len']}-token prompts ({nl} seqs)"):
        v = rows[name]
        assert isinstance(v, (int, float)) and math.isfinite(v) and v > 0, (name, v)
    change = rows[f"decode cost change {a['long_prompt_len']} vs {L} prompt"]
    assert isinstance(change, float) and math.isfinite(change) and change > -100, change
    assert rows["state bytes per sequence (vLLM pool)"] == rows["state bytes per sequence (config)"]
    assert rows["state pool slots (max concurrent sequences + 1 null slot)"] > n
    assert rows["decode GLA path in the worker"] == "torch"        # CPU
    assert rows["smoke: outputs equal to the torch reference"] == f"{n}/{n}"
    # rows were written as they came, and the table has them all
    lines = (out / "serve_rows.txt").read_text().splitlines()
    assert len(lines) == len(res["rows"]) and lines[0].startswith("model build time |")
    md = (out / "serve_bench.md").read_text()
    assert "| end-to-end output throughput |" in md and "tok/s" in md
    assert not (out / "smoke_model").exists()
