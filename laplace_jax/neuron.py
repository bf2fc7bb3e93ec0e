"""Neuron mode: the Trainium2 constraints as config and runtime settings.

`platform: neuron` (or `--platform neuron`) imports jax-neuronx and turns neuron mode on;
`neuron_mode: true` forces the same graphs on any platform (CPU) so they can be checked here:

- the GLA chunk loop fully unrolled (`execution.gla_unroll`, set by `config.resolve_execution`);
- the layer stack unrolled when the config says so (`execution.scan_layers: false`);
- gradient accumulation unrolled (the train step's micro-batch loop is a Python loop);
- the `rbg` PRNG (jax-neuronx: threefry is incomplete), parameters initialised on the host CPU;
- no `lax.cond`, no host callbacks, only static shapes; decode widths from `decode_widths`.

What remains as while loops (static trip counts, which jax-neuronx accepts): the layer scan when
`execution.scan_layers: true`, and Muon's Newton-Schulz `lax.map` over each weight kind's stacked
matrices (tests/jax/test_neuron.py pins both down, counting in the HLO text with tests/jax/hlo_checks.py).
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from laplace_jax.config import Config


def is_neuron(cfg: Config) -> bool:
    return cfg.neuron_mode or cfg.platform == "neuron"


def use_rbg_prng() -> None:
    """jax-neuronx supports the `rbg` PRNG (one rng-bit-generator op); threefry is incomplete."""
    jax.config.update("jax_default_prng_impl", "rbg")


def host_cpu() -> Any:
    """The host CPU device (with `platform: neuron` the platforms are `neuron,cpu`)."""
    return jax.devices("cpu")[0]


def host_key(seed: int) -> jax.Array:
    """A PRNG key (the current impl: `rbg` in neuron mode) made on the host CPU."""
    with jax.default_device(host_cpu()):
        return jax.device_put(jax.random.PRNGKey(seed), host_cpu())


def host_init_params(model_cfg, key: jax.Array, shardings: Any = None) -> Any:
    """Random parameters computed on the host CPU (RNG-heavy init stays off the accelerator),
    then placed with `shardings` (None: left on the host)."""
    from laplace_jax.model import init_params

    cpu = host_cpu()
    with jax.default_device(cpu):
        params = init_params(model_cfg, jax.device_put(key, cpu))
    if shardings is None:
        return params
    host = jax.tree.map(np.asarray, params)  # every process computed the same values: each places its shards
    return jax.tree.map(lambda a, s: jax.make_array_from_callback(a.shape, s, lambda idx: a[idx]), host, shardings)
