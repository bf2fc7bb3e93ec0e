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
e^{γ(n-1-j)} would be a positive exponent).

Precision: the state and every accumulation are float32.  `precision` picks the operands of the
three products that involve float32 intermediates (the masked scores, the state, the decayed keys):
"ieee" (the default for float32 inputs; parity with the JAX float32 model), "bf16" (the default for
bf16 inputs: those operands rounded to bf16, as JAX's own `ops.gla.chunk_simple_gla` and fla's
`chunk_simple_gla` do for bf16 models; 2.4x faster than tf32 on an H200, BENCHMARKS run S8) or
"tf32" (10 mantissa bits; the default for float16 inputs).  q k^T of bf16 inputs is always a bf16
product: exact products, float32 sums.  `prefill_errors` measures each against float64.

Two launch paths, the same math: this module's kernel walks each request's chunks in series (grid
(request, head, value block): the throughput path); export/ops/gla_prefill_chunked.py spreads the
chunks over the grid (for few requests, whose serial grid would leave SMs idle).
`gla_prefill_inplace` picks by `gla_prefill_chunked.prefill_path` from host integers (no sync).

`prefill_errors()` compares against a float64 step recurrence (`within_tolerance` judges it);
`bench_prefill_kernel()` times it against the torch path (gather + `gla_chunked` + scatter).
`python -m export.gla_prefill_triton cuda` runs both (TRITON_INTERPRET=1 ... cpu runs the check on
CPU tensors).
"""
import contextlib
import os
from typing import Iterator, Optional

import torch

# available / enabled: one switch for all Triton paths
from export.gla_triton import _rowmajor, available, check_gamma, enabled, triton, tl  # noqa: F401
from export.ops.launch_keys import Launch, run

# H200, K=96 (padded to 128), V=192: BV=64 gives R*H*3 programs (384 for 8 requests, ~3 per SM of
# 132) with a [128, 64] float32 state (64 registers a thread at 4 warps) next to the [64, 64] score
# and output tiles; BV=32 would double the programs but recompute q k^T six times per chunk.
# Stages: the loads of the next chunk's q, k, v are multi-buffered in shared memory (40 KB a stage
# for bf16 at BT=64; 80 KB for float32, which therefore gets one stage to stay under 227 KB with
# the dot operands' staging).  bf16 takes three: 0.273 ms against 0.321 with two at 8 x 2,048
# tokens (H200, BENCHMARKS run S8); 8 warps, BV 32 or 128, and 32- or 128-token chunks were slower.
BLOCK_V = 64
NUM_WARPS = 4
CHUNK = 64
_MODES = {"ieee": 0, "tf32": 1, "bf16": 2}

if triton is not None:
    @triton.jit
    def _mm(a, b, MODE: tl.constexpr, EMULATE: tl.constexpr):
        """a @ b with float32 accumulation; operands cast per MODE (0 ieee, 1 tf32, 2 bf16).
        EMULATE: the CPU interpreter, whose dot cannot take bf16 operands: round them to bf16 and
        multiply in float32 (the same products: a product of two bf16 values is exact in float32)."""
        if MODE == 2 and EMULATE:
            c = tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32),
                       input_precision="ieee")
        elif MODE == 2:
            c = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
        elif MODE == 1:
            c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32")
        else:
            c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return c

    @triton.jit
    def _head_rows(ptr, rows, s_t, h, s_h, cols, mt, mc):
        """ptr[rows, h, cols] as a [rows, cols] tile (masked rows and columns read as 0)."""
        return tl.load(ptr + rows[:, None] * s_t + h * s_h + cols[None, :], mask=mt[:, None] & mc[None, :], other=0.0)

    @triton.jit
    def _chunk_decays(g, rt):
        """The decays inside a chunk that do not depend on it: [i >= j] e^{γ(i-j)} [BT, BT] and
        e^{γ(i+1)} [BT] (all exponents <= 0)."""
        diff = (rt[:, None] - rt[None, :]).to(tl.float32)
        return tl.where(diff >= 0, tl.exp(g * tl.maximum(diff, 0.0)), 0.0), tl.exp(g * (rt + 1).to(tl.float32))

    @triton.jit
    def _chunk_state(k, v, g, n, rt, MODE: tl.constexpr, EMULATE: tl.constexpr):
        """A chunk's contribution to the state after it, (k ⊙ [j < n] e^{γ(n-1-j)})^T v [BK, BV]
        (n real tokens; a padding row's weight is a select: its exponent would be positive)."""
        pos = rt.to(tl.float32)
        kdec = tl.where(pos < n, tl.exp(g * tl.maximum(n - 1.0 - pos, 0.0)), 0.0)
        return _mm(tl.trans(k.to(tl.float32) * kdec[:, None]), v, MODE, EMULATE)

    @triton.jit
    def _chunk_output(q, k, v, s, dmask, qdec, QK_MODE: tl.constexpr, MODE: tl.constexpr,
                      EMULATE: tl.constexpr):
        """((q k^T) ⊙ dmask) v + qdec ⊙ (q S), S the state entering the chunk [BT, BV]."""
        att = _mm(q, tl.trans(k), QK_MODE, EMULATE) * dmask
        return _mm(att, v, MODE, EMULATE) + _mm(q, s, MODE, EMULATE) * qdec[:, None]

    # the per-request index arrays are read once per program: their pointers' 16-byte alignment
    # (a slice of the step's arrays starts anywhere) must not make a compile variant
    @triton.jit(do_not_specialize_on_alignment=["slots_ptr", "keep_ptr", "cu_ptr"])
    def _gla_prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, pool_ptr, slots_ptr, keep_ptr, cu_ptr, gamma_ptr,
                            sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h,
                            sp_slot, sp_h, sp_k, sp_v,
                            scale,
                            K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            BT: tl.constexpr, QK_MODE: tl.constexpr, MODE: tl.constexpr,
                            EMULATE: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        vb = tl.program_id(2)
        bos = tl.load(cu_ptr + r).to(tl.int64)
        eos = tl.load(cu_ptr + r + 1).to(tl.int64)
        slot = tl.load(slots_ptr + r).to(tl.int64)
        keep = tl.load(keep_ptr + r)
        g = tl.load(gamma_ptr + h).to(tl.float32)

        rk = tl.arange(0, BK)
        rv = vb * BV + tl.arange(0, BV)
        rt = tl.arange(0, BT)
        mk = rk < K
        mv = rv < V
        dmask, qdec = _chunk_decays(g, rt)

        s_ptrs = pool_ptr + slot * sp_slot + h * sp_h + rk[:, None] * sp_k + rv[None, :] * sp_v
        s_mask = mk[:, None] & mv[None, :]
        s = tl.load(s_ptrs, mask=s_mask, other=0.0)
        # a select, not a product: a reused page may hold anything, NaN included
        s = tl.where(keep != 0, s, 0.0)

        for t0 in range(bos, eos, BT):
            rows = t0 + rt
            mt = rows < eos
            n = tl.minimum(eos - t0, BT).to(tl.float32)                  # real tokens here
            q = _head_rows(q_ptr, rows, sq_t, h, sq_h, rk, mt, mk)
            k = _head_rows(k_ptr, rows, sk_t, h, sk_h, rk, mt, mk)
            v = _head_rows(v_ptr, rows, sv_t, h, sv_h, rv, mt, mv)
            o = _chunk_output(q, k, v, s, dmask, qdec, QK_MODE, MODE, EMULATE)     # uses S entering the chunk
            tl.store(o_ptr + rows[:, None] * so_t + h * so_h + rv[None, :],
                     (o * scale).to(o_ptr.dtype.element_ty), mask=mt[:, None] & mv[None, :])
            s = tl.exp(g * n) * s + _chunk_state(k, v, g, n, rt, MODE, EMULATE)

        tl.store(s_ptrs, s, mask=s_mask)


def default_precision(dtype: torch.dtype) -> str:
    """The products' precision `gla_prefill_inplace` uses for q, k, v of `dtype` (the module doc)."""
    return {torch.float32: "ieee", torch.bfloat16: "bf16"}.get(dtype, "tf32")


def _modes(dtype: torch.dtype, precision: Optional[str]) -> tuple:
    """(QK_MODE, MODE) for inputs of `dtype`.  MODE: `precision`, by default ieee for float32
    inputs, bf16 for bf16 ones (JAX's chunked GLA rounds the same operands to the input dtype) and
    tf32 for float16 (whose 5 exponent bits would not hold the decayed state).  q k^T of 16-bit
    inputs uses operands they are exact in: bf16 for bf16, tf32 (11 significant bits) for float16."""
    low = dtype != torch.float32
    precision = precision or default_precision(dtype)
    if precision not in _MODES:
        raise ValueError(f"precision={precision!r}: want one of {sorted(_MODES)}")
    mode = _MODES[precision]
    if not low:
        return mode, mode
    return (_MODES["bf16"] if dtype == torch.bfloat16 else _MODES["tf32"]), mode


def gla_prefill_inplace(pool: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor, q: torch.Tensor,
                        k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor, cu_seqlens: torch.Tensor,
                        chunk: int = CHUNK, precision: Optional[str] = None,
                        block_v: int = BLOCK_V, num_warps: int = NUM_WARPS,
                        num_stages: Optional[int] = None,
                        out_dtype: torch.dtype = torch.float32, path: Optional[str] = None) -> torch.Tensor:
    """Chunked GLA over the packed prefill tokens of R requests, continuing from and writing back
    their states in the pool.

    pool [num_slots, H, K, V] float32 (any strides; updated in place at the R slots); slots [R]
    integer (distinct for real requests); keep [R] bool (False: start from zero); q, k [T, H, K],
    v [T, H, V] (float32 or bf16, one dtype; views with last-dim stride 1 are used as they are);
    gamma [H] (ln λ, <= 0); cu_seqlens [R + 1] integer, nondecreasing, cu_seqlens[R] <= T.
    chunk: tokens per step, a power of 2 >= 16 (tensor-core tile); precision: see the module doc;
    block_v, num_warps, num_stages (None: by dtype): launch settings.  path: "serial" (this module's
    kernel), "chunked" (export/ops/gla_prefill_chunked.py, chunks in parallel) or None: by
    `gla_prefill_chunked.prefill_path` from R, T and the shapes (or `forced_path`).  Returns o [T, H, V] in
    out_dtype (float32, or q's dtype as JAX's chunk_simple_gla returns it: one rounding of the
    float32 result; rows outside every request are left uninitialised)."""
    if triton is None:
        raise RuntimeError("export.gla_prefill_triton: triton is not installed")
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
    o = torch.empty((T, H, V), device=q.device, dtype=out_dtype)
    if R == 0 or T == 0:
        return o
    from export.ops import gla_prefill_chunked as chunked   # it imports this module's _mm, _modes
    path = path or _forced_path or chunked.prefill_path(R, T, H, K, V, chunk, chunked.sm_count(q.device), block_v)
    if path not in ("serial", "chunked"):
        raise ValueError(f"path={path!r}: want 'serial', 'chunked' or None")
    q, k, v = _rowmajor(q), _rowmajor(k), _rowmajor(v)
    gamma = gamma.to(device=q.device, dtype=torch.float32).contiguous()
    cu_seqlens = cu_seqlens.to(torch.int32).contiguous()   # index dtypes fixed: one compile variant
    slots = slots.to(torch.long).contiguous()
    if path == "chunked":
        return chunked.gla_prefill_chunked(pool, slots, keep, q, k, v, gamma, cu_seqlens, o, chunk, precision,
                                           block_v, num_warps, num_stages)
    BK = max(16, triton.next_power_of_2(K))
    BV = max(16, min(block_v, triton.next_power_of_2(V)))
    grid = (R, H, triton.cdiv(V, BV))
    run(Launch(_gla_prefill_kernel, grid, (
        q, k, v, o, pool, slots, keep.to(torch.int8).contiguous(), cu_seqlens, gamma,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1),
        pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(3),
        float(K) ** -0.5),
        dict(K=K, V=V, BK=BK, BV=BV, BT=chunk, QK_MODE=qk_mode, MODE=mode,
             EMULATE=os.environ.get("TRITON_INTERPRET") == "1", num_warps=num_warps,
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


# ----------------------------------------------------------------------------- reference and check

def gla_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor,
                  state0: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple:
    """The step recurrence in float64, all requests at once (padded to the longest).

    q, k [T, H, K]; v [T, H, V]; gamma [H]; state0 [R, H, K, V] (the states the requests start
    from); cu_seqlens [R + 1].  Returns (o [T, H, V] float64, zero outside every request; final
    states [R, H, K, V] float64)."""
    T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    cu = cu_seqlens.to(device=dev, dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    R = lens.shape[0]
    L = int(lens.max()) if R else 0
    t = torch.arange(L, device=dev)
    tok = (cu[:-1, None] + t).clamp(max=max(T - 1, 0))               # [R, L]
    valid = t[None, :] < lens[:, None]
    qg, kg, vg = q.double()[tok], k.double()[tok], v.double()[tok]   # [R, L, H, *]
    lam = torch.exp(gamma.double().to(dev)).view(1, H, 1, 1)
    s = state0.double().clone()
    o = torch.zeros(R, L, H, V, device=dev, dtype=torch.float64)
    for i in range(L):
        upd = lam * s + kg[:, i, :, :, None] * vg[:, i, :, None, :]
        s = torch.where(valid[:, i].view(R, 1, 1, 1), upd, s)
        o[:, i] = torch.einsum("rhk,rhkv->rhv", qg[:, i], s) * K ** -0.5
    out = torch.zeros(T, H, V, device=dev, dtype=torch.float64)
    out[tok[valid]] = o[valid]
    return out, s


def tolerance(precision: str, chunk: int = CHUNK, K: int = 96) -> float:
    """Relative error (‖out − ref‖ / ‖ref‖ per request) allowed against the float64 reference.

    ieee: every output element is a float32 sum of chunk + K products (scores · v, q · S) on top
    of a state that is itself such sums; for random-sign data a sum of n terms carries a relative
    error of about λ√n·u·(Σ|terms| / |sum|) ≈ λ·n·u (u = 2^-24, λ = 6: Higham & Mary's
    probabilistic bound, as tests/conftest.f32_sum_err).
    tf32 / bf16: one operand of each product (the float32 scores, the state, the decayed keys) is
    rounded to 10 / 7 stored mantissa bits, at most 2^-10 / 2^-8 relative each (tf32 may truncate:
    its bias of up to 2^-11 does not average out over a sum).  Two such roundings stand in the
    chain of the inter-chunk part (the state's update, then q·S), one in the intra part; the
    bound allows four."""
    if precision == "ieee":
        return 6.0 * (chunk + K) * 2.0 ** -24
    return {"tf32": 4 * 2.0 ** -10, "bf16": 4 * 2.0 ** -8}[precision]


def output_rounding(dtype: torch.dtype) -> float:
    """The relative error o picks up when stored in `dtype` (round to nearest: half an ulp, at
    most u = 2^-8 for bf16, 2^-11 for float16, relative per element and so in norm): add it to
    `tolerance` for o of that dtype (the final state stays float32)."""
    return {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _page_pool(num_slots: int, H: int, K: int, V: int, g: torch.Generator, device: str):
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


def prefill_errors(device: str = "cuda", lengths=(1, 63, 64, 65, 200, 2048, 17, 128, 1000, 3),
                   H: int = 16, K: int = 96, V: int = 192, dtype: torch.dtype = torch.bfloat16,
                   precision: Optional[str] = None, chunk: int = CHUNK, num_slots: int = 24,
                   seed: Optional[int] = None, out_dtype: torch.dtype = torch.float32,
                   path: Optional[str] = None) -> dict:
    """Run `gla_prefill_inplace` once on random data and measure it against `gla_reference`.

    Requests of `lengths` (packed, with a few unused rows at the end); every third one starts from
    zero (keep False) and its page is filled with NaN, which must not leak; slots are distinct,
    random, never 0, and the pool slots no request owns must stay bit-for-bit unchanged, as must
    the bytes of each page outside the pool view.  q, k, v are strided views of one projection.
    path: the kernel (`gla_prefill_inplace`'s; None: its rule).  Returns {"o", "state"}: the largest
    per-request relative error, {"changed"}: elements changed outside the requests' states, and the seed."""
    from export.torch_model import split_heads

    seed = _fresh_seed() if seed is None else seed
    g = torch.Generator(device="cpu").manual_seed(seed)
    R = len(lengths)
    raw, pool = _page_pool(num_slots, H, K, V, g, device)
    slots = (torch.randperm(num_slots - 1, generator=g)[:R] + 1).to(device)
    keep = (torch.arange(R) % 3 != 1).to(device)
    pool[slots[~keep]] = float("nan")
    raw_before = raw.clone()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device, dtype=torch.int32)
    T = int(cu[-1]) + 5
    proj = torch.randn(T, H * (2 * K + 2 * V), generator=g).to(device=device, dtype=dtype)
    q, k, v, _ = split_heads(proj, H, K, V)
    gamma = check_gamma(H, device)
    state0 = torch.where(keep.view(-1, 1, 1, 1), pool[slots], 0.0)
    want_o, want_s = gla_reference(q, k, v, gamma, state0, cu)

    o = gla_prefill_inplace(pool, slots, keep, q, k, v, gamma, cu, chunk, precision, out_dtype=out_dtype, path=path)
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
    `tolerance` and o within `tolerance` + `output_rounding(out_dtype)`."""
    tol = tolerance(precision, chunk, K)
    return not e["changed"] and e["state"] <= tol and e["o"] <= tol + output_rounding(out_dtype)


# ----------------------------------------------------------------------------- benchmark

def _time_ms(fn, warmup: int = 3, reps: int = 20) -> float:
    """Median wall time of fn() in ms, by CUDA events around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def bench_prefill_kernel(device: str = "cuda", requests: int = 8, length: int = 2048, H: int = 16,
                         K: int = 96, V: int = 192,
                         configs=((64, 4, 2, "tf32", 64), (64, 4, 2, "bf16", 64), (64, 4, 3, "bf16", 64),
                                  (64, 8, 2, "bf16", 64), (32, 4, 2, "bf16", 64), (128, 8, 2, "bf16", 64),
                                  (64, 8, 2, "bf16", 128), (64, 4, 2, "bf16", 32))) -> dict:
    """Time the prefill GLA of `requests` × `length` bf16 tokens (the 3B shape).

    "torch": the current vLLM path: gather the states by slot, `gla_chunked` on the float32 q, k, v
    (the float32 copies the mixer makes anyway for mixer_post are not counted), scatter back.
    "triton BV/warps/stages/precision/chunk": `gla_prefill_inplace` on bf16 strided views, per config.
    Returns {name: ms} plus "ratio": torch ms / the fastest Triton ms."""
    from export.torch_model import gla_chunked, split_heads

    g = torch.Generator(device="cpu").manual_seed(_fresh_seed())
    T = requests * length
    _, pool = _page_pool(requests + 1, H, K, V, g, device)
    slots = torch.arange(1, requests + 1, device=device)
    keep = torch.ones(requests, dtype=torch.bool, device=device)
    cu = torch.arange(0, T + 1, length, device=device, dtype=torch.int32)
    proj = torch.randn(T, H * (2 * K + 2 * V), generator=g).to(device=device, dtype=torch.bfloat16)
    q, k, v, _ = split_heads(proj, H, K, V)
    gamma = check_gamma(H, device)
    q32, k32, v32 = (x.float().view(requests, length, H, -1) for x in (q, k, v))

    def torch_path():
        st = torch.where(keep.view(-1, 1, 1, 1), pool[slots], 0.0)
        _, st = gla_chunked(q32, k32, v32, gamma, st, CHUNK)
        pool[slots] = st

    out = {"torch": _time_ms(torch_path)}
    for bv, warps, stages, prec, chunk in configs:
        name = f"triton BV={bv} warps={warps} stages={stages} {prec} chunk={chunk}"
        for label, odt in ((name, torch.float32), (name + " o bf16", torch.bfloat16)):
            try:
                out[label] = _time_ms(lambda: gla_prefill_inplace(
                    pool, slots, keep, q, k, v, gamma, cu, chunk, prec, bv, warps, stages, out_dtype=odt))
            except Exception as e:  # noqa: BLE001 - a setting that does not compile or fit (shared memory): report, go on
                print(f"bench {label}: {e}")
                out[label] = float("nan")
    out["ratio"] = out["torch"] / min(t for name, t in out.items() if name.startswith("triton") and t == t)
    return out


def _main(device: str) -> int:
    """Check (float32 ieee, bf16 tf32, bf16 bf16) and, on CUDA, bench.  Exit status 1 when a check
    is over its tolerance."""
    small = {} if device != "cpu" else dict(lengths=(1, 63, 64, 65, 130, 7), H=2)
    bad = 0
    for dtype, prec, odt in ((torch.float32, "ieee", torch.float32), (torch.bfloat16, "tf32", torch.float32),
                             (torch.bfloat16, "bf16", torch.float32), (torch.bfloat16, "bf16", torch.bfloat16)):
        e = prefill_errors(device, dtype=dtype, precision=prec, out_dtype=odt, **small)
        ok = within_tolerance(e, prec, odt)
        bad += not ok
        print(f"check {str(dtype)[6:]:8s} {prec} o in {str(odt)[6:]}: rel err o {e['o']:.2e} "
              f"state {e['state']:.2e} (tolerance {tolerance(prec):.1e}, o + {output_rounding(odt):.1e}), "
              f"changed outside {e['changed']}, seed {e['seed']}: {'ok' if ok else 'FAIL'}")
    if device != "cpu":
        for name, ms in bench_prefill_kernel(device).items():
            print(f"bench {name}: {ms:.3f}" + ("x" if name == "ratio" else " ms"))
    return 1 if bad else 0


if __name__ == "__main__":  # python -m export.gla_prefill_triton [cuda|cpu]  (cpu: TRITON_INTERPRET=1)
    import sys
    sys.exit(_main(sys.argv[1] if len(sys.argv) > 1 else "cuda"))
