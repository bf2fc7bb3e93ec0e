"""export's Triton kernels, one module per kernel family, each holding its kernel(s) and launcher only.

`triton_switch` is the one place triton is imported and switched on or off (`available`, `enabled`);
`conv` (the causal conv window + SiLU, prefill and decode), `gla_decode` (one GLA step),
`gla_prefill` (the chunked GLA of packed prefill requests, serial over a request's chunks),
`gla_prefill_chunked` (the same with the chunks spread over the grid; `gla_prefill` picks),
`gla_chunk_math` (the chunk math both prefills share) and `gated_mix` (the post-GLA step) import
only it, `launch_keys` and torch.  `launch_keys`: every launcher launches through its `run` (which
can record Triton's cache key instead); `warmup`: the vLLM mixer launches every kernel variant when
its state pools are bound.  Their float64 references live in export/reference.py, their error bounds
and checks in export/checks.py, their timing in benchmarks/ops/.
"""
