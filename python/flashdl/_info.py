"""What this build and machine offer, and the CPU thread count."""

from __future__ import annotations

from typing import TypedDict

from . import _checks, _ext


class Info(TypedDict):
    """What flashdl.info() returns (a plain dict at runtime)."""

    version: str
    backends: list[str]
    cuda_architectures: list[str]
    cuda_device_count: int
    cuda_status: str
    cpu_isa: str
    num_threads: int
    fa1_sram_bytes: int


def info() -> Info:
    """What this build and this machine offer.

    Returns
    -------
    dict
        ``version`` (str); ``backends`` (``["cpu"]`` or ``["cpu", "cuda"]``: compiled in);
        ``cuda_architectures`` (list of str, e.g. ``["80", "90"]``); ``cuda_device_count`` (int);
        ``cuda_status`` (str: why there is no device, if there is none -- "no NVIDIA GPU found", "no
        NVIDIA driver found, or one older than this build's CUDA runtime", or that the build has no
        CUDA backend -- with CUDA's own message in parentheses); ``cpu_isa`` (the CPU kernels in use:
        ``"avx512bf16"``, ``"avx512"``, ``"avx2"`` or ``"generic"``, the widest the CPU runs or the
        copy ``FLASHDL_CPU_ISA`` names); ``num_threads`` (CPU threads, int); ``fa1_sram_bytes``
        (int: the on-chip budget M of the CPU backend's fa1 schedule, in bytes).

    Examples
    --------
    >>> import flashdl
    >>> i = flashdl.info()
    >>> "cpu" in i["backends"], i["cpu_isa"] in ("avx512bf16", "avx512", "avx2", "generic")
    (True, True)
    """
    b = _ext.build_info()
    archs = [a for a in b["cuda_architectures"].replace(",", ";").split(";") if a]
    return {
        "version": b["version"],
        "backends": ["cpu", "cuda"] if b["cuda_compiled"] else ["cpu"],
        "cuda_architectures": archs,
        "cuda_device_count": b["cuda_device_count"],
        "cuda_status": b["cuda_status"],
        "cpu_isa": b["cpu_isa"],
        "num_threads": b["cpu_threads"],
        "fa1_sram_bytes": b["cpu_sram_bytes"],
    }


def set_num_threads(n: int) -> None:
    """Sets the CPU backend's thread count for later calls.

    Parameters
    ----------
    n : int
        Threads, >= 1; 0 restores the default (the environment variable ``FLASHDL_NUM_THREADS``, or
        the number of cores).

    Raises
    ------
    ValueError
        ``n < 0``.
    TypeError
        ``n`` not an int.

    Notes
    -----
    On the CPU, every result is bitwise reproducible for a given thread count.

    Examples
    --------
    >>> import flashdl
    >>> flashdl.set_num_threads(1)
    >>> flashdl.info()["num_threads"]
    1
    >>> flashdl.set_num_threads(0)                 # back to the default
    """
    # The core takes a C int: a larger one would otherwise reach nanobind's "incompatible
    # function arguments".
    _ext.set_num_threads(_checks.integer("n", n, "an int in [0, 2**31) (0: the default)", 0, 2**31))
