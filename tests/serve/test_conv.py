"""The Triton conv kernel (export/ops/conv.py: packed prefill and one-token decode) under Triton's CPU
interpreter against torch `reference.conv_with_state` per request.  TRITON_INTERPRET=1 around the
imports and for the calls, as tests/serve/test_gla_prefill.py says."""
import pytest

from conftest import U32, f32_sum_err, import_interpreted, interpreter_fixture, need

torch = need("torch")

(conv,) = import_interpreted("export.ops.conv")
import torch.nn.functional as F
from export.reference import conv_with_state

interpret = interpreter_fixture(conv._conv_prefill_kernel, conv._conv_rows_kernel, conv._conv_window_kernel)


def _check_requests(u, pool, old_pool, x, w, b, slots, keep, cu):
    """Each request r of slots: its rows of u against torch conv_with_state from its old window
    (zeros where keep is False), and its new window in pool, exactly."""
    C = w.shape[-1]
    for r in range(slots.shape[0]):
        a, e = int(cu[r]), int(cu[r + 1])
        win = torch.where(keep[r], old_pool[slots[r]], 0.0)
        want_u, want_w = conv_with_state(x[a:e][None], win[None], w, b)
        # both sum C + 1 terms (taps, bias) in float32, in their own orders; Σ|terms| is the
        # same conv of the absolute values; then SiLU (|silu'| <= 1.1, a few roundings of its own)
        mag, _ = conv_with_state(x[a:e].abs()[None], win.abs()[None], w.abs(), b.abs())
        tol = 1.1 * 2 * f32_sum_err(C + 1, mag[0]) + 4 * U32 * F.silu(want_u[0]).abs()
        assert ((F.silu(want_u[0]) - u[a:e]).abs() <= tol).all(), r
        assert torch.equal(pool[slots[r]], want_w[0]), r               # copies of inputs: exact


def _pages(R: int, seed: int):
    """A float32 conv pool (C = 4, D = 80) of 12 slots inside a page buffer with bytes around each
    view, R distinct slots (never the null slot 0), keep False for every third (those pages NaN),
    random weights.  Returns (generator, C, D, raw, pool, slots, keep, raw before, w, b)."""
    g = torch.Generator().manual_seed(seed)
    C, D, S = 4, 80, 12
    raw = torch.randn(S, 5 + C * D + 3, generator=g)
    pool = raw[:, 5:5 + C * D].unflatten(1, (C, D))
    slots = torch.randperm(S - 1, generator=g)[:R] + 1
    keep = torch.tensor([i % 3 != 1 for i in range(R)])
    pool[slots[~keep]] = float("nan")
    w, b = torch.randn(D, 1, C, generator=g), torch.randn(D, generator=g)
    return g, C, D, raw, pool, slots, keep, raw.clone(), w, b


def _conv_case(lens, pad_rows=0, seed=11, **launch):
    """The conv kernel on requests of `lens` tokens (all 1: conv_decode_inplace), `pad_rows` more
    rows at the null slot 0 with keep False, against torch conv_with_state per request (float32;
    requests shorter than the kernel take part of their window from the old one); NaN pages with
    keep False must not leak; other slots and the bytes around the view stay as they were."""
    g, C, D, raw, pool, slots, keep, before, w, b = _pages(len(lens), seed)
    R = len(lens)
    if set(lens) == {1}:
        x = torch.randn(R + pad_rows, D, generator=g)
        cu = torch.arange(R + 1)
        u = conv.conv_decode_inplace(pool, torch.cat([slots, torch.zeros(pad_rows, dtype=slots.dtype)]),
                                     torch.cat([keep, torch.zeros(pad_rows, dtype=torch.bool)]), x, w, b)
    else:
        assert pad_rows == 0
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        x = torch.randn(int(cu[-1]) + 3, D, generator=g)
        u = conv.conv_prefill_inplace(pool, slots, keep, x, w, b, cu, **launch)
    _check_requests(u, pool, before[:, 5:5 + C * D].unflatten(1, (C, D)), x, w, b, slots, keep, cu)
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
        conv.conv_prefill_inplace(torch.zeros(2, 4, 16), torch.tensor([1]), torch.tensor([True]), x,
                                  torch.zeros(16, 1, 4), torch.zeros(16), torch.tensor([0, 8]),
                                  block_t=2, seg_tiles=1, n_split=2)


