"""`python -m laplace_jax.eval`: what a trained checkpoint knows and what its fixed state remembers.

Tasks (one module each; `__main__` is the command line):

- `heldout`: loss, perplexity and bits per byte on the held-out split (the trainer's own eval loss);
- `length`:  documents streamed far past `seq_len` through `prefill` with the state carried: mean
  loss per position bucket;
- `passkey`: a 5-digit key hidden at several depths of filler text, scored by the rank of its
  log-probability among fixed candidate keys;
- `mqar`:    multi-query associative recall accuracy per key-query distance (data/mqar.py).

`scoring` holds the model-side pieces they share (checkpoint loading, streamed log-probabilities),
`ranking` the tie-aware credit of a true answer among candidates, `plots` the PNGs.
"""


class EvalError(ValueError):
    """An evaluation cannot run as asked; the message is one line naming the fix."""
