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

`conv_decode_inplace` is the same kernel for a decode step (one token per row) with one-token
tiles: the prefill's 32-token tiles would be 31/32 masked rows there.
"""
import torch

from export.gla_triton import triton, tl

# D = 3072: 48 channel blocks per request; each block of 32 tokens loads C shifted [32, 64] tiles
# of x (the shifts hit L1/L2: about one read of x overall) and stores one.  On an H200 at 8 × 2,048
# bf16 tokens: 0.226 ms a layer, against 0.246 for [64, 64] tiles and 0.35-0.50 for wider
# channel blocks (`bench_conv_kernel`, BENCHMARKS run S7).
BLOCK_D = 64
BLOCK_T = 32
NUM_WARPS = 4
# decode: one token per row.  Run as one-token requests with the prefill tiles, the conv took
# 16.8 ms a step at width 1,280 on an H200 (BENCHMARKS run S6); a [1, 512] tile moves the same bytes
# with 1/64 of the masked work.
DECODE_BLOCK_D = 512

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
                         silu: bool = True, block_t: int = BLOCK_T, block_d: int = BLOCK_D) -> torch.Tensor:
    """Causal depthwise conv over the packed prefill tokens of R requests, continuing from and
    writing back their windows in the pool.

    pool [num_slots, C, D] float32 (any strides; updated in place at the R slots); slots [R]
    integer (distinct for real requests); keep [R] bool (False: start from a zero window);
    x [T, D] (last-dim stride 1); weight [D, 1, C] (Conv1d layout); bias [D]; cu_seqlens [R + 1]
    integer, nondecreasing, cu_seqlens[R] <= T.  Returns SiLU(u) (u if not silu) [T, D] in x's
    dtype (rows outside every request are left uninitialised).  block_t, block_d: the tile
    (powers of 2)."""
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
    block_d = min(block_d, triton.next_power_of_2(D))
    grid = (R, triton.cdiv(D, block_d))
    _conv_prefill_kernel[grid](
        x, u, pool, slots.contiguous(), keep.to(torch.int8).contiguous(), cu_seqlens.contiguous(),
        weight, bias, x.stride(0), u.stride(0), pool.stride(0), pool.stride(1), pool.stride(2),
        weight.stride(0), weight.stride(-1),
        D=D, C=C, BC=triton.next_power_of_2(C), BD=block_d, BT=block_t, SILU=silu, num_warps=NUM_WARPS)
    return u


def conv_decode_inplace(pool: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor, x: torch.Tensor,
                        weight: torch.Tensor, bias: torch.Tensor, silu: bool = True) -> torch.Tensor:
    """One decode step: row b of x [B, D] is the next input of the sequence whose window is
    pool[slots[b]] (zeros where keep[b] is False).  Returns SiLU(u) [B, D] in x's dtype; the
    windows are updated in place.  Padding rows may share the null slot 0 (their writes race
    there, harmlessly, as in gla_triton)."""
    cu = torch.arange(x.shape[0] + 1, device=x.device, dtype=torch.int32)
    return conv_prefill_inplace(pool, slots, keep, x, weight, bias, cu, silu, block_t=1, block_d=DECODE_BLOCK_D)


def bench_conv_kernel(prefill_tokens: int = 16384, width: int = 1280, D: int = 3072, C: int = 4,
                      tiles=((64, 64), (32, 128), (16, 256), (64, 128), (32, 64))) -> dict:
    """CUDA, bf16, the 3B width.  Prefill: `conv_prefill_inplace` on 8 requests of
    prefill_tokens / 8 tokens per tile (block_t, block_d), and its HBM traffic (x read, u written)
    in TB/s.  Decode at `width` rows: the torch decode path's window gather, `conv_step` and scatter
    against `conv_decode_inplace`."""
    from export.gla_prefill_triton import _time_ms
    from export.torch_model import conv_step

    g = torch.Generator(device="cpu").manual_seed(0)
    w = torch.randn(D, 1, C, generator=g).to("cuda", torch.bfloat16)
    b = torch.randn(D, generator=g).to("cuda", torch.bfloat16)
    pool = torch.zeros(width + 8, C, D, device="cuda")
    out = {}
    R = 8
    slots = torch.arange(1, R + 1, device="cuda")
    keep = torch.ones(R, dtype=torch.bool, device="cuda")
    cu = torch.arange(0, prefill_tokens + 1, prefill_tokens // R, device="cuda", dtype=torch.int32)
    x = torch.randn(prefill_tokens, D, generator=g).to("cuda", torch.bfloat16)
    gb = 2 * x.numel() * x.element_size() / 1e9
    for bt, bd in tiles:
        ms = _time_ms(lambda: conv_prefill_inplace(pool, slots, keep, x, w, b, cu, block_t=bt, block_d=bd))
        out[f"prefill {prefill_tokens} tokens BT={bt} BD={bd}"] = (ms, gb / ms)
    slots = (torch.randperm(width + 7, generator=g)[:width] + 1).cuda()
    keep = torch.ones(width, dtype=torch.bool, device="cuda")
    xd = x[:width]

    def torch_step():       # the torch decode path's conv: gather, conv_step, scatter
        u, window = conv_step(xd, torch.where(keep.view(-1, 1, 1), pool[slots], 0.0), w, b)
        pool[slots] = window.float()
        return torch.nn.functional.silu(u)

    gb = 2 * width * C * D * 4 / 1e9
    out[f"decode {width} rows torch"] = (_time_ms(torch_step), gb)
    ms = _time_ms(lambda: conv_decode_inplace(pool, slots, keep, xd, w, b))
    out[f"decode {width} rows triton"] = (ms, gb / ms)
    return out


if __name__ == "__main__":  # python -m export.conv_triton   (CUDA: the bench; the checks are tests)
    for name, (ms, tbs) in bench_conv_kernel().items():
        print(f"bench conv {name}: {ms:.3f} ms" + (f" = {tbs:.2f} TB/s" if "torch" not in name else ""))
