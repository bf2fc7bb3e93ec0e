"""held-out: loss, perplexity and bits per byte on the held-out split of a prepared data folder.

The loss is the training loop's own `eval_loss` (`train.heldout_evaluator` over
`pipeline.make_eval_batches`: the split's windows in order, the trainer's eval batch size), so the
same checkpoint and batches give the same number as metrics.jsonl. Bits per byte = total nats / ln 2 /
total UTF-8 bytes of the tokenizer's own decoding of the evaluated target tokens, documents only
(the `<|endoftext|>` separators are scored but decode to no bytes).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import jax
import numpy as np

from laplace_jax.config import MeshConfig
from laplace_jax.data.pipeline import TokenWindows, make_eval_batches
from laplace_jax.sharding import make_mesh, param_shardings
from laplace_jax.train import RunLayout, heldout_evaluator

from laplace_jax.eval.scoring import Checkpoint

MAX_TOKENS = 1 << 20   # the default evaluates the whole split up to this many tokens


def text_bytes(tokenizer, ids: Sequence[int]) -> int:
    """UTF-8 bytes of the tokenizer's decoding of `ids`, without its special tokens."""
    text = tokenizer.hf_tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)
    return len(text.encode("utf-8"))


def run(ckpt: Checkpoint, data_dir: str | Path, tokenizer, num_batches: int = 0) -> dict:
    """Evaluate `num_batches` eval batches (0: the whole split, at most MAX_TOKENS tokens) on one device."""
    cfg = ckpt.cfg
    micro, S = RunLayout.from_config(cfg, 1, 1).micro, cfg.model.seq_len
    windows = TokenWindows(data_dir, "val", seq_len=S, vocab_size=cfg.model.vocab_size).num_windows
    if num_batches <= 0:
        num_batches = max(1, min(windows, MAX_TOKENS // S) // micro)
    batches = make_eval_batches(data_dir, seq_len=S, batch_size=micro, num_batches=num_batches,
                                vocab_size=cfg.model.vocab_size)
    mesh = make_mesh(MeshConfig(data=1, fsdp=1), devices=jax.devices()[:1])
    p_sh = param_shardings(ckpt.params, mesh)
    loss = heldout_evaluator(cfg, mesh, p_sh, batches)(jax.device_put(ckpt.params, p_sh))
    tokens = num_batches * micro * S
    # the eval batches hold the split's windows in order, so their targets are one stretch of text
    nbytes = text_bytes(tokenizer, np.concatenate([b["targets"].reshape(-1) for b in batches]))
    return {"loss": loss, "perplexity": math.exp(loss), "bits_per_byte": loss * tokens / math.log(2) / nbytes,
            "tokens": tokens, "bytes": nbytes, "batches": num_batches, "batch_size": micro, "seq_len": S,
            "split_windows": windows, "trainer_batches": cfg.train.eval_batches, "data": str(data_dir)}
