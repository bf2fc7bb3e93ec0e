"""Muon as an optax transform, with distributed Newton–Schulz (`jax.shard_map` + two all_to_alls).

Pipeline for each Muon leaf ``[L, m, n]`` (stored ``[in, out]``; a 2-D ``[m, n]`` leaf is ``L = 1``):

1. Nesterov momentum in float32 (EMA form: ``mu = b*mu + (1-b)*g``, ``u = (1-b)*g + b*mu``).
2. ``u`` is cast to ``comm_dtype`` (default bfloat16). This is the one cast that also decides what
   goes on the wire: the single-device path applies the same cast at the same point, so every path
   hands Newton–Schulz identical bits. bf16 loses nothing here because Newton–Schulz itself runs in
   bf16; it halves the all_to_all bytes relative to float32.
3. Orthogonalisation of every ``[m, n]`` slice on its owner (`orthogonalize`): Frobenius
   normalisation (float32 sum, ``+ eps``), transpose when ``m > n``, ``ns_steps`` quintic steps
   ``X <- aX + (bA + cA^2)X, A = XX^T`` with bf16 operands and float32 accumulation, result in bf16.
   ``comm``: ``"all_to_all"`` (default) or ``"gather"`` (the article's baseline: all_gather of the
   gradients, owner NS, broadcast). With one FSDP rank both are the reference path itself: the
   rank owns every whole matrix, so no collective is emitted and nothing is packed into a send
   buffer (packing all 96 matrices of the 3B model would need one 2.7e9-element buffer).
4. Shape scale: ``moonlight`` = ``0.2*sqrt(max(m, n))`` (default: matches AdamW's update RMS, so
   Muon shares AdamW's learning rate and schedule), or ``spectral`` = ``sqrt(max(1, n/m))``
   (fan_out/fan_in with ``[in, out]`` storage).
5. Decoupled weight decay and ``-lr(step)`` in `muon` (optax chain).

No ``lax.cond`` anywhere: empty slots are zeros and run through Newton–Schulz (0/(0+eps) = 0).
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from .plan import MuonPlan, make_plan

INT32_MAX = 2**31 - 1

NS_COEFFS = (3.4445, -4.7750, 2.0315)
COMMS = ("all_to_all", "gather")


# ----------------------------------------------------------------------------- Newton–Schulz

def newton_schulz(x: jax.Array, steps: int = 5, eps: float = 1e-7,
                  coeffs: tuple[float, float, float] = NS_COEFFS) -> jax.Array:
    """Quintic Newton–Schulz on one ``[m, n]`` matrix; bf16 in the matmuls, f32 accumulation.

    Returns bf16 ``[m, n]`` with singular values in roughly [0.7, 1.2]."""
    a, b, c = coeffs
    m, n = x.shape
    xf = x.astype(jnp.float32)
    xf = xf / (jnp.sqrt(jnp.sum(xf * xf)) + eps)
    X = xf.astype(jnp.bfloat16)
    if m > n:
        X = X.T
    dot = functools.partial(jnp.matmul, preferred_element_type=jnp.float32)
    for _ in range(steps):
        A = dot(X, X.T)
        Ab = A.astype(jnp.bfloat16)
        B = (b * A + c * dot(Ab, Ab)).astype(jnp.bfloat16)
        X = (a * X.astype(jnp.float32) + dot(B, X)).astype(jnp.bfloat16)
    if m > n:
        X = X.T
    return X


def orthogonalize_stack(x: jax.Array, steps: int = 5, eps: float = 1e-7) -> jax.Array:
    """``[S, m, n]`` -> bf16 ``[S, m, n]``, each slice on its own (one compiled body, `lax.map`)."""
    return jax.lax.map(lambda s: newton_schulz(s, steps, eps), x)


# ----------------------------------------------------------------------------- shard_map compat

def shard_map_compat(f, mesh, in_specs, out_specs):
    """`jax.shard_map` (or the experimental one on older jax) without the replication check."""
    sm = getattr(jax, "shard_map", None)
    if sm is None:  # older jax
        from jax.experimental.shard_map import shard_map as sm  # type: ignore
    params = inspect.signature(sm).parameters
    kw = {}
    if "check_vma" in params:
        kw["check_vma"] = False
    elif "check_rep" in params:
        kw["check_rep"] = False
    return sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw)


def _table(rows: tuple[int, ...], me: jax.Array) -> jax.Array:
    return jnp.asarray(np.asarray(rows, np.int32))[me]


# ----------------------------------------------------------------------------- per-shard bodies

def _a2a_body(plan: MuonPlan, axis: str, steps: int, eps: float, comm_dtype, *xs):
    """Inside shard_map: xs[k] is this rank's row shard ``[L_k, m_k/N, n_k]`` (comm dtype)."""
    N, C = plan.n_ranks, plan.chunk
    me = jax.lax.axis_index(axis)
    # Send: chunk for destination o = row shards of o's matrices, in o's layout (static).
    rows = []
    for o in range(N):
        parts = []
        for k, kd in enumerate(plan.kinds):
            for s in range(plan.slots[k]):
                l = plan.layer[k][s][o]
                if l >= 0:
                    parts.append(xs[k][l].reshape(-1))
        used = sum(p.shape[0] for p in parts)
        if used < C:
            parts.append(jnp.zeros((C - used,), comm_dtype))
        rows.append(jnp.concatenate(parts) if len(parts) > 1 else parts[0])
    send = jnp.stack(rows)                                                  # [N, C]
    recv = jax.lax.all_to_all(send, axis, 0, 0, tiled=False)              # row j: from rank j
    # Owner: assemble whole matrices (layout of *this* rank: offsets looked up by rank id).
    col = jnp.arange(C, dtype=jnp.int32)
    back = jnp.zeros((N, C), comm_dtype)
    for k, kd in enumerate(plan.kinds):
        pk, r = plan.piece(k), kd.m // N
        mats, offs, pres = [], [], []
        for s in range(plan.slots[k]):
            off = _table(plan.offset[k][s], me)
            present = _table(plan.layer[k][s], me) >= 0
            blk = jax.lax.dynamic_slice(recv, (jnp.int32(0), off), (N, pk))
            mats.append(jnp.where(present, blk, jnp.zeros_like(blk)).reshape(kd.m, kd.n))
            offs.append(off)
            pres.append(present)
        out = orthogonalize_stack(jnp.stack(mats), steps, eps).astype(comm_dtype)  # [S, m, n]
        for s in range(plan.slots[k]):
            blk = out[s].reshape(N, pk)                                     # row j -> rank j
            placed = jax.lax.dynamic_update_slice(jnp.zeros((N, C), comm_dtype), blk,
                                                  (jnp.int32(0), offs[s]))
            region = (col >= offs[s]) & (col < offs[s] + pk) & pres[s]
            back = jnp.where(region[None, :], placed, back)
    got = jax.lax.all_to_all(back, axis, 0, 0, tiled=False)               # row o: from owner o
    res = []
    for k, kd in enumerate(plan.kinds):
        pk, r = plan.piece(k), kd.m // N
        per_layer = []
        for l, (o, s) in enumerate(plan.owner[k]):
            off = plan.offset[k][s][o]
            per_layer.append(got[o, off:off + pk].reshape(r, kd.n))
        res.append(jnp.stack(per_layer))
    return tuple(res)


