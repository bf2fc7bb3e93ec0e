"""The Laplace decoder: a Flax module that owns the parameters, pure functions for the math.

Parameter tree and state layout: docs/PARAMS.md. Three entry points share the parameters:

- `forward(params, tokens)`              → logits [B, S, vocab]          (training; chunked GLA)
- `prefill(params, tokens)`              → (logits [B, S, vocab], state)  (any prompt length)
- `decode_step(params, token, state)`    → (logits [B, vocab], state)     (O(1) in context length)

The state is a fixed-size float32 pytree: {"conv": [L, B, C, D], "gla": [L, B, H, K, V]}.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from laplace_jax.config import ModelConfig, gla_decay_log
from laplace_jax.ops.gla import chunk_simple_gla, simple_gla_step
from laplace_jax.ops.glu import swiglu
from laplace_jax.ops.matmul import mixed_matmul
from laplace_jax.ops.mix import gated_mix
from laplace_jax.ops.norm import layer_norm
from laplace_jax.ops.split import split_last

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
_DENSE_OUT = ("dense_out",)
_GLA_SAVED = ("gla_out", "gla_chunk_states")
_GEMM_INPUTS = ("conv_out", "mix_out", "ffn_in", "glu_out")


def _saving(policy, *names: str):
    return jax.checkpoint_policies.save_from_both_policies(
        policy, jax.checkpoint_policies.save_only_these_names(*names))


_REMAT_POLICIES = {
    "full": None,
    "dots": _saving(jax.checkpoint_policies.checkpoint_dots, *_DENSE_OUT),
    "dots_no_batch": _saving(jax.checkpoint_policies.dots_with_no_batch_dims_saveable, *_DENSE_OUT),
    "dots_gla": _saving(jax.checkpoint_policies.dots_with_no_batch_dims_saveable, *_DENSE_OUT, *_GLA_SAVED),
    "dots_acts": _saving(jax.checkpoint_policies.dots_with_no_batch_dims_saveable, *_DENSE_OUT, *_GLA_SAVED,
                         *_GEMM_INPUTS),
}


# ----------------------------------------------------------------------------- parameters

def _normal(std: float):
    return nn.initializers.normal(stddev=std)


def _uniform(bound: float):
    def init(key, shape, dtype=F32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)
    return init


def _layer_param_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Per-layer parameter shapes (without the leading L axis) and initialisers."""
    D, H, K, V, F, C = cfg.d_model, cfg.num_heads, cfg.d_k, cfg.d_v, cfg.ffn_dim, cfg.conv_kernel
    resid_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)  # GPT-2 style: residual writers scaled
    conv_bound = 1.0 / math.sqrt(C)                           # torch Conv1d default for depthwise
    return {
        "attn_norm": ((D,), nn.initializers.ones),
        "conv_w": ((C, D), _uniform(conv_bound)),
        "conv_b": ((D,), _uniform(conv_bound)),
        "w_qkvg": ((D, cfg.qkvg_dim), _normal(cfg.init_std)),
        "aug_balance": ((H, K), nn.initializers.zeros),
        "head_norm": ((cfg.decay_tiers, V), nn.initializers.ones),
        "w_out": ((D, D), _normal(resid_std)),
        "ffn_norm": ((D,), nn.initializers.ones),
        "w_12": ((D, 2 * F), _normal(cfg.init_std)),
        "w_3": ((F, D), _normal(resid_std)),
    }


