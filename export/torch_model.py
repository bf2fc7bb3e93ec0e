"""Plain-PyTorch Laplace decoder: the reference for the serving path (no vLLM import).

Its configuration is the architecture itself (`laplace_jax.spec.Arch`, pure Python); its module
names and layouts are the `torch_name` / `to_torch` columns of `laplace_jax.spec.PARAMS`:

* matrices and ``lm_head`` are ``nn.Linear`` weights, stored ``[out, in]`` (JAX: ``[in, out]``);
* ``conv_w`` is the depthwise ``nn.Conv1d`` weight ``[D, 1, C]`` (JAX: ``[C, D]``);
* the stacked ``[L, ...]`` layer arrays become ``layers.{i}.*``.

State per layer (float32): ``conv [B, C, D]`` (the last C layer-normed inputs, oldest first) and
``gla [B, H, K, V]``; bytes per sequence ``L * (C*D + H*K*V) * 4``.

The math (conv, chunked and one-step GLA, gated_mix, LayerNorm) is export/reference.py's, which
the vLLM model's torch path runs too; this module holds the modules, state and loading.
"""
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

# the folder's file names and readers (re-exported: convert, atomic and hf_config import the names from here)
from export.folder_check import CONFIG_NAME, WEIGHTS_NAME, FolderError, read_arch, read_header
from export.reference import conv_step, conv_with_state, gated_mix, gla_chunked, gla_step, layer_norm, split_heads
from laplace_jax.spec import Arch

def read_config(path: str) -> Arch:
    """The architecture from an exported folder's config.json, every key required (folder_check)."""
    return read_arch(path)


class LaplaceMixer(nn.Module):
    """One token mixer (conv → qkvg → GLA → gated_mix → w_out): its parameters, names as in
    PARAMS.md, and its sequence and one-token forward passes (states passed in and returned)."""

    def __init__(self, cfg: Arch):
        super().__init__()
        D, C, H, K, V = cfg.d_model, cfg.conv_kernel, cfg.num_heads, cfg.d_k, cfg.d_v
        self.conv = nn.Conv1d(D, D, C, groups=D, bias=True)   # conv.weight [D,1,C], conv.bias [D]
        self.w_qkvg = nn.Linear(D, cfg.qkvg_dim, bias=False)
        self.aug_balance = nn.Parameter(torch.zeros(H, K))
        self.head_norm = nn.Parameter(torch.ones(cfg.decay_tiers, V))
        self.w_out = nn.Linear(D, D, bias=False)
        self.register_buffer("g_gamma", torch.tensor(cfg.decay_log(), dtype=torch.float32), persistent=False)
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
        o, gla_state = gla_chunked(q, k, v, self.g_gamma, gla_state, chunk)
        return self.mix_out(q, k, v, g, o, xn.dtype), conv_state, gla_state

    def step_in(self, xn, conv_state):
        """The part of one decode step before the GLA. xn: [B, D]; conv_state: [B, C, D].
        Returns (q, k, v, g [B, H, *] float32, the new conv window [B, C, D] in xn's dtype)."""
        u, window = conv_step(xn, conv_state, self.conv.weight, self.conv.bias)
        return (*self.split(F.silu(u)), window)

    def mix_out(self, q, k, v, g, o, dtype):
        """The part after the GLA (laplace_jax.model._mix_out): `gated_mix`, then W_out.
        q, k [..., H, K]; v, g, o [..., H, V] float32 → [..., D] in `dtype`."""
        o = gated_mix(q, k, v, g, o, self.aug_balance, self.head_norm, self.eps)
        return self.w_out(o.reshape(*o.shape[:-2], -1).to(dtype))

    def forward_step(self, xn, conv_state, gla_state):
        """xn: [B, D] one token per sequence. Returns (out [B, D], conv_state, gla_state)."""
        q, k, v, g, window = self.step_in(xn, conv_state)
        o, gla_state = gla_step(q, k, v, self.g_gamma, gla_state)
        return self.mix_out(q, k, v, g, o, xn.dtype), window.float(), gla_state


class Norm(nn.Module):
    """The scale of a LayerNorm (attn_norm, ffn_norm, final_norm); applied by `layer_norm`."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))


class LaplaceBlock(nn.Module):
    def __init__(self, cfg: Arch):
        super().__init__()
        self.attn_norm = Norm(cfg.d_model)
        self.mixer = LaplaceMixer(cfg)
        self.ffn_norm = Norm(cfg.d_model)
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
        self.final_norm = Norm(cfg.d_model)
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


def check_folder(folder: str) -> Arch:
    """The folder's architecture, once config.json and model.safetensors agree (export/folder_check.py:
    the strict config.json reader and the header-only weights reader; the shapes are this model's)."""
    arch = read_arch(os.path.join(folder, CONFIG_NAME))
    table = read_header(os.path.join(folder, WEIGHTS_NAME))
    with torch.device("meta"):
        want = LaplaceForCausalLM(arch).expected_shapes()
    try:
        check_state_dict(want, {k: tuple(t["shape"]) for k, t in table.items()}, str(folder))
    except ValueError as e:
        raise FolderError(str(e)) from None
    return arch
