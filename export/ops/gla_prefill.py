"""Triton kernel for the Simple-GLA prefill of all prefill requests of a vLLM step, state in place.

The tokens of R requests lie back to back (request r owns rows cu_seqlens[r]:cu_seqlens[r+1]).
For each request r, head h, with slot = slots[r]:

    S_0 = keep[r] ? pool[slot, h] : 0,   S_t = λ_h S_{t-1} + k_t v_t^T,   o_t = K^-0.5 S_t^T q_t

and the final state is written back to pool[slot, h]: one read and one write of each state, no
gather / scatter copies, no per-length grouping.

One program per (request, head, block of BV value columns) walks the request's chunks of BT tokens
in order, holding its [K, BV] float32 state block in registers.  Per chunk (n real tokens, rows i,
columns j of the chunk; all exponents <= 0):

    o     = ((q k^T) ⊙ [i >= j] e^{γ(i-j)}) v  +  e^{γ(i+1)} (q S)          (times K^-0.5)
    S     = e^{γn} S + (k ⊙ [j < n] e^{γ(n-1-j)})^T v

The padding rows of a partial last chunk load as zeros and get decay weight 0 (a select: their
e^{γ(n-1-j)} would be a positive exponent).  A request of one token takes the decode step's float32
math instead (S = λS + k v^T, o = K^-0.5 S^T q, as ops/gla_decode.py; gla_chunk_math's doc), or with
SKIP_ONE is left to the decode kernel launched by request beside this one (a step that runs as one
CUDA graph, export/full_graph.py, holds its decode rows as one-token requests).  A request of no
tokens (a row padding such a step) leaves its page untouched.

Precision: the state and every accumulation are float32.  `precision` picks the operands of the
three products that involve float32 intermediates (the masked scores, the state, the decayed keys):
"ieee" (the default for float32 inputs; parity with the JAX float32 model), "bf16" (the default for
bf16 inputs: those operands rounded to bf16, as JAX's own `ops.gla.chunk_simple_gla` and fla's
`chunk_simple_gla` do for bf16 models; 2.4x faster than tf32 on an H200, BENCHMARKS run S8) or
"tf32" (10 mantissa bits; the default for float16 inputs).  q k^T of bf16 inputs is always a bf16
product: exact products, float32 sums.

Two launch paths, the same math (export/ops/gla_chunk_math.py, which both import): this module's
kernel walks each request's chunks in series (grid (request, head, value block): the throughput
path); export/ops/gla_prefill_chunked.py spreads the chunks over the grid (for few requests, whose
serial grid would leave SMs idle).  `gla_prefill_inplace` picks by `gla_prefill_chunked.prefill_path`
from host integers (no sync).

`export.checks.prefill_errors()` measures each against the float64 recurrence
(`reference.gla_float64`; `checks.within_tolerance` judges it); benchmarks/ops/bench_kernels.py
times it against the torch path (gather + `gla_chunked` + scatter).
"""
import contextlib
from typing import Iterator, Optional

import torch

from export.ops import gla_prefill_chunked as chunked
from export.ops.gla_chunk_math import (_chunk_decays, _chunk_output, _chunk_state, _head_row, _head_rows, _modes,
                                       _one_token_state, _tile_ranges)
from export.ops.gla_chunk_math import default_precision  # noqa: F401  (gla_prefill.default_precision)
from export.ops.launch_keys import Launch, run, scratch
from export.ops.triton_switch import checked_out, interpreting, require, rowmajor, tl, triton

# H200, K=96 (padded to 128), V=192: BV=64 gives R*H*3 programs (384 for 8 requests, ~3 per SM of
# 132) with a [128, 64] float32 state (64 registers a thread at 4 warps) next to the [64, 64] score
# and output tiles; BV=32 would double the programs but recompute q k^T six times per chunk.
# Stages: the loads of the next chunk's q, k, v are multi-buffered in shared memory (40 KB a stage
# for bf16 at BT=64; 80 KB for float32, which therefore gets one stage to stay under 227 KB with
# the dot operands' staging).  bf16 takes three: 0.273 ms against 0.321 with two at 8 x 2,048
# tokens (H200, BENCHMARKS run S8); 8 warps, BV 32 or 128, and 32- or 128-token chunks were slower.
BLOCK_V = 64
NUM_WARPS = 4
# The serial kernel's pipeline stages in a whole-step graph (export/full_graph.py), where most of its
# programs are those of decode rows (one-token requests, stepped by the decode kernel: they exit at
# once, but each holds an SM slot while it starts).  Its bf16 default of 3 stages reserves 120 KB of
# shared memory a program (one program an SM on an H100/H200), 1 stage 40 KB (two, at its 255
# registers); benchmarks/ops/compile_sm90.py prints both.
WHOLE_STEP_STAGES = 1
CHUNK = 64

