"""The per-step token budget Laplace gets from vLLM's OpenAI server when the user gives none.

vLLM's scheduler fills each engine step with the running sequences' next tokens, then prefill chunks
of waiting prompts up to `max_num_batched_tokens`; a running sequence's next token waits for the
whole step.  So the budget bounds the worst inter-token gap.  vLLM's own default for its OpenAI server
on an H100/H200-class GPU is 8,192 tokens (`EngineArgs.get_batch_defaults`), sized for transformers.

For Laplace a step's time is linear in its tokens (no attention over a KV cache): one H200, 3B,
prefill ≈ 9.3 µs a prompt token (107k prompt tok/s through vLLM, BENCHMARKS.md run S12), a decode
step of a few dozen sequences ≈ 6.5 ms (TPOT median at 12 req/s, shared/notes/online-serving.md).
A full 8,192-token step then holds every running sequence ≈ 6.5 + 8,192 x 0.0093 ≈ 83 ms; the Llama
peer's p99 inter-token latency at 12 req/s was 33 ms.  With 2,048 tokens the worst step is
≈ 6.5 + 19 ≈ 26 ms, under that; and chunking a prompt costs Laplace nothing but the step overhead (the
fixed state is carried exactly from chunk to chunk, no KV re-read).  The price: a lone 8,192-token
prompt prefills in 4 steps instead of 1 (≈ 4 x 3 ms of step overhead on ≈ 76 ms of prefill).

Applied only where it helps latency and the user set nothing: the OpenAI server (vLLM's offline
`LLM` class keeps its throughput default), chunked prefill not turned off, `--performance-mode`
not 'throughput', no `--max-num-batched-tokens`.  It is never below `--max-num-seqs` (vLLM requires
budget ≥ sequences).  `vllm serve EXPORT --max-num-batched-tokens N` overrides it.

How: vLLM decides the defaults in `EngineArgs._set_default_max_num_seqs_and_batched_tokens_args
(usage_context, model_config, parallel_config)` (the same in 0.26 and 0.32), after loading the
general plugins and before any model hook sees the config; `install()` wraps that method to fill in
the budget for this architecture first.
"""
import functools
import logging

ONLINE_TOKENS_PER_STEP = 2048
_HOOK = "_set_default_max_num_seqs_and_batched_tokens_args"

# a child of vLLM's own logger, so the line shows in the server's log with vLLM's format and level
logger = logging.getLogger("vllm.laplace.step_budget")


def online_token_budget(max_num_seqs: int | None) -> int:
    """Tokens per engine step for online serving: ONLINE_TOKENS_PER_STEP, or `max_num_seqs` if larger."""
    return max(ONLINE_TOKENS_PER_STEP, max_num_seqs or 0)


def applies(args, usage_context, architectures: list[str], arch: str) -> bool:
    """Whether the Laplace default fills in `args.max_num_batched_tokens` (vLLM `EngineArgs`) for a
    model of `architectures`; `arch` is Laplace's architecture name."""
    from vllm.usage.usage_lib import UsageContext
    return (arch in architectures and usage_context == UsageContext.OPENAI_API_SERVER
            and args.max_num_batched_tokens is None and args.enable_chunked_prefill is not False
            and getattr(args, "performance_mode", None) != "throughput")


def install(arch: str) -> None:
    """Wrap vLLM's default-setting method once, for models of architecture `arch` (idempotent; vLLM
    calls plugins in every process)."""
    from vllm.engine.arg_utils import EngineArgs
    original = getattr(EngineArgs, _HOOK, None)
    if original is None:
        raise RuntimeError(f"vLLM's EngineArgs has no {_HOOK}: this vLLM version is not one the Laplace "
                           "plugin knows (0.26, 0.32); pass --max-num-batched-tokens explicitly and report it")
    if getattr(original, "_laplace_budget", False):
        return

    @functools.wraps(original)
    def with_laplace_budget(self, usage_context, model_config, parallel_config):
        if applies(self, usage_context, list(model_config.architectures or []), arch):
            self.max_num_batched_tokens = online_token_budget(self.max_num_seqs)
            logger.info("Laplace: max_num_batched_tokens = %d for online serving (a bounded step keeps the "
                        "inter-token latency steady; export/step_budget.py says why); "
                        "--max-num-batched-tokens overrides it", self.max_num_batched_tokens)
        return original(self, usage_context, model_config, parallel_config)

    with_laplace_budget._laplace_budget = True
    setattr(EngineArgs, _HOOK, with_laplace_budget)
