"""Triton kernel for the causal depthwise conv (+ SiLU) of all prefill requests of a vLLM step,
conv window read from and written back to vLLM's state pool in place.

The tokens of R requests lie back to back (request r owns rows cu_seqlens[r]:cu_seqlens[r+1]).
Request r continues from the window W = pool[slots[r]] [C, D] (its last C inputs, oldest first;
zeros when keep[r] is False) and, as `reference.conv_with_state`,

    u_t = b + Σ_c w[:, c] · x_{t-(C-1)+c}          (x_τ for τ < 0 is W[C + τ])
    W'  = the last C inputs of W ++ x

The kernel returns SiLU(u) (the mixer's next step, fused: one rounding to x's dtype instead of two)
and writes W' to pool[slots[r]].

Each request's tokens are cut into segments of SEG = BT · seg_tiles tokens; program (r, channel
block, s) walks segments s, s + S, s + 2S, ... of request r (S = the grid's third size), each in
tiles of BT tokens. Only segment 0 reaches back into the old window (SEG >= C - 1), and the same
program writes the new window after it, so the old window is read (by segment 0's first tile and,
for requests shorter than C, by the new window) before it is overwritten; a barrier orders those
reads before the write across the program's threads.  S is free (any S is exact): the launcher
picks it so that one long prompt among short ones is not walked by a single program per channel
block.  Tiles that start C - 1 or more tokens into their request read x only (no window loads,
no per-row source masks).

`conv_decode_inplace` is the same kernel for a decode step (one token per row) with one-token
tiles: the prefill's 32-token tiles would be 31/32 masked rows there.
"""
from typing import Optional

import torch

from export.ops.launch_keys import Launch, run, scratch
from export.ops.triton_switch import checked_out, require, rowmajor, tl, triton

# D = 3072: 48 channel blocks per request; each block of 32 tokens loads C shifted [32, 64] tiles
# of x (the shifts hit L1/L2: about one read of x overall) and stores one.  On an H200 at 8 × 2,048
# bf16 tokens: 0.226 ms a layer, against 0.246 for [64, 64] tiles and 0.35-0.50 for wider
# channel blocks (benchmarks/ops/bench_kernels.py, BENCHMARKS run S7); with segments, 4.15 ms a prefill step
# in the engine = 0.173 ms a layer (run S10; the stand-alone bench spread ±30 % between leases).
BLOCK_D = 64
BLOCK_T = 32
NUM_WARPS = 4
# tokens per segment = BLOCK_T · SEG_TILES; at most SPLIT_CAP (request, segment-slot) pairs a launch
# (× D / BLOCK_D channel blocks): 8 requests of 2,048 tokens get 32 slots each, 8 of which have a
# segment, and one long prompt among short ones still gets 32-way parallelism.
SEG_TILES = 8
SPLIT_CAP = 256
# decode: one token per row.  Run as one-token requests with the prefill tiles, the conv took
# 16.8 ms a step at width 1,280 on an H200 (BENCHMARKS run S6); a [1, 512] tile moves the same bytes
# with 1/64 of the masked work.
DECODE_BLOCK_D = 512