if triton is not None:
    # the per-request index arrays are read once per program: their pointers' 16-byte alignment
    # (a slice of the step's arrays starts anywhere) must not make a compile variant
    @triton.jit(do_not_specialize_on_alignment=["slots_ptr", "keep_ptr", "cu_ptr"])
    def _gla_prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, pool_ptr, slots_ptr, keep_ptr, cu_ptr, g_gamma_ptr,
                            sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h,
                            sp_slot, sp_h, sp_k, sp_v,
                            scale,
                            K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            BT: tl.constexpr, QK_MODE: tl.constexpr, MODE: tl.constexpr,
                            EMULATE: tl.constexpr, SKIP_ONE: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        vb = tl.program_id(2)
        bos = tl.load(cu_ptr + r).to(tl.int64)
        eos = tl.load(cu_ptr + r + 1).to(tl.int64)
        slot = tl.load(slots_ptr + r).to(tl.int64)
        keep = tl.load(keep_ptr + r)
        g = tl.load(g_gamma_ptr + h).to(tl.float32)
        # the requests this program steps: a request with no tokens (a row that pads a CUDA-graph
        # batch) leaves its page alone (its slot may be another request's); with SKIP_ONE so does a
        # one-token request (the decode kernel's, launched beside this one: ops/gla_decode.py)
        mine = eos - bos > (1 if SKIP_ONE else 0)

        rk, rv, rt, mk, mv = _tile_ranges(vb, K, V, BK, BV, BT)

        s_ptrs = pool_ptr + slot * sp_slot + h * sp_h + rk[:, None] * sp_k + rv[None, :] * sp_v
        s_mask = mk[:, None] & mv[None, :] & mine
        s = tl.load(s_ptrs, mask=s_mask, other=0.0)
        # a select, not a product: a reused page may hold anything, NaN included
        s = tl.where(keep != 0, s, 0.0)

        if SKIP_ONE:
            if mine:
                s = _walk_chunks(s, q_ptr, k_ptr, v_ptr, o_ptr, bos, eos, h, g, rk, rv, rt, mk, mv,
                                 sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, scale, BT, QK_MODE, MODE, EMULATE)
        elif eos - bos == 1:
            # one token (gla_chunk_math's doc): the decode step's float32 math.  A request-level
            # branch outside the chunk loop: inside it, the loop's registers spilled 4x more
            q1 = _head_row(q_ptr, bos, sq_t, h, sq_h, rk, mk)
            s = _one_token_state(s, _head_row(k_ptr, bos, sk_t, h, sk_h, rk, mk),
                                 _head_row(v_ptr, bos, sv_t, h, sv_h, rv, mv), g, MODE)
            tl.store(o_ptr + bos * so_t + h * so_h + rv,
                     (tl.sum(s * q1[:, None], axis=0) * scale).to(o_ptr.dtype.element_ty), mask=mv)
        else:
            s = _walk_chunks(s, q_ptr, k_ptr, v_ptr, o_ptr, bos, eos, h, g, rk, rv, rt, mk, mv,
                             sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, scale, BT, QK_MODE, MODE, EMULATE)

        tl.store(s_ptrs, s, mask=s_mask)

    @triton.jit
    def _walk_chunks(s, q_ptr, k_ptr, v_ptr, o_ptr, bos, eos, h, g, rk, rv, rt, mk, mv,
                     sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, scale,
                     BT: tl.constexpr, QK_MODE: tl.constexpr, MODE: tl.constexpr, EMULATE: tl.constexpr):
        """Rows bos:eos of head h in chunks of BT from state s [BK, BV] (the module doc's math):
        their o written, the state after them returned."""
        dmask, qdec = _chunk_decays(g, rt)
        for t0 in range(bos, eos, BT):
            rows = t0 + rt
            mt = rows < eos
            n = tl.minimum(eos - t0, BT).to(tl.float32)                  # real tokens here
            q = _head_rows(q_ptr, rows, sq_t, h, sq_h, rk, mt, mk)
            k = _head_rows(k_ptr, rows, sk_t, h, sk_h, rk, mt, mk)
            v = _head_rows(v_ptr, rows, sv_t, h, sv_h, rv, mt, mv)
            o = _chunk_output(q, k, v, s, dmask, qdec, QK_MODE, MODE, EMULATE)  # uses S entering the chunk
            tl.store(o_ptr + rows[:, None] * so_t + h * so_h + rv[None, :],
                     (o * scale).to(o_ptr.dtype.element_ty), mask=mt[:, None] & mv[None, :])
            s = tl.exp(g * n) * s + _chunk_state(k, v, g, n, rt, MODE, EMULATE)
        return s


