"""What the Neuron compiler refuses, counted in lowered StableHLO (`jit(f).lower(...).as_text()`)
or compiled HLO (`.compile().as_text()`) text: conditionals, host callbacks, dynamic shapes, and
the while loops (jax-neuronx accepts those with a static trip count). Used by test_neuron.py."""
from __future__ import annotations

import re
from typing import Any

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
