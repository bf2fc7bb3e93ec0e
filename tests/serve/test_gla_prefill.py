"""The Triton prefill GLA kernel (export/ops/gla_prefill.py) under Triton's CPU interpreter against
the float64 step recurrence (`export.checks.prefill_errors`, within `checks.within_tolerance`).

TRITON_INTERPRET=1 must be set when the kernels are decorated (import time; triton's own, by
conftest), so it is set around this module's imports and, for the calls, by a fixture; it is not
left in the environment, where the vLLM subprocesses of other tests would inherit it.  Triton is a
test requirement: CI (`make install-test`, the serve extra) installs it, and `need` fails there
(CI=true) rather than skipping."""
import pytest

from conftest import import_interpreted, interpreter_fixture, need

torch = need("torch")

gla_prefill, gla_decode, checks = import_interpreted("export.ops.gla_prefill", "export.ops.gla_decode", "export.checks")

interpret = interpreter_fixture(gla_prefill._gla_prefill_kernel, gla_decode._gla_decode_kernel)


# K, V not powers of 2 (masked to BK, BV); chunk 16: partial chunks at 1, 15, 17, 40, 3.  The
# serial kernel (at these shapes `prefill_path` would pick the chunked one: test_gla_prefill_chunked.py)
SMALL = dict(H=2, K=24, V=40, chunk=16, num_slots=10, path="serial")


@pytest.mark.parametrize("lengths", [(1, 15, 16, 17, 40, 3), (33,), (16, 16, 1, 1, 64)])
def test_gla_prefill_float32_vs_float64(lengths):
    """o and final states within float32 rounding of the float64 recurrence; keep False pages are
    NaN (must not leak); nothing but the requests' states changes (pool slots, bytes around the
    strided view)."""
    e = checks.prefill_errors("cpu", lengths=lengths, dtype=torch.float32, **SMALL)
    assert e["changed"] == 0, e
    assert max(e["o"], e["state"]) <= checks.prefill_tolerance("ieee", SMALL["chunk"], SMALL["K"]), e


def test_gla_prefill_3b_head_shape():
    """K=96 (padded to 128), V=192 (three 64-wide blocks), chunk 64: lengths around the chunk."""
    e = checks.prefill_errors("cpu", lengths=(1, 63, 64, 65, 130), H=2, K=96, V=192,
                              dtype=torch.float32, num_slots=8, path="serial")
    assert e["changed"] == 0, e
    assert max(e["o"], e["state"]) <= checks.prefill_tolerance("ieee", 64, 96), e


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["o_f32", "o_bf16"])
def test_gla_prefill_bf16_inputs(precision, out_dtype):
    """bf16 q, k, v; o in float32 (what the vLLM mixer asks for) or bf16 (plus its rounding).
    The interpreter multiplies tf32 operands in float32 (so ieee's bound holds there), and
    emulates bf16 operands exactly (rounded to bf16, exact products)."""
    e = checks.prefill_errors("cpu", lengths=(1, 15, 17, 40), dtype=torch.bfloat16, precision=precision,
                              out_dtype=out_dtype, **SMALL)
    assert e["changed"] == 0, e
    assert checks.within_tolerance(e, "ieee" if precision == "tf32" else "bf16", out_dtype,
                                   SMALL["chunk"], SMALL["K"]), e


