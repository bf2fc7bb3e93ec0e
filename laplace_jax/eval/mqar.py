"""mqar: multi-query associative recall accuracy per key-query distance (data/mqar.py).

Sequences of the task's `eval` stream (independent of the trainer's train/val streams), scored at every
query position by the model's logits over the value ids: top-1 credit (chance 1/values) and rank score
(chance 0.5), per distance bucket [2^i, 2^(i+1)).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from laplace_jax.data.mqar import MQARSource, MQARSpec, query_distances
from laplace_jax.eval.ranking import rank_score, top1_credit

# inputs int [B, S] -> scores of the value ids [B, S, values] (higher = more likely)
ValueScoreFn = Callable[[np.ndarray], np.ndarray]


def run(score_values: ValueScoreFn, spec: MQARSpec, *, sequences: int, seed: int, batch: int = 32,
        progress=None) -> dict:
    """Accuracy of `score_values` on `sequences` examples, per distance bucket and overall."""
    source = MQARSource(spec, seed, "eval")
    dist, credit, rank = [], [], []
    for a in range(0, sequences, batch):
        ex = [source[i] for i in range(a, min(a + batch, sequences))]
        scores = score_values(np.stack([e["inputs"] for e in ex]))
        for b, e in enumerate(ex):
            q = np.flatnonzero(e["targets"] >= 0)
            true = e["targets"][q] - spec.keys
            dist.append(query_distances(e["inputs"], e["targets"], spec.pairs)[q])
            credit.append(top1_credit(scores[b, q], true))
            rank.append(rank_score(scores[b, q], true))
        if progress:
            progress(len(ex))
    dist, credit, rank = np.concatenate(dist), np.concatenate(credit), np.concatenate(rank)
    level = np.floor(np.log2(dist)).astype(int)
    buckets = [{"lo": 2 ** i, "hi": 2 ** (i + 1), "queries": int((level == i).sum()),
                "accuracy": float(credit[level == i].mean()), "rank_score": float(rank[level == i].mean())}
               for i in range(int(level.max()) + 1) if (level == i).any()]
    return {"spec": dataclasses.asdict(spec), "sequences": sequences, "queries": int(len(dist)),
            "chance_accuracy": 1.0 / spec.values, "accuracy": float(credit.mean()), "rank_score": float(rank.mean()),
            "buckets": buckets}
