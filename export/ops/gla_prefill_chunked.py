"""Chunk-parallel Triton prefill for Simple GLA: one long prompt fills the GPU.

The serial prefill kernel (export/ops/gla_prefill.py) runs one program per (request, head,
value block) and walks the request's chunks in order: one 2,048-token request at the 3B shape is
16 × 3 = 48 programs on 132 SMs, each doing 32 chunk steps in series.  Here the same math is split
in three launches (R requests packed back to back by cu_seqlens as there; chunk c of request r holds
rows t0 = cu[r] + j·BT ... with n ≤ BT real tokens; exponents ≤ 0):

 1. `_chunk_local_kernel`, grid (chunk, head, value block), all chunks at once: the chunk's own
    contribution to the state  U_c = (k ⊙ [j < n] e^{γ(n-1-j)})^T v  [K, BV], to a float32 buffer.
 2. `_chunk_pass_kernel`, grid (request, head, block of state entries): the state at each
    chunk's start,
        S_0 = keep ? pool[slot] : 0,   S_{c+1} = e^{γ n_c} S_c + U_c,
    into a second buffer (U read once, S written once), and the final state to the pool page.  The
    decay is one scalar a head, so the pass is elementwise in the state: a load, a store and an
    FMA per entry and chunk, spread over all of K·V (not only over value blocks).
 3. `_chunk_out_kernel`, grid (chunk, head, value block):
        o = ((q k^T) ⊙ [i >= j] e^{γ(i-j)}) v + e^{γ(i+1)} (q S_c)          (times K^-0.5)

Every product and sum is the serial kernel's, in the same order and precision (both call the
`_chunk_state` and `_chunk_output` of export/ops/gla_chunk_math.py, with its `_modes`, and both give
a request of one token the decode step's math, there described; a request of no tokens leaves its
page untouched in both): U_c is the
float32 product the serial kernel adds to its state, so the two paths agree to the last bit where
the products do (the CPU interpreter), and `export.checks.prefill_tolerance` bounds both against
float64.

Chunks are numbered request after request (request r's first chunk is Σ_{i<r} ceil(len_i / BT));
the host sizes the grid by the bound T // BT + R (no device sync; the lengths stay on the device),
and each program finds its request by a scan over the R lengths (the chunked path is chosen for
few requests).  Programs past the last chunk store nothing.  Extra traffic against the serial
kernel: the buffers, 4 · H·K·V float32 a chunk (U written, read, S written, read): 4.7 MB a chunk
at the 3B shape, 0.15 GB for 32 chunks; `prefill_path` keeps the serial kernel where its grid fills
the GPU (throughput batches, where those bytes would cost ~ as much as the whole serial kernel).

Compile variants: one per kernel for a model and dtype (constexprs: shapes, chunk, modes; R is
`do_not_specialize`: R = 1 would be its own binary; index arrays not alignment-specialized).
"""
import functools
from typing import Optional

import torch

from export.ops.gla_chunk_math import (_chunk_decays, _chunk_output, _chunk_state, _head_row, _head_rows, _modes,
                                       _tile_ranges)
from export.ops.launch_keys import Launch, run, scratch
from export.ops.triton_switch import interpreting, tl, triton

# The serial kernel's tile (its BLOCK_V / CHUNK / NUM_WARPS measurements apply to the same tiles here)
BLOCK_V = 64
NUM_WARPS = 4
# The state pass: BE entries of a head's state per program (K·V = 18,432 at the 3B shape: 18
# programs a head, 288 for one request), 8 float32 a thread at 4 warps
PASS_BLOCK = 1024
PASS_WARPS = 4
PASS_STAGES = 1
# Cap of the two chunk-state buffers (U and S): above it the serial kernel runs (an 8,192-token
# prompt at the 3B shape needs 2 × 129 × 1.18 MB = 0.30 GB); vLLM's memory profile runs no prefill,
# so this transient is outside its accounting.
BUFFER_BUDGET = 512 << 20
# SMs of the GPU the rule assumes where the device has none to ask (the CPU interpreter): an H200's
H200_SMS = 132


