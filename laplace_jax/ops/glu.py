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
    # One elementwise expression over the (a, b) pair axis of y viewed as [..., 2, F], so XLA writes
    # the [..., 2F] cotangent in one pass. Autodiff's concatenate([da, db]) materialised both halves
    # and then copied them, once for each GEMM that reads the cotangent (~1 ms per 3B layer at B=16).
    F = y.shape[-1] // 2
    pair = y.reshape(*y.shape[:-1], 2, F).astype(F32)
    a, b = pair[..., :1, :], pair[..., 1:, :]                 # [..., 1, F]: broadcast over the pair axis
    sa = jax.nn.sigmoid(a)
    is_a = (jnp.arange(2) == 0)[:, None]                      # [2, 1]
    d = dh.astype(F32)[..., None, :] * jnp.where(is_a, b * sa * (1.0 + a * (1.0 - sa)), a * sa)
    # Written once: without the barrier XLA fused this expression into both consumer GEMMs as a
    # Triton prologue, computing it twice in slower GEMMs than cuBLAS's (BENCHMARKS.md, runs 15-16).
    return (jax.lax.optimization_barrier(d.reshape(y.shape).astype(y.dtype)),)


swiglu.defvjp(_fwd, _bwd)
