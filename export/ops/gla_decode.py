"""Triton kernel for one Simple-GLA decode step that updates vLLM's state pool in place.

For every batch row b and head h, with slot = slots[b] and keep = keep[b]:

    S' = (keep ? λ_h S[slot, h] : 0) + k_{b,h} v_{b,h}^T        (S: [K, V] float32)
    o_{b,h} = K^-0.5 S'^T q_{b,h}

S' is written back into pool[slot, h]: one read and one write of the state, where the torch path
(gather by slot, `torch.where`, `gla_step`, scatter back) makes several full passes over it.

Rows that pad a CUDA-graph batch point at the null slot 0 (several rows may): their writes race
there, which is harmless because slot 0 belongs to no sequence and their outputs are discarded.
Real rows must have distinct slots.

`triton_switch.available(t)` says whether the kernel can run for tensors like `t`.
`export.checks.check_decode_kernel()` compares it with `reference.gla_step`;
benchmarks/ops/bench_kernels.py times it.
"""
import os
from typing import Optional

import torch

from export.ops.launch_keys import Launch, run, scratch
from export.ops.triton_switch import checked_out, require, rowmajor, tl, triton

BLOCK_V = 64
BLOCK_K = None      # None: all of K in one block (next power of 2)
NUM_WARPS = 4


def _evict_default() -> bool:
    """LAPLACE_GLA_DECODE_EVICT=1: the state's loads and stores carry `evict_first` (each state
    byte is touched once a step, so L2 has nothing to keep; chosen per run for a benchmark)."""
    return os.environ.get("LAPLACE_GLA_DECODE_EVICT", "0") == "1"


if triton is not None:
    # the per-request index arrays are read once per program: their pointers' 16-byte alignment
    # (a slice of the step's arrays starts anywhere) must not make a compile variant
    @triton.jit(do_not_specialize_on_alignment=["slots_ptr", "keep_ptr", "cu_ptr"])
    def _gla_decode_kernel(pool_ptr, slots_ptr, keep_ptr, cu_ptr, q_ptr, k_ptr, v_ptr, g_gamma_ptr, o_ptr,
                           sp_slot, sp_h, sp_k, sp_v,
                           sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, so_b, so_h,
                           scale,
                           K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           EVICT: tl.constexpr, BY_REQUEST: tl.constexpr):
        # program (b, h, vb): batch row b, or with BY_REQUEST request b of cu_ptr's packed requests,
        # which it steps only if the request has one token (its row: the request's first); a program
        # of any other request masks every load and store off, leaving its rows and page alone
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        vb = tl.program_id(2)
        row = b
        live = b >= 0
        if BY_REQUEST:
            row = tl.load(cu_ptr + b).to(tl.int64)
            live = tl.load(cu_ptr + b + 1).to(tl.int64) - row == 1
        slot = tl.load(slots_ptr + b).to(tl.int64)
        keep = tl.load(keep_ptr + b)
        lam = tl.exp(tl.load(g_gamma_ptr + h).to(tl.float32))
        rv = vb * BV + tl.arange(0, BV)
        mv = (rv < V) & live
        v = tl.load(v_ptr + row * sv_b + h * sv_h + rv, mask=mv, other=0.0).to(tl.float32)
        o = tl.zeros([BV], dtype=tl.float32)
        # K in blocks of BK rows, unrolled: with BK dividing K (32 for K = 96) no lane is masked off,
        # and all blocks' loads can be in flight at once
        for kb in tl.static_range(0, K, BK):
            rk = kb + tl.arange(0, BK)
            mk = (rk < K) & live
            q = tl.load(q_ptr + row * sq_b + h * sq_h + rk, mask=mk, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + row * sk_b + h * sk_h + rk, mask=mk, other=0.0).to(tl.float32)
            ptrs = pool_ptr + slot * sp_slot + h * sp_h + rk[:, None] * sp_k + rv[None, :] * sp_v
            m = mk[:, None] & mv[None, :]
            if EVICT:
                s = tl.load(ptrs, mask=m, other=0.0, eviction_policy="evict_first")
            else:
                s = tl.load(ptrs, mask=m, other=0.0)
            # a select, not a product: a reused page may hold anything (keep == 0: start from zero)
            s = tl.where(keep != 0, s * lam, 0.0)
            s = s + k[:, None] * v[None, :]
            o += tl.sum(s * q[:, None], axis=0)
            if EVICT:
                tl.store(ptrs, s, mask=m, eviction_policy="evict_first")
            else:
                tl.store(ptrs, s, mask=m)
        tl.store(o_ptr + row * so_b + h * so_h + rv, o * scale, mask=mv)


