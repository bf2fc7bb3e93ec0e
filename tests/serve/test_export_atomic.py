"""An export is whole or absent (issue 35): an export killed (SIGKILL) at any stage leaves no folder at
--out that looks like a model, and an earlier export it was replacing stays whole (at --out, or, killed
between the two renames of the swap, in its `-old-` sibling); the next export cleans up after the
killed one. The stages are export/atomic.py's pause points (LAPLACE_EXPORT_PAUSE_AT, a test-only hook).
Subprocesses: the core (`export_params`, torch only: ~3 s each) at most stages, `python -m export`
(jax + orbax + torch, ~8 s) at one."""
import dataclasses
import filecmp
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, cli_env, need, write_run

need("torch")
need("safetensors")

from export.atomic import PAUSE_ENV, is_export
from export.random_weights import random_params
from laplace_jax.config import load_config

ARCH = dataclasses.replace(load_config("laplace_tiny").model, num_layers=1, vocab_size=512)
CORE = ("import sys, dataclasses; from export.convert import export_params; "
        "from export.random_weights import random_params; from laplace_jax.config import load_config; "
        "a = dataclasses.replace(load_config('laplace_tiny').model, num_layers=1, vocab_size=512); "
        "export_params(random_params(a, seed=int(sys.argv[2])), a, sys.argv[1], overwrite=True)")


def _killed_at(stage: str, cmd: list[str]) -> None:
    """Run `cmd` until it pauses at `stage`, then SIGKILL it."""
    p = subprocess.Popen(cmd, cwd=ROOT, env=cli_env(**{PAUSE_ENV: stage}), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    line = ""
    while "paused at" not in line:
        line = p.stderr.readline()
        assert line or p.poll() is None, f"exited {p.returncode} before stage {stage}"
        assert time.time() < deadline, f"never reached stage {stage}"
    p.send_signal(signal.SIGKILL)
    p.wait()
    p.stderr.close()


def _core(out, seed: int) -> list[str]:
    return [sys.executable, "-c", CORE, str(out), str(seed)]


def _same(a, b) -> bool:
    cmp = filecmp.dircmp(a, b)
    return not (cmp.left_only or cmp.right_only or cmp.diff_files or cmp.funny_files)


@pytest.mark.slow
def test_a_killed_export_leaves_the_old_one_or_nothing(tmp_path):
    out = tmp_path / "model"
    for stage in ("code", "written"):                             # a first export: nothing at --out
        _killed_at(stage, _core(out, 0))
        assert not out.exists(), stage
    assert subprocess.run(_core(out, 0), cwd=ROOT, env=cli_env(), capture_output=True).returncode == 0
    assert is_export(out)
    siblings = sorted(p.name for p in tmp_path.iterdir())
    assert siblings == ["model"], siblings                        # the killed exports' temporary folders: gone
    keep = tmp_path / "keep"
    subprocess.run(["cp", "-a", str(out), str(keep)], check=True)
    for stage in ("weights",):                                    # replacing it: the old export, whole
        _killed_at(stage, _core(out, 1))
        assert _same(out, keep), stage
    _killed_at("swapping", _core(out, 1))                          # between the renames: old one aside
    assert not out.exists()
    old = [p for p in tmp_path.iterdir() if p.name.startswith(".model.export-old-")]
    assert len(old) == 1 and _same(old[0], keep)


@pytest.mark.slow
def test_the_cli_killed_while_writing_weights(tmp_path):
    run = tmp_path / "run"
    write_run(run, random_params(ARCH), ARCH, [1])
    out = tmp_path / "exported"
    cmd = [sys.executable, "-m", "export", "--checkpoint", str(run), "--out", str(out)]
    _killed_at("weights", cmd)
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".exported")]
    p = subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and is_export(out), p.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "run"]
    assert oct(os.stat(out).st_mode & 0o777) == oct(0o777 & ~_umask())   # a plain folder's mode, not 0700


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m
