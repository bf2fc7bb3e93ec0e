"""benchmarks/serve_bench end to end on CPU (`--smoke`: tiny config, vLLM CPU, 4 short requests), plus
the entry-point record it writes where the project is not installed.  vLLM runs in its own process
(it starts worker processes), as in test_vllm.py.  About 1-2 min on 2 cores."""
import json
import math
import os
import subprocess
import sys
from importlib.metadata import distributions

import pytest

from conftest import BENCHMARKS, ROOT, cpu_vllm_env, need

need("torch")
need("vllm")

from serve_bench import cli, compare, engine, folders, measures, steps
from serve_bench.rows import Rows


def test_entry_point_dist_info(tmp_path):
    """The dist-info serve_bench writes declares vllm.general_plugins: laplace → the plugin."""
    engine.write_entry_point_dist(tmp_path)
    eps = [e for d in distributions(path=[str(tmp_path)]) for e in d.entry_points
           if e.group == engine.ENTRY_GROUP]
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
    c = steps.classify_steps(calls, ids, new)
    assert (c["steps"], c["prefill_steps"], c["empty_calls"]) == (P + new - 1, P, int(empty_first))
    assert c["pure_steps"] == new - 1
    assert len(c["full_width_s"]) == new - P - (P == 1)       # the final step is never timed
    assert c["log"][0][0] == pytest.approx(13 if empty_first else 10)     # the empty call's 3 ms
    assert c["full_width_s"] == pytest.approx([0.01] * len(c["full_width_s"]))
    assert sum(ms for ms, *_ in c["log"]) == pytest.approx(1e3 * c["total_s"])     # the times add up
    st = steps.step_stats(c, n)
    assert st["ms_per_token"] == pytest.approx(st["median_ms"] / n) and st["tok_s"] > 0


def test_classify_steps_not_pure():
    """Two tokens in one step (a held-back output) is not a decode step; a short request is an error."""
    new, ids = 4, ["a", "b"]
    calls = [(0.01, {"a": 1, "b": 1}), (0.01, {"a": 2, "b": 2}), (0.01, {"a": 4, "b": 3}), (0.01, {"b": 4})]
    c = steps.classify_steps(calls, ids, new)
    assert c["pure_steps"] == 2 and [p for *_, p in c["log"]] == [False, True, False, True]
    with pytest.raises(RuntimeError, match="did not end with 4 tokens"):
        steps.classify_steps(calls[:-1], ids, new)


@pytest.mark.slow
def test_serve_bench_smoke(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(BENCHMARKS / "serve_bench"), "--smoke", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=cpu_vllm_env(), cwd=ROOT)
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


# ----------------------------------------------------------------------------- --peer llama --shapes

def test_llama_peer_3b_size():
    """The 3B peer: LlamaForCausalLM of Laplace's width/depth/GLU width/vocab, 24 MHA heads of 128,
    3.03e9 parameters; its shapes are transformers' own (built on the meta device: nothing allocated)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from laplace_jax.spec import Arch

    hf = folders.llama_config(Arch(), "bfloat16", 8448, head_dim=128)
    want = dict(architectures=["LlamaForCausalLM"], hidden_size=3072, num_hidden_layers=24,
                num_attention_heads=24, num_key_value_heads=24, head_dim=128, intermediate_size=8192,
                vocab_size=50304, tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0,
                torch_dtype="bfloat16")
    assert {k: hf[k] for k in want} == want and hf["max_position_embeddings"] >= 8448
    shapes = folders.llama_shapes(hf)
    assert folders.param_count(shapes) == pytest.approx(3.03e9, rel=0.01)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**hf))
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == shapes


def test_parse_shapes():
    S = measures.Shape
    assert measures.parse_shapes("1280x2048x256, 256x8192x256") == [S(1280, 2048, 256), S(256, 8192, 256)]
    assert str(S(1280, 2048, 256)) == "1280x2048x256"
    for bad in ("1280x2048", "4x8x1", "ax2x3"):
        with pytest.raises(Exception, match="REQUESTSxPROMPT_LENxNEW_TOKENS|new_tokens >= 2"):
            measures.parse_shapes(bad)


@pytest.mark.parametrize("half", [True, False])
def test_shape_measures(half):
    """Decode from tA − tH over new − new//2 tokens, or (no H run) from tA − tB over new − 1."""
    s = measures.Shape(10, 100, 8)
    t = {"A": 4.0, "H": 3.0, "B": 2.0} if half else {"A": 4.0, "B": 2.0}
    m = {k: v for k, (v, _) in measures.shape_measures(s, t, half).items()}
    dt, tail = (1.0, 4) if half else (2.0, 7)
    assert m == pytest.approx({"end-to-end output throughput": 80 / 4, "prefill throughput": 1000 / 2,
                               "decode-phase output throughput": 10 * tail / dt, "decode step time": 1e3 * dt / tail})
    assert set(measures.shape_measures(s, {"A": 4.0}, half)) == {"end-to-end output throughput"}


