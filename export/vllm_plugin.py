"""vLLM general plugin: makes stock vLLM serve exported Laplace folders with no flags.

Registered as the `vllm.general_plugins` entry point `laplace = export.vllm_plugin:register`.
vLLM calls `register()` in every process it starts; it is idempotent.
"""

ARCH = "LaplaceForCausalLM"
MODEL_TYPE = "laplace"
OP = "vllm::laplace_mixer"
_done = False


def register() -> None:
    global _done
    if _done:
        return
    from transformers import AutoConfig

    from export.hf_config import LaplaceHFConfig

    try:
        AutoConfig.register(MODEL_TYPE, LaplaceHFConfig)
    except ValueError:  # already registered (e.g. by an earlier import in this process)
        pass

    from vllm import ModelRegistry

    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, "export.vllm_model:LaplaceForCausalLM")

    # vLLM's own hook for attention-free state models (mamba_block_size etc.), with the model runner
    # and the prefix-caching mode chosen first (export/config_hook.py)
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from export.config_hook import LaplaceMambaConfig
    MODELS_CONFIG_MAP.setdefault(ARCH, LaplaceMambaConfig)

    # Piecewise CUDA graphs must split at the stateful mixer (its control flow depends on the batch),
    # as they do at vLLM's own attention / mamba ops.
    from vllm.config import CompilationConfig
    ops = getattr(CompilationConfig, "_attention_ops", None)
    if isinstance(ops, list) and OP not in ops:
        ops.append(OP)

    # the OpenAI server's whole-step CUDA graphs and token budget, where the user sets neither
    # (export/full_graph.py)
    from export.full_graph import install_server_defaults
    install_server_defaults()
    _done = True
