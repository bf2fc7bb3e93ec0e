"""The vLLM side of the benchmark: the plugin entry point, the environment, the kernel checks of
phase b, the engine's arguments and start, probes of its worker, and the comparison's child
processes (one engine per process)."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from serve_bench.rows import Heartbeat, Rows, log

ENTRY_GROUP = "vllm.general_plugins"
ENTRY_NAME = "laplace"
ENTRY_VALUE = "export.vllm_plugin:register"
PACKAGE = Path(__file__).resolve().parent      # benchmarks/serve_bench: run as `python <PACKAGE>`
BENCHMARKS = PACKAGE.parent
REPO_ROOT = BENCHMARKS.parent

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
    _prepend_pythonpath(str(BENCHMARKS))   # and serve_bench, vllm_check (_pool_info runs there)
    if plugin_registered():
        return "installed"
    site = work / "entry_points"
    dist = write_entry_point_dist(site)
    _prepend_pythonpath(str(site))
    if not plugin_registered():
        raise RuntimeError(f"wrote {dist} but the {ENTRY_GROUP} entry point is still not found")
    return f"not installed: wrote {dist} and put {site} on PYTHONPATH"


# ----------------------------------------------------------------------------- b. kernel checks

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


# ----------------------------------------------------------------------------- c. vLLM worker probes

def _pool_info(worker):
    """Runs in the vLLM worker: state bytes per sequence slot, slots in the pool, decode path."""
    from export import vllm_model
    from export.ops import triton_switch
    from vllm_check import _state_bytes   # benchmarks/vllm_check.py

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


# ----------------------------------------------------------------------------- c. the engine

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


# ----------------------------------------------------------------------------- the comparison's children

def child_argv(a, kind: str) -> list[str]:
    """This program for one model of the comparison, with the engine settings of this run."""
    argv = [sys.executable, str(PACKAGE), "--model-kind", kind, "--out", str(Path(a.out) / kind),
            "--shapes", ",".join(map(str, a.shapes)), "--dtype", a.dtype, "--gpu-mem", str(a.gpu_mem),
            "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--llm-kwargs", json.dumps(a.llm_kwargs),
            "--repeats", str(a.repeats)]
    argv += ["--config", a.config] if a.config else []
    argv += [flag for flag, on in (("--smoke", a.smoke), ("--enforce-eager", a.enforce_eager),
                                   ("--no-half", a.no_half)) if on]
    folder = a.model_dir if kind == "laplace" else a.peer_dir
    return argv + (["--model-dir" if kind == "laplace" else "--peer-dir", folder] if folder else [])


def on_sigterm(signum, frame):
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
