"""Laplace as a vLLM out-of-tree model (attention-free; recurrent state in vLLM's per-sequence pool).

Each layer's token mixer is a `MambaBase` layer whose two float32 states — the conv window
[C, D] and the GLA matrix [H, K, V] — live in vLLM's state pool (one page per sequence, backend
`MambaAttentionBackendEnum.LINEAR`).  The mixer runs as one opaque custom op
(`torch.ops.vllm.laplace_mixer`) so the rest of the model can go through torch.compile.

On CUDA with triton, Triton kernels (export/ops/) update the states in the pool in place, with no
grouping by length: the decode rows' conv window (ops/conv.py, one-token tiles) and GLA step
(ops/gla_decode.py); all prefill requests of a step as one packed call each of ops/conv.py (conv
window + SiLU) and ops/gla_prefill.py (chunked GLA), with no state gather / scatter; each writes its
rows of one conv and one GLA output, so the projection, the post-GLA step (`gated_mix`:
self-augmentation, head norm, gate, cast; one kernel of ops/gated_mix.py) and w_out run once over
the step's rows.  The torch path (CPU installs without triton, or
LAPLACE_VLLM_TRITON=0) runs prefill requests of equal query length as one batch (chunked GLA with
no loop over chunks) and the decode step in torch.
A decode-only batch may be captured whole in a CUDA graph (the LINEAR backend allows uniform
single-token decode graphs), so the decode path makes no host syncs.

Prefix caching (`--enable-prefix-caching`): the class declares `SupportsMambaPrefixCaching`; vLLM's
'align' mode (export/prefix_cache.py says why that one, and why the metadata then comes from
Bailing linear attention's builder) copies a cached block's state into the page at
`state_indices_tensor` before the step, so a prefill after a cache hit is a prefill with context:
initial states read from that page (both paths), final states written back to it.

vLLM internals used (checked on 0.32 CPU and by reading 0.26): `MambaBase`, `IsAttentionFree`,
`HasInnerState`, `SupportsMambaPrefixCaching`, `BailingLinearAttentionBackend` (export/prefix_cache.py),
`get_forward_context()` (`.attn_metadata[prefix]`: `LinearAttentionMetadata`, `.no_compile_layers`),
`compilation_config.static_forward_context`, `direct_register_custom_op`.
Do NOT add `from __future__ import annotations` here (breaks vLLM's dynamic-shape detection).
"""
import contextlib
import os
from collections.abc import Iterable
from typing import Optional

import torch
from torch import nn

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.models.interfaces import HasInnerState, IsAttentionFree, SupportsMambaPrefixCaching
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from export import full_graph, prefix_cache, step_index
from export.ops import conv, gated_mix, gla_decode, gla_prefill, launch_tape, triton_switch, warmup
from export.ops.launch_keys import scratch
from export.reference import layer_norm
from export.torch_model import LaplaceMixer, Norm, check_folder, check_state_dict
from laplace_jax.spec import Arch

try:  # vLLM >= 0.11
    from vllm.compilation.decorators import support_torch_compile
except ImportError:  # pragma: no cover
    support_torch_compile = None


def _laplace_config(hf_config) -> Arch:
    return hf_config.arch() if hasattr(hf_config, "arch") else Arch.from_json(hf_config.to_dict())


def checked_arch(vllm_config: VllmConfig) -> Arch:
    """The architecture to serve: a local folder is checked whole first (export/folder_check.py: every
    config.json key present, the weights' names and shapes its model's; one line naming what is not),
    before vLLM sizes a state cache or allocates a weight from it."""
    folder = str(vllm_config.model_config.model)
    return check_folder(folder) if os.path.isdir(folder) else _laplace_config(vllm_config.model_config.hf_config)


def state_shapes(cfg: Arch):
    """vLLM's per-sequence state pages, one layer: (conv window, GLA matrix) = `Arch.state_layout`."""
    layout = cfg.state_layout()
    return (layout["conv"], layout["gla"])


STATE_DTYPES = (torch.float32, torch.float32)


