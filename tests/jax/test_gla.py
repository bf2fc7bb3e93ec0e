"""The three GLA forms against a float64 NumPy token recurrence (an independent reference)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import f32_sum_err
from laplace_jax.ops import chunk_simple_gla, recurrent_simple_gla, simple_gla_step


def numpy_gla(q, k, v, g, s0=None, scale=None):
    """S_t = e^g S_{t-1} + k_t v_t^T ; o_t = scale S_t^T q_t, in float64."""
    q, k, v, g = (np.asarray(a, np.float64) for a in (q, k, v, g))
    B, T, H, K = q.shape
    s = np.zeros((B, H, K, v.shape[-1])) if s0 is None else np.asarray(s0, np.float64)
    scale = K ** -0.5 if scale is None else scale
    o = np.zeros((B, T, H, v.shape[-1]))
    for t in range(T):
        s = np.exp(g)[None, :, None, None] * s + np.einsum("bhk,bhv->bhkv", k[:, t], v[:, t])
        o[:, t] = scale * np.einsum("bhk,bhkv->bhv", q[:, t], s)
    return o, s


def numpy_gla_grads(q, k, v, g, s0, w, ws, scale=None):
    """d/d(q, k, v, s0) of sum(o * w) + sum(S_T * ws), in float64: G_t = dL/dS_t = e^g G_{t+1} +
    scale q_t w_t^T (G_T adds ws); dq_t = scale S_t w_t, dk_t = G_t v_t, dv_t = G_t^T k_t, ds0 = e^g G_1."""
    q, k, v, g, s0, w, ws = (np.asarray(a, np.float64) for a in (q, k, v, g, s0, w, ws))
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    lam = np.exp(g)[None, :, None, None]
    states, s = [], s0
    for t in range(T):
        s = lam * s + np.einsum("bhk,bhv->bhkv", k[:, t], v[:, t])
        states.append(s)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    G = ws.copy()
    for t in reversed(range(T)):
        G = G + scale * np.einsum("bhk,bhv->bhkv", q[:, t], w[:, t])
        dq[:, t] = scale * np.einsum("bhkv,bhv->bhk", states[t], w[:, t])
        dk[:, t] = np.einsum("bhkv,bhv->bhk", G, v[:, t])
        dv[:, t] = np.einsum("bhkv,bhk->bhv", G, k[:, t])
        G = lam * G
    return dq, dk, dv, G


def magnitude(fn, *arrays, **kw):
    """Each output's sum of |terms|: `fn` (a float64 reference above) on the absolute values. Every
    term is a product of the inputs and positive decays e^(g m), so this is exact."""
    return fn(*(a if i == 3 or a is None else np.abs(np.asarray(a, np.float64)) for i, a in enumerate(arrays)), **kw)


def gla_roundings(K, V, T):
    """Float32 roundings on one term's way into an output, in any of the forms: a sum over the K
    (or V) head dim, at most T token / chunk hand-offs each a multiplication by a decay and an
    addition, and a few products and exponentials (q k, the decay, v, the scale)."""
    return max(K, V) + 2 * T + 8


def within_f32(got, want, mag, n):
    """Worst |got - want| over f32_sum_err(n, Σ|terms|), elementwise: got a float32 result of sums
    of n roundings, want exact (float64). At most 1 where got is right."""
    err = np.abs(np.asarray(jnp.asarray(got, jnp.float32), np.float64) - want)
    return float(np.max(err / f32_sum_err(n, mag)))


def rel(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def make(B, T, H, K, V, seed=0, with_state=False):
    r = np.random.default_rng(seed)
    q, k = (r.standard_normal((B, T, H, K)).astype(np.float32) for _ in range(2))
    v = r.standard_normal((B, T, H, V)).astype(np.float32)
    # decays from a half-life of 1 token to 2048 tokens, as in the model
    g = (-np.log(2.0) / np.geomspace(1.0, 2048.0, H)).astype(np.float32)
    s0 = r.standard_normal((B, H, K, V)).astype(np.float32) if with_state else None
    return q, k, v, g, s0


@pytest.mark.parametrize("shape,chunking", [
    ((2, 48, 3, 5, 7), {"num_chunks": 16}),
    ((1, 64, 4, 8, 16), {"num_chunks": 4}),
    ((3, 40, 2, 3, 6), {"num_chunks": 1}),
    ((2, 37, 3, 5, 7), {"chunk_size": 8}),     # tail chunk of 5
    ((1, 5, 2, 4, 4), {"chunk_size": 16}),     # shorter than one chunk
])
@pytest.mark.parametrize("with_state", [False, True])
def test_forms_match_float64_recurrence(shape, chunking, with_state):
    q, k, v, g, s0 = make(*shape, with_state=with_state)
    o_ref, s_ref = numpy_gla(q, k, v, g, s0)
    o_mag, s_mag = magnitude(numpy_gla, q, k, v, g, s0)
    n = gla_roundings(*shape[3:], shape[1])
    forms = {
        "chunk": chunk_simple_gla(q, k, v, g, initial_state=s0, **chunking),
        "chunk_unrolled": chunk_simple_gla(q, k, v, g, initial_state=s0, unroll=True, **chunking),
        "chunk_matmul": chunk_simple_gla(q, k, v, g, initial_state=s0, hand_off="matmul", **chunking),
        "recurrent": recurrent_simple_gla(q, k, v, g, initial_state=s0),
    }
    state = jnp.zeros_like(s_ref, dtype=jnp.float32) if s0 is None else s0
    steps = []
    for t in range(shape[1]):
        o, state = simple_gla_step(q[:, t], k[:, t], v[:, t], g, state)
        steps.append(o)
    forms["step"] = (jnp.stack(steps, 1), state)
    for name, (o, s) in forms.items():
        assert within_f32(o, o_ref, o_mag, n) <= 1, name
        assert within_f32(s, s_ref, s_mag, n) <= 1, name
        assert s.dtype == jnp.float32


def test_explicit_scale():
    q, k, v, g, _ = make(1, 32, 2, 4, 4)
    o_ref, _ = numpy_gla(q, k, v, g, scale=0.3)
    o_mag, _ = magnitude(numpy_gla, q, k, v, g, scale=0.3)
    o, _ = chunk_simple_gla(q, k, v, g, num_chunks=4, scale=0.3)
    assert within_f32(o, o_ref, o_mag, gla_roundings(4, 4, 32)) <= 1


def test_chunked_gradients_match_recurrent():
    """The chunked forms' gradients and autodiff of the token recurrence, each against float64."""
    q, k, v, g, s0 = make(2, 32, 3, 4, 6, seed=1, with_state=True)
    w = np.random.default_rng(2).standard_normal((2, 32, 3, 6)).astype(np.float32)
    ws = np.random.default_rng(3).standard_normal(s0.shape).astype(np.float32)
    want = numpy_gla_grads(q, k, v, g, s0, w, ws)
    mags = magnitude(numpy_gla_grads, q, k, v, g, s0, w, ws)
    n = gla_roundings(4, 6, 32)

    def loss(fn, q, k, v, s0):
        o, s = fn(q, k, v, g, initial_state=s0)
        return jnp.sum(o * w) + jnp.sum(s * ws)

    forms = {"recurrent": recurrent_simple_gla}
    for kw in ({}, {"hand_off": "matmul"}, {"unroll": True}):
        forms[str(kw)] = lambda *a, kw=kw, **k2: chunk_simple_gla(*a, num_chunks=4, **kw, **k2)
    for form, fn in forms.items():
        got = jax.grad(lambda *a: loss(fn, *a), argnums=(0, 1, 2, 3))(q, k, v, s0)
        for name, a, b, mag in zip("q k v initial_state".split(), got, want, mags):
            assert within_f32(a, b, mag, n) <= 1, (name, form)


def test_bf16_inputs_accumulate_in_float32():
    q, k, v, g, _ = make(1, 128, 4, 16, 32, seed=4)
    o_ref, s_ref = numpy_gla(q, k, v, g)
    bf = [jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)]
    o, s = chunk_simple_gla(*bf, g, num_chunks=8)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    assert rel(o, o_ref) < 3e-2 and rel(s, s_ref) < 3e-2


def test_bad_chunking_is_a_clear_error():
    q, k, v, g, _ = make(1, 30, 2, 4, 4)
    with pytest.raises(ValueError, match="not divisible by num_chunks=16"):
        chunk_simple_gla(q, k, v, g)
