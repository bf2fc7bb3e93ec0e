"""The Laplace decoder: a Flax module that owns the parameters, pure functions for the math.

Parameter tree and state layout: `laplace_jax/spec.py` (docs/PARAMS.md is generated from it). The
math takes a `Net` (the architecture and its execution choices); three entry points share the parameters:

- `forward(params, tokens, net)`             → logits [B, S, vocab]          (training; chunked GLA)
- `prefill(params, tokens, net)`             → (logits [B, S, vocab], state)  (any prompt length)
- `decode_step(params, token, state, net)`   → (logits [B, vocab], state)     (O(1) in context length)

The state is a fixed-size float32 pytree: {"conv": [L, B, C, D], "gla": [L, B, H, K, V]}.
"""
from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from laplace_jax import spec
from laplace_jax.choices import Remat
from laplace_jax.config import Net
from laplace_jax.ops.gla import chunk_simple_gla, simple_gla_step
from laplace_jax.ops.glu import swiglu
from laplace_jax.ops.matmul import mixed_matmul
from laplace_jax.ops.mix import gated_mix
from laplace_jax.ops.norm import layer_norm
from laplace_jax.ops.split import split_last
from laplace_jax.spec import Arch

Array = jax.Array
Params = dict[str, Any]
F32 = jnp.float32

# What the remat policies keep besides dot outputs, by `checkpoint_name`:
# - a widening (float32-output) dense projection's output: it is a custom_vjp, which the dot
#   policies cannot see (they would re-run that GEMM in the backward);
# - the GLA's output and its chunk states (named in ops/gla_pallas.py): the backward then re-runs
#   neither Pallas forward kernel (~10 KB per token and layer in bf16);
# - the bf16 inputs of the next GEMMs (conv output, gated mix, FFN norm, GLU): the backward then
#   recomputes no standalone forward work, for ~40 KB more per token and layer.
# the chunked GLA's name scope: its ops' HLO metadata says GLA (benchmarks/step_kinds.py; its chunk
# matmuls are dots like the dense layers')
GLA_SCOPE = "chunked_gla"
_DENSE_OUT = ("dense_out",)
_GLA_SAVED = ("gla_out", "gla_chunk_states")
_GEMM_INPUTS = ("conv_out", "mix_out", "ffn_in", "glu_out")


def _saving(policy, *names: str):
    return jax.checkpoint_policies.save_from_both_policies(
        policy, jax.checkpoint_policies.save_only_these_names(*names))


_REMAT_POLICIES: dict[Remat, object] = {   # every choice of choices.Remat but "none" (tests/test_config.py)
    "full": None,
    "dots": _saving(jax.checkpoint_policies.checkpoint_dots, *_DENSE_OUT),
    "dots_no_batch": _saving(jax.checkpoint_policies.dots_with_no_batch_dims_saveable, *_DENSE_OUT),
    "dots_gla": _saving(jax.checkpoint_policies.dots_with_no_batch_dims_saveable, *_DENSE_OUT, *_GLA_SAVED),
    "dots_acts": _saving(jax.checkpoint_policies.dots_with_no_batch_dims_saveable, *_DENSE_OUT, *_GLA_SAVED,
                         *_GEMM_INPUTS),
}


# ----------------------------------------------------------------------------- parameters

def _initializer(p: spec.Param, arch: Arch):
    """The Flax initializer of one table row (`spec.Param.init`)."""
    scale = spec.init_std(p, arch)
    if p.init in ("normal", "normal_resid"):
        return nn.initializers.normal(stddev=scale)
    if p.init == "conv_uniform":
        return lambda key, shape, dtype=F32: jax.random.uniform(key, shape, dtype, -scale, scale)
    return {"ones": nn.initializers.ones, "zeros": nn.initializers.zeros}[p.init]


def _declare(module: nn.Module, params: tuple[spec.Param, ...], arch: Arch) -> Params:
    return {p.name: module.param(p.name, _initializer(p, arch), p.shape(arch)) for p in params}


class LayerStack(nn.Module):
    """Declares every per-layer weight kind of `spec.PARAMS` as one stacked [L, ...] array."""

    arch: Arch

    @nn.compact
    def __call__(self) -> Params:
        return _declare(self, spec.layer_params(), self.arch)


