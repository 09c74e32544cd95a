"""The argument layer of every front end (NumPy, torch, JAX, the drop-ins, the KV cache, ring and
Ulysses attention): what Python alone checks of the options, named as the public API names them,
and the layout and output helpers the NumPy-level calls share. The core checks the values (ranges,
shapes, dtypes, devices) and names the argument; nothing here imports a framework.
"""

from __future__ import annotations

import numbers
import secrets
from typing import TYPE_CHECKING, Any, Optional, Tuple, Union

import numpy as np

from . import _checks
from ._frameworks import dtype_name, is_numpy_bfloat16

ArrayLike = Any
"""An array of NumPy, PyTorch, JAX or CuPy (or any CPU array with __dlpack__); the outputs come
back in the caller's framework: the same type for NumPy, PyTorch, JAX and CuPy, NumPy arrays for
other DLPack CPU arrays. Any, as no common array type covers these frameworks."""

BlockSize = Union[int, Tuple[int, int]]
"""block_size: an int for both, or a pair (block_q, block_k)."""

if TYPE_CHECKING:
    from typing_extensions import TypedDict

    class _Options(TypedDict, total=False):
        """The keyword options that attention and attention_varlen of every front end share: the
        typing overloads take them as **options: Unpack[...] (the implementations name each with
        its default and document it)."""

        causal: bool
        softmax_scale: Optional[float]
        schedule: str
        window_size: Tuple[int, int]
        dropout_p: float
        seed: Optional[int]
        offset: int
        block_mask: Optional[ArrayLike]
        block_size: BlockSize
        alibi_slopes: Optional[ArrayLike]
        softcap: float
        bias: Optional[ArrayLike]
        mask: Optional[ArrayLike]
        sinks: Optional[ArrayLike]
        layout: str

    class AttentionOptions(_Options, total=False):
        """flashdl.attention's: also the dropout slice."""

        dropout_batch_offset: int
        dropout_head_offset: int
        dropout_nheads_total: int

    class VarlenOptions(_Options, total=False):
        """flashdl.attention_varlen's: also the paged keys and values."""

        block_table: Optional[ArrayLike]
        seqused_k: Optional[ArrayLike]

    class TorchOptions(_Options, total=False):
        """flashdl.torch.attention's: also the backward's determinism."""

        deterministic: bool

    class TorchVarlenOptions(VarlenOptions, total=False):
        """flashdl.torch.attention_varlen's."""

        deterministic: bool


FLOATS_FWD = ("q", "k", "v")


FLOATS_BWD = ("dout", "q", "k", "v", "out")


def window_pair(window_size):
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(
            "window_size: expected a pair (left, right) of ints, -1 for unbounded, "
            f"got {window_size!r}"
        ) from None
    what = "a pair (left, right) of ints that fit int64, -1 for unbounded"
    return (_checks.integer("window_size", left, what), _checks.integer("window_size", right, what))


def unsigned(name, x, bits):
    """x as an int in [0, 2**bits): TypeError for a non-integer (a bool too), ValueError out of
    range."""
    return _checks.integer(name, x, f"an int in [0, 2**{bits})", 0, 2**bits)


def dropout_probability(dropout_p):
    """A float; the core checks the range [0, 1) and names dropout_p."""
    return _checks.real("dropout_p", dropout_p, "a float in [0, 1)")


def draw_seed() -> int:
    """A fresh random dropout seed, 63 bits from the OS (secrets), never NumPy's global state."""
    return secrets.randbits(63)


def dropout_args(dropout_p, seed, offset):
    """(dropout_p, seed, offset) validated; seed None draws one (only when dropout_p > 0)."""
    dropout_p = dropout_probability(dropout_p)
    if seed is None:
        seed = draw_seed() if dropout_p > 0 else 0
    # The offset is a 32-bit Philox counter word (the core checks it too).
    return dropout_p, unsigned("seed", seed, 64), unsigned("offset", offset, 32)


def block_sparse(block_mask, block_size):
    """The extension's block-sparse keywords. block_mask: None (dense) or any CPU array that crosses
    DLPack (NumPy, or the framework of q); the core checks dtype bool, rank, shape and device.
    block_size: an int or a pair (block_q, block_k) of ints >= 1."""
    what = "an int or a pair (block_q, block_k) of ints"
    try:
        pair = (
            (block_size, block_size)
            if type(block_size) is int or isinstance(block_size, numbers.Integral)
            else block_size
        )
        bq, bk = pair
    except (TypeError, ValueError):
        raise TypeError(f"block_size: expected {what}, got {block_size!r}") from None
    bq, bk = (_checks.integer("block_size", x, what) for x in (bq, bk))
    if not (1 <= bq < 2**63 and 1 <= bk < 2**63):
        raise ValueError(f"block_size: expected block sizes in [1, 2**63), got ({bq}, {bk})")
    if block_mask is not None and not (
        isinstance(block_mask, np.ndarray) or hasattr(block_mask, "__dlpack__")
    ):
        raise TypeError(
            "block_mask: expected None or a bool array (NumPy or the framework of q) "
            f"of shape (nblocks_q, nblocks_k), got {type(block_mask).__name__}"
        )
    if block_mask is not None:
        _checks.readable("block_mask", block_mask)
    return dict(block_mask=block_mask, block_size_q=bq, block_size_k=bk)


