"""The serving side's math, one home: the plain-torch functional pieces the torch model
(export/torch_model.py) and the vLLM model (export/vllm_model.py) run, and the float64 references
the Triton kernels (export/ops/) are checked against (export/checks.py).

Shipped with torch_model.py into every exported folder (export/remote_code.py): imports torch only.
All state math in float32; the decay is g_gamma = ln λ [H] (<= 0), as in laplace_jax.
"""
import torch
import torch.nn.functional as F


# ----------------------------------------------------------------------------- functional pieces

def layer_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    mu = xf.mean(-1, keepdim=True)
    var = (xf - mu).square().mean(-1, keepdim=True)
    return ((xf - mu) * torch.rsqrt(var + eps) * w.float()).to(x.dtype)


def conv_with_state(x: torch.Tensor, window: torch.Tensor, w: torch.Tensor, b: torch.Tensor):
    """Causal depthwise conv over x [B, S, D] continuing from window [B, C, D] (last C inputs).

    w: [D, 1, C] (Conv1d layout); returns (u [B, S, D], new window [B, C, D])."""
    S = x.shape[1]
    full = torch.cat([window.to(x.dtype), x], dim=1)               # [B, C + S, D]
    seq = full[:, 1:]                                               # last C-1 of window + x
    u = F.conv1d(seq.transpose(1, 2), w.to(x.dtype), b.to(x.dtype), groups=w.shape[0])
    new_window = full[:, S:]                                        # [B, C, D]
    return u.transpose(1, 2), new_window


def conv_step(x: torch.Tensor, window: torch.Tensor, w: torch.Tensor, b: torch.Tensor):
    """One token of `conv_with_state`, in x's dtype: x [B, D], window [B, C, D], w [D, 1, C].
    Returns (u [B, D], the new window [B, C, D] in x's dtype)."""
    new_window = torch.cat([window[:, 1:].to(x.dtype), x.unsqueeze(1)], dim=1)
    u = (new_window * w[:, 0, :].t().to(x.dtype)).sum(1) + b.to(x.dtype)
    return u, new_window


def split_heads(qkvg: torch.Tensor, H: int, K: int, V: int) -> tuple:
    """The projection [..., H·(2K + 2V)] as q, k [..., H, K], v, g [..., H, V] (views, same dtype).

    Each view keeps the projection's strides on the leading dimensions, also where one has size 1
    (a view or reshape would renumber those): the Triton kernels' compile key holds the strides,
    and a one-token step must not make a variant of its own."""
    q, k, v, g = torch.split(qkvg, [H * K, H * K, H * V, H * V], dim=-1)
    return tuple(x.as_strided((*x.shape[:-1], H, d), (*x.stride()[:-1], d * x.stride(-1), x.stride(-1)),
                              x.storage_offset())
                 for x, d in ((q, K), (k, K), (v, V), (g, V)))


