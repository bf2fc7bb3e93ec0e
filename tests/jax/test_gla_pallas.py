"""The Pallas GLA kernels (run by Pallas' interpreter on CPU) against the float64 recurrence, the XLA
chunked form and autodiff of the token recurrence; and their Triton lowering for CUDA (no GPU needed)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laplace_jax.ops import chunk_simple_gla, recurrent_simple_gla
from laplace_jax.ops.gla_pallas import _pieces, chunk_simple_gla_pallas, supported
from test_gla import gla_roundings, magnitude, make, numpy_gla, numpy_gla_grads, within_f32

# K = 48 and V = 80 are cut into power-of-two pieces (32 + 16, 64 + 16), as 96 and 192 are in the 3B model.
SHAPE = (2, 64, 2, 48, 80)


@pytest.mark.parametrize("with_state", [False, True])
def test_forward_matches_float64_recurrence(with_state):
    q, k, v, g, s0 = make(*SHAPE, with_state=with_state)
    o_ref, s_ref = numpy_gla(q, k, v, g, s0)
    o_mag, s_mag = magnitude(numpy_gla, q, k, v, g, s0)
    o, s = chunk_simple_gla_pallas(q, k, v, g, chunk_size=16, initial_state=s0, interpret=True)
    assert o.shape == o_ref.shape and o.dtype == jnp.float32 and s.dtype == jnp.float32
    n = gla_roundings(*SHAPE[3:], SHAPE[1])
    assert within_f32(o, o_ref, o_mag, n) <= 1 and within_f32(s, s_ref, s_mag, n) <= 1


def test_gradients_match_autodiff_of_recurrence():
    """The Pallas backward and autodiff of the token recurrence, each against float64."""
    q, k, v, g, s0 = make(*SHAPE, seed=1, with_state=True)
    r = np.random.default_rng(2)
    w = r.standard_normal(q.shape[:3] + (v.shape[-1],)).astype(np.float32)
    ws = r.standard_normal(s0.shape).astype(np.float32)
    want = numpy_gla_grads(q, k, v, g, s0, w, ws)
    mags = magnitude(numpy_gla_grads, q, k, v, g, s0, w, ws)
    n = gla_roundings(*SHAPE[3:], SHAPE[1])

    def loss(fn, q, k, v, s0):
        o, s = fn(q, k, v, g, initial_state=s0)
        return jnp.sum(o * w) + jnp.sum(s * ws)

    pallas = lambda *a, **kw: chunk_simple_gla_pallas(*a, chunk_size=16, interpret=True, **kw)
    for form, fn in (("pallas", pallas), ("recurrent", recurrent_simple_gla)):
        got = jax.grad(lambda *a: loss(fn, *a), argnums=(0, 1, 2, 3))(q, k, v, s0)
        for name, a, b, mag in zip(("q", "k", "v", "initial_state"), got, want, mags):
            assert within_f32(a, b, mag, n) <= 1, (name, form)


def test_bf16_matches_xla_chunked_form():
    """Same dtype policy as the XLA form: bf16 products, f32 accumulation, bf16 chunk states."""
    q, k, v, g, _ = make(1, 256, 2, 32, 64, seed=3)
    bf = [jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)]
    do = jnp.asarray(np.random.default_rng(4).standard_normal((1, 256, 2, 64)), jnp.bfloat16)

    def fwd_bwd(**kw):
        o, vjp = jax.vjp(lambda q, k, v: chunk_simple_gla(q, k, v, g, chunk_size=64, **kw)[0], *bf)
        return (o, *vjp(do))

    for name, a, b in zip(("o", "dq", "dk", "dv"), fwd_bwd(impl="pallas"), fwd_bwd(hand_off="matmul")):
        assert a.dtype == jnp.bfloat16, name
        a, b = (np.asarray(x.astype(jnp.float32), np.float64) for x in (a, b))
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-2, name


def test_impl_pallas_falls_back_to_xla_for_a_tail_chunk():
    q, k, v, g, _ = make(1, 40, 2, 16, 16)
    o_ref, _ = numpy_gla(q, k, v, g)
    o_mag, _ = magnitude(numpy_gla, q, k, v, g)
    assert supported(40, 16, 16, 16) == "T=40 is not a multiple of chunk_size=16"
    o, _ = chunk_simple_gla(q, k, v, g, chunk_size=16, impl="pallas")
    assert within_f32(o, o_ref, o_mag, gla_roundings(16, 16, 40)) <= 1
    with pytest.raises(ValueError, match="T=40 is not a multiple of chunk_size=16; use ops.gla"):
        chunk_simple_gla_pallas(q, k, v, g, chunk_size=16)


def test_pieces_are_powers_of_two_covering_the_dim():
    assert _pieces(96) == ((0, 64), (64, 32)) and _pieces(192) == ((0, 128), (128, 64))
    assert _pieces(128) == ((0, 128),)


def test_3b_shape_lowers_to_four_triton_kernels_for_cuda():
    """Lowering (not compiling) for CUDA checks Triton's constraints (power-of-two tiles) on a CPU machine."""
    sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    B, T, H, K, V = 2, 2048, 16, 96, 192

    def f(q, k, v, g, do):
        o, vjp = jax.vjp(lambda q, k, v: chunk_simple_gla_pallas(q, k, v, g, interpret=False)[0], q, k, v)
        return o, vjp(do)

    calls = custom_calls_for_cuda(f, sd(B, T, H, K), sd(B, T, H, K), sd(B, T, H, V),
                                  jax.ShapeDtypeStruct((H,), jnp.float32), sd(B, T, H, V))
    assert calls == ["__gpu$xla.gpu.triton"] * 4, calls  # states, output, dstates, grads


def custom_calls_for_cuda(f, *shapes) -> list[str]:
    """The custom-call targets of `f` lowered (not compiled) for CUDA on this CPU machine; skips the
    test where jax needs a real (or abstract) GPU to read its compute capability (jax >= 0.11)."""
    try:
        low = jax.jit(f).trace(*shapes).lower(lowering_platforms=("cuda",))
    except RuntimeError as e:
        if "No supported GPU devices" in str(e):
            pytest.skip(str(e)[:100])
        raise
    return re.findall(r"custom_call @(\S+)\(", low.as_text())
