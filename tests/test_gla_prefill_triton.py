"""The Triton prefill kernels (export/gla_prefill_triton.py, export/conv_triton.py) under Triton's
CPU interpreter against float64 / torch references, and the vLLM mixer's Triton prefill path
against its torch path.

TRITON_INTERPRET=1 must be set when the kernels are decorated (import time; triton's own, by
conftest), so it is set around this module's imports and, for the calls, by a fixture; it is not
left in the environment, where the vLLM subprocesses of other tests would inherit it.  Triton is a
test requirement: CI (`make install-test`, the serve extra) installs it, and `need` fails there
(CI=true) rather than skipping."""
import types

import pytest

from conftest import f32_sum_err, import_interpreted, need  # noqa: E402

torch = need("torch")

conv_triton, gpt, gla_triton, mix_triton = import_interpreted(
    "export.conv_triton", "export.gla_prefill_triton", "export.gla_triton", "export.mix_triton")
import torch.nn.functional as F  # noqa: E402
from export.torch_model import conv_with_state  # noqa: E402

U32 = 2.0 ** -24


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction
    import triton.language.standard as std
    kernels = (gpt._gla_prefill_kernel, conv_triton._conv_prefill_kernel, gla_triton._gla_decode_kernel,
               mix_triton._mix_post_kernel, std.sum)
    assert all(isinstance(k, InterpretedFunction) for k in kernels), \
        "triton or export's Triton kernels were imported before TRITON_INTERPRET=1 was set (conftest, this module)"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("LAPLACE_VLLM_TRITON", raising=False)


# ----------------------------------------------------------------------------- the GLA kernel alone

# K, V not powers of 2 (masked to BK, BV); chunk 16: partial chunks at 1, 15, 17, 40, 3.  The
# serial kernel (at these shapes `prefill_path` would pick the chunked one: tests/test_gla_prefill_chunked.py)
SMALL = dict(H=2, K=24, V=40, chunk=16, num_slots=10, path="serial")


@pytest.mark.parametrize("lengths", [(1, 15, 16, 17, 40, 3), (33,), (16, 16, 1, 1, 64)])
def test_gla_prefill_float32_vs_float64(lengths):
    """o and final states within float32 rounding of the float64 recurrence; keep False pages are
    NaN (must not leak); nothing but the requests' states changes (pool slots, bytes around the
    strided view)."""
    e = gpt.prefill_errors("cpu", lengths=lengths, dtype=torch.float32, **SMALL)
    assert e["changed"] == 0, e
    assert max(e["o"], e["state"]) <= gpt.tolerance("ieee", SMALL["chunk"], SMALL["K"]), e


def test_gla_prefill_3b_head_shape():
    """K=96 (padded to 128), V=192 (three 64-wide blocks), chunk 64: lengths around the chunk."""
    e = gpt.prefill_errors("cpu", lengths=(1, 63, 64, 65, 130), H=2, K=96, V=192,
                           dtype=torch.float32, num_slots=8, path="serial")
    assert e["changed"] == 0, e
    assert max(e["o"], e["state"]) <= gpt.tolerance("ieee", 64, 96), e


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["o_f32", "o_bf16"])
def test_gla_prefill_bf16_inputs(precision, out_dtype):
    """bf16 q, k, v; o in float32 (what the vLLM mixer asks for) or bf16 (plus its rounding).
    The interpreter multiplies tf32 operands in float32 (so ieee's bound holds there), and
    emulates bf16 operands exactly (rounded to bf16, exact products)."""
    e = gpt.prefill_errors("cpu", lengths=(1, 15, 17, 40), dtype=torch.bfloat16, precision=precision,
                           out_dtype=out_dtype, **SMALL)
    assert e["changed"] == 0, e
    assert gpt.within_tolerance(e, "ieee" if precision == "tf32" else "bf16", out_dtype,
                                SMALL["chunk"], SMALL["K"]), e


def test_gla_prefill_out_dtype_is_float32_or_q_dtype():
    """o in another dtype than float32 or q's would be a silent extra rounding: refused."""
    with pytest.raises(ValueError, match="out_dtype torch.float16"):
        gpt.prefill_errors("cpu", lengths=(3,), dtype=torch.bfloat16, out_dtype=torch.float16, **SMALL)