class LaplaceVllmMixer(LaplaceMixer, MambaBase):
    """Token mixer (conv → qkvg → GLA → aug → head norm → gate → w_out) with state in vLLM's pool."""

    def __init__(self, cfg: Arch, prefix: str):
        LaplaceMixer.__init__(self, cfg)
        self.cfg = cfg
        self.prefix = prefix
        self.chunk = max(1, cfg.chunk_size)   # prefill chunk (any size is exact)
        self.kv_cache = (torch.tensor([]), torch.tensor([]))
        vllm_config = get_current_vllm_config()
        # 'align' with prefix caching: vLLM then copies states between blocks (the warm-up compiles
        # that copy too) and the metadata comes from `_backend`
        self.mamba_cache_mode = vllm_config.cache_config.mamba_cache_mode
        self._backend = prefix_cache.state_backend(self.mamba_cache_mode) or full_graph.StateBackend
        self._compilation = vllm_config.compilation_config     # its cudagraph_mode, settled later
        ctx = vllm_config.compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"duplicate layer name: {prefix}")
        ctx[prefix] = self

    # --- the state pools: binding them compiles every Triton kernel variant (export/ops/warmup.py),
    # so that none compiles while serving
    @property
    def kv_cache(self):
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, value) -> None:
        self._kv_cache = value
        warmup.on_bind(self)

    # --- MambaBase interface
    @property
    def mamba_type(self):
        return MambaAttentionBackendEnum.LINEAR

    def get_state_shape(self):
        return state_shapes(self.cfg)

    def get_attn_backend(self):
        # metadata builders whose state indices a CUDA graph can follow: with prefix caching
        # export/prefix_cache.py's, else export/full_graph.py's (which allows whole-step graphs)
        return self._backend

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

    def forward(self, xn: torch.Tensor, residual: torch.Tensor) -> None:
        """residual [N, D] += the mixer of xn [N, D], in place (the block's residual add is done
        here: on the Triton path it is the w_out GEMM's epilogue, β = 1 on the residual rows
        themselves, so neither a separate pass nor a copy of the residual into a new output;
        `addmm(out=)` into another tensor copies its addend first: 2.27 ms a prefill step, run S11)."""
        torch.ops.vllm.laplace_mixer(xn, residual, self.prefix)

    @torch.no_grad()
    def _forward(self, xn: torch.Tensor, residual: torch.Tensor) -> None:
        md = self._metadata()
        if md is None:                     # profiling / dummy run: no state, no pages (adds nothing)
            return
        conv_pool, gla_pool = self._pools()
        ix = step_index.of_step(md)
        nd, npf = ix.nd, ix.npf
        if triton_switch.available(xn):   # the Triton kernels (CUDA, triton installed, not switched off)
            if full_graph.capturing_whole_step(xn, self._compilation):
                self._rows_graph(ix, xn, residual, conv_pool, gla_pool)
            else:
                self._forward_fast(md, ix, xn, residual, conv_pool, gla_pool)
            return
        if nd > 0:
            o = self._decode(xn[:nd], conv_pool, gla_pool, ix.slots[:nd], ix.has_ctx[:nd])
            residual[:nd] += o.to(residual.dtype)
        if npf > 0:
            self._prefill(xn, residual, conv_pool, gla_pool, ix.slots, ix.has_ctx,
                          _prefill_groups(md, ix.qsl, ix.has_ctx, nd, nd + npf, self.chunk, self.H * self.K * self.V))

    def _forward_fast(self, md, ix, xn, residual, conv_pool, gla_pool) -> None:
        """The Triton paths of a step (no host sync: a decode-only batch may be captured in a full
        CUDA graph): the decode rows and all prefill requests packed, as one block of rows
        (`_rows_fast`).  The step's first layer records its launches and GEMMs on a tape that the
        later layers replay with their own tensors (export/ops/launch_tape.py: the host time of an
        eagerly run prefill step)."""
        nd, n = ix.nd, ix.n      # one token a decode row: the prefill tokens start at row nd
        roles = dict(conv_pool=conv_pool, gla_pool=gla_pool, conv_w=self.conv.weight, conv_b=self.conv.bias,
                     g_gamma=self.g_gamma, aug=self.aug_balance, norm=self.head_norm, w_qkvg=self.w_qkvg.weight,
                     w_out=self.w_out.weight, x_dec=xn[:nd], x_pf=xn[nd:n], res=residual[:n])
        held = ix.shared.setdefault("tape", launch_tape.Held())   # one per step, as ix is
        if held.tape is not None and held.tape.replay(roles):
            return
        tape = None
        if not held.tried and launch_tape.can_record(xn.device):
            held.tried = True
            tape = launch_tape.Tape(roles, direct_ok=xn.is_cuda)
        dec = (ix.slots[:nd], ix.keep8[:nd], ix.cu_decode) if nd > 0 else None
        pf = (ix.slots[nd:], ix.keep8[nd:], ix.cu_prefill) if ix.npf > 0 else None
        with tape.recording() if tape is not None else contextlib.nullcontext():
            self._rows_fast(roles["x_dec"], roles["x_pf"], roles["res"], conv_pool, gla_pool, dec, pf, tape)
        if tape is not None and tape.valid:
            held.tape = tape

    def _rows_graph(self, ix, xn, residual, conv_pool, gla_pool) -> None:
        """A step as a FULL-mode CUDA graph captures it (export/full_graph.py), for vLLM to replay for
        any batch of xn's rows: every request of the step through the prefill kernels, decode rows as
        one-token requests, with launch grids from the padded sizes only (N = xn's rows, R = the
        padded requests); nothing here may depend on the batch the capture happened to see.
        xn, residual [N, D]: residual += the mixer of xn, in place (rows after the last request pad
        the graph's batch: vLLM discards them)."""
        n = xn.shape[0]
        cu = ix.qsl.to(torch.int32)               # every request's rows, from row 0
        # each row's request: one searchsorted for the step's 24 layers, not one a layer
        req = ix.shared.get("row_req")
        if req is None or req.shape[0] != n:
            req = ix.shared["row_req"] = conv.row_requests(cu, n)
        self._rows_fast(xn[:0], xn, residual[:n], conv_pool, gla_pool, None, (ix.slots, ix.keep8, cu),
                        whole=True, row_req=req)

    def _rows_fast(self, x_dec, x_pf, residual, conv_pool, gla_pool, dec, pf, tape=None,
                   whole: bool = False, row_req=None) -> None:
        """A step's rows by the Triton kernels, states updated in the pools in place: nd decode rows
        (one token each), then the packed tokens of R prefill requests, as one block of rows.

        x_dec [nd, D], x_pf [T, D]; residual [nd + T, D] (a row block of the block's input,
        contiguous) += the mixer's output of those rows, in place.  dec: (slots [nd], keep [nd] bool
        or int8, cu 0..nd int32) of the decode rows; pf: (slots [R], keep [R], cu [R + 1] from the
        first prefill token) of the prefill requests; None where the step has none.  tape: the
        step's recording tape (x_dec, x_pf and residual are its roles "x_dec", "x_pf" and "res").
        whole: pf holds the step's every request (`_rows_graph`): the conv by its row-tiled kernel,
        the GLA of one-token requests by the decode kernel and of the others by the serial one, all
        with grids that depend on the sizes only; row_req: each row's request
        (`conv.row_requests`), None: made by the conv.

        Only the conv and the GLA differ between decode rows (one-token kernels) and prefill
        requests (chunked kernels), and each writes its own rows of one output, so the projection,
        the gated mix and w_out run once over all rows: in a mixed step three launches fewer (the
        host time a step with a prefill waits on, BENCHMARKS.md run S19 b) and one read of each
        weight matrix."""
        nd, T = x_dec.shape[0], x_pf.shape[0]
        dev = x_pf.device
        u = scratch(torch.empty((nd + T, x_pf.shape[1]), device=dev, dtype=x_pf.dtype))
        o = scratch(torch.empty((nd + T, self.H, self.V), device=dev, dtype=torch.float32))
        u_dec, u_pf, o_dec, o_pf = u[:nd], u[nd:], o[:nd], o[nd:]
        if tape is not None:     # the views the launches take: tensors of the step, as u and o
            tape.step(u_dec, u_pf, o_dec, o_pf, *(dec or ()), *(pf or ()))
        w, b = self.conv.weight, self.conv.bias
        if dec is not None:
            conv.conv_decode_inplace(conv_pool, dec[0], dec[1], x_dec, w, b, cu_seqlens=dec[2], out=u_dec)
        if pf is not None and whole:
            conv.conv_rows_inplace(conv_pool, pf[0], pf[1], x_pf, w, b, pf[2], out=u_pf, row_req=row_req)
        elif pf is not None:
            conv.conv_prefill_inplace(conv_pool, pf[0], pf[1], x_pf, w, b, pf[2], out=u_pf)
        q, k, v, g = self._project(u, tape)
        if dec is not None:
            qd, kd, vd = q[:nd], k[:nd], v[:nd]
            if tape is not None:
                tape.step(qd, kd, vd)
            gla_decode.gla_decode_inplace(gla_pool, dec[0], dec[1], qd, kd, vd, self.g_gamma, out=o_dec)
        if pf is not None:
            # the kernel reads q, k, v straight from the projection (strided views, x's dtype).  o
            # stays float32: a bf16 o (as JAX's chunk_simple_gla returns it) made the kernel slower
            # than the fused post gained (H200, 8 × 2,048 tokens: 0.349 vs 0.279 ms, and 0.179 vs
            # 0.197 ms; BENCHMARKS run S10)
            qp, kp, vp = q[nd:], k[nd:], v[nd:]
            if tape is not None:
                tape.step(qp, kp, vp)
            if whole:
                # the one-token requests (decode rows) by the decode kernel, the others by the serial
                # one; each kernel's programs for the other's requests do nothing (see WHOLE_STEP_*)
                gla_decode.gla_decode_inplace(gla_pool, pf[0], pf[1], qp, kp, vp, self.g_gamma, out=o_pf,
                                              cu_seqlens=pf[2])
            gla_prefill.gla_prefill_inplace(gla_pool, pf[0], pf[1], qp, kp, vp, self.g_gamma, pf[2],
                                            path="serial" if whole else None, skip_one=whole,
                                            num_stages=gla_prefill.WHOLE_STEP_STAGES if whole else None, out=o_pf)
        self._mix_out_fused(q, k, v, g, o, residual, tape)

    def _project(self, u, tape):
        """q, k [N, H, K], v, g [N, H, V]: views of u [N, D] w_qkvg^T (recorded on `tape`, if any)."""
        qkvg = tape.mm(u, "w_qkvg") if tape is not None else torch.mm(u, self.w_qkvg.weight.t())
        q, k, v, g = self.heads(qkvg)
        if tape is not None:
            tape.step(q, k, v, g)
        return q, k, v, g

    def _decode(self, xn, conv_pool, gla_pool, sl, keep):
        """The torch decode path: conv window and GLA state gathered from the pool at slots sl
        (zeros where keep is False), one forward_step, scattered back.  Returns [B, D]."""
        cs = torch.where(keep.view(-1, 1, 1), conv_pool[sl], 0.0)
        gs = torch.where(keep.view(-1, 1, 1, 1), gla_pool[sl], 0.0)
        o, cs, gs = self.forward_step(xn, cs, gs)
        conv_pool[sl] = cs.to(conv_pool.dtype)
        gla_pool[sl] = gs.to(gla_pool.dtype)
        return o

    def _mix_out_fused(self, q, k, v, g, o, residual, tape=None) -> None:
        """`mix_out` with gated_mix as one Triton kernel (export/ops/gated_mix.py): the same float32
        math (q, k, v, g, o of any float dtype upcast inside it), y [N, H·V] in residual's dtype,
        then residual [N, D] += y w_out^T as one in-place GEMM (cuBLAS adds the residual in its
        epilogue, to the float32 accumulator: one rounding; `addmm_` hands cuBLAS the residual rows
        as both C and the output, so nothing is copied).  q, k [N, H, K], v, g [N, H, V] (views of
        the projection), o [N, H, V]; residual: a row block of the block's input (contiguous), the
        recording tape's role "res" where there is a tape."""
        y = gated_mix.gated_mix_fused(q, k, v, g, o, self.aug_balance, self.head_norm, self.eps,
                                      residual.dtype)
        if tape is not None:
            tape.addmm_("res", y, "w_out")
        else:
            residual.addmm_(y, self.w_out.weight.t())

    def _prefill(self, xn, residual, conv_pool, gla_pool, slots, has_ctx, groups):
        """Prefill requests of equal query length run as one batch: states gathered from the pool
        (zeros for new sequences), one forward_seq, states scattered back and outputs added to
        their residual rows in place."""
        D = xn.shape[-1]
        for g in groups:
            G, L = len(g.rows), g.length
            if g.consecutive:                      # rows r0..r0+G-1: tokens s0 .. s0+G*L, no gather
                r0, s0 = g.rows[0], g.starts[0]
                sl = slots[r0: r0 + G]
                x = xn[s0: s0 + G * L].reshape(G, L, D)
                keep = has_ctx[r0: r0 + G]
            else:
                rows = torch.tensor(g.rows, device=xn.device)
                tok = (torch.tensor(g.starts, device=xn.device).view(G, 1)
                       + torch.arange(L, device=xn.device).view(1, L))              # [G, L]
                sl = slots[rows]
                x = xn[tok]
                keep = has_ctx[rows]
            if g.keep == "all":
                cs, gs = conv_pool[sl], gla_pool[sl]
            elif g.keep == "none":
                cs = conv_pool.new_zeros((G,) + conv_pool.shape[1:])
                gs = gla_pool.new_zeros((G,) + gla_pool.shape[1:])
            else:
                cs = torch.where(keep.view(-1, 1, 1), conv_pool[sl], 0.0)
                gs = torch.where(keep.view(-1, 1, 1, 1), gla_pool[sl], 0.0)
            o, cs, gs = self.forward_seq(x, cs, gs, self.chunk)
            conv_pool[sl] = cs.to(conv_pool.dtype)
            gla_pool[sl] = gs.to(gla_pool.dtype)
            if g.consecutive:
                residual[s0: s0 + G * L] += o.reshape(G * L, D).to(residual.dtype)
            else:
                residual[tok] += o.to(residual.dtype)     # tok: distinct rows


