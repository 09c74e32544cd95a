"""flashdl.attention and attention_backward: any DLPack array in, the caller's array type out.

Outputs are allocated with the caller's framework on the caller's device and the C++ core writes
into them (destination passing). The core validates shapes, dtypes, devices and options and names
the bad argument; this layer adds only what Python alone knows (array types, frameworks, streams).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Optional, Tuple, overload

import numpy as np

from . import _args, _checks, _ext
from ._args import ArrayLike, BlockSize
from ._fast_path import forward as _fast_forward
from ._frameworks import Frame

if TYPE_CHECKING:
    import numpy.typing as npt
    from typing_extensions import Unpack

    from ._args import AttentionOptions, VarlenOptions


def _dropout_slice(batch_offset, head_offset, nheads_total):
    """The dropout slice options as the binding's keywords: ints (the core checks the values)."""
    return {name: _checks.integer(name, value, "an int") for name, value in (
        ("dropout_batch_offset", batch_offset), ("dropout_head_offset", head_offset),
        ("dropout_nheads_total", nheads_total))}


def _heads(q, rank=4):
    """nheads of a (batch, seqlen, nheads, headdim) q (or (total, nheads, headdim) for varlen); 0
    for a wrongly ranked q, which the core then names."""
    shape = tuple(q.shape)
    return shape[rank - 2] if len(shape) == rank else 0


def _extra_grads(frame, q, opts, given_bias, rank=4):
    """The backward's extra outputs: dbias (the bias's dtype, in the shape of the bias the core
    sees) when a bias is given, dsinks (float32 (nheads,)) when sinks are; as (keywords for the
    extension, a function that turns the filled arrays into what the caller gets)."""
    kw, arrays = {}, []
    bias = opts.get("bias")
    if bias is not None:
        dbias = frame.empty(tuple(bias.shape), given_bias.dtype)
        kw["dbias"] = frame.dest(dbias)
        arrays.append(("dbias", dbias))
    if opts.get("sinks") is not None:
        dsinks = frame.empty((_heads(q, rank),), frame.float32())
        kw["dsinks"] = frame.dest(dsinks)
        arrays.append(("dsinks", dsinks))

    def finish():
        result = []
        for name, x in arrays:
            x = frame.finish(x)
            if name == "dbias":
                x = _in_shape_of(x, given_bias)
            result.append(x)
        return tuple(result)
    return kw, finish


def _in_shape_of(dbias, bias):
    """dbias (the compact gradient) in the shape of the bias the caller gave: leading size-1
    axes dropped, axes the caller broadcast with a stride of 0 broadcast back (a view holding the
    gradient of the shared value)."""
    shape = tuple(bias.shape)
    dbias = dbias.reshape(tuple(dbias.shape)[len(dbias.shape) - len(shape):])
    if tuple(dbias.shape) == shape:
        return dbias
    if isinstance(dbias, np.ndarray):
        return np.broadcast_to(dbias, shape)
    expand = getattr(dbias, "expand", None)
    return expand(*shape) if callable(expand) else dbias


@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, return_lse: Literal[False] = ...,
              return_seed: Literal[False] = ..., **options: Unpack[AttentionOptions]) -> ArrayLike: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, return_lse: Literal[True],
              return_seed: Literal[False] = ..., **options: Unpack[AttentionOptions]
              ) -> Tuple[ArrayLike, ArrayLike]: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, return_lse: Literal[False] = ...,
              return_seed: Literal[True], **options: Unpack[AttentionOptions]
              ) -> Tuple[ArrayLike, int]: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, return_lse: Literal[True],
              return_seed: Literal[True], **options: Unpack[AttentionOptions]
              ) -> Tuple[ArrayLike, ArrayLike, int]: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, return_lse: bool = ...,
              return_seed: bool = ..., **options: Unpack[AttentionOptions]) -> Any: ...