def gla_prefill_inplace(pool: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor, q: torch.Tensor,
                        k: torch.Tensor, v: torch.Tensor, g_gamma: torch.Tensor, cu_seqlens: torch.Tensor,
                        chunk: int = CHUNK, precision: Optional[str] = None,
                        block_v: int = BLOCK_V, num_warps: int = NUM_WARPS,
                        num_stages: Optional[int] = None,
                        out_dtype: torch.dtype = torch.float32, path: Optional[str] = None,
                        out: Optional[torch.Tensor] = None, skip_one: bool = False) -> torch.Tensor:
    """Chunked GLA over the packed prefill tokens of R requests, continuing from and writing back
    their states in the pool.

    pool [num_slots, H, K, V] float32 (any strides; updated in place at the R slots); slots [R]
    integer (distinct for real requests); keep [R] bool (False: start from zero); q, k [T, H, K],
    v [T, H, V] (float32 or bf16, one dtype; views with last-dim stride 1 are used as they are);
    g_gamma [H] (ln λ, <= 0); cu_seqlens [R + 1] integer, nondecreasing, cu_seqlens[R] <= T.
    chunk: tokens per step, a power of 2 >= 16 (tensor-core tile); precision: see the module doc;
    block_v, num_warps, num_stages (None: by dtype): launch settings.  path: "serial" (this module's
    kernel), "chunked" (export/ops/gla_prefill_chunked.py, chunks in parallel) or None: by
    `gla_prefill_chunked.prefill_path` from R, T and the shapes (or `forced_path`).  Returns o [T, H, V] in
    out_dtype (float32, or q's dtype as JAX's chunk_simple_gla returns it: one rounding of the
    float32 result; rows outside every request are left uninitialised).  out: where to write o ([T,
    H, V] in out_dtype, last-dim stride 1; a row block of a buffer the caller shares), None: new.
    skip_one: requests of one token are left alone, rows and pages (serial path only:
    `gla_decode.gla_decode_inplace(..., cu_seqlens=)` steps them)."""
    require("export.ops.gla_prefill")
    T, H, K = q.shape
    V = v.shape[-1]
    R = slots.shape[0]
    if pool.dtype != torch.float32 or tuple(pool.shape[1:]) != (H, K, V):
        raise ValueError(f"state pool {tuple(pool.shape)} {pool.dtype}: want [*, {H}, {K}, {V}] float32")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk={chunk}: want a power of 2 >= 16")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if cu_seqlens.shape[0] != R + 1:
        raise ValueError(f"cu_seqlens has {cu_seqlens.shape[0]} entries for {R} requests: want R + 1")
    qk_mode, mode = _modes(q.dtype, precision)
    if out_dtype not in (torch.float32, q.dtype):
        raise ValueError(f"out_dtype {out_dtype}: want float32 or q's dtype {q.dtype}")
    o = checked_out(out, (T, H, V), out_dtype) if out is not None else \
        scratch(torch.empty((T, H, V), device=q.device, dtype=out_dtype))
    if R == 0 or T == 0:
        return o
    path = path or _forced_path or chunked.prefill_path(R, T, H, K, V, chunk, chunked.sm_count(q.device), block_v)
    if path not in ("serial", "chunked"):
        raise ValueError(f"path={path!r}: want 'serial', 'chunked' or None")
    if skip_one and path != "serial":
        raise ValueError(f"skip_one with path={path!r}: only the serial kernel leaves one-token requests alone")
    q, k, v = rowmajor(q), rowmajor(k), rowmajor(v)
    g_gamma = g_gamma.to(device=q.device, dtype=torch.float32).contiguous()
    cu_seqlens = cu_seqlens.to(torch.int32).contiguous()   # index dtypes fixed: one compile variant
    slots = slots.to(torch.long).contiguous()
    if path == "chunked":
        return chunked.gla_prefill_chunked(pool, slots, keep, q, k, v, g_gamma, cu_seqlens, o, chunk, precision,
                                           block_v, num_warps, num_stages)
    BK = max(16, triton.next_power_of_2(K))
    BV = max(16, min(block_v, triton.next_power_of_2(V)))
    grid = (R, H, triton.cdiv(V, BV))
    run(Launch(_gla_prefill_kernel, grid, (
        q, k, v, o, pool, slots, keep.to(torch.int8).contiguous(), cu_seqlens, g_gamma,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1),
        pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(3),
        float(K) ** -0.5),
        dict(K=K, V=V, BK=BK, BV=BV, BT=chunk, QK_MODE=qk_mode, MODE=mode,
             EMULATE=interpreting(), SKIP_ONE=skip_one, num_warps=num_warps,
             num_stages=num_stages or {torch.float32: 1, torch.bfloat16: 3}.get(q.dtype, 2))))
    return o


_forced_path: Optional[str] = None


@contextlib.contextmanager
def forced_path(path: str) -> Iterator[None]:
    """Inside the block `gla_prefill_inplace` (path None) takes `path` ("serial" or "chunked"):
    the warm-up compiles both kernels through the mixer's own launch code."""
    global _forced_path
    saved, _forced_path = _forced_path, path
    try:
        yield
    finally:
        _forced_path = saved
