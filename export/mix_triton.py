"""Triton kernel for the mixer's post-GLA part (`torch_model.mixer_post` + reshape + cast), fused.

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

`mixer_post_fused` is used by export/vllm_model.py where `available(t)` (gla_triton's switch: CUDA,
triton, LAPLACE_VLLM_TRITON != "0").  `check_mix_kernel()` compares it with `mixer_post` in float64
against an error bound derived from the arithmetic (`error_bound`); `bench_mix_kernel()` times it
against the torch path.  `python -m export.mix_triton cuda` runs both (TRITON_INTERPRET=1 ... cpu:
the check on small CPU tensors).
"""
import math
import os
from typing import Optional

import torch

from export.gla_prefill_triton import _fresh_seed, _time_ms
from export.gla_triton import _rowmajor, available, enabled, triton, tl  # noqa: F401  (one switch for all)
from export.ops.launch_keys import Launch, run

# 8 tokens × 256 (padded V) float32 per tile: 16 values a thread and tensor at 4 warps; N=16384,
# H=16 gives 32768 programs, N=1280 2560 (~20 per SM of 132).  bench_mix_kernel tries others.
BLOCK_T = 8
NUM_WARPS = 4

if triton is not None:
    # N (tokens) changes every step: Triton would compile N = 1 and N % 16 == 0 apart
    @triton.jit(do_not_specialize=["N"])
    def _mix_post_kernel(q_ptr, k_ptr, v_ptr, g_ptr, o_ptr, a_ptr, w_ptr, y_ptr, N,
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


def mixer_post_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, o: torch.Tensor,
                     aug_balance: torch.Tensor, head_norm: torch.Tensor, eps: float,
                     out_dtype: torch.dtype, block_t: int = BLOCK_T,
                     num_warps: int = NUM_WARPS) -> torch.Tensor:
    """`mixer_post(q, k, v, g, o, ...)` reshaped to [N, H·V] and cast to `out_dtype`, in one pass.

    q, k [N, H, K]; v, g [N, H, V] (bf16, float16 or float32, each its own; any strides, last-dim
    stride 1 used as is); o [N, H, V] (float32 or the GLA kernels' bf16 / float16 output, upcast
    inside); aug_balance [H, K]; head_norm [T, V] with T
    dividing H (head h uses row h // (H / T)); eps: the RMSNorm epsilon.  Returns y [N, H·V]
    (contiguous) in out_dtype.  block_t, num_warps: launch settings."""
    if triton is None:
        raise RuntimeError("export.mix_triton: triton is not installed")
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
    y = torch.empty((N, H * V), device=q.device, dtype=out_dtype)
    if N == 0:
        return y
    q, k, v, g, o = (_rowmajor(x) for x in (q, k, v, g, o))
    a, w = _rowmajor(aug_balance), _rowmajor(head_norm)
    grid = (triton.cdiv(N, block_t), H)
    run(Launch(_mix_post_kernel, grid, (
        q, k, v, g, o, a, w, y, N,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), o.stride(0), o.stride(1),
        a.stride(0), w.stride(0), y.stride(0), float(eps)),
        dict(K=K, V=V, HPT=H // T, BK=triton.next_power_of_2(K), BV=triton.next_power_of_2(V), BT=block_t,
             num_warps=num_warps)))
    return y


# ----------------------------------------------------------------------------- reference and bound

U32 = 2.0 ** -24   # float32 unit roundoff
LAMBDA = 6.0       # probabilistic sum bound (Higham & Mary 2019), as tests/conftest.f32_sum_err
ULPS = 8.0         # allowance for one elementary function (exp, rsqrt, division: approx. on GPUs)


def reference(q, k, v, g, o, aug_balance, head_norm, eps) -> torch.Tensor:
    """torch `mixer_post` in float64 on the same values: [N, H·V] float64."""
    from export.torch_model import mixer_post
    d = [x.double() for x in (q, k, v, g, o)]
    y = mixer_post(*d, aug_balance.double(), head_norm.double(), eps)
    return y.reshape(y.shape[0], -1)


