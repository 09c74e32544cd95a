"""The caller's framework: which one, how to allocate outputs with it, which stream, dtype views.

Frameworks are recognised by ``type(x).__module__`` and taken from ``sys.modules``: flashdl never
imports torch, jax or cupy itself, so a caller who has not imported one never pays for it.
Shape, dtype and device checks are the C++ core's job; this file knows only what Python knows.
"""

from __future__ import annotations

import sys

import numpy as np

from . import _checks

_KNOWN = ("NumPy", "PyTorch", "JAX", "CuPy")


def type_name(x) -> str:
    t = type(x)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _kind(name: str, x) -> str:
    """'numpy', 'torch', 'jax', 'cupy' or 'dlpack' (any other object with __dlpack__)."""
    root = type(x).__module__.split(".")[0]
    if root == "numpy" and isinstance(x, np.ndarray):
        return "numpy"
    if root == "torch" and isinstance(x, sys.modules["torch"].Tensor):
        return "torch"
    if root == "cupy" and isinstance(x, sys.modules["cupy"].ndarray):
        return "cupy"
    if root in ("jax", "jaxlib") and "jax" in sys.modules:
        jax = sys.modules["jax"]
        if isinstance(x, jax.core.Tracer):
            raise TypeError(
                f"{name}: got a JAX tracer; inside jax.jit, jax.grad or jax.vmap "
                "use flashdl.jax.attention (this entry point takes concrete arrays)"
            )
        if isinstance(x, jax.Array):
            return "jax"
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__") and hasattr(x, "shape"):
        return "dlpack"
    raise TypeError(
        f"{name}: expected an array ({', '.join(_KNOWN)} or any object with "
        f"__dlpack__), got {type_name(x)}"
    )


# str() of a NumPy dtype costs microseconds, several times per call; dtypes are few and hashable.
_DTYPE_NAMES: dict = {}


def dtype_name(x) -> str:
    dtype = getattr(x, "dtype", "")
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        name = _DTYPE_NAMES[dtype] = str(dtype)
        return name
    except TypeError:  # an unhashable dtype object
        return str(dtype)


def is_numpy_bfloat16(x) -> bool:
    return isinstance(x, np.ndarray) and dtype_name(x) == "bfloat16"


