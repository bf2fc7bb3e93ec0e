"""The vLLM mixer's Triton paths (export/vllm_model.py: decode conv and GLA kernels, packed conv + GLA
prefill, the fused gated_mix after each; Triton's CPU interpreter) against its torch paths, on one
mixed step.  TRITON_INTERPRET=1 around the imports and for the calls, as
tests/serve/test_gla_prefill.py says."""
import copy
import types

import pytest

from conftest import U32, import_interpreted, interpreter_fixture, need

torch = need("torch")

conv, gla_decode, gla_prefill, gated_mix, checks = import_interpreted(
    "export.ops.conv", "export.ops.gla_decode", "export.ops.gla_prefill", "export.ops.gated_mix", "export.checks")

interpret = interpreter_fixture(conv._conv_prefill_kernel, conv._conv_rows_kernel, conv._conv_window_kernel,
                                gla_decode._gla_decode_kernel, gla_prefill._gla_prefill_kernel,
                                gated_mix._gated_mix_kernel)


def _layer(seed: int, prefix: str):
    """A mixer of the tiny config with random weights from `seed` (layer `prefix` of a model)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from export.vllm_model import LaplaceVllmMixer
    from laplace_jax.config import load_config

    g = torch.Generator().manual_seed(seed)
    with set_current_vllm_config(VllmConfig()):
        m = LaplaceVllmMixer(load_config("laplace_tiny").model, prefix)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 1.0) + (p.dim() == 1))
    return m.eval()


@pytest.fixture(scope="module")
def mixer():
    """A LaplaceVllmMixer of the tiny config with random weights (built in a default VllmConfig)."""
    need("vllm")
    return _layer(5, "layers.0.mixer")


def _step(nd, lens, ctx, slots):
    """A metadata object with the fields the mixer reads: nd decode rows (1 token each) then the
    prefill requests of `lens` tokens; ctx: context tokens before this step, per request."""
    q = [1] * nd + list(lens)
    qsl = torch.tensor([0, *torch.tensor(q).cumsum(0).tolist()], dtype=torch.int32)
    return types.SimpleNamespace(
        num_decodes=nd, num_prefills=len(lens), num_decode_tokens=nd, num_prefill_tokens=sum(lens),
        query_start_loc=qsl, seq_lens=torch.tensor(ctx, dtype=torch.int32) + qsl[1:] - qsl[:-1],
        state_indices_tensor=torch.tensor(slots, dtype=torch.int32))


def _run(m, raw, md, xn, res, rows, triton_on, monkeypatch):
    """The mixer's _forward on this step with its pools inside the page buffer `raw` (changed in
    place) and residual res; Triton paths on or off.  Returns the output [rows, D] (res + mixer)."""
    C, D = m.cfg.conv_kernel, m.cfg.d_model
    conv_pool = raw[:, 3:3 + C * D].unflatten(1, (C, D))
    gla_pool = raw[:, 3 + C * D: 3 + C * D + m.H * m.K * m.V].unflatten(1, (m.H, m.K, m.V))
    monkeypatch.setenv("LAPLACE_VLLM_TRITON", "1" if triton_on else "0")
    monkeypatch.setattr(m, "_metadata", lambda: md)
    monkeypatch.setattr(m, "_pools", lambda: (conv_pool, gla_pool))
    out = res[:rows].clone()                 # the mixer adds into its residual rows in place
    m._forward(xn, out)
    return out


def _assert_as_torch_path(m, md, got, want, res, raw_t, raw, slots):
    """A Triton path's step (outputs got, pages raw_t) against the torch path's (want, raw): each
    request's rows and GLA state within the bounds below, conv windows equal, other pages unchanged.

    o: each path within prefill_tolerance('ieee') of the exact GLA; gated_mix's head RMSNorm keeps a
    relative error; gated_mix itself (torch ops or the fused kernel) adds its own float32 rounding,
    relative (λ√V/2 + ~20)u per checks.gated_mix_error_bound, twice; w_out adds a D-term float32 sum
    (λ·D·u for random signs, each path); the residual add rounds once per path (the Triton path adds
    it in the GEMM, the torch path after it): u |res + mixer| each."""
    C, D, H, K, V = m.cfg.conv_kernel, m.cfg.d_model, m.H, m.K, m.V
    post = 2 * 2 * (6 * V ** 0.5 / 2 + 20) * U32
    tol = 2 * 2 * checks.prefill_tolerance("ieee", gla_prefill.CHUNK, K) + post + 2 * 6 * D * U32
    starts = md.query_start_loc.tolist()
    for r, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
        assert torch.isfinite(got[a:b]).all(), r
        mix = want[a:b] - res[a:b]
        assert float((got[a:b] - want[a:b]).norm()) <= tol * float(mix.norm()) + 2 * U32 * float(want[a:b].norm()), r
    cs = slice(3, 3 + C * D)
    gs = slice(3 + C * D, 3 + C * D + H * K * V)
    assert torch.equal(raw_t[slots][:, cs], raw[slots][:, cs])                   # input copies: exact
    for s in slots:
        rel = float((raw_t[s, gs] - raw[s, gs]).norm() / raw[s, gs].norm())
        assert rel <= 2 * checks.prefill_tolerance("ieee", gla_prefill.CHUNK, K)
    others = [s for s in range(raw.shape[0]) if s not in slots]
    assert torch.equal(raw_t[others].view(torch.int32), raw[others].view(torch.int32))


def test_vllm_mixer_triton_prefill_equals_torch_path(mixer, monkeypatch):
    """A mixed step: 2 decode rows, then prefill requests of 1, 3, 17, 40 and 5 tokens (new and
    continued ones; pages of new sequences hold NaN), 4 padding rows.  The Triton paths (decode
    conv and GLA kernels; packed conv + GLA prefill; the fused gated_mix after each, interpreter) against the
    torch paths: outputs and GLA states within float32 rounding, conv windows equal."""
    m = mixer
    C, D, H, K, V = m.cfg.conv_kernel, m.cfg.d_model, m.H, m.K, m.V
    g = torch.Generator().manual_seed(8)
    lens, ctx = [1, 3, 17, 40, 5], [5, 0, 0, 7, 12, 33, 0]          # ctx: decodes first
    slots = [4, 9, 2, 7, 11, 1, 5]
    md = _step(2, lens, ctx, slots)
    n = 2 + sum(lens)
    raw = torch.randn(13, 3 + C * D + H * K * V + 5, generator=g)
    for r, c in enumerate(ctx):
        if c == 0:
            raw[slots[r]] = float("nan")
    xn = torch.randn(n + 4, D, generator=g)
    res = torch.randn(n + 4, D, generator=g)                  # the block's residual stream
    raw_t = raw.clone()
    calls = []
    for mod, name in ((gla_prefill, "gla_prefill_inplace"), (conv, "conv_prefill_inplace"),
                      (gated_mix, "gated_mix_fused")):
        f = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, f=f, name=name, **kw: calls.append(name) or f(*a, **kw))
    got = _run(m, raw_t, md, xn, res, n + 4, True, monkeypatch)
    # the decode rows' conv (one-token tiles of the packed kernel), the prefill's packed conv and
    # GLA, then one fused post over all rows
    assert calls == ["conv_prefill_inplace", "conv_prefill_inplace", "gla_prefill_inplace", "gated_mix_fused"]
    want = _run(m, raw, md, xn, res, n + 4, False, monkeypatch)
    assert len(calls) == 4                                                 # the torch path: none

    assert torch.equal(got[n:], res[n:]) and torch.equal(want[n:], res[n:])     # padding: mixer output 0
    _assert_as_torch_path(m, md, got, want, res, raw_t, raw, slots)
    gs = slice(3 + C * D, 3 + C * D + H * K * V)
    edges = torch.cat([raw_t[:, :3], raw_t[:, gs.stop:]], 1), torch.cat([raw[:, :3], raw[:, gs.stop:]], 1)
    assert torch.equal(edges[0].view(torch.int32), edges[1].view(torch.int32))     # NaN-aware


def test_whole_step_graph_path_equals_torch_path(mixer, monkeypatch):
    """The path a FULL-mode CUDA graph captures (`_rows_graph`, export/full_graph.py) on a step as vLLM
    pads it for a graph: 3 decode rows, prefill requests of 2, 17 and 1 tokens, two requests of no
    tokens (seq_len 0) whose stale slots are live requests' pages, 5 rows after the last request.
    Against the torch path on the unpadded step: outputs and states within the bounds of the mixed
    step's test, conv windows equal, the live pages not overwritten by the empty requests."""
    from export import step_index

    m = mixer
    C, D, H, K, V = m.cfg.conv_kernel, m.cfg.d_model, m.H, m.K, m.V
    g = torch.Generator().manual_seed(12)
    lens, ctx, slots = [2, 17, 1], [4, 9, 1, 0, 6, 0], [6, 2, 9, 4, 11, 3]
    md = _step(3, lens, ctx, slots)
    n = 3 + sum(lens)
    padded = _step(3, lens + [0, 0], ctx + [0, 0], slots + [2, 4])
    padded.seq_lens[-2:] = 0
    raw = torch.randn(13, 3 + C * D + H * K * V + 5, generator=g)
    for r, c in enumerate(ctx):
        if c == 0:
            raw[slots[r]] = float("nan")
    xn = torch.randn(n + 5, D, generator=g)
    res = torch.randn(n + 5, D, generator=g)
    raw_t = raw.clone()
    want = _run(m, raw, md, xn[:n], res, n, False, monkeypatch)
    conv_pool = raw_t[:, 3:3 + C * D].unflatten(1, (C, D))
    gla_pool = raw_t[:, 3 + C * D: 3 + C * D + H * K * V].unflatten(1, (H, K, V))
    got = res.clone()
    monkeypatch.setenv("LAPLACE_VLLM_TRITON", "1")
    ix = step_index.derive(padded)
    with torch.no_grad():
        m._rows_graph(ix, xn, got, conv_pool, gla_pool)
    # each row's request, kept for the step's other layers: the 3 decode rows, the prefill requests'
    # rows, then the 5 padding rows past the last of the 8 (padded) requests
    want_req = [0, 1, 2] + [3] * 2 + [4] * 17 + [5] + [8] * 5
    assert ix.shared["row_req"].tolist() == want_req
    _assert_as_torch_path(m, md, got, want, res, raw_t, raw, slots)


