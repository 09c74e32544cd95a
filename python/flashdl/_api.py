"""flashdl.attention and attention_backward: any DLPack array in, the caller's array type out.

Outputs are allocated with the caller's framework on the caller's device and the C++ core writes
into them (destination passing). The core validates shapes, dtypes, devices and options and names
the bad argument; this layer adds only what Python alone knows (array types, frameworks, streams).
"""

from __future__ import annotations

import numbers
import operator
import secrets
from typing import TYPE_CHECKING, Any, Literal, Optional, Tuple, Union, overload

import numpy as np

from . import _ext
from ._frameworks import Frame

if TYPE_CHECKING:
    import numpy.typing as npt

ArrayLike = Any
"""An array of NumPy, PyTorch, JAX or CuPy (or any CPU array with __dlpack__); the outputs come
back in the caller's framework: the same type for NumPy, PyTorch, JAX and CuPy, NumPy arrays for
other DLPack CPU arrays. Any, as no common array type covers these frameworks."""

BlockSize = Union[int, Tuple[int, int]]
"""block_size: an int for both, or a pair (block_q, block_k)."""

_FLOATS_FWD = ("q", "k", "v")
_FLOATS_BWD = ("dout", "q", "k", "v", "out")


def _window(window_size):
    try:
        left, right = window_size
        return operator.index(left), operator.index(right)
    except (TypeError, ValueError):
        raise TypeError("window_size: expected a pair (left, right) of ints, -1 for unbounded, "
                        f"got {window_size!r}") from None


def _unsigned(name, x, bits):
    """x as an int in [0, 2**bits): TypeError for a non-integer, ValueError out of range."""
    try:
        x = operator.index(x)
    except TypeError:
        raise TypeError(f"{name}: expected an int in [0, 2**{bits}), "
                        f"got {type(x).__name__}") from None
    if not 0 <= x < 2**bits:
        raise ValueError(f"{name}: expected an int in [0, 2**{bits}), got {x}")
    return x


def _dropout_p(dropout_p):
    """A float; the core checks the range [0, 1) and names dropout_p."""
    if not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p: expected a float in [0, 1), got {type(dropout_p).__name__}")
    return float(dropout_p)


def draw_seed() -> int:
    """A fresh random dropout seed, 63 bits from the OS (secrets), never NumPy's global state."""
    return secrets.randbits(63)


def _dropout(dropout_p, seed, offset):
    """(dropout_p, seed, offset) validated; seed None draws one (only when dropout_p > 0)."""
    dropout_p = _dropout_p(dropout_p)
    if seed is None:
        seed = draw_seed() if dropout_p > 0 else 0
    # The offset is a 32-bit Philox counter word (the core checks it too).
    return dropout_p, _unsigned("seed", seed, 64), _unsigned("offset", offset, 32)


def _block_sparse(block_mask, block_size):
    """The extension's block-sparse keywords. block_mask: None (dense) or any CPU array that crosses
    DLPack (NumPy, or the framework of q); the core checks dtype bool, rank, shape and device.
    block_size: an int or a pair (block_q, block_k) of ints >= 1."""
    try:
        pair = (block_size, block_size) if isinstance(block_size, numbers.Integral) else block_size
        bq, bk = (operator.index(x) for x in pair)
    except (TypeError, ValueError):
        raise TypeError("block_size: expected an int or a pair (block_q, block_k) of ints, "
                        f"got {block_size!r}") from None
    if not (1 <= bq < 2**63 and 1 <= bk < 2**63):
        raise ValueError(f"block_size: expected block sizes in [1, 2**63), got ({bq}, {bk})")
    if block_mask is not None and not (isinstance(block_mask, np.ndarray)
                                       or hasattr(block_mask, "__dlpack__")):
        raise TypeError("block_mask: expected None or a bool array (NumPy or the framework of q) "
                        f"of shape (nblocks_q, nblocks_k), got {type(block_mask).__name__}")
    return dict(block_mask=block_mask, block_size_q=bq, block_size_k=bk)


