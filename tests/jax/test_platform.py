"""The trainer sizes JAX's GPU memory pool (train.gpu_mem_fraction) before JAX starts its backend, unless
the user sized it or the run cannot be on a GPU (issue 34: the shipped config is the fast one)."""
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from conftest import cli_env
from laplace_jax.platform import gpu_memory_env, gpu_memory_note, size_gpu_memory

ROOT = Path(__file__).resolve().parents[2]
SET = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.94"}


@pytest.mark.parametrize("env,platform,want", [
    ({}, "auto", SET),                                          # JAX picks a GPU where there is one
    ({}, "gpu", SET),
    ({"JAX_PLATFORMS": "cuda"}, "auto", SET),
    ({"JAX_PLATFORMS": "cpu,cuda"}, "auto", SET),
    ({"JAX_PLATFORMS": "rocm"}, "auto", SET),
    ({"JAX_PLATFORMS": "cpu"}, "gpu", SET),                    # platform=gpu overrides JAX_PLATFORMS
    ({"JAX_PLATFORMS": "cpu"}, "auto", {}),
    ({"JAX_PLATFORMS": "neuron,cpu"}, "auto", {}),
    ({}, "cpu", {}),
    ({}, "neuron", {}),
    ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}, "gpu", {}),   # the user's own setting stays
    ({"XLA_CLIENT_MEM_FRACTION": "0.5"}, "gpu", {}),          # jaxlib refuses both names at once
    ({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, "gpu", {}),
    ({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, "gpu", {}),
    ({"XLA_PYTHON_CLIENT_MEM_FRACTION": ""}, "gpu", SET),      # empty: jaxlib reads it as unset
])
def test_what_the_trainer_sets(env, platform, want):
    assert gpu_memory_env(env, platform, 0.94) == want


def test_the_fraction_is_written_as_given():
    assert gpu_memory_env({}, "gpu", 0.9) == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}
    assert gpu_memory_env({}, "gpu", 1.0) == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "1"}


def test_nothing_is_set_once_a_backend_runs(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    jax.devices()   # this process's CPU backend runs: a variable set now would not take effect
    assert size_gpu_memory("gpu", 0.94) == {}
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ


def test_no_note_and_nothing_left_set_without_a_gpu(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")
    assert jax.default_backend() == "cpu"
    assert gpu_memory_note(SET) is None
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ


def test_the_trainer_starts_no_backend_before_its_main_sets_the_pool():
    """JAX reads the pool variables when its backend starts (the GPU plugin's initialize, at the first
    jax.devices() or computation), not at `import jax`: importing the trainer and loading a config start
    none, so `python -m laplace_jax.train`'s main sets the variable in time, and so does a script that
    imported jax first."""
    code = ("import jax, laplace_jax.train; from laplace_jax.config import load_config; load_config('laplace_3b'); "
            "from jax._src import xla_bridge; print(xla_bridge.backends_are_initialized())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
