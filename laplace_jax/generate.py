"""`python -m laplace_jax.generate --checkpoint RUN_DIR [--step N] --prompt TEXT [--prompt ...]`

JAX text generation with constant memory: each prompt is prefilled in fixed pieces of
`chunk_size` tokens (its remainder one token at a time), then the batch decodes one token per
sequence per step from a fixed-size float32 state. Every compiled shape comes from a fixed set —
one prefill piece [1, chunk_size] and one decode step per width in `decode_widths` (a batch is
padded to the next width) — so new prompt lengths or batch sizes never trigger a compilation.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax.config import Net
from laplace_jax.model import decode_step, init_state, prefill

Params = dict[str, Any]


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0   # 0: greedy
    top_k: int = 0             # 0: no top-k cut
    seed: int = 0


def pick_width(n: int, widths: Sequence[int]) -> int:
    """The smallest configured decode width that holds `n` sequences."""
    for w in widths:
        if w >= n:
            return w
    raise ValueError(f"{n} sequences exceed the largest decode width {widths[-1]}: "
                     f"add a larger width to decode_widths or send fewer prompts at once")


def _sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """logits [B, V] f32 → token ids [B] int32. Branch-free (no lax.cond)."""
    if sampling.temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if sampling.top_k > 0:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


class Generator:
    """Batched generation with a fixed set of compiled shapes (see the module doc)."""

    def __init__(self, params: Params, net: Net, widths: Sequence[int], sampling: Sampling = Sampling()):
        self.params, self.net, self.widths, self.sampling = params, net, tuple(widths), sampling
        self.piece = net.arch.chunk_size
        self._prefill_jit = jax.jit(functools.partial(prefill, net=net))
        self._decode_jit = jax.jit(self._decode_and_sample)
        # Every token/state/key argument committed to the parameters' device: a committed and an
        # uncommitted argument of one shape compile twice (≈11 s per compile on Neuron).
        devs = getattr(jax.tree.leaves(params)[0], "devices", lambda: set())()
        put = (lambda t: jax.device_put(t, next(iter(devs)))) if len(devs) == 1 else (lambda t: t)
        self._prefill = lambda p, tokens, state: self._prefill_jit(p, put(tokens), state=put(state))
        self._decode = lambda p, *args: self._decode_jit(p, *put(args))

    def _decode_and_sample(self, params, token, state, key):
        logits, state = decode_step(params, token, state, self.net)
        return logits, _sample(logits, key, self.sampling), state

    def _prefill_one(self, ids: Sequence[int]) -> tuple[jax.Array, Params]:
        """One prompt → (last-position logits [V], state of width 1)."""
        state = init_state(self.net.arch, 1)
        full = len(ids) // self.piece * self.piece
        logits = None
        for a in range(0, full, self.piece):
            out, state = self._prefill(self.params, jnp.asarray([ids[a:a + self.piece]], jnp.int32), state=state)
            logits = out[0, -1]
        key = jax.random.PRNGKey(0)
        for t in ids[full:]:  # the remainder, one token at a time through the width-1 decode step
            out, _, state = self._decode(self.params, jnp.asarray([t], jnp.int32), state, key)
            logits = out[0]
        return logits, state

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 stop_token: int | None = None) -> list[list[int]]:
        """Token ids of each prompt's continuation (up to max_new_tokens, cut after stop_token)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        bad = [t for p in prompts for t in p if not 0 <= t < self.net.arch.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.net.arch.vocab_size})")
        W = pick_width(len(prompts), self.widths)
        firsts, states = [], []
        for p in prompts:
            logits, st = self._prefill_one(list(p))
            firsts.append(logits)
            states.append(st)
        pad = W - len(prompts)
        state = jax.tree.map(lambda *xs: jnp.concatenate(xs + (jnp.zeros_like(xs[0]),) * pad, axis=1), *states)
        key = jax.random.PRNGKey(self.sampling.seed)
        key, sub = jax.random.split(key)
        logits = jnp.stack(firsts + [jnp.zeros_like(firsts[0])] * pad)
        token = _sample(logits, sub, self.sampling)
        out = [[] for _ in prompts]
        done = np.zeros(len(prompts), bool)
        for i in range(max_new_tokens):
            tok = np.asarray(token)[:len(prompts)]
            for r, t in enumerate(tok):
                if not done[r]:
                    out[r].append(int(t))
                    done[r] = stop_token is not None and int(t) == stop_token
            if done.all() or i == max_new_tokens - 1:
                break
            key, sub = jax.random.split(key)
            _, token, state = self._decode(self.params, token, state, sub)
        return out