if triton is not None:
    @triton.jit
    def _find_chunk(c, cu_ptr, R, BT: tl.constexpr):
        """(request, its first chunk's number) for chunk c: the last request whose chunks start at
        or before c (requests without tokens own no chunk; past the last chunk: the last request)."""
        r = 0
        first = 0
        acc = 0
        for i in range(0, R):
            n_i = tl.load(cu_ptr + i + 1) - tl.load(cu_ptr + i)
            take = c >= acc
            r = tl.where(take, i, r)
            first = tl.where(take, acc, first)
            acc += (n_i + BT - 1) // BT
        return r, first

    @triton.jit
    def _chunk_span(c, cu_ptr, R, BT: tl.constexpr):
        """(first row, end of its request, start of its request) of chunk c: first >= end past the
        last chunk."""
        r, first = _find_chunk(c, cu_ptr, R, BT)
        bos = tl.load(cu_ptr + r).to(tl.int64)
        eos = tl.load(cu_ptr + r + 1).to(tl.int64)
        return bos + (c - first).to(tl.int64) * BT, eos, bos

    @triton.jit
    def _chunk_rows(cu_ptr, R, BT: tl.constexpr):
        """(c, first row t0, end of its request eos, start of its request bos, rows t0 + [0, BT),
        rows < eos) of this program's chunk c (grid axis 0)."""
        c = tl.program_id(0)
        t0, eos, bos = _chunk_span(c, cu_ptr, R, BT)
        rows = t0 + tl.arange(0, BT)
        return c, t0, eos, bos, rows, rows < eos

    _IDX = ["cu_ptr", "slots_ptr", "keep_ptr"]    # read once per program: alignment is no variant

    @triton.jit(do_not_specialize=["R"], do_not_specialize_on_alignment=_IDX)
    def _chunk_local_kernel(k_ptr, v_ptr, buf_ptr, cu_ptr, g_gamma_ptr, R,
                            sk_t, sk_h, sv_t, sv_h, sb_c, sb_h, sb_k,
                            K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            BT: tl.constexpr, MODE: tl.constexpr, EMULATE: tl.constexpr):
        c, t0, eos, _, rows, mt = _chunk_rows(cu_ptr, R, BT)
        h = tl.program_id(1).to(tl.int64)
        vb = tl.program_id(2)
        g = tl.load(g_gamma_ptr + h).to(tl.float32)
        rk, rv, rt, mk, mv = _tile_ranges(vb, K, V, BK, BV, BT)
        k = _head_rows(k_ptr, rows, sk_t, h, sk_h, rk, mt, mk)
        v = _head_rows(v_ptr, rows, sv_t, h, sv_h, rv, mt, mv)
        u = _chunk_state(k, v, g, tl.minimum(eos - t0, BT).to(tl.float32), rt, MODE, EMULATE)
        ptrs = buf_ptr + c.to(tl.int64) * sb_c + h * sb_h + rk[:, None] * sb_k + rv[None, :]
        tl.store(ptrs, u, mask=mk[:, None] & mv[None, :] & (t0 < eos))

    @triton.jit(do_not_specialize=["R"], do_not_specialize_on_alignment=_IDX)
    def _chunk_pass_kernel(u_ptr, s_ptr, pool_ptr, slots_ptr, keep_ptr, cu_ptr, g_gamma_ptr, R,
                           sb_c, sb_h, sp_slot, sp_h, sp_k, sp_v,
                           K: tl.constexpr, V: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr):
        # elementwise in the state: program (r, h, e) walks BE of head h's K·V entries through
        # request r's chunks (U and S buffers hold each [K, V] contiguously)
        r = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        e = tl.program_id(2) * BE + tl.arange(0, BE)
        m = e < K * V
        bos = tl.load(cu_ptr + r).to(tl.int64)
        eos = tl.load(cu_ptr + r + 1).to(tl.int64)
        first = 0
        for i in range(0, r):
            first += (tl.load(cu_ptr + i + 1) - tl.load(cu_ptr + i) + BT - 1) // BT
        slot = tl.load(slots_ptr + r).to(tl.int64)
        keep = tl.load(keep_ptr + r)
        g = tl.load(g_gamma_ptr + h).to(tl.float32)
        s_pool = pool_ptr + slot * sp_slot + h * sp_h + (e // V) * sp_k + (e % V) * sp_v
        s = tl.load(s_pool, mask=m, other=0.0)
        s = tl.where(keep != 0, s, 0.0)        # a select: a reused page may hold NaN
        base = first.to(tl.int64) * sb_c + h * sb_h + e
        n_chunks = (eos - bos + BT - 1) // BT
        # U_c and S_c live in two buffers, so no load of U waits on a store of S, and each U is
        # loaded three chunks ahead (u0, u1, u2 rotate): the walk's chain is one FMA a chunk, not
        # one memory round trip (Triton pipelines only loads that feed dots)
        u0 = tl.load(u_ptr + base, mask=m & (n_chunks > 0), other=0.0)
        u1 = tl.load(u_ptr + base + sb_c, mask=m & (n_chunks > 1), other=0.0)
        for j in range(0, n_chunks):
            u2 = tl.load(u_ptr + base + (j + 2) * sb_c, mask=m & (j + 2 < n_chunks), other=0.0)
            n = tl.minimum(eos - bos - j * BT, BT).to(tl.float32)
            tl.store(s_ptr + base + j * sb_c, s, mask=m)              # the state entering chunk j
            s = tl.exp(g * n) * s + u0
            u0 = u1
            u1 = u2
        tl.store(s_pool, s, mask=m & (eos > bos))     # as the serial kernel: no tokens, page untouched

    @triton.jit(do_not_specialize=["R"], do_not_specialize_on_alignment=_IDX)
    def _chunk_out_kernel(q_ptr, k_ptr, v_ptr, o_ptr, buf_ptr, u_ptr, cu_ptr, g_gamma_ptr, R,
                          sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, sb_c, sb_h, sb_k,
                          scale,
                          K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          BT: tl.constexpr, QK_MODE: tl.constexpr, MODE: tl.constexpr,
                          EMULATE: tl.constexpr):
        c, t0, eos, bos, rows, mt = _chunk_rows(cu_ptr, R, BT)
        h = tl.program_id(1).to(tl.int64)
        vb = tl.program_id(2)
        g = tl.load(g_gamma_ptr + h).to(tl.float32)
        rk, rv, rt, mk, mv = _tile_ranges(vb, K, V, BK, BV, BT)
        dmask, qdec = _chunk_decays(g, rt)
        at = c.to(tl.int64) * sb_c + h * sb_h + rk[:, None] * sb_k + rv[None, :]
        s = tl.load(buf_ptr + at, mask=mk[:, None] & mv[None, :] & (t0 < eos), other=0.0)
        if eos - bos == 1:
            # a request of one token: the serial kernel's decode math, S' = e^γ S + U (U: the local
            # kernel's, `_one_token_state`'s value), o = S'^T q as a float32 sum
            s = tl.exp(g * 1.0) * s + tl.load(u_ptr + at, mask=mk[:, None] & mv[None, :], other=0.0)
            q1 = _head_row(q_ptr, t0, sq_t, h, sq_h, rk, mk)
            tl.store(o_ptr + t0 * so_t + h * so_h + rv,
                     (tl.sum(s * q1[:, None], axis=0) * scale).to(o_ptr.dtype.element_ty), mask=mv)
        else:
            q = _head_rows(q_ptr, rows, sq_t, h, sq_h, rk, mt, mk)
            k = _head_rows(k_ptr, rows, sk_t, h, sk_h, rk, mt, mk)
            v = _head_rows(v_ptr, rows, sv_t, h, sv_h, rv, mt, mv)
            o = _chunk_output(q, k, v, s, dmask, qdec, QK_MODE, MODE, EMULATE)
            tl.store(o_ptr + rows[:, None] * so_t + h * so_h + rv[None, :],
                     (o * scale).to(o_ptr.dtype.element_ty), mask=mt[:, None] & mv[None, :])


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """SMs of `device` (an H200's 132 off CUDA, where the rule is exercised by tests)."""
    if device.type != "cuda":
        return H200_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def chunk_buffer_rows(R: int, T: int, chunk: int) -> int:
    """Chunks of R requests holding T tokens in all, at most: Σ ceil(len_r / chunk) ≤ T // chunk + R."""
    return T // chunk + R


def prefill_path(R: int, T: int, H: int, K: int, V: int, chunk: int, n_sm: int,
                 block_v: int = BLOCK_V) -> str:
    """"chunked" or "serial" for R requests of T tokens in all, from host integers only.

    The serial kernel runs R·H·ceil(V / BV) programs, each walking its request's chunks in series;
    with fewer programs than SMs some SMs idle through the whole walk, and the chunked path (grid
    ~ chunks·H·ceil(V / BV)) is worth its buffer traffic, if there are chunks to spread (T ≥ 2
    chunks) and the buffer fits `BUFFER_BUDGET`.  Otherwise the serial kernel: it fills the GPU and
    moves fewer bytes."""
    serial_programs = R * H * -(-V // min(block_v, V))
    buffer = 2 * chunk_buffer_rows(R, T, chunk) * H * K * V * 4
    if serial_programs < n_sm and T >= 2 * chunk and buffer <= BUFFER_BUDGET:
        return "chunked"
    return "serial"


def gla_prefill_chunked(pool: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor, q: torch.Tensor,
                        k: torch.Tensor, v: torch.Tensor, g_gamma: torch.Tensor, cu_seqlens: torch.Tensor,
                        o: torch.Tensor, chunk: int, precision: Optional[str] = None,
                        block_v: int = BLOCK_V, num_warps: int = NUM_WARPS,
                        num_stages: Optional[int] = None) -> torch.Tensor:
    """`gla_prefill.gla_prefill_inplace`'s math by the three chunk-parallel launches, into o.

    Arguments as there (already checked by it): pool [num_slots, H, K, V] float32 (updated at the
    R slots), slots [R], keep [R] bool, q, k [T, H, K], v [T, H, V] (last-dim stride 1), g_gamma [H]
    float32 contiguous, cu_seqlens [R + 1] contiguous, o [T, H, V] (float32 or q's dtype).
    Returns o (rows outside every request untouched)."""
    T, H, K = q.shape
    V = v.shape[-1]
    R = slots.shape[0]
    qk_mode, mode = _modes(q.dtype, precision)
    BK = max(16, triton.next_power_of_2(K))
    BV = max(16, min(block_v, triton.next_power_of_2(V)))
    n_vb = triton.cdiv(V, BV)
    n_chunks = chunk_buffer_rows(R, T, chunk)
    u_buf = scratch(torch.empty((n_chunks, H, K, V), device=q.device, dtype=torch.float32))
    s_buf = scratch(torch.empty_like(u_buf))
    emulate = interpreting()
    stages = num_stages or {torch.float32: 1, torch.bfloat16: 3}.get(q.dtype, 2)
    keep8 = keep.to(torch.int8).contiguous()
    slots = slots.to(torch.long).contiguous()
    strides_b = (u_buf.stride(0), u_buf.stride(1), u_buf.stride(2))
    run(Launch(_chunk_local_kernel, (n_chunks, H, n_vb),
               (k, v, u_buf, cu_seqlens, g_gamma, R, k.stride(0), k.stride(1), v.stride(0), v.stride(1), *strides_b),
               dict(K=K, V=V, BK=BK, BV=BV, BT=chunk, MODE=mode, EMULATE=emulate,
                    num_warps=num_warps, num_stages=stages)))
    run(Launch(_chunk_pass_kernel, (R, H, triton.cdiv(K * V, PASS_BLOCK)),
               (u_buf, s_buf, pool, slots, keep8, cu_seqlens, g_gamma, R, u_buf.stride(0), u_buf.stride(1),
                pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(3)),
               dict(K=K, V=V, BE=PASS_BLOCK, BT=chunk, num_warps=PASS_WARPS, num_stages=PASS_STAGES)))
    run(Launch(_chunk_out_kernel, (n_chunks, H, n_vb),
               (q, k, v, o, s_buf, u_buf, cu_seqlens, g_gamma, R, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                v.stride(0), v.stride(1), o.stride(0), o.stride(1), *strides_b, float(K) ** -0.5),
               dict(K=K, V=V, BK=BK, BV=BV, BT=chunk, QK_MODE=qk_mode, MODE=mode, EMULATE=emulate,
                    num_warps=num_warps, num_stages=stages)))
    return o