def _score_mods(alibi_slopes, softcap):
    """The extension's score-modifier keywords. alibi_slopes: None or a float32 array that crosses
    DLPack (NumPy, or the framework of q, on the device of q); the core checks dtype, shape and
    device. softcap: a float >= 0 (0: off); the core checks the range."""
    if not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap: expected a float >= 0 (0: off), got {type(softcap).__name__}")
    if alibi_slopes is not None:
        if not (isinstance(alibi_slopes, np.ndarray) or hasattr(alibi_slopes, "__dlpack__")):
            raise TypeError("alibi_slopes: expected None or a float32 array (NumPy or the "
                            "framework of q) of shape (nheads,) or (batch, nheads), "
                            f"got {type(alibi_slopes).__name__}")
        if getattr(alibi_slopes, "requires_grad", False):
            alibi_slopes = alibi_slopes.detach()  # the slopes are not differentiated
    return dict(alibi_slopes=alibi_slopes, softcap=float(softcap))


def _scalars(causal, softmax_scale, schedule, window_size):
    """(causal, softmax_scale, schedule, (left, right)) as far as Python checks them (the core
    checks the schedule's name and the values); flashdl.torch passes them on to its custom ops."""
    if not isinstance(schedule, str):
        raise TypeError(f"schedule: expected a str ('auto', 'fa1', 'fa2' or 'reference'), "
                        f"got {type(schedule).__name__}")
    if softmax_scale is not None:
        try:
            softmax_scale = float(softmax_scale)
        except (TypeError, ValueError):
            raise TypeError("softmax_scale: expected a float or None, "
                            f"got {type(softmax_scale).__name__}") from None
    return bool(causal), softmax_scale, schedule, _window(window_size)


def _options(causal, softmax_scale, schedule, window_size, frame):
    causal, softmax_scale, schedule, (left, right) = _scalars(causal, softmax_scale, schedule,
                                                              window_size)
    return dict(dtype=frame.dtype, softmax_scale=softmax_scale, causal=causal,
                window_left=left, window_right=right, schedule=schedule, stream=frame.stream)


def _layout(layout):
    """True for layout='bhsd' ((batch, nheads, seqlen, headdim) arrays), False for 'bshd'."""
    if layout not in ("bshd", "bhsd"):
        raise ValueError("layout: expected 'bshd' (batch, seqlen, nheads, headdim) or 'bhsd' "
                         f"(batch, nheads, seqlen, headdim), got {layout!r}")
    return layout == "bhsd"


def _as_bshd(name, x):
    """A (batch, nheads, seqlen, headdim) array as the (batch, seqlen, nheads, headdim) view the
    core reads (a view in NumPy, PyTorch and CuPy; JAX, which has no views, transposes)."""
    if len(getattr(x, "shape", ())) != 4 or not hasattr(x, "swapaxes"):
        raise ValueError(f"{name}: with layout='bhsd' expected a rank-4 array (batch, nheads, "
                         f"seqlen, headdim), got shape {tuple(getattr(x, 'shape', ()))}")
    return x.swapaxes(1, 2)


class _BhsdErrors:
    """Adds to a ValueError from the core that its shapes are in flashdl's own order."""

    def __init__(self, on):
        self.on = on

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        if self.on and kind is ValueError:
            raise ValueError(f"{err} (layout='bhsd': shapes above are in flashdl's "
                             "(batch, seqlen, nheads, headdim) order)") from None
        return False


def _output_like(frame, x, bhsd):
    """An output shaped like x (batch, seqlen, nheads, headdim) and the view the core writes: with
    layout='bhsd' the output is a contiguous (batch, nheads, seqlen, headdim) array and the core
    writes it through a transposed view."""
    shape = tuple(x.shape)
    if not bhsd or len(shape) != 4:
        out = frame.empty(shape, x.dtype)
        return out, out
    out = frame.empty((shape[0], shape[2], shape[1], shape[3]), x.dtype)
    return out, out.swapaxes(1, 2)


