"""The ops with hand-written backward passes (ops.glu.swiglu, ops.norm.layer_norm, ops.split.split_last)
against autodiff of the plain formula, and the form of their backward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laplace_jax.ops.glu import swiglu
from laplace_jax.ops.norm import layer_norm
from laplace_jax.ops.split import split_last


def _plain(y):
    a, b = jnp.split(y.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.silu(a) * b).astype(y.dtype)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_swiglu_value_and_grad_match_autodiff(dtype, tol):
    y = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 2 * 24), jnp.float32).astype(dtype) * 3
    w = jax.random.normal(jax.random.PRNGKey(1), (3, 5, 24), jnp.float32)
    loss = lambda f: lambda y: jnp.sum(f(y).astype(jnp.float32) * w)  # noqa: E731
    np.testing.assert_allclose(np.float32(swiglu(y)), np.float32(_plain(y)), rtol=tol, atol=tol)
    got, ref = jax.grad(loss(swiglu))(y), jax.grad(loss(_plain))(y)
    assert got.dtype == ref.dtype == dtype
    err = float(jnp.linalg.norm((got - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
    assert err < tol, err


def test_swiglu_cotangent_is_built_once_behind_a_barrier():
    """One concatenate of the two halves' cotangents, materialised by an optimization barrier (XLA
    otherwise fused it into both GEMMs that read it); the plain form has no barrier."""
    y = jnp.ones((4, 16), jnp.bfloat16)
    grad = lambda f: str(jax.make_jaxpr(jax.grad(lambda y: jnp.sum(f(y).astype(jnp.float32))))(y))  # noqa: E731
    ours = grad(swiglu)
    assert ours.count("concatenate") == 1 and ours.count("optimization_barrier") == 1
    assert "optimization_barrier" not in grad(_plain)   # the check can fail: the plain form has none


def _plain_layer_norm(x, scale, eps):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(jnp.square(x - mean).mean(-1, keepdims=True) + eps) * scale


def test_layer_norm_value_and_grads_match_autodiff():
    x = 3 + 2 * jax.random.normal(jax.random.PRNGKey(0), (3, 5, 64), jnp.float32)
    scale = 1 + 0.1 * jax.random.normal(jax.random.PRNGKey(1), (64,), jnp.float32)
    w = jax.random.normal(jax.random.PRNGKey(2), (3, 5, 64), jnp.float32)
    np.testing.assert_allclose(np.asarray(layer_norm(x, scale, 1e-5)),
                               np.asarray(_plain_layer_norm(x, scale, 1e-5)), rtol=1e-5, atol=1e-5)
    loss = lambda f: lambda x, s: jnp.sum(jnp.sin(f(x, s, 1e-5)) * w)  # noqa: E731
    got = jax.grad(loss(layer_norm), argnums=(0, 1))(x, scale)
    ref = jax.grad(loss(_plain_layer_norm), argnums=(0, 1))(x, scale)
    for name, a, b in zip(("x", "scale"), got, ref):
        assert a.dtype == b.dtype == jnp.float32, name
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 1e-5, name


def test_layer_norm_backward_takes_three_row_reductions():
    """mean(ĝ), mean(ĝ x̂) and d scale's sum over rows; autodiff of the plain form takes five."""
    x, scale = jnp.ones((4, 64)), jnp.ones((64,))
    count = lambda f: str(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(f(x, scale, 1e-5))))(x)).count(  # noqa: E731
        "reduce_sum") - 3                  # the forward's mean and variance, the loss's sum
    assert (count(layer_norm), count(_plain_layer_norm)) == (3, 5)


def test_split_last_matches_jnp_split_and_builds_the_cotangent_once():
    y = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 10), jnp.float32)
    ws = [jax.random.normal(jax.random.PRNGKey(i), (2, 3, n)) for i, n in enumerate((4, 4, 2), 1)]

    def loss(split):
        return lambda y: sum(jnp.sum(jnp.sin(p) * w) for p, w in zip(split(y), ws))
    ours = lambda y: split_last(y, (4, 4, 2))                       # noqa: E731
    plain = lambda y: jnp.split(y, [4, 8], axis=-1)                 # noqa: E731
    for a, b in zip(ours(y), plain(y)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(jax.grad(loss(ours))(y)), np.asarray(jax.grad(loss(plain))(y)))
    jaxpr = str(jax.make_jaxpr(jax.grad(loss(ours)))(y))
    assert jaxpr.count("concatenate") == 1 and "optimization_barrier" in jaxpr
    with pytest.raises(ValueError, match="do not add up"):
        split_last(y, (4, 4))
