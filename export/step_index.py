"""The per-step index arrays of the vLLM mixer: computed by the first layer, read by all 24.

Every layer of a step sees the same attention metadata (one `LinearAttentionMetadata` per step
for the whole KV-cache group), so the arrays derived from it — each request's state slot (padding
rows sent to the null slot 0), whether it continues a sequence, the prefill offsets — are the same
in every layer.  Derived per layer they cost ~14 small device ops a layer (a prefill step runs the
mixers eagerly, between vLLM's CUDA-graph pieces, so each op is host time: a 512-token prefill step
on an H200 is 5.6 ms on the GPU and 24.6 ms of wall time, BENCHMARKS.md run S14); here once a step.

Kept on the metadata object by `kept`, which the torch path's prefill plan (`vllm_model._prefill_groups`) uses too.
Inside a CUDA-graph capture the arrays are derived again (never taken from a run outside it):
the ops that compute them must be in the graph, or a replay would read the capture's values.
"""
from typing import Callable, NamedTuple, TypeVar

import torch


class StepIndex(NamedTuple):
    """One step's requests: nd decode rows (one token each) first, then npf prefill requests."""
    nd: int
    npf: int
    n: int                        # tokens of the step's requests (decode + prefill)
    qsl: torch.Tensor             # [nd + npf + 1] query start offsets (vLLM's)
    slots: torch.Tensor           # [nd + npf] int64 state slots; padding rows → 0, the null slot
    has_ctx: torch.Tensor         # [nd + npf] bool: continues a sequence (False: start from zero)
    keep8: torch.Tensor           # has_ctx as int8, the kernels' flag
    cu_decode: torch.Tensor       # [nd + 1] int32: 0..nd, the decode rows as one-token requests
    cu_prefill: torch.Tensor      # [npf + 1] int32: prefill offsets from the first prefill token
    shared: dict                  # what else the step's layers share (the mixer's launch tape)


_ATTR = "_laplace_step_index"
T = TypeVar("T")


def derive(md) -> StepIndex:
    """The index arrays of metadata `md` (fields: num_decodes, num_prefills, num_decode_tokens,
    num_prefill_tokens, query_start_loc, seq_lens, state_indices_tensor); no host sync."""
    nd, npf = int(md.num_decodes), int(md.num_prefills)
    nreq = nd + npf
    qsl = md.query_start_loc[: nreq + 1]
    seq_lens = md.seq_lens[:nreq]
    # context 0 → a new sequence: start from zero (pages are reused without zeroing)
    has_ctx = (seq_lens - (qsl[1:] - qsl[:-1])) > 0
    slots = md.state_indices_tensor[:nreq].long()
    # Rows that pad a CUDA-graph batch have seq_len 0 and a PAD_SLOT_ID (-1) or a stale slot id
    # (a freed slot that another sequence may own now): send their writes to the null slot 0.
    slots = torch.where((slots < 0) | (seq_lens <= 0), torch.zeros_like(slots), slots)
    cu_prefill = (qsl[nd:] - qsl[nd]).to(torch.int32).contiguous()
    cu_decode = torch.arange(nd + 1, device=qsl.device, dtype=torch.int32)
    return StepIndex(nd, npf, int(md.num_decode_tokens) + int(md.num_prefill_tokens), qsl, slots, has_ctx,
                     has_ctx.to(torch.int8), cu_decode, cu_prefill, {})


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def kept(md, attr: str, key: tuple, build: Callable[[], T]) -> T:
    """build()'s value for this step: kept on the metadata object `md` under `attr` with `key` and
    reused while the key matches (vLLM builds a new `md` each step, shared by all its layers); built
    every time where `md` takes no attributes (a class with __slots__)."""
    held = getattr(md, attr, None)
    if held is not None and held[0] == key:
        return held[1]
    value = build()
    try:
        setattr(md, attr, (key, value))
    except AttributeError:
        pass
    return value


def of_step(md) -> StepIndex:
    """`derive(md)`, once per step (`kept`), keyed by the step's sizes, whether a CUDA graph is
    being captured (a capture derives its own, inside the graph) and the slot tensor itself (a
    shallow copy of `md` with other state indices, as vLLM's `update_block_table` makes for a
    second state group, carries the first one's attribute: it must not reuse its slots)."""
    key = (_capturing(md.query_start_loc.device), int(md.num_decodes), int(md.num_prefills),
           int(md.num_decode_tokens), int(md.num_prefill_tokens), id(md.state_indices_tensor))
    return kept(md, _ATTR, key, lambda: derive(md))
