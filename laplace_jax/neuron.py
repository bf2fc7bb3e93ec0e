"""Neuron mode: the Trainium2 constraints as config, runtime settings and HLO checks.

`platform: neuron` (or `--platform neuron`) imports jax-neuronx and turns neuron mode on;
`neuron_mode: true` forces the same graphs on any platform (CPU) so they can be checked here:

- the GLA chunk loop fully unrolled (`execution.gla_unroll`, set by `config.resolve_execution`);
- the layer stack unrolled when the config says so (`execution.scan_layers: false`);
- gradient accumulation unrolled (the train step's micro-batch loop is a Python loop);
- the `rbg` PRNG (jax-neuronx: threefry is incomplete), parameters initialised on the host CPU;
- no `lax.cond`, no host callbacks, only static shapes; decode widths from `decode_widths`.

What remains as while loops (static trip counts, which jax-neuronx accepts): the layer scan when
`execution.scan_layers: true`, and Muon's Newton-Schulz `lax.map` over each weight kind's stacked
matrices (tests/test_neuron.py pins both down).

`hlo_report(text)` counts what the Neuron compiler refuses (conditionals, host callbacks,
dynamic shapes) and the while loops, in lowered StableHLO or compiled HLO text.
"""
from __future__ import annotations

import re
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


# ----------------------------------------------------------------------------- HLO checks

# StableHLO (lowered, `jit(f).lower(...).as_text()`) and HLO (compiled, `.compile().as_text()`).
_WHILE = re.compile(r"stablehlo\.while\b|\bwhile\(")
_COND = re.compile(r"stablehlo\.(?:case|if)\b|\bconditional\(")
_CALLBACK = re.compile(r"custom_call(?:_target=\"|\s+@)[\w.$]*callback\w*", re.I)
_HOST_IO = re.compile(r"stablehlo\.(?:infeed|outfeed|send|recv)\b|\b(?:infeed|outfeed|send|recv)(?:-done)?\(")
_DYN_OPS = re.compile(r"stablehlo\.(?:dynamic_broadcast_in_dim|dynamic_reshape|dynamic_iota|dynamic_pad|"
                      r"dynamic_gather|dynamic_conv|real_dynamic_slice|get_dimension_size|set_dimension_size)\b|"
                      r"\b(?:get|set)-dimension-size\(")
_DYN_DIMS = re.compile(r"tensor<(?:[^>]*x)?\?|#stablehlo\.bounds|\[[^\]]*<=\d")
_TRIP = re.compile(r"\bwhile\(.*?known_trip_count\":\{\"n\":\"(\d+)\"")


def hlo_report(text: str) -> dict[str, Any]:
    """Counts in lowered StableHLO or compiled HLO text. `trip_counts` (compiled HLO only): the
    static trip count of each while loop that XLA could prove (a loop without one is missing)."""
    return {
        "while": len(_WHILE.findall(text)),
        "conditional": len(_COND.findall(text)),
        "host_callback": len(_CALLBACK.findall(text)) + len(_HOST_IO.findall(text)),
        "dynamic_shape": len(_DYN_OPS.findall(text)) + len(_DYN_DIMS.findall(text)),
        "trip_counts": [int(n) for n in _TRIP.findall(text)],
    }


def neuron_violations(text: str, *, allow_while: bool = True) -> list[str]:
    """What the Neuron compiler would refuse in this HLO text (empty: nothing). While loops are
    allowed only when `allow_while` (jax-neuronx accepts static while loops)."""
    r = hlo_report(text)
    out = [f"{r[k]} {k.replace('_', ' ')} op(s)" for k in ("conditional", "host_callback", "dynamic_shape") if r[k]]
    if r["while"] and not allow_while:
        out.append(f"{r['while']} while loop(s)")
    return out
