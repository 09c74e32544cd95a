"""flashdl.attention and attention_backward: any DLPack array in, the caller's array type out.

Outputs are allocated with the caller's framework on the caller's device and the C++ core writes
into them (destination passing). The core validates shapes, dtypes, devices and options and names
the bad argument; this layer adds only what Python alone knows (array types, frameworks, streams).
"""

from __future__ import annotations

import numbers
import operator
import secrets
import sys
from typing import TYPE_CHECKING, Any, Literal, Optional, Tuple, Union, overload

import numpy as np

from . import _checks, _ext
from ._frameworks import Frame, _dtype_name, _is_numpy_bfloat16

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
    except (TypeError, ValueError):
        raise TypeError("window_size: expected a pair (left, right) of ints, -1 for unbounded, "
                        f"got {window_size!r}") from None
    what = "a pair (left, right) of ints that fit int64, -1 for unbounded"
    return (_checks.integer("window_size", left, what),
            _checks.integer("window_size", right, what))


def _unsigned(name, x, bits):
    """x as an int in [0, 2**bits): TypeError for a non-integer (a bool too), ValueError out of
    range."""
    return _checks.integer(name, x, f"an int in [0, 2**{bits})", 0, 2**bits)


def _dropout_p(dropout_p):
    """A float; the core checks the range [0, 1) and names dropout_p."""
    return _checks.real("dropout_p", dropout_p, "a float in [0, 1)")


def draw_seed() -> int:
    """A fresh random dropout seed, 63 bits from the OS (secrets), never NumPy's global state."""
    return secrets.randbits(63)


def _dropout_slice(batch_offset, head_offset, nheads_total):
    """The dropout slice options as the binding's keywords: ints (the core checks the values)."""
    return {name: _checks.integer(name, value, "an int") for name, value in (
        ("dropout_batch_offset", batch_offset), ("dropout_head_offset", head_offset),
        ("dropout_nheads_total", nheads_total))}


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
    what = "an int or a pair (block_q, block_k) of ints"
    try:
        pair = ((block_size, block_size)
                if type(block_size) is int or isinstance(block_size, numbers.Integral)
                else block_size)
        bq, bk = pair
    except (TypeError, ValueError):
        raise TypeError(f"block_size: expected {what}, got {block_size!r}") from None
    bq, bk = (_checks.integer("block_size", x, what) for x in (bq, bk))
    if not (1 <= bq < 2**63 and 1 <= bk < 2**63):
        raise ValueError(f"block_size: expected block sizes in [1, 2**63), got ({bq}, {bk})")
    if block_mask is not None and not (isinstance(block_mask, np.ndarray)
                                       or hasattr(block_mask, "__dlpack__")):
        raise TypeError("block_mask: expected None or a bool array (NumPy or the framework of q) "
                        f"of shape (nblocks_q, nblocks_k), got {type(block_mask).__name__}")
    if block_mask is not None:
        _checks.readable("block_mask", block_mask)
    return dict(block_mask=block_mask, block_size_q=bq, block_size_k=bk)


def _score_mods(alibi_slopes, softcap):
    """The extension's score-modifier keywords. alibi_slopes: None or a float32 array that crosses
    DLPack (NumPy, or the framework of q, on the device of q); the core checks dtype, shape and
    device. softcap: a float >= 0 (0: off); the core checks the range."""
    softcap = _checks.real("softcap", softcap, "a float >= 0 (0: off)")
    if alibi_slopes is not None:
        if not (isinstance(alibi_slopes, np.ndarray) or hasattr(alibi_slopes, "__dlpack__")):
            raise TypeError("alibi_slopes: expected None or a float32 array (NumPy or the "
                            "framework of q) of shape (nheads,) or (batch, nheads), "
                            f"got {type(alibi_slopes).__name__}")
        _checks.readable("alibi_slopes", alibi_slopes)
        if getattr(alibi_slopes, "requires_grad", False):
            alibi_slopes = alibi_slopes.detach()  # the slopes are not differentiated
    return dict(alibi_slopes=alibi_slopes, softcap=float(softcap))


