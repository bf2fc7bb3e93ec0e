"""JAX generation: greedy output equals argmax over the full-sequence forward (recomputed from
scratch each step), batches equal single runs, and compiled shapes stay within the fixed set."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import count_compiles, logit_atol
from laplace_jax.config import Net, load_config
from laplace_jax.generate import Generator, Sampling, pick_width
from laplace_jax.model import forward, init_params

CFG = load_config("laplace_tiny", ["model.vocab_size=512", "model.seq_len=64", "model.num_chunks=4"]).net


@pytest.fixture(scope="module")
def params():
    p = init_params(CFG.arch, jax.random.PRNGKey(0))
    # a sharper distribution than init so greedy choices are well separated
    return jax.tree.map(lambda a: a * 3.0 if a.ndim == 2 else a, p)


def greedy_reference(params, prompt, n):
    """Re-run the whole sequence through `forward` (chunked GLA, no state carried) for each token.
    The generator's logits (prefill's chunks, then the decode recurrence) are these within float32
    rounding, a few logit_atol at most (test_model), so the two argmaxes agree exactly on every
    machine only where the top two logits are further apart: checked, not assumed."""
    ids = list(prompt)
    one_chunk = Net(dataclasses.replace(CFG.arch, num_chunks=1), CFG.ex)   # any length: one chunk
    fwd = jax.jit(lambda p, t: forward(p, t, one_chunk))
    for _ in range(n):
        logits = np.asarray(fwd(params, jnp.asarray([ids]))[0, -1])
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] > 10 * logit_atol(params), (ids, top2)   # 5e-3 vs 7.4e-4 here
        ids.append(int(np.argmax(logits)))
    return ids[len(prompt):]


def test_greedy_equals_full_recompute(params):
    gen = Generator(params, CFG, (1, 2, 4))
    prompts = [[7], list(range(3, 23)), list(range(100, 133))]  # 1 token, < chunk, > chunk (16)
    outs = gen.generate(prompts, 12)
    for p, o in zip(prompts, outs):
        assert o == greedy_reference(params, p, 12)


def test_batch_equals_single_and_shapes_are_fixed(params):
    gen = Generator(params, CFG, (1, 2, 4))
    prompts = [[1, 2, 3], [9] * 17, [5], [4, 4, 8, 15, 16, 23, 42]]
    with count_compiles() as compiled:
        together = gen.generate(prompts, 8)
        alone = [gen.generate([p], 8)[0] for p in prompts]
        gen.generate(prompts[:3], 8)   # width 3 → padded to 4
        gen.generate(prompts[:2], 8)
    assert together == alone
    assert compiled["jit(prefill)"] == 1               # one [1, chunk] piece, whatever the prompt lengths
    assert compiled["jit(_decode_and_sample)"] == 3    # widths 1 (prompt tails), 2 and 4


def test_sampling_is_seeded(params):
    a = Generator(params, CFG, (1, 2), Sampling(temperature=1.0, top_k=20, seed=3)).generate([[1, 2]], 10)
    b = Generator(params, CFG, (1, 2), Sampling(temperature=1.0, top_k=20, seed=3)).generate([[1, 2]], 10)
    c = Generator(params, CFG, (1, 2), Sampling(temperature=1.0, top_k=20, seed=4)).generate([[1, 2]], 10)
    assert a == b and a != c


def test_stop_token_and_errors(params):
    gen = Generator(params, CFG, (1, 2))
    out = gen.generate([[1, 2, 3]], 20)[0]
    cut = gen.generate([[1, 2, 3]], 20, stop_token=out[4])[0]
    assert cut == out[:out.index(out[4]) + 1]
    with pytest.raises(ValueError, match="largest decode width 2"):
        gen.generate([[1]] * 3, 2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gen.generate([[600]], 2)
    assert pick_width(3, (1, 2, 4, 8)) == 4
