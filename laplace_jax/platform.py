"""Platform selection: `platform: auto|cpu|gpu|neuron` (config key, or `--platform`), and the size of
JAX's GPU memory pool (`train.gpu_mem_fraction`), set before JAX starts its backend."""
from __future__ import annotations

import os
from typing import Mapping

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


# The variable the trainer sets, and every variable by which a user sizes JAX's GPU memory pool
# themselves (jaxlib's generate_pjrt_gpu_plugin_options reads them when the GPU backend starts, not at
# `import jax`; XLA_CLIENT_MEM_FRACTION is the newer name, and jaxlib refuses both names at once).
MEM_FRACTION_VAR = "XLA_PYTHON_CLIENT_MEM_FRACTION"
USER_GPU_MEMORY_VARS = (MEM_FRACTION_VAR, "XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
                        "XLA_PYTHON_CLIENT_ALLOCATOR")
_GPU_NAMES = {"cuda", "gpu", "rocm"}


def gpu_memory_env(env: Mapping[str, str], platform: str, fraction: float) -> dict[str, str]:
    """The variables to set (none, or {MEM_FRACTION_VAR: fraction}) so that JAX's memory pool takes
    `fraction` of each GPU instead of its default 0.75: none where the user set any of
    USER_GPU_MEMORY_VARS (non-empty), or where the run cannot be on a GPU (`platform` cpu or neuron, or
    auto with JAX_PLATFORMS naming no GPU). `env`: the environment (os.environ); `platform`: cfg.platform."""
    if platform in ("cpu", "neuron") or any(env.get(k) for k in USER_GPU_MEMORY_VARS):
        return {}
    named = {p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()}
    if platform == "auto" and named and not named & _GPU_NAMES:
        return {}
    return {MEM_FRACTION_VAR: f"{fraction:g}"}


def size_gpu_memory(platform: str, fraction: float) -> dict[str, str]:
    """Put `gpu_memory_env`'s variables into os.environ, before JAX starts its backend; returns them.
    Nothing once a backend runs (a caller computed with JAX before): it would no longer take effect."""
    from jax._src import xla_bridge   # no public way to ask; if the name moves, assume not started yet
    if getattr(xla_bridge, "backends_are_initialized", lambda: False)():
        return {}
    env = gpu_memory_env(os.environ, platform, fraction)
    os.environ.update(env)
    return env


def gpu_memory_note(env: Mapping[str, str]) -> str | None:
    """The note line for what `size_gpu_memory` set, once the backend runs: None where nothing was set,
    or the backend is not a GPU after all (platform auto; the variables are taken back: nothing read them)."""
    if not env:
        return None
    if jax.default_backend() != "gpu":
        for k in env:
            os.environ.pop(k, None)
        return None
    v = env[MEM_FRACTION_VAR]
    return (f"note: {MEM_FRACTION_VAR}={v} set for this run (train.gpu_mem_fraction; JAX's own default is "
            f"0.75): override with train.gpu_mem_fraction=F, or set {MEM_FRACTION_VAR} yourself")