def _array_arg(name, x, what):
    """x, an array that crosses DLPack (NumPy, or the framework of q), else TypeError naming it."""
    if not (isinstance(x, np.ndarray) or hasattr(x, "__dlpack__")):
        raise TypeError(f"{name}: expected None or {what} (NumPy or the framework of q), "
                        f"got {type(x).__name__}")
    _checks.readable(name, x)
    return x


def _strides(x):
    """Element strides of a NumPy array or torch tensor; None for arrays without strides (JAX)."""
    if isinstance(x, np.ndarray):
        return tuple(s // x.itemsize for s in x.strides) if x.itemsize else (0,) * x.ndim
    stride = getattr(x, "stride", None)
    return tuple(stride()) if callable(stride) else None


def _full_rank(name, x, rank, layout):
    """A bias or mask of rank <= `rank` as a view of rank `rank` (size-1 axes in front: NumPy
    broadcasting); more axes than that, or none, are refused naming the argument."""
    nd = len(getattr(x, "shape", ()))
    if not 1 <= nd <= rank:
        raise ValueError(f"{name}: expected an array of rank 1 to {rank} broadcastable to "
                         f"{layout}, got rank {nd}")
    return x[(None,) * (rank - nd)] if nd < rank else x


def _compact(x):
    """x with every leading axis of stride 0 (a broadcast view: np.broadcast_to, torch expand)
    narrowed to size 1: the array dBias sums into. A view; for torch, autograd carries the
    gradient back through it to the broadcast tensor."""
    st = _strides(x)
    if st is None:
        return x
    index = tuple(slice(0, 1) if st[a] == 0 and x.shape[a] > 1 else slice(None)
                  for a in range(len(st) - 1))
    return x[index] if any(i != slice(None) for i in index) else x


def _extras(sinks, bias=None, mask=None, rank=4, for_grad=False):
    """The extension's keywords for an attention bias, boolean mask and sinks. bias: a float
    array broadcastable to (batch, nheads, seqlen_q, seqlen_k) ((nheads, total_q, max_seqlen_k)
    for varlen, rank 3), fewer axes taken as leading size-1 ones; mask: a bool array of the same
    shapes; sinks: float32 (nheads,). The core checks dtypes, shapes and devices. Torch tensors
    that require grad cross detached (flashdl.torch returns their gradients). for_grad: the
    backward's bias, with stride-0 axes narrowed to size 1 (the shape dbias takes)."""
    layout = ("(batch, nheads, seqlen_q, seqlen_k)" if rank == 4
              else "(nheads, total_q, max_seqlen_k)")
    out = {}
    if bias is not None:
        bias = _full_rank("bias", _array_arg("bias", bias, "a float array"), rank, layout)
        out["bias"] = _compact(bias) if for_grad else bias
    if mask is not None:
        out["mask"] = _full_rank("mask", _array_arg("mask", mask, "a bool array"), rank, layout)
    if sinks is not None:
        out["sinks"] = _array_arg("sinks", sinks, "a float32 array of shape (nheads,)")
    if bias is not None and _dtype_name(bias) in ("int16", "uint16"):
        # (16-bit integers would be read as bfloat16 where NumPy bfloat16 arrays cross as uint16)
        raise TypeError(f"bias: unsupported dtype {_dtype_name(bias)} (expected float32, float16 "
                        "or bfloat16)")
    for name, x in list(out.items()):
        if getattr(x, "requires_grad", False):
            out[name] = x.detach()
        elif _is_numpy_bfloat16(x):
            out[name] = x.view(np.uint16)  # NumPy bfloat16 crosses as uint16 (see Frame.export)
            out["dtype"] = "bfloat16"  # ... and is read as bfloat16 (q, k, v are not int16)
    return out


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


def _scalars(causal, softmax_scale, schedule, window_size):
    """(causal, softmax_scale, schedule, (left, right)) as far as Python checks them (the core
    checks the schedule's name and the values); flashdl.torch passes them on to its custom ops."""
    if not isinstance(schedule, str):
        raise TypeError(f"schedule: expected a str ('auto', 'fa1', 'fa2' or 'reference'), "
                        f"got {type(schedule).__name__}")
    if softmax_scale is not None:
        # NaN stands for None below the Python layers (flashdl.jax's attributes): refused here
        # alike on every entry point; the core bounds the value.
        softmax_scale = _checks.finite(
            "softmax_scale", _checks.real("softmax_scale", softmax_scale, "a float or None"),
            "a finite number or None")
    return _checks.flag("causal", causal), softmax_scale, schedule, _window(window_size)


def _options(causal, softmax_scale, schedule, window_size, frame):
    causal, softmax_scale, schedule, (left, right) = _scalars(causal, softmax_scale, schedule,
                                                              window_size)
    return dict(dtype=frame.dtype, softmax_scale=softmax_scale, causal=causal,
                window_left=left, window_right=right, schedule=schedule, stream=frame.stream)


_LAYOUTS = {"bshd": "(batch, seqlen, nheads, headdim)", "bhsd": "(batch, nheads, seqlen, headdim)"}
_VARLEN_LAYOUTS = {"thd": "(total, nheads, headdim)", "htd": "(nheads, total, headdim)"}


def _layout(layout, varlen=False):
    """True for the heads-first layout ('bhsd', or 'htd' for packed arrays), False for flashdl's
    own order ('bshd', 'thd')."""
    names = _VARLEN_LAYOUTS if varlen else _LAYOUTS
    if not isinstance(layout, str) or layout not in names:
        (own, own_axes), (other, other_axes) = names.items()
        raise ValueError(f"layout: expected {own!r} {own_axes} or {other!r} {other_axes}, "
                         f"got {layout!r}")
    return layout != next(iter(names))


def _as_bshd(name, x, rank=4):
    """A heads-first array ((batch, nheads, seqlen, headdim), or (nheads, total, headdim) packed)
    as the (batch, seqlen, nheads, headdim) ((total, nheads, headdim)) view the core reads: a
    view in NumPy, PyTorch and CuPy; JAX, which has no views, transposes."""
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != rank or not hasattr(x, "swapaxes"):
        layout, axes = (("bhsd", _LAYOUTS["bhsd"]) if rank == 4
                        else ("htd", _VARLEN_LAYOUTS["htd"]))
        raise ValueError(f"{name}: with layout={layout!r} expected a rank-{rank} array {axes}, "
                         f"got shape {shape}")
    return x.swapaxes(rank - 3, rank - 2)


def _fits(q, k, v, heads_first, same_batch=True):
    """Whether shapes q, k, v (dense rank 4, or packed rank 3) are one call's arrays when read
    with the heads axis before the sequence axis (heads_first) or after it; same_batch False for
    a paged cache, whose first axis counts pages."""
    rank = len(q)
    if rank not in (3, 4) or len(k) != rank or len(v) != rank or k != v:
        return False
    h = rank - 3 if heads_first else rank - 2  # the heads axis
    if rank == 4 and same_batch and q[0] != k[0]:
        return False
    return q[-1] == k[-1] and k[h] > 0 and q[h] % k[h] == 0


class _LayoutErrors:
    """Rewords a ValueError from the core for the caller's layout: with a heads-first layout it
    says that the shapes quoted are in flashdl's order, and when q, k, v do not fit the layout
    they were passed with but fit the other one (a transposition explains them), it says so and
    names layout=. The outermost manager words the message (flashdl.torch wraps flashdl's own
    call on transposed views)."""

    def __init__(self, arrays, heads_first, varlen=False, same_batch=True, names="q, k, v"):
        self.shapes = [tuple(getattr(x, "shape", ())) for x in arrays]
        self.names = names
        self.heads_first, self.varlen, self.same_batch = heads_first, varlen, same_batch

    def __enter__(self):
        return self

    def _hint(self):
        names = _VARLEN_LAYOUTS if self.varlen else _LAYOUTS
        (own, own_axes), (other, other_axes) = names.items()
        if self.heads_first:
            (own, own_axes), (other, other_axes) = (other, other_axes), (own, own_axes)
        if len(self.shapes) != 3 or _fits(*self.shapes, self.heads_first, self.same_batch) or \
                not _fits(*self.shapes, not self.heads_first, self.same_batch):
            return ""
        q, k, v = self.shapes
        return (f"; {self.names} of shapes {q}, {k}, {v} do not fit layout={own!r} {own_axes} but "
                f"fit {other_axes}: pass layout={other!r} if that is their order")

    def __exit__(self, kind, err, tb):
        if kind is None or not issubclass(kind, ValueError):
            return False
        base = getattr(err, "_flashdl_base", str(err))
        msg = base
        if self.heads_first:
            layout, own = (("htd", "(total, nheads, headdim)") if self.varlen
                           else ("bhsd", "(batch, seqlen, nheads, headdim)"))
            msg += f" (layout={layout!r}: shapes above are in flashdl's {own} order)"
        msg += self._hint()
        new = ValueError(msg)
        new._flashdl_base = base  # type: ignore[attr-defined]
        raise new from None


def _output_like(frame, x, heads_first):
    """An output shaped like x ((batch, seqlen, nheads, headdim), or (total, nheads, headdim)
    packed) and the view the core writes: with a heads-first layout the output is a contiguous
    heads-first array and the core writes it through a transposed view."""
    shape = tuple(x.shape)
    if not heads_first or len(shape) not in (3, 4):
        out = frame.empty(shape, x.dtype)
        return out, out
    ax = len(shape) - 3  # the seqlen (total) axis; heads follow it
    swapped = shape[:ax] + (shape[ax + 1], shape[ax]) + shape[ax + 2:]
    out = frame.empty(swapped, x.dtype)
    return out, out.swapaxes(ax, ax + 1)


def _lse_shape(q):
    shape = tuple(q.shape)
    # A wrongly ranked q gets a placeholder; the core then reports q itself.
    return (shape[0], shape[2], shape[1]) if len(shape) == 4 else (0, 0, 0)


@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = ...,
              softmax_scale: Optional[float] = ..., schedule: str = ...,
              return_lse: Literal[False] = ..., window_size: Tuple[int, int] = ...,
              dropout_p: float = ..., seed: Optional[int] = ..., offset: int = ...,
              dropout_batch_offset: int = ..., dropout_head_offset: int = ...,
              dropout_nheads_total: int = ...,
              return_seed: Literal[False] = ..., block_mask: Optional[ArrayLike] = ...,
              block_size: BlockSize = ...,
              alibi_slopes: Optional[ArrayLike] = ..., softcap: float = ...,
              bias: Optional[ArrayLike] = ..., mask: Optional[ArrayLike] = ...,
              sinks: Optional[ArrayLike] = ...,
              layout: str = ...) -> ArrayLike: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = ...,
              softmax_scale: Optional[float] = ..., schedule: str = ...,
              return_lse: Literal[True], window_size: Tuple[int, int] = ...,
              dropout_p: float = ..., seed: Optional[int] = ..., offset: int = ...,
              dropout_batch_offset: int = ..., dropout_head_offset: int = ...,
              dropout_nheads_total: int = ...,
              return_seed: Literal[False] = ..., block_mask: Optional[ArrayLike] = ...,
              block_size: BlockSize = ...,
              alibi_slopes: Optional[ArrayLike] = ..., softcap: float = ...,
              bias: Optional[ArrayLike] = ..., mask: Optional[ArrayLike] = ...,
              sinks: Optional[ArrayLike] = ..., layout: str = ...
              ) -> Tuple[ArrayLike, ArrayLike]: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = ...,
              softmax_scale: Optional[float] = ..., schedule: str = ...,
              return_lse: Literal[False] = ..., window_size: Tuple[int, int] = ...,
              dropout_p: float = ..., seed: Optional[int] = ..., offset: int = ...,
              dropout_batch_offset: int = ..., dropout_head_offset: int = ...,
              dropout_nheads_total: int = ...,
              return_seed: Literal[True], block_mask: Optional[ArrayLike] = ...,
              block_size: BlockSize = ...,
              alibi_slopes: Optional[ArrayLike] = ..., softcap: float = ...,
              bias: Optional[ArrayLike] = ..., mask: Optional[ArrayLike] = ...,
              sinks: Optional[ArrayLike] = ..., layout: str = ...
              ) -> Tuple[ArrayLike, int]: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = ...,
              softmax_scale: Optional[float] = ..., schedule: str = ...,
              return_lse: Literal[True], window_size: Tuple[int, int] = ...,
              dropout_p: float = ..., seed: Optional[int] = ..., offset: int = ...,
              dropout_batch_offset: int = ..., dropout_head_offset: int = ...,
              dropout_nheads_total: int = ...,
              return_seed: Literal[True], block_mask: Optional[ArrayLike] = ...,
              block_size: BlockSize = ...,
              alibi_slopes: Optional[ArrayLike] = ..., softcap: float = ...,
              bias: Optional[ArrayLike] = ..., mask: Optional[ArrayLike] = ...,
              sinks: Optional[ArrayLike] = ..., layout: str = ...
              ) -> Tuple[ArrayLike, ArrayLike, int]: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = ...,
              softmax_scale: Optional[float] = ..., schedule: str = ...,
              return_lse: bool = ..., window_size: Tuple[int, int] = ...,
              dropout_p: float = ..., seed: Optional[int] = ..., offset: int = ...,
              dropout_batch_offset: int = ..., dropout_head_offset: int = ...,
              dropout_nheads_total: int = ...,
              return_seed: bool = ..., block_mask: Optional[ArrayLike] = ...,
              block_size: BlockSize = ...,
              alibi_slopes: Optional[ArrayLike] = ..., softcap: float = ...,
              bias: Optional[ArrayLike] = ..., mask: Optional[ArrayLike] = ...,
              sinks: Optional[ArrayLike] = ...,
              layout: str = ...) -> Any: ...


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
    bhsd = _layout(layout)
    frame = Frame({"q": q, "k": k, "v": v}, _FLOATS_FWD)
    frame.refuse_autograd({"q": q, "k": k, "v": v}, "flashdl.attention",
                          "flashdl.torch.attention")
    errors = _LayoutErrors((q, k, v), bhsd)
    if bhsd:
        q, k, v = (_as_bshd(n, x) for n, x in (("q", q), ("k", k), ("v", v)))
    opts = _options(causal, softmax_scale, schedule, window_size, frame)
    opts.update(_block_sparse(block_mask, block_size))
    opts.update(_score_mods(alibi_slopes, softcap))
    opts.update(_extras(sinks, bias, mask))
    dropout_p, seed, offset = _dropout(dropout_p, seed, offset)
    opts.update(_dropout_slice(dropout_batch_offset, dropout_head_offset, dropout_nheads_total))
    out, out_view = _output_like(frame, q, bhsd)
    lse = frame.empty(_lse_shape(q), frame.float32())
    with errors:
        _ext.forward(frame.export(q), frame.export(k), frame.export(v), frame.dest(out_view),
                     frame.dest(lse), dropout_p=dropout_p, seed=seed, offset=offset, **opts)
    out, lse = frame.finish(out), frame.finish(lse)
    result: tuple[Any, ...] = (out, lse) if return_lse else (out,)
    if return_seed:
        result += (seed,)
    return result if len(result) > 1 else out


