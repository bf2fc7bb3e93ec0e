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

BASE = dict(user_mode=False, cuda=True, v2=True, prefix_caching=False, eager=False)


def test_wanted_only_where_the_user_chose_nothing_and_vllm_can_run_it():
    assert full_graph.wanted(**BASE, environ={})
    for key, value in (("user_mode", True), ("cuda", False), ("v2", False), ("prefix_caching", True),
                       ("eager", True)):
        assert not full_graph.wanted(**{**BASE, key: value}, environ={}), key
    assert not full_graph.wanted(**BASE, environ={full_graph.ENV: "0"})
    assert full_graph.wanted(**BASE, environ={full_graph.ENV: "1"})


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


def test_choose_sets_full_and_the_capture_size_unless_the_user_set_them(on_cuda):
    v2 = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    cfg = _config(cudagraph_mode=None, max_cudagraph_capture_size=None, cudagraph_capture_sizes=None)
    assert full_graph.choose(cfg, environ=v2)
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.FULL
    assert cfg.compilation_config.max_cudagraph_capture_size == full_graph.GRAPH_TOKENS
    # the user's own sizes stay; FULL still chosen
    cfg = _config(cudagraph_mode=None, max_cudagraph_capture_size=None, cudagraph_capture_sizes=[1, 8])
    assert full_graph.choose(cfg, environ=v2)
    assert cfg.compilation_config.max_cudagraph_capture_size is None
    # the user's mode, V1, prefix caching, or the switch: nothing changed
    cached = _config(cudagraph_mode=None)
    cached.cache_config.enable_prefix_caching = True
    for cfg, env in ((_config(cudagraph_mode=CUDAGraphMode.PIECEWISE), v2),
                     (_config(cudagraph_mode=None), {}), (cached, v2),
                     (_config(cudagraph_mode=None), {**v2, full_graph.ENV: "0"})):
        before = cfg.compilation_config.cudagraph_mode
        assert not full_graph.choose(cfg, environ=env)
        assert cfg.compilation_config.cudagraph_mode == before


def test_the_token_budget_is_the_graph_size_for_the_openai_server_only(on_cuda, monkeypatch):
    monkeypatch.delenv(full_graph.ENV, raising=False)
    lap = types.SimpleNamespace(architectures=[full_graph.ARCH])
    server = UsageContext.OPENAI_API_SERVER
    assert full_graph.budget_tokens(EngineArgs(), server, lap) == full_graph.GRAPH_TOKENS
    assert full_graph.budget_tokens(EngineArgs(max_num_seqs=2048), server, lap) == 2048
    assert full_graph.budget_tokens(EngineArgs(), UsageContext.LLM_CLASS, lap) is None
    llama = types.SimpleNamespace(architectures=["LlamaForCausalLM"])
    assert full_graph.budget_tokens(EngineArgs(), server, llama) is None
    for args in (EngineArgs(max_num_batched_tokens=4096), EngineArgs(enable_prefix_caching=True),
                 EngineArgs(enforce_eager=True), EngineArgs(enable_chunked_prefill=False),
                 EngineArgs(compilation_config={"cudagraph_mode": "PIECEWISE"})):
        assert full_graph.budget_tokens(args, server, lap) is None, args
    monkeypatch.setenv(full_graph.ENV, "0")
    assert full_graph.budget_tokens(EngineArgs(), server, lap) is None


def test_the_budget_default_wraps_vllms_once():
    full_graph.install_budget_default()
    first = EngineArgs._set_default_max_num_seqs_and_batched_tokens_args
    full_graph.install_budget_default()
    assert EngineArgs._set_default_max_num_seqs_and_batched_tokens_args is first and first._laplace


def test_the_builder_declares_full_graphs_for_any_batch():
    """vLLM turns FULL into FULL_AND_PIECEWISE below ALWAYS; the mixer hands vLLM this backend
    without prefix caching (test_prefix_cache.py checks the 'align' one)."""
    assert full_graph.StateMetadataBuilder._cudagraph_support == AttentionCGSupport.ALWAYS
    assert full_graph.StateBackend.get_builder_cls() is full_graph.StateMetadataBuilder
    assert not full_graph.capturing_whole_step(torch.zeros(2), types.SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL))
