"""Helpers for tests and self-checks: the tiny config and random (non-trivial) parameters."""
import numpy as np

from export.torch_model import LaplaceConfig

TINY = dict(vocab_size=50304, d_model=128, num_layers=2, num_heads=4, d_k=16, d_v=32, qkvg_dim=384,
            conv_kernel=4, ffn_dim=256, decay_tiers=2, t_min=1.0, t_max=256.0, seq_len=256, num_chunks=16)


def tiny_model_cfg():
    """laplace_jax's ModelConfig when importable, else the torch-side LaplaceConfig (same fields)."""
    try:
        from laplace_jax.config import ModelConfig
        return ModelConfig(**TINY, compute_dtype="float32")
    except ImportError:
        return LaplaceConfig(**TINY)


def random_params(cfg, seed=0, scale=0.2):
    """A docs/PARAMS.md tree of float32 numpy arrays with non-trivial values everywhere."""
    r = np.random.default_rng(seed)
    L, D, H, K, V, F, C, T, N = (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.d_k, cfg.d_v,
                                 cfg.ffn_dim, cfg.conv_kernel, cfg.decay_tiers, cfg.vocab_size)

    def n(*shape, mean=0.0, s=scale):
        return (mean + s * r.standard_normal(shape)).astype(np.float32)

    return {
        "embed": n(N, D, s=1.0),
        "layers": {
            "attn_norm": n(L, D, mean=1.0, s=0.1), "conv_w": n(L, C, D, s=0.5), "conv_b": n(L, D, s=0.1),
            "w_qkvg": n(L, D, cfg.qkvg_dim, s=D ** -0.5), "aug_balance": n(L, H, K, s=0.5),
            "head_norm": n(L, T, V, mean=1.0, s=0.1), "w_out": n(L, D, D, s=D ** -0.5),
            "ffn_norm": n(L, D, mean=1.0, s=0.1), "w_12": n(L, D, 2 * F, s=D ** -0.5),
            "w_3": n(L, F, D, s=F ** -0.5),
        },
        "final_norm": n(D, mean=1.0, s=0.1),
        "lm_head": n(D, N, s=D ** -0.5 * 3),
    }