def test_gla_reference_is_the_step_recurrence():
    """The float64 reference against export.torch_model.gla_step, step by step, for one request."""
    from export.torch_model import gla_step
    g = torch.Generator().manual_seed(3)
    H, K, V, L = 2, 8, 4, 9
    q, k, v = (torch.randn(L, H, d, generator=g, dtype=torch.float64) for d in (K, K, V))
    gamma = torch.tensor([-0.5, -0.01])
    s0 = torch.randn(1, H, K, V, generator=g, dtype=torch.float64)
    o, s = gpt.gla_reference(q, k, v, gamma, s0, torch.tensor([0, L]))
    st = s0
    for t in range(L):
        ot, st = gla_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], gamma, st)
        assert torch.allclose(o[t], ot[0].double(), rtol=1e-5, atol=1e-6)   # gla_step is float32
    assert torch.allclose(s, st.double(), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- the decode GLA kernel alone

@pytest.mark.parametrize("block_k,block_v,evict", [(None, 64, False), (8, 16, True)])
def test_gla_decode_vs_float64(block_k, block_v, evict):
    """One decode step of `gla_decode_inplace` against the float64 step, elementwise within a bound
    derived from its float32 arithmetic.  K = 24 is padded to 32 in one block (block_k None) or
    taken in three unrolled blocks of 8 (with `evict_first` on the state); V = 40 leaves masked
    columns in the last block.  The pool
    is a strided view inside pages; pages of keep-False rows hold NaN (must not leak); three
    CUDA-graph padding rows share slot 0; no other byte changes."""
    g = torch.Generator().manual_seed(21)
    H, K, V, S, B, pad = 3, 24, 40, 16, 7, 3
    raw = torch.randn(S, 6 + H * K * V + 2, generator=g)
    pool = raw[:, 6:6 + H * K * V].unflatten(1, (H, K, V))
    slots = torch.randperm(S - 1, generator=g)[:B] + 1
    keep = torch.tensor([i % 3 != 1 for i in range(B)])
    pool[slots[~keep]] = float("nan")
    before = raw.clone()
    q, k, v = (torch.randn(B + pad, H, d, generator=g) for d in (K, K, V))
    gamma = gla_triton.check_gamma(H, "cpu")
    o = gla_triton.gla_decode_inplace(pool, torch.cat([slots, torch.zeros(pad, dtype=slots.dtype)]),
                                      torch.cat([keep, torch.zeros(pad, dtype=torch.bool)]), q, k, v, gamma,
                                      block_v=block_v, block_k=block_k, evict=evict)
    lam = torch.exp(gamma.double()).view(1, H, 1, 1)
    s0 = torch.where(keep.view(-1, 1, 1, 1), before[slots, 6:6 + H * K * V].view(B, H, K, V).double(), 0.0)
    kv = k[:B].double()[..., None] * v[:B].double()[..., None, :]
    s1 = lam * s0 + kv
    qd = q[:B].double()[..., None]
    want_o = (s1 * qd).sum(-2) * K ** -0.5
    # state: λ (exp, ~1 ulp) times s, the product k v, their sum: a few roundings of each term
    s_tol = 4 * U32 * ((lam * s0).abs() + kv.abs())
    assert ((pool[slots].double() - s1).abs() <= s_tol).all()
    # o: a float32 dot of K terms over the rounded state (in either order), then the scale
    mag = (s1.abs() * qd.abs()).sum(-2)
    o_tol = K ** -0.5 * (2 * f32_sum_err(K, mag) + (s_tol * qd.abs()).sum(-2)) + 2 * U32 * want_o.abs()
    assert ((o[:B].double() - want_o).abs() <= o_tol).all()
    other = torch.ones_like(raw, dtype=torch.bool)
    other[slots, 6:6 + H * K * V] = False
    other[0] = False              # the null slot: the padding rows' scratch
    assert torch.equal(raw.view(torch.int32)[other], before.view(torch.int32)[other])


# ----------------------------------------------------------------------------- the conv kernel alone

def _conv_case(lens, pad_rows=0, seed=11, **launch):
    """The conv kernel on requests of `lens` tokens (all 1: conv_decode_inplace), `pad_rows` more
    rows at the null slot 0 with keep False, against torch conv_with_state per request (float32;
    requests shorter than the kernel take part of their window from the old one); NaN pages with
    keep False must not leak; other slots and the bytes around the view stay as they were."""
    g = torch.Generator().manual_seed(seed)
    C, D, S = 4, 80, 12
    R = len(lens)
    raw = torch.randn(S, 5 + C * D + 3, generator=g)
    pool = raw[:, 5:5 + C * D].unflatten(1, (C, D))
    slots = torch.randperm(S - 1, generator=g)[:R] + 1
    keep = torch.tensor([i % 3 != 1 for i in range(R)])
    pool[slots[~keep]] = float("nan")
    before = raw.clone()
    w, b = torch.randn(D, 1, C, generator=g), torch.randn(D, generator=g)
    if set(lens) == {1}:
        x = torch.randn(R + pad_rows, D, generator=g)
        cu = torch.arange(R + 1)
        u = conv_triton.conv_decode_inplace(pool, torch.cat([slots, torch.zeros(pad_rows, dtype=slots.dtype)]),
                                            torch.cat([keep, torch.zeros(pad_rows, dtype=torch.bool)]), x, w, b)
    else:
        assert pad_rows == 0
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        x = torch.randn(int(cu[-1]) + 3, D, generator=g)
        u = conv_triton.conv_prefill_inplace(pool, slots, keep, x, w, b, cu, **launch)
    for r in range(R):
        a, e = int(cu[r]), int(cu[r + 1])
        win = torch.where(keep[r], before[slots[r], 5:5 + C * D].view(C, D), 0.0)
        want_u, want_w = conv_with_state(x[a:e][None], win[None], w, b)
        # both sum C + 1 terms (taps, bias) in float32, in their own orders; Σ|terms| is the
        # same conv of the absolute values; then SiLU (|silu'| <= 1.1, a few roundings of its own)
        mag, _ = conv_with_state(x[a:e].abs()[None], win.abs()[None], w.abs(), b.abs())
        tol = 1.1 * 2 * f32_sum_err(C + 1, mag[0]) + 4 * U32 * F.silu(want_u[0]).abs()
        assert ((F.silu(want_u[0]) - u[a:e]).abs() <= tol).all(), r
        assert torch.equal(pool[slots[r]], want_w[0]), r               # copies of inputs: exact
    other = torch.ones_like(raw, dtype=torch.bool)
    other[slots, 5:5 + C * D] = False
    if pad_rows:
        other[0] = False          # the null slot: the padding rows' scratch
    assert torch.equal(raw.view(torch.int32)[other], before.view(torch.int32)[other])


def test_conv_prefill_vs_conv_with_state():
    _conv_case([1, 2, 3, 4, 5, 70, 130])


@pytest.mark.parametrize("launch", [dict(block_t=2, seg_tiles=2, n_split=3),     # 4-token segments
                                    dict(block_t=4, seg_tiles=1, n_split=40),    # more slots than segments
                                    dict(block_t=1, seg_tiles=3, n_split=2)])    # segment = C - 1 tokens
def test_conv_prefill_split_segments(launch):
    """Requests cut into segments of C - 1 tokens or more, walked by n_split programs each (the
    130-token request: 33 segments over 3 programs in the first case), tiles at the request's
    start (old window taps) and inside it (x only).  The interpreter runs a request's segment-0
    program, which writes the new window, before the others: one of them reading the window
    would read the new one and fail the comparison."""
    _conv_case([1, 2, 3, 4, 5, 70, 130, 9], **launch)


def test_conv_split_needs_segments_of_c_minus_1():
    """Segments shorter than C - 1 would read the old window from a second program (a race with
    its write): refused."""
    x = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="C - 1 = 3"):
        conv_triton.conv_prefill_inplace(torch.zeros(2, 4, 16), torch.tensor([1]), torch.tensor([True]), x,
                                         torch.zeros(16, 1, 4), torch.zeros(16), torch.tensor([0, 8]),
                                         block_t=2, seg_tiles=1, n_split=2)


