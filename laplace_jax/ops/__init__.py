"""Pure array math (no Flax, no configs, no meshes)."""
from laplace_jax.ops.gla import chunk_simple_gla, recurrent_simple_gla, simple_gla_step

__all__ = ["chunk_simple_gla", "recurrent_simple_gla", "simple_gla_step"]
