"""The one Triton import and switch of export's kernels, and the launch helpers they share.

`triton` and `tl` are None where triton is not installed (CPU installs: the torch paths run).
`enabled()`: triton importable and LAPLACE_VLLM_TRITON not "0".  `available(t)`: enabled, and
tensors like `t` can run the kernels (CUDA, or any device under TRITON_INTERPRET=1, the CPU
interpreter the tests use).  `checked_out`: an output tensor a launcher's caller hands it, checked.
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


def checked_out(out: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A caller's output tensor for a launcher, checked: the kernels index its rows by their
    strides and its last dimension densely."""
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or (out.numel() and out.stride(-1) != 1):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} stride {out.stride()}: want {tuple(shape)} "
                         f"{dtype} with last-dim stride 1")
    return out