def _lse_shape(q):
    shape = tuple(q.shape)
    # A wrongly ranked q gets a placeholder; the core then reports q itself.
    return (shape[0], shape[2], shape[1]) if len(shape) == 4 else (0, 0, 0)


@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = ...,
              softmax_scale: Optional[float] = ..., schedule: str = ...,
              return_lse: Literal[False] = ..., window_size: Tuple[int, int] = ...,
              dropout_p: float = ..., seed: Optional[int] = ..., offset: int = ...,
              return_seed: Literal[False] = ..., block_mask: Optional[ArrayLike] = ...,
              block_size: BlockSize = ...,
              alibi_slopes: Optional[ArrayLike] = ..., softcap: float = ...,
              layout: str = ...) -> ArrayLike: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = ...,
              softmax_scale: Optional[float] = ..., schedule: str = ...,
              return_lse: Literal[True], window_size: Tuple[int, int] = ...,
              dropout_p: float = ..., seed: Optional[int] = ..., offset: int = ...,
              return_seed: Literal[False] = ..., block_mask: Optional[ArrayLike] = ...,
              block_size: BlockSize = ...,
              alibi_slopes: Optional[ArrayLike] = ..., softcap: float = ..., layout: str = ...
              ) -> Tuple[ArrayLike, ArrayLike]: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = ...,
              softmax_scale: Optional[float] = ..., schedule: str = ...,
              return_lse: Literal[False] = ..., window_size: Tuple[int, int] = ...,
              dropout_p: float = ..., seed: Optional[int] = ..., offset: int = ...,
              return_seed: Literal[True], block_mask: Optional[ArrayLike] = ...,
              block_size: BlockSize = ...,
              alibi_slopes: Optional[ArrayLike] = ..., softcap: float = ..., layout: str = ...
              ) -> Tuple[ArrayLike, int]: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = ...,
              softmax_scale: Optional[float] = ..., schedule: str = ...,
              return_lse: Literal[True], window_size: Tuple[int, int] = ...,
              dropout_p: float = ..., seed: Optional[int] = ..., offset: int = ...,
              return_seed: Literal[True], block_mask: Optional[ArrayLike] = ...,
              block_size: BlockSize = ...,
              alibi_slopes: Optional[ArrayLike] = ..., softcap: float = ..., layout: str = ...
              ) -> Tuple[ArrayLike, ArrayLike, int]: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = ...,
              softmax_scale: Optional[float] = ..., schedule: str = ...,
              return_lse: bool = ..., window_size: Tuple[int, int] = ...,
              dropout_p: float = ..., seed: Optional[int] = ..., offset: int = ...,
              return_seed: bool = ..., block_mask: Optional[ArrayLike] = ...,
              block_size: BlockSize = ...,
              alibi_slopes: Optional[ArrayLike] = ..., softcap: float = ...,
              layout: str = ...) -> Any: ...


