"""The model's three entry points agree: prefill + decode_step = the full-sequence logits."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import f32_sum_err, logit_atol
from laplace_jax.config import load_config
from laplace_jax.model import (LaplaceLM, decode_step, forward, init_params, init_state, prefill,
                               state_bytes_per_sequence)

SMALL = ["model.num_chunks=4", "model.seq_len=64", "model.vocab_size=512"]
CFG = load_config("laplace_tiny", SMALL).net
_decode = jax.jit(decode_step, static_argnums=3)
_prefill = jax.jit(prefill, static_argnums=2)
_forward = jax.jit(forward, static_argnums=2)


@pytest.fixture(scope="module")
def params():
    p = init_params(CFG.arch, jax.random.PRNGKey(0))
    # move every weight off its init (aug_balance starts at 0, norms at 1) so each one matters
    keys = iter(jax.random.split(jax.random.PRNGKey(1), 64))
    noise = {id(a): 0.05 * jax.random.normal(next(keys), a.shape) for a in jax.tree.leaves(p)}
    return jax.jit(lambda p, n: jax.tree.map(jnp.add, p, n))(p, jax.tree.unflatten(
        jax.tree.structure(p), [noise[id(a)] for a in jax.tree.leaves(p)]))


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.PRNGKey(2), (2, 64), 0, CFG.arch.vocab_size)


def rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def test_param_tree_matches_contract(params):
    L, D = CFG.arch.num_layers, CFG.arch.d_model
    assert params["embed"].shape == (CFG.arch.vocab_size, D)
    assert params["lm_head"].shape == (D, CFG.arch.vocab_size)
    assert params["layers"]["w_qkvg"].shape == (L, D, CFG.arch.qkvg_dim)
    assert params["layers"]["w_12"].shape == (L, D, 2 * CFG.arch.ffn_dim)
    assert params["layers"]["aug_balance"].shape == (L, CFG.arch.num_heads, CFG.arch.d_k)
    fresh = init_params(CFG.arch, jax.random.PRNGKey(0))
    assert not np.any(fresh["layers"]["aug_balance"])  # σ(0) = ½: half-strength value skip


def test_module_apply_equals_pure_forward(params, tokens):
    a = LaplaceLM(CFG).apply({"params": params}, tokens)
    b = forward(params, tokens, CFG)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("prompt_len", [1, 16, 23])  # one token, a chunk multiple, and not
def test_prefill_then_decode_equals_full_sequence(params, tokens, prompt_len):
    full = _forward(params, tokens, CFG)
    logits, state = _prefill(params, tokens[:, :prompt_len], CFG)
    # Chunked GLA (other chunk sizes) vs the token recurrence: other float32 algorithms, not only
    # other orders; each is within float32 rounding of the exact logits (logit_atol / max|logit|
    # = 3.3e-5 for the head's sum; the GLA's sums run over at most 64 tokens), so 1e-4 of max|logit|
    # (3x that) holds on any machine, and a wrong decay or a lost state moves logits by 1e-2 or more.
    assert rel(logits, full[:, :prompt_len]) <= 1e-4
    for t in range(prompt_len, tokens.shape[1]):  # decoding crosses several chunk boundaries
        step_logits, state = _decode(params, tokens[:, t], state, CFG)
        assert rel(step_logits, full[:, t]) <= 1e-4, t


def test_prefill_in_pieces_continues_the_state(params, tokens):
    full = _forward(params, tokens, CFG)
    state, outs = None, []
    for a, b in ((0, 5), (5, 21), (21, 40), (40, 64)):  # pieces of odd sizes, across chunk edges
        logits, state = _prefill(params, tokens[:, a:b], CFG, state)
        outs.append(logits)
    assert rel(jnp.concatenate(outs, 1), full) <= 1e-4    # as in the test above


def test_decode_from_zero_state_equals_prefill(params, tokens):
    state = init_state(CFG.arch, 2)
    logits, _ = _prefill(params, tokens[:, :8], CFG)
    for t in range(8):
        step_logits, state = _decode(params, tokens[:, t], state, CFG)
        assert rel(step_logits, logits[:, t]) <= 1e-4    # as in test_prefill_then_decode_...


def test_state_is_fixed_size_float32(params, tokens):
    _, s_short = prefill(params, tokens[:, :3], CFG)
    _, s_long = prefill(params, tokens, CFG)
    for a, b in zip(jax.tree.leaves(s_short), jax.tree.leaves(s_long)):
        assert a.shape == b.shape and a.dtype == jnp.float32
    nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(s_long)) // 2
    assert nbytes == state_bytes_per_sequence(CFG.arch)


@pytest.mark.parametrize("overrides", [["execution.scan_layers=false"], ["execution.remat=full"],
                                       ["execution.gla_unroll=true"], ["execution.remat=dots_no_batch"],
                                       ["execution.remat=dots_gla"], ["execution.remat=dots_acts"]])
def test_layer_loop_variants_agree(params, tokens, overrides):
    cfg = load_config("laplace_tiny", SMALL + overrides).net
    ref = _forward(params, tokens, CFG)
    out = _forward(params, tokens, cfg)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=0, atol=logit_atol(params))
    grad = _grad_qkvg(params, tokens, cfg)
    # d w_qkvg sums over the 128 tokens and back through the layers: two float32 evaluations differ
    # by about 2 f32_sum_err(128, sum|terms|) = 8e-6 of sum|terms|; 1e-4 of the largest entry allows
    # sum|terms| up to 12x that entry (measured: 2.3e-7).
    assert rel(grad, _grad_qkvg(params, tokens, CFG)) <= 1e-4


def _grad_jaxpr(remat: str, **model):
    cfg = load_config("laplace_tiny", SMALL).net.with_execution(remat=remat, **model)
    p = init_params(cfg.arch, jax.random.PRNGKey(0))
    toks = jnp.zeros((1, cfg.arch.seq_len), jnp.int32)
    return p, jax.make_jaxpr(jax.grad(lambda p: forward(p, toks, cfg).mean()))(p)


def _eqns(jaxpr):
    """Every equation of a jaxpr, inside scan, remat and custom_vjp bodies too."""
    from jax._src import core
    for e in jaxpr.eqns:
        yield e
        for sub in core.jaxprs_in_params(e.params):
            yield from _eqns(sub)


def _weight_dots(params, closed) -> int:
    """dot_generals that read a layer weight."""
    shapes = {tuple(a.shape[1:]) for a in jax.tree.leaves(params["layers"]) if a.ndim == 3}
    return sum(e.primitive.name == "dot_general" and any(tuple(v.aval.shape) in shapes for v in e.invars)
               for e in _eqns(closed.jaxpr))


@pytest.mark.parametrize("dense_output", ["compute", "float32"])
def test_dot_policies_rerun_no_projection(dense_output):
    """Under the dot-saving remat policies the backward re-runs none of the layer's projections
    (bf16 or float32 outputs): as many weight GEMMs as without remat; full remat re-runs three."""
    counts = {r: _weight_dots(*_grad_jaxpr(r, compute_dtype="bfloat16", dense_output=dense_output))
              for r in ("none", "dots_no_batch", "dots", "dots_gla", "dots_acts", "full")}
    assert counts["full"] == counts["none"] + 3, counts
    assert all(counts[r] == counts["none"] for r in ("dots_no_batch", "dots", "dots_gla", "dots_acts")), counts


def test_unrolled_layers_stack_weight_grads_with_one_concatenate():
    """With scan_layers=false the stacked weights are split once, so their gradients are one
    concatenate, not a zero-padded [L, ...] array per layer summed elementwise (the transpose of
    indexing a[i]; XLA ran that sum at a fraction of bandwidth)."""
    params, closed = _grad_jaxpr("dots_gla", scan_layers=False)
    stacked = {tuple(a.shape) for a in jax.tree.leaves(params["layers"])}
    found = {"pad": 0, "concatenate": 0}
    for e in _eqns(closed.jaxpr):
        if e.primitive.name in found and tuple(e.outvars[0].aval.shape) in stacked:
            found[e.primitive.name] += 1
    assert found["pad"] == 0 and found["concatenate"] >= len(stacked), found


@pytest.mark.skipif(tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11),
                    reason="jax 0.11 keeps both forward calls of the interpreted (CPU) kernels in the "
                           "graph; on GPUs under jax 0.11.2 the profiles of BENCHMARKS.md runs 12-17 "
                           "show each forward kernel once per layer with dots_gla/dots_acts")
def test_gla_saving_policies_run_the_gla_forward_once():
    """dots_gla / dots_acts keep the Pallas GLA's output and chunk states, so the backward re-runs
    neither GLA forward kernel; dots_no_batch re-runs both."""
    import re
    counts = {}
    for remat in ("dots_no_batch", "dots_gla", "dots_acts"):
        jaxpr = str(_grad_jaxpr(remat, gla_impl="pallas")[1])
        names = re.findall(r"name=(gla_states_fwd|gla_output|gla_states_bwd|gla_grads)\b", jaxpr)
        counts[remat] = {n: names.count(n) for n in set(names)}
    assert counts["dots_no_batch"] == {"gla_states_fwd": 2, "gla_output": 2, "gla_states_bwd": 1, "gla_grads": 1}
    for remat in ("dots_gla", "dots_acts"):
        assert counts[remat] == {"gla_states_fwd": 1, "gla_output": 1, "gla_states_bwd": 1, "gla_grads": 1}


@functools.lru_cache(maxsize=None)
def _grad_fn(cfg):
    return jax.jit(jax.grad(lambda p, t: forward(p, t, cfg).mean()))


def _grad_qkvg(params, tokens, cfg):
    return _grad_fn(cfg)(params, tokens)["layers"]["w_qkvg"]


def test_bf16_compute_close_to_float32(params, tokens):
    ref = _forward(params, tokens, CFG)
    out = _forward(params, tokens, CFG.with_execution(compute_dtype="bfloat16"))
    assert rel(out, ref) < 5e-2


def test_bf16_dense_output_close_to_float32_output(params, tokens):
    """dense_output=compute writes the hidden projections in bf16 (as autocast does): values and
    gradients stay within bf16 rounding of the float32-output form."""
    bf = CFG.with_execution(compute_dtype="bfloat16")
    ref_cfg = bf.with_execution(dense_output="float32")
    assert rel(_forward(params, tokens, bf), _forward(params, tokens, ref_cfg)) < 2e-2
    assert rel(_grad_qkvg(params, tokens, bf), _grad_qkvg(params, tokens, ref_cfg)) < 5e-2


@pytest.mark.parametrize("scan_layers", [True, False])
def test_decode_state_in_place_equals_scanned_state(params, tokens, scan_layers):
    """The in-place state update (layer scan or Python loop) = the xs/ys form. With the same layer
    loop both run the same float operations on the same values (only how each layer's state slice
    is read and written back differs: slicing, no arithmetic), so they agree bit for bit. The
    Python loop (eager, op by op) against the scan (one compiled program) orders its float32 sums
    differently: equal within float32 rounding."""
    cfg = CFG.with_execution(scan_layers=scan_layers)
    _, state = _prefill(params, tokens[:, :9], CFG)
    a = decode_step(params, tokens[:, 9], state, cfg)
    b = decode_step(params, tokens[:, 9], state, cfg, state_in_place=False)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    if scan_layers:
        return
    (a_logits, a_state), (c_logits, c_state) = a, decode_step(params, tokens[:, 9], state, CFG,
                                                               state_in_place=False)
    np.testing.assert_allclose(np.asarray(a_logits), np.asarray(c_logits), rtol=0, atol=logit_atol(params))
    D = CFG.arch.d_model
    # A state entry (a conv window's layer-norm output; a GLA state's k v^T products) comes from
    # D-long sums whose terms are of its own scale; their signs cancel as a random walk's do, so
    # sum |terms| is about sqrt(D) times the entry.
    for x, y in zip(jax.tree.leaves(a_state), jax.tree.leaves(c_state)):
        scale = D ** 0.5 * float(jnp.max(jnp.abs(y)))
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=2 * f32_sum_err(D, scale))


def test_training_forward_rejects_unchunkable_length(params, tokens):
    with pytest.raises(ValueError, match="num_chunks"):
        forward(params, tokens[:, :30], CFG)
