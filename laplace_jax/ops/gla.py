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
    decay = jnp.exp(g_gamma.astype(F32))[None, :, None, None]
    kv = k.astype(F32)[..., :, None] * v.astype(F32)[..., None, :]
    state = decay * state + kv
    o = _scale(q, scale) * jnp.einsum("bhk,bhkv->bhv", q.astype(F32), state)
    return o.astype(v.dtype), state


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
                 unroll: bool) -> tuple[Array, Array]:
    """Chunked GLA over q, k: [B, N, C, H, K], v: [B, N, C, H, V] starting from `state`.

    Everything that does not depend on the running state (the intra-chunk masked decay attention,
    each chunk's contribution to the state, the query decay) runs for all N chunks at once; only
    the state hand-off S_{c+1} = exp(γC) S_c + U_c is sequential.
    """
    C = q.shape[2]
    cdt = v.dtype
    pos = jnp.arange(C, dtype=F32)
    # D_ij = exp(γ (i - j)) for i >= j: [H, C, C], built once per call (C x C per head).
    diff = pos[:, None] - pos[None, :]
    causal = diff >= 0
    decay = jnp.where(causal[None], jnp.exp(g[:, None, None] * jnp.where(causal, diff, 0.0)[None]), 0.0)
    q_decay = jnp.exp(g[None, :] * (pos[:, None] + 1.0))            # [C, H]: e^{b_i}
    k_decay = jnp.exp(g[None, :] * (C - 1.0 - pos[:, None]))        # [C, H]: e^{b_{C-1} - b_i}
    chunk_decay = jnp.exp(g * C)[None, :, None, None]               # [1, H, 1, 1]

    scores = jnp.einsum("bnihk,bnjhk->bnhij", q, k, preferred_element_type=F32) * decay
    o_intra = jnp.einsum("bnhij,bnjhv->bnihv", scores.astype(cdt), v, preferred_element_type=F32)
    k_dec = (k.astype(F32) * k_decay[:, :, None]).astype(cdt)
    contrib = jnp.einsum("bnjhk,bnjhv->nbhkv", k_dec, v, preferred_element_type=F32)  # U_c

    def hand_off(s, u):
        return chunk_decay * s + u, s

    n = q.shape[1]
    if unroll:  # a Python loop: every chunk step is visible in the graph (no while loop)
        entering = []
        for c in range(n):
            state, s_in = hand_off(state, contrib[c])
            entering.append(s_in)
        states_in = jnp.stack(entering)
    else:
        state, states_in = jax.lax.scan(hand_off, state, contrib)
    q_dec = (q.astype(F32) * q_decay[:, :, None]).astype(cdt)
    o_inter = jnp.einsum("bnihk,nbhkv->bnihv", q_dec, states_in.astype(cdt), preferred_element_type=F32)
    return scale * (o_intra + o_inter), state


def chunk_simple_gla(q: Array, k: Array, v: Array, g_gamma: Array, *, num_chunks: int | None = None,
                     chunk_size: int | None = None, scale: float | None = None,
                     initial_state: Array | None = None, unroll: bool = False) -> tuple[Array, Array]:
    """Chunked Simple GLA. Returns (o [B, T, H, V] in v's dtype, final_state [B, H, K, V] f32).

    Give `num_chunks` (T must divide; default 16 when neither is given) or `chunk_size` (any T: a
    shorter tail chunk takes the remainder). Matmul inputs stay in the input dtype (bf16 on
    accelerators) with float32 accumulation; the state is float32. `unroll=True` unrolls the
    chunk loop completely (Neuron needs the whole graph).
    """
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
    g = g_gamma.astype(F32)
    sc = _scale(q, scale)
    state = _zero_state(q, v) if initial_state is None else initial_state.astype(F32)
    n_full, tail = divmod(T, chunk_size)
    outs = []
    for start, n, c in ((0, n_full, chunk_size), (n_full * chunk_size, 1 if tail else 0, tail)):
        if n == 0:
            continue
        part = [a[:, start:start + n * c].reshape(B, n, c, H, a.shape[-1]) for a in (q, k, v)]
        o, state = _chunk_block(*part, g, state, sc, unroll)
        outs.append(o.reshape(B, n * c, H, v.shape[-1]))
    o = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    return o.astype(v.dtype), state
