"""flashdl.attention_with_kvcache: attention for decoding, over a KV cache (contiguous or paged),
and flashdl.merge_states: exact merging of attention over disjoint key sets.

flash-attn's flash_attn_with_kvcache and vLLM's paged layout, any DLPack array in (NumPy,
PyTorch, JAX), the caller's array type out. The C++ core validates everything (src/kvcache.cpp)
before it writes the new keys and values into the cache.
"""

from __future__ import annotations

import numbers
import operator
import sys
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from . import _ext
from ._api import ArrayLike, _lse_shape, _options, _score_mods
from ._frameworks import Frame

def _index_array(name, x, required):
    """cache_seqlens and block_table: int32 CPU arrays (NumPy, or the framework of q); the core
    checks dtype, rank, shape, device and every value."""
    if x is None:
        if required:
            raise TypeError(f"{name}: expected an int32 array, got None")
        return None
    if isinstance(x, (list, tuple)):
        try:
            return np.asarray(x, dtype=np.int32)
        except (OverflowError, ValueError, TypeError) as err:
            raise ValueError(f"{name}: expected int32 values, got {x!r} ({err})") from None
    if isinstance(x, np.ndarray) or hasattr(x, "__dlpack__"):
        return x
    raise TypeError(f"{name}: expected an int32 array (NumPy or the framework of q), "
                    f"got {type(x).__name__}")


def _writable(name, x, frame_kind):
    """The cache is written when new keys are given: refuse arrays known to be read-only."""
    if frame_kind == "jax":
        raise TypeError(f"{name}: JAX arrays are immutable, so the cache cannot be appended to; "
                        "pass k=None and v=None (and write the cache with .at[].set()), or use "
                        "NumPy or PyTorch arrays")
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(f"{name}: the cache is read-only (NumPy writeable flag is False) but k "
                         "and v were given to append to it")
    if getattr(x, "requires_grad", False) and sys.modules["torch"].is_grad_enabled():
        raise ValueError(f"{name}: a cache that requires grad cannot be written in place; pass "
                         f"{name}.detach() or call under torch.no_grad()")


def attention_with_kvcache(q: ArrayLike, k_cache: ArrayLike, v_cache: ArrayLike, *,
                           cache_seqlens: ArrayLike, k: Optional[ArrayLike] = None,
                           v: Optional[ArrayLike] = None,
                           block_table: Optional[ArrayLike] = None, causal: bool = False,
                           softmax_scale: Optional[float] = None,
                           window_size: Tuple[int, int] = (-1, -1), num_splits: int = 0,
                           return_lse: bool = False, alibi_slopes: Optional[ArrayLike] = None,
                           softcap: float = 0.0) -> Any:
    """Attention of a few new queries over a KV cache (decoding), with an optional append.

    q: (batch, seqlen_q, nheads, headdim). k_cache, v_cache: (batch, seqlen_cache, nheads_kv,
    headdim), or paged: (num_pages, page_size, nheads_kv, headdim) with block_table, int32
    (batch, max_pages_per_sequence), naming each sequence's pages in order (vLLM's layout; only
    the pages a sequence uses are read, and must be valid). cache_seqlens: int32 (batch,), the
    tokens already in each sequence's cache. cache_seqlens and block_table are CPU arrays (NumPy,
    a list, or CPU tensors of the framework of q).

    k, v (batch, seqlen_new, nheads_kv, headdim), when given, are written into the caches at
    positions cache_seqlens[b] onward -- the one call where flashdl writes a caller's array.
    Everything is checked first (room in the cache, page indices, shapes), so a call that fails
    writes nothing. cache_seqlens itself is not changed: add seqlen_new to it for the next step.
    Sequence b then attends to its first cache_seqlens[b] + seqlen_new keys; causal and
    window_size are bottom-right aligned per sequence (query i sees key j <= i + L_b - seqlen_q).

    num_splits: key splits per (batch, kv head), computed in parallel and merged exactly
    (split-KV, "flash-decoding"); 0 chooses from the shape and the thread count. softmax_scale,
    alibi_slopes and softcap as in flashdl.attention. No dropout, no gradient (inference).

    Returns out (like q), or (out, lse) with return_lse=True, lse float32 (batch, nheads,
    seqlen_q). CUDA arrays (float16, bfloat16; PyTorch or CuPy): the append and the attention
    run on the device of q on the current stream (written, not yet run on a GPU);
    cache_seqlens and block_table stay host arrays, copied to the device on that stream.
    """
    if (k is None) != (v is None):
        raise ValueError(f"{'v' if k is not None else 'k'}: expected both k and v (the new keys "
                         "and values) or neither")
    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if k is not None:
        arrays.update(k=k, v=v)
    frame = Frame(arrays, tuple(arrays))
    if frame.kind == "torch" and sys.modules["torch"].is_grad_enabled() and q.requires_grad:
        raise ValueError("q: a tensor that requires grad was given to "
                         "flashdl.attention_with_kvcache, which has no backward (inference); "
                         "pass q.detach() or call it under torch.no_grad()")
    if k is not None:
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            _writable(name, x, frame.kind)
    if not isinstance(num_splits, numbers.Integral) or isinstance(num_splits, bool):
        raise TypeError(f"num_splits: expected an int >= 0, got {type(num_splits).__name__}")
    if not 0 <= num_splits < 2**63:
        raise ValueError(f"num_splits: expected an int >= 0 (0: chosen from the shape), "
                         f"got {num_splits}")
    opts = _options(causal, softmax_scale, "auto", window_size, frame)
    del opts["schedule"]
    opts.update(_score_mods(alibi_slopes, softcap))
    seqlens = _index_array("cache_seqlens", cache_seqlens, True)
    table = _index_array("block_table", block_table, False)
    out = frame.empty(q.shape, q.dtype)
    lse = frame.empty(_lse_shape(q), frame.float32())
    _ext.forward_kvcache(frame.export(q), frame.export(k_cache), frame.export(v_cache), seqlens,
                         None if k is None else frame.export(k),
                         None if v is None else frame.export(v), table, frame.dest(out),
                         frame.dest(lse), num_splits=operator.index(num_splits), **opts)
    out, lse = frame.finish(out), frame.finish(lse)
    return (out, lse) if return_lse else out


