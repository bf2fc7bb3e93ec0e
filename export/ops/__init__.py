"""export's Triton kernels, one module per kernel family, each holding its kernel(s) and launcher only.

`triton_switch` is the one place triton is imported and switched on or off (`available`, `enabled`);
`conv` (the causal conv window + SiLU, prefill and decode), `gla_decode` (one GLA step),
`gla_prefill` (the chunked GLA of packed prefill requests) and `gated_mix` (the post-GLA step) import
only it and torch.  Their float64 references live in export/reference.py, their error bounds and
checks in export/checks.py, their timing in benchmarks/ops/bench_kernels.py.
"""