def test_gla_prefill_out_dtype_is_float32_or_q_dtype():
    """o in another dtype than float32 or q's would be a silent extra rounding: refused."""
    with pytest.raises(ValueError, match="out_dtype torch.float16"):
        checks.prefill_errors("cpu", lengths=(3,), dtype=torch.bfloat16, out_dtype=torch.float16, **SMALL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_requests_take_the_decode_kernels_math(dtype):
    """A step run as one CUDA graph sends its decode rows to the serial prefill kernel as one-token
    requests (export/full_graph.py): their outputs and states equal the decode kernel's to the last
    bit (the same float32 step, no chunk products, no bf16 rounding of the state), NaN pages of new
    sequences included; a request of no tokens at the end, on a live request's page, leaves it."""
    from export.reference import split_heads

    H, K, V = 2, 24, 40
    g = torch.Generator().manual_seed(4)
    B = 6
    proj = torch.randn(B, H * (2 * K + 2 * V), generator=g).to(dtype)
    q, k, v, _ = split_heads(proj, H, K, V)
    pool = torch.randn(9, H, K, V, generator=g)
    slots = torch.tensor([3, 1, 7, 2, 8, 5])
    keep = torch.tensor([True, False, True, True, False, True])
    pool[slots[~keep]] = float("nan")
    g_gamma = checks.check_g_gamma(H, "cpu")
    p_dec = pool.clone()
    o_dec = gla_decode.gla_decode_inplace(p_dec, slots, keep, q, k, v, g_gamma)
    p_pf = pool.clone()
    cu = torch.tensor([*range(B + 1), B], dtype=torch.int32)          # + a request of no tokens
    o_pf = gla_prefill.gla_prefill_inplace(p_pf, torch.cat([slots, slots[:1]]), torch.cat([keep, keep[:1]]),
                                           q, k, v, g_gamma, cu, 16, path="serial")
    assert torch.equal(o_pf, o_dec)
    assert torch.equal(p_pf.view(torch.int32), p_dec.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_step_split_equals_the_serial_kernel_alone(dtype):
    """A whole-step graph (export/full_graph.py) runs the decode kernel by request (one-token
    requests only) and the serial kernel with skip_one (the others) over the same requests: each
    leaves the other's rows and pages alone (NaN sentinels in o and on the pages stay), and the two
    together equal the serial kernel's own one-token branch to the last bit, NaN pages of new
    sequences and a request of no tokens on a live page included."""
    from export.reference import split_heads

    H, K, V = 2, 24, 40
    lengths = [1, 5, 1, 17, 1, 0]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    T = int(cu[-1])
    g = torch.Generator().manual_seed(5)
    q, k, v, _ = split_heads(torch.randn(T, H * (2 * K + 2 * V), generator=g).to(dtype), H, K, V)
    pool = torch.randn(9, H, K, V, generator=g)
    slots = torch.tensor([3, 1, 7, 2, 8, 3])
    keep = torch.tensor([True, False, True, False, True, True])
    pool[slots[~keep]] = float("nan")
    g_gamma = checks.check_g_gamma(H, "cpu")
    one = torch.tensor([n == 1 for n in lengths])
    rows_one = torch.cat([torch.full((n,), n == 1) for n in lengths])

    p_ref = pool.clone()
    o_ref = gla_prefill.gla_prefill_inplace(p_ref, slots, keep, q, k, v, g_gamma, cu, 16, path="serial")
    bits = lambda t: t.view(torch.int32)

    p_dec, o_dec = pool.clone(), torch.full((T, H, V), float("nan"))
    gla_decode.gla_decode_inplace(p_dec, slots, keep, q, k, v, g_gamma, out=o_dec, cu_seqlens=cu)
    assert torch.equal(bits(o_dec[rows_one]), bits(o_ref[rows_one])) and o_dec[~rows_one].isnan().all()
    changed = (bits(p_dec) != bits(pool)).flatten(1).any(1)
    assert changed.nonzero().flatten().tolist() == sorted(slots[one].tolist())

    p_pf, o_pf = p_dec.clone(), o_dec.clone()
    gla_prefill.gla_prefill_inplace(p_pf, slots, keep, q, k, v, g_gamma, cu, 16, path="serial", skip_one=True,
                                    out=o_pf)
    assert torch.equal(bits(o_pf), bits(o_ref)) and torch.equal(bits(p_pf), bits(p_ref))
    alone = pool.clone()
    gla_prefill.gla_prefill_inplace(alone, slots, keep, q, k, v, g_gamma, cu, 16, path="serial", skip_one=True)
    assert torch.equal(bits(alone[slots[one]]), bits(pool[slots[one]]))

    with pytest.raises(ValueError, match="skip_one with path='chunked'"):
        gla_prefill.gla_prefill_inplace(pool.clone(), slots, keep, q, k, v, g_gamma, cu, 16, path="chunked",
                                        skip_one=True)
