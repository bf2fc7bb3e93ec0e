"""Chunked Simple GLA as four Pallas (Triton) kernels with a hand-written backward, for NVIDIA GPUs.

Same math and layout as `ops.gla.chunk_simple_gla` (q, k: [B, T, H, K]; v: [B, T, H, V]; g_gamma: [H];
state [B, H, K, V] float32), but each chunk stays on chip instead of the XLA form's separate
products, masks and casts round-tripping HBM:

    forward   1. states:  grid (B, H, K/bk, V/bv), a loop over the chunks carrying S_c in registers,
                 writing each chunk's entering state S_c (input dtype) and the final state (f32);
              2. output:  grid (B, H, N), o_c = scale [(q_c k_cᵀ ⊙ D) v_c + (q_c ⊙ e^{b}) S_c].
    backward  3. dstates: grid (B, H, K/bk, V/bv), the chunks in reverse, writing dS_{c+1};
              4. dq, dk, dv: grid (B, H, N) from q, k, v, do, S_c and dS_{c+1}.

Triton needs power-of-two tiles, so K and V (96 and 192 in the 3B model) are cut into power-of-two
pieces (64 + 32, 128 + 64) and every product is a short static sum of tile products. `g_gamma` is a
fixed decay (Laplace never trains it): its cotangent is zero, as for fla's `g_gamma`. T must be a
multiple of the chunk size; `supported` says whether a shape can run here.

`interpret=True` runs the same kernels through Pallas' interpreter (CPU tests).
"""
from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

Array = jax.Array
F32 = jnp.float32

# (state-kernel warps, chunk-kernel warps, state-kernel pipeline stages); the chunk kernels hold
# [C, C] f32 tiles, the state kernels loop over the chunks.
LAUNCH = (4, 8, 2)  # H200, B=8 T=2048 H=16 K=96 V=192: 1.09 ms fwd+bwd vs 1.27 ms at 1 stage (BENCHMARKS.md)


def _pieces(n: int) -> tuple[tuple[int, int], ...]:
    """Power-of-two (start, width) pieces covering range(n), largest first: 96 → (0, 64), (64, 32)."""
    out, start = [], 0
    for bit in reversed(range(n.bit_length())):
        w = 1 << bit
        if n & w:
            out.append((start, w))
            start += w
    return tuple(out)


def _state_block(n: int, cap: int = 64) -> int:
    """Largest power of two dividing n, at most cap: the state kernels' tile along K or V."""
    return min(n & -n, cap)


def supported(T: int, K: int, V: int, chunk_size: int) -> str | None:
    """None when the kernels can run this shape, else the reason (one line)."""
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        return f"chunk_size={chunk_size} must be a power of two >= 16"
    if T % chunk_size:
        return f"T={T} is not a multiple of chunk_size={chunk_size}"
    if K % 16 or V % 16:
        return f"head dims K={K}, V={V} must be multiples of 16"
    return None


