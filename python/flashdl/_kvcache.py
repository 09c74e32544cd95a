"""flashdl.attention_with_kvcache: attention for decoding, over a KV cache (contiguous or paged),
and flashdl.merge_states: exact merging of attention over disjoint key sets.

flash-attn's flash_attn_with_kvcache and vLLM's paged layout, any DLPack array in (NumPy,
PyTorch, JAX), the caller's array type out. The C++ core validates everything (src/kvcache.cpp)
before it writes the new keys and values into the cache.
"""

from __future__ import annotations

import operator
import re
import sys
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from . import _args, _checks, _ext
from ._args import ArrayLike
from ._frameworks import Frame


def _index_array(name, x, required):
    """cache_seqlens and block_table: int32 CPU arrays (NumPy, or the framework of q; integer
    arrays and lists of ints are narrowed to int32 when their values fit); the core checks dtype,
    rank, shape, device and every value."""
    if x is None:
        if required:
            raise TypeError(f"{name}: expected an int32 array, got None")
        return None
    if isinstance(x, (list, tuple)):
        try:
            values = np.asarray(x)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{name}: expected a list of ints, got {x!r} ({err})") from None
        if values.size and values.dtype.kind not in "iu":
            raise TypeError(f"{name}: expected a list of ints, got {x!r}")
        return _args.int32_index(name, values.astype(np.int64))
    if isinstance(x, np.ndarray) or hasattr(x, "__dlpack__"):
        return _args.int32_index(name, x)
    raise TypeError(
        f"{name}: expected an int32 array (NumPy or the framework of q), got {type(x).__name__}"
    )


def _writable(name, x, frame_kind):
    """The cache is written when new keys are given: refuse arrays known to be read-only."""
    if frame_kind == "jax":
        raise TypeError(
            f"{name}: JAX arrays are immutable, so the cache cannot be appended to; "
            "pass k=None and v=None (and write the cache with .at[].set()), or use "
            "NumPy or PyTorch arrays"
        )
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(
            f"{name}: the cache is read-only (NumPy writeable flag is False) but k "
            "and v were given to append to it"
        )
    if getattr(x, "requires_grad", False) and sys.modules["torch"].is_grad_enabled():
        raise ValueError(
            f"{name}: a cache that requires grad cannot be written in place; pass "
            f"{name}.detach() or call under torch.no_grad()"
        )