def test_step_index_once_per_step_and_as_derived(mixer, monkeypatch):
    """The step's index arrays (export/step_index.py) against a plain-list reference, derived by
    the first layer's mixer and reused by the next (no index op in its dispatches), and derived
    afresh for the next step's metadata object."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from export import step_index
    from export.ops import launch_keys

    lens, ctx, slots = [3, 17], [5, 0, 0, 7], [4, -1, 2, 7]        # 2 decode rows; row 1 pads (slot -1)
    md = _step(2, lens, ctx, slots)
    md.seq_lens[1] = 0
    ix = step_index.of_step(md)
    starts = [0, 1, 2, 5, 22]
    assert (ix.nd, ix.npf, ix.n) == (2, 2, 22) and ix.qsl.tolist() == starts
    assert ix.slots.dtype == torch.int64 and ix.slots.tolist() == [4, 0, 2, 7]           # padding → null slot
    assert ix.has_ctx.tolist() == [True, False, False, True] and ix.keep8.tolist() == [1, 0, 0, 1]
    assert ix.cu_decode.tolist() == [0, 1, 2] and ix.cu_prefill.tolist() == [0, 3, 20]
    assert ix.cu_prefill.dtype == ix.cu_decode.dtype == torch.int32
    assert step_index.of_step(md) is ix and step_index.of_step(_step(2, lens, ctx, slots)) is not ix
    # a shallow copy with other state indices (vLLM's update_block_table for another state group)
    # keeps md's attribute, not its slots
    other = copy.copy(md)
    other.state_indices_tensor = torch.tensor([1, 3, 5, 6], dtype=torch.int32)
    assert step_index.of_step(other).slots.tolist() == [1, 0, 5, 6] and step_index.of_step(md) is ix

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    C, D, H, K, V = mixer.cfg.conv_kernel, mixer.cfg.d_model, mixer.H, mixer.K, mixer.V
    pools = torch.zeros(8, C, D), torch.zeros(8, H, K, V)
    monkeypatch.setattr(mixer, "_pools", lambda: pools)
    fresh = _step(2, lens, ctx, slots)
    monkeypatch.setattr(mixer, "_metadata", lambda: fresh)
    xn, res = torch.zeros(22, D), torch.zeros(22, D)
    derive_ops = {"where", "zeros_like", "arange", "bitwise_or", "gt", "le", "lt"}
    counts = []
    with launch_keys.recording(), torch.no_grad():
        for _layer in range(2):
            with Ops() as ops:
                mixer._forward(xn, res)
            counts.append(ops.names)
    assert derive_ops <= set(counts[0]) and not derive_ops & set(counts[1]), counts
    assert len(counts[1]) <= len(counts[0]) - len(derive_ops)


LAUNCHERS = ((conv, "conv_prefill_inplace"), (gla_prefill, "gla_prefill_inplace"),
             (gla_decode, "gla_decode_inplace"), (gated_mix, "gated_mix_fused"))


@pytest.mark.parametrize("shape", ["mixed", "lone"])
def test_later_layers_replay_the_first_layers_launches_exactly(mixer, monkeypatch, shape):
    """export/ops/launch_tape.py: within one step, layers after the first replay the first layer's
    recorded launches and GEMMs with their own tensors (no launcher runs: 0 calls) and get the very
    bits of running the launchers themselves (LAPLACE_VLLM_REPLAY=0): outputs and both pools, three
    layers, a mixed step (decode rows + 5 prefills, serial GLA) and a lone prompt (chunked GLA).
    On the mixed step also: a layer whose residual has other strides runs live; a first layer whose
    input the launchers must copy (not row-major) makes no tape."""
    from export.ops import launch_keys

    layers = [mixer, _layer(21, "layers.1.mixer"), _layer(22, "layers.2.mixer")]
    C, D, H, K, V = mixer.cfg.conv_kernel, mixer.cfg.d_model, mixer.H, mixer.K, mixer.V
    if shape == "mixed":
        nd, lens, ctx, slots = 2, [1, 3, 17, 40, 5], [5, 0, 0, 7, 12, 33, 0], [4, 9, 2, 7, 11, 1, 5]
    else:
        nd, lens, ctx, slots = 0, [300], [0], [3]
    n = nd + sum(lens)
    g = torch.Generator().manual_seed(9)
    pools0 = [(torch.randn(13, C, D, generator=g), torch.randn(13, H, K, V, generator=g)) for _ in layers]
    xns = [torch.randn(n + 2, D, generator=g) for _ in layers]
    res0 = torch.randn(n + 2, D, generator=g)
    monkeypatch.setenv("LAPLACE_VLLM_TRITON", "1")
    calls, launches = [], []
    for mod, name in LAUNCHERS:
        f = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, f=f, name=name, **kw: calls.append(name) or f(*a, **kw))
    run = launch_keys.run
    for mod in (launch_keys, conv, gla_decode, gla_prefill, gla_prefill.chunked, gated_mix):   # run's users
        monkeypatch.setattr(mod, "run", lambda launch: launches.append(launch.kernel) or run(launch))

    def step(replay: str, strided_layer: int = -1, xn_first=None):
        monkeypatch.setenv("LAPLACE_VLLM_REPLAY", replay)
        md = _step(nd, lens, ctx, slots)
        pools = [(c.clone(), s.clone()) for c, s in pools0]
        res = res0.clone()
        per_layer = []
        for i, (m, p) in enumerate(zip(layers, pools)):
            monkeypatch.setattr(m, "_metadata", lambda: md)
            monkeypatch.setattr(m, "_pools", lambda p=p: p)
            calls.clear()
            launches.clear()
            target = res
            if i == strided_layer:          # the residual as a column block of a wider buffer
                target = torch.zeros(n + 2, 2 * D)[:, :D]
                target.copy_(res)
            m._forward(xns[i] if i or xn_first is None else xn_first, target)
            res.copy_(target)
            per_layer.append((list(calls), len(launches)))
        return res, pools, per_layer

    live, live_pools, live_calls = step("0")
    got, got_pools, got_calls = step("1")
    assert live_calls[0][0] and all(c == live_calls[0] for c in live_calls)   # live: every layer runs them
    assert got_calls[0] == live_calls[0]                                    # layer 0 records
    assert got_calls[1:] == [([], live_calls[0][1])] * 2                    # later layers replay its launches
    assert torch.equal(got, live)
    for (a, b), (c, d) in zip(got_pools, live_pools):
        assert torch.equal(a, c) and torch.equal(b, d)

    if shape != "mixed":       # the fallbacks below do not depend on the step's shape
        return
    # layer 1's residual has other strides: it runs the launchers itself, layer 2 replays again
    strided, _, strided_calls = step("1", strided_layer=1)
    assert strided_calls[1] == live_calls[0] and strided_calls[2] == ([], live_calls[0][1])
    assert torch.equal(strided, step("0", strided_layer=1)[0])
    # a first layer whose input is not row-major: its launchers copy it, so no tape is kept
    xn_t = xns[0].t().contiguous().t()
    copied, _, copied_calls = step("1", xn_first=xn_t)
    assert all(c == live_calls[0] for c in copied_calls)
    assert torch.equal(copied, live)


def test_replay_calls_the_compiled_launcher_only_without_launch_hooks():
    """launch_tape.no_launch_hooks against the installed Triton's own knobs: True as installed (its
    hooks are empty chains, not None, since Triton 3.6: a check for None alone never took the
    direct path on the GPU), False while a profiler-style launch hook is registered, True again
    once it is removed."""
    import triton

    from export.ops import launch_tape

    assert launch_tape.no_launch_hooks()
    chain = triton.knobs.runtime.launch_enter_hook
    hook = lambda *a, **kw: None   # noqa: E731
    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            assert not launch_tape.no_launch_hooks()
        finally:
            chain.remove(hook)
    else:
        triton.knobs.runtime.launch_enter_hook = hook
        try:
            assert not launch_tape.no_launch_hooks()
        finally:
            triton.knobs.runtime.launch_enter_hook = chain
    assert launch_tape.no_launch_hooks()
