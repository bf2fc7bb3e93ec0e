"""Whole vLLM steps as CUDA graphs: vLLM's FULL mode for Laplace, and the defaults that pick it.

Why: under vLLM's default FULL_AND_PIECEWISE mode a step with a prefill runs the 24 mixers eagerly,
between the CUDA-graph pieces of the rest of the model; their host time (7.6 ms a step for a lone
prompt and 11.2 ms beside 12 decodes on an H100, where the Llama peer's whole forward takes 3.6-5.2
ms; BENCHMARKS.md run S19 b) is what a new request's first token and the running requests' next
tokens wait on.  In FULL mode vLLM captures the whole forward, mixers included, once for each of
its capture sizes, and replays it for any batch of up to that many tokens: a step costs the host
one graph launch.

What it takes (checked in Triton's CPU interpreter by tests/serve/test_conv.py, test_gla_prefill.py
and test_vllm_mixer.py; the choice of mode by test_full_graph.py; on a GPU by `gpu_all.sh fullcheck`):
- launch grids that depend only on the step's padded size.  Inside a FULL capture the mixer
  (`LaplaceVllmMixer._rows_graph`) runs every request of the step, decode rows as one-token
  requests, through `conv.conv_rows_inplace` (tiles of rows, whatever their requests) and two GLA
  launches over all requests, each a program per request, head and value block: the decode kernel
  steps the one-token requests (the decode step's math and registers), the serial prefill kernel
  (one pipeline stage) the longer ones; each kernel's programs for the other's requests do nothing.
  The Python that picks paths by the batch's decode and prefill counts runs once, at capture, so it
  cannot be used there.
- metadata at fixed addresses: `StateMetadataBuilder` copies the state indices into a buffer of its
  own (vLLM's query_start_loc and seq_lens are its persistent input buffers already) and declares
  `AttentionCGSupport.ALWAYS`; vLLM's LINEAR builder declares single-token decodes only, for which
  vLLM turns FULL into FULL_AND_PIECEWISE.
- padding: vLLM pads a replayed batch with requests of no tokens (seq_len 0: step_index sends their
  slots to the null page) and with rows after the last request; the kernels leave the pages of
  requests without tokens untouched and give padding rows zeros.

The defaults: for the OpenAI server (`server_defaults`, from vLLM's engine arguments), FULL where
the user set no cudagraph_mode, on CUDA with Model Runner V2 and without prefix caching,
capture sizes up to GRAPH_TOKENS, and where the user set no token budget, GRAPH_TOKENS a step: a long
prompt is prefilled in chunks (vLLM's chunked prefill) that each run as a graph, so a running
request's next token waits on at most one such step (issue 32 item 4).  Larger steps run without
graphs.  The offline engine (`vllm.LLM`) keeps vLLM's FULL_AND_PIECEWISE: its decode steps run the
one-token decode kernels, faster than decode rows through the whole-step path (one H100, 12 rows:
4.47-4.56 against 5.25-5.28 ms a step, BENCHMARKS.md run S20 a), and its big prefill steps are
outside any graph either way.  LAPLACE_VLLM_FULL_GRAPHS=1 asks for FULL in any engine (the config
hook, `choose`), =0 in none; a cudagraph_mode or token budget of the user's own is kept.  With
prefix caching ('align' mode) the state indices come from export/prefix_cache.py's builder, which
keeps them in a buffer of its own as `StateMetadataBuilder` does; whole-step graphs run there only
with LAPLACE_VLLM_FULL_GRAPHS=1 until a GPU has checked them against vLLM's mode.
"""
import logging
import os
from collections.abc import Mapping

import torch

from vllm.config import CUDAGraphMode
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.linear_attn import LinearAttentionBackend, LinearAttentionMetadataBuilder

ENV = "LAPLACE_VLLM_FULL_GRAPHS"
ARCH = "LaplaceForCausalLM"
# Tokens of the largest captured step, and the OpenAI server's token budget a step.  A 2,048-token
# prompt is prefilled in two graph-sized steps; one request's 1,024 tokens still fill the GPU's
# GEMMs; the serial GLA kernel walks one request's 16 chunks of 64 in one of them.
GRAPH_TOKENS = 1024
log = logging.getLogger("vllm.laplace.full_graph")   # under vLLM's logger: its handler prints to the server log


def wanted(*, user_mode: bool, cuda: bool, v2: bool, prefix_caching: bool, eager: bool, server: bool,
           environ: Mapping[str, str] = os.environ) -> bool:
    """Whether to run whole steps as graphs: for the OpenAI server (LAPLACE_VLLM_FULL_GRAPHS=1: for
    any engine; =0: for none), where the user chose no cudagraph_mode, on CUDA with Model Runner V2,
    without enforce_eager, and with prefix caching only where =1 asks for it."""
    switch = environ.get(ENV)
    if switch == "0" or not (server or switch == "1"):
        return False
    if prefix_caching and switch != "1":     # 'align' states under whole-step graphs: not yet run on a GPU
        return False
    return not user_mode and cuda and v2 and not eager


def _set_full(cc) -> None:
    """FULL mode in compilation config `cc`, with graphs up to GRAPH_TOKENS unless sizes were set."""
    cc.cudagraph_mode = CUDAGraphMode.FULL
    if cc.max_cudagraph_capture_size is None and cc.cudagraph_capture_sizes is None:
        cc.max_cudagraph_capture_size = GRAPH_TOKENS
    log.info("Laplace: whole steps of up to %s tokens run as CUDA graphs (cudagraph_mode FULL; %s=0 "
             "keeps vLLM's FULL_AND_PIECEWISE)", cc.max_cudagraph_capture_size or "vLLM's largest", ENV)


