"""The three GLA forms against a float64 NumPy token recurrence (an independent reference)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
        assert rel(o, o_ref) <= 1e-5, name
        assert rel(s, s_ref) <= 1e-5, name
        assert s.dtype == jnp.float32


def test_explicit_scale():
    q, k, v, g, _ = make(1, 32, 2, 4, 4)
    o_ref, _ = numpy_gla(q, k, v, g, scale=0.3)
    o, _ = chunk_simple_gla(q, k, v, g, num_chunks=4, scale=0.3)
    assert rel(o, o_ref) <= 1e-5


def test_chunked_gradients_match_recurrent():
    q, k, v, g, s0 = make(2, 32, 3, 4, 6, seed=1, with_state=True)
    w = np.random.default_rng(2).standard_normal((2, 32, 3, 6)).astype(np.float32)
    ws = np.random.default_rng(3).standard_normal(s0.shape).astype(np.float32)

    def loss(fn, q, k, v, s0):
        o, s = fn(q, k, v, g, initial_state=s0)
        return jnp.sum(o * w) + jnp.sum(s * ws)

    g_rec = jax.grad(lambda *a: loss(recurrent_simple_gla, *a), argnums=(0, 1, 2, 3))(q, k, v, s0)
    for kw in ({}, {"hand_off": "matmul"}, {"unroll": True}):
        chunk = lambda *a, **k2: chunk_simple_gla(*a, num_chunks=4, **kw, **k2)  # noqa: E731
        g_chunk = jax.grad(lambda *a: loss(chunk, *a), argnums=(0, 1, 2, 3))(q, k, v, s0)
        for name, a, b in zip("q k v initial_state".split(), g_chunk, g_rec):
            assert rel(a, np.asarray(b, np.float64)) <= 1e-5, (name, kw)


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
