"""Triton kernel for the causal depthwise conv (+ SiLU) of all prefill requests of a vLLM step,
conv window read from and written back to vLLM's state pool in place.

The tokens of R requests lie back to back (request r owns rows cu_seqlens[r]:cu_seqlens[r+1]).
Request r continues from the window W = pool[slots[r]] [C, D] (its last C inputs, oldest first;
zeros when keep[r] is False) and, as `torch_model.conv_with_state`,

    u_t = b + Σ_c w[:, c] · x_{t-(C-1)+c}          (x_τ for τ < 0 is W[C + τ])
    W'  = the last C inputs of W ++ x

The kernel returns SiLU(u) (the mixer's next step, fused: one rounding to x's dtype instead of two)
and writes W' to pool[slots[r]].

One program per (request, block of BD channels) walks the request's tokens in blocks of BT, so the
old window is read (by the first block and, for requests shorter than C, by the new window) before
the same program overwrites it; a barrier orders those reads before the write across its threads.
"""
import torch

from export.gla_triton import triton, tl

# D = 3072: 48 channel blocks per request; each block of 64 tokens loads C shifted [64, 64] tiles
# of x (the shifts hit L1/L2: about one read of x overall) and stores one.
BLOCK_D = 64
BLOCK_T = 64
NUM_WARPS = 4

if triton is not None:
    @triton.jit
    def _conv_prefill_kernel(x_ptr, u_ptr, pool_ptr, slots_ptr, keep_ptr, cu_ptr, w_ptr, b_ptr,
                             sx_t, su_t, sp_slot, sp_c, sp_d, sw_d, sw_c,
                             D: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr,
                             BT: tl.constexpr, SILU: tl.constexpr):
        r = tl.program_id(0)
        rd = tl.program_id(1) * BD + tl.arange(0, BD)
        md = rd < D
        bos = tl.load(cu_ptr + r).to(tl.int64)
        eos = tl.load(cu_ptr + r + 1).to(tl.int64)
        slot = tl.load(slots_ptr + r).to(tl.int64)
        # keep == 0: the old window is zeros (masked loads, never a product: the page may hold NaN)
        keep = tl.load(keep_ptr + r) != 0
        win = pool_ptr + slot * sp_slot + rd * sp_d                     # + row * sp_c
        bias = tl.load(b_ptr + rd, mask=md, other=0.0).to(tl.float32)
        rt = tl.arange(0, BT)

        for t0 in range(bos, eos, BT):
            rows = t0 + rt
            mt = (rows < eos)[:, None] & md[None, :]
            acc = tl.full((BT, BD), 0.0, tl.float32) + bias[None, :]     # (see SILU below)
            for c in tl.static_range(C):
                src = rows - (C - 1 - c)                                # the input this tap reads
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

        # the new window: row j holds the input at eos - C + j (from the old window when before bos)
        j = tl.arange(0, BC)
        src = eos - C + j
        in_x = (src >= bos)[:, None]
        mj = (j < C)[:, None] & md[None, :]
        xs = tl.load(x_ptr + src[:, None] * sx_t + rd[None, :], mask=mj & in_x, other=0.0)
        ws = tl.load(win + (C + src - bos)[:, None] * sp_c, mask=mj & (~in_x) & keep, other=0.0)
        new = xs.to(tl.float32) + ws
        tl.debug_barrier()          # every thread's reads of the old window happen before the write
        tl.store(win + j[:, None] * sp_c, new, mask=mj)


def conv_prefill_inplace(pool: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor, x: torch.Tensor,
                         weight: torch.Tensor, bias: torch.Tensor, cu_seqlens: torch.Tensor,
                         silu: bool = True) -> torch.Tensor:
    """Causal depthwise conv over the packed prefill tokens of R requests, continuing from and
    writing back their windows in the pool.

    pool [num_slots, C, D] float32 (any strides; updated in place at the R slots); slots [R]
    integer (distinct for real requests); keep [R] bool (False: start from a zero window);
    x [T, D] (last-dim stride 1); weight [D, 1, C] (Conv1d layout); bias [D]; cu_seqlens [R + 1]
    integer, nondecreasing, cu_seqlens[R] <= T.  Returns SiLU(u) (u if not silu) [T, D] in x's
    dtype (rows outside every request are left uninitialised)."""
    if triton is None:
        raise RuntimeError("export.conv_triton: triton is not installed")
    T, D = x.shape
    C = weight.shape[-1]
    R = slots.shape[0]
    if pool.dtype != torch.float32 or tuple(pool.shape[1:]) != (C, D):
        raise ValueError(f"conv pool {tuple(pool.shape)} {pool.dtype}: want [*, {C}, {D}] float32")
    if cu_seqlens.shape[0] != R + 1:
        raise ValueError(f"cu_seqlens has {cu_seqlens.shape[0]} entries for {R} requests: want R + 1")
    u = torch.empty_like(x, memory_format=torch.contiguous_format)
    if R == 0 or T == 0:
        return u
    x = x if x.stride(-1) == 1 else x.contiguous()
    grid = (R, triton.cdiv(D, BLOCK_D))
    _conv_prefill_kernel[grid](
        x, u, pool, slots.contiguous(), keep.to(torch.int8).contiguous(), cu_seqlens.contiguous(),
        weight, bias, x.stride(0), u.stride(0), pool.stride(0), pool.stride(1), pool.stride(2),
        weight.stride(0), weight.stride(-1),
        D=D, C=C, BC=triton.next_power_of_2(C), BD=BLOCK_D, BT=BLOCK_T, SILU=silu, num_warps=NUM_WARPS)
    return u
