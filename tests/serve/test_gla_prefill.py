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

gla_prefill, checks = import_interpreted("export.ops.gla_prefill", "export.checks")

interpret = interpreter_fixture(gla_prefill._gla_prefill_kernel)


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
