"""The command line: `python benchmarks/serve_bench ...` (flags below; the phases in the package's
docstring)."""
import argparse
import json

import serve_bench
from serve_bench.measures import Shape, parse_shapes


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="benchmarks/serve_bench", description=serve_bench.__doc__.split("\n\n")[0])
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


def main(argv=None) -> int:
    """The default run (phases a-g), a comparison, or one model of a comparison (--model-kind)."""
    from serve_bench.compare import run_compare, run_model
    from serve_bench.phases import run_phases

    a = parse_args(argv)
    if a.model_kind:
        return run_model(a)
    if a.peer or a.shapes:
        return run_compare(a)
    return run_phases(a)