# The common eager call, fast (a tiny call's time is mostly Python): q, k, v of one dtype, either
# aligned native-order NumPy float16/32/64 arrays or plain CPU torch tensors (no subclass, no
# grad; _fast_forward_torch), every option but causal and return_lse at its default (seed 0 and
# block_size (128, 128) are flashdl.torch's spelling of the defaults). The binding's
# forward_default takes them positionally, with no lse array unless one is returned; shapes and
# strides are the core's to check, as in the full path. Anything else, or a call the core
# refuses, goes down the full path, which words the error for the caller (the layout hints):
# errors are the full path's.
_NDARRAY = np.ndarray
_FAST_DTYPES = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64))


def _fast_forward(q, k, v, causal, return_lse):
    if type(q) is not _NDARRAY:
        torch = sys.modules.get("torch")
        if torch is None or type(q) is not torch.Tensor or torch.compiler.is_compiling():
            return None
        return _fast_forward_torch(q, k, v, causal, return_lse)
    if not (type(k) is _NDARRAY and type(v) is _NDARRAY and q.dtype in _FAST_DTYPES
            and k.dtype is q.dtype and v.dtype is q.dtype
            and q.flags.aligned and k.flags.aligned and v.flags.aligned):
        return None
    out = np.empty(q.shape, q.dtype)
    lse = np.empty(_lse_shape(q), np.float32) if return_lse else None
    try:
        _ext.forward_default(q, k, v, out, lse, causal)
    except Exception:  # noqa: BLE001 - re-raised, worded, by the full path
        return None
    return (out, lse) if return_lse else out