class LaplaceLM(nn.Module):
    """Owns the parameters; `__call__`, `prefill` and `decode_step` run the pure functions below."""

    net: Net

    def setup(self) -> None:
        self.weights = _declare(self, spec.global_params(), self.net.arch)
        self.layers = LayerStack(self.net.arch)

    def _params(self) -> Params:
        return {**self.weights, "layers": self.layers()}

    def declare(self) -> Params:
        """Touch every parameter (used by `init`; runs no model math)."""
        return self._params()

    def __call__(self, tokens: Array) -> Array:
        return forward(self._params(), tokens, self.net)

    def prefill(self, tokens: Array, state: dict[str, Array] | None = None) -> tuple[Array, dict[str, Array]]:
        return prefill(self._params(), tokens, self.net, state)

    def decode_step(self, token: Array, state: dict[str, Array]) -> tuple[Array, dict[str, Array]]:
        return decode_step(self._params(), token, state, self.net)


def _plain(tree: Any) -> Any:
    return {k: _plain(v) for k, v in tree.items()} if hasattr(tree, "items") else tree


@functools.partial(jax.jit, static_argnums=0)
def init_params(arch: Arch, rng: Array) -> Params:
    """Random float32 parameters in the `spec.PARAMS` tree (one compiled init)."""
    variables = LaplaceLM(Net(arch)).init(rng, method=LaplaceLM.declare)
    return _plain(variables["params"])


