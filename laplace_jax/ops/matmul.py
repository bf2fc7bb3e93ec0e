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


def mixed_matmul(spec: str, a: Array, b: Array, out_dtype: Any = F32) -> Array:
    """einsum with float32 accumulation, output in `out_dtype` (default float32); the backward runs
    in the inputs' dtype.

    A bf16 `out_dtype` is what autocast writes: the GEMM accumulates in float32 and rounds once on
    output, halving the bytes written, saved for the backward and read by the next op. Then the
    cotangent is already bf16 and autodiff's own transposed products run as bf16 GEMMs, so this
    is a plain `dot_general`, which remat policies (`dots_with_no_batch_dims_saveable`) can see and
    save: behind a `custom_vjp` they cannot, and the backward re-ran every forward GEMM.

    A wider `out_dtype` (float32 logits) goes through `_widening_matmul`: plain autodiff would hand
    the float32 cotangent to the transposed products, which then run as float32 (TF32 on GPUs)
    matmuls at about half the bf16 rate."""
    if jnp.dtype(out_dtype) == jnp.promote_types(a.dtype, b.dtype):
        return jnp.einsum(spec, a, b, preferred_element_type=out_dtype)
    return _widening_matmul(spec, a, b, out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _widening_matmul(spec: str, a: Array, b: Array, out_dtype: Any) -> Array:
    """`mixed_matmul` for an output wider than the inputs: the cotangent is cast to the input dtype
    first (as bf16 autocast training does); the transposed products still accumulate in float32."""
    return jnp.einsum(spec, a, b, preferred_element_type=out_dtype)


def _mm_fwd(spec, a, b, out_dtype):
    return _widening_matmul(spec, a, b, out_dtype), (a, b)


def _mm_bwd(spec, out_dtype, res, g):
    a, b = res
    sa, sb = _transposed_spec(spec)
    g = g.astype(jnp.promote_types(a.dtype, b.dtype))
    da = jnp.einsum(sa, g, b, preferred_element_type=F32).astype(a.dtype)
    db = jnp.einsum(sb, g, a, preferred_element_type=F32).astype(b.dtype)
    return da, db


_widening_matmul.defvjp(_mm_fwd, _mm_bwd)
