"""Plain-PyTorch Laplace decoder: the reference for the serving path (no vLLM import).

Its configuration is the architecture itself (`laplace_jax.spec.Arch`, pure Python); its module
names and layouts are the `torch_name` / `to_torch` columns of `laplace_jax.spec.PARAMS`:

* matrices and ``lm_head`` are ``nn.Linear`` weights, stored ``[out, in]`` (JAX: ``[in, out]``);
* ``conv_w`` is the depthwise ``nn.Conv1d`` weight ``[D, 1, C]`` (JAX: ``[C, D]``);
* the stacked ``[L, ...]`` layer arrays become ``layers.{i}.*``.

State per layer (float32): ``conv [B, C, D]`` (the last C layer-normed inputs, oldest first) and
``gla [B, H, K, V]``; bytes per sequence ``L * (C*D + H*K*V) * 4``.
"""
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from laplace_jax.spec import Arch

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def read_config(path: str) -> Arch:
    """The architecture from an exported folder's config.json, every key required (folder_check)."""
    from export.folder_check import read_arch
    return read_arch(path)


# ----------------------------------------------------------------------------- functional pieces
# Shared with the vLLM model (export/vllm_model.py); all state math in float32.

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
    """The projection [..., H·(2K + 2V)] as q, k [..., H, K], v, g [..., H, V] (views, same dtype)."""
    q, k, v, g = torch.split(qkvg, [H * K, H * K, H * V, H * V], dim=-1)
    shp = qkvg.shape[:-1]
    return (q.reshape(*shp, H, K), k.reshape(*shp, H, K),
            v.reshape(*shp, H, V), g.reshape(*shp, H, V))


def gla_chunked(q, k, v, gamma, state, chunk: int = 64):
    """Simple GLA with fixed per-head decay, chunked, float32, with no Python loop over chunks.

    q, k: [B, S, H, K]; v: [B, S, H, V]; gamma: [H] (ln λ); state: [B, H, K, V].
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
    g = gamma.float().to(dev).view(H, 1)                            # [H, 1]
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


def gla_step(q, k, v, gamma, state):
    """One recurrent step. q, k: [B, H, K]; v: [B, H, V]; state: [B, H, K, V] (float32)."""
    K = q.shape[-1]
    lam = torch.exp(gamma.float()).view(1, -1, 1, 1)
    st = lam * state.float() + k.float().unsqueeze(-1) * v.float().unsqueeze(-2)
    o = torch.einsum("bhk,bhkv->bhv", q.float(), st) * K ** -0.5
    return o, st


def mixer_post(q, k, v, gt, o, aug_balance, head_norm, eps):
    """Self-augmentation + per-tier head RMSNorm + SiLU gate.  All [..., H, *] float32."""
    H = q.shape[-2]
    T = head_norm.shape[0]
    aug = torch.sigmoid((q * aug_balance.float() * k).sum(-1, keepdim=True))
    o = o + aug * v
    o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + eps)
    w = head_norm.float().repeat_interleave(H // T, dim=0)        # [H, V]
    o = o * w
    return o * F.silu(gt)


class LaplaceMixerWeights(nn.Module):
    """Parameters of one token mixer (conv .. w_out), names as in PARAMS.md."""

    def __init__(self, cfg: Arch):
        super().__init__()
        D, C, H, K, V = cfg.d_model, cfg.conv_kernel, cfg.num_heads, cfg.d_k, cfg.d_v
        self.conv = nn.Conv1d(D, D, C, groups=D, bias=True)   # conv.weight [D,1,C], conv.bias [D]
        self.w_qkvg = nn.Linear(D, cfg.qkvg_dim, bias=False)
        self.aug_balance = nn.Parameter(torch.zeros(H, K))
        self.head_norm = nn.Parameter(torch.ones(cfg.decay_tiers, V))
        self.w_out = nn.Linear(D, D, bias=False)
        self.register_buffer("gamma", torch.tensor(cfg.decay_log(), dtype=torch.float32), persistent=False)
        self.H, self.K, self.V, self.eps = H, K, V, cfg.norm_eps

    def heads(self, qkvg):
        """The projection [..., qkvg_dim] as q, k [..., H, K], v, g [..., H, V] (views, same dtype)."""
        return split_heads(qkvg, self.H, self.K, self.V)

    def split(self, u):
        return self.heads(self.w_qkvg(u).float())

    def forward_seq(self, xn, conv_state, gla_state, chunk: int = 64):
        """xn: layer-normed input [B, S, D]. Returns (out [B, S, D], conv_state, gla_state)."""
        u, conv_state = conv_with_state(xn, conv_state, self.conv.weight, self.conv.bias)
        q, k, v, g = self.split(F.silu(u))
        o, gla_state = gla_chunked(q, k, v, self.gamma, gla_state, chunk)
        o = mixer_post(q, k, v, g, o, self.aug_balance, self.head_norm, self.eps)
        out = self.w_out(o.reshape(*o.shape[:-2], -1).to(xn.dtype))
        return out, conv_state, gla_state

    def step_in(self, xn, conv_state):
        """The part of one decode step before the GLA. xn: [B, D]; conv_state: [B, C, D].
        Returns (q, k, v, g [B, H, *] float32, the new conv window [B, C, D] in xn's dtype)."""
        u, window = conv_step(xn, conv_state, self.conv.weight, self.conv.bias)
        return (*self.split(F.silu(u)), window)

    def step_out(self, q, k, v, g, o, dtype):
        """The part after the GLA: self-augmentation, head norm, gate, W_out → [B, D] in `dtype`."""
        o = mixer_post(q, k, v, g, o, self.aug_balance, self.head_norm, self.eps)
        return self.w_out(o.reshape(o.shape[0], -1).to(dtype))

    def forward_step(self, xn, conv_state, gla_state):
        """xn: [B, D] one token per sequence. Returns (out [B, D], conv_state, gla_state)."""
        q, k, v, g, window = self.step_in(xn, conv_state)
        o, gla_state = gla_step(q, k, v, self.gamma, gla_state)
        return self.step_out(q, k, v, g, o, xn.dtype), window.float(), gla_state


class _Norm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))


