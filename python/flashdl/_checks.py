"""Type checks of scalar and array arguments that every front end shares, before anything reaches
the extension. They check what Python alone can see (that a flag is a bool, an integer an int,
that an array is one the extension can read); values (ranges, finiteness of a scale) stay the
core's checks, with the one exception of NaN, which the Python layers use as "default".

Every refusal names the argument in the caller's terms and says what was expected.
"""

from __future__ import annotations

import math
import numbers
import operator
import sys

import numpy as np


def describe(x) -> str:
    """A short description of a value for a message: its type, and the value when it is short."""
    t = type(x)
    name = t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    if is_tracer(x):
        return f"a traced JAX value ({name})"
    text = repr(x)
    return f"{name} {text}" if len(text) <= 40 else name


def is_tracer(x) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.core.Tracer)


def _static_hint(name, x) -> str:
    return (
        f"; {name} must be a static Python value (mark it static in jax.jit, e.g. static_argnames)"
        if is_tracer(x)
        else ""
    )


def flag(name: str, x) -> bool:
    """A bool flag: Python's bool or NumPy's bool_. Anything else (a string, an int, None) is a
    TypeError naming the argument: `causal='no'` is true in Python, and is refused rather than
    read as True. ints are refused too, 0 and 1 included, so that every flag reads the same."""
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    raise TypeError(
        f"{name}: expected a bool (True or False), got {describe(x)}" + _static_hint(name, x)
    )


def real(name: str, x, expected: str) -> float:
    """A real number as a float: int or float (Python's, NumPy's), never a bool, a string or an
    array. NaN and infinities pass as floats; the core refuses them by name."""
    if type(x) is float:  # the common case, without the ABC check below
        return x
    if type(x) is not int and (isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real)):
        raise TypeError(f"{name}: expected {expected}, got {describe(x)}" + _static_hint(name, x))
    try:
        return float(x)
    except OverflowError:  # an int (or a Fraction) beyond float64's range
        what = f"an int of {x.bit_length()} bits" if isinstance(x, int) else describe(x)
        raise ValueError(
            f"{name}: expected {expected}, got {what}, beyond the range of a float"
        ) from None


def finite(name: str, x: float, expected: str) -> float:
    """x itself when finite; ValueError naming the argument for NaN and infinities (for values
    the Python layers would otherwise read as a default)."""
    if not math.isfinite(x):
        raise ValueError(f"{name}: expected {expected}, got {x}")
    return x


def integer(name: str, x, expected: str, lo: int = -(2**63), hi: int = 2**63) -> int:
    """An int in [lo, hi): Python's or NumPy's ints (anything with __index__ but a bool).
    TypeError for other types (a float is refused, never truncated), ValueError out of range."""
    if type(x) is int and lo <= x < hi:  # the common case, without the checks below
        return x
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name}: expected {expected}, got {describe(x)}")
    try:
        value = operator.index(x)
    except TypeError:
        raise TypeError(
            f"{name}: expected {expected}, got {describe(x)}" + _static_hint(name, x)
        ) from None
    if not lo <= value < hi:
        raise ValueError(f"{name}: expected {expected}, got {value}")
    return value


# NumPy dtype kinds the extension can read over DLPack: bool, ints, unsigned ints, floats and
# complex numbers of the native byte order; the core then says which of them a call takes.
_DLPACK_KINDS = "biufc"
# Dtype names (torch's and JAX's) that cross DLPack into the extension.
_DLPACK_NAMES = frozenset(
    (
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "complex64",
        "complex128",
    )
)


# NumPy dtypes readable() has accepted: the verdict depends on the dtype alone (alignment is
# checked per array).
_READABLE_NUMPY: set = set()
_READABLE_TORCH: set = set()  # torch dtypes that cross DLPack


def readable(name: str, x) -> None:
    """Refuses an array the extension cannot read, naming it, where nanobind would raise its
    generic "incompatible function arguments": NumPy arrays of a non-native byte order, of
    object, string, datetime or structured dtypes, long doubles, misaligned data; torch
    tensors that are sparse, on the meta device, or of a quantized dtype."""
    if isinstance(x, np.ndarray):
        dtype = x.dtype
        if dtype in _READABLE_NUMPY:  # checked before (str(dtype) alone costs microseconds)
            if not x.flags.aligned:
                raise ValueError(
                    f"{name}: the array's data is not aligned to its {dtype} "
                    f"elements; pass an aligned copy ({name}.copy())"
                )
            return
        if str(dtype) == "bfloat16":  # ml_dtypes: crosses as a uint16 view (Frame.export)
            _READABLE_NUMPY.add(dtype)
            return readable(name, x)  # the alignment check above, also on the first call
        if (
            dtype.kind not in _DLPACK_KINDS
            or (dtype.kind == "f" and dtype.itemsize > 8)
            or (dtype.kind == "c" and dtype.itemsize > 16)
        ):
            raise TypeError(
                f"{name}: unsupported dtype {dtype} (a NumPy dtype that cannot "
                "cross DLPack; expected float16, bfloat16, float32 or float64 "
                "for q, k, v; int32 or bool for index and mask arrays)"
            )
        if not dtype.isnative:
            raise TypeError(
                f"{name}: unsupported dtype {dtype.str} (non-native byte order); "
                f"convert it with {name}.astype({name}.dtype.newbyteorder('='))"
            )
        if not x.flags.aligned:
            raise ValueError(
                f"{name}: the array's data is not aligned to its {dtype} elements; "
                f"pass an aligned copy ({name}.copy())"
            )
        _READABLE_NUMPY.add(dtype)
        return
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if torch.compiler.is_compiling():
            return  # fake tensors under torch.compile: the op checks the real ones when it runs
        if x.layout != torch.strided:
            raise TypeError(
                f"{name}: expected a dense (strided) tensor, got layout {x.layout}; "
                f"pass {name}.to_dense()"
            )
        if x.is_meta:
            raise ValueError(
                f"{name}: a tensor on the meta device holds no data to compute "
                "with; flashdl.torch traces meta and fake tensors, this entry point "
                "computes"
            )
        if x.is_quantized:
            raise TypeError(f"{name}: unsupported dtype {x.dtype} (quantized); dequantize it first")
        if x.dtype not in _READABLE_TORCH:
            if str(x.dtype).split(".")[-1] not in _DLPACK_NAMES:
                raise TypeError(
                    f"{name}: unsupported dtype {x.dtype} (expected float16, "
                    "bfloat16, float32 or float64 for q, k, v; int32 or bool for "
                    "index and mask tensors)"
                )
            _READABLE_TORCH.add(x.dtype)
        if x.is_conj() or x.is_neg():
            raise TypeError(
                f"{name}: a tensor with a lazy conjugate or negative bit; pass "
                f"{name}.resolve_conj().resolve_neg()"
            )
        return
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, jax.Array) and not is_tracer(x):
        if str(x.dtype) not in _DLPACK_NAMES:
            raise TypeError(
                f"{name}: unsupported dtype {x.dtype} (expected float16, bfloat16, "
                "float32 or float64 for q, k, v; int32 or bool for index and mask "
                "arrays)"
            )
