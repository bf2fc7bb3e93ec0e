"""The loss and its gradient accumulated over micro-batches, with the weights gathered once per step.

`accumulate(params, batch [A, M, S], cfg, mesh)` → (mean loss, mean gradients shaped like params).

Two ways to synchronise across an FSDP mesh (`train.grad_sync`):

- ``"micro"``: plain SPMD. XLA all-gathers the sharded weights inside every micro-step (forward and
  again for the backward) and reduce-scatters every micro-step's gradient: A times the traffic, and
  on two H200s the collectives were not hidden (the micro-step took 17 % longer than on one GPU).
- ``"step"`` (default): a `shard_map` over the whole mesh. Each device all-gathers the weights once
  per optimizer step -- the hidden matrices and `lm_head` already cast to the compute dtype, the only
  dtype the model reads them in -- runs its rows of all A micro-batches with no communication,
  accumulates float32 gradients locally, and reduce-scatters them once. Cost: one replicated copy of
  the weights in the compute dtype and one float32 gradient buffer per device (6 GB + 12 GB for 3B).

Both give the same numbers up to the order of float32 additions (per micro-step vs per step).
Under plain SPMD (``"micro"`` and the eval loss) `execution.gla_impl="auto"` and `execution.mix_impl="auto"`
resolve to the XLA GLA and gated mix (`config.resolve_execution(..., gspmd=True)`): the Pallas
kernels have no partitioning rule, so XLA would gather the whole batch onto every device for them.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec as P

from laplace_jax.config import Config
from laplace_jax.model import forward
from laplace_jax.optim.muon import shard_map_compat
from laplace_jax.optim.optimizer import param_row
from laplace_jax.sharding import BATCH_AXES, DATA, FSDP, param_shardings

F32 = jnp.float32


def loss_fn(params: Any, batch: dict[str, jax.Array], cfg: Config) -> jax.Array:
    """Mean next-token cross entropy (float32) over the scored targets. batch: inputs/targets int32
    [B, S]; a negative target is not scored (MQAR's non-answer positions, data/mqar.py)."""
    logits = forward(params, batch["inputs"], cfg.net)
    targets = batch["targets"]
    scored = targets >= 0
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(targets, 0))
    return jnp.sum(jnp.where(scored, ce, 0.0)) / jnp.maximum(jnp.sum(scored), 1).astype(F32)


def _sum_micro(params: Any, batch: dict[str, jax.Array], cfg: Config) -> tuple[jax.Array, Any]:
    """Σ over the A micro-batches of (loss, float32 grads); a scan, or a Python loop on Neuron."""
    grad_fn = jax.value_and_grad(loss_fn)

    def micro(acc, mb):
        loss, grads = grad_fn(params, mb, cfg)
        return jax.tree.map(lambda a, g: a + g.astype(F32), acc, (loss, grads)), None

    acc = (jnp.zeros((), F32), jax.tree.map(lambda p: jnp.zeros(p.shape, F32), params))
    if cfg.neuron_mode:  # no while loop in the graph (a length-1 scan keeps one)
        for a in range(batch["inputs"].shape[0]):
            acc, _ = micro(acc, jax.tree.map(lambda x, a=a: x[a], batch))
        return acc
    acc, _ = jax.lax.scan(micro, acc, batch)
    return acc


def _gathered_in_compute_dtype(path: tuple[Any, ...]) -> bool:
    return param_row(path).compute_cast


def _fsdp_axis(spec: P) -> int | None:
    return next((i for i, s in enumerate(spec) if s == FSDP), None)


def accumulate(params: Any, batch: dict[str, jax.Array], cfg: Config, mesh: Mesh | None = None
               ) -> tuple[jax.Array, Any]:
    """Mean loss and mean float32 gradients over batch [A, M, S] (A micro-batches of M rows).

    With a mesh and ``cfg.train.grad_sync == "step"``, params are expected sharded as
    `laplace_jax.sharding.param_shardings` and the batch with M split over (data, fsdp)."""
    A = batch["inputs"].shape[0]
    if mesh is None or cfg.train.grad_sync == "micro":
        loss, grads = _sum_micro(params, batch, cfg)
        return loss / A, jax.tree.map(lambda g: g / A, grads)

    specs = jax.tree.map(lambda s: s.spec, param_shardings(params, mesh))
    cdt = jnp.dtype(cfg.execution.compute_dtype)
    n_dev = mesh.size
    has_data = DATA in mesh.axis_names and mesh.shape[DATA] > 1

    def body(local_params, local_batch):
        def gather(path, x, spec):
            if _gathered_in_compute_dtype(path):
                x = x.astype(cdt)
            ax = _fsdp_axis(spec)
            return x if ax is None else jax.lax.all_gather(x, FSDP, axis=ax, tiled=True)

        full = jax.tree_util.tree_map_with_path(gather, local_params, specs)
        loss, grads = _sum_micro(full, local_batch, cfg)

        def reduce(g, spec):
            ax = _fsdp_axis(spec)
            g = jax.lax.psum(g, FSDP) if ax is None else jax.lax.psum_scatter(g, FSDP, scatter_dimension=ax,
                                                                             tiled=True)
            return jax.lax.psum(g, DATA) if has_data else g

        grads = jax.tree.map(reduce, grads, specs)
        loss = jax.lax.psum(loss, (DATA, FSDP))
        scale = 1.0 / (A * n_dev)
        return loss * scale, jax.tree.map(lambda g: g * scale, grads)

    batch_spec = P(None, BATCH_AXES)
    fn = shard_map_compat(body, mesh, (specs, {k: batch_spec for k in batch}), (P(), specs))
    return fn(params, batch)
