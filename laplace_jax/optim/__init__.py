"""Optimizer: Muon (hidden matrices, distributed Newton–Schulz) + AdamW, one schedule.

Imports are lazy so that ``python -m laplace_jax.optim.traffic`` can set the XLA device-count
flag before jax is imported.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "build_optimizer": "optimizer", "make_schedule": "optimizer", "label_params": "optimizer",
    "assignment_report": "optimizer", "OptimizerReport": "optimizer", "is_muon_path": "optimizer",
    "muon": "muon", "scale_by_muon": "muon", "newton_schulz": "muon",
    "orthogonalize": "muon", "orthogonalize_stack": "muon", "shape_scale": "muon",
    "make_plan": "plan", "muon_traffic_bytes": "plan", "ns_flops": "plan", "MuonPlan": "plan",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
