"""The string choices of the configs and ops, each listed once as a `Literal` type, and the one
membership check that names the allowed values (derived from the type with `typing.get_args`).
YAML and the command line give plain strings; these types only say which strings are allowed."""
from __future__ import annotations

from typing import Any, Literal, get_args, get_origin

Remat = Literal["none", "full", "dots", "dots_no_batch", "dots_gla", "dots_acts"]   # model.py's policies
HandOff = Literal["scan", "matmul"]            # chunk-to-chunk GLA state: lax.scan | one contraction
KernelImpl = Literal["auto", "xla", "pallas"]  # an op with Pallas GPU kernels (ops/impl.py)
DenseOutput = Literal["compute", "float32"]    # hidden projections' output dtype
Dtype = Literal["float32", "bfloat16", "float16"]
MuonScale = Literal["moonlight", "spectral"]
MuonComm = Literal["all_to_all", "gather"]
GradSync = Literal["step", "micro"]
DataSource = Literal["text", "mqar"]
Platform = Literal["auto", "cpu", "gpu", "neuron"]


def is_choice(typ: Any) -> bool:
    """Whether a type annotation is one of these `Literal` choices."""
    return get_origin(typ) is Literal


def choices_text(choice: Any) -> str:
    """"'a' or 'b'", "'a', 'b' or 'c'"; from four on "one of 'a', 'b', 'c', 'd'"."""
    opts = [repr(x) for x in get_args(choice)]
    if len(opts) > 3:
        return "one of " + ", ".join(opts)
    return ", ".join(opts[:-1]) + " or " + opts[-1]


def check_choice(name: str, value: Any, choice: Any, error: type[Exception] = ValueError) -> None:
    """Raise `error` "<name>=<value!r>: choose ..." unless `value` is one of `choice`'s values."""
    if value not in get_args(choice):
        raise error(f"{name}={value!r}: choose {choices_text(choice)}")
