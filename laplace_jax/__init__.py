"""laplace_jax: JAX/Flax reimplementation of i14's Laplace 3B (Simple GLA decoder)."""
__version__ = "0.1.0"
