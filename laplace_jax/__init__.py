"""laplace_jax: JAX/Flax reimplementation of i14's Laplace 3B (Simple GLA decoder)."""
__version__ = "0.1.0"

import logging as _logging

# grain warns at import that worker profiling needs jaxlib >= 0.11; we pin 0.10 for jax-neuronx.
_logging.getLogger("absl").addFilter(lambda r: "worker profiling requires" not in r.getMessage())
