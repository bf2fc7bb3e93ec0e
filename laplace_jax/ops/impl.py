"""Which form of an op with Pallas GPU kernels runs: the `impl` argument of `chunk_simple_gla` and
`gated_mix` (configs: `execution.gla_impl`, `execution.mix_impl`, resolved by
`config.resolve_execution`; `auto` here serves callers of the ops themselves)."""
from __future__ import annotations

import jax

from laplace_jax.choices import KernelImpl, check_choice


def kernel_impl(caller: str, impl: KernelImpl) -> str:
    """'xla' | 'pallas' | 'auto' → 'xla' or 'pallas'; 'auto' is 'pallas' on GPUs and 'xla' on every
    other backend (CPU, Neuron)."""
    check_choice(f"{caller}: impl", impl, KernelImpl)
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return impl
