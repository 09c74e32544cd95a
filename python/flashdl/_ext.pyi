# Type stub of flashdl._ext, the nanobind extension (python/bindings.cpp): keep in step with its
# m.def(...) signatures. Arrays are anything nanobind reads over DLPack or the buffer protocol
# (NumPy, PyTorch, JAX, CuPy); inputs are read only, outputs (out, lse, dq, dk, dv, dbias, dsinks,
# mask_out) are written in place. Validation is the core's: it raises ValueError, TypeError,
# RuntimeError or NotImplementedError.

from typing import Any, List, Optional

_Array = Any

def forward_default(
    q: _Array, k: _Array, v: _Array, out: _Array, lse: Optional[_Array], causal: bool
) -> None: ...
def forward(
    q: _Array,
    k: _Array,
    v: _Array,
    out: _Array,
    lse: _Array,
    *,
    dtype: Optional[str] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    schedule: str = "auto",
    dropout_p: float = 0.0,
    seed: int = 0,
    offset: int = 0,
    stream: int = 0,
    sram_bytes: int = 0,
    num_threads: int = 0,
    block_mask: Optional[_Array] = None,
    block_size_q: int = 128,
    block_size_k: int = 128,
    alibi_slopes: Optional[_Array] = None,
    softcap: float = 0.0,
    validate_only: bool = False,
    sinks: Optional[_Array] = None,
    bias: Optional[_Array] = None,
    mask: Optional[_Array] = None,
    dropout_batch_offset: int = 0,
    dropout_head_offset: int = 0,
    dropout_nheads_total: int = 0,
) -> None:
    """Attention forward (validate_only: check the arguments, compute nothing): writes out (like
    q) and lse (float32, (batch, nheads, seqlen_q))."""

def backward(
    dout: _Array,
    q: _Array,
    k: _Array,
    v: _Array,
    out: _Array,
    lse: _Array,
    dq: _Array,
    dk: _Array,
    dv: _Array,
    *,
    dtype: Optional[str] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    schedule: str = "auto",
    dropout_p: float = 0.0,
    seed: int = 0,
    offset: int = 0,
    stream: int = 0,
    sram_bytes: int = 0,
    num_threads: int = 0,
    deterministic: bool = False,
    block_mask: Optional[_Array] = None,
    block_size_q: int = 128,
    block_size_k: int = 128,
    alibi_slopes: Optional[_Array] = None,
    softcap: float = 0.0,
    sinks: Optional[_Array] = None,
    dsinks: Optional[_Array] = None,
    bias: Optional[_Array] = None,
    mask: Optional[_Array] = None,
    dbias: Optional[_Array] = None,
    dropout_batch_offset: int = 0,
    dropout_head_offset: int = 0,
    dropout_nheads_total: int = 0,
) -> None:
    """Attention backward: writes dq, dk, dv (shaped and typed like q, k, v)."""

def forward_varlen(
    q: _Array,
    k: _Array,
    v: _Array,
    cu_seqlens_q: _Array,
    cu_seqlens_k: _Array,
    max_seqlen_q: int,
    max_seqlen_k: int,
    out: _Array,
    lse: _Array,
    *,
    dtype: Optional[str] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    schedule: str = "auto",
    dropout_p: float = 0.0,
    seed: int = 0,
    offset: int = 0,
    stream: int = 0,
    sram_bytes: int = 0,
    num_threads: int = 0,
    block_mask: Optional[_Array] = None,
    block_size_q: int = 128,
    block_size_k: int = 128,
    alibi_slopes: Optional[_Array] = None,
    softcap: float = 0.0,
    validate_only: bool = False,
    sinks: Optional[_Array] = None,
    bias: Optional[_Array] = None,
    mask: Optional[_Array] = None,
) -> None:
    """Variable-length forward (validate_only: check the arguments but not the values of
    cu_seqlens, compute nothing): writes out (like q) and lse (float32, (nheads, total_q))."""

def backward_varlen(
    dout: _Array,
    q: _Array,
    k: _Array,
    v: _Array,
    out: _Array,
    lse: _Array,
    cu_seqlens_q: _Array,
    cu_seqlens_k: _Array,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dq: _Array,
    dk: _Array,
    dv: _Array,
    *,
    dtype: Optional[str] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    schedule: str = "auto",
    dropout_p: float = 0.0,
    seed: int = 0,
    offset: int = 0,
    stream: int = 0,
    sram_bytes: int = 0,
    num_threads: int = 0,
    deterministic: bool = False,
    block_mask: Optional[_Array] = None,
    block_size_q: int = 128,
    block_size_k: int = 128,
    alibi_slopes: Optional[_Array] = None,
    softcap: float = 0.0,
    sinks: Optional[_Array] = None,
    dsinks: Optional[_Array] = None,
    bias: Optional[_Array] = None,
    mask: Optional[_Array] = None,
    dbias: Optional[_Array] = None,
) -> None:
    """Variable-length backward: writes dq, dk, dv (shaped and typed like q, k, v)."""

def forward_kvcache(
    q: _Array,
    k_cache: _Array,
    v_cache: _Array,
    cache_seqlens: _Array,
    k: Optional[_Array],
    v: Optional[_Array],
    block_table: Optional[_Array],
    out: _Array,
    lse: _Array,
    *,
    dtype: Optional[str] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    num_splits: int = 0,
    stream: int = 0,
    num_threads: int = 0,
    alibi_slopes: Optional[_Array] = None,
    softcap: float = 0.0,
    rotary_cos: Optional[_Array] = None,
    rotary_sin: Optional[_Array] = None,
    rotary_interleaved: bool = False,
    cache_batch_idx: Optional[_Array] = None,
    cache_leftpad: Optional[_Array] = None,
    sinks: Optional[_Array] = None,
    bias: Optional[_Array] = None,
    mask: Optional[_Array] = None,
) -> None:
    """Attention over a KV cache: appends k, v (when given) to k_cache, v_cache at cache_seqlens,
    then writes out (like q) and lse (float32, (batch, nheads, seqlen_q))."""

def merge_states(
    outs: List[_Array],
    lses: List[_Array],
    out: _Array,
    lse: _Array,
    *,
    dtype: Optional[str] = None,
    stream: int = 0,
) -> None:
    """Merges attention results over disjoint key sets: writes out and lse (CUDA arrays: on
    `stream`, a cudaStream_t as an int; 0: the legacy default stream)."""

def dropout_mask(mask_out: _Array, *, dropout_p: float, seed: int, offset: int = 0) -> None:
    """Writes the dropout keep-mask of (dropout_p, seed, offset) into mask_out, bool
    (batch, nheads, seqlen_q, seqlen_k)."""

def build_info() -> dict[str, Any]:
    """What this build and machine offer: version (str), cuda_compiled (bool),
    cuda_architectures (str), cuda_device_count (int), cuda_status (str), cpu_isa (str),
    cpu_threads (int), cpu_sram_bytes (int)."""

def set_num_threads(n: int) -> None:
    """CPU threads for later calls; 0 restores the default."""
