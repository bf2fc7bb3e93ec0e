"""Error bounds, tolerances and check harnesses of export's Triton kernels (export/ops/), each against
an independent reference (export/reference.py: torch, or the float64 recurrence).

Importable without a GPU: the tests run these checks in Triton's CPU interpreter on CPU tensors,
benchmarks/serve_bench.py (phase b) and benchmarks/ops/bench_kernels.py on the GPU.  Every bound is
derived from the arithmetic (unit roundoffs and λ of laplace_jax.numerics), never read off a run.

decode GLA: `check_decode_kernel`; prefill GLA: `prefill_errors`, judged by `within_tolerance`
(`prefill_tolerance` + `output_rounding`); gated_mix: `gated_mix_error` (≤ 1 passes) against
`gated_mix_error_bound`, over a grid of shapes and dtypes by `check_gated_mix`.
"""
import math
import os
from typing import Optional

import torch

from export.ops import triton_switch
from export.ops.gated_mix import gated_mix_fused
from export.ops.gla_decode import gla_decode_inplace
from export.ops.gla_prefill import CHUNK, gla_prefill_inplace
from export.reference import gated_mix_float64, gla_float64, gla_step, split_heads
from laplace_jax.numerics import LAMBDA, U_BFLOAT16, U_FLOAT32, U_TF32, unit_roundoff

ULPS = 8.0         # allowance for one elementary function (exp, rsqrt, division: approx. on GPUs)


