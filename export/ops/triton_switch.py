"""The one Triton import and switch of export's kernels, and the launch helpers they share.

`triton` and `tl` are None where triton is not installed (CPU installs: the torch paths run).
`enabled()`: triton importable and LAPLACE_VLLM_TRITON not "0".  `available(t)`: enabled, and
tensors like `t` can run the kernels (CUDA, or any device under TRITON_INTERPRET=1, the CPU
interpreter the tests use).
"""
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU install without triton: the torch path is used
    triton = None
    tl = None


def enabled() -> bool:
    return triton is not None and os.environ.get("LAPLACE_VLLM_TRITON", "1") != "0"


def interpreting() -> bool:
    """TRITON_INTERPRET=1: kernels decorated now run in Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(t: torch.Tensor) -> bool:
    return enabled() and (t.is_cuda or interpreting())


def require(module: str) -> None:
    """Raise where triton is not installed (a launcher called on a CPU install)."""
    if triton is None:
        raise RuntimeError(f"{module}: triton is not installed")


def rowmajor(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dimension is contiguous (the kernels take any other strides), else a
    contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()