def gla_decode_inplace(pool: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor, q: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor, g_gamma: torch.Tensor,
                       block_v: int = BLOCK_V, num_warps: int = NUM_WARPS,
                       block_k: Optional[int] = BLOCK_K, evict: Optional[bool] = None,
                       out: Optional[torch.Tensor] = None,
                       cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """pool [num_slots, H, K, V] float32 (any strides, updated in place); slots [B] integer (valid
    slot ids); keep [B] bool (False: start from a zero state); q, k [B, H, K]; v [B, H, V] (any
    float dtype, last-dim stride 1 or copied); g_gamma [H] (ln λ).  Returns o [B, H, V] float32.
    block_v, num_warps: the launch (one program per row, head and block_v columns of V); block_k:
    rows of K per unrolled step inside a program (None: all of K, padded to a power of 2); evict:
    `evict_first` on the state's traffic (None: LAPLACE_GLA_DECODE_EVICT); out: where to write o
    ([B, H, V] float32, last-dim stride 1; a row block of a buffer the caller shares), None: new.

    cu_seqlens [R + 1] int32 (nondecreasing): q, k, v [T, H, *] hold the packed tokens of R
    requests (request r: rows cu_seqlens[r]:cu_seqlens[r+1]) and slots, keep are per request [R];
    each request of exactly one token is stepped as above (its row of o written, its page updated),
    the others are left alone (rows and pages; the serial prefill kernel takes them: a whole-step
    graph, export/full_graph.py).  The grid is (R, H, ·) whatever the lengths."""
    require("export.ops.gla_decode")
    B, H, K = q.shape
    V = v.shape[-1]
    if pool.dtype != torch.float32 or tuple(pool.shape[1:]) != (H, K, V):
        raise ValueError(f"state pool {tuple(pool.shape)} {pool.dtype}: want [*, {H}, {K}, {V}] float32")
    rows = slots.shape[0]
    if cu_seqlens is not None and cu_seqlens.shape[0] != rows + 1:
        raise ValueError(f"cu_seqlens has {cu_seqlens.shape[0]} entries for {rows} requests: want R + 1")
    o = checked_out(out, (B, H, V), torch.float32) if out is not None else \
        scratch(torch.empty((B, H, V), device=q.device, dtype=torch.float32))
    if B == 0 or rows == 0:
        return o
    q, k, v = rowmajor(q), rowmajor(k), rowmajor(v)
    slots = slots.to(torch.long).contiguous()
    keep = keep.to(torch.int8).contiguous()
    g_gamma = g_gamma.to(device=q.device, dtype=torch.float32).contiguous()
    BV = min(block_v, triton.next_power_of_2(V))
    BK = triton.next_power_of_2(K) if block_k is None else block_k
    if BK & (BK - 1):
        raise ValueError(f"block_k={block_k}: want a power of 2")
    # without cu_seqlens the kernel reads no cu_ptr: slots stands in (one pointer type, one key)
    cu = cu_seqlens.to(torch.int32).contiguous() if cu_seqlens is not None else slots
    grid = (rows, H, triton.cdiv(V, BV))
    run(Launch(_gla_decode_kernel, grid, (
        pool, slots, keep, cu, q, k, v, g_gamma, o,
        pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(3),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1),
        float(K) ** -0.5),
        dict(K=K, V=V, BK=BK, BV=BV, EVICT=_evict_default() if evict is None else bool(evict),
             BY_REQUEST=cu_seqlens is not None, num_warps=num_warps)))
    return o
