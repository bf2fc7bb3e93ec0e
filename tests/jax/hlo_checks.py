"""What the Neuron compiler refuses, counted in lowered StableHLO (`jit(f).lower(...).as_text()`)
or compiled HLO (`.compile().as_text()`) text: conditionals, host callbacks, dynamic shapes, and
the while loops (jax-neuronx accepts those with a static trip count). Used by test_neuron.py. Also
where a name scope's is-finite ops run in compiled HLO (the train step's finite check: test_nonfinite.py)."""
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


# ----------------------------------------------------------------------------- where a check's reductions run

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%(\S+)\s.*\{\s*$")
_ROOT_TUPLE = re.compile(r"^\s*ROOT\s+%\S+\s*=\s*\(.*?\)\s+tuple\((.*)\)")
_IS_FINITE = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*\S+\s+is-finite\(%([^),\s]+)\).*op_name=\"([^\"]*)\"")


def is_finite_placement(text: str, scope: str) -> dict[str, int]:
    """Where the is-finite ops of name scope `scope` run, in compiled HLO text (`.compile().as_text()`):
    `fused`: in a multi-output fusion that also writes the value it checks (the check costs no read of
    its own); `reads`: anywhere else (a pass that reads the stored value back, or recomputes it)."""
    out = {"fused": 0, "reads": 0}
    blocks: list[list[str]] = []
    for line in text.splitlines():
        if _COMPUTATION.match(line):
            blocks.append([])
        elif blocks:
            blocks[-1].append(line)
    for lines in blocks:
        root = next((m.group(1) for m in map(_ROOT_TUPLE.match, lines) if m), "")
        written = set(re.findall(r"%([^,\s)]+)", root))
        for m in map(_IS_FINITE.match, lines):
            if m and f"/{scope}/" in m.group(2):
                out["fused" if m.group(1) in written else "reads"] += 1
    return out