def merge_states(out_a: ArrayLike, lse_a: ArrayLike, out_b: ArrayLike, lse_b: ArrayLike
                 ) -> Tuple[ArrayLike, ArrayLike]:
    """(out, lse) of attention over the union of two disjoint key sets, from the results over
    each: out_a, out_b (batch, seqlen, nheads, headdim) and lse_a, lse_b float32 (batch, nheads,
    seqlen), as flashdl.attention(..., return_lse=True) returns them. Exact (the softmax
    decomposition): lse = log(exp(lse_a) + exp(lse_b)), out = exp(lse_a - lse) out_a +
    exp(lse_b - lse) out_b; a row with lse -inf (it saw no key) weighs nothing. CUDA arrays are
    merged on their device, on the current stream (written, not yet run on a GPU)."""
    return merge_states_list([out_a, out_b], [lse_a, lse_b])


def merge_states_list(outs: Sequence[ArrayLike], lses: Sequence[ArrayLike]
                      ) -> Tuple[ArrayLike, ArrayLike]:
    """merge_states over any number of partial results (outs[i], lses[i]), merged in order; the
    same merge the split-KV kernels apply."""
    if isinstance(outs, (str, bytes)) or not isinstance(outs, Sequence) or \
            not isinstance(lses, Sequence):
        raise TypeError("outs, lses: expected lists of arrays, got "
                        f"{type(outs).__name__} and {type(lses).__name__}")
    if len(outs) == 0:
        raise ValueError("outs: expected at least one partial result, got none")
    arrays = {f"outs[{i}]": o for i, o in enumerate(outs)}
    arrays.update({f"lses[{i}]": x for i, x in enumerate(lses)})
    frame = Frame(arrays, tuple(f"outs[{i}]" for i in range(len(outs))))
    first = outs[0]
    out = frame.empty(first.shape, first.dtype)
    lse = frame.empty(tuple(lses[0].shape), frame.float32()) if len(lses) else \
        frame.empty((0, 0, 0), frame.float32())
    _ext.merge_states([frame.export(o) for o in outs], [frame.export(x) for x in lses],
                      frame.dest(out), frame.dest(lse), dtype=frame.dtype, stream=frame.stream)
    return frame.finish(out), frame.finish(lse)