def test_comparison_ratio_rows(tmp_path):
    """A ratio row comes as soon as both sides are in, whichever comes first; none for n/a values."""
    rows = Rows(tmp_path)
    s = measures.Shape(2, 8, 4)
    comp = compare.Comparison(rows, "llama", [s])
    comp.add("laplace", {"name": f"end-to-end output throughput, {s}", "value": 30.0, "unit": "tok/s"})
    comp.add("laplace", {"name": f"decode-phase output throughput, {s}", "value": "n/a (tA <= tH)", "unit": ""})
    comp.add("llama", {"name": f"decode-phase output throughput, {s}", "value": 9.0, "unit": "tok/s"})
    comp.add("llama", {"name": f"end-to-end output throughput, {s}", "value": 20.0, "unit": "tok/s"})
    got = [(r["name"], r["value"]) for r in rows.rows]
    assert got[-1] == ("ratio laplace/llama end-to-end 2x8x4", 1.5)
    assert [n for n, _ in got if n.startswith("ratio")] == ["ratio laplace/llama end-to-end 2x8x4"]
    assert ((tmp_path / "serve_rows.txt").read_text().splitlines()[0]
            == f"laplace: end-to-end output throughput, {s} | 30 | tok/s")


@pytest.mark.slow
def test_serve_bench_peer_smoke(tmp_path):
    """--smoke --peer llama --shapes --repeats 3: both models, each in its own child process and vLLM
    engine, on the same shapes; rows for both (timings the medians of three rounds), the ratios =
    laplace/llama of those rows, the peer folder a tiny Llama."""
    out, peer = tmp_path / "out", tmp_path / "peer"
    shapes = [(2, 24, 8), (3, 40, 6)]
    cmd = [sys.executable, str(BENCHMARKS / "serve_bench"), "--smoke", "--peer", "llama", "--out", str(out),
           "--shapes", ",".join("x".join(map(str, s)) for s in shapes), "--peer-dir", str(peer), "--repeats", "3"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=cpu_vllm_env(), cwd=ROOT)
    assert p.returncode == 0, f"serve_bench failed (rc={p.returncode}):\n{p.stdout[-6000:]}\n{p.stderr[-4000:]}"
    res = json.loads((out / "serve_bench.json").read_text())
    rows = {r["name"]: r["value"] for r in res["rows"]}
    units = {r["name"]: r["unit"] for r in res["rows"]}
    measures = {"end-to-end output throughput": "end-to-end", "prefill throughput": "prefill",
                "decode-phase output throughput": "decode"}
    for n, length, new in shapes:
        s = f"{n}x{length}x{new}"
        for kind in ("laplace", "llama"):
            assert rows[f"{kind}: output tokens, {s}"] == n * new, (kind, s)
            for m in [*measures, "decode step time", "tA", "tH", "tB"]:
                v = rows[f"{kind}: {m}, {s}"]
                assert isinstance(v, (int, float)) and math.isfinite(v) and v > 0, (kind, m, s, v)
            for key in "AHB":   # --repeats 3: each timing is the median of its three rounds
                unit = units[f"{kind}: t{key}, {s}"]
                runs = [float(x) for x in unit.split("median of 3: ")[1].split(", ")]
                assert len(runs) == 3 and rows[f"{kind}: t{key}, {s}"] == round(sorted(runs)[1], 3), unit
        for m, short in measures.items():
            ratio = rows[f"ratio laplace/llama {short} {s}"]
            assert ratio == pytest.approx(rows[f"laplace: {m}, {s}"] / rows[f"llama: {m}, {s}"], rel=1e-12)
    # the peer: vLLM's own Llama, of the tiny Laplace config's sizes
    cfg = json.loads((peer / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "float32"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]) \
        == (128, 2, 256, 50304)
    assert cfg["num_attention_heads"] * cfg["head_dim"] == 128 and not cfg["tie_word_embeddings"]
    assert rows["llama: parameters"] == folders.param_count(folders.llama_shapes(cfg))
    assert "laplace: state bytes per sequence (vLLM pool)" in rows      # the Laplace child ran the plugin
    assert not (out / "laplace" / "smoke_model").exists()
    # every row written as it came, and the side-by-side table
    assert len((out / "serve_rows.txt").read_text().splitlines()) == len(res["rows"])
    md = (out / "serve_bench.md").read_text()
    assert "| shape | laplace e2e | llama e2e | ratio |" in md
    assert all(f"| {n}x{length}x{new} |" in md for n, length, new in shapes)


