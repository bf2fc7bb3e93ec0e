"""Requests one after another through stock vLLM, with or without prefix caching: what each
generated, the log-probabilities of what it generated, and what vLLM's prefix cache served.

    python benchmarks/prefix_cache_check.py --model DIR --requests '[[1, 2, 3], {"turn_of": 0, "add": [4]}]'
        [--caching on|off] [--block-size N] [--max-tokens 8] [--dtype float32] [--chat '[{...}]']
        [--cuda-graphs]

A request is a list of token ids, or {"turn_of": i, "add": [ids]}: request i's prompt, what request i
generated, then `add` (the next turn of a conversation that resends everything).  Requests run one
at a time, in order, so each can hit the states the earlier ones left in the cache.  Greedy,
`--max-tokens` tokens each (EOS ignored), with the log-probability of every generated token
(`logprobs=0`: the chosen token's own).  `--chat` sends one chat conversation through `LLM.chat`
(the folder's chat template) and reports its prompt ids and text.

Output (one line, `PREFIX_CACHE_RESULT {json}`): prompts, outputs, logprobs, num_cached_tokens per
request; vLLM's own counters `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` (tokens); the
cache settings vLLM chose (block size, mamba cache mode), whether it schedules asynchronously, and
the default sampling parameters it took from the folder's generation_config.json.
Used by tests/serve/test_prefix_cache.py (CPU) and handy on a GPU machine.
"""
import argparse
import json
import os

from vllm_check import _first_mixer, exit_skipping_teardown, json_arg, stop_engine   # benchmarks/

COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
RESULT = "PREFIX_CACHE_RESULT "


def result_of(stdout: str):
    """The result a run of this script printed (its last `PREFIX_CACHE_RESULT` line), else None."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT)]
    return json.loads(lines[-1][len(RESULT):]) if lines else None


def resolve(request, prompts: list, outputs: list) -> list:
    """The prompt of one request (see the module docstring), given the earlier ones' prompts and
    outputs."""
    if isinstance(request, dict):
        i = request["turn_of"]
        return prompts[i] + outputs[i] + list(request["add"])
    return list(request)


def _state_backend(worker) -> str:
    """Runs in the vLLM worker: the name of the attention backend of the mixers' state metadata."""
    return _first_mixer(worker).get_attn_backend().get_name()


def run(model: str, requests: list, *, caching: bool, block_size=None, max_tokens: int = 8,
        dtype: str = "float32", max_model_len: int = 1024, chat=None, cuda_graphs: bool = False) -> dict:
    from vllm import LLM, SamplingParams

    kw = dict(model=model, dtype=dtype, max_model_len=max_model_len, max_num_seqs=4, enforce_eager=not cuda_graphs,
              seed=0, enable_prefix_caching=caching, disable_log_stats=False)
    if block_size:
        kw["block_size"] = block_size
    llm = LLM(**kw)
    cfg = llm.llm_engine.vllm_config
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                        detokenize=False)
    prompts, outputs, logprobs, cached = [], [], [], []
    for req in requests:
        p = resolve(req, prompts, outputs)
        (o,) = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
        toks = list(o.outputs[0].token_ids)
        prompts.append(p)
        outputs.append(toks)
        logprobs.append([step[t].logprob for step, t in zip(o.outputs[0].logprobs, toks)])
        cached.append(int(o.num_cached_tokens or 0))
    counters = {m.name: m.value for m in llm.get_metrics() if m.name in COUNTERS}
    res = {"prompts": prompts, "outputs": outputs, "logprobs": logprobs, "num_cached_tokens": cached,
           "counters": counters,
           "cache": {k: getattr(cfg.cache_config, k) for k in
                     ("enable_prefix_caching", "block_size", "mamba_block_size", "mamba_cache_mode")},
           "async_scheduling": bool(cfg.scheduler_config.async_scheduling),
           "state_backend": llm.collective_rpc(_state_backend)[0],
           "sampling_defaults": cfg.model_config.get_diff_sampling_param()}
    if chat is not None:
        (o,) = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        res["chat"] = {"prompt_token_ids": list(o.prompt_token_ids), "text": o.outputs[0].text,
                       "token_ids": list(o.outputs[0].token_ids)}
    stop_engine(llm)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/prefix_cache_check.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", required=True, help="JSON list (see above), or @file")
    ap.add_argument("--caching", choices=("on", "off"), default="on")
    ap.add_argument("--block-size", type=int, default=None, help="vLLM's --block-size (default: vLLM's pick)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--chat", default=None, help="JSON list of chat messages for LLM.chat")
    ap.add_argument("--cuda-graphs", action="store_true", help="vLLM's CUDA graphs on (default: eager)")
    a = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")   # _state_backend, sent to the worker
    res = run(a.model, json_arg(a.requests), caching=a.caching == "on", block_size=a.block_size,
              max_tokens=a.max_tokens, dtype=a.dtype, max_model_len=a.max_model_len,
              chat=json_arg(a.chat) if a.chat else None, cuda_graphs=a.cuda_graphs)
    print(RESULT + json.dumps(res))
    return 0


if __name__ == "__main__":
    exit_skipping_teardown(main())
