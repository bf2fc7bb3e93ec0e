"""A diverged step is never saved (issue 18): `python -m laplace_jax.train` on the tiny config stops with a
one-line error naming the step, the last checkpoint saved from finite weights and the fix; non-finite
float settings are config errors; metrics.jsonl is strict JSON."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env
from laplace_jax.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
# one device, one held-out batch, a checkpoint every step
FAST = ["train.log_every=1", "train.eval_every=1", "train.eval_batches=1", "train.ckpt_every=1"]


def _start(run_dir, *args):
    cmd = [sys.executable, "-m", "laplace_jax.train", "--config", "laplace_tiny", "--run-dir", str(run_dir),
           "--local-devices", "1", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc):
    _, err = proc.communicate(timeout=600)
    return proc.returncode, err.strip().splitlines()


def _committed(run_dir):
    d = Path(run_dir) / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def _strict_rows(run_dir):
    def reject(const):
        raise ValueError(f"non-standard JSON constant {const}")
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line, parse_constant=reject) for line in lines]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two real runs, side by side:
    lr1e4: `--steps 1 optim.lr=1e4 optim.warmup_steps=0` (the issue's command: finite weights whose
           forward pass is NaN, caught by the held-out loss of the save step);
    huge:  `--steps 2 optim.lr=3e38 optim.warmup_steps=1`: step 1 runs at lr 0 and is saved, the update
           of step 2 overflows the weights to inf (caught by the on-device finite check)."""
    base = tmp_path_factory.mktemp("nonfinite")
    procs = {
        "lr1e4": _start(base / "lr1e4", "--steps", "1", "optim.lr=1e4", "optim.warmup_steps=0", *FAST),
        "huge": _start(base / "huge", "--steps", "2", "optim.lr=3e38", "optim.warmup_steps=1", *FAST),
    }
    return base, {k: _finish(p) for k, p in procs.items()}


def _error_line(result):
    rc, err = result
    assert rc == 1, err[-20:]
    assert err[-1].startswith("error: ") and "Traceback" not in "\n".join(err)
    return err[-1]


def test_diverged_first_step_saves_nothing(runs):
    base, out = runs
    msg = _error_line(out["lr1e4"])
    assert "non-finite held-out loss at step 1 " in msg and "step 1 checkpoint was not saved" in msg
    assert "no checkpoint was saved yet" in msg and "lower optim.lr" in msg
    assert _committed(base / "lr1e4") == []


def test_non_finite_weights_are_not_saved(runs):
    base, out = runs
    msg = _error_line(out["huge"])
    assert "non-finite parameters or optimizer state at step 2 " in msg and "lower optim.lr" in msg
    # the earlier good checkpoint stays and is the one named
    assert f"last good checkpoint: step 1 ({base / 'huge' / 'checkpoints' / '1'})" in msg
    assert _committed(base / "huge") == [1]


def test_metrics_lines_are_strict_json(runs):
    base, _ = runs
    for name in ("lr1e4", "huge"):
        rows = _strict_rows(base / name)
        for r in rows:
            json.dumps(r, allow_nan=False)
        last = rows[-1]
        assert last["error"].startswith("non-finite") and last["step"] == (2 if name == "huge" else 1)
    assert _strict_rows(base / "lr1e4")[-1]["eval_loss"] is None   # a nan held-out loss is written as null


@pytest.mark.parametrize("override", ["optim.lr=inf", "optim.lr=nan", "optim.lr=-inf", "optim.grad_clip=nan",
                                      "model.t_max=inf", "train.peak_flops=inf", "data.val_fraction=nan"])
def test_non_finite_float_settings_are_config_errors(override):
    key = override.split("=")[0]
    # one line: the config file it came from, then the key and the fix
    with pytest.raises(ConfigError,
                       match=rf"^config \S*laplace_tiny\.yaml: {key}=-?(inf|nan): must be a finite number$"):
        load_config("laplace_tiny", [override])


@pytest.mark.parametrize("override", ["optim.warmup_steps=inf", "train.steps=nan"])
def test_non_finite_integer_settings_are_config_errors(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^config \S*laplace_tiny\.yaml: {key}=.*: expected an integer$"):
        load_config("laplace_tiny", [override])


def test_non_finite_lr_on_the_command_line(tmp_path):
    rc, err = _finish(_start(tmp_path / "r", "--steps", "1", "optim.lr=inf"))
    # a config error: one line naming the config file, the key and the fix
    assert rc == 2 and re.fullmatch(r"error: config \S*laplace_tiny\.yaml: optim\.lr=inf: must be a finite number",
                                    err[-1]), err
    assert not (tmp_path / "r").exists()
