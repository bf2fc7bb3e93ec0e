"""Triton kernel for one Simple-GLA decode step that updates vLLM's state pool in place.

For every batch row b and head h, with slot = slots[b] and keep = keep[b]:

    S' = (keep ? λ_h S[slot, h] : 0) + k_{b,h} v_{b,h}^T        (S: [K, V] float32)
    o_{b,h} = K^-0.5 S'^T q_{b,h}

S' is written back into pool[slot, h]: one read and one write of the state, where the torch path
(gather by slot, `torch.where`, `gla_step`, scatter back) makes several full passes over it.

Rows that pad a CUDA-graph batch point at the null slot 0 (several rows may): their writes race
there, which is harmless because slot 0 belongs to no sequence and their outputs are discarded.
Real rows must have distinct slots.

`available(t)` says whether the kernel can run for tensors like `t` (CUDA, triton importable,
LAPLACE_VLLM_TRITON not "0").  `check_decode_kernel()` compares it with `torch_model.gla_step` on
random data (GPU only; with TRITON_INTERPRET=1 it also runs on CPU tensors).
"""
import os
from typing import Optional

import torch

from export.ops.launch_keys import Launch, run

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU install without triton: the torch path is used
    triton = None
    tl = None

BLOCK_V = 64
BLOCK_K = None      # None: all of K in one block (next power of 2)
NUM_WARPS = 4


def _evict_default() -> bool:
    """LAPLACE_GLA_DECODE_EVICT=1: the state's loads and stores carry `evict_first` (each state
    byte is touched once a step, so L2 has nothing to keep; chosen per run for a benchmark)."""
    return os.environ.get("LAPLACE_GLA_DECODE_EVICT", "0") == "1"


def enabled() -> bool:
    return triton is not None and os.environ.get("LAPLACE_VLLM_TRITON", "1") != "0"