def error_bound(q, k, v, g, o, aug_balance, head_norm, eps, out_dtype: torch.dtype) -> torch.Tensor:
    """Per element of y [N, H·V]: how far a float32 evaluation (mixer_post's order) may be from the
    float64 one, first order in u = 2^-24, times 2 for the second-order terms; plus, for a 16-bit
    out_dtype, one ulp of the final cast (≤ eps(out_dtype)·|y|).

    logit = Σ_K q a k: K products (2 roundings each) and a K-term sum: (λ√K + 2)u Σ|q a k|.
    aug = σ(logit): |σ'| ≤ 1/4 on that; σ's own exp of -x rounds x·log2(e) (relative |x|u on the
    exponential, σ(1-σ)|x|u on σ) and a few ops (ULPS·u).
    o' = o + aug v: |v|·e_aug + 2u(|aug v| + |o'|).
    m = mean(o'^2) + eps: (λ√V + 2)u Σo'^2 for the sum, 2Σ|o'| e_o' from o's errors, over V, u
    each for the division and +eps; rsqrt halves the relative error, adds ULPS·u.
    y = o' r w SiLU(g): e_o' |r w s| + |y|(e_r/r + 3u (products) + SiLU's relative error
    (σ(g) as above, relative (1-σ)(|g| + ULPS)u, plus u))."""
    d = [x.double() for x in (q, k, v, g, o)]
    q, k, v, g, o = d
    N, H, K = q.shape
    V = v.shape[-1]
    T = head_norm.shape[0]
    u = U32
    a = aug_balance.double()
    w = head_norm.double().repeat_interleave(H // T, dim=0)                        # [H, V]
    x = (q * a * k).sum(-1, keepdim=True)
    sx = torch.sigmoid(x)
    e_x = (LAMBDA * math.sqrt(K) + 2) * u * (q * a * k).abs().sum(-1, keepdim=True)
    e_aug = 0.25 * e_x + sx * (1 - sx) * x.abs() * u + ULPS * u
    o1 = o + sx * v
    e_o1 = v.abs() * e_aug + 2 * u * ((sx * v).abs() + o1.abs())
    sq = (o1 * o1).sum(-1, keepdim=True)
    m = sq / V + eps
    e_m = ((LAMBDA * math.sqrt(V) + 2) * u * sq + 2 * (o1.abs() * e_o1).sum(-1, keepdim=True)) / V
    r = torch.rsqrt(m)
    rel_r = 0.5 * (e_m / m + 2 * u) + ULPS * u
    sg = torch.sigmoid(g)
    silu = g * sg
    rel_silu = (1 - sg) * (g.abs() + ULPS) * u + u
    y = o1 * r * w * silu
    bound = 2 * (e_o1 * (r * w * silu).abs() + y.abs() * (rel_r + 3 * u + rel_silu))
    bound = bound.reshape(N, -1)
    if out_dtype != torch.float32:
        bound = bound + torch.finfo(out_dtype).eps * (y.abs().reshape(N, -1) + bound)
    return bound


def random_inputs(N: int, H: int = 16, K: int = 96, V: int = 192, T: int = 4,
                  dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
                  seed: Optional[int] = None, o_dtype: torch.dtype = torch.float32) -> tuple:
    """q, k, v, g as strided views of one [N + 3, H·(2K + 2V)] projection in `dtype` (as the mixer
    splits it; 3 extra rows so the views do not end the buffer), o [N, H, V] in o_dtype (a strided
    view too), aug_balance [H, K], head_norm [T, V] float32 (random, not the ones/zeros of a fresh
    model), eps.  Returns (q, k, v, g, o, aug_balance, head_norm, eps)."""
    from export.torch_model import split_heads

    g_ = torch.Generator(device="cpu").manual_seed(_fresh_seed() if seed is None else seed)
    proj = torch.randn(N + 3, H * (2 * K + 2 * V), generator=g_).to(device=device, dtype=dtype)[:N]
    q, k, v, g = split_heads(proj, H, K, V)
    o = torch.randn(N, H, V + 5, generator=g_).to(device=device, dtype=o_dtype)[..., 2:2 + V]
    aug_balance = (0.3 * torch.randn(H, K, generator=g_)).to(device)
    head_norm = (1 + 0.2 * torch.randn(T, V, generator=g_)).to(device)
    return q, k, v, g, o, aug_balance, head_norm, 1e-5


def mix_error(N: int, H: int = 16, K: int = 96, V: int = 192, T: int = 4,
              dtype: torch.dtype = torch.bfloat16, out_dtype: torch.dtype = torch.bfloat16,
              device: str = "cuda", seed: Optional[int] = None, o_dtype: torch.dtype = torch.float32) -> float:
    """max |y − y64| / error_bound over y [N, H·V] for `mixer_post_fused` on `random_inputs`:
    ≤ 1 passes.  inf where y is not finite."""
    args = random_inputs(N, H, K, V, T, dtype, device, seed, o_dtype)
    return error_ratio(mixer_post_fused(*args, out_dtype), args, out_dtype)


def error_ratio(y: torch.Tensor, args: tuple, out_dtype: torch.dtype) -> float:
    """max |y − y64| / error_bound for y [N, H·V] computed from `args` (as `random_inputs`
    returns them).  Where the bound is 0 (y64 = 0 exactly, e.g. g = 0: a bf16 draw of randn hits 0
    a few times in 5e7) y must be exact too.  inf where y is not finite."""
    if not torch.isfinite(y).all():
        return float("inf")
    if not y.numel():
        return 0.0
    diff = (y.double() - reference(*args)).abs()
    return float(torch.where(diff == 0, 0.0, diff / error_bound(*args, out_dtype)).max())


def check_mix_kernel(device: str = "cuda", sizes=(1, 17, 1280, 16384),
                     configs=((16, 96, 192, 4), (4, 24, 40, 2))) -> dict:
    """`mix_error` for every N in `sizes`, head config (H, K, V, T) in `configs`, input dtype
    (bf16, float32) and out_dtype (bf16, float32), each with a fresh seed.  Returns
    {(N, H, in, out): error / bound}; all ≤ 1 passes."""
    out = {}
    for H, K, V, T in configs:
        for N in sizes:
            for dt in (torch.bfloat16, torch.float32):
                for odt in (torch.bfloat16, torch.float32):
                    out[(N, H, str(dt)[6:], str(odt)[6:])] = mix_error(N, H, K, V, T, dt, odt, device)
    return out


# ----------------------------------------------------------------------------- benchmark

def bench_mix_kernel(device: str = "cuda", sizes=(16384, 1280), H: int = 16, K: int = 96, V: int = 192,
                     T: int = 4, configs=((8, 4), (4, 4), (16, 4), (16, 8), (2, 2))) -> dict:
    """Time the post-GLA part at the 3B head shape: bf16 q, k, v, g views of the projection and
    float32 o, bf16 output (N=1280 the decode width), float32 views at N=1280, and bf16 o at
    sizes[0] (`gla_prefill_inplace(out_dtype=bf16)`, which the engine does not use: BENCHMARKS S10).

    "torch": `mixer_post` (g upcast, as the prefill path) + reshape + cast to bf16; "triton BT/warps":
    `mixer_post_fused` per launch config.  Returns {f"{name} N={N} {dtype}": ms} plus a "ratio" row
    per shape: torch ms / the fastest Triton ms."""
    from export.torch_model import mixer_post

    out = {}
    cases = [(n, torch.bfloat16, torch.float32) for n in sizes] + [(1280, torch.float32, torch.float32)]
    for N, dt, odt in cases + [(sizes[0], torch.bfloat16, torch.bfloat16)]:    # last: the prefill GLA's bf16 o option
        q, k, v, g, o, a, w, eps = random_inputs(N, H, K, V, T, dt, device, o_dtype=odt)
        tag = f"N={N} {str(dt)[6:]}" + (" o bf16" if odt == torch.bfloat16 else "")
        out[f"torch {tag}"] = _time_ms(
            lambda: mixer_post(q, k, v, g.float(), o, a, w, eps).reshape(N, -1).to(torch.bfloat16))
        best = float("inf")
        for bt, warps in configs:
            ms = _time_ms(lambda: mixer_post_fused(q, k, v, g, o, a, w, eps, torch.bfloat16, bt, warps))
            out[f"triton BT={bt} warps={warps} {tag}"] = ms
            best = min(best, ms)
        out[f"ratio {tag}"] = out[f"torch {tag}"] / best
    return out


def _main(device: str) -> int:
    """Check, and on CUDA bench.  Exit status 1 when any check case is over its bound."""
    sizes = (1, 17, 1280, 16384) if device != "cpu" else (1, 17, 40)
    errs = check_mix_kernel(device, sizes)
    bad = 0
    for (N, H, dt, odt), e in errs.items():
        ok = e <= 1.0
        bad += not ok
        print(f"check N={N:5d} H={H:2d} in {dt:8s} out {odt:8s}: error / bound {e:.3f} {'ok' if ok else 'FAIL'}")
    if device != "cpu":
        for name, ms in bench_mix_kernel(device).items():
            print(f"bench {name}: {ms:.4f}" + ("x" if name.startswith("ratio") else " ms"))
    print("check: " + ("FAIL" if bad else "ok"))
    return 1 if bad else 0


if __name__ == "__main__":  # python -m export.mix_triton [cuda|cpu]  (cpu: TRITON_INTERPRET=1)
    import sys
    sys.exit(_main(sys.argv[1] if len(sys.argv) > 1 else "cuda"))