if triton is not None:
    # the per-request index arrays are read once per program: their pointers' 16-byte alignment
    # (a slice of the step's arrays starts anywhere) must not make a compile variant
    @triton.jit(do_not_specialize_on_alignment=["slots_ptr", "keep_ptr", "cu_ptr"])
    def _conv_prefill_kernel(x_ptr, u_ptr, pool_ptr, slots_ptr, keep_ptr, cu_ptr, w_ptr, b_ptr,
                             sx_t, su_t, sp_slot, sp_c, sp_d, sw_d, sw_c,
                             D: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr,
                             BT: tl.constexpr, SEG: tl.constexpr, SILU: tl.constexpr):
        r = tl.program_id(0)
        rd = tl.program_id(1) * BD + tl.arange(0, BD)
        seg0 = tl.program_id(2)
        n_split = tl.num_programs(2)
        md = rd < D
        bos = tl.load(cu_ptr + r).to(tl.int64)
        eos = tl.load(cu_ptr + r + 1).to(tl.int64)
        slot = tl.load(slots_ptr + r).to(tl.int64)
        # keep == 0: the old window is zeros (masked loads, never a product: the page may hold NaN)
        keep = tl.load(keep_ptr + r) != 0
        win = pool_ptr + slot * sp_slot + rd * sp_d                     # + row * sp_c
        bias = tl.load(b_ptr + rd, mask=md, other=0.0).to(tl.float32)
        rt = tl.arange(0, BT)

        for s0 in range(bos + seg0 * SEG, eos, n_split * SEG):
            for t0 in range(s0, tl.minimum(s0 + SEG, eos), BT):
                rows = t0 + rt
                mt = (rows < eos)[:, None] & md[None, :]
                acc = tl.full((BT, BD), 0.0, tl.float32) + bias[None, :]     # (see SILU below)
                if t0 - bos >= C - 1:
                    # every tap of this tile reads x: no window loads, no per-row source masks
                    for c in tl.static_range(C):
                        xs = tl.load(x_ptr + (rows - (C - 1 - c))[:, None] * sx_t + rd[None, :], mask=mt, other=0.0)
                        wc = tl.load(w_ptr + rd * sw_d + c * sw_c, mask=md, other=0.0).to(tl.float32)
                        acc += xs.to(tl.float32) * wc[None, :]
                else:
                    for c in tl.static_range(C):
                        src = rows - (C - 1 - c)                            # the input this tap reads
                        in_x = (src >= bos)[:, None]
                        xs = tl.load(x_ptr + src[:, None] * sx_t + rd[None, :], mask=mt & in_x, other=0.0)
                        ws = tl.load(win + (C + src - bos)[:, None] * sp_c, mask=mt & (~in_x) & keep, other=0.0)
                        wc = tl.load(w_ptr + rd * sw_d + c * sw_c, mask=md, other=0.0).to(tl.float32)
                        acc += (xs.to(tl.float32) + ws) * wc[None, :]
                # not tl.sigmoid / tl.zeros: jit functions of triton's own, which the interpreter runs
                # only if triton itself was imported with TRITON_INTERPRET=1 (the tests cannot ensure it)
                if SILU:
                    acc = acc / (1.0 + tl.exp(-acc))
                tl.store(u_ptr + rows[:, None] * su_t + rd[None, :], acc.to(u_ptr.dtype.element_ty), mask=mt)

        if seg0 == 0:
            _new_window(x_ptr, win, bos, eos, keep, rd, md, sx_t, sp_c, C, BC)

    @triton.jit
    def _new_window(x_ptr, win, bos, eos, keep, rd, md, sx_t, sp_c, C: tl.constexpr, BC: tl.constexpr):
        """Write request [bos, eos)'s new window to `win` (its page, at channels rd): row j holds the
        input at eos - C + j (from the old window when before bos).  A request of no tokens (a row
        padding a CUDA-graph batch, whose slot may be another request's) leaves the page alone."""
        j = tl.arange(0, BC)
        src = eos - C + j
        in_x = (src >= bos)[:, None]
        mj = (j < C)[:, None] & md[None, :]
        xs = tl.load(x_ptr + src[:, None] * sx_t + rd[None, :], mask=mj & in_x, other=0.0)
        ws = tl.load(win + (C + src - bos)[:, None] * sp_c, mask=mj & (~in_x) & keep, other=0.0)
        new = xs.to(tl.float32) + ws
        tl.debug_barrier()      # every thread's reads of the old window happen before the write
        tl.store(win + j[:, None] * sp_c, new, mask=mj & (eos > bos))

    @triton.jit(do_not_specialize=["T", "R"],
                do_not_specialize_on_alignment=["slots_ptr", "keep_ptr", "cu_ptr", "req_ptr"])
    def _conv_rows_kernel(x_ptr, u_ptr, pool_ptr, slots_ptr, keep_ptr, cu_ptr, req_ptr, w_ptr, b_ptr, T, R,
                          sx_t, su_t, sp_slot, sp_c, sp_d, sw_d, sw_c,
                          D: tl.constexpr, C: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
                          SILU: tl.constexpr):
        # program (token tile, channel block): BT consecutive rows of the packed step, whatever
        # requests they belong to (req_ptr: each row's request, R for rows after the last); the
        # windows are read here and written by `_conv_window_kernel`, launched after
        rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        rd = tl.program_id(1) * BD + tl.arange(0, BD)
        md = rd < D
        in_t = rows < T
        r = tl.load(req_ptr + rows, mask=in_t, other=R)
        valid = in_t & (r < R)
        bos = tl.load(cu_ptr + r, mask=valid, other=0).to(tl.int64)
        slot = tl.load(slots_ptr + r, mask=valid, other=0).to(tl.int64)
        keep = tl.load(keep_ptr + r, mask=valid, other=0) != 0
        m = valid[:, None] & md[None, :]
        acc = tl.full((BT, BD), 0.0, tl.float32) + tl.load(b_ptr + rd, mask=md, other=0.0).to(tl.float32)[None, :]
        for c in tl.static_range(C):
            src = rows - (C - 1 - c)                                    # the input this tap reads
            in_x = (src >= bos)[:, None]
            xs = tl.load(x_ptr + src[:, None] * sx_t + rd[None, :], mask=m & in_x, other=0.0)
            ws = tl.load(pool_ptr + slot[:, None] * sp_slot + (C + src - bos)[:, None] * sp_c + rd[None, :] * sp_d,
                         mask=m & (~in_x) & keep[:, None], other=0.0)
            wc = tl.load(w_ptr + rd * sw_d + c * sw_c, mask=md, other=0.0).to(tl.float32)
            acc += (xs.to(tl.float32) + ws) * wc[None, :]
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        # rows of no request get zeros (deterministic padding rows for the steps after)
        acc = tl.where(m, acc, 0.0)
        tl.store(u_ptr + rows[:, None] * su_t + rd[None, :], acc.to(u_ptr.dtype.element_ty),
                 mask=in_t[:, None] & md[None, :])

    @triton.jit(do_not_specialize_on_alignment=["slots_ptr", "keep_ptr", "cu_ptr"])
    def _conv_window_kernel(x_ptr, pool_ptr, slots_ptr, keep_ptr, cu_ptr, sx_t, sp_slot, sp_c, sp_d,
                            D: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
        r = tl.program_id(0)
        rd = tl.program_id(1) * BD + tl.arange(0, BD)
        md = rd < D
        bos = tl.load(cu_ptr + r).to(tl.int64)
        eos = tl.load(cu_ptr + r + 1).to(tl.int64)
        slot = tl.load(slots_ptr + r).to(tl.int64)
        keep = tl.load(keep_ptr + r) != 0
        _new_window(x_ptr, pool_ptr + slot * sp_slot + rd * sp_d, bos, eos, keep, rd, md, sx_t, sp_c, C, BC)


def _checked(pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
             cu_seqlens: torch.Tensor, out: Optional[torch.Tensor]) -> tuple:
    """A conv launcher's arguments checked (one line naming what is wrong): (T, D, C, R, the output
    [T, D] in x's dtype: `out` checked, or a new tensor)."""
    require("export.ops.conv")
    T, D = x.shape
    C = weight.shape[-1]
    R = slots.shape[0]
    if pool.dtype != torch.float32 or tuple(pool.shape[1:]) != (C, D):
        raise ValueError(f"conv pool {tuple(pool.shape)} {pool.dtype}: want [*, {C}, {D}] float32")
    if cu_seqlens.shape[0] != R + 1:
        raise ValueError(f"cu_seqlens has {cu_seqlens.shape[0]} entries for {R} requests: want R + 1")
    u = checked_out(out, (T, D), x.dtype) if out is not None else \
        scratch(torch.empty_like(x, memory_format=torch.contiguous_format))
    return T, D, C, R, u


def conv_prefill_inplace(pool: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor, x: torch.Tensor,
                         weight: torch.Tensor, bias: torch.Tensor, cu_seqlens: torch.Tensor,
                         silu: bool = True, block_t: int = BLOCK_T, block_d: int = BLOCK_D,
                         seg_tiles: int = SEG_TILES, n_split: Optional[int] = None,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal depthwise conv over the packed prefill tokens of R requests, continuing from and
    writing back their windows in the pool.

    pool [num_slots, C, D] float32 (any strides; updated in place at the R slots); slots [R]
    integer (distinct for real requests); keep [R] bool (False: start from a zero window);
    x [T, D] (last-dim stride 1); weight [D, 1, C] (Conv1d layout); bias [D]; cu_seqlens [R + 1]
    integer, nondecreasing, cu_seqlens[R] <= T.  Returns SiLU(u) (u if not silu) [T, D] in x's
    dtype (rows outside every request are left uninitialised).  block_t, block_d: the tile
    (powers of 2); seg_tiles: tiles per segment; n_split: programs per (request, channel block),
    None: `default_split`.  out: where to write the result ([T, D], x's dtype, last-dim stride 1; a
    row block of a buffer the caller shares), None: a new tensor."""
    T, D, C, R, u = _checked(pool, slots, x, weight, cu_seqlens, out)
    if R == 0 or T == 0:
        return u
    x = rowmajor(x)
    block_d = min(block_d, triton.next_power_of_2(D))
    seg = block_t * seg_tiles
    n_split = default_split(T, R, seg) if n_split is None else n_split
    if n_split < 1 or (n_split > 1 and seg < C - 1):
        raise ValueError(f"n_split={n_split} with {seg}-token segments: want n_split >= 1, and "
                         f"segments of >= C - 1 = {C - 1} tokens when n_split > 1")
    grid = (R, triton.cdiv(D, block_d), n_split)
    run(Launch(_conv_prefill_kernel, grid, (
        x, u, pool, slots.to(torch.long).contiguous(), keep.to(torch.int8).contiguous(),
        cu_seqlens.to(torch.int32).contiguous(),
        weight, bias, x.stride(0), u.stride(0), pool.stride(0), pool.stride(1), pool.stride(2),
        weight.stride(0), weight.stride(-1)),
        dict(D=D, C=C, BC=triton.next_power_of_2(C), BD=block_d, BT=block_t, SEG=seg, SILU=silu,
             num_warps=NUM_WARPS)))
    return u


def conv_rows_inplace(pool: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor, x: torch.Tensor,
                      weight: torch.Tensor, bias: torch.Tensor, cu_seqlens: torch.Tensor, silu: bool = True,
                      block_t: int = BLOCK_T, block_d: int = BLOCK_D, out: Optional[torch.Tensor] = None,
                      row_req: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`conv_prefill_inplace`'s result for a whole step whose requests may be of any lengths, decode
    rows as one-token requests, with launch grids that depend on T and R only: the step can be
    captured once as a CUDA graph and replayed for any batch of that size (export/full_graph.py).

    Arguments as `conv_prefill_inplace`; rows from cu_seqlens[R] to T (padding) get zeros, and
    requests of no tokens (padding rows of vLLM's padded batch) leave their pages untouched.
    row_req: `row_requests(cu_seqlens, T)`, which every layer of a step shares (None: made here).
    Two launches: the conv over tiles of block_t rows (any requests; windows read), then each
    request's new window (written after every read of the old one)."""
    T, D, C, R, u = _checked(pool, slots, x, weight, cu_seqlens, out)
    if R == 0 or T == 0:
        return u
    x = rowmajor(x)
    block_d = min(block_d, triton.next_power_of_2(D))
    cu = cu_seqlens.to(torch.int32).contiguous()
    slots = slots.to(torch.long).contiguous()
    keep8 = keep.to(torch.int8).contiguous()
    req = row_requests(cu, T) if row_req is None else row_req
    run(Launch(_conv_rows_kernel, (triton.cdiv(T, block_t), triton.cdiv(D, block_d)), (
        x, u, pool, slots, keep8, cu, req, weight, bias, T, R,
        x.stride(0), u.stride(0), pool.stride(0), pool.stride(1), pool.stride(2),
        weight.stride(0), weight.stride(-1)),
        dict(D=D, C=C, BD=block_d, BT=block_t, SILU=silu, num_warps=NUM_WARPS)))
    run(Launch(_conv_window_kernel, (R, triton.cdiv(D, block_d)), (
        x, pool, slots, keep8, cu, x.stride(0), pool.stride(0), pool.stride(1), pool.stride(2)),
        dict(D=D, C=C, BC=triton.next_power_of_2(C), BD=block_d, num_warps=NUM_WARPS)))
    return u


def row_requests(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """Each of T packed rows' request under cu_seqlens [R + 1] (R for rows after the last request):
    [T] int32, by `torch.searchsorted` on the device (no host sync; in a CUDA graph, captured)."""
    rows = torch.arange(T, device=cu_seqlens.device, dtype=torch.int32)
    return scratch(torch.searchsorted(cu_seqlens[1:].to(torch.int32), rows, right=True, out_int32=True))


def default_split(T: int, R: int, seg: int) -> int:
    """Programs per (request, channel block) for R requests holding T tokens in all, from host
    integers only (the lengths stay on the device: no sync): enough segment slots for a request
    of all T tokens, at most SPLIT_CAP slots over the R requests."""
    return max(1, min(-(-T // seg), SPLIT_CAP // max(R, 1)))


def conv_decode_inplace(pool: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor, x: torch.Tensor,
                        weight: torch.Tensor, bias: torch.Tensor, silu: bool = True,
                        cu_seqlens: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One decode step: row b of x [B, D] is the next input of the sequence whose window is
    pool[slots[b]] (zeros where keep[b] is False).  Returns SiLU(u) [B, D] in x's dtype; the
    windows are updated in place.  Padding rows may share the null slot 0 (their writes race
    there, harmlessly, as in gla_decode).  cu_seqlens: 0..B int32, the rows as one-token requests
    (None: made here; the vLLM mixer passes its step's, made once for all layers); out: as in
    `conv_prefill_inplace`."""
    cu = torch.arange(x.shape[0] + 1, device=x.device, dtype=torch.int32) if cu_seqlens is None else cu_seqlens
    return conv_prefill_inplace(pool, slots, keep, x, weight, bias, cu, silu, block_t=1, block_d=DECODE_BLOCK_D,
                                seg_tiles=1, n_split=1, out=out)
