"""export/reference.py: gla_chunked (the loop-free chunked Simple GLA of the serving path) and gla_step
against an independent float64 NumPy token-by-token recurrence; the packed float64 recurrence
(gla_float64) against gla_step.  CPU, about a second.

Needs torch (the `serve` extra); skipped without it."""
import math

import numpy as np
import pytest

from conftest import f32_sum_err, need

torch = need("torch")

from export.reference import gla_chunked, gla_float64, gla_step


def recurrence(q, k, v, g_gamma, s0):
    """S_t = λ S_{t-1} + k_t v_t^T, o_t = K^-0.5 S_t^T q_t, all float64.  q, k [B,S,H,K]; v [B,S,H,V]."""
    q, k, v, s = (np.asarray(a, np.float64) for a in (q, k, v, s0))
    lam = np.exp(np.asarray(g_gamma, np.float64))[None, :, None, None]
    B, S, H, K = q.shape
    o = np.zeros((B, S, H, v.shape[-1]))
    for t in range(S):
        s = lam * s + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t], s) / math.sqrt(K)
    return o, s


def _inputs(B, S, H, K, V, init, seed):
    r = np.random.default_rng(seed)
    q, k = r.standard_normal((B, S, H, K)), r.standard_normal((B, S, H, K))
    v = r.standard_normal((B, S, H, V))
    # strong (half-life 1 token, and stronger) to weak decays
    g_gamma = -np.log(2.0) / np.array([0.25, 1.0, 16.0, 2048.0, 3.0, 500.0])[:H]
    s0 = r.standard_normal((B, H, K, V)) * 2.0 if init else np.zeros((B, H, K, V))
    return q, k, v, g_gamma, s0


def _within_f32(got, want, q, k, v, g_gamma, s0):
    """Worst |got - want| / f32_sum_err(n, sum|terms|), elementwise (at most 1 where got is right):
    sum|terms| is the recurrence on |q|, |k|, |v|, |s0| (every term is their product with positive
    decays), and a term meets n = max(K, V) + 2S + 8 float32 roundings in any form: the head-dim
    sum, at most S decay multiplications and additions over tokens and chunks, a few products and
    exponentials."""
    mag = recurrence(np.abs(q), np.abs(k), np.abs(v), g_gamma, np.abs(s0))
    n = max(q.shape[-1], v.shape[-1]) + 2 * q.shape[1] + 8
    return max(float(np.max(np.abs(np.asarray(a, np.float64) - b) / f32_sum_err(n, m)))
               for a, b, m in zip(got, want, mag))


@pytest.mark.parametrize("B,S,H,K,V,chunk,init", [
    (2, 37, 3, 5, 7, 8, True),         # tail chunk of 5
    (1, 1, 2, 4, 3, 16, False),        # one token
    (3, 64, 2, 8, 6, 16, True),        # an exact multiple of the chunk
    (1, 100, 4, 16, 32, 128, True),    # chunk longer than the sequence
    (2, 130, 2, 6, 10, 64, False),     # tail chunk of 2
    (1, 97, 6, 3, 5, 1, True),         # chunk of one token
    (2, 300, 3, 7, 9, 128, True),      # 3B chunk size, several chunks, tail of 44
])
def test_gla_chunked_equals_recurrence(B, S, H, K, V, chunk, init):
    q, k, v, g_gamma, s0 = _inputs(B, S, H, K, V, init, seed=S * 7 + H)
    want_o, want_s = recurrence(q, k, v, g_gamma, s0)
    t = lambda a: torch.tensor(a, dtype=torch.float32)
    o, s = gla_chunked(t(q), t(k), t(v), t(g_gamma), t(s0), chunk)
    assert tuple(o.shape) == (B, S, H, V) and tuple(s.shape) == (B, H, K, V)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    err = _within_f32((o, s), (want_o, want_s), q, k, v, g_gamma, s0)
    assert err <= 1, err


def test_gla_chunked_bf16_inputs_and_continuation():
    """bf16 q/k/v are upcast; prefill in two pieces (state handed on) equals one piece."""
    q, k, v, g_gamma, s0 = _inputs(2, 75, 4, 8, 12, True, seed=3)
    tb = lambda a: torch.tensor(a, dtype=torch.bfloat16)
    qb, kb, vb = tb(q), tb(k), tb(v)
    g, st = torch.tensor(g_gamma, dtype=torch.float32), torch.tensor(s0, dtype=torch.float32)
    o, s = gla_chunked(qb, kb, vb, g, st, 16)
    q, k, v = (x.float().numpy() for x in (qb, kb, vb))     # the bf16 values, exactly
    want_o, want_s = recurrence(q, k, v, g_gamma, s0)
    assert _within_f32((o, s), (want_o, want_s), q, k, v, g_gamma, s0) <= 1
    o1, s1 = gla_chunked(qb[:, :30], kb[:, :30], vb[:, :30], g, st, 16)
    o2, s2 = gla_chunked(qb[:, 30:], kb[:, 30:], vb[:, 30:], g, s1, 16)
    # the same sums, cut at token 30 instead of 32: each within float32 rounding of the exact ones
    assert _within_f32((torch.cat([o1, o2], 1), s2), (want_o, want_s), q, k, v, g_gamma, s0) <= 1


def test_gla_chunked_empty_sequence():
    st = torch.randn(2, 3, 4, 5)
    o, s = gla_chunked(torch.zeros(2, 0, 3, 4), torch.zeros(2, 0, 3, 4), torch.zeros(2, 0, 3, 5),
                       torch.full((3,), -0.5), st, 64)
    assert tuple(o.shape) == (2, 0, 3, 5) and torch.equal(s, st)


def test_gla_step_equals_recurrence():
    q, k, v, g_gamma, s0 = _inputs(3, 1, 5, 6, 4, True, seed=9)
    want_o, want_s = recurrence(q, k, v, g_gamma, s0)
    t = lambda a: torch.tensor(a, dtype=torch.float32)
    o, s = gla_step(t(q[:, 0]), t(k[:, 0]), t(v[:, 0]), t(g_gamma), t(s0))
    assert _within_f32((o[:, None], s), (want_o, want_s), q, k, v, g_gamma, s0) <= 1


def test_gla_float64_is_the_step_recurrence():
    """The packed float64 reference (`gla_float64`, the Triton prefill kernel's) against `gla_step`,
    step by step, for one request."""
    g = torch.Generator().manual_seed(3)
    H, K, V, L = 2, 8, 4, 9
    q, k, v = (torch.randn(L, H, d, generator=g, dtype=torch.float64) for d in (K, K, V))
    g_gamma = torch.tensor([-0.5, -0.01])
    s0 = torch.randn(1, H, K, V, generator=g, dtype=torch.float64)
    o, s = gla_float64(q, k, v, g_gamma, s0, torch.tensor([0, L]))
    st = s0
    for t in range(L):
        ot, st = gla_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g_gamma, st)
        assert torch.allclose(o[t], ot[0].double(), rtol=1e-5, atol=1e-6)   # gla_step is float32
    assert torch.allclose(s, st.double(), rtol=1e-5, atol=1e-6)
