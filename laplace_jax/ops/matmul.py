"""Matmuls with low-precision inputs, float32 accumulation, and a backward in the inputs' dtype."""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array
F32 = jnp.float32


def _transposed_spec(spec: str) -> tuple[str, str]:
    """'a,b->o' → the einsum specs of the two cotangents: 'o,b->a' and 'o,a->b'."""
    ins, out = spec.split("->")
    a, b = ins.split(",")
    return f"{out},{b}->{a}", f"{out},{a}->{b}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def mixed_matmul(spec: str, a: Array, b: Array, out_dtype: Any = F32) -> Array:
    """einsum with float32 accumulation, output in `out_dtype` (positional; default float32); the
    backward runs in the inputs' dtype.

    Plain autodiff would hand the float32 cotangent to the transposed products, which then run as
    float32 (TF32 on GPUs) matmuls at about half the bf16 rate. Here the cotangent is cast to the
    input dtype first (a no-op for float32 inputs), as bf16 autocast training does; the transposed
    products still accumulate in float32. A bf16 `out_dtype` is what autocast writes: the GEMM still
    accumulates in float32 and rounds once on output, halving the bytes written, saved for the
    backward and read by the next op."""
    return jnp.einsum(spec, a, b, preferred_element_type=out_dtype)


def _mm_fwd(spec, a, b, out_dtype):
    return mixed_matmul(spec, a, b, out_dtype), (a, b)


def _mm_bwd(spec, out_dtype, res, g):
    a, b = res
    sa, sb = _transposed_spec(spec)
    g = g.astype(jnp.promote_types(a.dtype, b.dtype))
    da = jnp.einsum(sa, g, b, preferred_element_type=F32).astype(a.dtype)
    db = jnp.einsum(sb, g, a, preferred_element_type=F32).astype(b.dtype)
    return da, db


mixed_matmul.defvjp(_mm_fwd, _mm_bwd)
