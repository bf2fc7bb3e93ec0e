"""benchmarks/prefill_host.py end to end on CPU (`--smoke`: the tiny config's random weights in
float32, vLLM CPU, the torch path): the rows it writes, the host split of each prefill step, and the
greedy agreement batch run twice in one engine; a prompt arriving beside decoding requests
(`--decodes`), after a shared prefix that prefix caching holds (`--cached-prefix`).  About 60 s."""
import json
import subprocess
import sys

import pytest

from conftest import BENCHMARKS, ROOT, cpu_vllm_env, need

need("torch")
need("vllm")

from laplace_jax.config import load_config


@pytest.mark.slow
def test_smoke_rows_host_split_and_agreement(tmp_path):
    r = subprocess.run([sys.executable, str(BENCHMARKS / "prefill_host.py"), "--smoke", "--out", str(tmp_path),
                        "--reps", "2", "--decodes", "3"],
                       cwd=ROOT, env=cpu_vllm_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "prefill_host.json").read_text())["models"]["laplace"]
    layers = load_config("laplace_tiny").model.num_layers
    assert [row["prompt_len"] for row in res["rows"]] == [32, 64]
    for row in res["rows"]:
        # one prefill step a request: one forward, one mixer call a layer, inside the forward's time,
        # inside the request's wall time
        assert row["calls"]["forward"] == 1 and row["calls"]["mixers"] == layers, row
        assert 0 < row["host_ms"]["mixers"] < row["host_ms"]["forward"] < row["wall_ms"], row
        # one thread's CPU time inside its wall time (both rounded to 0.001 ms)
        for name in ("forward", "mixers"):
            assert 0 < row["host_ms"][f"{name}_cpu"] <= row["host_ms"][name] + 0.002, row
        assert len(row["wall_ms_all"]) == 2
    # a prompt arriving beside 3 decoding requests: the steps until its first token are inside the
    # time from its arrival, each step's forward holds its mixers, and the decode-only step was timed
    assert [row["prompt_len"] for row in res["mixed_rows"]] == [32, 64]
    for row in res["mixed_rows"]:
        assert row["decodes"] == 3 and len(row["ttft_ms_all"]) == 2 and all(n >= 1 for n in row["steps"]), row
        for t, walls in zip(row["ttft_ms_all"], row["step_walls_ms"]):
            assert 0 < sum(walls) <= t + 0.02, row           # both rounded to 0.01 ms
        assert 0 < row["host_ms"]["mixers"] < row["host_ms"]["forward"], row
        assert row["decode_step_ms"] > 0
    assert res["engine"]["enable_prefix_caching"] is False and "compilation_config" not in res["engine"]
    agree = res["agreement"]
    # prompts to the longest length together, then short ones (one graph-sized step on a GPU) that fit
    # the smoke engine's model length (160)
    assert agree["prompt_lens"] == [37, 64, 5, 37, 64, 129]
    assert [len(t) for t in agree["tokens"]] == [8] * 6 and all(len(lp) == 8 for lp in agree["logprobs"])
    assert all(lp <= 0 for lps in agree["logprobs"] for lp in lps)
    assert res["replay_vs_live_same_engine"] == {"tokens_equal": True, "max_abs_logprob_diff": 0.0,
                                                 "positions_compared": 48, "positions": 48}


@pytest.mark.slow
def test_mixed_rows_after_a_cached_prefix(tmp_path):
    """--cached-prefix 64 --block-size 32: caching on in the engine, and every arrival's first 64
    tokens (two whole blocks, put in the cache by the priming request) come from the cache, as vLLM's
    own count of the request's cached tokens says; so do the agreement run's prompts."""
    r = subprocess.run([sys.executable, str(BENCHMARKS / "prefill_host.py"), "--smoke", "--out", str(tmp_path),
                        "--reps", "2", "--decodes", "2", "--lengths", "40", "--cached-prefix", "64",
                        "--block-size", "32"],
                       cwd=ROOT, env=cpu_vllm_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "prefill_host.json").read_text())["models"]["laplace"]
    assert res["engine"]["enable_prefix_caching"] is True and res["engine"]["block_size"] == 32
    (row,) = res["mixed_rows"]
    assert row["cached_prefix"] == 64 and row["cached_tokens"] == [64, 64], row
    # the agreement run's prompts follow the same prefix: each starts from the restored state
    assert res["agreement"]["cached_tokens"] == [64] * len(res["agreement"]["prompt_lens"]), res["agreement"]


def test_clock_counts_gc_pauses_and_cpu_time_inside_the_wall():
    """prefill_host.Clock: a collection inside a wrapped call is timed as "gc" (inside the call's own
    wall), the thread CPU time of a call that sleeps is well below its wall, and a name timed in one
    repetition only still makes a row's key."""
    import gc
    import time

    import prefill_host

    clock = prefill_host.Clock()
    try:
        def work():
            junk = [[i] for i in range(200_000)]       # objects for the collector to walk
            gc.collect()
            time.sleep(0.05)
            return len(junk)

        clock.wrap("forward", work, cpu=True)()
        assert clock.n["gc"] >= 1 and 0 < clock.s["gc"] < clock.s["forward"]
        assert clock.s["forward_cpu"] < clock.s["forward"] - 0.04       # the sleep is waiting, not work
    finally:
        gc.callbacks.remove(clock._gc)
    assert prefill_host.median_split([{"forward": 1.0}, {"forward": 2.0, "gc": 0.5}, {"forward": 4.0}]) == \
        {"forward": 2.0, "gc": 0.0}
