"""benchmarks/serve_bench.py end to end on CPU (`--smoke`: tiny config, vLLM CPU, 4 short requests), plus
the entry-point record it writes where the project is not installed.  vLLM runs in its own process
(it starts worker processes), as in test_vllm.py.  About 1-2 min on 2 cores."""
import json
import math
import os
import subprocess
import sys
from importlib.metadata import distributions

import pytest

from conftest import BENCHMARKS, ROOT, need  # noqa: E402

need("torch")
need("vllm")

import serve_bench  # noqa: E402  (benchmarks/serve_bench.py)


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


def _calls(first: list, new: int, empty_first: bool = False, dt: float = 0.01) -> list:
    """Synthetic step() calls: request i gets its first token in step first[i] and one more in each
    later step until it has `new`; `empty_first`: an output-less call before step 1 (async scheduling
    queueing the first batch)."""
    ids = [f"r{i}" for i in range(len(first))]
    calls = [(0.003, {})] if empty_first else []
    for t in range(1, max(first) + new):
        calls.append((dt, {r: t - f + 1 for r, f in zip(ids, first) if f <= t < f + new}))
    return calls


@pytest.mark.parametrize("first,empty_first", [
    ([1, 1, 1, 1], False),               # every prompt prefilled in step 1 (P = 1)
    ([1, 1, 1, 1], True),                # async scheduling: an empty first call, its time goes on
    ([1, 1, 2, 2, 2, 4], False),         # prefill over 4 steps, mixed with decodes (P = 4)
])
def test_classify_steps(first, empty_first):
    new, n, P = 6, len(first), max(first)
    ids = [f"r{i}" for i in range(n)]
    calls = _calls(first, new, empty_first)
    c = serve_bench.classify_steps(calls, ids, new)
    assert (c["steps"], c["prefill_steps"], c["empty_calls"]) == (P + new - 1, P, int(empty_first))
    assert c["pure_steps"] == new - 1
    assert len(c["full_width_s"]) == new - P - (P == 1)       # the final step is never timed
    assert c["log"][0][0] == pytest.approx(13 if empty_first else 10)     # the empty call's 3 ms
    assert c["full_width_s"] == pytest.approx([0.01] * len(c["full_width_s"]))
    assert sum(ms for ms, *_ in c["log"]) == pytest.approx(1e3 * c["total_s"])     # the times add up
    st = serve_bench.step_stats(c, n)
    assert st["ms_per_token"] == pytest.approx(st["median_ms"] / n) and st["tok_s"] > 0


def test_classify_steps_not_pure():
    """Two tokens in one step (a held-back output) is not a decode step; a short request is an error."""
    new, ids = 4, ["a", "b"]
    calls = [(0.01, {"a": 1, "b": 1}), (0.01, {"a": 2, "b": 2}), (0.01, {"a": 4, "b": 3}), (0.01, {"b": 4})]
    c = serve_bench.classify_steps(calls, ids, new)
    assert c["pure_steps"] == 2 and [p for *_, p in c["log"]] == [False, True, False, True]
    with pytest.raises(RuntimeError, match="did not end with 4 tokens"):
        serve_bench.classify_steps(calls[:-1], ids, new)


@pytest.mark.slow
def test_serve_bench_smoke(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(BENCHMARKS / "serve_bench.py"), "--smoke", "--out", str(out)]
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
    # e. per-step decode timing: short, long, short, long
    ns, news, LL = a["step_requests"], a["step_new_tokens"], a["long_prompt_len"]
    assert (ns, news, a["step_repeats"]) == (8, 8, 2) and ns * LL > a["max_num_batched_tokens"]
    runs = res["step"]["runs"]
    assert [(r["repeat"], r["prompt_len"]) for r in runs] == [(1, L), (1, LL), (2, L), (2, LL)]
    for r in runs:
        P, name = r["prefill_steps"], f"step run {r['repeat']}: {ns} x {r['prompt_len']} prompt"
        assert r["pure_steps"] == news - 1 == rows[f"{name}: pure decode steps"], r
        assert r["steps"] == P + news - 1, r
        assert len(r["full_width_s"]) == news - P - (P == 1) > 0, r     # see classify_steps
        assert r["prompt_len"] == L or P >= 2, r        # 8 x 48 tokens need two 256-token steps
        assert 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"] < 1e4, r
        for what in ("decode step time, median", "decode cost per output token",
                     "decode-phase output throughput"):
            v = rows[f"{name}: {what}"]
            assert isinstance(v, float) and math.isfinite(v) and v > 0, (name, what, v)
    for length in (L, LL):
        v = rows[f"step decode cost per output token, {length}-token prompts ({ns} seqs)"]
        assert isinstance(v, float) and math.isfinite(v) and 0 < v < 1e3, (length, v)
    for suffix in ("", ", run 1", ", run 2"):
        change = rows[f"step decode cost change {LL} vs {L} prompt{suffix}"]
        assert isinstance(change, float) and math.isfinite(change) and change > -100, (suffix, change)
    # rows were written as they came, and the table has them all
    lines = (out / "serve_rows.txt").read_text().splitlines()
    assert len(lines) == len(res["rows"]) and lines[0].startswith("model build time |")
    md = (out / "serve_bench.md").read_text()
    assert "| end-to-end output throughput |" in md and "tok/s" in md
    assert not (out / "smoke_model").exists()