def _check_args(args, prompts: list[str]) -> str | None:
    """What is wrong with the generation flags, checked before the checkpoint is read, or None."""
    for i, p in enumerate(prompts, 1):
        try:
            p.encode("utf-8")
        except UnicodeEncodeError as e:   # argv bytes that are not UTF-8 arrive as lone surrogates
            return (f"--prompt #{i} is not UTF-8 text (byte 0x{ord(p[e.start]) & 0xFF:02x} at offset "
                    f"{len(p[:e.start].encode('utf-8', 'surrogateescape'))}): pass UTF-8 text")
        if not p:
            return f"--prompt #{i} is empty: give at least one character of text"
    if args.max_new_tokens < 1:
        return f"--max-new-tokens {args.max_new_tokens}: must be at least 1"
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        return f"--temperature {args.temperature}: must be a finite number >= 0 (0 = greedy)"
    if args.top_k < 0:
        return f"--top-k {args.top_k}: must be >= 0 (0 = no cut)"
    return None


def main(argv: list[str] | None = None) -> int:
    from laplace_jax.checkpoint import CheckpointError, load_params
    from laplace_jax.cli import EXIT_USAGE, Parser
    from laplace_jax.data.tokenizer import get_tokenizer

    ap = Parser(prog="python -m laplace_jax.generate", description=__doc__.split("\n\n")[1])
    ap.add_argument("--checkpoint", required=True, help="a training run dir (RUN_DIR)")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    ap.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ignore-eos", action="store_true", help="do not stop at <|endoftext|>")
    ap.add_argument("--ids", action="store_true", help="also print the token ids")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    ap.add_argument("--platform", default=None, choices=["auto", "cpu", "gpu", "neuron"],
                    help="default: JAX's own choice")
    args = ap.parse_args(argv)
    from laplace_jax.config import ConfigError, resolve_execution
    from laplace_jax.platform import select_platform
    problem = _check_args(args, args.prompt)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    tok = get_tokenizer()
    prompts = [tok.encode(p) for p in args.prompt]
    try:
        select_platform(args.platform or "auto")  # before any array exists
        params, cfg, step = load_params(args.checkpoint, args.step)
        if args.platform:
            cfg = dataclasses.replace(cfg, platform=args.platform)
        cfg = dataclasses.replace(cfg, execution=dataclasses.replace(cfg.execution, compute_dtype=args.dtype))
        cfg = resolve_execution(cfg, jax.default_backend())
        if args.top_k > cfg.model.vocab_size:
            raise ConfigError(f"--top-k {args.top_k}: larger than the vocabulary ({cfg.model.vocab_size})")
        pick_width(len(prompts), cfg.decode_widths)
    except (CheckpointError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    gen = Generator(jax.tree.map(jnp.asarray, params), cfg.net, cfg.decode_widths,
                    Sampling(args.temperature, args.top_k, args.seed))
    stop = None if args.ignore_eos else tok.eos_id
    outs = gen.generate(prompts, args.max_new_tokens, stop)
    for text, ids, out in zip(args.prompt, prompts, outs):
        print(f"--- step {step} | prompt: {text!r}")
        # a sequence that stopped ends with the stop token: not text (vLLM and transformers' decode leave it
        # out too); --ids lists it
        print(text + tok.decode(out[:-1] if stop is not None and out and out[-1] == stop else out))
        if args.ids:
            print(f"prompt ids: {ids}\nnew ids: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
