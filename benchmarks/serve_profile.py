"""Where the time goes inside vLLM: torch-profiler tables of one prefill step and of decode steps.

    python benchmarks/serve_profile.py --out DIR [--prefill-seqs 8 --prompt-len 2048
        --decode-width 1280 --decode-steps 8 --max-num-batched-tokens 16384]
    python benchmarks/serve_profile.py --smoke --out DIR     # CPU, tiny config (the test)

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so one torch profiler sees every
kernel the model launches, the ones replayed from CUDA graphs included.  Same random-weight folder as
`benchmarks/serve_bench` (reused from /dev/shm when there).  The prefill step is profiled twice in the
same engine, on the torch path (LAPLACE_VLLM_TRITON=0) and on the packed Triton path (where triton
runs: CUDA).  Writes DIR/profile_prefill_{torch,triton}.txt and DIR/profile_decode.txt (the top ops
by self device time) and DIR/profile.json: per phase the wall time of the profiled region and the
device time split by kernel kind (GEMM, Triton, copies, ...), and first `path_agreement`: the
Triton decode and prefill paths against the torch prefill on the same tokens' log-probabilities.
Each profiled region also runs once with no profiler (wall time alone), and the decode steps once
more under cProfile: DIR/profile_decode_host.txt, where the host's time goes between kernels.
--decode-width 0 skips the decode profile.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_check import exit_skipping_teardown, stop_engine
from serve_bench.engine import ensure_plugin_entry_point, prefer_v2_runner
from serve_bench.folders import FOLDER_LEN, laplace_folder
from serve_bench.measures import make_prompts
from serve_bench.rows import log

# kernel-name fragments → kind, first match wins (cuBLAS/CUTLASS GEMMs, Inductor's and our Triton
# kernels, copies and gathers, the rest of aten's element-wise and reduction kernels)
KINDS = (("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas")),
         ("triton: ours (GLA, conv, mix)", ("_gla_", "_conv_", "_mix_")),
         ("triton: inductor", ("triton_",)),
         ("copy / gather / scatter", ("copy", "index", "gather", "scatter", "cat", "Cat", "memcpy", "Memcpy",
                                      "memset", "Memset", "fill")),
         ("aten element-wise / reduce", ("elementwise", "reduce", "Reduce", "softmax", "norm")))


def kind_of(name: str) -> str:
    for kind, keys in KINDS:
        if any(k in name for k in keys):
            return kind
    return "other"


def summarize(prof, wall_s: float, steps: int) -> dict:
    """Device time by kernel kind (ms per step) from the profiler's kernel events."""
    by_kind: dict[str, float] = {}
    total = 0.0
    for e in prof.events():
        if e.device_type.name not in ("CUDA", "PrivateUse1") or e.device_time_total is None:
            continue
        us = e.device_time_total
        by_kind[kind_of(e.name)] = by_kind.get(kind_of(e.name), 0.0) + us
        total += us
    per = max(1, steps)
    return {"wall_ms_per_step": 1e3 * wall_s / per, "device_ms_per_step": total / 1e3 / per,
            "by_kind_ms_per_step": {k: round(v / 1e3 / per, 3) for k, v in sorted(by_kind.items(),
                                                                             key=lambda kv: -kv[1])}}


def table(prof) -> str:
    sort = "self_cuda_time_total" if prof.use_device == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=45, max_name_column_width=90)


def timed(fn, cuda: bool) -> float:
    """Wall seconds of fn() (after the GPU has finished)."""
    import torch

    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def profiled(fn, cuda: bool):
    """Runs fn() under the torch profiler; returns (profiler, wall seconds)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        wall = timed(fn, cuda)
    return prof, wall


def host_profiled(fn, path: Path, cuda: bool, top: int = 35) -> float:
    """Runs fn() under cProfile and writes the top host functions by own and by cumulative time to
    `path` (time a function spends blocked on the GPU, e.g. in a synchronize or a .tolist() of a
    device tensor, is its own time).  Returns the wall seconds."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    wall = timed(fn, cuda)
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    for key in ("tottime", "cumulative"):
        stats.sort_stats(key).print_stats(top)
    path.write_text(text.getvalue())
    return wall


