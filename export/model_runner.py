"""Which of vLLM's GPU model runners serves Laplace: Model Runner V2 unless the user chose.

vLLM 0.26 picks V2 by itself for most models but keeps attention-free ones on V1
(`VllmConfig._is_default_v2_model_runner_model`). For this model V2 is the faster one: it prepares a
step's inputs on the GPU, and a decode step at width 1,280 went 52.8 -> 38.8 ms with it (H200,
BENCHMARKS.md run S11); prefix caching works on it too (run S17 c). So the model's config hook
(`export/config_hook.py`) asks for V2 through vLLM's own switch, the VLLM_USE_V2_MODEL_RUNNER
variable, where vLLM would give V2 to another model: a CUDA platform with Triton, no feature that V2
lacks (`_get_v2_model_runner_unsupported_features`), and no choice made by the user (a set variable
is theirs, 0 included). The hook runs first in `VllmConfig.__post_init__`, before anything reads the
runner, in the front-end process; the engine processes it starts inherit the variable. It stays set
in that process: another engine started later in the same Python process, for another model, runs on
V2 too, as if the user had set it.
"""
import logging
import os
from collections.abc import MutableMapping, Sequence

ENV = "VLLM_USE_V2_MODEL_RUNNER"
log = logging.getLogger(__name__)


def wants_v2(*, user_set: bool, cuda: bool, has_triton: bool, unsupported: Sequence[str]) -> bool:
    """Whether to ask for V2: the user left the choice to vLLM, and vLLM could run V2 here."""
    return not user_set and cuda and has_triton and not unsupported


def prefer_v2(vllm_config, environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set VLLM_USE_V2_MODEL_RUNNER=1 in `environ` when `wants_v2` for `vllm_config`; whether it did."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    features = getattr(vllm_config, "_get_v2_model_runner_unsupported_features", None)
    unsupported = features() if callable(features) else ["(this vLLM names none)"]
    want = wants_v2(user_set=ENV in environ, cuda=current_platform.is_cuda(), has_triton=bool(HAS_TRITON),
                    unsupported=unsupported)
    if want:
        environ[ENV] = "1"
        log.info("Laplace: serving on vLLM's Model Runner V2 (set %s=0 for V1)", ENV)
    return want
