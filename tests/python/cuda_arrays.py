"""Test helpers for the CUDA test files: which GPU frameworks are usable, host arrays as torch CUDA
tensors seen through a memory layout (contiguous, transposed, padded, misaligned), and CUDA
tensors back on the host. torch is imported only when a helper runs, so modules that import this
still collect without torch."""

from __future__ import annotations

import numpy as np
import pytest

import flashdl

LAYOUTS = ("contiguous", "transposed", "padded", "odd")


def gpu_frameworks(need_torch=False):
    """(torch, cupy): each module where it sees a CUDA device, else None. Skips the calling test
    module (call it at import) when flashdl sees no device, when neither framework is usable, or,
    with need_torch, when torch is not."""
    if flashdl.info()["cuda_device_count"] == 0:
        pytest.skip("no CUDA device: " + flashdl.info()["cuda_status"], allow_module_level=True)
    try:
        import torch

        if not torch.cuda.is_available():
            torch = None
    except ImportError:
        torch = None
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() == 0:
            cupy = None
    except Exception:  # ImportError or cupy's CUDA errors
        cupy = None
    if torch is None and (need_torch or cupy is None):
        pytest.skip("torch.cuda is not usable" if need_torch else
                    "neither torch.cuda nor cupy is usable", allow_module_level=True)
    return torch, cupy


def torch_array(x, dtype, layout, device="cuda"):
    """x (b, s, h, d) as a CUDA tensor of `dtype` viewed through `layout`: contiguous, transposed
    (stored as (b, h, s, d)), padded (rows of d + 8) or odd (rows of d + 3: no 16-byte alignment).
    x must be exact in dtype (the values are converted, never rounded, on the way)."""
    import torch

    tdt = getattr(torch, dtype)
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(device=device, dtype=tdt)
    if layout == "transposed":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if layout in ("padded", "odd"):
        pad = 8 if layout == "padded" else 3
        buf = torch.full(t.shape[:-1] + (t.shape[-1] + pad,), float("nan"), device=device, dtype=tdt)
        buf[..., : t.shape[-1]] = t
        return buf[..., : t.shape[-1]]
    assert layout == "contiguous", layout
    return t


def host(t):
    """A torch tensor as a float64 NumPy array."""
    import torch

    return t.detach().to(torch.float64).cpu().numpy()
