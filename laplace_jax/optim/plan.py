"""Static placement of the Muon matrices over the FSDP ranks (pure Python, no jax import).

Under FSDP every rank holds rows ``[d*m/N, (d+1)*m/N)`` of every stacked Muon leaf ``[L, m, n]``.
Newton–Schulz needs whole matrices, so each matrix gets one *owner* rank. One ``all_to_all`` sends
each row shard to the owner; the owner orthogonalises; a second ``all_to_all`` sends the row shards
back. Under SPMD every rank runs the same program, so:

* every rank has the same number of *slots* per weight kind, ``ceil(L_k / N)`` -- a slot holds one
  whole ``[m_k, n_k]`` matrix, or zeros where the rank owns fewer (this is compute, not traffic);
* the all_to_all moves one flat chunk of ``C`` elements per (source, destination) pair. A chunk
  carries only the row shards of the matrices its destination really owns, packed back to back in
  that owner's layout (the owner finds them at offsets looked up by its rank id), so each rank sends
  ``N*C = max over owners of the elements they own`` per all_to_all: the wire padding is the gap
  between the most loaded owner and the even share ``sum(sizes)/N``, never whole empty matrices.

Limits (3B, 64 ranks): the even share is 42.5 M elements, but an owner holds whole matrices and
W_12 alone is 50.3 M, so ``50.3/42.5 = 1.185`` is the floor for any whole-matrix scheme. With one
slot per kind (``ceil(24/64) = 1``) the best packing is 53.5 M (W_qkvg + W_3 on 8 ranks): 1.259,
against the article's 96 -> 128 slots = 1.333. Reaching 1.185 needs two W_3 slots on every rank,
i.e. more executed Newton–Schulz under SPMD; not worth it.

Owners are chosen by longest-processing-time greedy on matrix size (largest first, to the least
loaded rank that still has a free slot of that kind, ties to the lowest rank). That staggers the
kinds across ranks (at 64 ranks: 24 ranks own a W_12, 24 a W_qkvg, ...). The same plan drives the
gather+broadcast baseline (who orthogonalises what) and the analytic traffic model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def ns_flops(m: int, n: int, steps: int = 5) -> int:
    """FLOPs of `steps` quintic Newton–Schulz iterations on an m x n matrix (a = min, b = max):
    per step X X^T (2a^2 b), A A (2a^3), B X (2a^2 b) = 4a^2 b + 2a^3."""
    a, b = min(m, n), max(m, n)
    return steps * (4 * a * a * b + 2 * a ** 3)


@dataclass(frozen=True)
class Kind:
    name: str
    L: int
    m: int
    n: int

    @property
    def size(self) -> int:
        return self.m * self.n


@dataclass(frozen=True)
class MuonPlan:
    n_ranks: int
    kinds: tuple[Kind, ...]
    slots: tuple[int, ...]                               # per kind: slots per rank = ceil(L/N)
    owner: tuple[tuple[tuple[int, int], ...], ...]       # owner[k][l] = (rank, slot)
    layer: tuple[tuple[tuple[int, ...], ...], ...]       # layer[k][s][rank] = l, or -1 (empty slot)
    offset: tuple[tuple[tuple[int, ...], ...], ...]      # offset[k][s][rank] = element offset in chunk
    chunk: int                                           # C: elements per (source, destination) pair

    def piece(self, k: int) -> int:
        """Elements of one row shard of one matrix of kind k."""
        kd = self.kinds[k]
        return (kd.m // self.n_ranks) * kd.n

    # ------------------------------------------------------------------ accounting
    def rank_elements(self) -> list[int]:
        """Elements of whole matrices owned by each rank."""
        out = [0] * self.n_ranks
        for k, kd in enumerate(self.kinds):
            for (r, _s) in self.owner[k]:
                out[r] += kd.size
        return out

    def rank_flops(self, steps: int = 5) -> list[int]:
        """Useful Newton–Schulz FLOPs per rank (matrices it owns)."""
        out = [0] * self.n_ranks
        for k, kd in enumerate(self.kinds):
            f = ns_flops(kd.m, kd.n, steps)
            for (r, _s) in self.owner[k]:
                out[r] += f
        return out

    def executed_flops(self, steps: int = 5) -> int:
        """Newton–Schulz FLOPs every rank executes under SPMD (empty slots run on zeros)."""
        return sum(s * ns_flops(kd.m, kd.n, steps) for s, kd in zip(self.slots, self.kinds))

    @property
    def n_matrices(self) -> int:
        return sum(kd.L for kd in self.kinds)

    @property
    def total_elements(self) -> int:
        return sum(kd.L * kd.size for kd in self.kinds)


def _as_kinds(shapes: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> tuple[Kind, ...]:
    items = shapes.items() if isinstance(shapes, Mapping) else shapes
    kinds = []
    for name, shp in items:
        shp = tuple(getattr(shp, "shape", shp))
        if len(shp) == 2:
            shp = (1,) + shp
        if len(shp) != 3:
            raise ValueError(f"Muon leaf {name!r} has shape {shp}: expected [L, m, n] or [m, n]")
        kinds.append(Kind(str(name), *map(int, shp)))
    return tuple(kinds)


def make_plan(shapes: Mapping[str, Any] | Iterable[tuple[str, Any]], n_ranks: int) -> MuonPlan:
    """Place every matrix of every stacked leaf (`name -> [L, m, n]`, order kept) on an owner rank."""
    kinds = _as_kinds(shapes)
    N = int(n_ranks)
    if N < 1:
        raise ValueError(f"n_ranks={N}: must be >= 1")
    for kd in kinds:
        if kd.m % N:
            raise ValueError(f"Muon leaf {kd.name!r}: {kd.m} rows do not split over {N} FSDP ranks; "
                             f"use an FSDP size dividing {kd.m}")
    slots = tuple(max(1, math.ceil(kd.L / N)) for kd in kinds)
    load = [0] * N
    used = [[0] * N for _ in kinds]
    owner: list[list[tuple[int, int]]] = [[(-1, -1)] * kd.L for kd in kinds]
    items = sorted(((k, l) for k, kd in enumerate(kinds) for l in range(kd.L)),
                   key=lambda kl: (-kinds[kl[0]].size, kl[0], kl[1]))
    for k, l in items:
        r = min((d for d in range(N) if used[k][d] < slots[k]), key=lambda d: (load[d], d))
        owner[k][l] = (r, used[k][r])
        used[k][r] += 1
        load[r] += kinds[k].size
    layer = [[[-1] * N for _ in range(slots[k])] for k in range(len(kinds))]
    for k, kd in enumerate(kinds):
        for l, (r, s) in enumerate(owner[k]):
            layer[k][s][r] = l
    # Chunk layout of each owner rank: its present slots, kind-major, packed back to back.
    offset = [[[0] * N for _ in range(slots[k])] for k in range(len(kinds))]
    fill = [0] * N
    for r in range(N):
        for k, kd in enumerate(kinds):
            for s in range(slots[k]):
                if layer[k][s][r] >= 0:
                    offset[k][s][r] = fill[r]
                    fill[r] += (kd.m // N) * kd.n
    chunk = max(fill) if fill else 0
    return MuonPlan(N, kinds, slots,
                    tuple(tuple(o) for o in owner),
                    tuple(tuple(tuple(x) for x in ks) for ks in layer),
                    tuple(tuple(tuple(x) for x in ks) for ks in offset),
                    chunk)


def muon_traffic_bytes(shapes: Mapping[str, Any] | Iterable[tuple[str, Any]], n_ranks: int,
                       comm_dtype: str = "bfloat16", ns_steps: int = 5) -> dict[str, Any]:
    """Analytic per-rank Muon collective bytes for one step (no compile; `laplace_jax.info` uses it).

    Convention (the article's): bytes of the buffer each rank puts into / gets out of a collective,
    own share included -- all_to_all: operand; all_gather: gathered result; broadcast: the whole
    matrix set. all_to_all: 2 x N x C x dtype bytes. gather+broadcast: 2 x (all Muon matrices) x
    dtype bytes. `shapes`: Muon leaves only, name -> [L, m, n].
    """
    plan = make_plan(shapes, n_ranks)
    nb = DTYPE_BYTES[comm_dtype]
    N = plan.n_ranks
    # One rank owns every matrix already: no collective runs (muon.orthogonalize).
    a2a = 2 * N * plan.chunk * nb if N > 1 else 0
    gather = 2 * plan.total_elements * nb if N > 1 else 0
    useful = plan.rank_flops(ns_steps)
    mean = sum(useful) / N
    largest = max(kd.size for kd in plan.kinds)
    slots = sum(s * N for s in plan.slots)
    return {
        "n_ranks": N,
        "comm_dtype": comm_dtype,
        "n_matrices": plan.n_matrices,
        "muon_params": plan.total_elements,
        "all_to_all_bytes": a2a,
        "gather_bytes": gather,
        "ratio": gather / a2a if a2a else 1.0,
        "chunk_elements": plan.chunk,
        # per-rank all_to_all operand over the unpadded share (sum of sizes / N); article: 128/96
        "wire_padding": N * N * plan.chunk / plan.total_elements if plan.total_elements else 1.0,
        "wire_padding_lower_bound": max(plan.total_elements / N, largest) / (plan.total_elements / N),
        "compute_slots": slots,
        "ns_flops_total": sum(useful),
        "ns_flops_max_over_mean": max(useful) / mean if mean else 1.0,
        "ns_flops_executed_over_mean": plan.executed_flops(ns_steps) / mean if mean else 1.0,
        "rank_elements_max": max(plan.rank_elements()),
    }
