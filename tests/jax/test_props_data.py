"""Prepared data folders, generated (issue 35): a manifest with fields missing, mistyped or inconsistent
(split lists, shard sizes, token counts, dtype, vocabulary) and shards that are missing, short, long,
extra, of another dtype or out of the vocabulary. What `train` and `eval` open (`resolve_data_dir`, then
`TokenWindows` for each split, every window read) yields exactly the tokens of the shards the manifest
lists, or raises one `DataError` line naming the folder and the fix; `prepare` run again on the folder
(same inputs) leaves a dataset that loads, or raises one line. In-process: milliseconds an example."""
import json
import shutil

import numpy as np
import pytest
from hypothesis import example, given, strategies as st

from laplace_jax.data import prepare as prep
from laplace_jax.data.corpus import DataError
from laplace_jax.data.pipeline import TokenWindows, resolve_data_dir

SEQ, VOCAB = 8, 50304
TEXT = "\n\n".join(f"Document {i}: the river trade of the city, year {1700 + i}, merchants and ships."
                   for i in range(12))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A tiny dataset in several shards per split (about 200 tokens each split), and its input file."""
    root = tmp_path_factory.mktemp("data")
    src = root / "docs.txt"
    src.write_text(TEXT.replace("\n\n", "\n<|endoftext|>\n"))
    out = root / "clean"
    prep.prepare([src], out, val_fraction=0.5, workers=1, shard_tokens=64, progress=False)
    return src, out


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-3, max_value=2 ** 64), st.floats(),
              st.text(max_size=8), st.sampled_from(["train_00000.bin", "../clean/manifest.json", "uint16", "."])),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=5), inner, max_size=2),
    max_leaves=4)

FIELDS = ["format", "dtype", "byte_order", "max_token_id", "vocab_size", "tokens", "splits", "splits.train",
          "splits.val", "splits.train.tokens", "splits.val.shards", "splits.train.shards",
          "splits.train.shards.0", "splits.train.shards.0.file", "splits.train.shards.0.tokens",
          "splits.val.shards.1.tokens", "splits.val.shards.1.file", "fingerprint", "fingerprint.sources"]
manifest_edits = st.one_of(
    st.tuples(st.just("drop"), st.sampled_from(FIELDS), st.none()),
    st.tuples(st.just("set"), st.sampled_from(FIELDS), json_values),
    st.tuples(st.just("dup"), st.sampled_from(["train", "val"]), st.none()),       # a shard listed twice
    st.tuples(st.just("swap"), st.none(), st.none()),                             # train <-> val lists
    st.tuples(st.just("pop"), st.sampled_from(["train", "val"]), st.booleans()))  # a shard unlisted
shard_edits = st.tuples(
    st.sampled_from(["delete", "truncate", "append", "int32", "extra", "out_of_vocab"]),
    st.sampled_from(["train_00000.bin", "train_00001.bin", "val_00000.bin", "val_00002.bin"]),
    st.integers(min_value=0, max_value=200))


def _node(m, dotted: str):
    """(parent, key) of a dotted manifest field, or None where the path no longer exists."""
    parts = dotted.split(".")
    node = m
    for p in parts[:-1]:
        key = int(p) if isinstance(node, list) and p.isdigit() else p
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return None
    if isinstance(node, list):
        return (node, int(parts[-1])) if parts[-1].isdigit() else None
    return (node, parts[-1]) if isinstance(node, dict) else None


def _edit_manifest(m: dict, edits) -> dict:
    for kind, what, value in edits:
        splits = m.get("splits") if isinstance(m.get("splits"), dict) else {}
        shards = lambda s: splits.get(s, {}).get("shards") if isinstance(splits.get(s), dict) else None
        if kind in ("drop", "set"):
            at = _node(m, what)
            if at is None:
                continue
            node, key = at
            if kind == "set" and (isinstance(node, dict) or key < len(node)):
                node[key] = value
            elif kind == "drop" and (isinstance(node, dict) or key < len(node)):
                node.pop(key) if isinstance(node, list) else node.pop(key, None)
        elif kind == "dup" and isinstance(shards(what), list) and shards(what):
            shards(what).append(dict(shards(what)[0]) if isinstance(shards(what)[0], dict) else shards(what)[0])
        elif kind == "swap" and "train" in splits and "val" in splits:
            splits["train"], splits["val"] = splits["val"], splits["train"]
        elif kind == "pop" and isinstance(shards(what), list) and shards(what):
            shards(what).pop(-1 if value else 0)
    return m


def _edit_shard(d, kind: str, name: str, n: int) -> None:
    f = d / name
    if kind == "extra":
        np.arange(n, dtype="<u2").tofile(d / "train_00099.bin")
    elif not f.exists():
        return
    elif kind == "delete":
        f.unlink()
    elif kind == "truncate":
        with open(f, "r+b") as fh:
            fh.truncate(max(0, min(n, f.stat().st_size - 1)))
    elif kind == "append":
        with open(f, "ab") as fh:
            fh.write(b"\0" * (n + 1))
    elif kind == "int32":
        np.fromfile(f, "<u2").astype("<i4").tofile(f)
    elif kind == "out_of_vocab":
        a = np.fromfile(f, "<u2")
        a[n % len(a)] = 65535
        a.tofile(f)


def _listed_stream(d, split: str) -> np.ndarray:
    m = json.loads((d / prep.MANIFEST).read_text())
    return np.concatenate([np.fromfile(d / s["file"], "<u2") for s in m["splits"][split]["shards"]]).astype(np.int32)


def _loads_exactly_or_one_line(d) -> bool:
    """The property for what train/eval open. True if it loaded (and every window was checked)."""
    try:
        resolve_data_dir(d)
        for split in prep.SPLITS:
            tw = TokenWindows(d, split, seq_len=SEQ, vocab_size=VOCAB)
            stream = _listed_stream(d, split)
            for k in range(len(tw)):
                assert np.array_equal(tw[k], stream[k * SEQ:k * SEQ + SEQ + 1]), (split, k)
        return True
    except DataError as e:
        msg = str(e)
        assert "\n" not in msg and str(d) in msg, msg
        assert "--force" in msg or "model.vocab_size" in msg or "seq_len" in msg, msg
        return False


@given(st.lists(manifest_edits, max_size=3), st.lists(shard_edits, max_size=2))
@example([("drop", "splits.train.tokens", None)], [])            # was a KeyError traceback in prepare's up-to-date line
@example([("set", "splits", [])], [])                            # was a TypeError
@example([("set", "splits.train.shards.0.file", "../clean/manifest.json")], [])
@example([("dup", "train", None)], [])                             # a shard listed twice: read twice, silently
@example([("swap", None, None)], [])                             # trained on the held-out split, silently
@example([("dup", "train", None), ("pop", "train", False)], [])  # shards out of order: another stream, silently
@example([], [("extra", "train_00000.bin", 30)])
@example([], [("int32", "val_00000.bin", 0)])
@example([("set", "fingerprint", [1])], [])                      # was an AttributeError in prepare's refusal
@example([], [("out_of_vocab", "train_00000.bin", 0)])          # prepare says up to date: --force mends it
def test_generated_data_folders(prepared, tmp_path_factory, medits, sedits):
    src, clean = prepared
    d = tmp_path_factory.mktemp("edited") / "data"
    shutil.copytree(clean, d)
    m = _edit_manifest(json.loads((d / prep.MANIFEST).read_text()), medits)
    (d / prep.MANIFEST).write_text(json.dumps(m))
    for kind, name, n in sedits:
        _edit_shard(d, kind, name, n)
    _loads_exactly_or_one_line(d)
    # prepare again, same input and settings: the dataset is made whole, or one line says why not
    try:
        prep.prepare([src], d, val_fraction=0.5, workers=1, shard_tokens=64, progress=False)
    except DataError as e:
        assert "\n" not in str(e) and str(d) in str(e), str(e)
        return
    if not _loads_exactly_or_one_line(d):
        # what prepare checks to be a no-op is the manifest and the shards' sizes, not every token (a
        # 100B-token corpus); a shard corrupt in place is found when read, and its error says --force
        prep.prepare([src], d, val_fraction=0.5, workers=1, shard_tokens=64, progress=False, force=True)
        assert _loads_exactly_or_one_line(d)
    for split in prep.SPLITS:
        assert np.array_equal(_listed_stream(d, split), _listed_stream(clean, split))


def test_the_clean_folder_loads(prepared):
    assert _loads_exactly_or_one_line(prepared[1])
