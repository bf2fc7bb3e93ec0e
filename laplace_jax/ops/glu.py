"""The FFN's gated linear unit: silu(a) * b over the two halves of one fused projection."""
from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array
F32 = jnp.float32


@jax.custom_vjp
def swiglu(y: Array) -> Array:
    """y [..., 2F] = (a | b) → silu(a) * b [..., F]; float32 math, output in y's dtype."""
    F = y.shape[-1] // 2
    a, b = y[..., :F].astype(F32), y[..., F:].astype(F32)
    return (jax.nn.silu(a) * b).astype(y.dtype)


def _fwd(y: Array) -> tuple[Array, Array]:
    return swiglu(y), y


def _bwd(y: Array, dh: Array) -> tuple[Array]:
    F = y.shape[-1] // 2
    a, b = y[..., :F].astype(F32), y[..., F:].astype(F32)
    sa = jax.nn.sigmoid(a)
    d = dh.astype(F32)
    # The [..., 2F] cotangent is written once, behind a barrier: without it XLA fused autodiff's
    # concatenate into both consumer GEMMs as a Triton prologue, building it twice in GEMMs slower
    # than cuBLAS's (BENCHMARKS.md, runs 15-16). A broadcast over a [..., 2, F] pair axis instead
    # made XLA write a float32 intermediate and take two passes (run 18).
    da = d * b * sa * (1.0 + a * (1.0 - sa))
    return (jax.lax.optimization_barrier(jnp.concatenate([da, d * a * sa], -1).astype(y.dtype)),)


swiglu.defvjp(_fwd, _bwd)
