"""data.prepare refuses what would lose data or silently mis-tokenize it (issue 18 item 4): a non-empty
folder that is not a dataset, a dataset of other inputs without --force, binary and non-UTF-8 input;
huge documents reach the tokenizer in pieces whose tokens equal the whole text's."""

import numpy as np
import pytest

from laplace_jax.data import corpus, prepare as prep
from laplace_jax.data.tokenizer import get_tokenizer

WORDS = "the history of Ærø, naïve café 42 3.14 -- (x) it's we'll \t tabs\nnew lines  two  spaces".split(" ")


def _text(n_words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n_words))


def _prepare(inputs, out, **kw):
    return prep.prepare(inputs, out, val_fraction=0.0, workers=1, progress=False, **kw)


def _tokens(out) -> np.ndarray:
    return np.fromfile(out / "train_00000.bin", dtype="<u2")


def _cli(capsys, *argv) -> str:
    assert prep.main(list(argv) + ["--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    return err.strip()


# ----------------------------------------------------------------------------- the output folder

def test_refuses_a_folder_that_is_not_a_dataset(tmp_path, capsys):
    src = tmp_path / "a.txt"
    src.write_text(_text(50, 0))
    run = tmp_path / "run"                     # e.g. a training run dir
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("name: x\n")
    before = sorted(p.name for p in run.iterdir())
    msg = _cli(capsys, "--input", str(src), "--out", str(run))
    assert f"--out '{run}' is not empty and is not a prepared dataset" in msg and "'checkpoints'" in msg
    assert sorted(p.name for p in run.iterdir()) == before        # not even a lock file


def test_replacing_a_dataset_of_other_inputs_needs_force(tmp_path, capsys):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(_text(60, 1))
    b.write_text(_text(60, 2))
    out = tmp_path / "out"
    m = _prepare([a], out)
    stamp = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    msg = _cli(capsys, "--input", str(b), "--out", str(out), "--val-fraction", "0")
    assert f"already holds a dataset prepared from other inputs ({a})" in msg and "pass --force" in msg
    msg = _cli(capsys, "--input", str(a), "--out", str(out), "--val-fraction", "0.5")
    assert "other settings (val_fraction 0.0 -> 0.5)" in msg
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamp and prep.read_manifest(out) == m
    m2 = _prepare([b], out, force=True)
    assert m2["sources"][0]["path"] == str(b)
    assert _tokens(out).tolist() == get_tokenizer().encode(b.read_text()) + [50256]


# ----------------------------------------------------------------------------- binary / not UTF-8

@pytest.mark.parametrize("read_bytes", [1 << 20, 7])   # 7: the bad byte and multi-byte characters straddle reads
def test_non_utf8_text_names_file_and_offset(tmp_path, monkeypatch, capsys, read_bytes):
    monkeypatch.setattr(corpus, "_READ_BYTES", read_bytes)
    good = "naïve café " * 10                  # 13 bytes each (ï, é are 2 bytes)
    f = tmp_path / "latin1.txt"
    f.write_bytes(good.encode() + "déjà".encode("latin-1"))
    msg = _cli(capsys, "--input", str(f), "--out", str(tmp_path / "o"))
    assert msg == (f"error: {f} is not UTF-8 text: byte 0xe9 at byte offset 131 does not decode (binary or "
                   f"another encoding): convert it to UTF-8 (iconv -t UTF-8) or remove it from --input")
    assert prep.read_manifest(tmp_path / "o") is None
    cut = tmp_path / "cut.txt"                  # a multi-byte character cut off at the end of the file
    cut.write_bytes(good.encode() + "é".encode()[:1])
    assert "byte 0xc3 at byte offset 130 " in _cli(capsys, "--input", str(cut), "--out", str(tmp_path / "o"))


def test_binary_input_is_refused(tmp_path, capsys):
    nul = tmp_path / "nul.txt"
    nul.write_bytes("ok é ".encode() + b"\0\1\2")
    assert "looks binary: NUL byte at byte offset 6: give text files only" in _cli(
        capsys, "--input", str(nul), "--out", str(tmp_path / "o"))
    rnd = tmp_path / "random.txt"              # the case: random bytes
    rnd.write_bytes(np.random.default_rng(0).integers(0, 256, 200_000, dtype=np.uint8).tobytes())
    assert " is not UTF-8 text: byte 0x" in _cli(capsys, "--input", str(rnd), "--out", str(tmp_path / "o"))
    js = tmp_path / "a.jsonl"
    js.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    assert "a.jsonl is not UTF-8 text: byte 0xe9 at byte offset 30 " in _cli(
        capsys, "--input", str(js), "--out", str(tmp_path / "o"))
    doc = tmp_path / "a.json"
    doc.write_bytes(b'["ok", "\xff"]')
    assert "a.json is not UTF-8 text: byte 0xff at byte offset 8 " in _cli(
        capsys, "--input", str(doc), "--out", str(tmp_path / "o"))


# ----------------------------------------------------------------------------- huge documents in pieces

def test_pieces_tokenize_like_the_whole_text(tmp_path, monkeypatch):
    """Documents far longer than the piece size, read a few bytes at a time, separators straddling reads:
    the shards hold exactly the whole documents' tokens (the tokenizer run on each document at once)."""
    monkeypatch.setattr(corpus, "PIECE_CHARS", 40)
    monkeypatch.setattr(corpus, "_READ_BYTES", 5)
    docs = [_text(400, 3), _text(7, 4), _text(900, 5)]
    f = tmp_path / "one_line.txt"
    f.write_text(docs[0] + "<|endoftext|>" + " \n " + "<|endoftext|>" + docs[1] + "<|endoftext|>" + docs[2])
    pieces = list(corpus.iter_pieces([f]))
    assert max(len(t) for t, _ in pieces) <= 40 and sum(e for _, e in pieces) == 3   # whitespace doc skipped
    tok = get_tokenizer()
    m = _prepare([f], tmp_path / "out")
    want = [t for d in docs for t in tok.encode(d) + [tok.eos_id]]
    assert m["documents"] == 3 and _tokens(tmp_path / "out").tolist() == want


def test_text_without_spaces_is_cut_but_kept_whole(tmp_path, monkeypatch):
    """No safe cut in sight (one 'word' longer than a piece): cut at the piece size; every byte survives."""
    monkeypatch.setattr(corpus, "PIECE_CHARS", 64)
    text = "é" * 100 + "x" * 150 + " tail"
    f = tmp_path / "blob.txt"
    f.write_text(text)
    _prepare([f], tmp_path / "out")
    ids = _tokens(tmp_path / "out").tolist()
    assert ids[-1] == 50256 and get_tokenizer().decode(ids[:-1]) == text


def test_safe_cut_points():
    assert corpus.safe_cut("alpha beta gamma", 12) == 10          # before " gamma"
    assert corpus.safe_cut("a, b ,  c", 8) == 4                    # after "b": left of the later spaces is ","
    assert corpus.safe_cut("xxxxxxxxxx", 4) == 4                   # no space: hard cut