def decode_steps(llm, width: int, prompt_len: int, steps: int):
    """Adds `width` short requests, steps the engine until every request has its first token (all
    prefills done), then returns a function that runs `steps` pure decode steps."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    eng = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=3 * steps + 64, ignore_eos=True, detokenize=False)
    ids = [f"dec-{i}" for i in range(width)]
    for rid, p in zip(ids, make_prompts(width, prompt_len, seed=5)):
        eng.add_request(rid, TokensPrompt(prompt_token_ids=p), sp)
    seen: set = set()
    for _ in range(10 * width + 100):
        seen.update(o.request_id for o in eng.step() if o.outputs[0].token_ids)
        if len(seen) >= width:
            break
    for _ in range(3):          # async scheduling: let the pipeline settle on full-width decode
        eng.step()

    def run():
        for _ in range(steps):
            eng.step()
    return run, lambda: eng.abort_request(ids)


def path_agreement(llm, n: int = 4, prompt_len: int = 256, new: int = 32) -> dict:
    """The Triton paths against the torch prefill path, in this engine, on the log-probability of
    the same tokens: `new` greedy tokens generated on the default (Triton) decode path, CUDA graphs
    included, with their log-probabilities; then prompt+generated scored teacher-forced by the torch
    prefill (LAPLACE_VLLM_TRITON=0) and by the Triton prefill.  Returns |Δ log p| statistics (decode
    vs torch prefill, Triton prefill vs torch prefill) beside the spread of log p itself: a wrong
    kernel moves log p by about that spread, rounding (bf16) by far less."""
    import numpy as np
    from vllm import SamplingParams

    prompts = make_prompts(n, prompt_len, seed=7)
    gen = SamplingParams(temperature=0.0, max_tokens=new, logprobs=0, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], gen, use_tqdm=False)
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    dec = np.array([[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs])
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)

    def scored(switch: str) -> np.ndarray:
        os.environ["LAPLACE_VLLM_TRITON"] = switch
        res = llm.generate([{"prompt_token_ids": s} for s in seqs], score, use_tqdm=False)
        return np.array([[o.prompt_logprobs[t][s[t]].logprob for t in range(len(s) - new, len(s))]
                         for o, s in zip(res, seqs)])
    torch_pf, triton_pf = scored("0"), scored("1")
    os.environ.pop("LAPLACE_VLLM_TRITON")

    def stats(d: np.ndarray) -> dict:
        return {"max": float(d.max()), "p99": float(np.quantile(d, 0.99)), "mean": float(d.mean())}
    return {"tokens": int(dec.size), "std_logprob": float(torch_pf.std()),
            "decode_vs_torch_prefill": stats(np.abs(dec - torch_pf)),
            "triton_prefill_vs_torch_prefill": stats(np.abs(triton_pf - torch_pf))}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--prefill-seqs", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--decode-width", type=int, default=None, help="0: no decode profile")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--gpu-mem", type=float, default=0.90)
    a = ap.parse_args(argv)
    a.prefill_seqs = a.prefill_seqs or (2 if a.smoke else 8)
    a.prompt_len = a.prompt_len or (64 if a.smoke else 2048)
    a.decode_width = (4 if a.smoke else 1280) if a.decode_width is None else a.decode_width
    a.dtype = a.dtype or ("float32" if a.smoke else "bfloat16")
    a.max_num_batched_tokens = max(a.max_num_batched_tokens, a.prefill_seqs * a.prompt_len)
    return a


def setup_env(a) -> None:
    """Before vLLM is imported: the engine in this process, no FlashInfer sampler JIT, offline."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"       # the model runs in this process
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.smoke:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def start_engine(a, cuda: bool):
    """The serve benchmark's random-weight folder (built or reused) in an in-process vLLM engine."""
    import tempfile

    from vllm import LLM

    from laplace_jax.config import load_config
    from laplace_jax.spec import Arch

    prefer_v2_runner(cuda)
    cfg = load_config("laplace_tiny").model if a.smoke else Arch()
    max_len = max(a.prompt_len, 256 + 32) + 64 + a.decode_steps     # path_agreement: 256 + 32 tokens
    ensure_plugin_entry_point(Path(tempfile.mkdtemp(prefix="serve_profile_")))
    # the serve benchmark's folder (same length limit, so either program reuses the other's)
    folder, has_tok, _, _ = laplace_folder(a, cfg, max(max_len, FOLDER_LEN))
    kw = dict(model=str(folder), dtype=a.dtype, max_num_seqs=max(a.decode_width, a.prefill_seqs),
              max_model_len=max_len, max_num_batched_tokens=a.max_num_batched_tokens,
              enable_prefix_caching=False, seed=0, enforce_eager=a.smoke, skip_tokenizer_init=not has_tok)
    if cuda:
        kw.update(gpu_memory_utilization=a.gpu_mem,
                  compilation_config={"max_cudagraph_capture_size": kw["max_num_seqs"]})
    log(f"starting vLLM in-process: {kw}")
    return LLM(**kw)


