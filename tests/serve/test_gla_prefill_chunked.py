"""The chunk-parallel GLA prefill (export/ops/gla_prefill_chunked.py) in Triton's CPU interpreter:
against the float64 step recurrence within the serial kernel's derived bounds
(`export.checks.prefill_errors` / `within_tolerance`: packed requests, NaN pages of new
sequences that must not leak, non-zero initial states, padding rows, nothing changed outside the
requests' states), bit for bit against the serial kernel (the same products in the same order), and
the host rule that picks between them."""
import pytest

from conftest import import_interpreted, interpreter_fixture, need

torch = need("torch")

gla_prefill, chunked, checks = import_interpreted("export.ops.gla_prefill", "export.ops.gla_prefill_chunked",
                                                  "export.checks")
from export.reference import split_heads

interpret = interpreter_fixture(chunked._chunk_local_kernel, chunked._chunk_pass_kernel, chunked._chunk_out_kernel,
                                gla_prefill._gla_prefill_kernel)

# K, V not powers of 2 (masked to BK, BV); chunk 16: many chunks from few tokens
SMALL = dict(H=2, K=24, V=40, chunk=16, num_slots=10)
BATCHES = [(1, 15, 16, 17, 40, 3),      # around the chunk, partial chunks
           (100,),                       # one long request: 7 chunks, the last partial
           (16, 16, 1, 1, 64),           # whole chunks, one-token requests
           (0, 33, 0, 2)]                # requests without tokens own no chunk


@pytest.mark.parametrize("lengths", BATCHES)
def test_chunked_float32_vs_float64(lengths):
    e = checks.prefill_errors("cpu", lengths=lengths, dtype=torch.float32, path="chunked", **SMALL)
    assert checks.within_tolerance(e, "ieee", torch.float32, SMALL["chunk"], SMALL["K"]), e


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["o_f32", "o_bf16"])
def test_chunked_bf16_inputs(precision, out_dtype):
    """bf16 q, k, v (the interpreter multiplies tf32 operands in float32, so ieee's bound holds
    there, and emulates bf16 operands exactly); o in float32 or bf16 (plus its rounding)."""
    e = checks.prefill_errors("cpu", lengths=(1, 15, 17, 70), dtype=torch.bfloat16, precision=precision,
                              out_dtype=out_dtype, path="chunked", **SMALL)
    assert checks.within_tolerance(e, "ieee" if precision == "tf32" else "bf16", out_dtype,
                                   SMALL["chunk"], SMALL["K"]), e


@pytest.mark.parametrize("path", ["chunked", "serial"])
def test_bf16_o_at_the_seed_that_found_the_interpreters_truncation(path):
    """Seed 640168364 (a CI run): o in bf16 is 4.12e-3 from float64 on both paths, over u = 2^-8 plus
    the float32 tolerance, because the interpreter truncates the cast (checks.output_rounding)."""
    e = checks.prefill_errors("cpu", lengths=(1, 15, 17, 70), dtype=torch.bfloat16, precision="tf32",
                              out_dtype=torch.bfloat16, path=path, seed=640168364, **SMALL)
    assert e["o"] > checks.unit_roundoff(torch.bfloat16) + checks.prefill_tolerance("ieee", SMALL["chunk"], SMALL["K"])
    assert checks.within_tolerance(e, "ieee", torch.bfloat16, SMALL["chunk"], SMALL["K"]), e


def test_the_interpreter_truncates_a_bf16_cast():
    """What output_rounding's 2u rests on: Triton's interpreter casts float32 to bf16 by truncation
    (errors up to a whole ulp), where torch (and a GPU) round to nearest (half an ulp, u)."""
    from conftest import triton_interpreting
    with triton_interpreting():   # decorated for the interpreter, as the kernels under test are
        import triton
        import triton.language as tl

        @triton.jit
        def cast(x_ptr, y_ptr, N: tl.constexpr):
            i = tl.arange(0, N)
            tl.store(y_ptr + i, tl.load(x_ptr + i).to(y_ptr.dtype.element_ty, fp_downcast_rounding="rtne"))

        x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
        y = torch.empty(4096, dtype=torch.bfloat16)
        cast[(1,)](x, y, 4096)
    rel = ((y.float() - x) / x).abs().max().item()
    u = checks.unit_roundoff(torch.bfloat16)
    assert u < rel <= 2 * u, rel
    assert ((x.to(torch.bfloat16).float() - x) / x).abs().max().item() <= u


