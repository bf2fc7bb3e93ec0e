"""Multi-query associative recall (MQAR, the Zoology benchmark: Arora et al. 2023) as a grain source.

One example is a sequence of S = seq_len input tokens with its targets, built from N pairs, K key ids
and V value ids of the model's vocabulary (ids: keys 0..K-1, values K..K+V-1, filler K+V..vocab-1)::

    positions 0 .. 2N-1     k_1 v_1 k_2 v_2 ... k_N v_N     N distinct keys, N distinct values
    positions 2N .. S-1     filler ids (uniform), except N query slots: slot j is position 2N + 2j and
                            holds one of the keys (each key is queried once, in random order)

The target at a query position is the key's value; every other target is `IGNORE` (-1): the loss
(`grad_accum.loss_fn`) and the accuracy count answer positions only; every sequence has exactly N
answers, so the trainer's mean of per-micro-batch means is the mean over all answers. Query slots
are drawn without replacement with P(slot j) proportional to (j+1)^(a-1) (`power_a` = a; Zoology's
0.01 favours short gaps, 1 is uniform). A query's distance is its position minus its key's position in the context.

Example i of a split is a pure function of (seed, split, i): `np.random.default_rng([seed, split, i])`,
so the stream needs no state besides grain's position and resumes exactly like the text source.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

IGNORE = -1                                  # target of a position that is not scored
SPLITS = {"train": 0, "val": 1, "eval": 2}   # independent example streams of one seed
NUM_EXAMPLES = 2 ** 40                       # the stream's nominal length (grain needs one); never reached


@dataclass(frozen=True)
class MQARSpec:
    """Shape of the task: S input tokens, N pairs, K keys, V values in a vocab of `vocab_size` ids."""

    seq_len: int
    vocab_size: int
    pairs: int
    keys: int
    values: int
    power_a: float

    @classmethod
    def from_config(cls, cfg) -> "MQARSpec":
        """From a `Config` (its data.mqar_* fields and the model's seq_len/vocab_size)."""
        d, m = cfg.data, cfg.model
        return cls(m.seq_len, m.vocab_size, d.mqar_pairs, d.mqar_keys, d.mqar_values, d.mqar_power_a)

    def with_power(self, power_a: float) -> "MQARSpec":
        return dataclasses.replace(self, power_a=float(power_a))

    @property
    def slots(self) -> int:
        """Query slots after the context: positions 2N, 2N+2, ... below S."""
        return (self.seq_len - 2 * self.pairs + 1) // 2

    def slot_probs(self) -> np.ndarray:
        """float64 [slots]: P(slot j) before drawing without replacement."""
        p = np.arange(1, self.slots + 1, dtype=np.float64) ** (self.power_a - 1.0)
        return p / p.sum()


def make_example(spec: MQARSpec, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One sequence: {"inputs": int32 [S], "targets": int32 [S]} (see the module doc)."""
    S, N, K, V = spec.seq_len, spec.pairs, spec.keys, spec.values
    keys = rng.choice(K, N, replace=False)
    values = K + rng.choice(V, N, replace=False)
    inputs = rng.integers(K + V, spec.vocab_size, size=S)
    inputs[0:2 * N:2], inputs[1:2 * N:2] = keys, values
    slots = rng.choice(spec.slots, N, replace=False, p=spec.slot_probs())
    order = rng.permutation(N)                       # which pair each query slot asks for
    positions = 2 * N + 2 * slots
    inputs[positions] = keys[order]
    targets = np.full(S, IGNORE, dtype=np.int32)
    targets[positions] = values[order]
    return {"inputs": inputs.astype(np.int32), "targets": targets}


def query_distances(inputs: np.ndarray, targets: np.ndarray, pairs: int) -> np.ndarray:
    """int [S]: for each scored position (targets >= 0) its distance to its key's position in the
    context (the first 2N tokens), 0 elsewhere. inputs/targets: one example's [S] arrays."""
    key_pos = {int(k): 2 * i for i, k in enumerate(inputs[0:2 * pairs:2])}
    out = np.zeros(inputs.shape[0], dtype=np.int64)
    for q in np.flatnonzero(targets >= 0):
        out[q] = q - key_pos[int(inputs[q])]
    return out


class MQARSource:
    """Random-access grain source: element i = `make_example(spec, default_rng([seed, split, i]))`."""

    def __init__(self, spec: MQARSpec, seed: int, split: str = "train"):
        if split not in SPLITS:
            raise ValueError(f"unknown MQAR split {split!r}: choose one of {tuple(SPLITS)}")
        self.spec, self.seed, self.split = spec, int(seed), split

    def __len__(self) -> int:
        return NUM_EXAMPLES

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        i = int(i)
        if not 0 <= i < NUM_EXAMPLES:
            raise IndexError(f"example {i} out of range [0, {NUM_EXAMPLES})")
        return make_example(self.spec, np.random.default_rng([self.seed, SPLITS[self.split], i]))

    def __repr__(self) -> str:
        return f"MQARSource({self.spec}, seed={self.seed}, split={self.split!r})"
