"""Which form of an op with Pallas GPU kernels runs: the `impl` argument of `chunk_simple_gla` and
`gated_mix` (configs: `execution.gla_impl`, `execution.mix_impl`, resolved by
`config.resolve_execution`; `auto` here serves callers of the ops themselves)."""
from __future__ import annotations

import jax


def kernel_impl(caller: str, impl: str) -> str:
    """'xla' | 'pallas' | 'auto' → 'xla' or 'pallas'; 'auto' is 'pallas' on GPUs and 'xla' on every
    other backend (CPU, Neuron)."""
    if impl not in ("xla", "pallas", "auto"):
        raise ValueError(f"{caller}: impl={impl!r}: choose 'xla', 'pallas' or 'auto'")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return impl