def _dot(a: Array, b: Array, ta: bool = False, tb: bool = False) -> Array:
    """a @ b (optionally transposed operands) with float32 accumulation."""
    dims = (((0,) if ta else (1,), (1,) if tb else (0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=F32)


def _sum(terms) -> Array:
    """Sum of a short static list of tiles (no 0 + tile, which would add a scalar broadcast)."""
    return functools.reduce(operator.add, terms)


def _decays(g: Array, C: int) -> tuple[Array, Array, Array]:
    """Per-position decays of one head: D [C, C] (e^{γ(i-j)}, i >= j), e^{γ(i+1)} [C], e^{γ(C-1-i)} [C]."""
    i = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    diff = (i - j).astype(F32)
    D = jnp.where(i >= j, jnp.exp(g * jnp.maximum(diff, 0.0)), 0.0)
    pos = jax.lax.broadcasted_iota(jnp.int32, (C,), 0).astype(F32)
    return D, jnp.exp(g * (pos + 1.0)), jnp.exp(g * (C - 1.0 - pos))


# ---- kernels ---------------------------------------------------------------------------------------

def _states_kernel(g_ref, a_ref, b_ref, s0_ref, ss_ref, sT_ref, *, C: int, N: int, reverse: bool,
                   scale: float):
    """Forward: S_{c+1} = e^{γC} S_c + (k_c ⊙ e^{γ(C-1-i)})ᵀ v_c, ss[c] = S_c  (a = k, b = v).
    Backward: dS_c = e^{γC} dS_{c+1} + scale (q_c ⊙ e^{γ(i+1)})ᵀ do_c, ss[c] = dS_{c+1}  (a = q, b = do)."""
    g = g_ref[pl.program_id(1)]
    pos = jax.lax.broadcasted_iota(jnp.int32, (C,), 0).astype(F32)
    row = scale * jnp.exp(g * (pos + 1.0)) if reverse else jnp.exp(g * (C - 1.0 - pos))
    lam = jnp.exp(g * C)

    def body(step, s):
        c = N - 1 - step if reverse else step
        ss_ref[c] = s.astype(ss_ref.dtype)
        a = a_ref[pl.ds(c * C, C), :]
        a = (a.astype(F32) * row[:, None]).astype(a.dtype)
        return lam * s + _dot(a, b_ref[pl.ds(c * C, C), :], ta=True)

    sT_ref[...] = jax.lax.fori_loop(0, N, body, s0_ref[...].astype(F32))


def _out_kernel(g_ref, q_ref, k_ref, v_ref, s_ref, o_ref, *, C: int, kp, vp, scale: float):
    """o_c = scale [(q_c k_cᵀ ⊙ D) v_c + (q_c ⊙ e^{γ(i+1)}) S_c] for one (b, h, c)."""
    g = g_ref[pl.program_id(1)]
    D, qdec, _ = _decays(g, C)
    cdt = v_ref.dtype
    q = [q_ref[:, ks:ks + kw] for ks, kw in kp]
    scores = _sum(_dot(qi, k_ref[:, ks:ks + kw], tb=True) for qi, (ks, kw) in zip(q, kp))
    p = (scores * D).astype(cdt)
    qd = [(qi.astype(F32) * qdec[:, None]).astype(cdt) for qi in q]
    for vs, vw in vp:
        acc = _dot(p, v_ref[:, vs:vs + vw])
        for qdi, (ks, kw) in zip(qd, kp):
            acc += _dot(qdi, s_ref[ks:ks + kw, vs:vs + vw])
        o_ref[:, vs:vs + vw] = (scale * acc).astype(o_ref.dtype)


def _grad_kernel(g_ref, q_ref, k_ref, v_ref, do_ref, s_ref, ds_ref, dq_ref, dk_ref, dv_ref, *,
                 C: int, kp, vp, scale: float):
    """dq, dk, dv of one chunk from its entering state S_c (s) and dS_{c+1} (ds, scale included):
        dq = scale [(do vᵀ ⊙ D) k + e^{γ(i+1)} ⊙ (do S_cᵀ)]
        dk = scale (do vᵀ ⊙ D)ᵀ q + e^{γ(C-1-i)} ⊙ (v dS_{c+1}ᵀ)
        dv = scale (q kᵀ ⊙ D)ᵀ do + (k ⊙ e^{γ(C-1-i)}) dS_{c+1}."""
    g = g_ref[pl.program_id(1)]
    D, qdec, kdec = _decays(g, C)
    cdt = v_ref.dtype
    q = [q_ref[:, ks:ks + kw] for ks, kw in kp]
    k = [k_ref[:, ks:ks + kw] for ks, kw in kp]
    v = [v_ref[:, vs:vs + vw] for vs, vw in vp]
    do = [do_ref[:, vs:vs + vw] for vs, vw in vp]
    p = (_sum(_dot(qi, ki, tb=True) for qi, ki in zip(q, k)) * D).astype(cdt)     # [C, C]
    a = (_sum(_dot(di, vi, tb=True) for di, vi in zip(do, v)) * D).astype(cdt)    # [C, C]
    for (ks, kw), qi, ki in zip(kp, q, k):
        s_do = _sum(_dot(di, s_ref[ks:ks + kw, vs:vs + vw], tb=True) for di, (vs, vw) in zip(do, vp))
        dq_ref[:, ks:ks + kw] = (scale * (_dot(a, ki) + qdec[:, None] * s_do)).astype(dq_ref.dtype)
        v_ds = _sum(_dot(vi, ds_ref[ks:ks + kw, vs:vs + vw], tb=True) for vi, (vs, vw) in zip(v, vp))
        dk_ref[:, ks:ks + kw] = (scale * _dot(a, qi, ta=True) + kdec[:, None] * v_ds).astype(dk_ref.dtype)
    kd = [(ki.astype(F32) * kdec[:, None]).astype(cdt) for ki in k]
    for (vs, vw), di in zip(vp, do):
        acc = scale * _dot(p, di, ta=True)
        for kdi, (ks, kw) in zip(kd, kp):
            acc += _dot(kdi, ds_ref[ks:ks + kw, vs:vs + vw])
        dv_ref[:, vs:vs + vw] = acc.astype(dv_ref.dtype)


# ---- pallas_call wrappers --------------------------------------------------------------------------

def _params(warps: int, stages: int = 1) -> plt.CompilerParams:
    return plt.CompilerParams(num_warps=warps, num_stages=stages)


def _states(g, a, b, s0, C: int, reverse: bool, scale: float, interpret: bool, warps: int, stages: int
            ) -> tuple[Array, Array]:
    """Run the state recurrence. a: [B, T, H, K], b: [B, T, H, V] → (ss [B, H, N, K, V] in b's dtype, sT f32)."""
    B, T, H, K = a.shape
    V = b.shape[-1]
    N = T // C
    bk, bv = _state_block(K), _state_block(V)
    kern = functools.partial(_states_kernel, C=C, N=N, reverse=reverse, scale=scale)
    return pl.pallas_call(
        kern,
        grid=(B, H, K // bk, V // bv),
        in_specs=[
            pl.BlockSpec((H,), lambda b_, h, i, j: (0,)),
            pl.BlockSpec((None, T, None, bk), lambda b_, h, i, j: (b_, 0, h, i)),
            pl.BlockSpec((None, T, None, bv), lambda b_, h, i, j: (b_, 0, h, j)),
            pl.BlockSpec((None, None, bk, bv), lambda b_, h, i, j: (b_, h, i, j)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, N, bk, bv), lambda b_, h, i, j: (b_, h, 0, i, j)),
            pl.BlockSpec((None, None, bk, bv), lambda b_, h, i, j: (b_, h, i, j)),
        ],
        out_shape=[jax.ShapeDtypeStruct((B, H, N, K, V), b.dtype), jax.ShapeDtypeStruct((B, H, K, V), F32)],
        compiler_params=_params(warps, stages),
        interpret=interpret,
        name="gla_states_bwd" if reverse else "gla_states_fwd",
    )(g, a, b, s0)


def _chunk_specs(B: int, H: int, C: int, K: int, V: int, n_qk: int, n_v: int, n_s: int):
    """BlockSpecs of the per-chunk kernels: g, then n_qk [B,T,H,K] tiles, n_v [B,T,H,V], n_s states."""
    qk = pl.BlockSpec((None, C, None, K), lambda b, h, c: (b, c, h, 0))
    vv = pl.BlockSpec((None, C, None, V), lambda b, h, c: (b, c, h, 0))
    st = pl.BlockSpec((None, None, None, K, V), lambda b, h, c: (b, h, c, 0, 0))
    return [pl.BlockSpec((H,), lambda b, h, c: (0,))] + [qk] * n_qk + [vv] * n_v + [st] * n_s, qk, vv


def _output(g, q, k, v, ss, C: int, scale: float, interpret: bool, warps: int) -> Array:
    B, T, H, K = q.shape
    V = v.shape[-1]
    in_specs, _, vv = _chunk_specs(B, H, C, K, V, 2, 1, 1)
    kern = functools.partial(_out_kernel, C=C, kp=_pieces(K), vp=_pieces(V), scale=scale)
    return pl.pallas_call(
        kern, grid=(B, H, T // C), in_specs=in_specs, out_specs=vv,
        out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
        compiler_params=_params(warps), interpret=interpret, name="gla_output",
    )(g, q, k, v, ss)


def _grads(g, q, k, v, do, ss, dss, C: int, scale: float, interpret: bool, warps: int
           ) -> tuple[Array, Array, Array]:
    B, T, H, K = q.shape
    V = v.shape[-1]
    in_specs, qk, vv = _chunk_specs(B, H, C, K, V, 2, 2, 2)
    kern = functools.partial(_grad_kernel, C=C, kp=_pieces(K), vp=_pieces(V), scale=scale)
    return pl.pallas_call(
        kern, grid=(B, H, T // C), in_specs=in_specs, out_specs=[qk, qk, vv],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                   jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_params(warps), interpret=interpret, name="gla_grads",
    )(g, q, k, v, do, ss, dss)


# ---- differentiable entry point --------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _gla(q, k, v, g, s0, C: int, scale: float, interpret: bool, launch: tuple[int, int, int]):
    return _gla_fwd(q, k, v, g, s0, C, scale, interpret, launch)[0]


def _gla_fwd(q, k, v, g, s0, C, scale, interpret, launch):
    ss, sT = _states(g, k, v, s0, C, False, 1.0, interpret, launch[0], launch[2])
    o = _output(g, q, k, v, ss, C, scale, interpret, launch[1])
    # Named so a remat policy can keep the chunk states (model.py's dots_gla / dots_acts) instead of
    # re-running the state pass in the backward.
    return (o, sT), (q, k, v, g, checkpoint_name(ss, "gla_chunk_states"))


def _gla_bwd(C, scale, interpret, launch, res, cts):
    q, k, v, g, ss = res
    do, dsT = cts
    do = do.astype(v.dtype)
    dss, ds0 = _states(g, q, do, dsT.astype(F32), C, True, scale, interpret, launch[0], launch[2])
    dq, dk, dv = _grads(g, q, k, v, do, ss, dss, C, scale, interpret, launch[1])
    return dq, dk, dv, jnp.zeros_like(g), ds0


_gla.defvjp(_gla_fwd, _gla_bwd)


def chunk_simple_gla_pallas(q: Array, k: Array, v: Array, g_gamma: Array, *, chunk_size: int = 128,
                            scale: float | None = None, initial_state: Array | None = None,
                            interpret: bool | None = None, launch: tuple[int, int, int] = LAUNCH
                            ) -> tuple[Array, Array]:
    """Chunked Simple GLA on Pallas kernels. Returns (o [B, T, H, V] in v's dtype, final_state [B, H, K, V] f32).

    Differentiable in q, k, v and initial_state (g_gamma is a constant: zero cotangent). Products take
    the input dtype with float32 accumulation; the chunk states are handed between kernels in the
    input dtype (bf16 in training), as `ops.gla.chunk_simple_gla` does. `interpret` (default: on
    CPU) runs the kernels through Pallas' interpreter; `launch`: see LAUNCH.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    why = supported(T, K, V, chunk_size)
    if why:
        raise ValueError(f"chunk_simple_gla_pallas: {why}; use ops.gla.chunk_simple_gla for this shape")
    s0 = jnp.zeros((B, H, K, V), F32) if initial_state is None else initial_state.astype(F32)
    sc = K ** -0.5 if scale is None else float(scale)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    o, state = _gla(q, k, v.astype(q.dtype), g_gamma.astype(F32), s0, chunk_size, sc, bool(interpret),
                    tuple(launch))
    return o.astype(v.dtype), state