def attention_with_kvcache(
    q: ArrayLike,
    k_cache: ArrayLike,
    v_cache: ArrayLike,
    *,
    cache_seqlens: ArrayLike,
    k: Optional[ArrayLike] = None,
    v: Optional[ArrayLike] = None,
    block_table: Optional[ArrayLike] = None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: Tuple[int, int] = (-1, -1),
    num_splits: int = 0,
    return_lse: bool = False,
    alibi_slopes: Optional[ArrayLike] = None,
    softcap: float = 0.0,
    layout: str = "bshd",
    rotary_cos: Optional[ArrayLike] = None,
    rotary_sin: Optional[ArrayLike] = None,
    rotary_interleaved: bool = False,
    cache_batch_idx: Optional[ArrayLike] = None,
    cache_leftpad: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None,
    bias: Optional[ArrayLike] = None,
    mask: Optional[ArrayLike] = None,
) -> Any:
    """Attention of a few new queries over a KV cache (decoding), with an optional in-place append.

    flash-attn's ``flash_attn_with_kvcache``, with vLLM's paged layout. Sequence ``b`` attends to
    the first ``cache_seqlens[b] + seqlen_new`` keys of its cache; ``causal`` and ``window_size``
    are bottom-right aligned per sequence (query ``i`` sees key ``j <= i + L_b - seqlen_q``, with
    ``L_b`` that number of keys). No dropout and no gradient (inference).

    Parameters
    ----------
    q : array (batch, seqlen_q, nheads, headdim)
        The new queries.
    k_cache, v_cache : array
        Contiguous: (batch_cache, seqlen_cache, nheads_kv, headdim), sequence ``b`` in row
        ``b`` (rows past the batch of q untouched) or in row ``cache_batch_idx[b]``. Paged (with
        ``block_table``):
        (num_pages, page_size, nheads_kv, headdim), any page size. The dtype and device of q.
    cache_seqlens : int32 array (batch,)
        Tokens already in each sequence's cache. A host array (NumPy, a list, or a CPU tensor of the
        framework of q), also for CUDA q (then copied to the device on the current stream). Not
        changed by the call: add ``seqlen_new`` to it for the next step.
    k, v : array (batch, seqlen_new, nheads_kv, headdim), optional
        New keys and values, written into the caches at positions ``cache_seqlens[b]`` onward --
        the one call where flashdl writes a caller's array. Everything is checked first (room in the
        cache, page indices, shapes), so a call that fails writes nothing. Both or neither.
    block_table : int32 array (batch, max_pages_per_sequence), optional
        Paged caches: each sequence's pages, in order (vLLM's layout; only the pages a sequence uses
        are read, and they must be valid). A host array, as ``cache_seqlens``.
    causal, softmax_scale, window_size, alibi_slopes, softcap : optional
        As in :func:`attention`.
    rotary_cos, rotary_sin : array (seqlen_ro, rotary_dim / 2), optional
        Rotary embedding fused into the call (flash-attn's): the dtype and device of q,
        ``rotary_dim`` even and <= headdim. The first ``rotary_dim`` columns of the new keys are
        rotated at positions ``cache_seqlens[b] + row`` before they are written (the cache holds
        rotated keys); those of q at ``cache_seqlens[b] + row`` when ``causal`` or windowed (a
        window side below the cache's capacity, as flash-attn decides it), else every row of q
        at ``cache_seqlens[b]``. Positions count from cache position 0, also
        with ``cache_leftpad``. Both or neither.
    rotary_interleaved : bool, default False
        True: columns (2i, 2i + 1) rotate together (GPT-J); False: (i, i + rotary_dim / 2)
        (GPT-NeoX). flash-attn's ``flash_attn_with_kvcache`` defaults to True.
    cache_batch_idx : int32 array (batch,), optional
        Contiguous caches: sequence ``b`` reads (and appends to) cache row ``cache_batch_idx[b]``,
        so the caches may hold more rows than q has sequences. Values in range and, when k and v
        are appended, distinct. A host array, as ``cache_seqlens``.
    cache_leftpad : int32 array (batch,), optional
        The cache positions of sequence ``b`` before ``cache_leftpad[b]`` (<= cache_seqlens[b])
        hold no token: they are invisible, and causal, windows and ALiBi count keys from there.
        A host array.
    sinks : float32 array (nheads,), optional
        Attention sinks (gpt-oss), as in :func:`attention`: one logit per query head that joins
        each row's softmax denominator once (after the key splits are merged) and carries no
        value; lse includes it. On CUDA arrays the decode kernel adds it (checked on the CUDA
        host emulator, not yet run on a GPU; a NaN sink there is not refused).
    bias : float array, optional
        An additive bias, as in :func:`attention` (float32, float16 or bfloat16, read in place),
        broadcastable to ``(batch, nheads, seqlen_q, seqlen_cache)`` -- ``max_pages * page_size``
        in place of ``seqlen_cache`` for a paged cache: the key axis is the key's position in its
        sequence's cache (with ``cache_leftpad``, from cache position 0, so a mask over the
        cache's slots lines up), of which each row reads only the keys it sees. Applied after
        scale, softcap and ALiBi. On CUDA arrays: the decode kernel (checked on the CUDA host
        emulator, not yet run on a GPU).
    mask : bool array, optional
        A boolean mask (True = keep) with the bias's shapes: a key it hides is invisible to the
        row (NaN or Inf in its K, V or bias included); a row that keeps no key gets out 0 and lse
        -inf (or the sink).
    num_splits : int, default 0
        Key splits per (batch, kv head), computed in parallel and merged exactly (split-KV,
        "flash-decoding"); 0 chooses from the shape and the thread count.
    return_lse : bool, default False
        Also return the log-sum-exp.
    layout : {"bshd", "bhsd"}, default "bshd"
        ``"bhsd"``: q, k, v and out are (batch, nheads, seqlen, headdim), and the caches
        (batch, nheads_kv, seqlen_cache, headdim) (Hugging Face's cache layout), or paged
        (num_pages, nheads_kv, page_size, headdim); read, and the caches written, through transposed
        views, with no copy.

    Returns
    -------
    out : array (batch, seqlen_q, nheads, headdim)
        Like q.
    lse : float32 array (batch, nheads, seqlen_q)
        With ``return_lse=True``.

    Raises
    ------
    ValueError
        Shapes that do not fit, no room in the cache for ``k``, ``v``, a page index out of range, a
        read-only cache to append to, only one of ``k`` and ``v``, a q that requires grad,
        ``cache_batch_idx`` out of range or repeated where k and v are appended, rotary tables
        too short for the positions. A refused call leaves the caches unchanged.
    TypeError
        An argument of the wrong type (e.g. a non-integer ``num_splits``).

    Notes
    -----
    The CPU kernel reads each K/V row once per kv head for all query heads of its GQA group, in
    place. CUDA arrays (float16, bfloat16; PyTorch or CuPy): the append and the attention run on the
    device of q on the current stream (tests pass on an H100); rotary tables on the device
    of q, the index arrays on the host (copied over).

    Examples
    --------
    >>> import numpy as np, flashdl
    >>> k_cache = np.zeros((2, 16, 1, 8), np.float32)            # (batch, seqlen_cache, hkv, d)
    >>> v_cache = np.zeros((2, 16, 1, 8), np.float32)
    >>> lens = np.array([3, 5], np.int32)                        # tokens already cached
    >>> q = np.random.randn(2, 1, 4, 8).astype(np.float32)       # one new token, 4 query heads
    >>> k_new, v_new = (np.random.randn(2, 1, 1, 8).astype(np.float32) for _ in range(2))
    >>> out = flashdl.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
    ...                                      k=k_new, v=v_new, causal=True)
    >>> out.shape, bool((k_cache[1, 5] == k_new[1, 0]).all())   # appended at position 5
    ((2, 1, 4, 8), True)
    """
    if (k is None) != (v is None):
        raise ValueError(
            f"{'v' if k is not None else 'k'}: expected both k and v (the new keys "
            "and values) or neither"
        )
    return_lse = _checks.flag("return_lse", return_lse)
    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if k is not None:
        arrays.update(k=k, v=v)
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError(
            f"{'rotary_sin' if rotary_cos is not None else 'rotary_cos'}: expected "
            "both rotary_cos and rotary_sin or neither"
        )
    if rotary_cos is not None:
        arrays.update(rotary_cos=rotary_cos, rotary_sin=rotary_sin)
    rotary_interleaved = _checks.flag("rotary_interleaved", rotary_interleaved)
    frame = Frame(arrays, tuple(arrays))
    if frame.kind == "torch" and sys.modules["torch"].is_grad_enabled() and q.requires_grad:
        raise ValueError(
            "q: a tensor that requires grad was given to "
            "flashdl.attention_with_kvcache, which has no backward (inference); "
            "pass q.detach() or call it under torch.no_grad()"
        )
    if k is not None:
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            _writable(name, x, frame.kind)
    num_splits = _checks.integer(
        "num_splits", num_splits, "an int >= 0 (0: chosen from the shape)", 0, 2**63
    )
    bhsd = _args.is_heads_first(layout)
    opts = _args.options(causal, softmax_scale, "auto", window_size, frame)
    del opts["schedule"]
    opts.update(_args.score_mods(alibi_slopes, softcap))
    opts.update(_args.extras(sinks, bias, mask))
    seqlens = _index_array("cache_seqlens", cache_seqlens, True)
    table = _index_array("block_table", block_table, False)
    batch_idx = _index_array("cache_batch_idx", cache_batch_idx, False)
    leftpad = _index_array("cache_leftpad", cache_leftpad, False)
    errors = _args.LayoutErrors(
        (q, k_cache, v_cache),
        bhsd,
        same_batch=block_table is None and cache_batch_idx is None,
        names="q, k_cache, v_cache",
    )
    if bhsd:
        q, k_cache, v_cache = (
            _args.as_bshd(n, x) for n, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache))
        )
        if k is not None:
            k, v = _args.as_bshd("k", k), _args.as_bshd("v", v)
    out, out_view = _args.output_like(frame, q, bhsd)
    lse = frame.empty(_args.lse_shape(q), frame.float32())
    with errors:
        _ext.forward_kvcache(
            frame.export(q),
            frame.export(k_cache),
            frame.export(v_cache),
            seqlens,
            None if k is None else frame.export(k),
            None if v is None else frame.export(v),
            table,
            frame.dest(out_view),
            frame.dest(lse),
            num_splits=operator.index(num_splits),
            rotary_cos=None if rotary_cos is None else frame.export(rotary_cos),
            rotary_sin=None if rotary_sin is None else frame.export(rotary_sin),
            rotary_interleaved=rotary_interleaved,
            cache_batch_idx=batch_idx,
            cache_leftpad=leftpad,
            **opts,
        )
    out, lse = frame.finish(out), frame.finish(lse)
    return (out, lse) if return_lse else out