def gla_chunked(q, k, v, g_gamma, state, chunk: int = 64):
    """Simple GLA with fixed per-head decay, chunked, float32, with no Python loop over chunks.

    q, k: [B, S, H, K]; v: [B, S, H, V]; g_gamma: [H] (ln λ); state: [B, H, K, V].
    o_t = K^-0.5 S_t^T q_t with S_t = λ S_{t-1} + k_t v_t^T.  Returns (o [B, S, H, V], state).

    The sequence is cut into N chunks of C = min(chunk, S) tokens (the last one zero-padded).  For
    all chunks at once: the masked-decay attention inside each chunk, each chunk's state
    contribution U_c = (k ⊙ e^{γ(C-1-j)})^T v, and the state entering chunk c in closed form
    S_c = e^{γCc} S_0 + Σ_{m<c} e^{γC(c-1-m)} U_m (one contraction over the chunk axis with an
    [H, N, N] weight).  Every exponent is <= 0, so nothing overflows; tiny factors underflow to 0."""
    B, S, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5
    st0 = state.float()
    if S == 0:
        return torch.zeros(B, 0, H, V, device=q.device, dtype=torch.float32), st0
    dev = q.device
    C = max(1, min(int(chunk), S))
    N = -(-S // C)
    pad = N * C - S

    def blocks(x):                                                  # [B, S, H, *] → [B, H, N, C, *]
        x = x.float()
        if pad:
            x = F.pad(x, (0, 0, 0, 0, 0, pad))
        return x.reshape(B, N, C, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    qb, kb, vb = blocks(q), blocks(k), blocks(v)
    g = g_gamma.float().to(dev).view(H, 1)                          # [H, 1]
    pos = torch.arange(C, device=dev, dtype=torch.float32)          # i (or j) inside a chunk
    zero = torch.zeros((), device=dev)
    diff = pos.view(C, 1) - pos.view(1, C)                          # i - j
    dec = torch.where(diff >= 0, torch.exp(g.view(H, 1, 1) * diff.clamp(min=0)), zero)   # [H, C, C]
    att = torch.einsum("bhnik,bhnjk->bhnij", qb, kb) * dec.view(1, H, 1, C, C)
    intra = torch.einsum("bhnij,bhnjv->bhniv", att, vb)             # [B, H, N, C, V]
    kdec = kb * torch.exp(g * (C - 1 - pos)).view(1, H, 1, C, 1)
    u = torch.einsum("bhnjk,bhnjv->bhnkv", kdec, vb)                # U_c  [B, H, N, K, V]
    c = torch.arange(N, device=dev, dtype=torch.float32)
    lag = c.view(N, 1) - 1 - c.view(1, N)                           # c - 1 - m
    w = torch.where(lag >= 0, torch.exp(g.view(H, 1, 1) * C * lag.clamp(min=0)), zero)  # [H, N, N]
    s_in = (torch.einsum("hcm,bhmkv->bhckv", w, u)
            + torch.exp(g * C * c).view(1, H, N, 1, 1) * st0.unsqueeze(2))               # S_c
    qdec = qb * torch.exp(g * (pos + 1)).view(1, H, 1, C, 1)
    o = (intra + torch.einsum("bhnik,bhnkv->bhniv", qdec, s_in)) * scale
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :S]
    # state after the last real token: the last chunk holds n = S - (N-1)C of them
    n = S - (N - 1) * C
    kl = kb[:, :, -1] * torch.exp(g * (n - 1 - pos).clamp(min=0)).view(1, H, C, 1)   # pad rows are 0
    st = torch.exp(g * n).view(1, H, 1, 1) * s_in[:, :, -1] + kl.transpose(-1, -2) @ vb[:, :, -1]
    return o, st


def gla_step(q, k, v, g_gamma, state):
    """One recurrent step. q, k: [B, H, K]; v: [B, H, V]; g_gamma: [H] (ln λ); state: [B, H, K, V]
    (float32)."""
    K = q.shape[-1]
    lam = torch.exp(g_gamma.float()).view(1, -1, 1, 1)
    st = lam * state.float() + k.float().unsqueeze(-1) * v.float().unsqueeze(-2)
    o = torch.einsum("bhk,bhkv->bhv", q.float(), st) * K ** -0.5
    return o, st


def gated_mix(q, k, v, g, o, aug_balance, head_norm, eps):
    """The post-GLA step (laplace_jax.ops.mix.gated_mix): self-augmentation + per-tier head
    RMSNorm + SiLU gate.  q, k [..., H, K]; v, g, o [..., H, V], float32 (or float64 for the
    float64 reference); returns [..., H, V]."""
    H = q.shape[-2]
    T = head_norm.shape[0]
    aug = torch.sigmoid((q * aug_balance.float() * k).sum(-1, keepdim=True))
    o = o + aug * v
    o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + eps)
    w = head_norm.float().repeat_interleave(H // T, dim=0)        # [H, V]
    o = o * w
    return o * F.silu(g)


# ----------------------------------------------------------------------------- float64 references

def gla_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_gamma: torch.Tensor,
                state0: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple:
    """The step recurrence in float64 over packed requests (request r owns rows
    cu_seqlens[r]:cu_seqlens[r+1]), all requests at once (padded to the longest).

    q, k [T, H, K]; v [T, H, V]; g_gamma [H] (ln λ); state0 [R, H, K, V] (the states the requests start
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
    lam = torch.exp(g_gamma.double().to(dev)).view(1, H, 1, 1)
    s = state0.double().clone()
    o = torch.zeros(R, L, H, V, device=dev, dtype=torch.float64)
    for i in range(L):
        upd = lam * s + kg[:, i, :, :, None] * vg[:, i, :, None, :]
        s = torch.where(valid[:, i].view(R, 1, 1, 1), upd, s)
        o[:, i] = torch.einsum("rhk,rhkv->rhv", qg[:, i], s) * K ** -0.5
    out = torch.zeros(T, H, V, device=dev, dtype=torch.float64)
    out[tok[valid]] = o[valid]
    return out, s


def gated_mix_float64(q, k, v, g, o, aug_balance, head_norm, eps) -> torch.Tensor:
    """`gated_mix` in float64 on the same values, reshaped as the fused kernel's output:
    [N, H·V] float64."""
    d = [x.double() for x in (q, k, v, g, o)]
    y = gated_mix(*d, aug_balance.double(), head_norm.double(), eps)
    return y.reshape(y.shape[0], -1)
