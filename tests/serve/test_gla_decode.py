"""The Triton decode GLA kernel (export/ops/gla_decode.py) under Triton's CPU interpreter against the
float64 step, elementwise within a bound derived from its float32 arithmetic.  TRITON_INTERPRET=1
around the imports and for the calls, as tests/serve/test_gla_prefill.py says."""
import pytest

from conftest import U32, f32_sum_err, import_interpreted, interpreter_fixture, need

torch = need("torch")

gla_decode, checks = import_interpreted("export.ops.gla_decode", "export.checks")

interpret = interpreter_fixture(gla_decode._gla_decode_kernel)


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
    g_gamma = checks.check_g_gamma(H, "cpu")
    o = gla_decode.gla_decode_inplace(pool, torch.cat([slots, torch.zeros(pad, dtype=slots.dtype)]),
                                      torch.cat([keep, torch.zeros(pad, dtype=torch.bool)]), q, k, v, g_gamma,
                                      block_v=block_v, block_k=block_k, evict=evict)
    lam = torch.exp(g_gamma.double()).view(1, H, 1, 1)
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