def param_shapes(arch: Arch) -> Params:
    """The parameter tree as float32 `jax.ShapeDtypeStruct`s, from the spec (nothing allocated)."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, F32), spec.param_shapes(arch),
                        is_leaf=lambda x: isinstance(x, tuple))


# ----------------------------------------------------------------------------- the math

def decay_log(arch: Arch) -> Array:
    """γ_h [H] float32 (`Arch.decay_log`): fixed, not a parameter."""
    return jnp.asarray(np.asarray(arch.decay_log(), np.float32))


def _split_qkvg(net: Net, qkvg: Array) -> tuple[Array, Array, Array, Array]:
    H, K, V = net.arch.num_heads, net.arch.d_k, net.arch.d_v
    q, k, v, g = split_last(qkvg, (H * K, H * K, H * V, H * V))
    lead = qkvg.shape[:-1]
    return (q.reshape(*lead, H, K), k.reshape(*lead, H, K),
            v.reshape(*lead, H, V), g.reshape(*lead, H, V))


def _dense(x: Array, w: Array, net: Net, out_dtype: Any = None) -> Array:
    """x [..., n] @ w [n, m], inputs in the compute dtype, float32 accumulation (backward too);
    output in `out_dtype`, default per `net.ex.dense_output` (compute dtype or float32)."""
    cdt = jnp.dtype(net.ex.compute_dtype)
    if out_dtype is None:
        out_dtype = cdt if net.ex.dense_output == "compute" else F32
    # As one [tokens, n] @ [n, m] product: autodiff's transposes of a product over several leading
    # axes made XLA:CPU copy its operands (the tiny model trained 2x slower); on GPUs XLA flattens
    # the leading axes anyway.
    lead = x.shape[:-1]
    y = mixed_matmul("tn,nm->tm", x.reshape(-1, x.shape[-1]).astype(cdt), w.astype(cdt), jnp.dtype(out_dtype))
    y = y.reshape(*lead, w.shape[-1])
    # A widening matmul is a custom_vjp the dot policies cannot see; a same-dtype one is a plain dot
    # they already keep (naming it too would keep the same value twice).
    return checkpoint_name(y, "dense_out") if jnp.dtype(out_dtype) != cdt else y


def _mix_out(net: Net, lp: Params, q: Array, k: Array, v: Array, g: Array, o: Array) -> Array:
    """Self-augmentation, head RMSNorm per tier, SiLU gate (ops/mix.py), W_out. Shapes [..., H, *]."""
    cdt = jnp.dtype(net.ex.compute_dtype)
    o = gated_mix(q, k, v, g, o, lp["aug_balance"], lp["head_norm"], net.arch.norm_eps, impl=net.ex.mix_impl)
    o = checkpoint_name(o.reshape(*o.shape[:-2], net.arch.d_model).astype(cdt), "mix_out")
    return _dense(o, lp["w_out"], net).astype(F32)


def _ffn(net: Net, lp: Params, x: Array) -> Array:
    cdt = jnp.dtype(net.ex.compute_dtype)
    z = checkpoint_name(layer_norm(x, lp["ffn_norm"], net.arch.norm_eps).astype(cdt), "ffn_in")
    h = checkpoint_name(swiglu(_dense(z, lp["w_12"], net)).astype(cdt), "glu_out")
    return _dense(h, lp["w_3"], net).astype(F32)


def _conv_seq(net: Net, lp: Params, xn: Array, window: Array | None) -> tuple[Array, Array]:
    """Causal depthwise conv over xn [B, S, D] after `window` [B, C, D] (None: zeros)
    → (silu(conv) [B, S, D] f32, the new window = the last C inputs)."""
    C, S = net.arch.conv_kernel, xn.shape[1]
    if window is None:
        xp = jnp.pad(xn, ((0, 0), (C - 1, 0), (0, 0)))
    else:
        xp = jnp.concatenate([window[:, 1:].astype(xn.dtype), xn], axis=1)
    u = sum(xp[:, j:j + S] * lp["conv_w"][j] for j in range(C)) + lp["conv_b"]
    return jax.nn.silu(u), xp[:, -C:]


def _layer_seq(net: Net, lp: Params, x: Array, g_gamma: Array, chunking: dict[str, Any],
               st: dict[str, Array] | None) -> tuple[Array, dict[str, Array]]:
    """One layer over a sequence, from `st` (None: zero state). x: [B, S, D] f32 → (x, layer state)."""
    cdt = jnp.dtype(net.ex.compute_dtype)
    u, window = _conv_seq(net, lp, layer_norm(x, lp["attn_norm"], net.arch.norm_eps),
                          None if st is None else st["conv"])
    qkvg = _dense(checkpoint_name(u.astype(cdt), "conv_out"), lp["w_qkvg"], net).astype(cdt)
    q, k, v, g = _split_qkvg(net, qkvg)
    with jax.named_scope(GLA_SCOPE):
        o, gla_state = chunk_simple_gla(q, k, v, g_gamma, unroll=net.ex.gla_unroll, hand_off=net.ex.gla_hand_off,
                                        impl=net.ex.gla_impl, initial_state=None if st is None else st["gla"],
                                        **chunking)
    x = x + _mix_out(net, lp, q, k, v, g, checkpoint_name(o, "gla_out"))
    x = x + _ffn(net, lp, x)
    return x, {"conv": window.astype(F32), "gla": gla_state}


def _layer_step(net: Net, lp: Params, x: Array, g_gamma: Array, st: dict[str, Array]
                ) -> tuple[Array, dict[str, Array]]:
    """One layer for one token. x: [B, D] f32; st: {"conv": [B, C, D], "gla": [B, H, K, V]}."""
    cdt = jnp.dtype(net.ex.compute_dtype)
    xn = layer_norm(x, lp["attn_norm"], net.arch.norm_eps)
    window = jnp.concatenate([st["conv"][:, 1:], xn[:, None].astype(F32)], axis=1)
    u = jax.nn.silu(jnp.einsum("bcd,cd->bd", window, lp["conv_w"]) + lp["conv_b"])
    qkvg = _dense(u, lp["w_qkvg"], net).astype(cdt)
    q, k, v, g = _split_qkvg(net, qkvg)
    o, gla_state = simple_gla_step(q, k, v, g_gamma, st["gla"])
    x = x + _mix_out(net, lp, q, k, v, g, o)
    x = x + _ffn(net, lp, x)
    return x, {"conv": window, "gla": gla_state}


def _unstack(tree: Any, n: int) -> list[Any]:
    """A pytree of [n, ...] arrays → n pytrees of [...] arrays."""
    leaves, treedef = jax.tree.flatten(tree)
    parts = [[p[0] for p in jnp.split(a, n, axis=0)] for a in leaves]
    return [jax.tree.unflatten(treedef, [ps[i] for ps in parts]) for i in range(n)]


def _over_layers(net: Net, layer_fn, layers: Params, x: Array, per_layer: Any = None):
    """Apply `layer_fn(lp, x, extra) -> (x, out)` over the stacked layers (scan or a Python loop)."""
    if net.ex.remat != "none":
        layer_fn = jax.checkpoint(layer_fn, policy=_REMAT_POLICIES[net.ex.remat])
    if net.ex.scan_layers:
        def body(x, xs):
            lp, extra = xs
            return layer_fn(lp, x, extra)
        return jax.lax.scan(body, x, (layers, per_layer))
    outs = []
    # One split per stacked leaf, not L indexings: the transpose of a split is one concatenate, while
    # the transpose of `a[i]` is a zero-padded [L, ...] array per layer, and XLA summed the L padded
    # weight gradients elementwise (~40 ms per 3B micro-step at B=16 on an H200).
    lps = _unstack(layers, net.arch.num_layers)
    extras = [None] * net.arch.num_layers if per_layer is None else _unstack(per_layer, net.arch.num_layers)
    for lp, extra in zip(lps, extras):
        x, out = layer_fn(lp, x, extra)
        outs.append(out)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *outs)


def _over_layers_in_place(net: Net, layer_fn, layers: Params, x: Array, state: Any):
    """Like `_over_layers` for decoding, but the whole [L, ...] state rides in the scan carry and
    each layer's slice is read and written back with dynamic (update-)slices. A scan's per-layer
    outputs go to a new [L, ...] buffer, so the xs/ys form holds the state twice and copies it
    every step; a carried buffer is updated in place (with the state argument donated). With
    scan_layers=false the layers are a Python loop over the same static slices and updates."""
    if not net.ex.scan_layers:
        for i, lp in enumerate(_unstack(layers, net.arch.num_layers)):
            x, state = _layer_in_place(layer_fn, lp, x, state, i)
        return x, state

    def body(carry, xs):
        lp, i = xs
        return _layer_in_place(layer_fn, lp, *carry, i), None

    (x, state), _ = jax.lax.scan(body, (x, state), (layers, jnp.arange(net.arch.num_layers)))
    return x, state


def _layer_in_place(layer_fn, lp: Params, x: Array, state: Any, i: Any) -> tuple[Array, Any]:
    """Layer `i` (an int, or a traced index in the scan) on slice i of the [L, ...] state; its new
    state is written back into that slice."""
    st = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), state)
    x, st = layer_fn(lp, x, st)
    return x, jax.tree.map(lambda a, s: jax.lax.dynamic_update_index_in_dim(a, s.astype(a.dtype), i, 0), state, st)


def _embed(params: Params, tokens: Array) -> Array:
    return jnp.take(params["embed"], tokens, axis=0).astype(F32)


def _logits(net: Net, params: Params, x: Array) -> Array:
    cdt = jnp.dtype(net.ex.compute_dtype)
    xn = layer_norm(x, params["final_norm"], net.arch.norm_eps).astype(cdt)
    return _dense(xn, params["lm_head"], net, F32)     # logits stay float32 for the loss / sampling


def _run_seq(params: Params, tokens: Array, net: Net, chunking: dict[str, Any],
             state: dict[str, Array] | None = None):
    g_gamma = decay_log(net.arch)
    fn = lambda lp, x, st: _layer_seq(net, lp, x, g_gamma, chunking, st)  # noqa: E731
    x, state = _over_layers(net, fn, params["layers"], _embed(params, tokens), state)
    return _logits(net, params, x), state


def forward(params: Params, tokens: Array, net: Net) -> Array:
    """Training forward. tokens: [B, S] int with S divisible by num_chunks → logits [B, S, vocab] f32."""
    if tokens.shape[1] % net.arch.num_chunks:
        raise ValueError(f"forward: sequence length {tokens.shape[1]} is not divisible by "
                         f"num_chunks={net.arch.num_chunks}; use prefill() for arbitrary lengths")
    logits, _ = _run_seq(params, tokens, net, {"num_chunks": net.arch.num_chunks})
    return logits


def prefill(params: Params, tokens: Array, net: Net, state: dict[str, Array] | None = None
            ) -> tuple[Array, dict[str, Array]]:
    """A prompt (or the next piece of one) of any length S, continuing `state` (None: a new
    sequence). tokens: [B, S] → (logits [B, S, vocab], state)."""
    return _run_seq(params, tokens, net, {"chunk_size": min(net.arch.chunk_size, tokens.shape[1])}, state)


def decode_step(params: Params, token: Array, state: dict[str, Array], net: Net, *,
                state_in_place: bool = True) -> tuple[Array, dict[str, Array]]:
    """One token per sequence. token: [B] int; state from `prefill`/`init_state` → (logits [B, vocab], state).
    `state_in_place=False` scans the state as per-layer inputs/outputs instead (kept for benchmarks)."""
    g_gamma = decay_log(net.arch)
    fn = lambda lp, x, st: _layer_step(net, lp, x, g_gamma, st)  # noqa: E731
    over = _over_layers_in_place if state_in_place else _over_layers
    x, state = over(net, fn, params["layers"], _embed(params, token), state)
    return _logits(net, params, x), state


def init_state(arch: Arch, batch: int) -> dict[str, Array]:
    """A zero decode state for `batch` sequences: `Arch.state_layout` stacked over layers (float32)."""
    return {name: jnp.zeros((arch.num_layers, batch, *shape), F32) for name, shape in arch.state_layout().items()}


def state_bytes_per_sequence(arch: Arch) -> int:
    """Bytes of the decode state of one sequence, from the real pytree's shapes."""
    shapes = jax.eval_shape(functools.partial(init_state, arch, 1))
    return int(sum(np.prod(s.shape) * s.dtype.itemsize for s in jax.tree.leaves(shapes)))
