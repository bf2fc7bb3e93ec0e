"""The fused gated_mix kernel (export/ops/gated_mix.py) under Triton's CPU interpreter against
`reference.gated_mix` in float64, within `checks.gated_mix_error_bound` (derived from the float32
arithmetic, plus one ulp of a 16-bit output).  The vLLM mixer's paths that use it are compared with
the torch paths in tests/serve/test_vllm_mixer.py.

TRITON_INTERPRET=1 is set around this module's imports (conftest.import_interpreted: kernels are
decorated then) and, for the calls, by a fixture; it is not left in the environment."""
import pytest

from conftest import import_interpreted, interpreter_fixture, need

torch = need("torch")

gated_mix, checks = import_interpreted("export.ops.gated_mix", "export.checks")

interpret = interpreter_fixture(gated_mix._gated_mix_kernel)


DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=["in_bf16", "in_f32"])
@pytest.mark.parametrize("out_dtype", DTYPES, ids=["out_bf16", "out_f32"])
@pytest.mark.parametrize("N", [1, 9, 33])
def test_3b_heads(N, dtype, out_dtype):
    """H=16, K=96 (padded to 128), V=192 (to 256), T=4 tiers: N around the token block (8)."""
    assert checks.gated_mix_error(N, 16, 96, 192, 4, dtype, out_dtype, "cpu") <= 1.0


@pytest.mark.parametrize("N", [1, 9, 33])
def test_3b_heads_bf16_o(N):
    """bf16 q, k, v, g and a bf16 o, as `gla_prefill_inplace(out_dtype=bf16)` returns it (upcast
    inside; the bound takes o as given), bf16 and float32 out."""
    for out_dtype in DTYPES:
        assert checks.gated_mix_error(N, 16, 96, 192, 4, torch.bfloat16, out_dtype, "cpu",
                                      o_dtype=torch.bfloat16) <= 1.0


@pytest.mark.parametrize("dtype", DTYPES, ids=["in_bf16", "in_f32"])
@pytest.mark.parametrize("N", [1, 7, 17])
def test_small_odd_heads(N, dtype):
    """H=4, K=24, V=40, T=2 tiers (two heads a tier), bf16 and float32 out."""
    for out_dtype in DTYPES:
        assert checks.gated_mix_error(N, 4, 24, 40, 2, dtype, out_dtype, "cpu") <= 1.0


def test_tiers_and_heads_are_not_mixed_up():
    """Head h must use aug_balance[h] and head_norm[h // (H/T)]: with one tier's weight scaled,
    only its heads' outputs scale (the same float32 ops on the same inputs but one factor: within
    a few ulps), and a changed aug_balance row changes only its head."""
    H, K, V, T = 6, 8, 12, 3
    q, k, v, g, o, a, w, eps = checks.gated_mix_inputs(5, H, K, V, T, torch.float32, "cpu", seed=2)
    y = gated_mix.gated_mix_fused(q, k, v, g, o, a, w, eps, torch.float32).view(5, H, V)
    w2 = w.clone()
    w2[1] *= 2.0                                   # tier 1 = heads 2, 3
    y2 = gated_mix.gated_mix_fused(q, k, v, g, o, a, w2, eps, torch.float32).view(5, H, V)
    assert torch.equal(y2[:, [0, 1, 4, 5]], y[:, [0, 1, 4, 5]])
    assert torch.equal(y2[:, 2:4], 2.0 * y[:, 2:4])                    # ×2 is exact in float32
    a2 = a.clone()
    a2[4] += 1.0
    y3 = gated_mix.gated_mix_fused(q, k, v, g, o, a2, w, eps, torch.float32).view(5, H, V)
    assert torch.equal(y3[:, [0, 1, 2, 3, 5]], y[:, [0, 1, 2, 3, 5]]) and not torch.equal(y3[:, 4], y[:, 4])


def test_empty_and_output_layout():
    """N=0 launches nothing; y is [N, H·V] contiguous in out_dtype."""
    args = checks.gated_mix_inputs(0, 4, 24, 40, 2, torch.bfloat16, "cpu", seed=1)
    assert gated_mix.gated_mix_fused(*args, torch.bfloat16).shape == (0, 160)
    args = checks.gated_mix_inputs(3, 4, 24, 40, 2, torch.bfloat16, "cpu", seed=1)
    y = gated_mix.gated_mix_fused(*args, torch.bfloat16)
    assert y.shape == (3, 160) and y.dtype == torch.bfloat16 and y.is_contiguous()


def test_exact_zeros_pass_and_wrong_values_fail():
    """Where g = 0 the output is 0 exactly and its bound is 0 (seen on an H200: 6 bf16 draws of
    randn in 5e7 are 0, and 0/0 made the check fail with NaN): an exact 0 passes, anything else
    there fails; a wrong value elsewhere fails too."""
    args = list(checks.gated_mix_inputs(9, 4, 24, 40, 2, torch.bfloat16, "cpu", seed=3))
    args[3] = args[3].clone()
    args[3][2, 1, :7] = 0.0                                         # g
    args = tuple(args)
    y = gated_mix.gated_mix_fused(*args, torch.float32)
    assert (y.view(9, 4, 40)[2, 1, :7] == 0).all()
    assert checks.gated_mix_error_ratio(y, args, torch.float32) <= 1.0
    bad = y.clone()
    bad.view(9, 4, 40)[2, 1, 3] = 1e-30
    assert checks.gated_mix_error_ratio(bad, args, torch.float32) == float("inf")
    bad = y.clone()
    bad[5, 17] *= 1.001
    assert checks.gated_mix_error_ratio(bad, args, torch.float32) > 1.0
