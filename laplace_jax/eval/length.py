"""length: is the loss flat past the training length? Documents of `factor` x seq_len tokens are fed
through `prefill` in pieces of seq_len with the state carried (`Scorer.stream_nll`), and the mean
next-token loss is reported per position bucket. A transformer's loss blows up past its trained
positions; a decaying fixed state should stay flat or keep falling.

Documents are the held-out split's longest ones (between `<|endoftext|>`s) when enough of them are
long enough; otherwise (short-document corpora such as the demo's) contiguous stretches of the split,
documents joined by `<|endoftext|>` exactly as the trainer's windows see them. `mode` says which.
"""
from __future__ import annotations

import numpy as np

from laplace_jax.data.pipeline import TokenWindows

from laplace_jax.eval import EvalError

MAX_SCAN = 1 << 24   # tokens of the split searched for long documents


def long_documents(stream: np.ndarray, length: int, count: int, eos: int) -> list[np.ndarray]:
    """Up to `count` documents of `stream` (int [N], split at `eos`) with at least `length` tokens,
    each cut to its first `length`, in stream order."""
    bounds = np.concatenate([[-1], np.flatnonzero(stream == eos), [len(stream)]])
    docs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b - a - 1 >= length:
            docs.append(stream[a + 1:a + 1 + length])
            if len(docs) == count:
                break
    return docs


def sequences(source: TokenWindows, length: int, count: int, eos: int) -> tuple[np.ndarray, str]:
    """int32 [n, length] token sequences from the split, and their mode ("documents" | "stream")."""
    stream = source.read(0, min(source.num_tokens, MAX_SCAN))
    docs = long_documents(stream, length, count, eos)
    if len(docs) == count:
        return np.stack(docs), "documents"
    n = min(count, source.num_tokens // length)
    if n == 0:
        raise EvalError(f"the held-out split of {source.data_dir} has {source.num_tokens} tokens, fewer than one "
                        f"{length}-token sequence: lower --length-factor or prepare more held-out text")
    return np.stack([source.read(i * length, length) for i in range(n)]), "stream"


def summarize(nll: np.ndarray, seq_len: int, bucket: int) -> dict:
    """nll [B, T] → mean loss per bucket of `bucket` positions, and before / past seq_len."""
    T = nll.shape[1]
    starts = list(range(0, T, bucket))
    return {"bucket": bucket, "bucket_start": starts,
            "mean_nll": [float(nll[:, a:a + bucket].mean()) for a in starts],
            "within_seq_len": float(nll[:, :seq_len].mean()),
            "past_seq_len": float(nll[:, seq_len:].mean()) if T > seq_len else None}


def run(scorer, source: TokenWindows, *, seq_len: int, factor: int, count: int, eos: int, bucket: int = 0,
        progress=None) -> dict:
    """Stream `count` sequences of factor x seq_len (+1) tokens in pieces of seq_len; see the module doc."""
    tokens, mode = sequences(source, factor * seq_len + 1, count, eos)
    nll = scorer.stream_nll(tokens, piece=seq_len, progress=progress)
    out = {"mode": mode, "sequences": int(tokens.shape[0]), "length": factor * seq_len, "seq_len": seq_len,
           "piece": seq_len}
    out.update(summarize(nll, seq_len, bucket or max(1, seq_len // 4)))
    return out
