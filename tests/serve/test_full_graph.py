"""export/full_graph.py: when Laplace's vLLM steps run as whole CUDA graphs (FULL mode), the token
budget that goes with it, and the metadata builder that allows it.  The graph path's kernels and
mixer are checked in test_conv.py, test_gla_prefill.py and test_vllm_mixer.py (Triton's CPU
interpreter); the figures it gives on a GPU are in BENCHMARKS.md."""
import types

import pytest

from conftest import need

torch = need("torch")
need("vllm")

from vllm.config import CUDAGraphMode, VllmConfig  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.usage.usage_lib import UsageContext  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport  # noqa: E402

from export import full_graph  # noqa: E402

BASE = dict(user_mode=False, cuda=True, v2=True, prefix_caching=False, eager=False, server=True)


def test_wanted_for_the_server_where_the_user_chose_nothing_and_vllm_can_run_it():
    assert full_graph.wanted(**BASE, environ={})
    for key, value in (("user_mode", True), ("cuda", False), ("v2", False), ("prefix_caching", True),
                       ("eager", True), ("server", False)):
        assert not full_graph.wanted(**{**BASE, key: value}, environ={}), key
    assert not full_graph.wanted(**BASE, environ={full_graph.ENV: "0"})
    # with prefix caching only where asked for (not yet checked on a GPU against vLLM's mode)
    assert full_graph.wanted(**{**BASE, "prefix_caching": True}, environ={full_graph.ENV: "1"})
    # =1: the offline engine too (prefill_host's A/B), still not against the user's own mode
    assert full_graph.wanted(**{**BASE, "server": False}, environ={full_graph.ENV: "1"})
    assert not full_graph.wanted(**{**BASE, "server": False, "user_mode": True}, environ={full_graph.ENV: "1"})


@pytest.fixture
def on_cuda(monkeypatch):
    """The platform answers as a CUDA one (this CPU machine has none; the choice reads only that)."""
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)


def _config(**compilation):
    cfg = VllmConfig()
    cfg.cache_config.enable_prefix_caching = False        # as vLLM settles it for this model
    for k, v in compilation.items():
        setattr(cfg.compilation_config, k, v)
    return cfg


def test_the_config_hook_sets_full_only_when_asked(on_cuda):
    """`choose` (the config hook, any engine): FULL and graphs to GRAPH_TOKENS with
    LAPLACE_VLLM_FULL_GRAPHS=1 on V2; nothing without it (the server's defaults come earlier), on
    V1 or against the user's mode; with prefix caching only with =1; the user's capture sizes stay."""
    on = {"VLLM_USE_V2_MODEL_RUNNER": "1", full_graph.ENV: "1"}
    cfg = _config(cudagraph_mode=None, max_cudagraph_capture_size=None, cudagraph_capture_sizes=None)
    assert full_graph.choose(cfg, environ=on)
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.FULL
    assert cfg.compilation_config.max_cudagraph_capture_size == full_graph.GRAPH_TOKENS
    cfg = _config(cudagraph_mode=None, max_cudagraph_capture_size=None, cudagraph_capture_sizes=[1, 8])
    assert full_graph.choose(cfg, environ=on)
    assert cfg.compilation_config.max_cudagraph_capture_size is None
    cached = _config(cudagraph_mode=None)
    cached.cache_config.enable_prefix_caching = True
    for cfg, env in ((_config(cudagraph_mode=CUDAGraphMode.PIECEWISE), on),
                     (_config(cudagraph_mode=None), {"VLLM_USE_V2_MODEL_RUNNER": "1"}),
                     (_config(cudagraph_mode=None), {full_graph.ENV: "1"}),
                     (cached, {"VLLM_USE_V2_MODEL_RUNNER": "1"})):
        before = cfg.compilation_config.cudagraph_mode
        assert not full_graph.choose(cfg, environ=env)
        assert cfg.compilation_config.cudagraph_mode == before
    assert full_graph.choose(cached, environ=on)        # caching too, where =1 asks for it


LAP = types.SimpleNamespace(architectures=[full_graph.ARCH])


