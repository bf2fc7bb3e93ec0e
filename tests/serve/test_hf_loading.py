"""An exported folder through Hugging Face `transformers`, loaded as by a user who has neither jax nor
this project: `AutoTokenizer` + `AutoModelForCausalLM(trust_remote_code=True)` in a clean subprocess
(tests/serve/hf_clean_load.py). Greedy `generate` equals `python -m laplace_jax.generate` token for token,
logits equal the torch module's within float32 rounding, and the shipped modelling code is the
project's own source (these end-to-end tests, marked slow: 35-50 s on 2 shared CPU cores). Plus the
remote-code copier's walk and refusals (unit tests, well under a second)."""
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, cli_env, logit_atol, mean_ce_rtol, need, write_run

torch = need("torch")
need("transformers")
need("safetensors")

from export.remote_code import ENTRY_POINTS, RemoteCodeError, collect, module_path
from export.random_weights import random_params
from laplace_jax.config import load_config
from export.torch_model import LaplaceForCausalLM

# one token, fewer than a chunk (16), more than a chunk and not a multiple of it
PROMPTS = ["The", "Once upon a time there was a little",
           "The history of the city begins in the early days of the river trade, when merchants"]
MAX_NEW = 24
# Random weights whose greedy steps all have a top-2 logit gap far above float32 rounding (the test
# asserts it): over 72 steps some gap is often near 0 (seeds 3 and 5 of export.random_weights: 0.0033,
# 0.0035 against a bound of 0.0044); 7's smallest is 0.0149.
SEED = 7


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A checkpoint of random (seeded, hence machine-independent) weights, exported by the CLI."""
    cfg = load_config("laplace_tiny").model
    params = random_params(cfg, seed=SEED)
    tmp = tmp_path_factory.mktemp("hf")
    write_run(tmp / "run", params, cfg, [3])
    subprocess.run([sys.executable, "-m", "export", "--checkpoint", str(tmp / "run"), "--out", str(tmp / "folder")],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    return params, tmp / "run", tmp / "folder"


@pytest.fixture(scope="module")
def hf(exported, tmp_path_factory):
    """What transformers made of the folder, with the project unimportable and the network unused."""
    folder = exported[2]
    elsewhere = tmp_path_factory.mktemp("user")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HOME=str(elsewhere / "hf_home"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    out = elsewhere / "out.pt"
    p = subprocess.run([sys.executable, "-I", str(ROOT / "tests" / "serve" / "hf_clean_load.py"), str(folder), str(out),
                        str(MAX_NEW), *PROMPTS], cwd=elsewhere, env=env, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.mark.slow
def test_loads_without_the_project(exported, hf):
    assert hf["loading_info"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    assert hf["model_module"].startswith("transformers_modules.") and hf["project_modules"] == []
    config = json.loads((exported[2] / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "hf_config.LaplaceHFConfig",
                                  "AutoModelForCausalLM": "hf_modeling.LaplaceForCausalLM"}
    assert config["architectures"] == ["LaplaceForCausalLM"]   # vLLM's name, kept
    # save_pretrained (after PEFT's merge, say) writes back the names and entry points vLLM reads
    names = list(hf["tensor_names"].values())
    assert names[0] == names[1] and "embed.weight" in names[0]
    assert hf["resaved_config"]["architectures"] == ["LaplaceForCausalLM"]
    assert hf["resaved_config"]["auto_map"] == config["auto_map"]


@pytest.mark.slow
def test_shipped_code_is_the_project_source(exported):
    """Every shipped file is a project module with only its project imports changed (to relative)."""
    shipped = sorted(p.name for p in exported[2].glob("*.py"))
    modules = collect([m for m, _ in ENTRY_POINTS.values()])
    assert shipped == sorted(m.name.rsplit(".", 1)[1] + ".py" for m in modules)
    assert {"torch_model.py", "hf_config.py", "hf_modeling.py"} <= set(shipped)
    for m in modules:
        mine = (exported[2] / (m.name.rsplit(".", 1)[1] + ".py")).read_text().splitlines()
        source = module_path(m.name).read_text().splitlines()
        assert len(mine) == len(source)
        changed = [(a, b) for a, b in zip(source, mine) if a != b]
        for a, b in changed:
            assert re.match(r"\s*from (export|laplace_jax)\.[\w.]+ import ", a), a
            assert re.sub(r"from (export|laplace_jax)\.(?:\w+\.)*(\w+) import", r"from .\2 import", a) == b


@pytest.mark.slow
def test_greedy_equals_jax_generate(exported, hf):
    """`generate(do_sample=False)` = `python -m laplace_jax.generate`, alone and as a padded batch.
    The two sides' logits differ by float32 rounding (a few logit_atol), so each step's top-2 gap is
    checked to exceed that by far: equal argmaxes are then guaranteed, not lucky."""
    params, run, _ = exported
    assert hf["plain_ids"] == hf["ids"]
    assert min(hf["min_gap"]) > 10 * logit_atol(params), hf["min_gap"]
    cmd = [sys.executable, "-m", "laplace_jax.generate", "--checkpoint", str(run), "--ids", "--ignore-eos",
           "--max-new-tokens", str(MAX_NEW), "--platform", "cpu"]
    for text in PROMPTS:
        cmd += ["--prompt", text]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=cli_env())
    assert p.returncode == 0, p.stderr[-3000:]
    jax_ids = [json.loads(ln.split(":", 1)[1]) for ln in p.stdout.splitlines() if ln.startswith("prompt ids:")]
    jax_new = [json.loads(ln.split(":", 1)[1]) for ln in p.stdout.splitlines() if ln.startswith("new ids:")]
    assert jax_ids == hf["ids"]
    assert [len(x) for x in jax_new] == [MAX_NEW] * len(PROMPTS)
    assert hf["alone"] == jax_new
    assert hf["batch"] == jax_new


@pytest.mark.slow
def test_logits_and_loss_equal_the_torch_module(exported, hf):
    params, _, folder = exported
    with torch.no_grad():
        want, _ = LaplaceForCausalLM.from_pretrained(folder)(hf["joined"])
    assert (hf["logits"] - want).abs().max().item() <= logit_atol(params)
    n = hf["joined"].shape[1] - 1
    ce = torch.nn.functional.cross_entropy(hf["logits"][0, :-1], hf["joined"][0, 1:]).item()
    assert abs(hf["loss"] - ce) <= mean_ce_rtol(n, hf["logits"].shape[-1]) * ce


# ----------------------------------------------------------------------------- the copier's refusals

def _package(root, files: dict):
    for rel, text in files.items():
        path = root / "fakeproj" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_copier_follows_imports_and_rewrites_them(tmp_path, monkeypatch):
    _package(tmp_path, {"__init__.py": "import numpy\n", "a.py": "import torch\nfrom fakeproj.sub.b import B\n",
                        "sub/__init__.py": "", "sub/b.py": "def B():\n    from .c import C\n    return C\n",
                        "sub/c.py": "import math\nC = math.pi\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    got = {m.name: m.source for m in collect(["fakeproj.a"], packages=("fakeproj",))}
    assert got == {"fakeproj.a": "import torch\nfrom .b import B\n",
                   "fakeproj.sub.b": "def B():\n    from .c import C\n    return C\n",
                   "fakeproj.sub.c": "import math\nC = math.pi\n"}


@pytest.mark.parametrize("files, message", [
    ({"b.py": "import numpy\n"}, "imports numpy"),
    ({"a.py": "from fakeproj import b\n"}, "imports from a package"),
    ({"a.py": "import fakeproj.b\n"}, "cannot be shipped"),
    ({"a.py": "from fakeproj.b import (\n    B)\nfrom fakeproj.sub.b import C\n", "sub/b.py": "C = 1\n"},
     "both be shipped as b.py"),
    ({"a.py": "from fakeproj.b \\\n    import B\n"}, "on one line"),
])
def test_copier_refusals(tmp_path, monkeypatch, files, message):
    base = {"__init__.py": "", "sub/__init__.py": "", "a.py": "from fakeproj.b import B\n", "b.py": "B = 1\n"}
    _package(tmp_path, {**base, **files})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RemoteCodeError, match=message):
        collect(["fakeproj.a"], packages=("fakeproj",))