def profile_prefill(llm, a, res: dict, out: Path, cuda: bool) -> None:
    """One prefill step of prefill_seqs x prompt_len on each path, profiled and bare; their ratio.
    The mixer is an opaque op run eagerly on prefill steps and reads LAPLACE_VLLM_TRITON per call,
    so both prefill paths run in this one engine: a same-process ratio."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(a.prefill_seqs, a.prompt_len, seed=3)]
    tokens = a.prefill_seqs * a.prompt_len
    for path, switch in (("torch", "0"), ("triton", "1")):
        os.environ["LAPLACE_VLLM_TRITON"] = switch
        llm.generate(prompts, sp, use_tqdm=False)                          # this path's warm-up
        prof, wall = profiled(lambda: llm.generate(prompts, sp, use_tqdm=False), cuda)
        row = res[f"prefill_{path}"] = summarize(prof, wall, 1)
        bare = timed(lambda: llm.generate(prompts, sp, use_tqdm=False), cuda)
        row.update(tokens=tokens, tok_per_s=tokens / wall, wall_ms_unprofiled=1e3 * bare,
                   tok_per_s_unprofiled=tokens / bare)
        (out / f"profile_prefill_{path}.txt").write_text(table(prof))
        host = host_profiled(lambda: llm.generate(prompts, sp, use_tqdm=False),
                             out / f"profile_prefill_{path}_host.txt", cuda)
        row.update(wall_ms_cprofile=1e3 * host)
        log(f"prefill ({path} path) {a.prefill_seqs} x {a.prompt_len}: {row}")
    os.environ.pop("LAPLACE_VLLM_TRITON")
    res["prefill_ratio_triton_vs_torch"] = res["prefill_triton"]["tok_per_s"] / res["prefill_torch"]["tok_per_s"]


def profile_decode(llm, a, res: dict, out: Path, cuda: bool) -> None:
    """decode_steps pure decode steps at decode_width: profiled, bare and under cProfile."""
    run, done = decode_steps(llm, a.decode_width, 16, a.decode_steps)
    prof, wall = profiled(run, cuda)
    bare = timed(run, cuda)
    host = host_profiled(run, out / "profile_decode_host.txt", cuda)
    done()
    res["decode"] = summarize(prof, wall, a.decode_steps)
    res["decode"].update(width=a.decode_width, wall_ms_per_step_unprofiled=1e3 * bare / a.decode_steps,
                         wall_ms_per_step_cprofile=1e3 * host / a.decode_steps)
    (out / "profile_decode.txt").write_text(table(prof))
    log(f"decode width {a.decode_width}: {res['decode']}")


def main(argv=None) -> int:
    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    setup_env(a)
    import torch

    from export.ops import triton_switch

    cuda = torch.cuda.is_available() and not a.smoke
    llm = start_engine(a, cuda)
    res = {"args": vars(a), "device": torch.cuda.get_device_name() if cuda else "cpu",
           # where triton cannot run (CPU), both prefill rows are the torch path
           "triton_runs_here": triton_switch.available(torch.empty(0, device="cuda" if cuda else "cpu"))}
    res["path_agreement"] = path_agreement(llm)
    log(f"paths: {res['path_agreement']}")
    profile_prefill(llm, a, res, out, cuda)
    (out / "profile.json").write_text(json.dumps(res, indent=2) + "\n")
    if a.decode_width:
        profile_decode(llm, a, res, out, cuda)
        (out / "profile.json").write_text(json.dumps(res, indent=2) + "\n")
    stop_engine(llm)
    return 0

if __name__ == "__main__":
    exit_skipping_teardown(main())