def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = False,
              softmax_scale: Optional[float] = None, schedule: str = "auto",
              return_lse: bool = False, window_size: Tuple[int, int] = (-1, -1),
              dropout_p: float = 0.0, seed: Optional[int] = None, offset: int = 0,
              return_seed: bool = False, block_mask: Optional[ArrayLike] = None,
              block_size: BlockSize = 128,
              alibi_slopes: Optional[ArrayLike] = None, softcap: float = 0.0,
              layout: str = "bshd") -> Any:
    """Exact attention softmax(q k^T * scale) v, computed without materialising the N x N matrix.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim), with
    nheads a multiple of nheads_kv (GQA/MQA). The last dimension must be contiguous; any other
    strides work (a (batch, nheads, seqlen, headdim) array transposed to this layout is fine).
    causal is bottom-right aligned: key j is visible to query i iff j <= i + seqlen_k - seqlen_q.
    softmax_scale defaults to 1/sqrt(headdim). schedule: 'auto' (fa2; on the CPU, a few query
    rows over many keys run on the KV-cache kernel, as README.md says), 'fa1', 'fa2' or
    'reference' (naive float64, the test oracle). window_size=(left, right) limits the visible keys: key j
    is visible to query i iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q +
    right, -1 for unbounded on that side. causal=True is the window (-1, 0): no bound on the
    left, and no key past the bottom-right diagonal j = i + seqlen_k - seqlen_q; causal with a
    window (left, right) keeps that left bound and sets right to 0.

    Dropout: dropout_p in [0, 1) drops each attention probability independently and scales the
    kept ones by 1 / (1 - dropout_p). The mask is a counter-based (Philox) function of
    (seed, offset, batch, head, row, col) only: the same on the CPU and the GPU, for every
    schedule, and in attention_backward given the same (dropout_p, seed, offset);
    flashdl.dropout_mask returns it. seed: an int in [0, 2**64), or None to draw a fresh one
    (from the OS, not NumPy's global state); offset: an int in [0, 2**32) that selects another
    stream under the same seed (e.g. one per layer or step). lse is of the undropped scores.

    Block-sparse attention: block_mask, a bool array (nblocks_q, nblocks_k), or
    (batch or 1, nheads or 1, nblocks_q, nblocks_k) for a mask per batch and head, over blocks of
    block_size = block_q query rows by block_k keys (an int for both; default 128), with
    nblocks_q = ceil(seqlen_q / block_q) and nblocks_k = ceil(seqlen_k / block_k): key j is
    visible to query i only where block_mask[..., i // block_q, j // block_k] is True (and causal
    and the window allow it). Zero blocks are never loaded or computed. For CPU arrays a NumPy
    array or a CPU array of the framework of q; for CUDA arrays an array on the device of q.

    Score modifiers (flash-attn's conventions and order: scale, cap, bias, mask):
    softcap > 0 replaces each scaled score s by softcap * tanh(s / softcap) (Gemma 2, Grok),
    with the tanh's derivative in the backward; 0 is off. alibi_slopes: float32 (nheads,) or
    (batch, nheads) (NumPy or the framework of q, on the device of q) adds
    -slope[h] * |i + seqlen_k - seqlen_q - j| to the score of query i at key j (ALiBi: BLOOM,
    MPT), bottom-right aligned like causal; the slopes get no gradient. lse is of the modified
    scores.

    layout='bhsd' takes q, k, v as (batch, nheads, seqlen, headdim) arrays (PyTorch's SDPA
    layout), read through transposed views (JAX arrays, which have no views, are transposed), and
    returns out in that layout; lse is (batch, nheads, seqlen_q) either way. The default 'bshd' is
    (batch, seqlen, nheads, headdim).

    Returns out (like q, in the caller's framework and device); (out, lse) with
    return_lse=True, lse float32 (batch, nheads, seqlen_q), the natural-log sum of exp of the
    scaled scores (-inf, with out 0, for a query that sees no key); return_seed=True appends
    the seed used (an int: the drawn one when seed is None, 0 when dropout_p is 0 and no seed
    was given), which the backward needs: (out, seed) or (out, lse, seed).
    """
    bhsd = _layout(layout)
    frame = Frame({"q": q, "k": k, "v": v}, _FLOATS_FWD)
    frame.refuse_autograd({"q": q, "k": k, "v": v}, "flashdl.attention",
                          "flashdl.torch.attention")
    if bhsd:
        q, k, v = (_as_bshd(n, x) for n, x in (("q", q), ("k", k), ("v", v)))
    opts = _options(causal, softmax_scale, schedule, window_size, frame)
    opts.update(_block_sparse(block_mask, block_size))
    opts.update(_score_mods(alibi_slopes, softcap))
    dropout_p, seed, offset = _dropout(dropout_p, seed, offset)
    out, out_view = _output_like(frame, q, bhsd)
    lse = frame.empty(_lse_shape(q), frame.float32())
    with _BhsdErrors(bhsd):
        _ext.forward(frame.export(q), frame.export(k), frame.export(v), frame.dest(out_view),
                     frame.dest(lse), dropout_p=dropout_p, seed=seed, offset=offset, **opts)
    out, lse = frame.finish(out), frame.finish(lse)
    result: tuple[Any, ...] = (out, lse) if return_lse else (out,)
    if return_seed:
        result += (seed,)
    return result if len(result) > 1 else out