def _gather_body(plan: MuonPlan, axis: str, steps: int, eps: float, comm_dtype, *xs):
    """The article's baseline: all_gather every gradient, owners orthogonalise, broadcast."""
    N = plan.n_ranks
    me = jax.lax.axis_index(axis)
    res = []
    for k, kd in enumerate(plan.kinds):
        full = jax.lax.all_gather(xs[k], axis, axis=1, tiled=True)          # [L, m, n]
        mats, lays, pres = [], [], []
        for s in range(plan.slots[k]):
            lay = _table(plan.layer[k][s], me)
            present = lay >= 0
            mat = jax.lax.dynamic_index_in_dim(full, jnp.maximum(lay, 0), 0, keepdims=False)
            mats.append(jnp.where(present, mat, jnp.zeros_like(mat)))
            lays.append(lay)
            pres.append(present)
        out = orthogonalize_stack(jnp.stack(mats), steps, eps).astype(comm_dtype)
        mine = jnp.zeros((kd.L, kd.m, kd.n), comm_dtype)
        layer_ids = jnp.arange(kd.L, dtype=jnp.int32)
        for s in range(plan.slots[k]):
            hit = (layer_ids == lays[s]) & pres[s]
            mine = jnp.where(hit[:, None, None], out[s][None], mine)
        everything = jax.lax.psum(mine, axis)                               # "broadcast" from owners
        r = kd.m // N
        res.append(jax.lax.dynamic_slice_in_dim(everything, me * r, r, axis=1))
    return tuple(res)


# ----------------------------------------------------------------------------- group orthogonalisation

def _mesh_size(mesh, axis: str) -> int:
    return int(dict(zip(mesh.axis_names, mesh.devices.shape))[axis])


