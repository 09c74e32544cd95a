"""
flashdl's C++ core: exact FlashAttention over DLPack arrays (destination passing).
"""

from collections.abc import Sequence
from typing import Annotated

from numpy.typing import NDArray


def forward(q: Annotated[NDArray, dict(writable=False)], k: Annotated[NDArray, dict(writable=False)], v: Annotated[NDArray, dict(writable=False)], out: NDArray, lse: NDArray, *, dtype: str | None = None, softmax_scale: float | None = None, causal: bool = False, window_left: int = -1, window_right: int = -1, schedule: str = 'auto', dropout_p: float = 0.0, seed: int = 0, offset: int = 0, stream: int = 0, sram_bytes: int = 0, num_threads: int = 0, block_mask: Annotated[NDArray, dict(writable=False)] | None = None, block_size_q: int = 128, block_size_k: int = 128, alibi_slopes: Annotated[NDArray, dict(writable=False)] | None = None, softcap: float = 0.0, validate_only: bool = False, sinks: Annotated[NDArray, dict(writable=False)] | None = None, bias: Annotated[NDArray, dict(writable=False)] | None = None, mask: Annotated[NDArray, dict(writable=False)] | None = None, dropout_batch_offset: int = 0, dropout_head_offset: int = 0, dropout_nheads_total: int = 0) -> None:
    """
    Attention forward (validate_only: check the arguments, compute nothing): writes out (like q) and lse (float32, (batch, nheads, seqlen_q)).
    """

def forward_default(q: Annotated[NDArray, dict(writable=False)], k: Annotated[NDArray, dict(writable=False)], v: Annotated[NDArray, dict(writable=False)], out: NDArray, lse: NDArray | None, causal: bool) -> None:
    """
    forward with every option at its default but causal; lse None: not returned.
    """

def backward(dout: Annotated[NDArray, dict(writable=False)], q: Annotated[NDArray, dict(writable=False)], k: Annotated[NDArray, dict(writable=False)], v: Annotated[NDArray, dict(writable=False)], out: Annotated[NDArray, dict(writable=False)], lse: Annotated[NDArray, dict(writable=False)], dq: NDArray, dk: NDArray, dv: NDArray, *, dtype: str | None = None, softmax_scale: float | None = None, causal: bool = False, window_left: int = -1, window_right: int = -1, schedule: str = 'auto', dropout_p: float = 0.0, seed: int = 0, offset: int = 0, stream: int = 0, sram_bytes: int = 0, num_threads: int = 0, deterministic: bool = False, block_mask: Annotated[NDArray, dict(writable=False)] | None = None, block_size_q: int = 128, block_size_k: int = 128, alibi_slopes: Annotated[NDArray, dict(writable=False)] | None = None, softcap: float = 0.0, sinks: Annotated[NDArray, dict(writable=False)] | None = None, dsinks: NDArray | None = None, bias: Annotated[NDArray, dict(writable=False)] | None = None, mask: Annotated[NDArray, dict(writable=False)] | None = None, dbias: NDArray | None = None, dropout_batch_offset: int = 0, dropout_head_offset: int = 0, dropout_nheads_total: int = 0) -> None:
    """Attention backward: writes dq, dk, dv (shaped and typed like q, k, v)."""

def forward_varlen(q: Annotated[NDArray, dict(writable=False)], k: Annotated[NDArray, dict(writable=False)], v: Annotated[NDArray, dict(writable=False)], cu_seqlens_q: Annotated[NDArray, dict(writable=False)], cu_seqlens_k: Annotated[NDArray, dict(writable=False)], max_seqlen_q: int, max_seqlen_k: int, out: NDArray, lse: NDArray, *, dtype: str | None = None, softmax_scale: float | None = None, causal: bool = False, window_left: int = -1, window_right: int = -1, schedule: str = 'auto', dropout_p: float = 0.0, seed: int = 0, offset: int = 0, stream: int = 0, sram_bytes: int = 0, num_threads: int = 0, block_mask: Annotated[NDArray, dict(writable=False)] | None = None, block_size_q: int = 128, block_size_k: int = 128, alibi_slopes: Annotated[NDArray, dict(writable=False)] | None = None, softcap: float = 0.0, validate_only: bool = False, block_table: Annotated[NDArray, dict(writable=False)] | None = None, seqused_k: Annotated[NDArray, dict(writable=False)] | None = None, sinks: Annotated[NDArray, dict(writable=False)] | None = None, bias: Annotated[NDArray, dict(writable=False)] | None = None, mask: Annotated[NDArray, dict(writable=False)] | None = None) -> None:
    """
    Variable-length forward (validate_only: check the arguments but not the values of cu_seqlens, compute nothing): q (total_q, nheads, headdim), k, v (total_k, nheads_kv, headdim), cu_seqlens int32 (batch + 1,) on the CPU; writes out (like q) and lse (float32, (nheads, total_q)).
    """

