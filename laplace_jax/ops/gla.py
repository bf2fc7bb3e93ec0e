"""Simple Gated Linear Attention with a fixed per-head decay, in three agreeing forms.

Layout and conventions follow flash-linear-attention (fla):
    q, k: [B, T, H, K]    v: [B, T, H, V]    g_gamma: [H] (log decay, <= 0)
    state: [B, H, K, V] float32,  scale defaults to K ** -0.5
    S_t = exp(g_gamma) * S_{t-1} + k_t v_t^T ;   o_t = scale * S_t^T q_t

`chunk_simple_gla` (training, prefill), `recurrent_simple_gla` (reference), `simple_gla_step`
(decode). Pure functions: arrays in, arrays out.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from laplace_jax.choices import HandOff, KernelImpl, check_choice
from laplace_jax.ops.impl import kernel_impl
from laplace_jax.ops.matmul import mixed_matmul as _mm

Array = jax.Array
F32 = jnp.float32


def _scale(q: Array, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


def _zero_state(q: Array, v: Array) -> Array:
    B, _, H, K = q.shape
    return jnp.zeros((B, H, K, v.shape[-1]), F32)


def simple_gla_step(q: Array, k: Array, v: Array, g_gamma: Array, state: Array, *,
                    scale: float | None = None) -> tuple[Array, Array]:
    """One decode step. q, k: [B, H, K]; v: [B, H, V]; state: [B, H, K, V] f32 → (o [B, H, V], state)."""
    lam = jnp.exp(g_gamma.astype(F32))
    out_dtype = v.dtype
    q, k, v = q.astype(F32), k.astype(F32), v.astype(F32)
    # qᵀS' = λ qᵀS + (q·k) vᵀ: the read-out uses the incoming state, so it can share the one pass over
    # S with the update instead of re-reading S' after it is written (decode is state-bandwidth bound).
    # HIGHEST: a float32 read-out of a float32 state (no TF32 on GPUs); it is bandwidth-bound anyway.
    o = (lam[None, :, None] * jnp.einsum("bhk,bhkv->bhv", q, state, precision=jax.lax.Precision.HIGHEST)
         + jnp.sum(q * k, -1, keepdims=True) * v)
    state = lam[None, :, None, None] * state + k[..., :, None] * v[..., None, :]
    return (_scale(q, scale) * o).astype(out_dtype), state


def recurrent_simple_gla(q: Array, k: Array, v: Array, g_gamma: Array, *, scale: float | None = None,
                         initial_state: Array | None = None) -> tuple[Array, Array]:
    """Token-by-token reference. Returns (o [B, T, H, V], final_state [B, H, K, V] f32)."""
    state = _zero_state(q, v) if initial_state is None else initial_state.astype(F32)

    def step(s, qkv):
        o, s = simple_gla_step(*qkv, g_gamma, s, scale=scale)
        return s, o

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v))
    state, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1), state




def _chunk_block(q: Array, k: Array, v: Array, g: Array, state: Array, scale: float,
                 unroll: bool, hand_off: str) -> tuple[Array, Array]:
    """Chunked GLA over q, k: [B, N, C, H, K], v: [B, N, C, H, V] starting from `state`.

    Runs heads-first ([B, H, N, C, *]: every product is a plain batched matmul over (B, H, N)).
    Everything that does not depend on the running state (the intra-chunk masked decay attention,
    each chunk's contribution U_c to the state, the query decay) runs for all N chunks at once. Only
    the state hand-off S_{c+1} = e^{γC} S_c + U_c is sequential: a `lax.scan` over the N chunks
    (`hand_off="scan"`), a Python loop (`unroll=True`), or, with `hand_off="matmul"`, the closed form
    S_c = e^{γCc} S_0 + sum_{m<c} e^{γC(c-1-m)} U_m as one small float32 contraction over chunks.
    """
    B, n, C, H, K = q.shape
    cdt = v.dtype
    hm = lambda a: jnp.transpose(a, (0, 3, 1, 2, 4))  # noqa: E731  [B, N, C, H, *] -> [B, H, N, C, *]
    q, k, v = hm(q), hm(k), hm(v)
    pos = jnp.arange(C, dtype=F32)
    # D_ij = exp(γ (i - j)) for i >= j: [H, C, C], built once per call (C x C per head).
    diff = pos[:, None] - pos[None, :]
    causal = diff >= 0
    decay = jnp.where(causal[None], jnp.exp(g[:, None, None] * jnp.where(causal, diff, 0.0)[None]), 0.0)
    q_decay = jnp.exp(g[:, None] * (pos[None, :] + 1.0))            # [H, C]: e^{b_i}
    k_decay = jnp.exp(g[:, None] * (C - 1.0 - pos[None, :]))        # [H, C]: e^{b_{C-1} - b_i}

    scores = _mm("bhnik,bhnjk->bhnij", q, k) * decay[None, :, None]
    k_dec = (k.astype(F32) * k_decay[None, :, None, :, None]).astype(cdt)
    contrib = _mm("bhnjk,bhnjv->bhnkv", k_dec, v)                    # U_c: [B, H, N, K, V]

    chunk_decay = jnp.exp(g * C)[None, :, None, None]               # [1, H, 1, 1]
    if unroll:  # a Python loop: every chunk step is visible in the graph (no while loop)
        entering = []
        for c in range(n):
            entering.append(state)
            state = chunk_decay * state + contrib[:, :, c]
        states_in = jnp.stack(entering, axis=2)                     # [B, H, N, K, V]
    elif hand_off == "scan":
        def step(s, u):
            return chunk_decay * s + u, s

        state, states_in = jax.lax.scan(step, state, jnp.moveaxis(contrib, 2, 0))
        states_in = jnp.moveaxis(states_in, 0, 2)                   # [B, H, N, K, V]
    else:
        ci = jnp.arange(n, dtype=F32)
        lag = ci[:, None] - 1.0 - ci[None, :]                       # [N, N]: c - 1 - m
        w = jnp.where(lag[None] >= 0, jnp.exp(g[:, None, None] * C * jnp.maximum(lag, 0.0)[None]), 0.0)
        hi = jax.lax.Precision.HIGHEST
        states_in = jnp.einsum("hcm,bhmkv->bhckv", w, contrib, precision=hi)
        states_in = states_in + jnp.exp(g[:, None] * C * ci[None, :])[None, :, :, None, None] * state[:, :, None]
        w_last = jnp.exp(g[:, None] * C * (n - 1.0 - ci[None, :]))  # [H, N]
        state = (jnp.einsum("hm,bhmkv->bhkv", w_last, contrib, precision=hi)
                 + jnp.exp(g * C * n)[None, :, None, None] * state)
    q_dec = (q.astype(F32) * q_decay[None, :, None, :, None]).astype(cdt)
    # o = P v + q_dec S_in as ONE product over C + K: [P | q_dec] @ [v ; S_in] (no f32 partial sums)
    lhs = jnp.concatenate([scores.astype(cdt), q_dec], axis=-1)      # [B, H, N, C, C + K]
    rhs = jnp.concatenate([v, states_in.astype(cdt)], axis=-2)       # [B, H, N, C + K, V]
    o = scale * _mm("bhnij,bhnjv->bhniv", lhs, rhs)                  # [B, H, N, C, V]
    return jnp.transpose(o, (0, 2, 3, 1, 4)), state


def chunk_simple_gla(q: Array, k: Array, v: Array, g_gamma: Array, *, num_chunks: int | None = None,
                     chunk_size: int | None = None, scale: float | None = None,
                     initial_state: Array | None = None, unroll: bool = False,
                     hand_off: HandOff = "scan", impl: KernelImpl = "xla") -> tuple[Array, Array]:
    """Chunked Simple GLA. Returns (o [B, T, H, V] in v's dtype, final_state [B, H, K, V] f32).

    Give `num_chunks` (T must divide; default 16 when neither is given) or `chunk_size` (any T: a
    shorter tail chunk takes the remainder). Matmul inputs stay in the input dtype (bf16 on
    accelerators) with float32 accumulation, also in the backward pass; the state is float32.
    The chunk-to-chunk state hand-off is a `lax.scan` over the static chunks (`hand_off="scan"`),
    one float32 contraction over the chunk axis with no loop (`hand_off="matmul"`), or, with
    `unroll=True`, a Python loop with every step visible in the graph (Neuron). All agree to float32
    rounding. `impl="pallas"` runs the four Pallas kernels of `ops.gla_pallas` (GPUs; interpreted on
    CPU) wherever the shape allows (power-of-two chunk dividing T, head dims multiples of 16) and
    this XLA form elsewhere, e.g. for a prefill of arbitrary length; `impl="auto"` is "pallas" on
    GPUs and "xla" on every other backend (CPU, Neuron).
    """
    check_choice("chunk_simple_gla: hand_off", hand_off, HandOff)
    impl = kernel_impl("chunk_simple_gla", impl)
    B, T, H, K = q.shape
    if num_chunks is not None and chunk_size is not None:
        raise ValueError("chunk_simple_gla: give num_chunks or chunk_size, not both")
    if chunk_size is None:
        num_chunks = 16 if num_chunks is None else num_chunks
        if T % num_chunks:
            raise ValueError(f"chunk_simple_gla: T={T} is not divisible by num_chunks={num_chunks}; "
                             f"pass chunk_size= for arbitrary lengths")
        chunk_size = T // num_chunks
    if chunk_size <= 0:
        raise ValueError(f"chunk_simple_gla: chunk_size must be positive, got {chunk_size}")
    if impl == "pallas" and not unroll:
        from laplace_jax.ops import gla_pallas  # Pallas is imported only where it is asked for

        if gla_pallas.supported(T, K, v.shape[-1], chunk_size) is None:
            return gla_pallas.chunk_simple_gla_pallas(q, k, v, g_gamma, chunk_size=chunk_size, scale=scale,
                                                      initial_state=initial_state)
    g = g_gamma.astype(F32)
    sc = _scale(q, scale)
    state = _zero_state(q, v) if initial_state is None else initial_state.astype(F32)
    n_full, tail = divmod(T, chunk_size)
    outs = []
    for start, n, c in ((0, n_full, chunk_size), (n_full * chunk_size, 1 if tail else 0, tail)):
        if n == 0:
            continue
        part = [a[:, start:start + n * c].reshape(B, n, c, H, a.shape[-1]) for a in (q, k, v)]
        o, state = _chunk_block(*part, g, state, sc, unroll, hand_off)
        outs.append(o.reshape(B, n * c, H, v.shape[-1]))
    o = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    return o.astype(v.dtype), state