def orthogonalize(stacks: dict[str, jax.Array], *, ns_steps: int = 5, eps: float = 1e-7,
                  comm: str = "all_to_all", comm_dtype: Any = "bfloat16", mesh=None,
                  fsdp_axis: str = "fsdp") -> dict[str, jax.Array]:
    """Orthogonalise every ``[m, n]`` slice of every ``[L, m, n]`` stack; returns float32 stacks.

    With ``mesh=None`` everything runs here (the reference). With a mesh, each stack is taken as
    sharded ``P(None, fsdp_axis, None)`` (other mesh axes replicate) and ``comm`` picks the
    collective scheme; the result is bit-identical to ``mesh=None``. A mesh whose ``fsdp_axis`` has
    one rank runs the reference path (every comm is then the identity).
    """
    if comm not in COMMS:
        raise ValueError(f"comm={comm!r}: choose one of {COMMS}")
    cdt = jnp.dtype(comm_dtype)
    names = list(stacks)
    xs = [stacks[k].astype(cdt) for k in names]          # the wire cast, same point on every path
    if mesh is None or _mesh_size(mesh, fsdp_axis) == 1:
        outs = [orthogonalize_stack(x, ns_steps, eps).astype(cdt) for x in xs]
    else:
        plan = make_plan([(k, x.shape) for k, x in zip(names, xs)], _mesh_size(mesh, fsdp_axis))
        if comm == "all_to_all" and plan.chunk > INT32_MAX:   # the body's offsets are int32
            raise ValueError(f"Muon all_to_all: {plan.chunk:,} elements per (source, owner) chunk exceed "
                             f"int32 offsets at {plan.n_ranks} FSDP ranks; use more FSDP ranks or "
                             f"optim.muon_comm=gather")
        body_fn = _a2a_body if comm == "all_to_all" else _gather_body
        body = functools.partial(body_fn, plan, fsdp_axis, ns_steps, eps, cdt)
        spec = P(None, fsdp_axis, None)
        specs = tuple(spec for _ in xs)
        outs = list(shard_map_compat(body, mesh, specs, specs)(*xs))
    return {k: o.astype(jnp.float32) for k, o in zip(names, outs)}


# ----------------------------------------------------------------------------- optax transforms

def shape_scale(m: int, n: int, rule: str = "moonlight") -> float:
    """Update multiplier for an ``[m, n]`` (= [in, out]) matrix."""
    if rule == "moonlight":
        return 0.2 * float(np.sqrt(max(m, n)))
    if rule == "spectral":
        return float(np.sqrt(max(1.0, n / m)))
    raise ValueError(f"muon scale rule {rule!r}: choose 'moonlight' or 'spectral'")


class ScaleByMuonState(NamedTuple):
    mu: Any


def _leaf_name(path) -> str:
    return "/".join(str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path)


def scale_by_muon(*, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                  eps: float = 1e-7, scale: str = "moonlight", comm: str = "all_to_all",
                  comm_dtype: Any = "bfloat16", mesh=None,
                  fsdp_axis: str = "fsdp") -> optax.GradientTransformation:
    """Momentum + Newton–Schulz orthogonalisation + shape scale for ``[L, m, n]`` / ``[m, n]`` leaves.

    Every leaf it sees is a Muon matrix (use it under `optax.multi_transform`; masked leaves of
    that wrapper carry no arrays and are passed through)."""
    shape_scale(2, 2, scale)  # validate early
    if comm not in COMMS:
        raise ValueError(f"comm={comm!r}: choose one of {COMMS}")

    def init_fn(params):
        return ScaleByMuonState(mu=jax.tree.map(lambda p: jnp.zeros_like(p, dtype=jnp.float32), params))

    def update_fn(updates, state, params=None):
        del params
        b = momentum
        mu = jax.tree.map(lambda m, g: b * m + (1 - b) * g.astype(jnp.float32), state.mu, updates)
        if nesterov:
            u = jax.tree.map(lambda m, g: (1 - b) * g.astype(jnp.float32) + b * m, mu, updates)
        else:
            u = mu
        flat, treedef = jax.tree_util.tree_flatten_with_path(u)
        stacks = {}
        for i, (path, x) in enumerate(flat):
            if x.ndim not in (2, 3):
                raise ValueError(f"Muon leaf {_leaf_name(path)} has shape {x.shape}: "
                                 "expected [L, m, n] or [m, n]")
            stacks[f"{i}:{_leaf_name(path)}"] = x if x.ndim == 3 else x[None]
        outs = orthogonalize(stacks, ns_steps=ns_steps, eps=eps, comm=comm, comm_dtype=comm_dtype,
                             mesh=mesh, fsdp_axis=fsdp_axis)
        new = []
        for (path, x), key in zip(flat, stacks):
            o = outs[key].reshape(x.shape)
            new.append(o * jnp.float32(shape_scale(x.shape[-2], x.shape[-1], scale)))
        return jax.tree_util.tree_unflatten(treedef, new), ScaleByMuonState(mu=mu)

    return optax.GradientTransformation(init_fn, update_fn)


def muon(learning_rate, *, weight_decay: float = 0.0, **kwargs) -> optax.GradientTransformation:
    """Full Muon step: ``p <- p - lr(t) * (scale * NS(nesterov(g)) + wd * p)``."""
    parts = [scale_by_muon(**kwargs)]
    if weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*parts)
