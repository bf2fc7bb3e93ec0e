"""Platform selection: `platform: auto|cpu|gpu|neuron` (config key, or `--platform`)."""
from __future__ import annotations

import jax

from laplace_jax.config import ConfigError

NEURON_INSTALL = ("pip install 'laplace_jax[neuron]' --extra-index-url "
                  "https://pip.repos.neuron.amazonaws.com  (jax-neuronx comes only from AWS's Neuron index)")
_JAX_NAMES = {"cpu": "cpu", "gpu": "cuda", "neuron": "neuron,cpu"}  # neuron keeps the host CPU for init


def select_platform(name: str) -> None:
    """Point JAX at one backend before any computation runs; `auto` leaves JAX's own choice."""
    if name == "auto":
        return
    if name not in _JAX_NAMES:
        raise ConfigError(f"platform={name!r}: choose one of auto, cpu, gpu, neuron")
    if name == "neuron":
        try:
            import jax_neuronx  # noqa: F401  (registers the `neuron` PJRT plugin)
        except ImportError:
            raise ConfigError(f"platform=neuron needs jax-neuronx, which is not installed: {NEURON_INSTALL}") from None
    jax.config.update("jax_platforms", _JAX_NAMES[name])
