"""No Triton compile while serving (issue 32): the kernel variants that the vLLM mixer's launch code
produces over random steps are all among those its warm-up compiles when vLLM binds the state pool.

A variant is Triton's in-memory cache key (export/ops/launch_keys.triton_key: Triton's own binder
over the launch's arguments, plus the launch options); vLLM's JIT monitor fires exactly on a launch
whose key is not in that cache.  Nothing is launched here: `recording()` collects the keys (the
GEMMs around the kernels run on CPU tensors).  The pools are bound by vLLM's own
`MambaBase.bind_kv_cache` from a raw page buffer, as the engine binds them."""
import random

import pytest

from conftest import import_interpreted, interpreter_fixture, need

torch = need("torch")
need("vllm")

conv, gated_mix, gla_decode, gla_prefill, chunked, launch_keys, checks = import_interpreted(
    "export.ops.conv", "export.ops.gated_mix", "export.ops.gla_decode", "export.ops.gla_prefill",
    "export.ops.gla_prefill_chunked", "export.ops.launch_keys", "export.checks")

from laplace_jax.spec import Arch

# D = 36: a bf16 row of xn is 72 bytes, so xn[t0:] is 16-byte aligned only for even t0 (the conv
# prefill's x has two variants); D = 40 (80 bytes): always aligned.  H·ceil(V/64) = 2 programs
# per request: the serial GLA prefill grid never fills 132 SMs, so `prefill_path` picks by T.
ODD = dict(num_heads=2, d_k=8, d_v=18, d_model=36, qkvg_dim=2 * (16 + 36), decay_tiers=1)
EVEN = dict(num_heads=2, d_k=8, d_v=20, d_model=40, qkvg_dim=2 * (16 + 40), decay_tiers=2)
LENGTHS = (1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 300)


# `available()` holds for CPU tensors under TRITON_INTERPRET=1; one test runs the kernels
interpret = interpreter_fixture(conv._conv_prefill_kernel, conv._conv_rows_kernel, conv._conv_window_kernel,
                                gated_mix._gated_mix_kernel, gla_decode._gla_decode_kernel,
                                gla_prefill._gla_prefill_kernel, chunked._chunk_local_kernel,
                                chunked._chunk_pass_kernel, chunked._chunk_out_kernel)


