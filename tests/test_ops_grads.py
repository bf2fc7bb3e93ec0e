"""The ops with hand-written backward passes (ops.glu.swiglu, ops.split.split_last) against
autodiff of the plain formula, and the form of their backward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laplace_jax.ops.glu import swiglu
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