class _Group:
    __slots__ = ("rows", "starts", "length", "keep", "consecutive")

    def __init__(self, rows, starts, length, keep_flags):
        self.rows, self.starts, self.length = rows, starts, length
        self.keep = "all" if all(keep_flags) else ("none" if not any(keep_flags) else "some")
        self.consecutive = rows[-1] - rows[0] == len(rows) - 1


# bytes of per-chunk GLA states (U_c and S_c, float32) one forward_seq call may hold per tensor
_PREFILL_STATE_BUDGET = 512 << 20


def _prefill_groups(md, qsl, has_ctx, nd, nreq, chunk, hkv):
    """The prefill requests of this step grouped by query length (one host sync per step: the plan
    is kept on the step's metadata object, which every layer shares; `step_index.kept`)."""
    return step_index.kept(md, "_laplace_prefill_groups", (nd, nreq, int(md.num_prefill_tokens)),
                           lambda: _group_by_length(qsl.tolist(), has_ctx.tolist(), nd, nreq, chunk, hkv))


def _group_by_length(starts, keep_l, nd, nreq, chunk, hkv):
    """Requests nd..nreq-1 (query starts `starts`, has-context flags `keep_l`, host lists) grouped by
    query length, each group split to hold at most _PREFILL_STATE_BUDGET bytes of chunk states."""
    by_len = {}
    for r in range(nd, nreq):
        by_len.setdefault(starts[r + 1] - starts[r], []).append(r)
    groups = []
    for length, rows in by_len.items():
        if length <= 0:
            continue
        n_chunks = -(-length // max(1, min(chunk, length)))
        cap = max(1, _PREFILL_STATE_BUDGET // (n_chunks * hkv * 4))
        for i in range(0, len(rows), cap):
            part = rows[i: i + cap]
            groups.append(_Group(part, [starts[r] for r in part], length, [keep_l[r] for r in part]))
    return groups


def _laplace_mixer(xn: torch.Tensor, residual: torch.Tensor, layer_name: str) -> None:
    layer = get_forward_context().no_compile_layers[layer_name]
    layer._forward(xn, residual)


def _laplace_mixer_fake(xn: torch.Tensor, residual: torch.Tensor, layer_name: str) -> None:
    return


direct_register_custom_op(op_name="laplace_mixer", op_func=_laplace_mixer,
                          mutates_args=["residual"], fake_impl=_laplace_mixer_fake)


class LaplaceVllmBlock(nn.Module):
    def __init__(self, cfg: Arch, prefix: str):
        super().__init__()
        self.attn_norm = Norm(cfg.d_model)
        self.mixer = LaplaceVllmMixer(cfg, prefix=f"{prefix}.mixer")
        self.ffn_norm = Norm(cfg.d_model)
        self.w_12 = nn.Linear(cfg.d_model, 2 * cfg.ffn_dim, bias=False)
        self.w_3 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)
        self.eps = cfg.norm_eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] (vLLM's flattened tokens) → [N, D]."""
        xn = layer_norm(x, self.attn_norm.weight, self.eps)
        # x += mixer(xn), in place: x is this block's own (the embedding's or the last block's output)
        self.mixer(xn, x)
        z = layer_norm(x, self.ffn_norm.weight, self.eps)
        a, b = self.w_12(z).chunk(2, dim=-1)
        # the residual as the GEMM's addend (Inductor keeps an addmm whose users are not all
        # pointwise: here the next layer's LayerNorm and mixer), not a pass of its own
        return torch.addmm(x, nn.functional.silu(a) * b, self.w_3.weight.t())


class LaplaceVllmBackbone(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        cfg = _laplace_config(vllm_config.model_config.hf_config)
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # prefixes must hold exactly one integer (the layer index)
        self.layers = nn.ModuleList(LaplaceVllmBlock(cfg, prefix=f"layers.{i}")
                                    for i in range(cfg.num_layers))
        self.final_norm = Norm(cfg.d_model)

    def forward(self, input_ids: Optional[torch.Tensor], positions: torch.Tensor,
                inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        # the blocks add into x in place: a caller's inputs_embeds buffer is copied, not changed
        x = inputs_embeds.clone() if inputs_embeds is not None else self.embed(input_ids)
        for blk in self.layers:
            x = blk(x)
        return layer_norm(x, self.final_norm.weight, self.cfg.norm_eps)


if support_torch_compile is not None:
    LaplaceVllmBackbone = support_torch_compile(
        dynamic_arg_dims={"input_ids": 0, "positions": -1, "inputs_embeds": 0})(LaplaceVllmBackbone)


class LaplaceForCausalLM(nn.Module, HasInnerState, IsAttentionFree, SupportsMambaPrefixCaching):
    """vLLM entry class (architecture "LaplaceForCausalLM")."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        self.vllm_config = vllm_config
        checked_arch(vllm_config)
        self.backbone = LaplaceVllmBackbone(vllm_config=vllm_config, prefix=prefix)
        cfg = self.backbone.cfg
        self.config = vllm_config.model_config.hf_config
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    # --- state description (classmethods used by some vLLM paths)
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return state_shapes(checked_arch(vllm_config))

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return STATE_DTYPES

    @classmethod
    def get_mamba_state_copy_func(cls):
        # vLLM 0.26 calls this; 0.32 calls get_mamba_state_copy_funcs(types), which the
        # SupportsMambaPrefixCaching protocol maps onto it.
        # both states are whole per-block values: copy the block that holds the latest state
        from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
        return (get_temporal_copy_spec, get_temporal_copy_spec)

    def get_model_state_cls(self):
        """The per-model state class of vLLM's Model Runner V2 (which asks the model first).  With
        prefix caching ('align' mode): vLLM's Mamba state class, whose fused pre-copy moves each
        request's state page into the block a step writes, on the GPU (vLLM 0.26 gives an
        attention-free model `DefaultModelState` otherwise, which copies nothing, so a cache hit
        would start from a stale page); export/align_state.py's subclass of it, which also compiles
        the copy kernels for every batch size at start-up.  Without caching: `DefaultModelState`,
        0.26's choice."""
        if self.vllm_config.cache_config.mamba_cache_mode == "align":
            from export.align_state import LaplaceAlignModelState
            return LaplaceAlignModelState
        from vllm.v1.worker.gpu.model_states.default import DefaultModelState
        return DefaultModelState

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