def _backward_options(causal, softmax_scale, schedule, window_size, frame, dropout_p, seed,
                      offset, block_mask, block_size, alibi_slopes, softcap):
    """The backward's options: the forward's, with the dropout seed it used (never drawn here)."""
    opts = _options(causal, softmax_scale, schedule, window_size, frame)
    opts.update(_block_sparse(block_mask, block_size))
    opts.update(_score_mods(alibi_slopes, softcap))
    if seed is None:
        raise TypeError("seed: expected the int seed the forward used, got None")
    dropout_p, seed, offset = _dropout(dropout_p, seed, offset)
    opts.update(dropout_p=dropout_p, seed=seed, offset=offset)
    return opts


def attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                       out: ArrayLike, lse: ArrayLike, *, causal: bool = False,
                       softmax_scale: Optional[float] = None, schedule: str = "auto",
                       window_size: Tuple[int, int] = (-1, -1), deterministic: bool = False,
                       dropout_p: float = 0.0, seed: int = 0, offset: int = 0,
                       block_mask: Optional[ArrayLike] = None, block_size: BlockSize = 128,
                       alibi_slopes: Optional[ArrayLike] = None, softcap: float = 0.0,
                       layout: str = "bshd"
                       ) -> Tuple[ArrayLike, ArrayLike, ArrayLike]:
    """Gradients (dq, dk, dv) of attention(q, k, v) for the upstream gradient dout.

    out and lse are what attention(..., return_lse=True) returned for the same arguments and
    options; with dropout, pass the same dropout_p, offset and the seed the forward used
    (attention(..., return_seed=True) returns it when it drew one), so that the backward
    regenerates the same mask; with a block mask or score modifiers, the same block_mask and
    block_size, alibi_slopes and softcap. dq, dk, dv
    come back shaped and typed like q, k, v; with GQA,
    dk and dv sum over the query heads of each group. layout='bhsd': dout, q, k, v, out and the
    gradients are (batch, nheads, seqlen, headdim), as in attention(..., layout='bhsd').
    """
    bhsd = _layout(layout)
    frame = Frame({"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse}, _FLOATS_BWD)
    if bhsd:
        dout, q, k, v, out = (_as_bshd(n, x) for n, x in (
            ("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out)))
    opts = _backward_options(causal, softmax_scale, schedule, window_size, frame, dropout_p, seed,
                             offset, block_mask, block_size, alibi_slopes, softcap)
    (dq, dq_view), (dk, dk_view), (dv, dv_view) = (_output_like(frame, x, bhsd)
                                                   for x in (q, k, v))
    with _BhsdErrors(bhsd):
        _ext.backward(frame.export(dout), frame.export(q), frame.export(k), frame.export(v),
                      frame.export(out), frame.export(lse), frame.dest(dq_view),
                      frame.dest(dk_view), frame.dest(dv_view), deterministic=bool(deterministic),
                      **opts)
    return frame.finish(dq), frame.finish(dk), frame.finish(dv)


def dropout_mask(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, dropout_p: float,
                 seed: int, offset: int = 0) -> npt.NDArray[np.bool_]:
    """The keep-mask attention(..., dropout_p, seed, offset) applies: a NumPy bool array
    (batch, nheads, seqlen_q, seqlen_k), True where the probability of query row i and key
    column j of head h in batch b is kept (and scaled by 1 / (1 - dropout_p)). Computed by the
    C++ core's own generator, so it is exactly the mask of every backend and schedule. Masked
    (invisible) keys are not marked here: the mask covers every (i, j).
    """
    shape = tuple(_count(n, x) for n, x in (("batch", batch), ("nheads", nheads),
                                            ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)))
    if seed is None:
        raise TypeError("seed: expected an int in [0, 2**64), got None")
    dropout_p, seed, offset = _dropout(dropout_p, seed, offset)
    mask = np.empty(shape, dtype=bool)
    _ext.dropout_mask(mask, dropout_p=dropout_p, seed=seed, offset=offset)
    return mask


def _count(name, x):
    try:
        x = operator.index(x)
    except TypeError:
        raise TypeError(f"{name}: expected an int >= 0, got {type(x).__name__}") from None
    if x < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {x}")
    return x


# ---- variable-length batches (flash-attn's varlen layout) ----------------------------------------

def _cu_seqlens(name, x):
    """cu_seqlens as the extension takes it: any CPU array that crosses DLPack (NumPy, torch,
    JAX); the core checks dtype int32, rank, device and the offsets themselves."""
    if isinstance(x, np.ndarray) or hasattr(x, "__dlpack__"):
        if getattr(x, "requires_grad", False):
            x = x.detach()
        return x
    raise TypeError(f"{name}: expected an int32 array (NumPy or the framework of q) of shape "
                    f"(batch + 1,), got {type(x).__name__}")


def _max_seqlen(name, x):
    try:
        return operator.index(x)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}") from None


def _varlen_lse_shape(q):
    shape = tuple(q.shape)
    # A wrongly ranked q gets a placeholder; the core then reports q itself.
    return (shape[1], shape[0]) if len(shape) == 3 else (0, 0)


@overload
def attention_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, max_seqlen_q: int, max_seqlen_k: int, *,
                     causal: bool = ..., softmax_scale: Optional[float] = ...,
                     schedule: str = ..., return_lse: Literal[False] = ...,
                     window_size: Tuple[int, int] = ..., dropout_p: float = ...,
                     seed: Optional[int] = ..., offset: int = ...,
                     block_mask: Optional[ArrayLike] = ..., block_size: BlockSize = ...,
                     alibi_slopes: Optional[ArrayLike] = ..., softcap: float = ...
                     ) -> ArrayLike: ...
@overload
def attention_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, max_seqlen_q: int, max_seqlen_k: int, *,
                     causal: bool = ..., softmax_scale: Optional[float] = ...,
                     schedule: str = ..., return_lse: Literal[True],
                     window_size: Tuple[int, int] = ..., dropout_p: float = ...,
                     seed: Optional[int] = ..., offset: int = ...,
                     block_mask: Optional[ArrayLike] = ..., block_size: BlockSize = ...,
                     alibi_slopes: Optional[ArrayLike] = ..., softcap: float = ...
                     ) -> Tuple[ArrayLike, ArrayLike]: ...
@overload
def attention_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, max_seqlen_q: int, max_seqlen_k: int, *,
                     causal: bool = ..., softmax_scale: Optional[float] = ...,
                     schedule: str = ..., return_lse: bool = ...,
                     window_size: Tuple[int, int] = ..., dropout_p: float = ...,
                     seed: Optional[int] = ..., offset: int = ...,
                     block_mask: Optional[ArrayLike] = ..., block_size: BlockSize = ...,
                     alibi_slopes: Optional[ArrayLike] = ..., softcap: float = ...
                     ) -> Any: ...