def score_mods(alibi_slopes, softcap):
    """The extension's score-modifier keywords. alibi_slopes: None or a float32 array that crosses
    DLPack (NumPy, or the framework of q, on the device of q); the core checks dtype, shape and
    device. softcap: a float >= 0 (0: off); the core checks the range."""
    softcap = _checks.real("softcap", softcap, "a float >= 0 (0: off)")
    if alibi_slopes is not None:
        if not (isinstance(alibi_slopes, np.ndarray) or hasattr(alibi_slopes, "__dlpack__")):
            raise TypeError(
                "alibi_slopes: expected None or a float32 array (NumPy or the "
                "framework of q) of shape (nheads,) or (batch, nheads), "
                f"got {type(alibi_slopes).__name__}"
            )
        _checks.readable("alibi_slopes", alibi_slopes)
        if getattr(alibi_slopes, "requires_grad", False):
            alibi_slopes = alibi_slopes.detach()  # the slopes are not differentiated
    return dict(alibi_slopes=alibi_slopes, softcap=float(softcap))


def array_arg(name, x, what):
    """x, an array that crosses DLPack (NumPy, or the framework of q), else TypeError naming it."""
    if not (isinstance(x, np.ndarray) or hasattr(x, "__dlpack__")):
        raise TypeError(
            f"{name}: expected None or {what} (NumPy or the framework of q), got {type(x).__name__}"
        )
    _checks.readable(name, x)
    return x