def test_chunked_3b_head_shape():
    """K = 96 (padded to 128), V = 192 (three 64-wide blocks), 64-token chunks: one request of 3
    chunks (the last partial) beside a one-token one."""
    e = checks.prefill_errors("cpu", lengths=(150, 1), H=1, K=96, V=192, dtype=torch.bfloat16,
                              num_slots=4, path="chunked")
    assert checks.within_tolerance(e, "bf16", torch.float32, 64, 96), e


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_equals_serial_bitwise(dtype):
    """Same inputs, same pool: o and every state equal to the last bit (NaN pages of new sequences
    included, which both replace by zeros; the 1-token request by the decode math in both, the 17-
    and 33-token ones' one-token last chunks by the chunk math in both); the request of no tokens
    leaves its page as it was (NaN: a page that pads a CUDA-graph batch may be another request's)."""
    H, K, V, chunk = SMALL["H"], SMALL["K"], SMALL["V"], SMALL["chunk"]
    g = torch.Generator().manual_seed(3)
    lengths = (40, 1, 17, 0, 33)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    T = int(cu[-1]) + 3
    proj = torch.randn(T, H * (2 * K + 2 * V), generator=g).to(dtype)
    q, k, v, _ = split_heads(proj, H, K, V)
    pool = torch.randn(8, H, K, V, generator=g)
    slots = torch.tensor([5, 1, 7, 2, 3])
    keep = torch.tensor([True, False, True, False, True])
    pool[slots[~keep]] = float("nan")
    g_gamma = checks.check_g_gamma(H, "cpu")
    out = {}
    for path in ("serial", "chunked"):
        p = pool.clone()
        o = torch.full((T, H, V), 7.0)
        n = int(cu[-1])
        o[:n] = gla_prefill.gla_prefill_inplace(p, slots, keep, q, k, v, g_gamma, cu, chunk, path=path)[:n]
        out[path] = (o, p)
    assert torch.equal(out["serial"][0], out["chunked"][0])
    assert torch.equal(out["serial"][1].view(torch.int32), out["chunked"][1].view(torch.int32))
    has_tokens = torch.tensor(lengths) > 0
    assert torch.isfinite(out["chunked"][1][slots[has_tokens]]).all()
    assert torch.isnan(out["chunked"][1][slots[~has_tokens]]).all()


def test_chunked_leaves_padding_rows():
    """Rows of o after the last request stay as they were (the grid's spare chunk programs and the
    partial last chunk store nothing there)."""
    H, K, V, chunk = SMALL["H"], SMALL["K"], SMALL["V"], SMALL["chunk"]
    g = torch.Generator().manual_seed(4)
    cu = torch.tensor([0, 20, 37], dtype=torch.int32)
    proj = torch.randn(45, H * (2 * K + 2 * V), generator=g)
    q, k, v, _ = split_heads(proj, H, K, V)
    o = torch.full((45, H, V), 7.0)
    pool = torch.randn(3, H, K, V, generator=g)
    chunked.gla_prefill_chunked(pool, torch.tensor([1, 2]), torch.tensor([True, True]), q, k, v,
                                checks.check_g_gamma(H, "cpu"), cu, o, chunk)
    assert (o[37:] == 7.0).all() and torch.isfinite(o[:37]).all()


def test_prefill_path_rule():
    """3B shape (H 16, K 96, V 192, 64-token chunks) on an H200's 132 SMs: a lone prompt or two
    take the chunked path; 8 requests (384 serial programs) or more the serial one; fewer than two
    chunks, or a chunk-state buffer over the budget, the serial one."""
    rule = lambda R, T: chunked.prefill_path(R, T, 16, 96, 192, 64, 132)
    assert rule(1, 512) == rule(1, 2048) == rule(1, 8192) == rule(2, 4096) == "chunked"
    assert rule(3, 6144) == rule(8, 16384) == rule(1280, 1280) == "serial"
    assert rule(1, 127) == "serial"
    over = chunked.BUFFER_BUDGET // (2 * 16 * 96 * 192 * 4) * 64       # two buffers of chunk states
    assert rule(1, over) == "serial" and rule(1, over - 2 * 64) == "chunked"
