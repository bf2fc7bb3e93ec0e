"""vLLM's per-architecture config hook for Laplace (`MODELS_CONFIG_MAP["LaplaceForCausalLM"]`, set by
export/vllm_plugin.py): the model runner (export/model_runner.py), the prefix-caching mode
(export/prefix_cache.py) and whole-step CUDA graphs (export/full_graph.py), then vLLM's own hook
for attention-free state models (mamba_block_size, the chunked-prefill check)."""
import logging

from vllm.model_executor.models.config import MambaModelConfig

from export import full_graph
from export.model_runner import prefer_v2
from export.prefix_cache import choose_mamba_cache_mode


log = logging.getLogger(__name__)


class LaplaceMambaConfig(MambaModelConfig):
    @classmethod
    def verify_and_update_config(cls, vllm_config) -> None:
        try:
            prefer_v2(vllm_config)
        except (AttributeError, ImportError, TypeError, ValueError) as e:   # a vLLM whose config it cannot read
            log.warning("Laplace: kept vLLM's model-runner choice (%s: %s); VLLM_USE_V2_MODEL_RUNNER=1 asks "
                        "for V2", type(e).__name__, e)
        cache = vllm_config.cache_config
        cache.mamba_cache_mode = choose_mamba_cache_mode(bool(cache.enable_prefix_caching),
                                                         cache.mamba_cache_mode)
        full_graph.choose(vllm_config)          # after the runner: FULL graphs need V2
        super().verify_and_update_config(vllm_config)