def test_conv_default_split():
    """8 prompts of 2,048 tokens: 32 segment slots each (8 used); one request: a slot per segment
    of all T tokens; many requests: one program each."""
    assert conv_triton.default_split(16384, 8, 256) == 32
    assert conv_triton.default_split(1000, 1, 256) == 4
    assert conv_triton.default_split(16384, 1280, 256) == 1


def test_conv_decode_vs_conv_with_state():
    """The decode step's one-token tiles (512 channels wide, D = 80 masked), with CUDA-graph
    padding rows that all point at slot 0."""
    _conv_case([1] * 9, pad_rows=3)


# ----------------------------------------------------------------------------- the vLLM mixer

@pytest.fixture(scope="module")
def mixer():
    """A LaplaceVllmMixer of the tiny config with random weights (built in a default VllmConfig)."""
    need("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config

    from export.vllm_model import LaplaceVllmMixer
    from laplace_jax.config import load_config

    cfg = load_config("laplace_tiny").model
    g = torch.Generator().manual_seed(5)
    with set_current_vllm_config(VllmConfig()):
        m = LaplaceVllmMixer(cfg, "layers.0.mixer")
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 1.0) + (p.dim() == 1))
    return m.eval()


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


def test_vllm_mixer_triton_prefill_equals_torch_path(mixer, monkeypatch):
    """A mixed step: 2 decode rows, then prefill requests of 1, 3, 17, 40 and 5 tokens (new and
    continued ones; pages of new sequences hold NaN), 4 padding rows.  The Triton paths (decode
    conv and GLA kernels; packed conv + GLA prefill; the fused mixer_post after each, interpreter) against the
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
    for mod, name in ((gpt, "gla_prefill_inplace"), (conv_triton, "conv_prefill_inplace"),
                      (mix_triton, "mixer_post_fused")):
        f = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, f=f, name=name, **kw: calls.append(name) or f(*a, **kw))
    got = _run(m, raw_t, md, xn, res, n + 4, True, monkeypatch)
    # decode: the conv (one-token tiles of the packed kernel) and the fused post; prefill: one
    # packed call each, then the fused post
    assert calls == ["conv_prefill_inplace", "mixer_post_fused",                        # decode rows
                     "conv_prefill_inplace", "gla_prefill_inplace", "mixer_post_fused"]  # prefill
    want = _run(m, raw, md, xn, res, n + 4, False, monkeypatch)
    assert len(calls) == 5                                                 # the torch path: none

    assert torch.equal(got[n:], res[n:]) and torch.equal(want[n:], res[n:])     # padding: mixer output 0
    # o: each path within tolerance('ieee') of the exact GLA; mixer_post's head RMSNorm keeps a
    # relative error; mixer_post itself (torch ops or the fused kernel) adds its own float32
    # rounding, relative (λ√V/2 + ~20)u per mix_triton.error_bound, twice; w_out adds a D-term
    # float32 sum (λ·D·u for random signs, each path); the residual add rounds once per path (the
    # Triton path adds it in the GEMM, the torch path after it): u |res + mixer| each
    post = 2 * 2 * (6 * V ** 0.5 / 2 + 20) * U32
    tol = 2 * 2 * gpt.tolerance("ieee", gpt.CHUNK, K) + post + 2 * 6 * D * U32
    starts = md.query_start_loc.tolist()
    for r, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
        assert torch.isfinite(got[a:b]).all(), r
        mix = want[a:b] - res[a:b]
        assert float((got[a:b] - want[a:b]).norm()) <= tol * float(mix.norm()) + 2 * U32 * float(want[a:b].norm()), r
    cs = slice(3, 3 + C * D)
    gs = slice(3 + C * D, 3 + C * D + H * K * V)
    assert torch.equal(raw_t[slots][:, cs], raw[slots][:, cs])                   # input copies: exact
    for s in slots:
        assert float((raw_t[s, gs] - raw[s, gs]).norm() / raw[s, gs].norm()) <= 2 * gpt.tolerance("ieee", gpt.CHUNK, K)
    others = [s for s in range(13) if s not in slots]
    assert torch.equal(raw_t[others].view(torch.int32), raw[others].view(torch.int32))
    edges = torch.cat([raw_t[:, :3], raw_t[:, gs.stop:]], 1), torch.cat([raw[:, :3], raw[:, gs.stop:]], 1)
    assert torch.equal(edges[0].view(torch.int32), edges[1].view(torch.int32))     # NaN-aware
