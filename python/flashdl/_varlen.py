"""flashdl.attention_varlen and attention_varlen_backward: batches of sequences of different lengths
packed with no padding (flash-attn's varlen layout), any DLPack array in, the caller's array type out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Literal, Optional, Tuple, overload

import numpy as np

from . import _args, _checks, _ext
from ._args import ArrayLike, BlockSize
from ._frameworks import Frame

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._args import VarlenOptions


def _host_index(name, x):
    """block_table, seqused_k of attention_varlen: int32 host arrays (lists of ints, integer
    arrays narrowed to int32 when their values fit); the core checks the rest by name."""
    if isinstance(x, (list, tuple)):
        values = np.asarray(x)
        if values.size and values.dtype.kind not in "iu":
            raise TypeError(f"{name}: expected an int32 array or a list of ints, got {x!r}")
        return _args.int32_index(name, values.astype(np.int64))
    if not (isinstance(x, np.ndarray) or hasattr(x, "__dlpack__")):
        raise TypeError(f"{name}: expected an int32 array, got {type(x).__name__}")
    return _args.int32_index(name, x)


# Typing overloads, kept compact (a signature to a few lines, not a line per parameter).
# fmt: off
@overload
def attention_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, max_seqlen_q: int, max_seqlen_k: int, *,
                     return_lse: Literal[False] = ..., **options: Unpack[VarlenOptions]
                     ) -> ArrayLike: ...
@overload
def attention_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, max_seqlen_q: int, max_seqlen_k: int, *,
                     return_lse: Literal[True], **options: Unpack[VarlenOptions]
                     ) -> Tuple[ArrayLike, ArrayLike]: ...
@overload
def attention_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, max_seqlen_q: int, max_seqlen_k: int, *,
                     return_lse: bool = ..., **options: Unpack[VarlenOptions]) -> Any: ...
# fmt: on


def attention_varlen(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    cu_seqlens_q: ArrayLike,
    cu_seqlens_k: ArrayLike,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    schedule: str = "auto",
    return_lse: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    dropout_p: float = 0.0,
    seed: Optional[int] = None,
    offset: int = 0,
    block_mask: Optional[ArrayLike] = None,
    block_size: BlockSize = 128,
    alibi_slopes: Optional[ArrayLike] = None,
    softcap: float = 0.0,
    bias: Optional[ArrayLike] = None,
    mask: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None,
    layout: str = "thd",
    block_table: Optional[ArrayLike] = None,
    seqused_k: Optional[ArrayLike] = None,
) -> Any:
    """Attention over a batch of sequences of different lengths, packed with no padding.

    flash-attn's ``flash_attn_varlen_func`` layout: sequence ``b`` is
    ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]`` attending to ``k, v[cu_seqlens_k[b]:cu_seqlens_k[b+1]]``.
    Each sequence is :func:`attention` of its own rows: causal masks and windows are aligned
    bottom-right within each sequence, and a sequence with no keys gets out 0 and lse -inf. No
    padding is computed; on CUDA the whole batch is one launch.

    Parameters
    ----------
    q : array (total_q, nheads, headdim)
        The queries of every sequence, one after the other (dtypes as in :func:`attention`).
    k, v : array (total_k, nheads_kv, headdim)
        The keys and values, packed the same way.
    cu_seqlens_q, cu_seqlens_k : int32 array (batch + 1,)
        Cumulative sequence lengths: they start at 0, never decrease and end at ``total_q``
        (``total_k``). On the CPU (NumPy, or CPU tensors of the framework of q), where they are
        checked before anything runs; or, for CUDA q, on the device of q, read by the kernels with
        no host round trip and so not checked (offsets that break these rules give unspecified
        results, though never an access outside the arrays).
    max_seqlen_q, max_seqlen_k : int
        Bounds on the sequence lengths (no sequence may be longer).
    causal, softmax_scale, schedule, return_lse, window_size, dropout_p, seed, offset, softcap, sinks : optional
        As in :func:`attention`, per sequence (the sinks are per head, shared by every sequence).
        With dropout, sequence ``b`` gets the mask dense batch ``b`` would get, with row and column
        counted within the sequence.
    block_mask : bool array, optional
        ``(nblocks_q, nblocks_k)`` for every sequence, or
        ``(batch or 1, nheads or 1, nblocks_q, nblocks_k)`` with one plane per sequence, with
        ``nblocks = ceil(max_seqlen / block_size)``; blocks are counted from each sequence's start.
    block_size : int or (int, int), default 128
        As in :func:`attention`.
    alibi_slopes : float32 array (nheads,) or (batch, nheads), optional
        Row ``b`` for sequence ``b``, with ``i`` and ``j`` counted within the sequence.
    layout : {"thd", "htd"}, default "thd"
        ``"thd"``: q, k, v and out are (total, nheads, headdim) (flash-attn's). ``"htd"``: they are
        (nheads, total, headdim), read through transposed views (JAX arrays are transposed).
    block_table : int32 array (batch, max_pages_per_sequence), optional
        Paged keys and values (flash-attn's and vLLM's layout; forward only): k and v are then
        (num_pages, page_size, nheads_kv, headdim), any page size, and key ``j`` of sequence
        ``b`` is row ``j % page_size`` of page ``block_table[b, j // page_size]``. Sequence ``b``
        has ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` keys (or ``seqused_k[b]``), which its pages
        must hold. Chunked prefill: the new query rows of each sequence against every key its
        pages hold so far, causal aligned bottom-right. The pages are gathered into contiguous
        buffers first, so the result equals, bit for bit, that of the same call on contiguous
        k, v. A host array, checked there, as ``cu_seqlens_q`` and ``cu_seqlens_k`` must then be
        (also for CUDA q); ``layout="thd"`` only. CUDA arrays: the used pages are gathered on the
        device, on the call's stream, into stream-ordered buffers of
        ``2 * sum(keys used) * nheads_kv * headdim`` elements, freed behind the call (tests pass
        on an H100).
    seqused_k : int32 array (batch,), optional
        Sequence ``b`` uses only its first ``seqused_k[b]`` keys (<= its length in
        ``cu_seqlens_k``); causal and windows align to that count. A host array.

    Returns
    -------
    out : array (total_q, nheads, headdim)
        Like q (and in its layout).
    lse : float32 array (nheads, total_q)
        With ``return_lse=True``.

    Raises
    ------
    ValueError
        Bad shapes, offsets (host arrays), lengths above ``max_seqlen``, or options; the message
        names the argument.
    TypeError
        An argument of the wrong type (e.g. ``cu_seqlens`` not an array).

    See Also
    --------
    attention_varlen_backward, flashdl.torch.attention_varlen, flashdl.jax.attention_varlen

    Examples
    --------
    >>> import numpy as np, flashdl
    >>> cu = np.array([0, 3, 3, 10], dtype=np.int32)            # lengths 3, 0 and 7
    >>> q, k, v = (np.random.randn(10, 2, 8).astype(np.float32) for _ in range(3))
    >>> out, lse = flashdl.attention_varlen(q, k, v, cu, cu, 7, 7, causal=True, return_lse=True)
    >>> out.shape, lse.shape
    ((10, 2, 8), (2, 10))
    >>> one = flashdl.attention(q[None, 3:], k[None, 3:], v[None, 3:], causal=True)
    >>> bool(np.allclose(out[3:], one[0], atol=1e-6))            # sequence 2 on its own
    True
    """
    return_lse = _checks.flag("return_lse", return_lse)
    heads_first = _args.is_heads_first(layout, varlen=True)
    frame = Frame({"q": q, "k": k, "v": v}, _args.FLOATS_FWD)
    frame.refuse_autograd(
        {"q": q, "k": k, "v": v}, "flashdl.attention_varlen", "flashdl.torch.attention_varlen"
    )
    paged: Dict[str, Any] = {}
    if block_table is not None or seqused_k is not None:
        if heads_first:
            raise ValueError(
                f"layout: {layout!r} is not supported with block_table or seqused_k; expected 'thd'"
            )
        paged = dict(
            block_table=None if block_table is None else _host_index("block_table", block_table),
            seqused_k=None if seqused_k is None else _host_index("seqused_k", seqused_k),
        )
    errors = _args.LayoutErrors((q, k, v) if block_table is None else (), heads_first, varlen=True)
    if heads_first:
        q, k, v = (_args.as_bshd(n, x, rank=3) for n, x in (("q", q), ("k", k), ("v", v)))
    opts = _args.options(causal, softmax_scale, schedule, window_size, frame)
    dropout_p, seed, offset = _args.dropout_args(dropout_p, seed, offset)
    cu_q, cu_k = (
        _args.cu_seqlens("cu_seqlens_q", cu_seqlens_q),
        _args.cu_seqlens("cu_seqlens_k", cu_seqlens_k),
    )
    max_q, max_k = (
        _args.max_seqlen("max_seqlen_q", max_seqlen_q),
        _args.max_seqlen("max_seqlen_k", max_seqlen_k),
    )
    opts.update(_args.block_sparse(block_mask, block_size))
    opts.update(_args.score_mods(alibi_slopes, softcap))
    opts.update(_args.extras(sinks, bias, mask, rank=3))
    out, out_view = _args.output_like(frame, q, heads_first)
    lse = frame.empty(_args.varlen_lse_shape(q), frame.float32())
    with errors:
        _ext.forward_varlen(
            frame.export(q),
            frame.export(k),
            frame.export(v),
            cu_q,
            cu_k,
            max_q,
            max_k,
            frame.dest(out_view),
            frame.dest(lse),
            dropout_p=dropout_p,
            seed=seed,
            offset=offset,
            **opts,
            **paged,
        )
    out, lse = frame.finish(out), frame.finish(lse)
    return (out, lse) if return_lse else out


def attention_varlen_backward(
    dout: ArrayLike,
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    out: ArrayLike,
    lse: ArrayLike,
    cu_seqlens_q: ArrayLike,
    cu_seqlens_k: ArrayLike,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    schedule: str = "auto",
    window_size: Tuple[int, int] = (-1, -1),
    deterministic: bool = False,
    dropout_p: float = 0.0,
    seed: int = 0,
    offset: int = 0,
    block_mask: Optional[ArrayLike] = None,
    block_size: BlockSize = 128,
    alibi_slopes: Optional[ArrayLike] = None,
    softcap: float = 0.0,
    bias: Optional[ArrayLike] = None,
    mask: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None,
    layout: str = "thd",
) -> Tuple[ArrayLike, ArrayLike, ArrayLike]:
    """Gradients ``(dq, dk, dv)`` of :func:`attention_varlen` for the upstream gradient ``dout``.

    Pass ``out`` and ``lse`` as ``attention_varlen(..., return_lse=True)`` returned them, with the
    same arguments and options (for dropout, the seed the forward used).

    Parameters
    ----------
    dout : array (total_q, nheads, headdim)
        Gradient of the loss with respect to ``out``.
    q, k, v, out : array
        As in and from :func:`attention_varlen`.
    lse : float32 array (nheads, total_q)
        The forward's log-sum-exp.
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
        As in the forward.
    causal, softmax_scale, schedule, window_size, dropout_p, seed, offset : optional
        As in the forward.
    block_mask, block_size, alibi_slopes, softcap, sinks : optional
        As in the forward. With ``sinks``, dsinks (float32 (nheads,), summed over every
        sequence) is appended to the result.
    deterministic : bool, default False
        As in :func:`attention_backward`.
    layout : {"thd", "htd"}, default "thd"
        With ``"htd"``, dout, q, k, v, out and the gradients are (nheads, total, headdim).

    Returns
    -------
    dq, dk, dv : array
        Shaped like q, k and v. A sequence with no query rows gets zero dk, dv.

    Raises
    ------
    ValueError
        Shapes, offsets or options that do not fit (the message names the argument).
    TypeError
        An argument of the wrong type.

    Examples
    --------
    >>> import numpy as np, flashdl
    >>> cu = np.array([0, 4, 9], dtype=np.int32)
    >>> q, k, v = (np.random.randn(9, 2, 8).astype(np.float32) for _ in range(3))
    >>> out, lse = flashdl.attention_varlen(q, k, v, cu, cu, 5, 5, return_lse=True)
    >>> dq, dk, dv = flashdl.attention_varlen_backward(np.ones_like(out), q, k, v, out, lse,
    ...                                                cu, cu, 5, 5)
    >>> dq.shape, dk.shape
    ((9, 2, 8), (9, 2, 8))
    """
    heads_first = _args.is_heads_first(layout, varlen=True)
    frame = Frame({"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse}, _args.FLOATS_BWD)
    errors = _args.LayoutErrors((q, k, v), heads_first, varlen=True)
    if heads_first:
        dout, q, k, v, out = (
            _args.as_bshd(n, x, rank=3)
            for n, x in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out))
        )
    # The forward's options (as attention composes them) and the seed it used.
    opts = _args.options(causal, softmax_scale, schedule, window_size, frame)
    opts.update(_args.block_sparse(block_mask, block_size))
    opts.update(_args.score_mods(alibi_slopes, softcap))
    opts.update(_args.extras(sinks, bias, mask, rank=3, for_grad=True))
    opts.update(_args.backward_dropout(dropout_p, seed, offset))
    cu_q, cu_k = (
        _args.cu_seqlens("cu_seqlens_q", cu_seqlens_q),
        _args.cu_seqlens("cu_seqlens_k", cu_seqlens_k),
    )
    max_q, max_k = (
        _args.max_seqlen("max_seqlen_q", max_seqlen_q),
        _args.max_seqlen("max_seqlen_k", max_seqlen_k),
    )
    (dq, dq_view), (dk, dk_view), (dv, dv_view) = (
        _args.output_like(frame, x, heads_first) for x in (q, k, v)
    )
    extra_kw, extras = _args.extra_grads(frame, q, opts, bias, rank=3)
    with errors:
        _ext.backward_varlen(
            frame.export(dout),
            frame.export(q),
            frame.export(k),
            frame.export(v),
            frame.export(out),
            frame.export(lse),
            cu_q,
            cu_k,
            max_q,
            max_k,
            frame.dest(dq_view),
            frame.dest(dk_view),
            frame.dest(dv_view),
            deterministic=_checks.flag("deterministic", deterministic),
            **opts,
            **extra_kw,
        )
    return (frame.finish(dq), frame.finish(dk), frame.finish(dv)) + extras()