_TORCH_FAST: Optional[tuple] = None  # the torch names _fast_forward_torch uses, looked up once


def _torch_fast_names() -> tuple:
    global _TORCH_FAST
    torch = sys.modules["torch"]
    _TORCH_FAST = (torch.Tensor, torch.empty_like, torch.utils.dlpack.to_dlpack,
                   torch.contiguous_format, torch.empty, torch.float32)
    return _TORCH_FAST


def _fast_forward_torch(q, k, v, causal, return_lse):
    """_fast_forward on a torch.Tensor q, outside torch.compile (the caller's checks). Every
    other check is the core's (dtypes, devices, shapes: a refusal takes the full path) except
    those it cannot make: plain tensors, no autograd, and q on the CPU (a GPU call needs the
    caller's stream, which only the full path asks torch for)."""
    tensor, empty_like, to_dlpack, contiguous, empty, float32 = (_TORCH_FAST or
                                                                 _torch_fast_names())
    if (type(k) is not tensor or type(v) is not tensor or not q.is_cpu
            or q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    try:
        # empty_like: a third of torch.empty's time from a shape (a tiny call's largest part); a
        # fifth less again without the memory_format keyword, which a contiguous q does not need
        # (its layout is the one asked for).
        out = empty_like(q) if q.is_contiguous() else empty_like(q, memory_format=contiguous)
        if not return_lse:
            _ext.forward_default(to_dlpack(q), to_dlpack(k), to_dlpack(v), to_dlpack(out), None,
                                 causal)
            return out
        lse = empty(_lse_shape(q), dtype=float32)
        _ext.forward_default(to_dlpack(q), to_dlpack(k), to_dlpack(v), to_dlpack(out),
                             to_dlpack(lse), causal)
        return out, lse
    except Exception:  # noqa: BLE001 - re-raised, worded, by the full path
        return None


def _backward_options(causal, softmax_scale, schedule, window_size, frame, dropout_p, seed,
                      offset, block_mask, block_size, alibi_slopes, softcap, sinks=None,
                      bias=None, mask=None, rank=4):
    """The backward's options: the forward's, with the dropout seed it used (never drawn here)."""
    opts = _options(causal, softmax_scale, schedule, window_size, frame)
    opts.update(_block_sparse(block_mask, block_size))
    opts.update(_score_mods(alibi_slopes, softcap))
    opts.update(_extras(sinks, bias, mask, rank=rank, for_grad=True))
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
    bhsd = _layout(layout)
    frame = Frame({"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse}, _FLOATS_BWD)
    errors = _LayoutErrors((q, k, v), bhsd)
    if bhsd:
        dout, q, k, v, out = (_as_bshd(n, x) for n, x in (
            ("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out)))
    opts = _backward_options(causal, softmax_scale, schedule, window_size, frame, dropout_p, seed,
                             offset, block_mask, block_size, alibi_slopes, softcap, sinks,
                             bias, mask)
    opts.update(_dropout_slice(dropout_batch_offset, dropout_head_offset, dropout_nheads_total))
    (dq, dq_view), (dk, dk_view), (dv, dv_view) = (_output_like(frame, x, bhsd)
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
    dropout_p, seed, offset = _dropout(dropout_p, seed, offset)
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

def _conversion(name, x):
    """The one-line conversion of an index array to int32 in the caller's framework."""
    framework = type(x).__module__.split(".")[0]
    if framework == "torch":
        return f"{name}.to(torch.int32)"
    if framework in ("jax", "jaxlib"):
        return f"{name}.astype(jnp.int32)"
    return f"{name}.astype(np.int32)"


def _int32_index(name, x):
    """An index array (cu_seqlens, cache_seqlens, block_table) in int32, the dtype the core reads:
    int32 arrays pass as they are; other integer arrays in host memory (NumPy's default int64
    first of all, and CPU arrays of other frameworks) are converted to an int32 NumPy array when
    every value fits; an integer array on a GPU, or values that do not fit, are refused with the
    conversion to write. Arrays of other dtypes pass on, for the core to refuse by name."""
    _checks.readable(name, x)
    dtype = getattr(x, "dtype", None)
    if dtype is None or str(dtype).split(".")[-1] == "int32":
        return x
    if not isinstance(x, np.ndarray):
        try:
            host = np.from_dlpack(x)
        except Exception:  # a GPU array, or one NumPy cannot read: the core names it
            if str(dtype).split(".")[-1] in ("int64", "int16", "int8", "uint8", "uint16",
                                              "uint32", "uint64"):
                raise TypeError(f"{name}: expected an int32 array, got {str(dtype)} in device "
                                f"memory; convert it with {_conversion(name, x)}") from None
            return x
    else:
        host = x
    if host.dtype.kind not in "iu":
        return x
    if host.size and (host.min() < -2**31 or host.max() >= 2**31):
        bad = host.max() if host.max() >= 2**31 else host.min()
        raise ValueError(f"{name}: expected int32 values, got {bad} in an {host.dtype} array")
    return host.astype(np.int32)


def _cu_seqlens(name, x):
    """cu_seqlens as the extension takes it: any CPU array that crosses DLPack (NumPy, torch,
    JAX), integer arrays narrowed to int32 (_int32_index); the core checks dtype, rank, device
    and the offsets themselves."""
    if isinstance(x, np.ndarray) or hasattr(x, "__dlpack__"):
        if getattr(x, "requires_grad", False):
            x = x.detach()
        return _int32_index(name, x)
    raise TypeError(f"{name}: expected an int32 array (NumPy or the framework of q) of shape "
                    f"(batch + 1,), got {type(x).__name__}")


def _host_index(name, x):
    """block_table, seqused_k of attention_varlen: int32 host arrays (lists of ints, integer
    arrays narrowed to int32 when their values fit); the core checks the rest by name."""
    if isinstance(x, (list, tuple)):
        values = np.asarray(x)
        if values.size and values.dtype.kind not in "iu":
            raise TypeError(f"{name}: expected an int32 array or a list of ints, got {x!r}")
        return _int32_index(name, values.astype(np.int64))
    if not (isinstance(x, np.ndarray) or hasattr(x, "__dlpack__")):
        raise TypeError(f"{name}: expected an int32 array, got {type(x).__name__}")
    return _int32_index(name, x)


def _max_seqlen(name, x):
    return _checks.integer(name, x, "an int that fits int64")


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
                     alibi_slopes: Optional[ArrayLike] = ..., softcap: float = ...,
                     bias: Optional[ArrayLike] = ..., mask: Optional[ArrayLike] = ...,
                     sinks: Optional[ArrayLike] = ...,
                     layout: str = ..., block_table: Optional[ArrayLike] = ...,
                     seqused_k: Optional[ArrayLike] = ...
                     ) -> ArrayLike: ...
@overload
def attention_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, max_seqlen_q: int, max_seqlen_k: int, *,
                     causal: bool = ..., softmax_scale: Optional[float] = ...,
                     schedule: str = ..., return_lse: Literal[True],
                     window_size: Tuple[int, int] = ..., dropout_p: float = ...,
                     seed: Optional[int] = ..., offset: int = ...,
                     block_mask: Optional[ArrayLike] = ..., block_size: BlockSize = ...,
                     alibi_slopes: Optional[ArrayLike] = ..., softcap: float = ...,
                     bias: Optional[ArrayLike] = ..., mask: Optional[ArrayLike] = ...,
                     sinks: Optional[ArrayLike] = ...,
                     layout: str = ..., block_table: Optional[ArrayLike] = ...,
                     seqused_k: Optional[ArrayLike] = ...
                     ) -> Tuple[ArrayLike, ArrayLike]: ...
@overload
def attention_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, max_seqlen_q: int, max_seqlen_k: int, *,
                     causal: bool = ..., softmax_scale: Optional[float] = ...,
                     schedule: str = ..., return_lse: bool = ...,
                     window_size: Tuple[int, int] = ..., dropout_p: float = ...,
                     seed: Optional[int] = ..., offset: int = ...,
                     block_mask: Optional[ArrayLike] = ..., block_size: BlockSize = ...,
                     alibi_slopes: Optional[ArrayLike] = ..., softcap: float = ...,
                     bias: Optional[ArrayLike] = ..., mask: Optional[ArrayLike] = ...,
                     sinks: Optional[ArrayLike] = ...,
                     layout: str = ..., block_table: Optional[ArrayLike] = ...,
                     seqused_k: Optional[ArrayLike] = ...
                     ) -> Any: ...


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
    heads_first = _layout(layout, varlen=True)
    frame = Frame({"q": q, "k": k, "v": v}, _FLOATS_FWD)
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
    errors = _LayoutErrors((q, k, v) if block_table is None else (), heads_first, varlen=True)
    if heads_first:
        q, k, v = (_as_bshd(n, x, rank=3) for n, x in (("q", q), ("k", k), ("v", v)))
    opts = _options(causal, softmax_scale, schedule, window_size, frame)
    dropout_p, seed, offset = _dropout(dropout_p, seed, offset)
    cu_q, cu_k = _cu_seqlens("cu_seqlens_q", cu_seqlens_q), _cu_seqlens("cu_seqlens_k",
                                                                         cu_seqlens_k)
    max_q, max_k = _max_seqlen("max_seqlen_q", max_seqlen_q), _max_seqlen("max_seqlen_k",
                                                                           max_seqlen_k)
    opts.update(_block_sparse(block_mask, block_size))
    opts.update(_score_mods(alibi_slopes, softcap))
    opts.update(_extras(sinks, bias, mask, rank=3))
    out, out_view = _output_like(frame, q, heads_first)
    lse = frame.empty(_varlen_lse_shape(q), frame.float32())
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
    heads_first = _layout(layout, varlen=True)
    frame = Frame({"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse}, _FLOATS_BWD)
    errors = _LayoutErrors((q, k, v), heads_first, varlen=True)
    if heads_first:
        dout, q, k, v, out = (_as_bshd(n, x, rank=3) for n, x in (
            ("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out)))
    opts = _backward_options(causal, softmax_scale, schedule, window_size, frame, dropout_p, seed,
                             offset, block_mask, block_size, alibi_slopes, softcap, sinks,
                             bias, mask, rank=3)
    cu_q, cu_k = _cu_seqlens("cu_seqlens_q", cu_seqlens_q), _cu_seqlens("cu_seqlens_k",
                                                                         cu_seqlens_k)
    max_q, max_k = _max_seqlen("max_seqlen_q", max_seqlen_q), _max_seqlen("max_seqlen_k",
                                                                           max_seqlen_k)
    (dq, dq_view), (dk, dk_view), (dv, dv_view) = (_output_like(frame, x, heads_first)
                                                   for x in (q, k, v))
    extra_kw, extras = _extra_grads(frame, q, opts, bias, rank=3)
    with errors:
        _ext.backward_varlen(frame.export(dout), frame.export(q), frame.export(k),
                             frame.export(v), frame.export(out), frame.export(lse), cu_q, cu_k,
                             max_q, max_k, frame.dest(dq_view), frame.dest(dk_view),
                             frame.dest(dv_view), deterministic=_checks.flag("deterministic", deterministic),
                             **opts, **extra_kw)
    return (frame.finish(dq), frame.finish(dk), frame.finish(dv)) + extras()