def merge_states(
    out_a: ArrayLike, lse_a: ArrayLike, out_b: ArrayLike, lse_b: ArrayLike, *, layout: str = "bshd"
) -> Tuple[ArrayLike, ArrayLike]:
    """``(out, lse)`` of attention over the union of two disjoint key sets, from the results over each.

    Exact (the softmax decomposition): ``lse = log(exp(lse_a) + exp(lse_b))`` and
    ``out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b``; a row with lse -inf (it saw no
    key) weighs nothing. The merge that split-KV decoding and ring attention use.

    Parameters
    ----------
    out_a, out_b : array (batch, seqlen, nheads, headdim)
        Outputs over each key set, as ``flashdl.attention(..., return_lse=True)`` returns them.
    lse_a, lse_b : float32 array (batch, nheads, seqlen)
        Their log-sum-exps.
    layout : {"bshd", "bhsd"}, default "bshd"
        "bhsd": the outputs are (batch, nheads, seqlen, headdim), read through transposed
        views, and ``out`` is returned in that layout; lse is (batch, nheads, seqlen) either way.

    Returns
    -------
    out : array (batch, seqlen, nheads, headdim)
        The dtype of ``out_a``.
    lse : float32 array (batch, nheads, seqlen)

    Raises
    ------
    ValueError
        Shapes, dtypes or devices that do not match.
    TypeError
        Arguments that are not arrays.

    Notes
    -----
    CUDA arrays are merged on their device, on the current stream (tests pass on an H100).

    Examples
    --------
    >>> import numpy as np, flashdl
    >>> q = np.random.randn(1, 2, 1, 8).astype(np.float32)
    >>> k, v = (np.random.randn(1, 10, 1, 8).astype(np.float32) for _ in range(2))
    >>> a = flashdl.attention(q, k[:, :6], v[:, :6], return_lse=True)
    >>> b = flashdl.attention(q, k[:, 6:], v[:, 6:], return_lse=True)
    >>> out, lse = flashdl.merge_states(*a, *b)
    >>> bool(np.allclose(out, flashdl.attention(q, k, v), atol=1e-6))
    True
    """
    try:
        return merge_states_list([out_a, out_b], [lse_a, lse_b], layout=layout)
    except (ValueError, TypeError) as err:
        # merge_states_list names its arguments outs[i], lses[i]: these are out_a, lse_a, ...
        msg = re.sub(
            r"\b(outs|lses)\[([01])\]",
            lambda m: ("out_" if m[1] == "outs" else "lse_") + "ab"[int(m[2])],
            str(err),
        )
        if msg == str(err):
            raise
        raise type(err)(msg) from None