class Frame:
    """One call's view of the caller's framework: exports inputs, allocates outputs, names the
    stream. Outputs are allocated on the device of q; the core checks every other device."""

    def __init__(self, arrays: dict, floats: tuple):
        names = list(arrays)
        first = names[0]
        for name, x in arrays.items():
            _checks.readable(name, x)
        self.kind = _kind(first, arrays[first])
        self.like = arrays[first]
        for name in names[1:]:
            kind = _kind(name, arrays[name])
            foreign = kind == "dlpack" and type(arrays[name]) is not type(self.like)
            if kind != self.kind or foreign:
                raise ValueError(
                    f"{name}: expected an array of the same framework as {first} "
                    f"({type_name(self.like)}), got {type_name(arrays[name])}; "
                    "flashdl does not mix frameworks"
                )
        # NumPy cannot export ml_dtypes bfloat16 over DLPack: such arrays (and the NumPy buffers
        # that hold JAX results) cross as uint16 views and the call names the dtype. Only then is
        # a genuine 16-bit integer array ambiguous, so it is refused here.
        # 16-bit integer arrays are refused among the float arrays whatever the others are: a
        # NumPy bfloat16 bias (flashdl.attention's extras) switches the reading on too.
        self.dtype = None
        if self.kind in ("numpy", "jax", "dlpack"):
            for n in floats:
                if dtype_name(arrays[n]) in ("int16", "uint16"):
                    raise TypeError(
                        f"{n}: unsupported dtype {dtype_name(arrays[n])} (expected "
                        "float16, bfloat16, float32 or float64)"
                    )
            if any(dtype_name(arrays[n]) == "bfloat16" for n in floats):
                self.dtype = "bfloat16"
        self._device = self._find_device()
        self.stream = self._find_stream()

    # ---- device and stream ------------------------------------------------------------------
    def _find_device(self):
        x = self.like
        if self.kind == "torch":
            return x.device
        if self.kind == "cupy":
            return x.device
        if self.kind == "jax":
            devices = list(x.devices())
            bad = [d for d in devices if d.platform != "cpu"]
            if bad:
                raise RuntimeError(
                    f"JAX arrays on {bad[0].platform} are not supported yet: "
                    "flashdl takes JAX arrays on the CPU only (use PyTorch or "
                    "CuPy arrays for the GPU)"
                )
            return devices[0]
        if self.kind == "dlpack":
            device_type, _ = x.__dlpack_device__()
            if int(device_type) != 1:
                raise TypeError(
                    f"{type_name(x)} arrays off the CPU are not supported: flashdl "
                    "allocates GPU outputs with PyTorch or CuPy only"
                )
        return None

    def _find_stream(self) -> int:
        if self.kind == "torch" and self._device.type == "cuda":
            return int(sys.modules["torch"].cuda.current_stream(self._device).cuda_stream)
        if self.kind == "cupy":
            cupy = sys.modules["cupy"]
            with self._device:
                return int(cupy.cuda.get_current_stream().ptr)
        return 0

    # ---- inputs -----------------------------------------------------------------------------
    def refuse_autograd(self, arrays: dict, api: str, instead: str):
        """ValueError naming the first torch tensor that requires grad while grad mode is on: the
        NumPy-level API returns plain tensors, so the caller's graph would silently end there.
        flashdl.torch's autograd Functions call the same API with grad mode off (torch disables
        it inside Function.forward), so they pass."""
        if self.kind != "torch" or not sys.modules["torch"].is_grad_enabled():
            return
        for name, x in arrays.items():
            if x.requires_grad:
                raise ValueError(
                    f"{name}: a tensor that requires grad was given to {api}, whose result has no "
                    f"autograd history (gradients would silently stop there); use {instead} for "
                    f"autograd, or pass {name}.detach() or call it under torch.no_grad()"
                )

    def export(self, x):
        """What the extension receives for an input: an object it can read over DLPack."""
        if self.kind == "torch":
            if x.requires_grad:
                x = x.detach()  # torch refuses to export tensors that require grad
            return _torch_capsule(x)
        if is_numpy_bfloat16(x):
            return x.view(np.uint16)
        return x

    # ---- outputs ----------------------------------------------------------------------------
    def empty(self, shape, dtype):
        """An output array in the caller's framework on the device of the first argument."""
        if self.kind == "numpy":  # shapes and dtypes from NumPy arrays: np.empty takes them as is
            return np.empty(shape, dtype=dtype)
        shape = tuple(int(s) for s in shape)
        if self.kind == "torch":
            return sys.modules["torch"].empty(shape, dtype=dtype, device=self._device)
        if self.kind == "cupy":
            with self._device:
                return sys.modules["cupy"].empty(shape, dtype=dtype)
        # NumPy, JAX (immutable: computed into NumPy buffers, wrapped by finish), other CPU arrays
        return np.empty(shape, dtype=_numpy_dtype(dtype))

    def float32(self):
        return sys.modules["torch"].float32 if self.kind == "torch" else np.float32

    def dest(self, out):
        """What the extension receives for an output."""
        if self.kind == "torch":
            return _torch_capsule(out)
        if is_numpy_bfloat16(out):
            return out.view(np.uint16)
        return out

    def finish(self, out):
        """The output as the caller's array type, on the caller's device."""
        if self.kind == "jax":
            return sys.modules["jax"].device_put(out, self._device)
        return out


def _torch_capsule(x):
    """A plain CPU torch tensor as a DLPack capsule (torch.utils.dlpack.to_dlpack, a C function):
    Tensor.__dlpack__ runs about 2 us of Python per array, several times a call, which is most of
    a tiny call's time. CUDA tensors and subclasses keep __dlpack__ (its stream handshake, their
    overrides)."""
    torch = sys.modules["torch"]
    if type(x) is torch.Tensor and x.is_cpu:
        return torch.utils.dlpack.to_dlpack(x)
    return x


def _numpy_dtype(dtype):
    """A NumPy dtype for a JAX or foreign dtype (JAX dtypes already are NumPy/ml_dtypes ones)."""
    try:
        return np.dtype(dtype)
    except TypeError:
        return np.dtype(str(dtype))
