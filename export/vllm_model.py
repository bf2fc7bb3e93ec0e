"""Laplace as a vLLM out-of-tree model (attention-free; recurrent state in vLLM's per-sequence pool).

Each layer's token mixer is a `MambaBase` layer whose two float32 states — the conv window
[C, D] and the GLA matrix [H, K, V] — live in vLLM's state pool (one page per sequence, backend
`MambaAttentionBackendEnum.LINEAR`).  The mixer runs as one opaque custom op
(`torch.ops.vllm.laplace_mixer`) so the rest of the model can go through torch.compile.

vLLM internals used (checked on 0.32 CPU and by reading 0.26): `MambaBase`, `IsAttentionFree`,
`HasInnerState`, `get_forward_context()` (`.attn_metadata[prefix]`: `LinearAttentionMetadata`,
`.no_compile_layers`), `compilation_config.static_forward_context`, `direct_register_custom_op`.
Do NOT add `from __future__ import annotations` here (breaks vLLM's dynamic-shape detection).
"""
import os
from collections.abc import Iterable
from typing import Optional

import torch
from torch import nn

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.models.interfaces import HasInnerState, IsAttentionFree
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from export.torch_model import (LaplaceConfig, LaplaceMixerWeights, _Norm, check_state_dict,
                                layer_norm)

try:  # vLLM >= 0.11
    from vllm.compilation.decorators import support_torch_compile
except ImportError:  # pragma: no cover
    support_torch_compile = None


def _laplace_config(hf_config) -> LaplaceConfig:
    if hasattr(hf_config, "laplace_config"):
        return hf_config.laplace_config()
    return LaplaceConfig.from_dict({k: getattr(hf_config, k) for k in LaplaceConfig.__dataclass_fields__
                                    if hasattr(hf_config, k)})


def state_shapes(cfg: LaplaceConfig):
    return ((cfg.conv_kernel, cfg.d_model), (cfg.num_heads, cfg.d_k, cfg.d_v))


STATE_DTYPES = (torch.float32, torch.float32)


class LaplaceVllmMixer(LaplaceMixerWeights, MambaBase):
    """Token mixer (conv → qkvg → GLA → aug → head norm → gate → w_out) with state in vLLM's pool."""

    def __init__(self, cfg: LaplaceConfig, prefix: str):
        LaplaceMixerWeights.__init__(self, cfg)
        self.cfg = cfg
        self.prefix = prefix
        self.chunk = max(1, min(64, cfg.chunk_size))
        self.kv_cache = (torch.tensor([]), torch.tensor([]))
        ctx = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"duplicate layer name: {prefix}")
        ctx[prefix] = self

    # --- MambaBase interface
    @property
    def mamba_type(self):
        return MambaAttentionBackendEnum.LINEAR

    def get_state_shape(self):
        return state_shapes(self.cfg)

    def get_state_dtype(self):
        return STATE_DTYPES

    # --- compute
    def _pools(self):
        kv = self.kv_cache
        if isinstance(kv, (list, tuple)) and len(kv) and isinstance(kv[0], (list, tuple)):
            kv = kv[get_forward_context().virtual_engine]      # older per-virtual-engine layout
        return kv[0], kv[1]

    def _metadata(self):
        md = get_forward_context().attn_metadata
        if isinstance(md, list):                                 # micro-batched: not used here
            md = md[0] if md else None
        if isinstance(md, dict):
            md = md.get(self.prefix)
        return md

    def forward(self, xn: torch.Tensor, output: torch.Tensor) -> None:
        torch.ops.vllm.laplace_mixer(xn, output, self.prefix)

    @torch.no_grad()
    def _forward(self, xn: torch.Tensor, output: torch.Tensor) -> None:
        md = self._metadata()
        if md is None:                     # profiling / dummy run: no state, no pages
            output.zero_()
            return
        conv_pool, gla_pool = self._pools()
        nd, npf = int(md.num_decodes), int(md.num_prefills)
        nreq = nd + npf
        n = int(md.num_decode_tokens) + int(md.num_prefill_tokens)
        qsl = md.query_start_loc[: nreq + 1]
        qlen = qsl[1:] - qsl[:-1]
        # context 0 → a new sequence: start from zero (pages are reused without zeroing)
        has_ctx = (md.seq_lens[:nreq] - qlen) > 0
        slots = md.state_indices_tensor[:nreq].long()
        # Rows that pad a CUDA-graph batch have seq_len 0 and a PAD_SLOT_ID (-1) or a stale slot id
        # (a freed slot that another sequence may own now): send their writes to the null slot 0.
        pad = (slots < 0) | (md.seq_lens[:nreq] <= 0)
        slots = torch.where(pad, torch.zeros_like(slots), slots)
        if n < output.shape[0]:
            output[n:].zero_()
        if nd > 0:
            sl = slots[:nd]
            keep = has_ctx[:nd]
            cs = torch.where(keep.view(-1, 1, 1), conv_pool[sl], 0.0)
            gs = torch.where(keep.view(-1, 1, 1, 1), gla_pool[sl], 0.0)
            o, cs, gs = self.forward_step(xn[:nd], cs, gs)
            conv_pool[sl] = cs.to(conv_pool.dtype)
            gla_pool[sl] = gs.to(gla_pool.dtype)
            output[:nd] = o.to(output.dtype)
        if _STATS and self.cfg and self.prefix.startswith("layers.0."):
            _record_stats(has_ctx, nd, npf)
        if npf > 0:
            starts = qsl.tolist()
            keep_l = has_ctx.tolist()
            for r in range(nd, nreq):
                s, e = starts[r], starts[r + 1]
                slot = slots[r : r + 1]
                if keep_l[r]:
                    cs, gs = conv_pool[slot], gla_pool[slot]
                else:
                    cs = conv_pool.new_zeros((1,) + conv_pool.shape[1:])
                    gs = gla_pool.new_zeros((1,) + gla_pool.shape[1:])
                o, cs, gs = self.forward_seq(xn[s:e].unsqueeze(0), cs, gs, self.chunk)
                conv_pool[slot] = cs.to(conv_pool.dtype)
                gla_pool[slot] = gs.to(gla_pool.dtype)
                output[s:e] = o[0].to(output.dtype)