def _settled(args, usage=UsageContext.OPENAI_API_SERVER, model_config=LAP, environ=None):
    """What the wrapped `_set_default_max_num_seqs_and_batched_tokens_args` leaves in args: (mode,
    largest capture size, token budget).  vLLM's own part needs a model config with max_model_len."""
    full_graph.install_server_defaults()
    model_config = types.SimpleNamespace(architectures=model_config.architectures, max_model_len=8192,
                                         is_multimodal_model=False)
    parallel = types.SimpleNamespace(use_batched_dp_moe=False)
    args._set_default_max_num_seqs_and_batched_tokens_args(usage, model_config, parallel)
    cc = args.compilation_config
    return cc.cudagraph_mode, cc.max_cudagraph_capture_size, args.max_num_batched_tokens


def test_the_server_gets_whole_step_graphs_and_their_token_budget(on_cuda, monkeypatch):
    monkeypatch.delenv(full_graph.ENV, raising=False)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    full = (CUDAGraphMode.FULL, full_graph.GRAPH_TOKENS)
    assert _settled(EngineArgs(max_num_seqs=256)) == (*full, full_graph.GRAPH_TOKENS)
    assert _settled(EngineArgs(max_num_seqs=2048)) == (*full, 2048)          # vLLM: budget >= seqs
    assert _settled(EngineArgs(max_num_batched_tokens=4096, max_num_seqs=256)) == (*full, 4096)
    # not the offline engine, another model, prefix caching, eager, the user's mode, or switched off
    llama = types.SimpleNamespace(architectures=["LlamaForCausalLM"])
    server = UsageContext.OPENAI_API_SERVER
    for args, usage, model in ((EngineArgs(max_num_seqs=256), UsageContext.LLM_CLASS, LAP),
                               (EngineArgs(max_num_seqs=256), server, llama),
                               (EngineArgs(max_num_seqs=256, enable_prefix_caching=True), server, LAP),
                               (EngineArgs(max_num_seqs=256, enforce_eager=True), server, LAP)):
        mode, _, budget = _settled(args, usage, model)
        assert mode is None and budget != full_graph.GRAPH_TOKENS, (args, usage)
    args = EngineArgs(max_num_seqs=256)
    args.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    assert _settled(args)[0] == CUDAGraphMode.PIECEWISE and args.max_num_batched_tokens != full_graph.GRAPH_TOKENS
    monkeypatch.setenv(full_graph.ENV, "0")
    assert _settled(EngineArgs(max_num_seqs=256))[0] is None


def test_the_server_defaults_wrap_vllms_once():
    full_graph.install_server_defaults()
    first = EngineArgs._set_default_max_num_seqs_and_batched_tokens_args
    full_graph.install_server_defaults()
    assert EngineArgs._set_default_max_num_seqs_and_batched_tokens_args is first and first._laplace


def test_the_builder_declares_full_graphs_for_any_batch():
    """vLLM turns FULL into FULL_AND_PIECEWISE below ALWAYS; the mixer hands vLLM this backend
    without prefix caching (test_prefix_cache.py checks the 'align' one)."""
    assert full_graph.StateMetadataBuilder._cudagraph_support == AttentionCGSupport.ALWAYS
    assert full_graph.StateBackend.get_builder_cls() is full_graph.StateMetadataBuilder
    assert not full_graph.capturing_whole_step(torch.zeros(2), types.SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL))


def test_the_builders_keep_state_indices_at_one_address():
    """Both builders (without caching and 'align') declare full graphs for any batch and hand every
    build's state indices over in the same buffer: a replayed graph reads the captured address."""
    from export.prefix_cache import AlignStateMetadataBuilder, state_backend

    assert AlignStateMetadataBuilder.get_cudagraph_support(None, None) == AttentionCGSupport.ALWAYS
    assert state_backend("align").get_builder_cls() is AlignStateMetadataBuilder
    slots = torch.full((4,), -7, dtype=torch.int32)

    def md(ids):
        return types.SimpleNamespace(state_indices_tensor=torch.tensor(ids, dtype=torch.int32))

    first, again = full_graph.own_slots(slots, md([5, 2])), full_graph.own_slots(slots, md([3, 9, 1]))
    assert first.state_indices_tensor.data_ptr() == again.state_indices_tensor.data_ptr() == slots.data_ptr()
    assert again.state_indices_tensor.tolist() == [3, 9, 1] and slots.tolist() == [3, 9, 1, -7]
    over = torch.arange(5, dtype=torch.int32)        # more requests than the buffer: left as vLLM made it
    assert full_graph.own_slots(slots, types.SimpleNamespace(state_indices_tensor=over)).state_indices_tensor is over
