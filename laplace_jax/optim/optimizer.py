"""`build_optimizer`: Muon for the hidden matrices, AdamW for the rest, one schedule, clipping."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import optax

from laplace_jax import spec

from .muon import muon

MUON, ADAMW = spec.MUON, spec.ADAMW


def key_name(p) -> str:
    """The name of one pytree path entry (dict key, attribute or index)."""
    return str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p))))


def param_row(path: tuple[Any, ...]) -> spec.Param:
    """The `spec.PARAMS` row of a parameter leaf (by its name, the path's last key)."""
    row = spec.lookup(key_name(path[-1])) if path else None
    if row is None:
        names = "/".join(key_name(p) for p in path)
        raise ValueError(f"parameter '{names}' is not in laplace_jax.spec.PARAMS: add a row for it there")
    return row


def is_muon_path(path: tuple[Any, ...]) -> bool:
    """The Muon group (`spec.Param.group`): the stacked hidden matrices."""
    return param_row(path).group == spec.MUON


def label_params(params: Any) -> Any:
    """'muon' or 'adamw' per leaf, from the parameter table's groups."""
    return jax.tree_util.tree_map_with_path(lambda path, _: MUON if is_muon_path(path) else ADAMW, params)


def _adamw_decay_mask(params: Any) -> Any:
    return jax.tree_util.tree_map_with_path(lambda path, _: param_row(path).group == spec.ADAMW_DECAY, params)


def make_schedule(optim_cfg: Any) -> optax.Schedule:
    """Linear warmup 0 -> lr over warmup_steps, then cosine to min_lr_ratio*lr at total_steps."""
    c = optim_cfg
    decay = max(1, c.total_steps - c.warmup_steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=c.lr, warmup_steps=c.warmup_steps,
        decay_steps=c.warmup_steps + decay, end_value=c.lr * c.min_lr_ratio)


@dataclass
class OptimizerReport:
    """Assignment of parameters to the two groups."""
    muon_matrices: int = 0
    muon_params: int = 0
    muon_leaves: list[str] = field(default_factory=list)
    adamw_tensors: int = 0
    adamw_params: int = 0
    adamw_leaves: list[str] = field(default_factory=list)
    adamw_decayed: list[str] = field(default_factory=list)
    comm: str = ""
    comm_dtype: str = ""
    fsdp_ranks: int = 1

    @property
    def total_params(self) -> int:
        return self.muon_params + self.adamw_params

    def __str__(self) -> str:
        return "\n".join([
            f"optimizer: {self.total_params:,} params",
            f"  muon : {self.muon_matrices} matrices, {self.muon_params:,} params "
            f"({', '.join(self.muon_leaves)}); comm={self.comm} ({self.comm_dtype}) "
            f"over {self.fsdp_ranks} FSDP rank(s)",
            f"  adamw: {self.adamw_tensors} tensors, {self.adamw_params:,} params "
            f"(weight decay on {', '.join(self.adamw_decayed) or 'none'})",
        ])


def _size(x) -> int:
    n = 1
    for d in x.shape:
        n *= int(d)
    return n


def assignment_report(params: Any, *, comm: str = "", comm_dtype: str = "",
                      fsdp_ranks: int = 1) -> OptimizerReport:
    rep = OptimizerReport(comm=comm, comm_dtype=comm_dtype, fsdp_ranks=fsdp_ranks)
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = "/".join(key_name(p) for p in path)
        if is_muon_path(path):
            rep.muon_matrices += int(x.shape[0]) if len(x.shape) == 3 else 1
            rep.muon_params += _size(x)
            rep.muon_leaves.append(name)
        else:
            rep.adamw_tensors += 1
            rep.adamw_params += _size(x)
            rep.adamw_leaves.append(name)
            if param_row(path).group == spec.ADAMW_DECAY:
                rep.adamw_decayed.append(name)
    return rep


def build_optimizer(optim_cfg: Any, params: Any, *, mesh=None,
                    fsdp_axis: str = "fsdp") -> tuple[optax.GradientTransformation, OptimizerReport]:
    """Muon (the table's `muon` group) + AdamW (the rest) under one warmup-cosine schedule.

    ``params`` may be arrays or `jax.ShapeDtypeStruct`s (only the tree and shapes are used).
    ``mesh``: when given, Muon orthogonalises with ``optim_cfg.muon_comm`` over ``fsdp_axis``
    (leaves sharded ``P(None, fsdp_axis, None)``); ``None`` = single-device reference path.
    """
    c = optim_cfg
    schedule = make_schedule(c)
    labels = label_params(params)
    muon_tx = muon(schedule, weight_decay=c.weight_decay, momentum=c.muon_momentum,
                   nesterov=c.muon_nesterov, ns_steps=c.ns_steps, eps=c.muon_eps,
                   scale=c.muon_scale, comm=c.muon_comm, comm_dtype=c.muon_comm_dtype,
                   mesh=mesh, fsdp_axis=fsdp_axis)
    adamw_tx = optax.adamw(schedule, b1=c.adam_b1, b2=c.adam_b2, eps=c.adam_eps,
                           weight_decay=c.weight_decay, mask=_adamw_decay_mask)
    parts = []
    if c.grad_clip and c.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(c.grad_clip))
    parts.append(optax.multi_transform({MUON: muon_tx, ADAMW: adamw_tx}, labels))
    ranks = 1
    if mesh is not None:
        ranks = int(dict(zip(mesh.axis_names, mesh.devices.shape))[fsdp_axis])
    report = assignment_report(params, comm=c.muon_comm if mesh is not None else "single-device",
                               comm_dtype=c.muon_comm_dtype, fsdp_ranks=ranks)
    return optax.chain(*parts), report