def check_g_gamma(H: int, device) -> torch.Tensor:
    """ln λ [H] float32 for the kernels' checks and benches: fast and slow heads, λ from 0.5 to
    ~0.9988 (the 3B model's range)."""
    return torch.tensor([-0.69 / (1 + 37 * i) for i in range(H)], dtype=torch.float32, device=device)


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def page_pool(num_slots: int, H: int, K: int, V: int, g: torch.Generator, device: str):
    """A state pool that is a strided view inside a page buffer (another state before it,
    padding after it, as vLLM lays out a layer's two states).  Returns (raw page buffer, pool)."""
    hkv = H * K * V
    raw = torch.randn(num_slots, 8 + hkv + 24, generator=g).to(device)
    return raw, raw[:, 8:8 + hkv].unflatten(1, (H, K, V))


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float32 tensor (NaN-aware exact comparison)."""
    return x.contiguous().view(torch.int32)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm().clamp(min=1e-300))


# ----------------------------------------------------------------------------- the decode GLA kernel

def check_decode_kernel(device: str = "cuda", H: int = 16, K: int = 96, V: int = 192,
                        rows: int = 300, num_slots: int = 400, pad_rows: int = 20, seed: int = 0) -> float:
    """Max abs error of `gla_decode_inplace` against torch `reference.gla_step` (o of the real rows, the
    updated pool rows of their slots, and all slots no row touches, which must stay unchanged).

    The pool is a strided view into a page buffer (as vLLM lays out a layer's two states); q, k, v
    are non-contiguous views of one projection (as the mixer splits them); `pad_rows` extra rows
    point at slot 0 with keep False (CUDA-graph padding) and are excluded from the comparison."""
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
    g_gamma = check_g_gamma(H, device)

    st = torch.where(keep[:rows].view(-1, 1, 1, 1), before[slots[:rows]], 0.0)
    want_o, want_s = gla_step(q[:rows], k[:rows], v[:rows], g_gamma, st)

    o = gla_decode_inplace(pool, slots, keep, q, k, v, g_gamma)
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


# ----------------------------------------------------------------------------- the prefill GLA kernel

def prefill_tolerance(precision: str, chunk: int = CHUNK, K: int = 96) -> float:
    """Relative error (‖out − ref‖ / ‖ref‖ per request) allowed against the float64 reference.

    ieee: every output element is a float32 sum of chunk + K products (scores · v, q · S) on top
    of a state that is itself such sums; for random-sign data a sum of n terms carries a relative
    error of about λ√n·u·(Σ|terms| / |sum|) ≈ λ·n·u (u = 2^-24, λ = 6: Higham & Mary's
    probabilistic bound, `laplace_jax.numerics`).
    tf32 / bf16: one operand of each product (the float32 scores, the state, the decayed keys) is
    rounded to 10 / 7 stored mantissa bits, at most 2^-10 / 2^-8 relative each (tf32 may truncate:
    its bias of up to 2^-11 does not average out over a sum).  Two such roundings stand in the
    chain of the inter-chunk part (the state's update, then q·S), one in the intra part; the
    bound allows four."""
    if precision == "ieee":
        return LAMBDA * (chunk + K) * U_FLOAT32
    # tf32: a truncation may cost a whole ulp, 2u; bf16: round to nearest, u
    return {"tf32": 4 * (2 * U_TF32), "bf16": 4 * U_BFLOAT16}[precision]


def output_rounding(dtype: torch.dtype) -> float:
    """The relative error o picks up when stored in `dtype`, per element and so in norm: add it to
    `prefill_tolerance` for o of that dtype (the final state stays float32).  A GPU rounds the cast
    to nearest: half an ulp, u = 2^-8 for bf16, 2^-11 for float16.  Triton's CPU interpreter (the
    tests) truncates it, `fp_downcast_rounding="rtne"` or not: a whole ulp, 2u (float32 → bf16 of
    random normals there: 7.7e-3 at most against u = 3.9e-3; with a bound of u, o in bf16 failed at
    seed 640168364: 4.12e-3, tests/serve/test_gla_prefill_chunked.py)."""
    u = unit_roundoff(dtype)
    return 2 * u if dtype != torch.float32 and triton_switch.interpreting() else u


def prefill_errors(device: str = "cuda", lengths=(1, 63, 64, 65, 200, 2048, 17, 128, 1000, 3),
                   H: int = 16, K: int = 96, V: int = 192, dtype: torch.dtype = torch.bfloat16,
                   precision: Optional[str] = None, chunk: int = CHUNK, num_slots: int = 24,
                   seed: Optional[int] = None, out_dtype: torch.dtype = torch.float32,
                   path: Optional[str] = None) -> dict:
    """Run `gla_prefill_inplace` once on random data and measure it against `reference.gla_float64`.

    Requests of `lengths` (packed, with a few unused rows at the end); every third one starts from
    zero (keep False) and its page is filled with NaN, which must not leak; slots are distinct,
    random, never 0, and the pool slots no request owns must stay bit-for-bit unchanged, as must
    the bytes of each page outside the pool view.  q, k, v are strided views of one projection.
    path: the kernel (`gla_prefill_inplace`'s; None: its rule).  Returns {"o", "state"}: the largest
    per-request relative error, {"changed"}: elements changed outside the requests' states, and the seed."""
    seed = fresh_seed() if seed is None else seed
    g = torch.Generator(device="cpu").manual_seed(seed)
    R = len(lengths)
    raw, pool = page_pool(num_slots, H, K, V, g, device)
    slots = (torch.randperm(num_slots - 1, generator=g)[:R] + 1).to(device)
    keep = (torch.arange(R) % 3 != 1).to(device)
    pool[slots[~keep]] = float("nan")
    raw_before = raw.clone()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device, dtype=torch.int32)
    T = int(cu[-1]) + 5
    proj = torch.randn(T, H * (2 * K + 2 * V), generator=g).to(device=device, dtype=dtype)
    q, k, v, _ = split_heads(proj, H, K, V)
    g_gamma = check_g_gamma(H, device)
    state0 = torch.where(keep.view(-1, 1, 1, 1), pool[slots], 0.0)
    want_o, want_s = gla_float64(q, k, v, g_gamma, state0, cu)

    o = gla_prefill_inplace(pool, slots, keep, q, k, v, g_gamma, cu, chunk, precision, out_dtype=out_dtype, path=path)
    assert o.dtype == out_dtype
    starts = cu.tolist()
    err_o = max(_rel(o[a:b], want_o[a:b]) for a, b in zip(starts[:-1], starts[1:]))
    err_s = max(_rel(pool[slots[r]], want_s[r]) for r in range(R))
    owned = torch.zeros(num_slots, dtype=torch.bool, device=device)
    owned[slots] = True
    other = torch.ones_like(raw, dtype=torch.bool)
    other[owned, 8:8 + H * K * V] = False                 # everything but the requests' states
    changed = int((_bits(raw)[other] != _bits(raw_before)[other]).sum())
    return {"o": err_o, "state": err_s, "changed": changed, "seed": seed}


def within_tolerance(e: dict, precision: str, out_dtype: torch.dtype = torch.float32,
                     chunk: int = CHUNK, K: int = 96) -> bool:
    """`prefill_errors`' result e is exact outside the states, its final states are within
    `prefill_tolerance` and o within that + `output_rounding(out_dtype)`."""
    tol = prefill_tolerance(precision, chunk, K)
    return not e["changed"] and e["state"] <= tol and e["o"] <= tol + output_rounding(out_dtype)


# ----------------------------------------------------------------------------- the gated_mix kernel

def gated_mix_error_bound(q, k, v, g, o, aug_balance, head_norm, eps, out_dtype: torch.dtype) -> torch.Tensor:
    """Per element of y [N, H·V]: how far a float32 evaluation (`reference.gated_mix`'s order) may be
    from the float64 one, first order in u = 2^-24, times 2 for the second-order terms; plus, for a
    16-bit out_dtype, one ulp of the final cast (≤ 2u(out_dtype)·|y|).

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
    u = U_FLOAT32
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
        bound = bound + 2 * unit_roundoff(out_dtype) * (y.abs().reshape(N, -1) + bound)
    return bound


def gated_mix_inputs(N: int, H: int = 16, K: int = 96, V: int = 192, T: int = 4,
                  dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
                  seed: Optional[int] = None, o_dtype: torch.dtype = torch.float32) -> tuple:
    """q, k, v, g as strided views of one [N + 3, H·(2K + 2V)] projection in `dtype` (as the mixer
    splits it; 3 extra rows so the views do not end the buffer), o [N, H, V] in o_dtype (a strided
    view too), aug_balance [H, K], head_norm [T, V] float32 (random, not the ones/zeros of a fresh
    model), eps.  Returns (q, k, v, g, o, aug_balance, head_norm, eps)."""
    g_ = torch.Generator(device="cpu").manual_seed(fresh_seed() if seed is None else seed)
    proj = torch.randn(N + 3, H * (2 * K + 2 * V), generator=g_).to(device=device, dtype=dtype)[:N]
    q, k, v, g = split_heads(proj, H, K, V)
    o = torch.randn(N, H, V + 5, generator=g_).to(device=device, dtype=o_dtype)[..., 2:2 + V]
    aug_balance = (0.3 * torch.randn(H, K, generator=g_)).to(device)
    head_norm = (1 + 0.2 * torch.randn(T, V, generator=g_)).to(device)
    return q, k, v, g, o, aug_balance, head_norm, 1e-5


def gated_mix_error(N: int, H: int = 16, K: int = 96, V: int = 192, T: int = 4,
              dtype: torch.dtype = torch.bfloat16, out_dtype: torch.dtype = torch.bfloat16,
              device: str = "cuda", seed: Optional[int] = None, o_dtype: torch.dtype = torch.float32) -> float:
    """max |y − y64| / gated_mix_error_bound over y [N, H·V] for `gated_mix_fused` on `gated_mix_inputs`:
    ≤ 1 passes.  inf where y is not finite."""
    args = gated_mix_inputs(N, H, K, V, T, dtype, device, seed, o_dtype)
    return gated_mix_error_ratio(gated_mix_fused(*args, out_dtype), args, out_dtype)


def gated_mix_error_ratio(y: torch.Tensor, args: tuple, out_dtype: torch.dtype) -> float:
    """max |y − y64| / gated_mix_error_bound for y [N, H·V] computed from `args` (as `gated_mix_inputs`
    returns them).  Where the bound is 0 (y64 = 0 exactly, e.g. g = 0: a bf16 draw of randn hits 0
    a few times in 5e7) y must be exact too.  inf where y is not finite."""
    if not torch.isfinite(y).all():
        return float("inf")
    if not y.numel():
        return 0.0
    diff = (y.double() - gated_mix_float64(*args)).abs()
    return float(torch.where(diff == 0, 0.0, diff / gated_mix_error_bound(*args, out_dtype)).max())


def check_gated_mix(device: str = "cuda", sizes=(1, 17, 1280, 16384),
                    configs=((16, 96, 192, 4), (4, 24, 40, 2))) -> dict:
    """`gated_mix_error` for every N in `sizes`, head config (H, K, V, T) in `configs`, input dtype
    (bf16, float32) and out_dtype (bf16, float32), each with a fresh seed.  Returns
    {(N, H, in, out): error / bound}; all ≤ 1 passes."""
    out = {}
    for H, K, V, T in configs:
        for N in sizes:
            for dt in (torch.bfloat16, torch.float32):
                for odt in (torch.bfloat16, torch.float32):
                    out[(N, H, str(dt)[6:], str(odt)[6:])] = gated_mix_error(N, H, K, V, T, dt, odt, device)
    return out
