"""The model side of every task: a checkpoint's parameters on one device and jitted log-probabilities
of token sequences, streamed through `prefill` in fixed pieces with the state carried."""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax.checkpoint import load_params
from laplace_jax.config import Config, Net
from laplace_jax.generate import Generator
from laplace_jax.model import init_state, prefill

Params = dict[str, Any]


@dataclasses.dataclass
class Checkpoint:
    """A run's parameters (numpy float32, docs/PARAMS.md tree), its config and the step."""

    run_dir: Path
    step: int
    cfg: Config
    params: Params


def load_checkpoint(run_dir: str | Path, step: int | None = None) -> Checkpoint:
    """The checkpoint `generate` reads (`CheckpointError`, one line, if there is none)."""
    params, cfg, step = load_params(run_dir, step)
    return Checkpoint(Path(run_dir), step, cfg, params)


@functools.partial(jax.jit, static_argnames="cfg")
def _piece_nll(params: Params, inputs: jax.Array, targets: jax.Array, state: Params, cfg: Net
               ) -> tuple[jax.Array, Params]:
    """One piece [B, P] continuing `state` → (next-token negative log-likelihoods [B, P], state)."""
    logits, state = prefill(params, inputs, cfg, state)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], state


@functools.partial(jax.jit, static_argnames="cfg")
def _continuation_logprob(params: Params, last_logits: jax.Array, state: Params, tokens: jax.Array,
                          mask: jax.Array, cfg: Net) -> jax.Array:
    """log P(tokens[c, :n_c] | prompt) for C continuations of one prompt [C] (tokens/mask [C, T], the
    prompt's state of width 1 and its last-position logits [V])."""
    C = tokens.shape[0]
    logits, _ = prefill(params, tokens, cfg, jax.tree.map(lambda a: jnp.repeat(a, C, axis=1), state))
    # token j is predicted by the prompt's last position (j = 0) or by continuation position j - 1
    pred = jnp.concatenate([jnp.broadcast_to(last_logits, (C, 1, last_logits.shape[-1])), logits[:, :-1]], 1)
    logp = jnp.take_along_axis(jax.nn.log_softmax(pred, axis=-1), tokens[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(mask, logp, 0.0), axis=-1)


@functools.partial(jax.jit, static_argnames=("cfg", "lo", "hi"))
def _range_logits(params: Params, inputs: jax.Array, cfg: Net, lo: int, hi: int) -> jax.Array:
    logits, _ = prefill(params, inputs, cfg)
    return logits[..., lo:hi]


class Scorer:
    """Log-probabilities of one model (parameters placed on the first device; `cfg`: the run's
    `Config.net` with its execution resolved for this backend, `config.resolve_execution`)."""

    def __init__(self, params: Params, cfg: Net):
        self.cfg = cfg
        self.params = jax.device_put(params, jax.devices()[0])
        self._generator = Generator(self.params, cfg, widths=(1,))

    def stream_nll(self, tokens: np.ndarray, piece: int, progress=None) -> np.ndarray:
        """tokens int [B, T+1] → float32 [B, T]: -log P(tokens[:, t+1] | tokens[:, :t+1]), the
        sequences fed through `prefill` in pieces of `piece` tokens, the state carried between them
        (the last piece may be shorter). `progress(n)` is called after each piece."""
        tokens = np.asarray(tokens, np.int32)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        state = init_state(self.cfg.arch, tokens.shape[0])
        out = []
        for a in range(0, inputs.shape[1], piece):
            nll, state = _piece_nll(self.params, inputs[:, a:a + piece], targets[:, a:a + piece], state, cfg=self.cfg)
            out.append(np.asarray(nll))
            if progress:
                progress(1)
        return np.concatenate(out, axis=1)

    def continuation_logprobs(self, prompt: Sequence[int], continuations: Sequence[Sequence[int]]) -> np.ndarray:
        """float64 [C]: log P(continuation | prompt) of each continuation. The prompt is prefilled
        once (`generate`'s fixed pieces), the continuations then run as one batch from its state."""
        last, state = self._generator._prefill_one(list(prompt))
        T = max(len(c) for c in continuations)
        tokens = np.zeros((len(continuations), T), np.int32)
        mask = np.zeros((len(continuations), T), bool)
        for i, c in enumerate(continuations):
            tokens[i, :len(c)], mask[i, :len(c)] = c, True
        return np.asarray(_continuation_logprob(self.params, last, state, tokens, mask, cfg=self.cfg), np.float64)

    def range_logits(self, inputs: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """inputs int [B, S] → float32 [B, S, hi-lo]: the logits of ids lo..hi-1 at every position
        (one prefill from the zero state)."""
        return np.asarray(_range_logits(self.params, np.asarray(inputs, np.int32), cfg=self.cfg, lo=lo, hi=hi))