def test_conv_default_split():
    """8 prompts of 2,048 tokens: 32 segment slots each (8 used); one request: a slot per segment
    of all T tokens; many requests: one program each."""
    assert conv.default_split(16384, 8, 256) == 32
    assert conv.default_split(1000, 1, 256) == 4
    assert conv.default_split(16384, 1280, 256) == 1


def test_conv_decode_vs_conv_with_state():
    """The decode step's one-token tiles (512 channels wide, D = 80 masked), with CUDA-graph
    padding rows that all point at slot 0."""
    _conv_case([1] * 9, pad_rows=3)


def test_conv_writes_a_callers_row_block_and_checks_it(interpret):
    """out= (the vLLM mixer's one conv output for decode and prefill rows): the result lands in the
    caller's row block with the very bits of a fresh output, the rows around it untouched; an out of
    another shape or dtype, or with strided columns, is refused by name."""
    g = torch.Generator().manual_seed(3)
    C, D = 4, 80
    pool = torch.randn(6, C, D, generator=g)
    slots, keep = torch.tensor([2, 5]), torch.tensor([True, False])
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    x = torch.randn(20, D, generator=g)
    w, b = torch.randn(D, 1, C, generator=g), torch.randn(D, generator=g)
    want = conv.conv_prefill_inplace(pool.clone(), slots, keep, x, w, b, cu)
    buf = torch.full((23, D), 7.0)
    got = conv.conv_prefill_inplace(pool.clone(), slots, keep, x, w, b, cu, out=buf[3:])
    assert got.data_ptr() == buf[3:].data_ptr() and torch.equal(buf[3:], want)
    assert torch.equal(buf[:3], torch.full((3, D), 7.0))
    for bad in (torch.empty(19, D), torch.empty(20, D, dtype=torch.float64), torch.empty(D, 20).t()):
        with pytest.raises(ValueError, match="out .*want \\(20, 80\\) torch.float32 with last-dim stride 1"):
            conv.conv_prefill_inplace(pool.clone(), slots, keep, x, w, b, cu, out=bad)


def test_conv_rows_as_a_whole_step_graph_runs_them():
    """`conv_rows_inplace` (export/full_graph.py's steps): decode rows and prefill requests of any
    length in one launch over row tiles, as vLLM pads a batch for a graph: two requests of no tokens
    (seq_len 0) whose slots are live requests' pages (a stale block-table row), and rows after the
    last request.  Each request's SiLU(conv) against torch conv_with_state, its new window exact; the
    pages of the empty requests hold what the live requests wrote (not their old windows); padding
    rows are zeros; everything else unchanged."""
    lens = [1, 1, 2, 1, 9, 40, 1, 3]
    g, C, D, raw, pool, slots, keep, before, w, b = _pages(len(lens), 5)
    cu_real = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    n = int(cu_real[-1])
    cu = torch.cat([cu_real, cu_real[-1:].repeat(2)])               # + two requests of no tokens
    pad_slots = torch.cat([slots, slots[[4, 0]]])
    pad_keep = torch.cat([keep, torch.tensor([True, True])])
    x = torch.randn(n + 5, D, generator=g)
    u = conv.conv_rows_inplace(pool, pad_slots, pad_keep, x, w, b, cu, block_t=8, block_d=32)
    _check_requests(u, pool, before[:, 5:5 + C * D].unflatten(1, (C, D)), x, w, b, slots, keep, cu)
    assert torch.equal(u[n:], torch.zeros(5, D))
    other = torch.ones_like(raw, dtype=torch.bool)
    other[slots, 5:5 + C * D] = False
    assert torch.equal(raw.view(torch.int32)[other], before.view(torch.int32)[other])
    with pytest.raises(ValueError, match="cu_seqlens has 3 entries for 1 requests"):
        conv.conv_rows_inplace(pool, slots[:1], keep[:1], x, w, b, cu[:3])
