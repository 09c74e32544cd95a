"""What this build and machine offer, and the CPU thread count."""

from __future__ import annotations

import operator
from typing import TypedDict

from . import _ext


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
    """Version, backends compiled in, CUDA architectures and devices, CPU ISA, threads and the fa1
    on-chip budget M (bytes) of the CPU backend."""
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
    """CPU threads for later calls; 0 restores the default (FLASHDL_NUM_THREADS or the cores)."""
    try:
        n = operator.index(n)
    except TypeError:
        raise TypeError(f"n: expected an int, got {type(n).__name__}") from None
    _ext.set_num_threads(n)