def _bound_mixer(arch: dict, dtype: torch.dtype, num_blocks: int = 40):
    """A LaplaceVllmMixer of `arch` in `dtype` (built as vLLM builds it: default dtype set), its
    pools bound by vLLM's `bind_kv_cache` from a [blocks, 1, 1, page] int8 buffer whose pages
    carry 24 bytes of padding.  Returns (mixer, warm-up keys recorded during the binding)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from export.vllm_model import LaplaceVllmMixer

    cfg = Arch(num_layers=1, **arch)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with set_current_vllm_config(VllmConfig()):
            m = LaplaceVllmMixer(cfg, "layers.0.mixer")
    finally:
        torch.set_default_dtype(saved)
    assert m.g_gamma.dtype == torch.float32 and m.w_qkvg.weight.dtype == dtype
    C, D, H, K, V = cfg.conv_kernel, cfg.d_model, m.H, m.K, m.V
    page = 4 * (C * D + H * K * V) + 24
    raw = torch.zeros(num_blocks, 1, 1, page, dtype=torch.int8)
    with launch_keys.recording() as warm:
        m.bind_kv_cache(raw)
    assert m.kv_cache[1].shape == (num_blocks, H, K, V)
    return m, launch_keys.keys(warm)


def _random_step(rng: random.Random, num_blocks: int):
    """vLLM's metadata for a random step: 0-5 decode rows, then 0-6 prefill requests (at least one
    request) of lengths around the chunk edges, new or continued, on distinct slots."""
    from vllm.v1.attention.backends.linear_attn import LinearAttentionMetadata

    nd = rng.randint(0, 5)
    lens = [rng.choice(LENGTHS) for _ in range(rng.randint(0 if nd else 1, 6))]
    q = [1] * nd + lens
    qsl = torch.tensor([0, *torch.tensor(q).cumsum(0).tolist()], dtype=torch.int32)
    ctx = torch.tensor([rng.choice((0, 0, 5, 300)) if i >= nd else rng.randint(1, 99) for i in range(len(q))],
                       dtype=torch.int32)
    slots = torch.tensor(rng.sample(range(1, num_blocks), len(q)), dtype=torch.int32)
    return LinearAttentionMetadata(num_prefills=len(lens), num_prefill_tokens=sum(lens), num_decodes=nd,
                                   num_decode_tokens=nd, query_start_loc=qsl, seq_lens=ctx + qsl[1:] - qsl[:-1],
                                   state_indices_tensor=slots)


def _step_keys(m, md, monkeypatch, pad_rows: int, whole: bool = False) -> set:
    """The keys of the step's launches: by `_forward` (an eager step), or with `whole` by the path a
    FULL-mode CUDA graph captures (`_rows_graph`, export/full_graph.py) on the same step."""
    from export import step_index

    n = md.num_decode_tokens + md.num_prefill_tokens
    xn = torch.randn(n + pad_rows, m.cfg.d_model).to(m.w_qkvg.weight.dtype)
    residual = torch.zeros_like(xn)
    monkeypatch.setattr(m, "_metadata", lambda: md)
    with launch_keys.recording() as launches:
        if whole:
            m._rows_graph(step_index.derive(md), xn, residual, *m._pools())
        else:
            m._forward(xn, residual)
    return launch_keys.keys(launches)


@pytest.mark.parametrize("arch,dtype,variants", [(ODD, torch.bfloat16, 13), (EVEN, torch.bfloat16, 12),
                                                 (EVEN, torch.float32, 12)], ids=["D36-bf16", "D40-bf16", "D40-f32"])
def test_warm_up_covers_random_steps(arch, dtype, variants, monkeypatch):
    """Over 60 random steps (decode rows, prefill requests of 1 ... 300 tokens, mixes, padding
    rows), run eagerly and by the whole-step graph path, every key is one the warm-up recorded; the
    warm-up set is small and fixed: decode conv, decode GLA, gated mix (shared by decode and
    prefill), prefill conv (twice where a row of xn is not a multiple of 16 bytes), serial GLA
    prefill, the three chunked-prefill kernels, and the whole-step path's row-tiled conv and window
    kernels, decode GLA by request and serial GLA prefill (leaving one-token requests to the former;
    fewer pipeline stages: `gla_prefill.WHOLE_STEP_STAGES`)."""
    m, warm = _bound_mixer(arch, dtype)
    names = sorted(k[0] for k in warm)
    assert len(warm) == variants, names
    rng = random.Random(32)
    seen, paths = set(), set()
    for _ in range(60):
        md = _random_step(rng, 40)
        keys = _step_keys(m, md, monkeypatch, pad_rows=rng.randint(0, 3))
        assert keys <= warm, (md, keys - warm)
        whole = _step_keys(m, md, monkeypatch, pad_rows=rng.randint(0, 3), whole=True)
        assert whole <= warm, (md, whole - warm)
        seen |= keys | whole
        paths |= {k[0] for k in keys if "chunk" in k[0] or k[0] == "_gla_prefill_kernel"}
    assert paths == {"_gla_prefill_kernel", "_chunk_local_kernel", "_chunk_pass_kernel", "_chunk_out_kernel"}
    assert seen == warm            # and the warm-up compiles nothing a step cannot reach


def test_keys_see_what_triton_specializes():
    """The key is Triton's: a stride that is 1 (a constant to Triton) or a multiple of 16 makes
    another key, as does an input pointer off 16-byte alignment; the exempt arguments do not (the
    mix kernel's token count N; the index arrays' alignment)."""
    T, D, C = 40, 36, 4
    pool = torch.zeros(3, C, D)
    w, b = torch.randn(D, 1, C), torch.randn(D)
    x = torch.randn(T + 1, D).to(torch.bfloat16)

    def conv_launch(xx, slots, cu):
        with launch_keys.recording() as launches:
            conv.conv_prefill_inplace(pool, slots, torch.ones(1, dtype=torch.bool), xx, w, b, cu)
        (launch,) = launches
        return launch

    cu = torch.tensor([0, T], dtype=torch.int32)
    s = torch.tensor([1, 2], dtype=torch.long)
    launch = conv_launch(x[:T], s[:1], cu)
    base = launch_keys.triton_key(launch)
    assert launch_keys.triton_key(conv_launch(x[1:], s[:1], cu)) != base          # x off 16 bytes
    exempt = conv_launch(x[:T], s[1:], torch.tensor([7, 0, T], dtype=torch.int32)[1:])
    assert exempt.args[3].data_ptr() % 16 and exempt.args[5].data_ptr() % 16      # slots, cu
    assert launch_keys.triton_key(exempt) == base
    assert launch.args[8] == D                                                   # sx_t
    for stride, same in ((D + 8, True), (1, False), (32, False)):
        args = launch.args[:8] + (stride,) + launch.args[9:]
        assert (launch_keys.triton_key(launch._replace(args=args)) == base) == same, stride

    q, k, v, g, o, a, hn, eps = checks.gated_mix_inputs(17, 2, 8, 18, 1, torch.bfloat16, "cpu", seed=1)
    with launch_keys.recording() as launches:
        for n in (1, 16, 17):
            gated_mix.gated_mix_fused(q[:n], k[:n], v[:n], g[:n], o[:n], a, hn, eps, torch.bfloat16)
    assert len(launches) == 3 and len(launch_keys.keys(launches)) == 1


def test_warm_up_writes_only_the_null_slot():
    """Bound for real (the kernels run, in the interpreter), the warm-up changes slot 0 of the pools
    and nothing else: every other page of the raw buffer (the states of other sequences, the
    padding between pages) keeps its bytes."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from export.vllm_model import LaplaceVllmMixer

    cfg = Arch(num_layers=1, **ODD)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with set_current_vllm_config(VllmConfig()):
            m = LaplaceVllmMixer(cfg, "layers.0.mixer")
    finally:
        torch.set_default_dtype(saved)
    page = 4 * (cfg.conv_kernel * cfg.d_model + m.H * m.K * m.V) + 24
    raw = torch.randint(-128, 128, (6, 1, 1, page), dtype=torch.int8, generator=torch.Generator().manual_seed(2))
    before = raw.clone()
    m.bind_kv_cache(raw)
    assert not torch.equal(raw[0], before[0])              # the warm-up ran, in slot 0
    assert torch.equal(raw[1:], before[1:])
