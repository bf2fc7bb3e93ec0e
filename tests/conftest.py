"""Test-wide setup: 8 emulated CPU devices (set before jax is imported anywhere)."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import importlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def need(module: str):
    """Import a serving dependency: skipped where it is not installed, but a failure in CI (CI=true),
    whose install step must have brought it."""
    if os.environ.get("CI"):
        return importlib.import_module(module)
    return pytest.importorskip(module)


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory) -> Path:
    """The README's main job: the tiny config trained 200 steps on the demo corpus (one CPU device)."""
    run = tmp_path_factory.mktemp("trained") / "tiny"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "laplace_jax.train", "--config", "laplace_tiny", "--run-dir", str(run),
           "--local-devices", "1", "--steps", "200", "train.eval_every=100", "train.ckpt_every=200"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    return run