def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = False,
              softmax_scale: Optional[float] = None, schedule: str = "auto",
              return_lse: bool = False, window_size: Tuple[int, int] = (-1, -1),
              dropout_p: float = 0.0, seed: Optional[int] = None, offset: int = 0,
              dropout_batch_offset: int = 0, dropout_head_offset: int = 0,
              dropout_nheads_total: int = 0,
              return_seed: bool = False, block_mask: Optional[ArrayLike] = None,
              block_size: BlockSize = 128,
              alibi_slopes: Optional[ArrayLike] = None, softcap: float = 0.0,
              bias: Optional[ArrayLike] = None, mask: Optional[ArrayLike] = None,
              sinks: Optional[ArrayLike] = None,
              layout: str = "bshd") -> Any:
    """Exact attention ``softmax(q k^T * softmax_scale) v``, without materialising the N x N matrix.

    Any DLPack array goes in (NumPy, PyTorch, JAX, CuPy); the output comes back in the caller's
    framework, on the caller's device. Runs the CPU backend for CPU arrays and the CUDA backend for
    CUDA arrays. The result carries no autograd history: train with :func:`flashdl.torch.attention`
    or :func:`flashdl.jax.attention`.

    Parameters
    ----------
    q : array (batch, seqlen_q, nheads, headdim)
        Queries. float16, bfloat16 or float32 (float64 on the CPU; float16 or bfloat16 on CUDA).
        The last dimension must be contiguous; any other strides work, so a
        (batch, nheads, seqlen, headdim) array transposed to this layout needs no copy.
    k, v : array (batch, seqlen_k, nheads_kv, headdim)
        Keys and values, the dtype and device of q. ``nheads`` must be a multiple of ``nheads_kv``
        (GQA / MQA): query head ``h`` reads kv head ``h // (nheads // nheads_kv)``.
    causal : bool, default False
        Bottom-right aligned causal mask: key ``j`` is visible to query ``i`` iff
        ``j <= i + seqlen_k - seqlen_q``. The same as the window ``(-1, 0)``.
    softmax_scale : float, optional
        Scale of the scores; None (default) is ``1 / sqrt(headdim)``.
    schedule : {"auto", "fa2", "fa1", "reference"}, default "auto"
        ``"fa2"`` (FlashAttention-2's order), ``"fa1"`` (the paper's Algorithm 1 as written),
        ``"reference"`` (naive float64 that materialises the matrix: the test oracle, CPU only).
        ``"auto"`` is fa2, except that on the CPU a forward with at most 2 query rows per kv head
        (seqlen_q x the GQA group; 4 from 1,024 keys, 32 from 8,192, 64 from 65,536) over at least
        256 keys, without dropout or a block mask, runs on the KV-cache kernel.
    return_lse : bool, default False
        Also return the log-sum-exp of each row.
    window_size : (int, int), default (-1, -1)
        ``(left, right)``: key ``j`` is visible to query ``i`` iff
        ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right``; -1 is unbounded
        on that side. With ``causal=True``, right is 0 and left is kept.
    dropout_p : float, default 0.0
        In ``[0, 1)``: each attention probability is dropped independently and the kept ones are
        scaled by ``1 / (1 - dropout_p)``. The mask is a counter-based (Philox) function of
        ``(seed, offset, batch, head, row, col)`` only: the same on the CPU and the GPU, for every
        schedule, and in :func:`attention_backward` given the same ``(dropout_p, seed, offset)``;
        :func:`dropout_mask` returns it. lse is of the undropped scores.
    seed : int, optional
        Dropout seed in ``[0, 2**64)``; None draws a fresh one from the OS (never NumPy's global
        state) when ``dropout_p > 0``.
    offset : int, default 0
        In ``[0, 2**32)``: selects another stream under the same seed (e.g. one per layer or step).
    dropout_batch_offset, dropout_head_offset, dropout_nheads_total : int, default 0
        For a call on a slice of a larger one (tensor or data parallelism by hand, one process per
        group of heads or batch entries): element ``(b, h, i, j)`` is dropped as element
        ``(b + dropout_batch_offset, h + dropout_head_offset, i, j)`` of a call with
        ``dropout_nheads_total`` query heads (0: ``nheads`` of q) would be, so the slices' masks
        are exactly the slices of the whole call's mask (``dropout_mask`` of the whole shape).
        Offsets ``>= 0``; ``dropout_head_offset + nheads <= dropout_nheads_total``. Pass the same
        values to :func:`attention_backward`. Only the mask depends on them.
    return_seed : bool, default False
        Also return the seed used (the drawn one when ``seed`` is None; 0 when ``dropout_p`` is 0 and
        no seed was given), which the backward needs.
    block_mask : bool array, optional
        Block-sparse attention: ``(nblocks_q, nblocks_k)``, or
        ``(batch or 1, nheads or 1, nblocks_q, nblocks_k)`` for a mask per batch and head, with
        ``nblocks_q = ceil(seqlen_q / block_q)`` and ``nblocks_k = ceil(seqlen_k / block_k)``. Key
        ``j`` is visible to query ``i`` only where ``block_mask[..., i // block_q, j // block_k]`` is
        true (and causal and the window allow it); zero blocks are never loaded or computed. A NumPy
        array or a CPU array of the framework of q for CPU arrays; on the device of q for CUDA ones.
    block_size : int or (int, int), default 128
        ``block_q`` query rows by ``block_k`` keys per block of ``block_mask`` (an int for both).
    alibi_slopes : float32 array (nheads,) or (batch, nheads), optional
        ALiBi (BLOOM, MPT): adds ``-slope[h] * |i + seqlen_k - seqlen_q - j|`` to the score of query
        ``i`` at key ``j``, bottom-right aligned like causal. On the device of q; no gradient.
        Known bug: on CUDA (an H100) the fa2 forward with slopes and a ``block_mask`` gives wrong
        rows for steep slopes; use ``schedule="fa1"`` there until it is fixed (docs/cuda.md).
    softcap : float, default 0.0
        When > 0, each scaled score ``s`` becomes ``softcap * tanh(s / softcap)`` (Gemma 2, Grok);
        0 is off. Modifiers apply in flash-attn's order: scale, cap, bias, mask.
    sinks : float32 array (nheads,), optional
        Attention sinks (gpt-oss, StreamingLLM): one logit per query head that joins every row's
        softmax denominator and carries no value, ``p_ij = exp(s_ij) / (exp(sink_h) + sum_j
        exp(s_ij))``. lse includes it; a row that sees no key gets ``out`` 0 and ``lse = sink``.
        Finite values (checked for CPU arrays; CUDA ones are not read on the host). On CUDA
        arrays: compiled and passing on the CUDA emulator, not yet run on a GPU.
    layout : {"bshd", "bhsd"}, default "bshd"
        ``"bshd"``: q, k, v and out are (batch, seqlen, nheads, headdim). ``"bhsd"``: they are
        (batch, nheads, seqlen, headdim) (PyTorch's SDPA layout), read through transposed views
        (JAX arrays, which have no views, are transposed). lse has the same shape either way.

    Returns
    -------
    out : array (batch, seqlen_q, nheads, headdim)
        Like q: its dtype, framework and device (and its layout).
    lse : float32 array (batch, nheads, seqlen_q)
        With ``return_lse=True``: the natural log of the sum of exp of the scaled, masked (and
        modified) scores; ``-inf``, with ``out`` 0, for a query that sees no key.
    seed : int
        With ``return_seed=True``: ``(out, seed)``, or ``(out, lse, seed)`` with both flags.

    Raises
    ------
    ValueError
        A bad shape, dtype combination, device or option value (the message names the argument,
        what was expected and what was given); a torch tensor that requires grad while grad mode is
        on.
    TypeError
        An argument of the wrong type (e.g. ``window_size`` not a pair of ints).

    See Also
    --------
    attention_backward : the gradients.
    flashdl.torch.attention : the same with autograd and torch.compile support.
    flashdl.jax.attention : the same under jax.jit, jax.grad and jax.vmap.

    Examples
    --------
    >>> import numpy as np, flashdl
    >>> q, k, v = (np.random.randn(2, 16, 4, 8).astype(np.float32) for _ in range(3))
    >>> out, lse = flashdl.attention(q, k, v, causal=True, return_lse=True)
    >>> out.shape, lse.shape
    ((2, 16, 4, 8), (2, 4, 16))

    GQA (2 kv heads for 4 query heads), a window of 4 keys to the left, and PyTorch's layout:

    >>> kv = np.random.randn(2, 2, 16, 8).astype(np.float32)          # (batch, nheads_kv, seqlen, d)
    >>> flashdl.attention(q.swapaxes(1, 2), kv, kv, window_size=(4, 0), layout="bhsd").shape
    (2, 4, 16, 8)
    """
    if ((causal is False or causal is True) and (return_lse is False or return_lse is True)
            and softmax_scale is None and (seed is None or (seed.__class__ is int and seed == 0))
            and return_seed is False and block_mask is None and alibi_slopes is None
            and bias is None and mask is None and sinks is None and schedule == "auto"
            and layout == "bshd" and window_size.__class__ is tuple and window_size == (-1, -1)
            and dropout_p.__class__ is float and dropout_p == 0.0
            and softcap.__class__ is float and softcap == 0.0
            and offset.__class__ is int and offset == 0
            and ((block_size.__class__ is int and block_size == 128)
                 or (block_size.__class__ is tuple and block_size == (128, 128)))
            and dropout_batch_offset.__class__ is int and dropout_batch_offset == 0
            and dropout_head_offset.__class__ is int and dropout_head_offset == 0
            and dropout_nheads_total.__class__ is int and dropout_nheads_total == 0):
        result = _fast_forward(q, k, v, causal, return_lse)
        if result is not None:
            return result
    return_lse = _checks.flag("return_lse", return_lse)
    return_seed = _checks.flag("return_seed", return_seed)
    bhsd = _args.is_heads_first(layout)
    frame = Frame({"q": q, "k": k, "v": v}, _args.FLOATS_FWD)
    frame.refuse_autograd({"q": q, "k": k, "v": v}, "flashdl.attention",
                          "flashdl.torch.attention")
    errors = _args.LayoutErrors((q, k, v), bhsd)
    if bhsd:
        q, k, v = (_args.as_bshd(n, x) for n, x in (("q", q), ("k", k), ("v", v)))
    opts = _args.options(causal, softmax_scale, schedule, window_size, frame)
    opts.update(_args.block_sparse(block_mask, block_size))
    opts.update(_args.score_mods(alibi_slopes, softcap))
    opts.update(_args.extras(sinks, bias, mask))
    dropout_p, seed, offset = _args.dropout_args(dropout_p, seed, offset)
    opts.update(_dropout_slice(dropout_batch_offset, dropout_head_offset, dropout_nheads_total))
    out, out_view = _args.output_like(frame, q, bhsd)
    lse = frame.empty(_args.lse_shape(q), frame.float32())
    with errors:
        _ext.forward(frame.export(q), frame.export(k), frame.export(v), frame.dest(out_view),
                     frame.dest(lse), dropout_p=dropout_p, seed=seed, offset=offset, **opts)
    out, lse = frame.finish(out), frame.finish(lse)
    result: tuple[Any, ...] = (out, lse) if return_lse else (out,)
    if return_seed:
        result += (seed,)
    return result if len(result) > 1 else out