class LaplaceBlock(nn.Module):
    def __init__(self, cfg: Arch):
        super().__init__()
        self.attn_norm = _Norm(cfg.d_model)
        self.mixer = LaplaceMixerWeights(cfg)
        self.ffn_norm = _Norm(cfg.d_model)
        self.w_12 = nn.Linear(cfg.d_model, 2 * cfg.ffn_dim, bias=False)
        self.w_3 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)
        self.eps = cfg.norm_eps

    def ffn(self, x):
        z = layer_norm(x, self.ffn_norm.weight, self.eps)
        a, b = self.w_12(z).chunk(2, dim=-1)
        return self.w_3(F.silu(a) * b)


class LaplaceForCausalLM(nn.Module):
    """Full-sequence forward (chunked GLA) and recurrent decode with a fixed-size state."""

    def __init__(self, cfg: Arch):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(LaplaceBlock(cfg) for _ in range(cfg.num_layers))
        self.final_norm = _Norm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    # -- state
    def init_state(self, batch: int, device=None) -> list:
        c = self.config
        device = device or self.embed.weight.device
        return [{"conv": torch.zeros(batch, c.conv_kernel, c.d_model, device=device),
                 "gla": torch.zeros(batch, c.num_heads, c.d_k, c.d_v, device=device)}
                for _ in range(c.num_layers)]

    # -- forward
    def forward(self, tokens: torch.Tensor, state: Optional[list] = None, chunk: Optional[int] = None):
        """tokens [B, S] → (logits [B, S, N] float32, new state). Continues from `state` if given."""
        B = tokens.shape[0]
        if state is None:
            state = self.init_state(B, tokens.device)
        chunk = chunk or max(1, self.config.chunk_size)
        x = self.embed(tokens)
        new_state = []
        for blk, st in zip(self.layers, state):
            xn = layer_norm(x, blk.attn_norm.weight, blk.eps)
            out, conv, gla = blk.mixer.forward_seq(xn, st["conv"], st["gla"], chunk)
            x = x + out
            x = x + blk.ffn(x)
            new_state.append({"conv": conv.float(), "gla": gla})
        x = layer_norm(x, self.final_norm.weight, self.config.norm_eps)
        return self.lm_head(x).float(), new_state

    def decode_step(self, tokens: torch.Tensor, state: list):
        """tokens [B] → (logits [B, N] float32, new state): one recurrent step."""
        x = self.embed(tokens)
        new_state = []
        for blk, st in zip(self.layers, state):
            xn = layer_norm(x, blk.attn_norm.weight, blk.eps)
            out, conv, gla = blk.mixer.forward_step(xn, st["conv"], st["gla"])
            x = x + out
            x = x + blk.ffn(x)
            new_state.append({"conv": conv, "gla": gla})
        x = layer_norm(x, self.final_norm.weight, self.config.norm_eps)
        return self.lm_head(x).float(), new_state

    @torch.no_grad()
    def generate(self, prompt: list, max_new_tokens: int, eos_token_id: Optional[int] = None) -> list:
        """Greedy decoding of one prompt (list of ids) → list of new ids (stops at eos if given)."""
        dev = self.embed.weight.device
        logits, state = self.forward(torch.tensor([prompt], device=dev))
        out = []
        nxt = int(logits[0, -1].argmax())
        for _ in range(max_new_tokens):
            out.append(nxt)
            if eos_token_id is not None and nxt == eos_token_id:
                break
            if len(out) == max_new_tokens:
                break
            logits, state = self.decode_step(torch.tensor([nxt], device=dev), state)
            nxt = int(logits[0].argmax())
        return out

    # -- loading
    def expected_shapes(self) -> dict:
        return {k: tuple(v.shape) for k, v in self.state_dict().items()}

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype = torch.float32, device="cpu") -> "LaplaceForCausalLM":
        from safetensors.torch import load_file

        from export.folder_check import check_folder
        cfg = check_folder(str(path))   # config.json whole, the weights' names and shapes its model's
        tensors = load_file(os.path.join(path, WEIGHTS_NAME))
        model = cls(cfg)
        model.load_state_dict({k: v.to(torch.float32) for k, v in tensors.items()}, strict=True)
        return model.to(device=device, dtype=dtype).eval()


def check_state_dict(expected: dict, found: dict, where: str = "") -> None:
    """Raise ValueError naming missing / unexpected / mis-shaped tensors."""
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    bad = sorted(k for k in set(expected) & set(found) if tuple(expected[k]) != tuple(found[k]))
    if not (missing or extra or bad):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing (e.g. {', '.join(missing[:3])})")
    if extra:
        parts.append(f"{len(extra)} unexpected (e.g. {', '.join(extra[:3])})")
    if bad:
        parts.append("shape mismatch: " + ", ".join(
            f"{k} is {list(found[k])}, config wants {list(expected[k])}" for k in bad[:3]))
    raise ValueError(f"{where}/{WEIGHTS_NAME} does not match {where}/{CONFIG_NAME}: "
                     + "; ".join(parts) + " — re-export the checkpoint or fix config.json")