def test_engine_kwargs_keep_vllm_stat_logging_default(tmp_path):
    """serve_bench leaves per-request stat logging at vllm.LLM's default (off): forcing it on cost
    3.5 % of the 1,280 x 2,048 x 256 run on an H200 (BENCHMARKS.md, run S9). --llm-kwargs still wins."""
    a = cli.parse_args(["--out", str(tmp_path)])
    kw = engine.engine_kwargs(a, tmp_path, True, 4, 64, cuda=True)
    assert "disable_log_stats" not in kw
    assert kw["max_num_batched_tokens"] == 16384 and not kw["enforce_eager"]
    assert kw["compilation_config"] == {"max_cudagraph_capture_size": 4}
    a = cli.parse_args(["--out", str(tmp_path), "--llm-kwargs", '{"disable_log_stats": false}'])
    assert engine.engine_kwargs(a, tmp_path, True, 4, 64, cuda=True)["disable_log_stats"] is False


def test_config_reaches_both_children_and_sizes_both_models(tmp_path):
    """--config picks the model size of both sides (the host-floor run: two tiny models through the
    same vLLM): the children get it, the Laplace config is that file's, the peer is built from it."""
    a = cli.parse_args(["--out", str(tmp_path), "--peer", "llama", "--config", "laplace_tiny",
                                "--shapes", "8x16x4"])
    for kind in ("laplace", "llama"):
        argv = engine.child_argv(a, kind)
        assert argv[argv.index("--config") + 1] == "laplace_tiny"
        child = cli.parse_args(argv[2:])
        cfg, _, _ = engine.model_setup(child)
        assert (cfg.d_model, cfg.num_layers, cfg.ffn_dim) == (128, 2, 256)
    hf = folders.llama_config(cfg, "bfloat16", 64, head_dim=128)
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]) == (128, 2, 1)
    a = cli.parse_args(["--out", str(tmp_path), "--shapes", "8x16x4"])
    assert "--config" not in engine.child_argv(a, "laplace")
    assert engine.model_setup(a)[0].d_model == 3072


@pytest.mark.parametrize("cuda, preset, expect", [(False, None, None), (True, None, "1"), (True, "0", "0")])
def test_v2_runner_asked_for_on_cuda_only_and_never_over_the_users_choice(monkeypatch, cuda, preset, expect):
    """vLLM 0.26 runs Llama on Model Runner V2 but attention-free models on V1 unless told; the
    comparison asks for V2 on CUDA (the CPU build has none) and keeps a value the user set."""
    # setenv first in both cases, so that monkeypatch restores the variable's absence afterwards
    # (a bare delenv of an unset variable records nothing, and the "1" set here leaked into the
    # vLLM tests that follow: CPU vLLM then refused to start, "Model Runner V2 requires Triton")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", preset or "unset")
    if preset is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    assert engine.prefer_v2_runner(cuda) == expect
    assert os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == expect