class LayerStack(nn.Module):
    """Declares every per-layer weight kind as one stacked [L, ...] array."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self) -> Params:
        L = self.cfg.num_layers
        return {name: self.param(name, init, (L, *shape))
                for name, (shape, init) in _layer_param_specs(self.cfg).items()}


class LaplaceLM(nn.Module):
    """Owns the parameters; `__call__`, `prefill` and `decode_step` run the pure functions below."""

    cfg: ModelConfig

    def setup(self) -> None:
        cfg = self.cfg
        self.embed = self.param("embed", _normal(cfg.init_std), (cfg.vocab_size, cfg.d_model))
        self.layers = LayerStack(cfg)
        self.final_norm = self.param("final_norm", nn.initializers.ones, (cfg.d_model,))
        self.lm_head = self.param("lm_head", _normal(cfg.init_std), (cfg.d_model, cfg.vocab_size))

    def _params(self) -> Params:
        return {"embed": self.embed, "layers": self.layers(),
                "final_norm": self.final_norm, "lm_head": self.lm_head}

    def declare(self) -> Params:
        """Touch every parameter (used by `init`; runs no model math)."""
        return self._params()

    def __call__(self, tokens: Array) -> Array:
        return forward(self._params(), tokens, self.cfg)

    def prefill(self, tokens: Array, state: dict[str, Array] | None = None) -> tuple[Array, dict[str, Array]]:
        return prefill(self._params(), tokens, self.cfg, state)

    def decode_step(self, token: Array, state: dict[str, Array]) -> tuple[Array, dict[str, Array]]:
        return decode_step(self._params(), token, state, self.cfg)


def _plain(tree: Any) -> Any:
    return {k: _plain(v) for k, v in tree.items()} if hasattr(tree, "items") else tree


@functools.partial(jax.jit, static_argnums=0)
def init_params(cfg: ModelConfig, rng: Array) -> Params:
    """Random float32 parameters in the docs/PARAMS.md tree (one compiled init)."""
    variables = LaplaceLM(cfg).init(rng, method=LaplaceLM.declare)
    return _plain(variables["params"])


def param_shapes(cfg: ModelConfig) -> Params:
    """The parameter tree as `jax.ShapeDtypeStruct`s (nothing allocated)."""
    return jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))


# ----------------------------------------------------------------------------- the math

def decay_log(cfg: ModelConfig) -> Array:
    """γ_h [H] float32: fixed, not a parameter."""
    return jnp.asarray(np.asarray(gla_decay_log(cfg), np.float32))


def _split_qkvg(cfg: ModelConfig, qkvg: Array) -> tuple[Array, Array, Array, Array]:
    H, K, V = cfg.num_heads, cfg.d_k, cfg.d_v
    q, k, v, g = split_last(qkvg, (H * K, H * K, H * V, H * V))
    lead = qkvg.shape[:-1]
    return (q.reshape(*lead, H, K), k.reshape(*lead, H, K),
            v.reshape(*lead, H, V), g.reshape(*lead, H, V))


def _dense(x: Array, w: Array, cfg: ModelConfig, out_dtype: Any = None) -> Array:
    """x [..., n] @ w [n, m], inputs in the compute dtype, float32 accumulation (backward too);
    output in `out_dtype`, default per `cfg.dense_output` (compute dtype or float32)."""
    cdt = jnp.dtype(cfg.compute_dtype)
    if out_dtype is None:
        out_dtype = cdt if cfg.dense_output == "compute" else F32
    # As one [tokens, n] @ [n, m] product: autodiff's transposes of a product over several leading
    # axes made XLA:CPU copy its operands (the tiny model trained 2x slower); on GPUs XLA flattens
    # the leading axes anyway.
    lead = x.shape[:-1]
    y = mixed_matmul("tn,nm->tm", x.reshape(-1, x.shape[-1]).astype(cdt), w.astype(cdt), jnp.dtype(out_dtype))
    y = y.reshape(*lead, w.shape[-1])
    # A widening matmul is a custom_vjp the dot policies cannot see; a same-dtype one is a plain dot
    # they already keep (naming it too would keep the same value twice).
    return checkpoint_name(y, "dense_out") if jnp.dtype(out_dtype) != cdt else y


def _mix_out(cfg: ModelConfig, lp: Params, q: Array, k: Array, v: Array, g: Array, o: Array) -> Array:
    """Self-augmentation, head RMSNorm per tier, SiLU gate (ops/mix.py), W_out. Shapes [..., H, *]."""
    cdt = jnp.dtype(cfg.compute_dtype)
    o = gated_mix(q, k, v, g, o, lp["aug_balance"], lp["head_norm"], cfg.norm_eps, impl=cfg.mix_impl)
    o = checkpoint_name(o.reshape(*o.shape[:-2], cfg.d_model).astype(cdt), "mix_out")
    return _dense(o, lp["w_out"], cfg).astype(F32)


def _ffn(cfg: ModelConfig, lp: Params, x: Array) -> Array:
    cdt = jnp.dtype(cfg.compute_dtype)
    z = checkpoint_name(layer_norm(x, lp["ffn_norm"], cfg.norm_eps).astype(cdt), "ffn_in")
    h = checkpoint_name(swiglu(_dense(z, lp["w_12"], cfg)).astype(cdt), "glu_out")
    return _dense(h, lp["w_3"], cfg).astype(F32)


def _conv_seq(cfg: ModelConfig, lp: Params, xn: Array, window: Array | None) -> tuple[Array, Array]:
    """Causal depthwise conv over xn [B, S, D] after `window` [B, C, D] (None: zeros)
    → (silu(conv) [B, S, D] f32, the new window = the last C inputs)."""
    C, S = cfg.conv_kernel, xn.shape[1]
    if window is None:
        xp = jnp.pad(xn, ((0, 0), (C - 1, 0), (0, 0)))
    else:
        xp = jnp.concatenate([window[:, 1:].astype(xn.dtype), xn], axis=1)
    u = sum(xp[:, j:j + S] * lp["conv_w"][j] for j in range(C)) + lp["conv_b"]
    return jax.nn.silu(u), xp[:, -C:]


def _layer_seq(cfg: ModelConfig, lp: Params, x: Array, g_gamma: Array, chunking: dict[str, Any],
               st: dict[str, Array] | None) -> tuple[Array, dict[str, Array]]:
    """One layer over a sequence, from `st` (None: zero state). x: [B, S, D] f32 → (x, layer state)."""
    cdt = jnp.dtype(cfg.compute_dtype)
    u, window = _conv_seq(cfg, lp, layer_norm(x, lp["attn_norm"], cfg.norm_eps),
                          None if st is None else st["conv"])
    qkvg = _dense(checkpoint_name(u.astype(cdt), "conv_out"), lp["w_qkvg"], cfg).astype(cdt)
    q, k, v, g = _split_qkvg(cfg, qkvg)
    o, gla_state = chunk_simple_gla(q, k, v, g_gamma, unroll=cfg.gla_unroll, hand_off=cfg.gla_hand_off,
                                    impl=cfg.gla_impl, initial_state=None if st is None else st["gla"],
                                    **chunking)
    x = x + _mix_out(cfg, lp, q, k, v, g, checkpoint_name(o, "gla_out"))
    x = x + _ffn(cfg, lp, x)
    return x, {"conv": window.astype(F32), "gla": gla_state}


def _layer_step(cfg: ModelConfig, lp: Params, x: Array, g_gamma: Array, st: dict[str, Array]
                ) -> tuple[Array, dict[str, Array]]:
    """One layer for one token. x: [B, D] f32; st: {"conv": [B, C, D], "gla": [B, H, K, V]}."""
    cdt = jnp.dtype(cfg.compute_dtype)
    xn = layer_norm(x, lp["attn_norm"], cfg.norm_eps)
    window = jnp.concatenate([st["conv"][:, 1:], xn[:, None].astype(F32)], axis=1)
    u = jax.nn.silu(jnp.einsum("bcd,cd->bd", window, lp["conv_w"]) + lp["conv_b"])
    qkvg = _dense(u, lp["w_qkvg"], cfg).astype(cdt)
    q, k, v, g = _split_qkvg(cfg, qkvg)
    o, gla_state = simple_gla_step(q, k, v, g_gamma, st["gla"])
    x = x + _mix_out(cfg, lp, q, k, v, g, o)
    x = x + _ffn(cfg, lp, x)
    return x, {"conv": window, "gla": gla_state}


def _unstack(tree: Any, n: int) -> list[Any]:
    """A pytree of [n, ...] arrays → n pytrees of [...] arrays."""
    leaves, treedef = jax.tree.flatten(tree)
    parts = [[p[0] for p in jnp.split(a, n, axis=0)] for a in leaves]
    return [jax.tree.unflatten(treedef, [ps[i] for ps in parts]) for i in range(n)]


def _over_layers(cfg: ModelConfig, layer_fn, layers: Params, x: Array, per_layer: Any = None):
    """Apply `layer_fn(lp, x, extra) -> (x, out)` over the stacked layers (scan or a Python loop)."""
    if cfg.remat != "none":
        layer_fn = jax.checkpoint(layer_fn, policy=_REMAT_POLICIES[cfg.remat])
    if cfg.scan_layers:
        def body(x, xs):
            lp, extra = xs
            return layer_fn(lp, x, extra)
        return jax.lax.scan(body, x, (layers, per_layer))
    outs = []
    # One split per stacked leaf, not L indexings: the transpose of a split is one concatenate, while
    # the transpose of `a[i]` is a zero-padded [L, ...] array per layer, and XLA summed the L padded
    # weight gradients elementwise (~40 ms per 3B micro-step at B=16 on an H200).
    lps = _unstack(layers, cfg.num_layers)
    extras = [None] * cfg.num_layers if per_layer is None else _unstack(per_layer, cfg.num_layers)
    for lp, extra in zip(lps, extras):
        x, out = layer_fn(lp, x, extra)
        outs.append(out)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *outs)


def _over_layers_in_place(cfg: ModelConfig, layer_fn, layers: Params, x: Array, state: Any):
    """Like `_over_layers` for decoding, but the whole [L, ...] state rides in the scan carry and
    each layer's slice is read and written back with dynamic (update-)slices. A scan's per-layer
    outputs go to a new [L, ...] buffer, so the xs/ys form holds the state twice and copies it
    every step; a carried buffer is updated in place (with the state argument donated). With
    scan_layers=false the layers are a Python loop over the same static slices and updates."""
    if not cfg.scan_layers:
        for i, lp in enumerate(_unstack(layers, cfg.num_layers)):
            x, state = _layer_in_place(layer_fn, lp, x, state, i)
        return x, state

    def body(carry, xs):
        lp, i = xs
        return _layer_in_place(layer_fn, lp, *carry, i), None

    (x, state), _ = jax.lax.scan(body, (x, state), (layers, jnp.arange(cfg.num_layers)))
    return x, state


def _layer_in_place(layer_fn, lp: Params, x: Array, state: Any, i: Any) -> tuple[Array, Any]:
    """Layer `i` (an int, or a traced index in the scan) on slice i of the [L, ...] state; its new
    state is written back into that slice."""
    st = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), state)
    x, st = layer_fn(lp, x, st)
    return x, jax.tree.map(lambda a, s: jax.lax.dynamic_update_index_in_dim(a, s.astype(a.dtype), i, 0), state, st)


def _embed(params: Params, tokens: Array) -> Array:
    return jnp.take(params["embed"], tokens, axis=0).astype(F32)


def _logits(cfg: ModelConfig, params: Params, x: Array) -> Array:
    cdt = jnp.dtype(cfg.compute_dtype)
    xn = layer_norm(x, params["final_norm"], cfg.norm_eps).astype(cdt)
    return _dense(xn, params["lm_head"], cfg, F32)     # logits stay float32 for the loss / sampling


def _run_seq(params: Params, tokens: Array, cfg: ModelConfig, chunking: dict[str, Any],
             state: dict[str, Array] | None = None):
    g_gamma = decay_log(cfg)
    fn = lambda lp, x, st: _layer_seq(cfg, lp, x, g_gamma, chunking, st)  # noqa: E731
    x, state = _over_layers(cfg, fn, params["layers"], _embed(params, tokens), state)
    return _logits(cfg, params, x), state


def forward(params: Params, tokens: Array, cfg: ModelConfig) -> Array:
    """Training forward. tokens: [B, S] int with S divisible by num_chunks → logits [B, S, vocab] f32."""
    if tokens.shape[1] % cfg.num_chunks:
        raise ValueError(f"forward: sequence length {tokens.shape[1]} is not divisible by "
                         f"num_chunks={cfg.num_chunks}; use prefill() for arbitrary lengths")
    logits, _ = _run_seq(params, tokens, cfg, {"num_chunks": cfg.num_chunks})
    return logits


def prefill(params: Params, tokens: Array, cfg: ModelConfig, state: dict[str, Array] | None = None
            ) -> tuple[Array, dict[str, Array]]:
    """A prompt (or the next piece of one) of any length S, continuing `state` (None: a new
    sequence). tokens: [B, S] → (logits [B, S, vocab], state)."""
    return _run_seq(params, tokens, cfg, {"chunk_size": min(cfg.chunk_size, tokens.shape[1])}, state)


def decode_step(params: Params, token: Array, state: dict[str, Array], cfg: ModelConfig, *,
                state_in_place: bool = True) -> tuple[Array, dict[str, Array]]:
    """One token per sequence. token: [B] int; state from `prefill`/`init_state` → (logits [B, vocab], state).
    `state_in_place=False` scans the state as per-layer inputs/outputs instead (kept for benchmarks)."""
    g_gamma = decay_log(cfg)
    fn = lambda lp, x, st: _layer_step(cfg, lp, x, g_gamma, st)  # noqa: E731
    over = _over_layers_in_place if state_in_place else _over_layers
    x, state = over(cfg, fn, params["layers"], _embed(params, token), state)
    return _logits(cfg, params, x), state


def init_state(cfg: ModelConfig, batch: int) -> dict[str, Array]:
    """A zero decode state for `batch` sequences (float32)."""
    L, C, D, H, K, V = cfg.num_layers, cfg.conv_kernel, cfg.d_model, cfg.num_heads, cfg.d_k, cfg.d_v
    return {"conv": jnp.zeros((L, batch, C, D), F32), "gla": jnp.zeros((L, batch, H, K, V), F32)}


def state_bytes_per_sequence(cfg: ModelConfig) -> int:
    """Bytes of the decode state of one sequence, from the real pytree's shapes."""
    shapes = jax.eval_shape(functools.partial(init_state, cfg, 1))
    return int(sum(np.prod(s.shape) * s.dtype.itemsize for s in jax.tree.leaves(shapes)))