def attention_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, max_seqlen_q: int, max_seqlen_k: int, *,
                     causal: bool = False, softmax_scale: Optional[float] = None,
                     schedule: str = "auto", return_lse: bool = False,
                     window_size: Tuple[int, int] = (-1, -1), dropout_p: float = 0.0,
                     seed: Optional[int] = None, offset: int = 0,
                     block_mask: Optional[ArrayLike] = None, block_size: BlockSize = 128,
                     alibi_slopes: Optional[ArrayLike] = None, softcap: float = 0.0) -> Any:
    """attention over a batch of sequences of different lengths, packed with no padding
    (flash-attn's flash_attn_varlen_func layout).

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_kv, headdim). cu_seqlens_q and
    cu_seqlens_k: int32 arrays (batch + 1,) on the CPU (NumPy, or CPU tensors of the framework
    of q; checked before anything runs) or, for CUDA q, on the device of q (read by the kernels
    with no host round trip, and so not checked: offsets that break the rules below give
    unspecified results, though never an access outside the arrays), the cumulative sequence
    lengths: sequence b is q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]
    attending to k, v[cu_seqlens_k[b]:cu_seqlens_k[b+1]]. They start at 0, never decrease and
    end at total_q (total_k); no sequence may be longer than max_seqlen_q (max_seqlen_k).
    Each sequence is attention(...) of its own rows: causal masks and windows are aligned
    bottom-right within each sequence; a sequence with no keys gets out 0 and lse -inf.

    Dropout: sequence b gets the mask dense batch b would get, keyed by (seed, offset, b, head,
    row, col) with row and col counted within the sequence. block_mask: (nblocks_q, nblocks_k)
    for every sequence, or (batch or 1, nheads or 1, nblocks_q, nblocks_k) with one plane per
    sequence, nblocks = ceil(max_seqlen / block_size); blocks are counted from each sequence's
    start. On CUDA the whole batch is one launch. alibi_slopes: (nheads,) or (batch, nheads),
    row b for sequence b, with i and j counted within the sequence; softcap as in attention.

    Returns out (like q); (out, lse) with return_lse=True, lse float32 (nheads, total_q).
    """
    frame = Frame({"q": q, "k": k, "v": v}, _FLOATS_FWD)
    frame.refuse_autograd({"q": q, "k": k, "v": v}, "flashdl.attention_varlen",
                          "flashdl.torch.attention_varlen")
    opts = _options(causal, softmax_scale, schedule, window_size, frame)
    dropout_p, seed, offset = _dropout(dropout_p, seed, offset)
    cu_q, cu_k = _cu_seqlens("cu_seqlens_q", cu_seqlens_q), _cu_seqlens("cu_seqlens_k",
                                                                         cu_seqlens_k)
    max_q, max_k = _max_seqlen("max_seqlen_q", max_seqlen_q), _max_seqlen("max_seqlen_k",
                                                                           max_seqlen_k)
    opts.update(_block_sparse(block_mask, block_size))
    opts.update(_score_mods(alibi_slopes, softcap))
    out = frame.empty(q.shape, q.dtype)
    lse = frame.empty(_varlen_lse_shape(q), frame.float32())
    _ext.forward_varlen(frame.export(q), frame.export(k), frame.export(v), cu_q, cu_k, max_q,
                        max_k, frame.dest(out), frame.dest(lse), dropout_p=dropout_p, seed=seed,
                        offset=offset, **opts)
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
                              alibi_slopes: Optional[ArrayLike] = None, softcap: float = 0.0
                              ) -> Tuple[ArrayLike, ArrayLike, ArrayLike]:
    """Gradients (dq, dk, dv) of attention_varlen for the upstream gradient dout
    (total_q, nheads, headdim); out and lse (nheads, total_q) as attention_varlen(...,
    return_lse=True) returned them for the same arguments and options. A sequence with no
    query rows gets zero dk, dv."""
    frame = Frame({"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse}, _FLOATS_BWD)
    opts = _backward_options(causal, softmax_scale, schedule, window_size, frame, dropout_p, seed,
                             offset, block_mask, block_size, alibi_slopes, softcap)
    cu_q, cu_k = _cu_seqlens("cu_seqlens_q", cu_seqlens_q), _cu_seqlens("cu_seqlens_k",
                                                                         cu_seqlens_k)
    max_q, max_k = _max_seqlen("max_seqlen_q", max_seqlen_q), _max_seqlen("max_seqlen_k",
                                                                           max_seqlen_k)
    dq = frame.empty(q.shape, q.dtype)
    dk = frame.empty(k.shape, k.dtype)
    dv = frame.empty(v.shape, v.dtype)
    _ext.backward_varlen(frame.export(dout), frame.export(q), frame.export(k), frame.export(v),
                         frame.export(out), frame.export(lse), cu_q, cu_k, max_q, max_k,
                         frame.dest(dq), frame.dest(dk), frame.dest(dv),
                         deterministic=bool(deterministic), **opts)
    return frame.finish(dq), frame.finish(dk), frame.finish(dv)