def _backward_options(causal, softmax_scale, schedule, window_size, frame, dropout_p, seed,
                      offset, block_mask, block_size, alibi_slopes, softcap, sinks=None,
                      bias=None, mask=None, rank=4):
    """The backward's options: the forward's, with the dropout seed it used (never drawn here)."""
    opts = _args.options(causal, softmax_scale, schedule, window_size, frame)
    opts.update(_args.block_sparse(block_mask, block_size))
    opts.update(_args.score_mods(alibi_slopes, softcap))
    opts.update(_args.extras(sinks, bias, mask, rank=rank, for_grad=True))
    if seed is None:
        raise TypeError("seed: expected the int seed the forward used, got None")
    dropout_p, seed, offset = _args.dropout_args(dropout_p, seed, offset)
    opts.update(dropout_p=dropout_p, seed=seed, offset=offset)
    return opts


def attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                       out: ArrayLike, lse: ArrayLike, *, causal: bool = False,
                       softmax_scale: Optional[float] = None, schedule: str = "auto",
                       window_size: Tuple[int, int] = (-1, -1), deterministic: bool = False,
                       dropout_p: float = 0.0, seed: int = 0, offset: int = 0,
                       dropout_batch_offset: int = 0, dropout_head_offset: int = 0,
                       dropout_nheads_total: int = 0,
                       block_mask: Optional[ArrayLike] = None, block_size: BlockSize = 128,
                       alibi_slopes: Optional[ArrayLike] = None, softcap: float = 0.0,
              bias: Optional[ArrayLike] = None, mask: Optional[ArrayLike] = None,
              sinks: Optional[ArrayLike] = None,
                       layout: str = "bshd"
                       ) -> Tuple[ArrayLike, ArrayLike, ArrayLike]:
    """Gradients ``(dq, dk, dv)`` of :func:`attention` for the upstream gradient ``dout``.

    Recomputes the attention matrix block by block from ``lse`` (nothing of size N x N is stored).
    Pass the arguments and options of the forward call: with dropout the same ``dropout_p``,
    ``offset`` and the seed the forward used (``attention(..., return_seed=True)`` returns it when it
    drew one), so that the same mask is regenerated; with a block mask or score modifiers the same
    ``block_mask``, ``block_size``, ``alibi_slopes`` and ``softcap``.

    Parameters
    ----------
    dout : array (batch, seqlen_q, nheads, headdim)
        Gradient of the loss with respect to ``out``; the dtype of q.
    q, k, v : array
        The forward's inputs, as in :func:`attention`.
    out : array (batch, seqlen_q, nheads, headdim)
        The forward's output.
    lse : float32 array (batch, nheads, seqlen_q)
        The forward's log-sum-exp (``attention(..., return_lse=True)``).
    causal, softmax_scale, schedule, window_size : optional
        As in :func:`attention`; must match the forward.
    deterministic : bool, default False
        Bitwise reproducible dq on CUDA (fa2 otherwise sums dq with float atomics). dk and dv are
        always reproducible, and so is every gradient on the CPU for a given thread count.
    dropout_p : float, default 0.0
        The forward's dropout probability.
    seed : int, default 0
        The seed the forward used (None is refused: it would draw a different mask).
    offset : int, default 0
        The forward's offset.
    dropout_batch_offset, dropout_head_offset, dropout_nheads_total : int, default 0
        The forward's (see :func:`attention`).
    block_mask, block_size, alibi_slopes, softcap, sinks : optional
        As in :func:`attention`; must match the forward.
    layout : {"bshd", "bhsd"}, default "bshd"
        With ``"bhsd"``, dout, q, k, v, out and the gradients are (batch, nheads, seqlen, headdim).

    Returns
    -------
    dq, dk, dv : array
        Shaped, typed and laid out like q, k and v. With GQA, dk and dv sum over the query heads of
        each group. A query that saw no key contributes zero gradients.
    dsinks : float32 array (nheads,)
        With ``sinks``: appended, ``(dq, dk, dv, dsinks)``;
        ``dsinks[h] = -sum over batches and rows of exp(sinks[h] - lse) * rowsum(dout * out)``.

    Raises
    ------
    ValueError
        Shapes or options that do not fit (the message names the argument).
    TypeError
        An argument of the wrong type, or ``seed=None``.

    Examples
    --------
    >>> import numpy as np, flashdl
    >>> q, k, v = (np.random.randn(1, 16, 2, 8).astype(np.float32) for _ in range(3))
    >>> out, lse, seed = flashdl.attention(q, k, v, dropout_p=0.1, return_lse=True,
    ...                                    return_seed=True)
    >>> dq, dk, dv = flashdl.attention_backward(np.ones_like(out), q, k, v, out, lse,
    ...                                         dropout_p=0.1, seed=seed)
    >>> dq.shape == q.shape and dk.shape == k.shape
    True
    """
    bhsd = _args.is_heads_first(layout)
    frame = Frame({"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse}, _args.FLOATS_BWD)
    errors = _args.LayoutErrors((q, k, v), bhsd)
    if bhsd:
        dout, q, k, v, out = (_args.as_bshd(n, x) for n, x in (
            ("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out)))
    opts = _backward_options(causal, softmax_scale, schedule, window_size, frame, dropout_p, seed,
                             offset, block_mask, block_size, alibi_slopes, softcap, sinks,
                             bias, mask)
    opts.update(_dropout_slice(dropout_batch_offset, dropout_head_offset, dropout_nheads_total))
    (dq, dq_view), (dk, dk_view), (dv, dv_view) = (_args.output_like(frame, x, bhsd)
                                                   for x in (q, k, v))
    extra_kw, extras = _extra_grads(frame, q, opts, bias)
    with errors:
        _ext.backward(frame.export(dout), frame.export(q), frame.export(k), frame.export(v),
                      frame.export(out), frame.export(lse), frame.dest(dq_view),
                      frame.dest(dk_view), frame.dest(dv_view), deterministic=_checks.flag("deterministic", deterministic),
                      **opts, **extra_kw)
    return (frame.finish(dq), frame.finish(dk), frame.finish(dv)) + extras()


def dropout_mask(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, dropout_p: float,
                 seed: int, offset: int = 0) -> npt.NDArray[np.bool_]:
    """The keep-mask that ``attention(..., dropout_p, seed, offset)`` applies.

    Computed by the C++ core's own generator (Philox4x32-10 keyed by the seed, counter
    ``(col, row, batch * nheads + head, offset)``), so it is exactly the mask of every backend,
    schedule, tile size and thread count, forward and backward. Masked (invisible) keys are not
    marked here: the mask covers every ``(i, j)``.

    Parameters
    ----------
    batch, nheads, seqlen_q, seqlen_k : int
        The shape of the attention call (ints >= 0).
    dropout_p : float
        The dropout probability, in ``[0, 1)``.
    seed : int
        The seed, in ``[0, 2**64)``.
    offset : int, default 0
        The offset, in ``[0, 2**32)``.

    Returns
    -------
    numpy.ndarray of bool (batch, nheads, seqlen_q, seqlen_k)
        True where the probability of query row ``i`` and key column ``j`` of head ``h`` in batch
        ``b`` is kept (and scaled by ``1 / (1 - dropout_p)``).

    Raises
    ------
    ValueError
        A negative size, ``dropout_p`` outside ``[0, 1)``, ``seed`` or ``offset`` out of range.
    TypeError
        A non-integer size, seed or offset (``seed=None`` included).

    Examples
    --------
    >>> import flashdl
    >>> keep = flashdl.dropout_mask(1, 2, 4, 8, dropout_p=0.5, seed=42)
    >>> keep.shape, keep.dtype
    ((1, 2, 4, 8), dtype('bool'))
    >>> bool((keep == flashdl.dropout_mask(1, 2, 4, 8, 0.5, 42)).all())     # a pure function
    True
    """
    shape = tuple(_count(n, x) for n, x in (("batch", batch), ("nheads", nheads),
                                            ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)))
    if seed is None:
        raise TypeError("seed: expected an int in [0, 2**64), got None")
    dropout_p, seed, offset = _args.dropout_args(dropout_p, seed, offset)
    try:
        mask = np.empty(shape, dtype=bool)
    except (MemoryError, ValueError):
        names = ("batch", "nheads", "seqlen_q", "seqlen_k")
        largest = names[max(range(4), key=lambda i: shape[i])]
        raise ValueError(f"{largest}: a mask of shape {shape} cannot be allocated") from None
    _ext.dropout_mask(mask, dropout_p=dropout_p, seed=seed, offset=offset)
    return mask


def _count(name, x):
    return _checks.integer(name, x, "an int >= 0", 0, 2**63)


# ---- variable-length batches (flash-attn's varlen layout) ----------------------------------------


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


def attention_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, max_seqlen_q: int, max_seqlen_k: int, *,
                     causal: bool = False, softmax_scale: Optional[float] = None,
                     schedule: str = "auto", return_lse: bool = False,
                     window_size: Tuple[int, int] = (-1, -1), dropout_p: float = 0.0,
                     seed: Optional[int] = None, offset: int = 0,
                     block_mask: Optional[ArrayLike] = None, block_size: BlockSize = 128,
                     alibi_slopes: Optional[ArrayLike] = None, softcap: float = 0.0,
                     bias: Optional[ArrayLike] = None, mask: Optional[ArrayLike] = None,
                     sinks: Optional[ArrayLike] = None,
                     layout: str = "thd", block_table: Optional[ArrayLike] = None,
                     seqused_k: Optional[ArrayLike] = None) -> Any:
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
        As in :func:`attention`, per sequence (the sinks are per head, shared by every sequence). With dropout, sequence ``b`` gets the mask dense batch
        ``b`` would get, with row and column counted within the sequence.
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
    frame.refuse_autograd({"q": q, "k": k, "v": v}, "flashdl.attention_varlen",
                          "flashdl.torch.attention_varlen")
    paged = {}
    if block_table is not None or seqused_k is not None:
        if heads_first:
            raise ValueError(f"layout: {layout!r} is not supported with block_table or "
                             "seqused_k; expected 'thd'")
        paged = dict(block_table=None if block_table is None else _host_index("block_table",
                                                                              block_table),
                     seqused_k=None if seqused_k is None else _host_index("seqused_k",
                                                                          seqused_k))
    errors = _args.LayoutErrors((q, k, v) if block_table is None else (), heads_first, varlen=True)
    if heads_first:
        q, k, v = (_args.as_bshd(n, x, rank=3) for n, x in (("q", q), ("k", k), ("v", v)))
    opts = _args.options(causal, softmax_scale, schedule, window_size, frame)
    dropout_p, seed, offset = _args.dropout_args(dropout_p, seed, offset)
    cu_q, cu_k = _args.cu_seqlens("cu_seqlens_q", cu_seqlens_q), _args.cu_seqlens("cu_seqlens_k",
                                                                         cu_seqlens_k)
    max_q, max_k = _args.max_seqlen("max_seqlen_q", max_seqlen_q), _args.max_seqlen("max_seqlen_k",
                                                                           max_seqlen_k)
    opts.update(_args.block_sparse(block_mask, block_size))
    opts.update(_args.score_mods(alibi_slopes, softcap))
    opts.update(_args.extras(sinks, bias, mask, rank=3))
    out, out_view = _args.output_like(frame, q, heads_first)
    lse = frame.empty(_args.varlen_lse_shape(q), frame.float32())
    with errors:
        _ext.forward_varlen(frame.export(q), frame.export(k), frame.export(v), cu_q, cu_k, max_q,
                            max_k, frame.dest(out_view), frame.dest(lse), dropout_p=dropout_p,
                            seed=seed, offset=offset, **opts, **paged)
    out, lse = frame.finish(out), frame.finish(lse)
    return (out, lse) if return_lse else out


def attention_varlen_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                              out: ArrayLike, lse: ArrayLike, cu_seqlens_q: ArrayLike,
                              cu_seqlens_k: ArrayLike, max_seqlen_q: int, max_seqlen_k: int, *,
                              causal: bool = False, softmax_scale: Optional[float] = None,
                              schedule: str = "auto", window_size: Tuple[int, int] = (-1, -1),
                              deterministic: bool = False, dropout_p: float = 0.0, seed: int = 0,
                              offset: int = 0, block_mask: Optional[ArrayLike] = None,
                              block_size: BlockSize = 128,
                              alibi_slopes: Optional[ArrayLike] = None, softcap: float = 0.0,
              bias: Optional[ArrayLike] = None, mask: Optional[ArrayLike] = None,
              sinks: Optional[ArrayLike] = None,
                              layout: str = "thd") -> Tuple[ArrayLike, ArrayLike, ArrayLike]:
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
    causal, softmax_scale, schedule, window_size, dropout_p, seed, offset, block_mask, block_size, alibi_slopes, softcap, sinks : optional
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
        dout, q, k, v, out = (_args.as_bshd(n, x, rank=3) for n, x in (
            ("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out)))
    opts = _backward_options(causal, softmax_scale, schedule, window_size, frame, dropout_p, seed,
                             offset, block_mask, block_size, alibi_slopes, softcap, sinks,
                             bias, mask, rank=3)
    cu_q, cu_k = _args.cu_seqlens("cu_seqlens_q", cu_seqlens_q), _args.cu_seqlens("cu_seqlens_k",
                                                                         cu_seqlens_k)
    max_q, max_k = _args.max_seqlen("max_seqlen_q", max_seqlen_q), _args.max_seqlen("max_seqlen_k",
                                                                           max_seqlen_k)
    (dq, dq_view), (dk, dk_view), (dv, dv_view) = (_args.output_like(frame, x, heads_first)
                                                   for x in (q, k, v))
    extra_kw, extras = _extra_grads(frame, q, opts, bias, rank=3)
    with errors:
        _ext.backward_varlen(frame.export(dout), frame.export(q), frame.export(k),
                             frame.export(v), frame.export(out), frame.export(lse), cu_q, cu_k,
                             max_q, max_k, frame.dest(dq_view), frame.dest(dk_view),
                             frame.dest(dv_view), deterministic=_checks.flag("deterministic", deterministic),
                             **opts, **extra_kw)
    return (frame.finish(dq), frame.finish(dk), frame.finish(dv)) + extras()