def merge_states_list(
    outs: Sequence[ArrayLike], lses: Sequence[ArrayLike], *, layout: str = "bshd"
) -> Tuple[ArrayLike, ArrayLike]:
    """:func:`merge_states` over any number of partial results, merged in order.

    The same merge the split-KV kernels apply.

    Parameters
    ----------
    outs : sequence of arrays (batch, seqlen, nheads, headdim)
        Outputs over disjoint key sets.
    lses : sequence of float32 arrays (batch, nheads, seqlen)
        Their log-sum-exps, one per output.
    layout : {"bshd", "bhsd"}, default "bshd"
        As in :func:`merge_states`.

    Returns
    -------
    out : array (batch, seqlen, nheads, headdim)
    lse : float32 array (batch, nheads, seqlen)

    Raises
    ------
    ValueError
        No partial result, or shapes, dtypes or devices that do not match.
    TypeError
        ``outs`` or ``lses`` not a list (or tuple) of arrays.

    Examples
    --------
    >>> import numpy as np, flashdl
    >>> q = np.random.randn(1, 2, 1, 8).astype(np.float32)
    >>> k, v = (np.random.randn(1, 12, 1, 8).astype(np.float32) for _ in range(2))
    >>> parts = [flashdl.attention(q, k[:, i:i + 4], v[:, i:i + 4], return_lse=True)
    ...          for i in (0, 4, 8)]
    >>> out, lse = flashdl.merge_states_list([o for o, _ in parts], [l for _, l in parts])
    >>> bool(np.allclose(out, flashdl.attention(q, k, v), atol=1e-6))
    True
    """
    if (
        isinstance(outs, (str, bytes))
        or not isinstance(outs, Sequence)
        or not isinstance(lses, Sequence)
    ):
        raise TypeError(
            "outs, lses: expected lists of arrays, got "
            f"{type(outs).__name__} and {type(lses).__name__}"
        )
    if len(outs) == 0:
        raise ValueError("outs: expected at least one partial result, got none")
    arrays = {f"outs[{i}]": o for i, o in enumerate(outs)}
    arrays.update({f"lses[{i}]": x for i, x in enumerate(lses)})
    bhsd = _args.is_heads_first(layout)
    frame = Frame(arrays, tuple(f"outs[{i}]" for i in range(len(outs))))
    # out is allocated like outs[0]: a wrongly ranked one is named here, not as out.
    shape0 = tuple(getattr(outs[0], "shape", ()))
    if len(shape0) != 4:
        axes = "(batch, nheads, seqlen, headdim)" if bhsd else "(batch, seqlen, nheads, headdim)"
        raise ValueError(f"outs[0]: expected rank 4 {axes}, got shape {shape0}")
    if bhsd:
        outs = [_args.as_bshd(f"outs[{i}]", o) for i, o in enumerate(outs)]
    out, out_view = _args.output_like(frame, outs[0], bhsd)
    lse = (
        frame.empty(tuple(lses[0].shape), frame.float32())
        if len(lses)
        else frame.empty((0, 0, 0), frame.float32())
    )
    with _args.LayoutErrors((), bhsd):
        _ext.merge_states(
            [frame.export(o) for o in outs],
            [frame.export(x) for x in lses],
            frame.dest(out_view),
            frame.dest(lse),
            dtype=frame.dtype,
            stream=frame.stream,
        )
    return frame.finish(out), frame.finish(lse)
