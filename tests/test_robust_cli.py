"""Every command line given a bad path, file or flag value ends in one `error:` line naming the problem and
the fix, exit status 2, and touches nothing (issue 18's sweep). In-process: no training happens, each case
stops before any computation (about 0.1-1 s each)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, cli_env
from export.__main__ import main as export_main
from laplace_jax.data.prepare import main as prepare_main
from laplace_jax.generate import main as generate_main
from laplace_jax.info import main as info_main
from laplace_jax.optim.traffic import main as traffic_main
from laplace_jax.train import main as train_main

# in-process train runs see the test session's 8 emulated devices: 8 sequences per step
EIGHT = ["train.batch_tokens=2048", "train.micro_batch=8"]

CASES = [  # (command, argv with {placeholders}, what the error line says)
    (train_main, ["--run-dir", "{file}", "--steps", "1", *EIGHT], "--run-dir {file} is a file: give a folder"),
    (train_main, ["--run-dir", "{ro}/run", "--steps", "1", *EIGHT], "(Read-only file system): use a --run-dir in a"),
    (train_main, ["--config", "{list_yaml}", "--run-dir", "{tmp}/r"], "holds a YAML list, not a mapping of sections"),
    (train_main, ["--config", "{bad_yaml}", "--run-dir", "{tmp}/r"], "not valid YAML"),
    (train_main, ["--config", "{dir}", "--run-dir", "{tmp}/r"], "cannot be read (Is a directory): give a YAML file"),
    (train_main, ["--run-dir", "{tmp}/r", "--steps", "-1"], "argument --steps: -1: must be at least 1 (see "),
    (train_main, ["--run-dir", "{tmp}/r", "--local-devices", "abc"], "argument --local-devices: invalid int value"),
    (train_main, ["--run-dir", "{tmp}/r", "data.path={bad_manifest}", *EIGHT], "manifest.json is unreadable"),
    (train_main, ["--run-dir", "{tmp}/r", "data.path={file}", *EIGHT], "is not a directory of token shards"),
    (train_main, ["--run-dir", "{tmp}/r", "optim.lr"], "override 'optim.lr': expected key=value"),
    (info_main, ["--config", "{list_yaml}"], "not a mapping"),
    (info_main, ["--config", "laplace_tiny", "--ranks", "0"], "argument --ranks: 0: must be at least 1"),
    (traffic_main, ["--config", "{bad_yaml}", "--analytic"], "not valid YAML"),
    (traffic_main, ["--config", "nope", "--analytic"], "config 'nope' not found"),
    (traffic_main, ["--config", "laplace_tiny", "--ranks", "-3"], "argument --ranks: -3: must be at least 1"),
    (generate_main, ["--checkpoint", "{file}", "--prompt", "hi"], "no checkpoints in {file}/checkpoints: train first"),
    (generate_main, ["--checkpoint", "{tmp}", "--prompt", "ok", "--prompt", ""], "--prompt #2 is empty"),
    (generate_main, ["--checkpoint", "{tmp}", "--prompt", "caf\udce9"],
     "--prompt #1 is not UTF-8 text (byte 0xe9 at offset 3)"),
    (generate_main, ["--checkpoint", "{tmp}", "--prompt", "hi", "--max-new-tokens", "0"], "must be at least 1"),
    (generate_main, ["--checkpoint", "{tmp}", "--prompt", "hi", "--temperature", "nan"], "finite number >= 0"),
    (generate_main, ["--checkpoint", "{tmp}", "--prompt", "hi", "--top-k", "-1"], "--top-k -1: must be >= 0"),
    (prepare_main, ["--input", "demo", "--out", "{file}"], "is a file: give a directory path"),
    (prepare_main, ["--input", "demo", "--out", "{ro}/data"], "(Read-only file system): choose a writable folder"),
    (prepare_main, ["--input", "{file}", "--out", "{tmp}/o"], "has an unknown format"),
    (prepare_main, ["--input", "demo", "--out", "{tmp}/o", "--workers", "0"], "argument --workers: 0: must be"),
    (prepare_main, ["--input", "demo", "--out", "{tmp}/o", "--val-fraction", "nan"], "must be in [0, 1)"),
    (prepare_main, ["--input", "demo", "--out", "{dir}"], "is not empty and is not a prepared dataset"),
    (export_main, ["--checkpoint", "{file}", "--out", "{tmp}/e"], "no checkpoints found"),
    (export_main, ["--checkpoint", "{tmp}", "--out", "{file}"], "exists and is not a directory"),
    (export_main, ["--checkpoint", "{tmp}", "--out", "{tmp}/e", "--dtype", "int8"], "unknown dtype 'int8'"),
]


@pytest.fixture(scope="module")
def read_only(tmp_path_factory):
    """A read-only filesystem (a ro tmpfs: read-only even for root, unlike chmod), or None."""
    ro = tmp_path_factory.mktemp("ro")
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                        capture_output=True).returncode == 0
    yield ro if ok else None
    if ok:
        subprocess.run(["umount", str(ro)], capture_output=True)


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.mark.parametrize("cmd,argv,says", CASES,
                         ids=[f"{c.__module__.split('.')[-1]}-{i}" for i, (c, _, _) in enumerate(CASES)])
def test_bad_input_is_one_line_and_exit_2(cmd, argv, says, tmp_path, read_only, capsys):
    if any("{ro}" in a for a in argv) and read_only is None:
        pytest.skip("cannot mount a read-only tmpfs here (needs root with CAP_SYS_ADMIN)")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "notes.txt").write_text("mine\n")
    (tmp_path / "file").write_text("not a folder\n")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "bad.yaml").write_text("model: [1, 2\n")
    (tmp_path / "manifest").mkdir()
    (tmp_path / "manifest" / "manifest.json").write_text('{"format": "laplace_jax.tokens/v1", "splits": ')
    names = {"tmp": tmp_path, "file": tmp_path / "file", "dir": tmp_path / "dir", "ro": read_only,
             "list_yaml": tmp_path / "list.yaml", "bad_yaml": tmp_path / "bad.yaml",
             "bad_manifest": tmp_path / "manifest"}
    fill = lambda s: s.format(**names)
    before = _snapshot(tmp_path)
    try:
        status = cmd([fill(a) for a in argv])
    except SystemExit as e:   # argparse
        status = e.code
    out, err = capsys.readouterr()
    assert status == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and out == "", err
    assert fill(says) in err, err
    assert _snapshot(tmp_path) == before
    if read_only is not None:
        assert os.listdir(read_only) == []


def test_train_out_of_device_memory_is_one_line_naming_smaller_settings(tmp_path, capsys):
    """XLA's out-of-memory error, for real: a vocabulary of 2^30 tokens gives each of the 8 CPU devices
    64 GiB shards of the embedding and the head, which it cannot allocate (XLA:CPU reports it as INTERNAL
    "Out of memory allocating ..." when the step is dispatched). The error line names the micro-batch the
    layout accepts next (16 sequences a step on 8 devices: 8), not XLA's traceback; no checkpoint is
    written; any other runtime error is not taken for it."""
    import jax

    from laplace_jax.config import load_config
    from laplace_jax.train import out_of_memory

    status = train_main(["--run-dir", str(tmp_path / "r"), "--steps", "1", "train.batch_tokens=4096",
                         "train.micro_batch=16", "model.vocab_size=1073741824"])
    out, err = capsys.readouterr()
    last = err.rstrip().splitlines()[-1]     # after the run's own notes (set-up, compile)
    assert status == 2 and out == "" and "Traceback" not in err and err.count("error:") == 1, err
    assert last.startswith("error: out of device memory on 8 x cpu at train.micro_batch=16, "
                           "execution.remat=none ("), err
    assert "ut of memory" in last, err
    assert last.endswith("use train.micro_batch=8 or execution.remat=full or more devices "
                         "(mesh.fsdp shards the parameters and optimizer state)"), err
    assert not list((tmp_path / "r" / "checkpoints").iterdir())
    cfg = load_config("laplace_tiny")
    assert out_of_memory(jax.errors.JaxRuntimeError("INTERNAL: cuda error"), cfg, 1, "cpu", None) is None


# `python -m export` where torch cannot be imported, as after `make train` (no serve extra): a meta-path
# finder in front of every other answers any import of torch as an absent module does
WITHOUT_TORCH = """
import importlib.abc, runpy, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
runpy.run_module("export", run_name="__main__", alter_sys=True)
"""


def test_export_without_torch_is_one_line_naming_the_install_step(tmp_path):
    p = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, "--checkpoint", str(tmp_path / "run"),
                        "--out", str(tmp_path / "out")], cwd=ROOT, env=cli_env(), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("error: ") and p.stdout == "", p.stderr
    assert "no module named 'torch'" in p.stderr and "make install-serve" in p.stderr, p.stderr
    assert list(tmp_path.iterdir()) == []