def backward_varlen(dout: Annotated[NDArray, dict(writable=False)], q: Annotated[NDArray, dict(writable=False)], k: Annotated[NDArray, dict(writable=False)], v: Annotated[NDArray, dict(writable=False)], out: Annotated[NDArray, dict(writable=False)], lse: Annotated[NDArray, dict(writable=False)], cu_seqlens_q: Annotated[NDArray, dict(writable=False)], cu_seqlens_k: Annotated[NDArray, dict(writable=False)], max_seqlen_q: int, max_seqlen_k: int, dq: NDArray, dk: NDArray, dv: NDArray, *, dtype: str | None = None, softmax_scale: float | None = None, causal: bool = False, window_left: int = -1, window_right: int = -1, schedule: str = 'auto', dropout_p: float = 0.0, seed: int = 0, offset: int = 0, stream: int = 0, sram_bytes: int = 0, num_threads: int = 0, deterministic: bool = False, block_mask: Annotated[NDArray, dict(writable=False)] | None = None, block_size_q: int = 128, block_size_k: int = 128, alibi_slopes: Annotated[NDArray, dict(writable=False)] | None = None, softcap: float = 0.0, sinks: Annotated[NDArray, dict(writable=False)] | None = None, dsinks: NDArray | None = None, bias: Annotated[NDArray, dict(writable=False)] | None = None, mask: Annotated[NDArray, dict(writable=False)] | None = None, dbias: NDArray | None = None) -> None:
    """
    Variable-length backward: writes dq, dk, dv (shaped and typed like q, k, v).
    """

def forward_kvcache(q: Annotated[NDArray, dict(writable=False)], k_cache: Annotated[NDArray, dict(writable=False)], v_cache: Annotated[NDArray, dict(writable=False)], cache_seqlens: Annotated[NDArray, dict(writable=False)], k: Annotated[NDArray, dict(writable=False)] | None, v: Annotated[NDArray, dict(writable=False)] | None, block_table: Annotated[NDArray, dict(writable=False)] | None, out: NDArray, lse: NDArray, *, dtype: str | None = None, softmax_scale: float | None = None, causal: bool = False, window_left: int = -1, window_right: int = -1, num_splits: int = 0, stream: int = 0, num_threads: int = 0, alibi_slopes: Annotated[NDArray, dict(writable=False)] | None = None, softcap: float = 0.0, rotary_cos: Annotated[NDArray, dict(writable=False)] | None = None, rotary_sin: Annotated[NDArray, dict(writable=False)] | None = None, rotary_interleaved: bool = False, cache_batch_idx: Annotated[NDArray, dict(writable=False)] | None = None, cache_leftpad: Annotated[NDArray, dict(writable=False)] | None = None, sinks: Annotated[NDArray, dict(writable=False)] | None = None, bias: Annotated[NDArray, dict(writable=False)] | None = None, mask: Annotated[NDArray, dict(writable=False)] | None = None) -> None:
    """
    Attention over a KV cache: appends k, v (when given) to k_cache, v_cache at cache_seqlens, then writes out (like q) and lse (float32, (batch, nheads, seqlen_q)).
    """

def merge_states(outs: Sequence[Annotated[NDArray, dict(writable=False)]], lses: Sequence[Annotated[NDArray, dict(writable=False)]], out: NDArray, lse: NDArray, *, dtype: str | None = None, stream: int = 0) -> None:
    """
    Merges attention results over disjoint key sets: writes out and lse (CUDA arrays: on `stream`, a cudaStream_t as an int; 0: the legacy default stream).
    """

def dropout_mask(mask_out: NDArray, *, dropout_p: float, seed: int, offset: int = 0) -> None:
    """
    Writes the dropout keep-mask of (dropout_p, seed, offset) into mask_out, bool (batch, nheads, seqlen_q, seqlen_k).
    """

def xla_ffi_targets() -> list:
    """
    XLA FFI handlers of this build: a list of (target name, platform, PyCapsule).
    """

def build_info() -> dict:
    """What this build and machine offer."""

def set_num_threads(n: int) -> None:
    """CPU threads for later calls; 0 restores the default."""
