"""Triton kernel for the mixer's post-GLA step (`reference.gated_mix` + reshape + cast), fused.

For token t, head h (tier τ = h // (H / T)), in float32 in torch's order:

    aug = σ(Σ_k q_k a_{h,k} k_k)
    o'  = o + aug · v
    y   = o' · rsqrt(mean_v(o'^2) + eps) · head_norm[τ] · SiLU(g)

written once, cast to the output dtype, as y [N, H·V] ready for w_out.  The torch path runs about
ten float32 element-wise / reduction passes over [N, H, V] plus the reshape copy and the cast; here
q, k, v, g are read once straight from the projection (strided bf16 or float32 views), o once, y
written once.

One program per (block of BT tokens, head): the head's V values (padded to a power of 2, masked)
are in registers, so the RMS reduction is one in-register sum.  No host syncs (the decode path runs
inside CUDA graphs).

`gated_mix_fused` is used by export/vllm_model.py where `triton_switch.available(t)`.
`export.checks.gated_mix_error()` compares it with `reference.gated_mix` in float64 against an
error bound derived from the arithmetic (`checks.gated_mix_error_bound`);
benchmarks/ops/bench_kernels.py times it against the torch path.
"""
import torch

from export.ops.launch_keys import Launch, run, scratch
from export.ops.triton_switch import require, rowmajor, tl, triton

# 8 tokens × 256 (padded V) float32 per tile: 16 values a thread and tensor at 4 warps; N=16384,
# H=16 gives 32768 programs, N=1280 2560 (~20 per SM of 132).  bench_kernels.py tries others.
BLOCK_T = 8
NUM_WARPS = 4

if triton is not None:
    # N (tokens) changes every step: Triton would compile N = 1 and N % 16 == 0 apart
    @triton.jit(do_not_specialize=["N"])
    def _gated_mix_kernel(q_ptr, k_ptr, v_ptr, g_ptr, o_ptr, a_ptr, w_ptr, y_ptr, N,
                         sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, so_t, so_h,
                         sa_h, sw_t, sy_t, eps,
                         K: tl.constexpr, V: tl.constexpr, HPT: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr):
        tb = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        rows = tb * BT + tl.arange(0, BT)
        rk = tl.arange(0, BK)
        rv = tl.arange(0, BV)
        mt = rows < N
        mk = rk < K
        mv = rv < V
        mtk = mt[:, None] & mk[None, :]
        mtv = mt[:, None] & mv[None, :]
        q = tl.load(q_ptr + rows[:, None] * sq_t + h * sq_h + rk[None, :], mask=mtk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + rows[:, None] * sk_t + h * sk_h + rk[None, :], mask=mtk, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + h * sa_h + rk, mask=mk, other=0.0).to(tl.float32)
        # torch's order: (q · a) · k, then the sum over K
        aug = tl.sigmoid(tl.sum(q * a[None, :] * k, axis=1))                          # [BT]
        v = tl.load(v_ptr + rows[:, None] * sv_t + h * sv_h + rv[None, :], mask=mtv, other=0.0).to(tl.float32)
        o = tl.load(o_ptr + rows[:, None] * so_t + h * so_h + rv[None, :], mask=mtv, other=0.0).to(tl.float32)
        o = o + aug[:, None] * v
        # padded columns are 0 (masked loads), so the sum is over the V real ones; mean = sum / V
        ms = tl.sum(o * o, axis=1) / V
        o = o * tl.rsqrt(ms + eps)[:, None]
        w = tl.load(w_ptr + (h // HPT) * sw_t + rv, mask=mv, other=0.0).to(tl.float32)
        o = o * w[None, :]
        g = tl.load(g_ptr + rows[:, None] * sg_t + h * sg_h + rv[None, :], mask=mtv, other=0.0).to(tl.float32)
        o = o * (g * tl.sigmoid(g))
        tl.store(y_ptr + rows[:, None] * sy_t + h * V + rv[None, :], o.to(y_ptr.dtype.element_ty), mask=mtv)


def gated_mix_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, o: torch.Tensor,
                    aug_balance: torch.Tensor, head_norm: torch.Tensor, eps: float,
                    out_dtype: torch.dtype, block_t: int = BLOCK_T,
                    num_warps: int = NUM_WARPS) -> torch.Tensor:
    """`reference.gated_mix(q, k, v, g, o, ...)` reshaped to [N, H·V] and cast to `out_dtype`, in one pass.

    q, k [N, H, K]; v, g [N, H, V] (bf16, float16 or float32, each its own; any strides, last-dim
    stride 1 used as is); o [N, H, V] (float32 or the GLA kernels' bf16 / float16 output, upcast
    inside); aug_balance [H, K]; head_norm [T, V] with T
    dividing H (head h uses row h // (H / T)); eps: the RMSNorm epsilon.  Returns y [N, H·V]
    (contiguous) in out_dtype.  block_t, num_warps: launch settings."""
    require("export.ops.gated_mix")
    N, H, K = q.shape
    V = v.shape[-1]
    T = head_norm.shape[0]
    if tuple(k.shape) != (N, H, K) or tuple(v.shape) != (N, H, V) or tuple(g.shape) != (N, H, V) \
            or tuple(o.shape) != (N, H, V):
        raise ValueError(f"shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"g {tuple(g.shape)} o {tuple(o.shape)}: want [N, H, K] ×2, [N, H, V] ×3")
    if o.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"o is {o.dtype}: want float32, bfloat16 or float16 (the GLA kernels' output)")
    if tuple(aug_balance.shape) != (H, K) or head_norm.shape[1] != V or H % T:
        raise ValueError(f"aug_balance {tuple(aug_balance.shape)}, head_norm {tuple(head_norm.shape)}: "
                         f"want [{H}, {K}] and [T, {V}] with T dividing {H}")
    y = scratch(torch.empty((N, H * V), device=q.device, dtype=out_dtype))
    if N == 0:
        return y
    q, k, v, g, o = (rowmajor(x) for x in (q, k, v, g, o))
    a, w = rowmajor(aug_balance), rowmajor(head_norm)
    grid = (triton.cdiv(N, block_t), H)
    run(Launch(_gated_mix_kernel, grid, (
        q, k, v, g, o, a, w, y, N,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), o.stride(0), o.stride(1),
        a.stride(0), w.stride(0), y.stride(0), float(eps)),
        dict(K=K, V=V, HPT=H // T, BK=triton.next_power_of_2(K), BV=triton.next_power_of_2(V), BT=block_t,
             num_warps=num_warps)))
    return y