def available(t: torch.Tensor) -> bool:
    return enabled() and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:
    # the per-request index arrays are read once per program: their pointers' 16-byte alignment
    # (a slice of the step's arrays starts anywhere) must not make a compile variant
    @triton.jit(do_not_specialize_on_alignment=["slots_ptr", "keep_ptr"])
    def _gla_decode_kernel(pool_ptr, slots_ptr, keep_ptr, q_ptr, k_ptr, v_ptr, gamma_ptr, o_ptr,
                           sp_slot, sp_h, sp_k, sp_v,
                           sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, so_b, so_h,
                           scale,
                           K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           EVICT: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        vb = tl.program_id(2)
        slot = tl.load(slots_ptr + b).to(tl.int64)
        keep = tl.load(keep_ptr + b)
        lam = tl.exp(tl.load(gamma_ptr + h).to(tl.float32))
        rv = vb * BV + tl.arange(0, BV)
        mv = rv < V
        v = tl.load(v_ptr + b * sv_b + h * sv_h + rv, mask=mv, other=0.0).to(tl.float32)
        o = tl.zeros([BV], dtype=tl.float32)
        # K in blocks of BK rows, unrolled: with BK dividing K (32 for K = 96) no lane is masked off,
        # and all blocks' loads can be in flight at once
        for kb in tl.static_range(0, K, BK):
            rk = kb + tl.arange(0, BK)
            mk = rk < K
            q = tl.load(q_ptr + b * sq_b + h * sq_h + rk, mask=mk, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + b * sk_b + h * sk_h + rk, mask=mk, other=0.0).to(tl.float32)
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
        tl.store(o_ptr + b * so_b + h * so_h + rv, o * scale, mask=mv)


def _rowmajor(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def check_gamma(H: int, device) -> torch.Tensor:
    """ln λ [H] float32 for the kernels' checks and benches: fast and slow heads, λ from 0.5 to
    ~0.9988 (the 3B model's range)."""
    return torch.tensor([-0.69 / (1 + 37 * i) for i in range(H)], dtype=torch.float32, device=device)


def gla_decode_inplace(pool: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor, q: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor,
                       block_v: int = BLOCK_V, num_warps: int = NUM_WARPS,
                       block_k: Optional[int] = BLOCK_K, evict: Optional[bool] = None) -> torch.Tensor:
    """pool [num_slots, H, K, V] float32 (any strides, updated in place); slots [B] integer (valid
    slot ids); keep [B] bool (False: start from a zero state); q, k [B, H, K]; v [B, H, V] (any
    float dtype, last-dim stride 1 or copied); gamma [H] (ln λ).  Returns o [B, H, V] float32.
    block_v, num_warps: the launch (one program per row, head and block_v columns of V); block_k:
    rows of K per unrolled step inside a program (None: all of K, padded to a power of 2); evict:
    `evict_first` on the state's traffic (None: LAPLACE_GLA_DECODE_EVICT)."""
    if triton is None:
        raise RuntimeError("export.gla_triton: triton is not installed")
    B, H, K = q.shape
    V = v.shape[-1]
    if pool.dtype != torch.float32 or tuple(pool.shape[1:]) != (H, K, V):
        raise ValueError(f"state pool {tuple(pool.shape)} {pool.dtype}: want [*, {H}, {K}, {V}] float32")
    o = torch.empty((B, H, V), device=q.device, dtype=torch.float32)
    if B == 0:
        return o
    q, k, v = _rowmajor(q), _rowmajor(k), _rowmajor(v)
    slots = slots.to(torch.long).contiguous()
    keep = keep.to(torch.int8).contiguous()
    gamma = gamma.to(device=q.device, dtype=torch.float32).contiguous()
    BV = min(block_v, triton.next_power_of_2(V))
    BK = triton.next_power_of_2(K) if block_k is None else block_k
    if BK & (BK - 1):
        raise ValueError(f"block_k={block_k}: want a power of 2")
    grid = (B, H, triton.cdiv(V, BV))
    run(Launch(_gla_decode_kernel, grid, (
        pool, slots, keep, q, k, v, gamma, o,
        pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(3),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1),
        float(K) ** -0.5),
        dict(K=K, V=V, BK=BK, BV=BV, EVICT=_evict_default() if evict is None else bool(evict),
             num_warps=num_warps)))
    return o


def check_decode_kernel(device: str = "cuda", H: int = 16, K: int = 96, V: int = 192,
                        rows: int = 300, num_slots: int = 400, pad_rows: int = 20, seed: int = 0) -> float:
    """Max abs error of `gla_decode_inplace` against torch `gla_step` (o of the real rows, the
    updated pool rows of their slots, and all slots no row touches, which must stay unchanged).

    The pool is a strided view into a page buffer (as vLLM lays out a layer's two states); q, k, v
    are non-contiguous views of one projection (as the mixer splits them); `pad_rows` extra rows
    point at slot 0 with keep False (CUDA-graph padding) and are excluded from the comparison."""
    from export.torch_model import gla_step, split_heads

    g = torch.Generator(device="cpu").manual_seed(seed)
    page = 8 + H * K * V + 24                       # some other state before it, padding after it
    raw = torch.randn(num_slots, page, generator=g)
    raw_dev = raw.to(device)
    pool = raw_dev[:, 8:8 + H * K * V].unflatten(1, (H, K, V))         # strided, not contiguous
    before = pool.clone()
    real = torch.randperm(num_slots - 1, generator=g)[:rows] + 1                   # distinct, never 0
    slots = torch.cat([real, torch.zeros(pad_rows, dtype=torch.long)]).to(device)
    keep = torch.cat([torch.rand(rows, generator=g) < 0.8, torch.zeros(pad_rows, dtype=torch.bool)])
    keep = keep.to(device)
    B = rows + pad_rows
    proj = torch.randn(B, H * (2 * K + 2 * V), generator=g).to(device)
    q, k, v, _ = split_heads(proj, H, K, V)
    gamma = check_gamma(H, device)

    st = torch.where(keep[:rows].view(-1, 1, 1, 1), before[slots[:rows]], 0.0)
    want_o, want_s = gla_step(q[:rows], k[:rows], v[:rows], gamma, st)

    o = gla_decode_inplace(pool, slots, keep, q, k, v, gamma)
    if device != "cpu":
        torch.cuda.synchronize()
    err_o = (o[:rows] - want_o).abs().max().item()
    err_s = (pool[slots[:rows]] - want_s).abs().max().item()
    untouched = torch.ones(num_slots, dtype=torch.bool, device=pool.device)
    untouched[slots] = False
    err_u = (pool[untouched] - before[untouched]).abs().max().item()
    # the rest of each page (outside the view) is untouched too
    outside = torch.cat([raw_dev[:, :8], raw_dev[:, 8 + H * K * V:]], 1).cpu()
    err_p = (outside - torch.cat([raw[:, :8], raw[:, 8 + H * K * V:]], 1)).abs().max().item()
    return max(err_o, err_s, err_u, err_p)


def bench_decode_kernel(width: int = 1280, H: int = 16, K: int = 96, V: int = 192,
                        launches=((64, 4, None, False), (64, 4, None, True), (64, 4, 32, False),
                                  (64, 4, 32, True), (64, 2, 32, False), (64, 2, 32, True),
                                  (128, 4, 32, True), (32, 2, 32, True))) -> dict:
    """CUDA: `gla_decode_inplace` at `width` rows of the 3B head shape (bf16 views of one
    projection, as the mixer passes them), ms per launch (block_v, num_warps, block_k, evict) and its
    state traffic in TB/s (read + write of width × H·K·V float32)."""
    from export.gla_prefill_triton import _time_ms
    from export.torch_model import split_heads

    g = torch.Generator(device="cpu").manual_seed(0)
    slots = (torch.randperm(width + 7, generator=g)[:width] + 1).cuda()
    keep = torch.ones(width, dtype=torch.bool, device="cuda")
    pool = torch.zeros(width + 8, H, K, V, device="cuda")
    proj = torch.randn(width, H * (2 * K + 2 * V), generator=g).to("cuda", torch.bfloat16)
    q, k, v, _ = split_heads(proj, H, K, V)
    gamma = check_gamma(H, "cuda")
    gb = 2 * width * H * K * V * 4 / 1e9
    out = {}
    for bv, warps, bk, ev in launches:
        ms = _time_ms(lambda: gla_decode_inplace(pool, slots, keep, q, k, v, gamma, bv, warps, bk, ev))
        out[f"BV={bv} warps={warps} BK={bk or 'all'} evict={int(ev)}"] = (ms, gb / ms)
    return out


if __name__ == "__main__":  # python -m export.gla_triton [cpu|cuda]  (cuda: also bench_decode_kernel)
    import sys
    dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    print(f"max abs error {check_decode_kernel(dev):.3e}")
    if dev != "cpu":
        for name, (ms, tbs) in bench_decode_kernel().items():
            print(f"bench decode GLA width 1280 {name}: {ms:.3f} ms = {tbs:.2f} TB/s of state")
