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
from ._fast_path import backward as _fast_backward
from ._fast_path import forward as _fast_forward
from ._fast_path import int_pair as _int_pair
from ._frameworks import Frame

if TYPE_CHECKING:
    import numpy.typing as npt
    from typing_extensions import Unpack

    from ._args import AttentionOptions


def _dropout_slice(batch_offset, head_offset, nheads_total):
    """The dropout slice options as the binding's keywords: ints (the core checks the values)."""
    return {
        name: _checks.integer(name, value, "an int")
        for name, value in (
            ("dropout_batch_offset", batch_offset),
            ("dropout_head_offset", head_offset),
            ("dropout_nheads_total", nheads_total),
        )
    }


# Typing overloads, kept compact (a signature to a few lines, not a line per parameter).
# fmt: off
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
# fmt: on


def attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    schedule: str = "auto",
    return_lse: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    dropout_p: float = 0.0,
    seed: Optional[int] = None,
    offset: int = 0,
    dropout_batch_offset: int = 0,
    dropout_head_offset: int = 0,
    dropout_nheads_total: int = 0,
    return_seed: bool = False,
    block_mask: Optional[ArrayLike] = None,
    block_size: BlockSize = 128,
    alibi_slopes: Optional[ArrayLike] = None,
    softcap: float = 0.0,
    bias: Optional[ArrayLike] = None,
    mask: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None,
    layout: str = "bshd",
) -> Any:
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
    if (
        (causal is False or causal is True)
        and (return_lse is False or return_lse is True)
        and softmax_scale is None
        and (seed is None or (seed.__class__ is int and seed == 0))
        and return_seed is False
        and block_mask is None
        and alibi_slopes is None
        and bias is None
        and mask is None
        and sinks is None
        and schedule == "auto"
        and layout == "bshd"
        and _int_pair(window_size, -1)
        and dropout_p.__class__ is float
        and dropout_p == 0.0
        and softcap.__class__ is float
        and softcap == 0.0
        and offset.__class__ is int
        and offset == 0
        and ((block_size.__class__ is int and block_size == 128) or _int_pair(block_size, 128))
        and dropout_batch_offset.__class__ is int
        and dropout_batch_offset == 0
        and dropout_head_offset.__class__ is int
        and dropout_head_offset == 0
        and dropout_nheads_total.__class__ is int
        and dropout_nheads_total == 0
    ):
        fast = _fast_forward(q, k, v, causal, return_lse)
        if fast is not None:
            return fast
    return_lse = _checks.flag("return_lse", return_lse)
    return_seed = _checks.flag("return_seed", return_seed)
    bhsd = _args.is_heads_first(layout)
    frame = Frame({"q": q, "k": k, "v": v}, _args.FLOATS_FWD)
    frame.refuse_autograd({"q": q, "k": k, "v": v}, "flashdl.attention", "flashdl.torch.attention")
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
        _ext.forward(
            frame.export(q),
            frame.export(k),
            frame.export(v),
            frame.dest(out_view),
            frame.dest(lse),
            dropout_p=dropout_p,
            seed=seed,
            offset=offset,
            **opts,
        )
    out, lse = frame.finish(out), frame.finish(lse)
    result: tuple[Any, ...] = (out, lse) if return_lse else (out,)
    if return_seed:
        result += (seed,)
    return result if len(result) > 1 else out


def attention_backward(
    dout: ArrayLike,
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    out: ArrayLike,
    lse: ArrayLike,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    schedule: str = "auto",
    window_size: Tuple[int, int] = (-1, -1),
    deterministic: bool = False,
    dropout_p: float = 0.0,
    seed: int = 0,
    offset: int = 0,
    dropout_batch_offset: int = 0,
    dropout_head_offset: int = 0,
    dropout_nheads_total: int = 0,
    block_mask: Optional[ArrayLike] = None,
    block_size: BlockSize = 128,
    alibi_slopes: Optional[ArrayLike] = None,
    softcap: float = 0.0,
    bias: Optional[ArrayLike] = None,
    mask: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None,
    layout: str = "bshd",
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
    if (
        (causal is False or causal is True)
        and layout == "bshd"
        and schedule == "auto"
        and deterministic is False
        and softmax_scale is block_mask is alibi_slopes is bias is mask is sinks is None
        and _int_pair(window_size, -1)
        and dropout_p.__class__ is softcap.__class__ is float
        and dropout_p == softcap == 0.0
        and seed.__class__ is offset.__class__ is dropout_batch_offset.__class__ is int
        and dropout_head_offset.__class__ is dropout_nheads_total.__class__ is int
        and seed == offset == dropout_batch_offset == dropout_head_offset == 0
        and dropout_nheads_total == 0
        and ((block_size.__class__ is int and block_size == 128) or _int_pair(block_size, 128))
    ):
        fast = _fast_backward(dout, q, k, v, out, lse, causal)
        if fast is not None:
            return fast
    bhsd = _args.is_heads_first(layout)
    frame = Frame({"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse}, _args.FLOATS_BWD)
    errors = _args.LayoutErrors((q, k, v), bhsd)
    if bhsd:
        dout, q, k, v, out = (
            _args.as_bshd(n, x)
            for n, x in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out))
        )
    # The forward's options (as attention composes them) and the seed it used.
    opts = _args.options(causal, softmax_scale, schedule, window_size, frame)
    opts.update(_args.block_sparse(block_mask, block_size))
    opts.update(_args.score_mods(alibi_slopes, softcap))
    opts.update(_args.extras(sinks, bias, mask, for_grad=True))
    opts.update(_args.backward_dropout(dropout_p, seed, offset))
    opts.update(_dropout_slice(dropout_batch_offset, dropout_head_offset, dropout_nheads_total))
    (dq, dq_view), (dk, dk_view), (dv, dv_view) = (
        _args.output_like(frame, x, bhsd) for x in (q, k, v)
    )
    extra_kw, extras = _args.extra_grads(frame, q, opts, bias)
    with errors:
        _ext.backward(
            frame.export(dout),
            frame.export(q),
            frame.export(k),
            frame.export(v),
            frame.export(out),
            frame.export(lse),
            frame.dest(dq_view),
            frame.dest(dk_view),
            frame.dest(dv_view),
            deterministic=_checks.flag("deterministic", deterministic),
            **opts,
            **extra_kw,
        )
    return (frame.finish(dq), frame.finish(dk), frame.finish(dv)) + extras()


def dropout_mask(
    batch: int,
    nheads: int,
    seqlen_q: int,
    seqlen_k: int,
    dropout_p: float,
    seed: int,
    offset: int = 0,
) -> npt.NDArray[np.bool_]:
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
    shape = tuple(
        _count(n, x)
        for n, x in (
            ("batch", batch),
            ("nheads", nheads),
            ("seqlen_q", seqlen_q),
            ("seqlen_k", seqlen_k),
        )
    )
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
