"""Credit for the true answer among scored candidates, with ties shared (so a constant scorer gets
chance exactly, not 0 or 1 by the accident of argmax's tie-breaking)."""
from __future__ import annotations

import numpy as np


def top1_credit(scores: np.ndarray, true: np.ndarray) -> np.ndarray:
    """scores [..., C] (higher = more likely), true int [...] → [...]: 1/(candidates tied at the
    maximum) if the true one is among them, else 0. A constant scorer gets 1/C."""
    scores = np.asarray(scores, np.float64)
    mine = np.take_along_axis(scores, np.asarray(true)[..., None], axis=-1)[..., 0]
    top = scores.max(axis=-1)
    tied = (scores == top[..., None]).sum(axis=-1)
    return np.where(mine == top, 1.0 / tied, 0.0)


def rank_score(scores: np.ndarray, true: np.ndarray) -> np.ndarray:
    """scores [..., C], true int [...] → [...] in [0, 1]: 1 - (candidates above + half the others
    tied with it) / (C - 1). 1: ranked first, 0: last, 0.5: a constant scorer's (and a random one's
    mean), so a weak model gets a graded answer."""
    scores = np.asarray(scores, np.float64)
    C = scores.shape[-1]
    mine = np.take_along_axis(scores, np.asarray(true)[..., None], axis=-1)
    above = (scores > mine).sum(axis=-1)
    ties = (scores == mine).sum(axis=-1) - 1
    return 1.0 - (above + 0.5 * ties) / max(C - 1, 1)
