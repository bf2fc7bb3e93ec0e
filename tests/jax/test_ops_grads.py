"""The ops with hand-written backward passes (ops.glu.swiglu, ops.norm.layer_norm, ops.split.split_last)
against autodiff of the plain formula, and the form of their backward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import U32, f32_sum_err
from laplace_jax.ops.glu import swiglu
from laplace_jax.ops.norm import layer_norm
from laplace_jax.ops.split import split_last


def _plain(y):
    a, b = jnp.split(y.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.silu(a) * b).astype(y.dtype)


# Elementwise, no sums: silu(a) b and its derivative take at most 8 roundings each (products, the
# sum 1 + a(1 - σ), σ within 2 ulps) in either form; two forms: 16 units of the dtype's roundoff
# (float32: 16u = 9.5e-7, relative; bfloat16: the float32 math rounded once to 8 bits, 2^-8, and
# 1e-2 is under 3 of those).
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 16 * U32), (jnp.bfloat16, 1e-2)])
def test_swiglu_value_and_grad_match_autodiff(dtype, tol):
    y = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 2 * 24), jnp.float32).astype(dtype) * 3
    w = jax.random.normal(jax.random.PRNGKey(1), (3, 5, 24), jnp.float32)
    loss = lambda f: lambda y: jnp.sum(f(y).astype(jnp.float32) * w)
    np.testing.assert_allclose(np.float32(swiglu(y)), np.float32(_plain(y)), rtol=tol, atol=tol)
    got, ref = jax.grad(loss(swiglu))(y), jax.grad(loss(_plain))(y)
    assert got.dtype == ref.dtype == dtype
    err = float(jnp.linalg.norm((got - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
    assert err < tol, err


def test_swiglu_cotangent_is_built_once_behind_a_barrier():
    """One concatenate of the two halves' cotangents, materialised by an optimization barrier (XLA
    otherwise fused it into both GEMMs that read it); the plain form has no barrier."""
    y = jnp.ones((4, 16), jnp.bfloat16)
    grad = lambda f: str(jax.make_jaxpr(jax.grad(lambda y: jnp.sum(f(y).astype(jnp.float32))))(y))
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
    # Each form's mean (a sum of D = 64 terms) errs by f32_sum_err(D, sum|x|) / D, which moves x̂ by
    # that over σ; its variance (positive terms) by f32_sum_err(D, 1) relatively, x̂ by half that,
    # plus 8u for the elementwise steps (the rsqrt within 2 ulps). Two forms, times |scale|.
    D = x.shape[-1]
    atol = 2 * float(jnp.max(jnp.abs(scale))) * float(jnp.max(
        f32_sum_err(D, jnp.abs(x).sum(-1)) / D / x.std(-1)))          # 1.4e-5 here
    rtol = f32_sum_err(D, 1.0) + 16 * U32                            # 3.8e-6
    np.testing.assert_allclose(np.asarray(layer_norm(x, scale, 1e-5)),
                               np.asarray(_plain_layer_norm(x, scale, 1e-5)), rtol=rtol, atol=atol)
    loss = lambda f: lambda x, s: jnp.sum(jnp.sin(f(x, s, 1e-5)) * w)
    got = jax.grad(loss(layer_norm), argnums=(0, 1))(x, scale)
    ref = jax.grad(loss(_plain_layer_norm), argnums=(0, 1))(x, scale)
    for name, a, b in zip(("x", "scale"), got, ref):
        assert a.dtype == b.dtype == jnp.float32, name
        # the backward's row sums (over D = 64, and 15 rows for d scale) of terms of the gradient's
        # own scale, in two forms: 2 f32_sum_err(64, 1) + 16u = 6.7e-6 normwise, under 1e-5
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 1e-5, name


def test_layer_norm_backward_takes_three_row_reductions():
    """mean(ĝ), mean(ĝ x̂) and d scale's sum over rows; autodiff of the plain form takes five."""
    x, scale = jnp.ones((4, 64)), jnp.ones((64,))
    count = lambda f: str(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(f(x, scale, 1e-5))))(x)).count(
        "reduce_sum") - 3                  # the forward's mean and variance, the loss's sum
    assert (count(layer_norm), count(_plain_layer_norm)) == (3, 5)


def test_split_last_matches_jnp_split_and_builds_the_cotangent_once():
    y = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 10), jnp.float32)
    ws = [jax.random.normal(jax.random.PRNGKey(i), (2, 3, n)) for i, n in enumerate((4, 4, 2), 1)]

    def loss(split):
        return lambda y: sum(jnp.sum(jnp.sin(p) * w) for p, w in zip(split(y), ws))
    ours = lambda y: split_last(y, (4, 4, 2))
    plain = lambda y: jnp.split(y, [4, 8], axis=-1)
    for a, b in zip(ours(y), plain(y)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(jax.grad(loss(ours))(y)), np.asarray(jax.grad(loss(plain))(y)))
    jaxpr = str(jax.make_jaxpr(jax.grad(loss(ours)))(y))
    assert jaxpr.count("concatenate") == 1 and "optimization_barrier" in jaxpr
    with pytest.raises(ValueError, match="do not add up"):
        split_last(y, (4, 4))
