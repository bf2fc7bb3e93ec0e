"""The property of tests/test_props_*.py end to end (issue 35): examples hypothesis found, handed to the
real command lines. Each exits with status 2 and one `error:` line naming the file, the key and the fix,
no traceback (a JAX command costs a few seconds to start, so these few stand for the in-process
thousands)."""
import dataclasses
import json
import subprocess
import sys

import pytest

from conftest import ROOT, cli_env, write_run
from laplace_jax.config import load_config

ARCH = dataclasses.replace(load_config("laplace_tiny").model, num_layers=1, vocab_size=512)


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """A config naming no model, a data folder whose manifest lacks a split's token count, a run whose
    checkpoint metadata lacks the config, and a dataset whose fingerprint was edited to a list."""
    from export.random_weights import random_params
    from laplace_jax.data import prepare as prep
    root = tmp_path_factory.mktemp("bad")
    (root / "no_model.yaml").write_text("optim:\n  lr: 0.01\ntrain:\n  steps: 5\n")
    src = root / "docs.txt"
    src.write_text("\n<|endoftext|>\n".join(f"Document {i} about the river trade of the city." for i in range(40)))
    prep.prepare([src], root / "data", val_fraction=0.25, workers=1, progress=False)
    m = json.loads((root / "data" / prep.MANIFEST).read_text())
    del m["splits"]["train"]["tokens"]
    (root / "data" / prep.MANIFEST).write_text(json.dumps(m))
    prep.prepare([src], root / "data2", val_fraction=0.25, workers=1, progress=False)
    m = json.loads((root / "data2" / prep.MANIFEST).read_text())
    m["fingerprint"] = [1]
    (root / "data2" / prep.MANIFEST).write_text(json.dumps(m))
    write_run(root / "run", random_params(ARCH), ARCH, [1])
    meta = root / "run" / "checkpoints" / "1" / "meta" / "metadata"
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "config"}))
    return root


CASES = [  # (module, argv with {root}, words of the one line)
    ("laplace_jax.train", ["--config", "{root}/no_model.yaml", "--run-dir", "{root}/r1"],
     "{root}/no_model.yaml names no model: a config names the whole architecture"),
    ("laplace_jax.train", ["--run-dir", "{root}/r2", "--local-devices", "1", "model.num_layers=1",
                           "data.path={root}/data"],
     "{root}/data/manifest.json: splits.train.tokens is None, not a non-negative integer: re-run"),
    ("laplace_jax.eval", ["--checkpoint", "{root}/run", "--tasks", "held-out"],
     "checkpoint step 1 in {root}/run is unreadable ("),
    ("export", ["--checkpoint", "{root}/run", "--out", "{root}/exported"], "lacks the run's config (config.model)"),
    ("laplace_jax.data.prepare", ["--input", "{root}/docs.txt", "--out", "{root}/data2", "--val-fraction", "0.25",
                                  "--workers", "1", "--quiet"],
     "already holds a dataset prepared from other inputs (): pass --force"),
]


@pytest.mark.parametrize("module,argv,words", CASES,
                         ids=[f"{m.split('.')[-1]}-{i}" for i, (m, _, _) in enumerate(CASES)])
def test_found_examples_end_in_one_line_and_exit_2(bad, module, argv, words):
    fill = lambda s: s.format(root=bad)
    p = subprocess.run([sys.executable, "-m", module, *map(fill, argv)], cwd=ROOT, env=cli_env(), capture_output=True,
                       text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("error: ") and "Traceback" not in p.stderr, p.stderr
    assert fill(words) in p.stderr, p.stderr
    assert not (bad / "exported").exists() and not [q for q in bad.iterdir() if q.name.startswith(".exported")]


def test_the_readme_names_every_entry_point():
    text = (ROOT / "README.md").read_text()
    para = text[text.index("Exit status"):][:2500]
    for module in ("laplace_jax.train", "laplace_jax.eval", "laplace_jax.generate", "laplace_jax.data.prepare",
                   "laplace_jax.info", "export", "vLLM"):
        assert module in para, module
