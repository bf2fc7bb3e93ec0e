"""The GLA output's gated mix: self-augmentation, head RMSNorm per decay tier, SiLU gate.

    gate = σ(Σ_k q ⊙ a ⊙ k)                 a = aug_balance [H, K]
    x    = o + gate · v
    y    = x / rms(x) ⊙ w[tier(h)] ⊙ silu(g)   w = head_norm [T, V], H/T contiguous heads per tier

q, k: [..., H, K]; v, g, o: [..., H, V] → y [..., H, V] in q's dtype; float32 math. `gated_mix` picks
this XLA form or the fused Pallas kernels of `ops.mix_pallas` (`impl`, as `chunk_simple_gla`).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from laplace_jax.choices import KernelImpl
from laplace_jax.ops.impl import kernel_impl

Array = jax.Array
F32 = jnp.float32


def head_rms_norm(o: Array, weight: Array, eps: float) -> Array:
    """o: [..., H, V]; weight: [T, V] shared by the H/T contiguous heads of each decay tier → f32."""
    *lead, H, V = o.shape
    T = weight.shape[0]
    o = o.astype(F32).reshape(*lead, T, H // T, V)
    o = o * jax.lax.rsqrt(jnp.square(o).mean(-1, keepdims=True) + eps) * weight[:, None, :]
    return o.reshape(*lead, H, V)


def gated_mix_xla(q: Array, k: Array, v: Array, g: Array, o: Array, aug_balance: Array,
                  head_norm: Array, eps: float) -> Array:
    """The mix as plain jnp (autodiff backward); shapes in the module doc."""
    gate = jax.nn.sigmoid(jnp.sum(q.astype(F32) * aug_balance * k.astype(F32), -1, keepdims=True))
    x = o.astype(F32) + gate * v.astype(F32)
    return (head_rms_norm(x, head_norm, eps) * jax.nn.silu(g.astype(F32))).astype(q.dtype)


def gated_mix(q: Array, k: Array, v: Array, g: Array, o: Array, aug_balance: Array, head_norm: Array,
              eps: float, *, impl: KernelImpl = "xla") -> Array:
    """The gated mix (module doc). `impl="pallas"` runs `ops.mix_pallas` (one fused kernel each way;
    GPUs, interpreted on CPU) where the shape allows and this XLA form elsewhere (e.g. a decode step
    of a few tokens); `impl="auto"` is "pallas" on GPUs and "xla" on every other backend."""
    if kernel_impl("gated_mix", impl) == "pallas":
        from laplace_jax.ops import mix_pallas  # Pallas is imported only where it is asked for

        if mix_pallas.supported(math.prod(q.shape[:-2]), q.shape[-1], v.shape[-1]) is None:
            return mix_pallas.gated_mix_pallas(q, k, v, g, o, aug_balance, head_norm, eps)
    return gated_mix_xla(q, k, v, g, o, aug_balance, head_norm, eps)
