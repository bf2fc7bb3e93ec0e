"""Device mesh and FSDP sharding rules.

Mesh axes: ("data", "fsdp"). Parameters are sharded over "fsdp" and replicated over "data"; the
batch is split over both. Which axis of a weight is split is its `spec.Param.fsdp_axis`:

- stacked hidden matrices [L, m, n]: rows (axis 1) over fsdp — the layout Muon's all_to_all expects;
- `embed` [N, D]: vocabulary rows over fsdp; `lm_head` [D, N]: vocabulary columns over fsdp;
- norms, conv, aug_balance (a few KB per layer): replicated.
A dimension that does not divide the fsdp size stays replicated (tiny configs on odd meshes).
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from laplace_jax import spec
from laplace_jax.config import ConfigError, MeshConfig
from laplace_jax.optim.optimizer import key_name

DATA, FSDP = "data", "fsdp"
BATCH_AXES = (DATA, FSDP)


class MeshError(ConfigError):
    """The mesh shape does not fit the devices."""


def make_mesh(mesh_cfg: MeshConfig, devices: list[Any] | None = None) -> Mesh:
    """A (data, fsdp) mesh over `devices` (default: all). fsdp = -1 takes every remaining device."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    data = mesh_cfg.data
    fsdp = n // data if mesh_cfg.fsdp == -1 else mesh_cfg.fsdp
    if data * fsdp != n:
        raise MeshError(f"mesh.data={data} x mesh.fsdp={mesh_cfg.fsdp} does not cover the {n} devices: "
                        f"set mesh.fsdp=-1 or make data*fsdp = {n}")
    return Mesh(np.asarray(devices).reshape(data, fsdp), (DATA, FSDP))


def _fsdp_size(mesh: Mesh) -> int:
    return int(mesh.shape[FSDP])


def param_spec(path: tuple[Any, ...], shape: tuple[int, ...], fsdp: int) -> P:
    """The PartitionSpec of one parameter (or optimizer-state leaf named after one), from the table.
    Leaves the table does not name (step counters) and shapes of another rank replicate."""
    row = spec.lookup(key_name(path[-1]))
    axis = None if row is None else row.stored_fsdp_axis
    if axis is None or len(shape) != len(row.dims.split()) + int(row.per_layer) or shape[axis] % fsdp:
        return P()
    parts: list[Any] = [None] * len(shape)
    parts[axis] = FSDP
    return P(*parts)


def param_shardings(params: Any, mesh: Mesh) -> Any:
    """NamedShardings for a parameter pytree (arrays or ShapeDtypeStructs)."""
    fsdp = _fsdp_size(mesh)
    return jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, param_spec(p, tuple(x.shape), fsdp) if p else P()), params)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, ndim: int, batch_axis: int = 0) -> NamedSharding:
    """Shard `batch_axis` over every device (data x fsdp), the rest replicated."""
    spec: list[Any] = [None] * ndim
    spec[batch_axis] = BATCH_AXES
    return NamedSharding(mesh, P(*spec))


def opt_state_shardings(opt_shapes: Any, mesh: Mesh) -> Any:
    """Optimizer-state shardings by the same rules: moment leaves end in their parameter's name
    (e.g. `.../mu/layers/w_qkvg`), so they shard like it; counters and other scalars replicate."""
    return param_shardings(opt_shapes, mesh)
