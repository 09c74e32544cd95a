"""The common eager calls, fast: a tiny call's time is mostly Python, and this path skips the
argument layer for the calls that need none of it (flashdl.attention and flashdl.torch.attention
with every option at its default but causal and return_lse; flashdl.attention_backward with every
option at its default but causal)."""

from __future__ import annotations

import sys
from typing import Optional

import numpy as np

from . import _ext
from ._args import lse_shape

# The common eager call, fast (a tiny call's time is mostly Python): q, k, v of one dtype, either
# aligned native-order NumPy float16/32/64 arrays or plain CPU torch tensors (no subclass, no
# grad; forward_torch), every option but causal and return_lse at its default (seed 0 and
# block_size (128, 128) are flashdl.torch's spelling of the defaults). The binding's
# forward_default takes them positionally, with no lse array unless one is returned; shapes and
# strides are the core's to check, as in the full path. Anything else, or a call the core
# refuses, goes down the full path, which words the error for the caller (the layout hints):
# errors are the full path's.
_NDARRAY = np.ndarray


_FAST_DTYPES = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64))


def int_pair(x, value):
    """Whether x is the tuple (value, value) of ints: == alone also takes (-1.0, -1.0) or
    (True, True), which the full path refuses (a TypeError naming the argument)."""
    return x.__class__ is tuple and x == (value, value) and x[0].__class__ is x[1].__class__ is int


def forward(q, k, v, causal, return_lse):
    if type(q) is not _NDARRAY:
        torch = sys.modules.get("torch")
        if torch is None or type(q) is not torch.Tensor or torch.compiler.is_compiling():
            return None
        return forward_torch(q, k, v, causal, return_lse)
    if not (
        type(k) is _NDARRAY
        and type(v) is _NDARRAY
        and q.dtype in _FAST_DTYPES
        and k.dtype is q.dtype
        and v.dtype is q.dtype
        and q.flags.aligned
        and k.flags.aligned
        and v.flags.aligned
    ):
        return None
    out = np.empty(q.shape, q.dtype)
    lse = np.empty(lse_shape(q), np.float32) if return_lse else None
    try:
        _ext.forward_default(q, k, v, out, lse, causal)
    except Exception:  # noqa: BLE001 - re-raised, worded, by the full path
        return None
    return (out, lse) if return_lse else out


def backward(dout, q, k, v, out, lse, causal):
    """attention_backward's (dq, dk, dv) on NumPy arrays as forward takes them (and lse, which
    the core checks as the full path's call would), or None: the full path (and its errors)."""
    if not (
        type(q) is _NDARRAY
        and type(k) is _NDARRAY
        and type(v) is _NDARRAY
        and type(dout) is _NDARRAY
        and type(out) is _NDARRAY
        and type(lse) is _NDARRAY
        and q.dtype in _FAST_DTYPES
        and k.dtype is v.dtype is dout.dtype is out.dtype is q.dtype
        and q.flags.aligned
        and k.flags.aligned
        and v.flags.aligned
        and dout.flags.aligned
        and out.flags.aligned
        and lse.flags.aligned
    ):
        return None
    dq, dk, dv = np.empty(q.shape, q.dtype), np.empty(k.shape, k.dtype), np.empty(v.shape, v.dtype)
    try:
        if causal:
            _ext.backward(dout, q, k, v, out, lse, dq, dk, dv, causal=True)
        else:
            _ext.backward(dout, q, k, v, out, lse, dq, dk, dv)
    except Exception:  # noqa: BLE001 - re-raised, worded, by the full path
        return None
    return dq, dk, dv


_TORCH_FAST: Optional[tuple] = None  # the torch names forward_torch uses, looked up once


def _torch_fast_names() -> tuple:
    global _TORCH_FAST
    torch = sys.modules["torch"]
    _TORCH_FAST = (
        torch.Tensor,
        torch.empty_like,
        torch.utils.dlpack.to_dlpack,
        torch.contiguous_format,
        torch.empty,
        torch.float32,
    )
    return _TORCH_FAST


def forward_torch(q, k, v, causal, return_lse):
    """forward on a torch.Tensor q, outside torch.compile (the caller's checks). Every
    other check is the core's (dtypes, devices, shapes: a refusal takes the full path) except
    those it cannot make: plain tensors, no autograd, and q on the CPU (a GPU call needs the
    caller's stream, which only the full path asks torch for)."""
    tensor, empty_like, to_dlpack, contiguous, empty, float32 = _TORCH_FAST or _torch_fast_names()
    if (
        type(k) is not tensor
        or type(v) is not tensor
        or not q.is_cpu
        or q.requires_grad
        or k.requires_grad
        or v.requires_grad
    ):
        return None
    try:
        # empty_like: a third of torch.empty's time from a shape (a tiny call's largest part); a
        # fifth less again without the memory_format keyword, which a contiguous q does not need
        # (its layout is the one asked for).
        out = empty_like(q) if q.is_contiguous() else empty_like(q, memory_format=contiguous)
        if not return_lse:
            _ext.forward_default(
                to_dlpack(q), to_dlpack(k), to_dlpack(v), to_dlpack(out), None, causal
            )
            return out
        lse = empty(lse_shape(q), dtype=float32)
        _ext.forward_default(
            to_dlpack(q), to_dlpack(k), to_dlpack(v), to_dlpack(out), to_dlpack(lse), causal
        )
        return out, lse
    except Exception:  # noqa: BLE001 - re-raised, worded, by the full path
        return None
