"""Where a lone prompt's prefill step spends its wall time on the host: Laplace beside the Llama peer.

    python benchmarks/prefill_host.py --out DIR --model-dir /dev/shm/lap [--peer-dir /dev/shm/peer]
        [--replay-ab] [--graphs-ab] [--lengths 512,2048,8192] [--reps 5] [--max-num-seqs 256] [--capture N]
        [--decodes N [--cached-prefix N [--block-size 256]]]
    python benchmarks/prefill_host.py --smoke --out DIR      # CPU: the tiny config's random weights, float32

Each model runs in a child process with vLLM's engine in that process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
configured as `online_bench` configures its servers (--max-num-seqs, vLLM's own CUDA-graph sizes unless
--capture sets the largest, Model Runner V2, the same random-weight folders).  For each prompt length, one request alone
is generated with max_tokens=1 (its prefill step and first token, the offline part of a TTFT) --reps
times after two warm-ups.  Host clocks (time.perf_counter around the calls, no profiler) split the wall
time: the model's forward (its Python and kernel launches; the GPU runs behind it), and for Laplace the
24 mixer calls inside it (`LaplaceVllmMixer._forward`, run eagerly between vLLM's CUDA-graph pieces)
and the launcher calls inside those (`launch_keys.run`: a replayed layer makes none,
export/ops/launch_tape.py) and the replays themselves (`replays`: a replayed layer's launches and GEMMs;
the mixers' time less these is the Python around them); the forward's and the mixers' thread CPU time beside their walls
(`forward_cpu`, `mixers_cpu`: a wall above it is time the thread waited, for the GIL that another of
vLLM's threads held or for the GPU), and the garbage collector's pauses (`gc`).  Also the GPU time of
the forward (CUDA events around it).

With --decodes N, each length is also measured as a prompt arriving while N other requests decode
(`mixed_rows`): the engine is stepped by hand (`LLMEngine.add_request` / `step`), and a row holds the
time from adding the prompt to its first token, the walls of the steps that took (the mixed step:
its prefill beside the N decode rows), the host split and GPU time of those steps, and the median
decode-only step of the same N requests before it (what a running request's ITL is between
arrivals).  Under traffic this is the step a new request's TTFT and the running ones' ITL spikes
wait on (BENCHMARKS.md run S17).  With --cached-prefix P both engines run with prefix caching on
(--block-size B, default 256; Laplace in vLLM's 'align' mode) and each arriving prompt is one shared
P-token prefix, put in the cache by a request of its own first, followed by its own tokens: the step
of a cache hit beside the decodes (issue 33), with each arrival's cached tokens as vLLM reports them.

Then a few prompts of mixed lengths sent together, greedy, 8 tokens with their logprobs; for Laplace
again in the same engine with LAPLACE_VLLM_REPLAY=0 (the tape off): tokens must be equal (the exit
status says so) and the logprob difference is reported.  --replay-ab also runs a second Laplace child
with the tape off, for its timings; --graphs-ab runs the first with LAPLACE_VLLM_FULL_GRAPHS=1
(whole-step CUDA graphs, as vLLM's OpenAI server runs by default, export/full_graph.py) and a second
with =0 (vLLM's FULL_AND_PIECEWISE, the offline engine's default), and compares their agreement runs
(a batch of five short prompts is prefilled in one graph-sized step; --budget 128 makes every step
mix prefill chunks with decodes).  Writes
DIR/prefill_host.json and prints one row per model and length.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench.rows import log  # noqa: E402

LAUNCH_MODULES = ("conv", "gated_mix", "gla_decode", "gla_prefill", "gla_prefill_chunked")


class Clock:
    """Host seconds and calls accumulated by wrapped functions, per name.  With `cpu=True` a wrapped
    function's thread CPU time too (as NAME_cpu): a wall time well above it is time the calling thread
    waited (for the GIL held by another of vLLM's threads, or for the GPU) rather than worked.  The
    garbage collector's pauses are accumulated as "gc" (`gc.callbacks`)."""

    def __init__(self):
        self.s: dict = {}
        self.n: dict = {}
        self._gc_t0 = None
        import gc
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            self.s["gc"] = self.s.get("gc", 0.0) + time.perf_counter() - self._gc_t0
            self.n["gc"] = self.n.get("gc", 0) + 1
            self._gc_t0 = None

    def wrap(self, name: str, fn, cpu: bool = False):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            c0 = time.thread_time() if cpu else 0.0      # the CPU interval inside the wall one
            try:
                return fn(*args, **kw)
            finally:
                c1 = time.thread_time() if cpu else 0.0
                self.s[name] = self.s.get(name, 0.0) + time.perf_counter() - t0
                self.n[name] = self.n.get(name, 0) + 1
                if cpu:
                    self.s[name + "_cpu"] = self.s.get(name + "_cpu", 0.0) + c1 - c0
        return timed

    def reset(self) -> None:
        self.s.clear()
        self.n.clear()


class GpuClock:
    """GPU milliseconds of each wrapped call (CUDA events recorded around it)."""

    def __init__(self):
        self.events: list = []

    def wrap(self, fn):
        import torch

        def timed(*args, **kw):
            if torch.cuda.is_current_stream_capturing():        # CUDA-graph capture: no events
                return fn(*args, **kw)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            try:
                return fn(*args, **kw)
            finally:
                b.record()
                self.events.append((a, b))
        return timed

    def take_ms(self) -> float:
        import torch

        torch.cuda.synchronize()
        ms = sum(a.elapsed_time(b) for a, b in self.events)
        self.events.clear()
        return ms


def instrument(model_cls, laplace: bool, clock: Clock, gpu) -> None:
    """Wrap the forward of `model_cls` (host clock, and GPU events where `gpu`), and for Laplace the
    mixer's `_forward` and every launcher module's `run`."""
    fwd = clock.wrap("forward", model_cls.forward, cpu=True)
    model_cls.forward = gpu.wrap(fwd) if gpu is not None else fwd
    if not laplace:
        return
    import importlib

    from export import vllm_model
    from export.ops import launch_tape
    vllm_model.LaplaceVllmMixer._forward = clock.wrap("mixers", vllm_model.LaplaceVllmMixer._forward, cpu=True)
    # a replayed layer's launches and GEMMs (the rest of its mixer time is the Python around them)
    launch_tape.Tape.replay = clock.wrap("replays", launch_tape.Tape.replay, cpu=True)
    for name in LAUNCH_MODULES:
        mod = importlib.import_module(f"export.ops.{name}")
        mod.run = clock.wrap("triton_launches", mod.run)


def child(a) -> dict:
    """One model in this process: the rows of every length."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.smoke:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from vllm import LLM, SamplingParams

    from serve_bench.engine import ensure_plugin_entry_point, prefer_v2_runner
    from serve_bench.measures import make_prompts

    cuda = torch.cuda.is_available() and not a.smoke
    prefer_v2_runner(cuda)
    laplace = a.child.startswith("laplace")
    work = Path(a.out) / "entry"
    ensure_plugin_entry_point(work)
    kw = dict(model=a.folder, dtype=a.dtype, max_num_seqs=a.max_num_seqs, max_model_len=a.max_len,
              enable_prefix_caching=a.cached_prefix > 0, seed=0, enforce_eager=a.smoke)
    if a.cached_prefix:
        kw["block_size"] = a.block_size
    if a.budget:
        kw["max_num_batched_tokens"] = a.budget
    if cuda:
        kw["gpu_memory_utilization"] = 0.85
        if a.capture:
            kw["compilation_config"] = {"max_cudagraph_capture_size": a.capture}
    if laplace:
        from export import vllm_model
        model_cls = vllm_model.LaplaceForCausalLM
    else:
        from vllm.model_executor.models.llama import LlamaForCausalLM as model_cls
    clock = Clock()
    gpu = GpuClock() if cuda else None
    instrument(model_cls, laplace, clock, gpu)
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    rows = []
    for length in a.lengths:
        prompts = make_prompts(a.reps + 2, length, seed=11)
        walls, splits, gpu_ms = [], [], []
        for i, p in enumerate(prompts):
            wall, _, split, g = _timed(lambda: llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False),
                                       clock, gpu, cuda)
            if i < 2:
                continue                                   # warm-ups
            walls.append(wall)
            splits.append(split)
            if g is not None:
                gpu_ms.append(g)
        med = median_split(splits)
        row = {"model": a.child, "prompt_len": length, "wall_ms": statistics.median(walls),
               "wall_ms_all": [round(w, 2) for w in walls],
               "host_ms": {k: round(v, 3) for k, v in med.items()},
               "calls": dict(clock.n), "forward_gpu_ms": statistics.median(gpu_ms) if gpu_ms else None}
        log(f"ROW {json.dumps(row)}")
        rows.append(row)
    mixed = [mixed_row(llm, a, length, clock, gpu, cuda) for length in a.lengths] if a.decodes else []
    agree = agreement_run(llm, a)
    res = {"rows": rows, "mixed_rows": mixed, "agreement": agree,
           "device": torch.cuda.get_device_name() if cuda else "cpu", "engine": kw,
           "replay": os.environ.get("LAPLACE_VLLM_REPLAY", "1")}
    if laplace and res["replay"] != "0":
        # the same engine with the tape off (launch_tape reads the switch at each step)
        os.environ["LAPLACE_VLLM_REPLAY"] = "0"
        res["replay_vs_live_same_engine"] = compare(agree, agreement_run(llm, a))
        os.environ["LAPLACE_VLLM_REPLAY"] = res["replay"]
        log(f"replay vs live, same engine: {res['replay_vs_live_same_engine']}")
    from vllm_check import stop_engine
    stop_engine(llm)
    return res


def _timed(call, clock: Clock, gpu, cuda: bool) -> tuple[float, object, dict, float | None]:
    """`call()` (a generate, an engine step): its wall ms, its result, its host split (ms, the
    instrumented functions it ran) and its GPU ms (None off CUDA)."""
    import torch

    clock.reset()
    if gpu is not None:
        gpu.take_ms()
    t0 = time.perf_counter()
    outs = call()
    if cuda:
        torch.cuda.synchronize()
    wall = 1e3 * (time.perf_counter() - t0)
    return wall, outs, {k: 1e3 * v for k, v in clock.s.items()}, (gpu.take_ms() if gpu is not None else None)


def median_split(splits: list) -> dict:
    """The median over repetitions of each name's host time, for every name timed in any of them (a
    GC pause, say, in one repetition only: 0 in the others), in first-seen order."""
    names = dict.fromkeys(k for s in splits for k in s)
    return {k: statistics.median(s.get(k, 0.0) for s in splits) for k in names}


BG_LEN = 16       # prompt tokens of each decoding request of a mixed row
PER_REP = 4       # decode steps between arrivals, then the arrival's


def background_tokens(reps: int) -> int:
    """Tokens each decoding request of a mixed row generates: enough that none finishes during the row
    (its reps + 2 arrivals, each after PER_REP decode steps and taking a few steps itself)."""
    return PER_REP * (reps + 2) * 4 + 16


def mixed_row(llm, a, length: int, clock: Clock, gpu, cuda: bool) -> dict:
    """A `length`-token prompt arriving while a.decodes requests decode (module docstring): --reps
    arrivals after two warm-ups, each stepped until its first token."""
    from vllm import SamplingParams

    from serve_bench.measures import make_prompts

    engine = llm.llm_engine
    # parse_args sized max_model_len for these requests (BG_LEN + background_tokens)
    bg_sp = SamplingParams(temperature=0.0, max_tokens=background_tokens(a.reps), ignore_eos=True, detokenize=False)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    prefix = make_prompts(1, a.cached_prefix, seed=51)[0] if a.cached_prefix else []
    if prefix:                                    # the shared prefix into the cache, by a request of its own
        engine.add_request(f"prime{length}", {"prompt_token_ids": prefix + make_prompts(1, 16, seed=52)[0]}, one)
        while engine.has_unfinished_requests():
            engine.step()
    bg = [f"bg{length}-{i}" for i in range(a.decodes)]
    for rid, p in zip(bg, make_prompts(a.decodes, BG_LEN, seed=31)):
        engine.add_request(rid, {"prompt_token_ids": p}, bg_sp)
    for _ in range(PER_REP):                      # their prefill, then decoding
        _timed(engine.step, clock, gpu, cuda)
    ttfts, steps, walls, decode_walls, splits, gpu_ms, cached = [], [], [], [], [], [], []
    for i, p in enumerate(make_prompts(a.reps + 2, length, seed=41)):
        p = prefix + p
        dw = [_timed(engine.step, clock, gpu, cuda)[0] for _ in range(PER_REP)]
        rid = f"new{length}-{i}"
        t0 = time.perf_counter()
        engine.add_request(rid, {"prompt_token_ids": p}, one)
        n, sw, split, g, first = 0, [], {}, 0.0, None
        while first is None:
            wall, outs, s, gm = _timed(engine.step, clock, gpu, cuda)
            n, sw = n + 1, sw + [wall]
            for k, v in s.items():
                split[k] = split.get(k, 0.0) + v
            g += gm or 0.0
            first = next((o for o in outs if o.request_id == rid and o.outputs and o.outputs[0].token_ids), None)
            if n > 64:
                raise RuntimeError(f"{rid}: no first token after 64 steps")
        ttft = 1e3 * (time.perf_counter() - t0)
        if i < 2:
            continue                              # warm-ups
        ttfts.append(ttft)
        steps.append(n)
        walls.append(sw)
        decode_walls.extend(dw)
        splits.append(split)
        gpu_ms.append(g)
        cached.append(first.num_cached_tokens)
    engine.abort_request(bg)
    while engine.has_unfinished_requests():
        engine.step()
    row = {"model": a.child, "prompt_len": length, "decodes": a.decodes, "cached_prefix": a.cached_prefix,
           "cached_tokens": cached,
           "ttft_ms": statistics.median(ttfts), "ttft_ms_all": [round(t, 2) for t in ttfts],
           "steps": steps, "step_walls_ms": [[round(w, 2) for w in sw] for sw in walls],
           "decode_step_ms": statistics.median(decode_walls),
           "host_ms": {k: round(v, 3) for k, v in median_split(splits).items()},
           "gpu_ms": statistics.median(gpu_ms) if cuda else None}
    log(f"MIXED {json.dumps(row)}")
    return row


def agreement_run(llm, a) -> dict:
    """Greedy tokens and their logprobs for a few prompts of mixed lengths sent together (one step
    prefills them all, then decode steps): what the replay A/B compares (`compare`)."""
    from vllm import SamplingParams

    from serve_bench.measures import make_prompts

    lens = [n for n in (37, 300, 1000, max(a.lengths)) if n <= max(a.lengths)]
    # then prompts of 5 ... 300 tokens (535 in all): one step that a whole-step CUDA graph runs
    # (export/full_graph.py), their decode steps too
    short = [n for n in (5, 37, 64, 129, 300) if a.cached_prefix + n + 8 <= a.max_len]
    lens += short
    # with --cached-prefix each prompt follows the shared prefix that mixed_row put in the cache: the
    # agreement then compares steps that start from restored state pages
    pre = make_prompts(1, a.cached_prefix, seed=51)[0] if a.cached_prefix else []
    prompts = [pre + make_prompts(1, n, seed=20 + i)[0] for i, n in enumerate(lens)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False, logprobs=0)
    outs = []
    for batch in (prompts[:len(lens) - len(short)], prompts[len(lens) - len(short):]):
        outs += llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
    toks = [list(o.outputs[0].token_ids) for o in outs]
    lps = [[float(d[t].logprob) for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return {"prompt_lens": lens, "tokens": toks, "logprobs": lps,
            "cached_tokens": [getattr(o, "num_cached_tokens", None) for o in outs]}


def compare(a: dict, b: dict) -> dict:
    """Two agreement runs: whether their tokens are equal, and the largest logprob difference over
    the positions where both generated the same tokens so far (after a greedy tie breaks the other
    way the two score different tokens in different contexts)."""
    diffs = []
    for ta, tb, la, lb in zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"]):
        for i, (x, y) in enumerate(zip(la, lb)):
            if ta[:i + 1] != tb[:i + 1]:
                break
            diffs.append(abs(x - y))
    return {"tokens_equal": a["tokens"] == b["tokens"], "max_abs_logprob_diff": max(diffs, default=0.0),
            "positions_compared": len(diffs), "positions": sum(len(t) for t in a["tokens"])}


def tiny_folder(folder: Path, max_len: int) -> Path:
    """The tiny config's random-weight float32 folder (--smoke without --model-dir), built once."""
    if not (folder / "config.json").exists():
        from laplace_jax.config import load_config
        from serve_bench.folders import build_random_folder

        build_random_folder(load_config("laplace_tiny").model, folder, "float32", max_len)
    return folder


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--peer-dir", default=None, help="the Llama peer's folder (none: Laplace alone)")
    ap.add_argument("--replay-ab", action="store_true",
                    help="Laplace also with LAPLACE_VLLM_REPLAY=0 (export/ops/launch_tape.py off)")
    ap.add_argument("--graphs-ab", action="store_true",
                    help="Laplace with LAPLACE_VLLM_FULL_GRAPHS=1 (whole-step CUDA graphs, which vLLM's OpenAI "
                         "server gets by default, export/full_graph.py) and again with =0 (vLLM's "
                         "FULL_AND_PIECEWISE, the offline engine's default): both rows, and their agreement")
    ap.add_argument("--lengths", default=None, help="comma list of prompt lengths")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--decodes", type=int, default=0,
                    help="also measure each length arriving while this many requests decode (0: not)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--capture", type=int, default=None,
                    help="max_cudagraph_capture_size (default: vLLM's own, as online_bench's servers)")
    ap.add_argument("--cached-prefix", type=int, default=0,
                    help="with --decodes: prefix caching on, each arrival after this many shared prefix tokens")
    ap.add_argument("--block-size", type=int, default=256, help="the engines' block size with --cached-prefix")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--budget", type=int, default=None,
                    help="the engines' max_num_batched_tokens (default: vLLM's): a small one makes every "
                         "step of the agreement run mix prefill chunks with decodes")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.lengths = [int(x) for x in (a.lengths or ("32,64" if a.smoke else "512,2048,8192")).split(",")]
    a.dtype = a.dtype or ("float32" if a.smoke else "bfloat16")
    # the longest prompt, or a decoding request of a mixed row, and room to generate
    a.max_len = max(max(a.lengths) + a.cached_prefix, BG_LEN + background_tokens(a.reps)) + 64
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.child:
        res = child(a)
        (out / f"prefill_host_{a.child}.json").write_text(json.dumps(res, indent=2) + "\n")
        from vllm_check import exit_skipping_teardown
        exit_skipping_teardown(0)
    if a.model_dir is None and a.smoke:
        a.model_dir = str(tiny_folder(out / "tiny_laplace", a.max_len))
    if a.model_dir is None:
        raise SystemExit("error: --model-dir FOLDER (a Laplace export, e.g. the serve benchmark's) is required")
    # (name, folder, environment): the A/B children switch one thing each
    models = ([("laplace", a.model_dir, {"LAPLACE_VLLM_FULL_GRAPHS": "1"} if a.graphs_ab else {})]
              + ([("laplace_live", a.model_dir, {"LAPLACE_VLLM_REPLAY": "0"})] if a.replay_ab else [])
              + ([("laplace_pw", a.model_dir, {"LAPLACE_VLLM_FULL_GRAPHS": "0"})] if a.graphs_ab else [])
              + ([("llama", a.peer_dir, {})] if a.peer_dir else []))
    result = {"args": {k: v for k, v in vars(a).items() if k not in ("child", "folder")}, "models": {}}
    status = 0
    for name, folder, env in models:
        cmd = [sys.executable, __file__, "--out", str(out), "--child", name, "--folder", folder,
               "--lengths", ",".join(map(str, a.lengths)), "--reps", str(a.reps), "--dtype", a.dtype,
               "--max-num-seqs", str(a.max_num_seqs), "--decodes", str(a.decodes),
               "--cached-prefix", str(a.cached_prefix), "--block-size", str(a.block_size)] \
            + (["--budget", str(a.budget)] if a.budget else []) \
            + (["--capture", str(a.capture)] if a.capture else []) + (["--smoke"] if a.smoke else [])
        rc = subprocess.call(cmd, env={**os.environ, "LAPLACE_VLLM_REPLAY": "1", **env})
        path = out / f"prefill_host_{name}.json"
        if rc != 0 or not path.exists():
            log(f"{name}: child exited {rc}")
            status = 1
            continue
        result["models"][name] = json.loads(path.read_text())
    got = result["models"]
    # the tape replays the same launches (equal to the bit: a token that differs fails the run); the
    # whole-step graphs run other kernels (row-tiled conv, decode rows through the prefill kernel) in
    # another order: their difference is reported, for the reader to hold against its bound
    for other, key, strict in (("laplace_live", "replay_vs_live", True),
                               ("laplace_pw", "full_vs_piecewise_graphs", False)):
        if "laplace" in got and other in got:
            result[key] = compare(got["laplace"]["agreement"], got[other]["agreement"])
            print(f"{key.replace('_', ' ')}: {result[key]}")
            if strict and not result[key]["tokens_equal"]:
                status = 1
    if "laplace" in got and not got["laplace"].get("replay_vs_live_same_engine", {}).get("tokens_equal", True):
        status = 1
    (out / "prefill_host.json").write_text(json.dumps(result, indent=2) + "\n")
    for name, res in result["models"].items():
        if res["agreement"].get("cached_tokens") and any(res["agreement"]["cached_tokens"]):
            print(f"{name:8s} agreement prompts' cached tokens: {res['agreement']['cached_tokens']}")
        for r in res["rows"]:
            print(f"{name:8s} {r['prompt_len']:6d} tokens: wall {r['wall_ms']:.2f} ms, forward GPU "
                  f"{r['forward_gpu_ms'] if r['forward_gpu_ms'] is None else round(r['forward_gpu_ms'], 2)} ms,"
                  f" host {r['host_ms']}")
        for r in res.get("mixed_rows", []):
            after = f" after {r['cached_prefix']} cached-prefix tokens (cached {r['cached_tokens']})" \
                if r.get("cached_prefix") else ""
            print(f"{name:8s} {r['prompt_len']:6d} tokens{after} beside {r['decodes']} decodes: "
                  f"TTFT {r['ttft_ms']:.2f} ms"
                  f" in {r['steps']} steps {r['step_walls_ms']}, decode-only step {r['decode_step_ms']:.2f} ms,"
                  f" GPU {r['gpu_ms']}, host {r['host_ms']}")
    return status


if __name__ == "__main__":
    sys.exit(main())
