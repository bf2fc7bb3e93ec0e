"""Abstract parameter tree (docs/PARAMS.md) for the optimizer, its tests and the traffic tool.

The optimizer only ever sees params as a pytree; this builds the same tree from a `ModelConfig`
without importing the model (the lead may later point `param_shapes` at the model's own
`jax.eval_shape(init_params, ...)` -- the tree must stay identical).
"""
from __future__ import annotations

from typing import Any


def param_shape_tuples(m: Any) -> dict[str, Any]:
    """PARAMS.md tree as nested dicts of shape tuples (pure Python, no jax import)."""
    L, D, Q, F = m.num_layers, m.d_model, m.qkvg_dim, m.ffn_dim
    C, T, V, H, K, N = m.conv_kernel, m.decay_tiers, m.d_v, m.num_heads, m.d_k, m.vocab_size
    return {
        "embed": (N, D),
        "layers": {
            "attn_norm": (L, D),
            "conv_w": (L, C, D),
            "conv_b": (L, D),
            "w_qkvg": (L, D, Q),
            "aug_balance": (L, H, K),
            "head_norm": (L, T, V),
            "w_out": (L, D, D),
            "ffn_norm": (L, D),
            "w_12": (L, D, 2 * F),
            "w_3": (L, F, D),
        },
        "final_norm": (D,),
        "lm_head": (D, N),
    }


def param_shapes(model_cfg: Any) -> Any:
    """Pytree of `jax.ShapeDtypeStruct` (float32) matching docs/PARAMS.md for `model_cfg`."""
    import jax
    import jax.numpy as jnp

    def conv(t: Any) -> Any:
        if isinstance(t, dict):
            return {k: conv(v) for k, v in t.items()}
        return jax.ShapeDtypeStruct(tuple(t), jnp.float32)

    return conv(param_shape_tuples(model_cfg))