_STATS = os.environ.get("LAPLACE_VLLM_STATS")   # debug/test: append per-step batch make-up here


def _record_stats(has_ctx, nd, npf):
    hc = has_ctx.tolist()
    rec = {"decodes": nd, "new_decodes": nd - sum(hc[:nd]), "prefills": npf,
           "continued_prefills": sum(hc[nd:])}
    with open(_STATS, "a") as f:
        f.write(repr(rec) + "\n")


def _laplace_mixer(xn: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    layer = get_forward_context().no_compile_layers[layer_name]
    layer._forward(xn, output)


def _laplace_mixer_fake(xn: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    return


direct_register_custom_op(op_name="laplace_mixer", op_func=_laplace_mixer,
                          mutates_args=["output"], fake_impl=_laplace_mixer_fake)


class LaplaceVllmBlock(nn.Module):
    def __init__(self, cfg: LaplaceConfig, prefix: str):
        super().__init__()
        self.attn_norm = _Norm(cfg.d_model)
        self.mixer = LaplaceVllmMixer(cfg, prefix=f"{prefix}.mixer")
        self.ffn_norm = _Norm(cfg.d_model)
        self.w_12 = nn.Linear(cfg.d_model, 2 * cfg.ffn_dim, bias=False)
        self.w_3 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)
        self.eps = cfg.norm_eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xn = layer_norm(x, self.attn_norm.weight, self.eps)
        out = torch.empty_like(x)
        self.mixer(xn, out)
        x = x + out
        z = layer_norm(x, self.ffn_norm.weight, self.eps)
        a, b = self.w_12(z).chunk(2, dim=-1)
        return x + self.w_3(nn.functional.silu(a) * b)


class LaplaceVllmBackbone(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        cfg = _laplace_config(vllm_config.model_config.hf_config)
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # prefixes must hold exactly one integer (the layer index)
        self.layers = nn.ModuleList(LaplaceVllmBlock(cfg, prefix=f"layers.{i}")
                                    for i in range(cfg.num_layers))
        self.final_norm = _Norm(cfg.d_model)

    def forward(self, input_ids: Optional[torch.Tensor], positions: torch.Tensor,
                inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = inputs_embeds if inputs_embeds is not None else self.embed(input_ids)
        for blk in self.layers:
            x = blk(x)
        return layer_norm(x, self.final_norm.weight, self.cfg.norm_eps)


if support_torch_compile is not None:
    LaplaceVllmBackbone = support_torch_compile(
        dynamic_arg_dims={"input_ids": 0, "positions": -1, "inputs_embeds": 0})(LaplaceVllmBackbone)


class LaplaceForCausalLM(nn.Module, HasInnerState, IsAttentionFree):
    """vLLM entry class (architecture "LaplaceForCausalLM")."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        self.vllm_config = vllm_config
        self.backbone = LaplaceVllmBackbone(vllm_config=vllm_config, prefix=prefix)
        cfg = self.backbone.cfg
        self.config = vllm_config.model_config.hf_config
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    # --- state description (classmethods used by some vLLM paths)
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return state_shapes(_laplace_config(vllm_config.model_config.hf_config))

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return STATE_DTYPES

    @classmethod
    def get_mamba_state_copy_func(cls):
        # both states are whole per-block values: copy the block that holds the latest state
        from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
        return (get_temporal_copy_spec, get_temporal_copy_spec)

    # --- model API
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.embed(input_ids)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:  # older vLLM name
        return self.embed_input_ids(input_ids)

    def forward(self, input_ids: Optional[torch.Tensor], positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds: Optional[torch.Tensor] = None, **kwargs):
        return self.backbone(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor, *args) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.backbone.named_parameters())
        params.update({"lm_head.weight": self.lm_head.weight})
        got = {}
        for name, w in weights:
            got[name] = w
        check_state_dict({k: tuple(p.shape) for k, p in params.items()},
                         {k: tuple(w.shape) for k, w in got.items()},
                         str(self.vllm_config.model_config.model))
        for name, w in got.items():
            params[name].data.copy_(w.to(params[name].dtype))
        loaded = set(f"backbone.{k}" for k in params if k != "lm_head.weight")
        loaded.add("lm_head.weight")
        return loaded
