"""passkey: a random 5-digit key hidden at a depth of filler text, then the question.

A case of `length` tokens is filler (held-out text, `<|endoftext|>` removed) with the needle inserted
after round(depth x filler) tokens, then the question::

    <filler> The pass key is 12345. Remember it. 12345 is the pass key. <filler> What is the pass key? The pass key is

Every case draws its key from one fixed set of candidate keys, and the score is the rank of the true
key's log-probability (" 12345" as the continuation) among all candidates' (`ranking`): top-1 credit
(chance 1/candidates) and a rank score (chance 0.5), so a weak model gets a graded answer.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from laplace_jax.eval import EvalError
from laplace_jax.eval.ranking import rank_score, top1_credit

NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"

# (prompt ids, [candidate continuation ids]) -> log-probabilities [C]
LogprobFn = Callable[[Sequence[int], Sequence[Sequence[int]]], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Case:
    length: int
    depth: float
    prompt: tuple[int, ...]
    key_index: int          # the true key's index in the candidate list


def candidate_keys(count: int, seed: int) -> list[str]:
    """`count` distinct 5-digit keys (10000..99999), fixed by the seed."""
    rng = np.random.default_rng([seed, 0x9A55])
    return [str(k) for k in 10000 + rng.choice(90000, count, replace=False)]


def make_cases(filler: np.ndarray, tokenizer, keys: Sequence[str], *, lengths: Sequence[int],
               depths: Sequence[float], trials: int, seed: int) -> list[Case]:
    """`trials` cases per (length, depth), deterministic from the seed. filler: int [N] held-out
    tokens without separators (each case takes a random stretch of it)."""
    rng = np.random.default_rng([seed, 0xF111])
    question = tokenizer.encode(QUESTION)
    cases = []
    for length in lengths:
        for depth in depths:
            for _ in range(trials):
                k = int(rng.integers(len(keys)))
                needle = tokenizer.encode(NEEDLE.format(key=keys[k]))
                n = length - len(needle) - len(question)
                if n < 1 or n > len(filler):
                    raise EvalError(f"passkey length {length}: needs {len(needle) + len(question) + 1} to "
                                    f"{len(needle) + len(question) + len(filler)} tokens (the held-out filler "
                                    f"has {len(filler)}): choose other --passkey-lengths")
                start = int(rng.integers(0, len(filler) - n + 1))
                fill = [int(t) for t in filler[start:start + n]]
                at = int(round(depth * n))
                cases.append(Case(length, float(depth), tuple(fill[:at] + needle + fill[at:] + question), k))
    return cases


def score(cases: Sequence[Case], keys: Sequence[str], tokenizer, logprobs: LogprobFn, progress=None) -> dict:
    """Run `logprobs` on every case; mean top-1 credit and rank score per (length, depth)."""
    continuations = [tokenizer.encode(" " + k) for k in keys]
    cells: dict[tuple[int, float], list[tuple[float, float]]] = {}
    for case in cases:
        s = np.asarray(logprobs(case.prompt, continuations), np.float64)
        cells.setdefault((case.length, case.depth), []).append(
            (float(top1_credit(s, np.asarray(case.key_index))), float(rank_score(s, np.asarray(case.key_index)))))
        if progress:
            progress(1)
    rows = [{"length": L, "depth": d, "cases": len(v), "accuracy": float(np.mean([a for a, _ in v])),
             "rank_score": float(np.mean([r for _, r in v]))} for (L, d), v in cells.items()]
    return {"candidates": len(keys), "chance_accuracy": 1.0 / len(keys), "chance_rank_score": 0.5,
            "accuracy": float(np.mean([r["accuracy"] for r in rows])),
            "rank_score": float(np.mean([r["rank_score"] for r in rows])), "cells": rows}
