"""The gated mix's Pallas kernels (Pallas' interpreter on CPU) against a float64 NumPy reference and
autodiff of the XLA form; the dispatcher's fallback; the model with either form; the Triton lowering."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import U32, f32_sum_err
from laplace_jax.config import load_config
from laplace_jax.model import forward, init_params
from laplace_jax.ops.mix import gated_mix, gated_mix_xla
from laplace_jax.ops.mix_pallas import gated_mix_pallas, supported
from test_gla_pallas import custom_calls_for_cuda

# K = 48 and V = 80 are read in power-of-two pieces (32 + 16, 64 + 16), as 96 and 192 are in the 3B model.
N, H, K, V, T = 64, 4, 48, 80, 2
EPS = 1e-5


def make(n=N, seed=0, dtype=np.float32):
    r = np.random.default_rng(seed)
    x = lambda *s: r.standard_normal(s).astype(np.float32)
    arrays = [x(n, H, K), x(n, H, K), x(n, H, V), x(n, H, V), x(n, H, V)]
    return [a.astype(dtype) for a in arrays] + [0.5 * x(H, K), 1 + 0.2 * x(T, V)]


def numpy_mix(q, k, v, g, o, a, w):
    q, k, v, g, o, a, w = (np.asarray(t, np.float64) for t in (q, k, v, g, o, a, w))
    sig = lambda z: 1 / (1 + np.exp(-z))
    x = o + sig(np.sum(q * a * k, -1, keepdims=True)) * v
    y = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS) * np.repeat(w, H // T, axis=0)
    return y * g * sig(g)


def mix_err(q, k, v, g, o, a, w):
    """A float32 rounding bound on each output of the mix (float64; the formula in ops/mix.py):
    - the K-long sum s = sum(q a k) errs by f32_sum_err(K, sum|q a k|), reaching y through the
      gate's slope (at most 1/4) times v and the norm's factor rms(x)^-1 w silu(g);
    - x = o + gate v rounds twice (plus the gate's own few ulps): 4u (|o| + |gate v|), same factor;
    - the V-long mean of x^2 (positive terms) errs by λ√V u relatively, halved by the rsqrt;
    - the rest (the rsqrt, products with w, g and σ(g)): at most 12u of |y| (each within 2 ulps)."""
    q, k, v, g, o, a, w = (np.asarray(t, np.float64) for t in (q, k, v, g, o, a, w))
    sig = lambda z: 1 / (1 + np.exp(-z))
    gate = sig(np.sum(q * a * k, -1, keepdims=True))
    x = o + gate * v
    factor = np.abs(np.repeat(w, H // T, axis=0) * g * sig(g)) / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS)
    s_err = f32_sum_err(q.shape[-1], np.sum(np.abs(q * a * k), -1, keepdims=True))
    y = np.abs(numpy_mix(q, k, v, g, o, a, w))
    return factor * (np.abs(v) * s_err / 4 + 4 * U32 * (np.abs(o) + np.abs(gate * v))) + y * (
        f32_sum_err(v.shape[-1], 1.0) / 2 + 12 * U32)


def within_f32(got, want, err):
    """Worst |got - want| / err elementwise: at most 1 where got is right."""
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    return float(np.max(np.abs(got - want) / err))


def rel(a, b):
    a, b = np.asarray(jnp.asarray(a, jnp.float32), np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def pallas(*args):
    return gated_mix_pallas(*args, EPS, interpret=True)


def test_forward_matches_float64_reference():
    ins = make()
    y = pallas(*ins)
    assert y.shape == (N, H, V) and y.dtype == jnp.float32
    assert within_f32(y, numpy_mix(*ins), mix_err(*ins)) <= 1


def test_gradients_match_autodiff_of_the_xla_form():
    ins = [jnp.asarray(t) for t in make(seed=1)]
    dy = jnp.asarray(np.random.default_rng(2).standard_normal((N, H, V)), jnp.float32)

    def grads(fn):
        return jax.vjp(lambda *x: fn(*x, EPS), *ins)[1](dy)

    for name, got, want in zip("qkvgoaw", grads(lambda *x: pallas(*x[:7])), grads(gated_mix_xla)):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert rel(got, want) <= 1e-5, name


@pytest.mark.parametrize("o_dtype", [jnp.bfloat16, jnp.float32])   # f32: a decode step's GLA output
def test_bf16_keeps_dtypes_and_matches_the_xla_form(o_dtype):
    ins = [jnp.asarray(t) for t in make(seed=3)]
    ins[:5] = [t.astype(jnp.bfloat16) for t in ins[:4]] + [ins[4].astype(o_dtype)]
    dy = jnp.asarray(np.random.default_rng(4).standard_normal((N, H, V)), jnp.bfloat16)

    def fwd_bwd(fn):
        y, vjp = jax.vjp(lambda *x: fn(*x, EPS), *ins)
        return (y, *vjp(dy))

    for name, got, want in zip(("y",) + tuple("qkvgoaw"), fwd_bwd(lambda *x: pallas(*x[:7])),
                               fwd_bwd(gated_mix_xla)):
        assert got.dtype == want.dtype, name
        assert rel(got, np.asarray(want.astype(jnp.float32), np.float64)) < 1e-2, name


def test_leading_axes_and_the_dispatchers_fallback():
    ins = make(n=2 * 32)
    batched = [t.reshape(2, 32, *t.shape[1:]) for t in ins[:5]] + ins[5:]
    want = numpy_mix(*ins).reshape(2, 32, H, V)
    assert within_f32(gated_mix(*batched, EPS, impl="pallas"), want, mix_err(*ins).reshape(want.shape)) <= 1
    few = make(n=8)                          # 8 tokens (a small decode batch): not a multiple of 16
    assert supported(8, K, V) == "8 tokens are not a multiple of 16"
    assert within_f32(gated_mix(*few, EPS, impl="pallas"), numpy_mix(*few), mix_err(*few)) <= 1
    with pytest.raises(ValueError, match="8 tokens are not a multiple of 16; use ops.mix.gated_mix_xla"):
        gated_mix_pallas(*few, EPS)
    with pytest.raises(ValueError, match="impl='triton': choose 'auto', 'xla' or 'pallas'"):
        gated_mix(*few, EPS, impl="triton")
    assert supported(64, 40, V) == f"head dims K=40, V={V} must be multiples of 16"


def test_model_loss_and_grads_agree_with_either_mix():
    base = load_config("laplace_tiny")
    cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, vocab_size=256, num_layers=2)).net
    params = init_params(cfg.arch, jax.random.PRNGKey(0))
    params["layers"]["aug_balance"] = 0.3 * jax.random.normal(jax.random.PRNGKey(1),
                                                              params["layers"]["aug_balance"].shape)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, cfg.arch.seq_len), 0, cfg.arch.vocab_size)

    def value_and_grad(impl):
        c = cfg.with_execution(mix_impl=impl)
        return jax.value_and_grad(lambda p: jnp.mean(forward(p, tokens, c) ** 2))(params)

    (lx, gx), (lp, gp) = value_and_grad("xla"), value_and_grad("pallas")
    # The loss is one XLA mean of z^2 (positive terms, summed the same way for both) over 131,072
    # logits that differ only by the mix's float32 rounding (a few u: the tests above): its relative
    # change is about twice their mean relative change, and 1e-6 = 17u is above that.
    assert abs(float(lx) - float(lp)) <= 1e-6 * abs(float(lx))
    # Two float32 backward passes through the whole model, summing in different orders; their
    # longest sums run over the 512 tokens: 2 f32_sum_err(512, 1) = 1.6e-5 of sum|terms| (λ = 6;
    # 2.7e-6 at λ = 1, the typical size). Normwise over a whole gradient, 1e-5 = 168u holds that
    # (measured: at most 1.1e-6, over the XLA:CPU ISA, thread and optimisation settings tried).
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(gx), jax.tree.leaves(gx), jax.tree.leaves(gp)):
        assert rel(b, np.asarray(a, np.float64)) <= 1e-5, jax.tree_util.keystr(path[0])


def test_3b_shape_lowers_to_two_triton_kernels_for_cuda():
    """Lowering (not compiling) for CUDA checks Triton's constraints (power-of-two tiles) on a CPU machine."""
    sd = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
    n, h, k, v, t = 32768, 16, 96, 192, 4

    def f(*args):
        y, vjp = jax.vjp(lambda *x: gated_mix_pallas(*x, EPS, interpret=False), *args[:7])
        return y, vjp(args[7])

    calls = custom_calls_for_cuda(f, sd(n, h, k), sd(n, h, k), sd(n, h, v), sd(n, h, v), sd(n, h, v),
                                  sd(h, k, dt=jnp.float32), sd(t, v, dt=jnp.float32), sd(n, h, v))
    assert calls == ["__gpu$xla.gpu.triton"] * 2, calls  # forward, backward