def strides(x):
    """Element strides of a NumPy array or torch tensor; None for arrays without strides (JAX)."""
    if isinstance(x, np.ndarray):
        return tuple(s // x.itemsize for s in x.strides) if x.itemsize else (0,) * x.ndim
    stride = getattr(x, "stride", None)
    return tuple(stride()) if callable(stride) else None


def full_rank(name, x, rank, layout):
    """A bias or mask of rank <= `rank` as a view of rank `rank` (size-1 axes in front: NumPy
    broadcasting); more axes than that, or none, are refused naming the argument."""
    nd = len(getattr(x, "shape", ()))
    if not 1 <= nd <= rank:
        raise ValueError(
            f"{name}: expected an array of rank 1 to {rank} broadcastable to "
            f"{layout}, got rank {nd}"
        )
    return x[(None,) * (rank - nd)] if nd < rank else x


def compact(x):
    """x with every leading axis of stride 0 (a broadcast view: np.broadcast_to, torch expand)
    narrowed to size 1: the array dBias sums into. A view; for torch, autograd carries the
    gradient back through it to the broadcast tensor."""
    st = strides(x)
    if st is None:
        return x
    index = tuple(
        slice(0, 1) if st[a] == 0 and x.shape[a] > 1 else slice(None) for a in range(len(st) - 1)
    )
    return x[index] if any(i != slice(None) for i in index) else x


def extras(sinks, bias=None, mask=None, rank=4, for_grad=False):
    """The extension's keywords for an attention bias, boolean mask and sinks. bias: a float
    array broadcastable to (batch, nheads, seqlen_q, seqlen_k) ((nheads, total_q, max_seqlen_k)
    for varlen, rank 3), fewer axes taken as leading size-1 ones; mask: a bool array of the same
    shapes; sinks: float32 (nheads,). The core checks dtypes, shapes and devices. Torch tensors
    that require grad cross detached (flashdl.torch returns their gradients). for_grad: the
    backward's bias, with stride-0 axes narrowed to size 1 (the shape dbias takes)."""
    layout = (
        "(batch, nheads, seqlen_q, seqlen_k)" if rank == 4 else "(nheads, total_q, max_seqlen_k)"
    )
    out = {}
    if bias is not None:
        bias = full_rank("bias", array_arg("bias", bias, "a float array"), rank, layout)
        out["bias"] = compact(bias) if for_grad else bias
    if mask is not None:
        out["mask"] = full_rank("mask", array_arg("mask", mask, "a bool array"), rank, layout)
    if sinks is not None:
        out["sinks"] = array_arg("sinks", sinks, "a float32 array of shape (nheads,)")
    if bias is not None and dtype_name(bias) in ("int16", "uint16"):
        # (16-bit integers would be read as bfloat16 where NumPy bfloat16 arrays cross as uint16)
        raise TypeError(
            f"bias: unsupported dtype {dtype_name(bias)} (expected float32, float16 or bfloat16)"
        )
    for name, x in list(out.items()):
        if getattr(x, "requires_grad", False):
            out[name] = x.detach()
        elif is_numpy_bfloat16(x):
            out[name] = x.view(np.uint16)  # NumPy bfloat16 crosses as uint16 (see Frame.export)
            out["dtype"] = "bfloat16"  # ... and is read as bfloat16 (q, k, v are not int16)
    return out


def scalars(causal, softmax_scale, schedule, window_size):
    """(causal, softmax_scale, schedule, (left, right)) as far as Python checks them (the core
    checks the schedule's name and the values); flashdl.torch passes them on to its custom ops."""
    if not isinstance(schedule, str):
        raise TypeError(
            f"schedule: expected a str ('auto', 'fa1', 'fa2' or 'reference'), "
            f"got {type(schedule).__name__}"
        )
    if softmax_scale is not None:
        # NaN stands for None below the Python layers (flashdl.jax's attributes): refused here
        # alike on every entry point; the core bounds the value.
        softmax_scale = _checks.finite(
            "softmax_scale",
            _checks.real("softmax_scale", softmax_scale, "a float or None"),
            "a finite number or None",
        )
    return _checks.flag("causal", causal), softmax_scale, schedule, window_pair(window_size)


def options(causal, softmax_scale, schedule, window_size, frame):
    causal, softmax_scale, schedule, (left, right) = scalars(
        causal, softmax_scale, schedule, window_size
    )
    return dict(
        dtype=frame.dtype,
        softmax_scale=softmax_scale,
        causal=causal,
        window_left=left,
        window_right=right,
        schedule=schedule,
        stream=frame.stream,
    )


LAYOUTS = {"bshd": "(batch, seqlen, nheads, headdim)", "bhsd": "(batch, nheads, seqlen, headdim)"}


VARLEN_LAYOUTS = {"thd": "(total, nheads, headdim)", "htd": "(nheads, total, headdim)"}


def is_heads_first(layout, varlen=False):
    """True for the heads-first layout ('bhsd', or 'htd' for packed arrays), False for flashdl's
    own order ('bshd', 'thd')."""
    names = VARLEN_LAYOUTS if varlen else LAYOUTS
    if not isinstance(layout, str) or layout not in names:
        (own, own_axes), (other, other_axes) = names.items()
        raise ValueError(
            f"layout: expected {own!r} {own_axes} or {other!r} {other_axes}, got {layout!r}"
        )
    return layout != next(iter(names))


def as_bshd(name, x, rank=4):
    """A heads-first array ((batch, nheads, seqlen, headdim), or (nheads, total, headdim) packed)
    as the (batch, seqlen, nheads, headdim) ((total, nheads, headdim)) view the core reads: a
    view in NumPy, PyTorch and CuPy; JAX, which has no views, transposes."""
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != rank or not hasattr(x, "swapaxes"):
        layout, axes = ("bhsd", LAYOUTS["bhsd"]) if rank == 4 else ("htd", VARLEN_LAYOUTS["htd"])
        raise ValueError(
            f"{name}: with layout={layout!r} expected a rank-{rank} array {axes}, got shape {shape}"
        )
    return x.swapaxes(rank - 3, rank - 2)


def fits(q, k, v, heads_first, same_batch=True):
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


class LayoutErrors:
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
        names = VARLEN_LAYOUTS if self.varlen else LAYOUTS
        (own, own_axes), (other, other_axes) = names.items()
        if self.heads_first:
            (own, own_axes), (other, other_axes) = (other, other_axes), (own, own_axes)
        if len(self.shapes) != 3:
            return ""
        q, k, v = self.shapes
        if fits(q, k, v, self.heads_first, self.same_batch) or not fits(
            q, k, v, not self.heads_first, self.same_batch
        ):
            return ""
        return (
            f"; {self.names} of shapes {q}, {k}, {v} do not fit layout={own!r} {own_axes} but "
            f"fit {other_axes}: pass layout={other!r} if that is their order"
        )

    def __exit__(self, kind, err, tb):
        if kind is None or not issubclass(kind, ValueError):
            return False
        base = getattr(err, "_flashdl_base", str(err))
        msg = base
        if self.heads_first:
            layout, own = (
                ("htd", "(total, nheads, headdim)")
                if self.varlen
                else ("bhsd", "(batch, seqlen, nheads, headdim)")
            )
            msg += f" (layout={layout!r}: shapes above are in flashdl's {own} order)"
        msg += self._hint()
        new = ValueError(msg)
        new._flashdl_base = base  # type: ignore[attr-defined]
        raise new from None


def output_like(frame, x, heads_first):
    """An output shaped like x ((batch, seqlen, nheads, headdim), or (total, nheads, headdim)
    packed) and the view the core writes: with a heads-first layout the output is a contiguous
    heads-first array and the core writes it through a transposed view."""
    shape = tuple(x.shape)
    if not heads_first or len(shape) not in (3, 4):
        out = frame.empty(shape, x.dtype)
        return out, out
    ax = len(shape) - 3  # the seqlen (total) axis; heads follow it
    swapped = shape[:ax] + (shape[ax + 1], shape[ax]) + shape[ax + 2 :]
    out = frame.empty(swapped, x.dtype)
    return out, out.swapaxes(ax, ax + 1)


def lse_shape(q):
    shape = tuple(q.shape)
    # A wrongly ranked q gets a placeholder; the core then reports q itself.
    return (shape[0], shape[2], shape[1]) if len(shape) == 4 else (0, 0, 0)


def conversion(name, x):
    """The one-line conversion of an index array to int32 in the caller's framework."""
    framework = type(x).__module__.split(".")[0]
    if framework == "torch":
        return f"{name}.to(torch.int32)"
    if framework in ("jax", "jaxlib"):
        return f"{name}.astype(jnp.int32)"
    return f"{name}.astype(np.int32)"


def int32_index(name, x):
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
            if str(dtype).split(".")[-1] in (
                "int64",
                "int16",
                "int8",
                "uint8",
                "uint16",
                "uint32",
                "uint64",
            ):
                raise TypeError(
                    f"{name}: expected an int32 array, got {str(dtype)} in device "
                    f"memory; convert it with {conversion(name, x)}"
                ) from None
            return x
    else:
        host = x
    if host.dtype.kind not in "iu":
        return x
    if host.size and (host.min() < -(2**31) or host.max() >= 2**31):
        bad = host.max() if host.max() >= 2**31 else host.min()
        raise ValueError(f"{name}: expected int32 values, got {bad} in an {host.dtype} array")
    return host.astype(np.int32)


def cu_seqlens(name, x):
    """cu_seqlens as the extension takes it: any CPU array that crosses DLPack (NumPy, torch,
    JAX), integer arrays narrowed to int32 (int32_index); the core checks dtype, rank, device
    and the offsets themselves."""
    if isinstance(x, np.ndarray) or hasattr(x, "__dlpack__"):
        if getattr(x, "requires_grad", False):
            x = x.detach()
        return int32_index(name, x)
    raise TypeError(
        f"{name}: expected an int32 array (NumPy or the framework of q) of shape "
        f"(batch + 1,), got {type(x).__name__}"
    )


def max_seqlen(name, x):
    return _checks.integer(name, x, "an int that fits int64")


def varlen_lse_shape(q):
    shape = tuple(q.shape)
    # A wrongly ranked q gets a placeholder; the core then reports q itself.
    return (shape[1], shape[0]) if len(shape) == 3 else (0, 0)


def heads(q, rank=4):
    """nheads of a (batch, seqlen, nheads, headdim) q (or (total, nheads, headdim) for varlen); 0
    for a wrongly ranked q, which the core then names."""
    shape = tuple(q.shape)
    return shape[rank - 2] if len(shape) == rank else 0


def extra_grads(frame, q, opts, given_bias, rank=4):
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
        dsinks = frame.empty((heads(q, rank),), frame.float32())
        kw["dsinks"] = frame.dest(dsinks)
        arrays.append(("dsinks", dsinks))

    def finish():
        result = []
        for name, x in arrays:
            x = frame.finish(x)
            if name == "dbias":
                x = in_shape_of(x, given_bias)
            result.append(x)
        return tuple(result)

    return kw, finish


def in_shape_of(dbias, bias):
    """dbias (the compact gradient) in the shape of the bias the caller gave: leading size-1
    axes dropped, axes the caller broadcast with a stride of 0 broadcast back (a view holding the
    gradient of the shared value)."""
    shape = tuple(bias.shape)
    dbias = dbias.reshape(tuple(dbias.shape)[len(dbias.shape) - len(shape) :])
    if tuple(dbias.shape) == shape:
        return dbias
    if isinstance(dbias, np.ndarray):
        return np.broadcast_to(dbias, shape)
    expand = getattr(dbias, "expand", None)
    return expand(*shape) if callable(expand) else dbias


def backward_dropout(dropout_p, seed, offset):
    """The backward's dropout keywords: the seed the forward used (never drawn here)."""
    if seed is None:
        raise TypeError("seed: expected the int seed the forward used, got None")
    dropout_p, seed, offset = dropout_args(dropout_p, seed, offset)
    return dict(dropout_p=dropout_p, seed=seed, offset=offset)