def choose(vllm_config, environ: Mapping[str, str] = os.environ) -> bool:
    """The config hook's part, for an engine other than the OpenAI server (whose mode
    `server_defaults` set before): FULL mode where `wanted` (so with LAPLACE_VLLM_FULL_GRAPHS=1 only:
    benchmarks/prefill_host.py's A/B); whether it did.  Runs first in `VllmConfig.__post_init__`,
    while a mode the user did not set is still None."""
    from vllm.platforms import current_platform

    cc = vllm_config.compilation_config
    model = vllm_config.model_config
    if not wanted(user_mode=cc.cudagraph_mode is not None, cuda=current_platform.is_cuda(),
                  v2=environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1",
                  prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
                  eager=bool(model is not None and model.enforce_eager), server=False, environ=environ):
        return False
    _set_full(cc)
    return True


def server_defaults(args, usage_context, model_config, environ: Mapping[str, str] = os.environ) -> bool:
    """For Laplace's OpenAI server where `wanted`: FULL mode (graphs up to GRAPH_TOKENS) in the engine
    arguments' compilation config; whether it did (then `install_server_defaults` also makes an unset
    token budget GRAPH_TOKENS).  args: vLLM's EngineArgs, before vLLM settles its defaults; Model
    Runner V2 is assumed unless VLLM_USE_V2_MODEL_RUNNER=0 (the config hook asks for it later,
    export/model_runner.py)."""
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext

    if ARCH not in (getattr(model_config, "architectures", None) or []):
        return False
    cc = args.compilation_config
    if isinstance(cc, dict) or cc is None:          # not a CompilationConfig yet: leave it to vLLM
        return False
    if not wanted(user_mode=cc.cudagraph_mode is not None, cuda=current_platform.is_cuda(),
                  v2=environ.get("VLLM_USE_V2_MODEL_RUNNER") != "0",
                  prefix_caching=bool(args.enable_prefix_caching), eager=bool(args.enforce_eager),
                  server=usage_context == UsageContext.OPENAI_API_SERVER, environ=environ):
        return False
    _set_full(cc)
    return True


def install_server_defaults() -> None:
    """Wrap vLLM's `EngineArgs._set_default_max_num_seqs_and_batched_tokens_args` (where it settles an
    unset token budget by usage context, before the engine's config exists) with `server_defaults`,
    and where they apply and the user set no budget, GRAPH_TOKENS tokens a step (at least
    max_num_seqs, as vLLM requires) with chunked prefill on."""
    from vllm.engine.arg_utils import EngineArgs

    orig = EngineArgs._set_default_max_num_seqs_and_batched_tokens_args
    if getattr(orig, "_laplace", False):
        return

    def with_laplace_defaults(self, usage_context, model_config, *args, **kwargs):
        full = server_defaults(self, usage_context, model_config)
        budget = full and self.max_num_batched_tokens is None and self.enable_chunked_prefill is not False
        orig(self, usage_context, model_config, *args, **kwargs)
        if budget:
            self.max_num_batched_tokens = max(GRAPH_TOKENS, self.max_num_seqs)
            log.info("Laplace: %d tokens a step (each step one CUDA graph; --max-num-batched-tokens "
                     "sets another)", self.max_num_batched_tokens)

    with_laplace_defaults._laplace = True
    EngineArgs._set_default_max_num_seqs_and_batched_tokens_args = with_laplace_defaults


def capturing_whole_step(x: torch.Tensor, compilation_config) -> bool:
    """Whether the mixer runs inside the capture of a FULL-mode graph (one that vLLM replays for any
    batch of its size, decode-only or mixed), rather than a uniform-decode graph of
    FULL_AND_PIECEWISE or an eager step."""
    return (x.is_cuda and torch.cuda.is_current_stream_capturing()
            and compilation_config.cudagraph_mode == CUDAGraphMode.FULL)


def own_slots(slots: torch.Tensor, md):
    """`md` (vLLM's linear-attention metadata) with its state indices copied into `slots` [max_num_seqs]
    int32, a buffer of the builder's own: a replayed graph reads the captured address, where vLLM's
    builders hand over a view of a buffer it rewrites, or a fresh gather ('align' mode)."""
    n = md.state_indices_tensor.shape[0]
    if n <= slots.shape[0]:
        slots[:n].copy_(md.state_indices_tensor, non_blocking=True)
        md.state_indices_tensor = slots[:n]
    return md


class OwnSlotsBuilder:
    """What a linear-attention metadata builder needs for whole-step graphs, mixed in before vLLM's
    builder class: the state indices in a buffer of its own (`own_slots`) and full CUDA graphs
    declared for any batch (vLLM's LINEAR builder declares single-token decodes, Bailing's uniform
    batches; below ALWAYS vLLM turns FULL into FULL_AND_PIECEWISE)."""

    _cudagraph_support = AttentionCGSupport.ALWAYS

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return AttentionCGSupport.ALWAYS       # Bailing's builder overrides this classmethod itself

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._slots = torch.zeros(vllm_config.scheduler_config.max_num_seqs, dtype=torch.int32, device=device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False, **kw):
        return own_slots(self._slots, super().build(common_prefix_len, common_attn_metadata, fast_build, **kw))


class StateMetadataBuilder(OwnSlotsBuilder, LinearAttentionMetadataBuilder):
    """vLLM's LINEAR metadata, with `OwnSlotsBuilder`'s state-index buffer and full graphs."""


class StateBackend(LinearAttentionBackend):
    """The LINEAR backend with `StateMetadataBuilder` (the mixer's `get_attn_backend` without prefix
    caching)."""

    @staticmethod
    def get_builder_cls():
        return StateMetadataBuilder
