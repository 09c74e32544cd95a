"""flashdl.torch.attention and attention_varlen: differentiable attention on torch tensors, the
custom ops under torch.compile, export and tracing, the eager autograd.Function elsewhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Optional, Tuple, Union, overload

import torch

from . import _args, _checks, _fast_path, _torch_eager
from ._args import ArrayLike, BlockSize
from ._torch_args import check_tensors, cu_tensor, int64, op_options
from ._torch_eager import (
    DEFAULT_OPTIONS,
    TENSOR_TYPES,
    dispatch_modes,
    eager_attention,
    eager_ok,
    function_modes,
    functorch_active,
    is_compiling,
    is_tracing,
)
from ._torch_ops import attention_forward_op, call, varlen_forward_op
from ._varlen import attention_varlen as _attention_varlen

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._args import TorchOptions, TorchVarlenOptions

_Tensor = torch.Tensor
# attention's defaults, by name: its fast path tests them by identity (`is`) first, which the
# default object itself passes (and any 0 or 128: CPython's shared small ints); an equal value the
# caller passed (flash-attn style `dropout_p=0.0`) is then tested by value, as before. Equality
# tests with type guards alone cost a tiny call 0.2 us more.
_NO_WINDOW = (-1, -1)
_ZERO = 0.0
_AUTO = "auto"
_BSHD = "bshd"
_BHSD = "bhsd"
_NO_OFFSET = 0
_BLOCK = 128


# Typing overloads, kept compact (a signature to a few lines, not a line per parameter).
# fmt: off
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              return_lse: Literal[False] = ..., **options: Unpack[TorchOptions]) -> torch.Tensor: ...
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, return_lse: Literal[True],
              **options: Unpack[TorchOptions]) -> Tuple[torch.Tensor, torch.Tensor]: ...
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, return_lse: bool = ...,
              **options: Unpack[TorchOptions]
              ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]: ...
# fmt: on


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    schedule: str = _AUTO,
    window_size: Tuple[int, int] = _NO_WINDOW,
    dropout_p: float = _ZERO,
    seed: Optional[int] = None,
    offset: int = _NO_OFFSET,
    block_mask: Optional[ArrayLike] = None,
    block_size: BlockSize = _BLOCK,
    deterministic: bool = False,
    alibi_slopes: Optional[ArrayLike] = None,
    softcap: float = _ZERO,
    bias: Optional[ArrayLike] = None,
    mask: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None,
    return_lse: bool = False,
    layout: str = _BSHD,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`flashdl.attention` for torch tensors, differentiable with respect to q, k and v.

    Under ``torch.compile`` (``fullgraph=True`` included, also with dropout), ``torch.export``,
    tracing, dispatch modes and functorch transforms the call is the custom op
    ``flashdl::attention_forward`` (its backward ``flashdl::attention_backward``), which their
    graphs keep as one op; in eager mode it is a plain ``autograd.Function`` over the same
    kernels (no op dispatch), with the same results bit for bit.

    Parameters
    ----------
    q : torch.Tensor (batch, seqlen_q, nheads, headdim)
        CPU or CUDA (on CUDA: float16 or bfloat16, the work on the current stream).
    k, v : torch.Tensor (batch, seqlen_k, nheads_kv, headdim)
        ``nheads`` a multiple of ``nheads_kv`` (GQA / MQA).
    causal, softmax_scale, schedule, window_size : optional
        As in :func:`flashdl.attention` (causal is bottom-right aligned).
    dropout_p : float, default 0.0
        In ``[0, 1)``, as in :func:`flashdl.attention`. Pass 0 at evaluation.
    seed : int, optional
        None (default) draws one from the generator of q's device (torch's CPU generator for CPU
        tensors, torch.cuda's for CUDA ones, as torch's dropout; so ``torch.manual_seed`` makes it
        repeatable). The backward reuses that seed and offset: the mask is regenerated, never
        stored. On CUDA the drawn seed is read back to the host: one synchronisation per call with
        dropout. Under ``torch.compile`` the seed is a ``torch.randint`` in the graph; inductor
        replaces that by its own generator unless ``torch._inductor.config.fallback_random`` is set,
        so its masks differ from eager ones (still repeatable under ``torch.manual_seed``).
    offset : int, default 0
        As in :func:`flashdl.attention`.
    block_mask, block_size : optional
        Block-sparse attention as in :func:`flashdl.attention` (a bool CPU tensor or NumPy array);
        the backward skips the same zero blocks. NumPy arrays are passed as tensors (no copy).
    deterministic : bool, default False
        Passed to the backward: on CUDA, fa2 accumulates dq with float atomics by default, so dq may
        differ in the last bits from run to run; True makes dq bitwise reproducible at some cost in
        speed. dk and dv are always reproducible, and so is every gradient on the CPU (for a given
        thread count).
    alibi_slopes : float32 tensor (nheads,) or (batch, nheads), optional
        As in :func:`flashdl.attention`, on the device of q; no gradient.
    softcap : float, default 0.0
        As in :func:`flashdl.attention`.
    return_lse : bool, default False
        Also return lse, float32 (batch, nheads, seqlen_q), without gradient (marked
        non-differentiable).
    layout : {"bshd", "bhsd"}, default "bshd"
        ``"bhsd"`` takes (batch, nheads, seqlen, headdim) tensors (SDPA's layout) through transposed
        views, no copy, and returns out as a (batch, nheads, seqlen_q, headdim) view.

    Returns
    -------
    out : torch.Tensor (batch, seqlen_q, nheads, headdim)
        Like q (in its layout), with autograd history.
    lse : torch.Tensor, float32 (batch, nheads, seqlen_q)
        With ``return_lse=True``.

    Raises
    ------
    ValueError
        Bad shapes, dtypes, devices or option values (the message names the argument).
    TypeError
        An argument of the wrong type (e.g. q not a tensor).

    Notes
    -----
    Double backward is not supported.

    Examples
    --------
    >>> import torch, flashdl.torch
    >>> q, k, v = (torch.randn(2, 16, 4, 8, requires_grad=True) for _ in range(3))
    >>> out = flashdl.torch.attention(q, k, v, causal=True, dropout_p=0.1)
    >>> out.sum().backward()
    >>> q.grad.shape
    torch.Size([2, 16, 4, 8])

    In PyTorch's (batch, nheads, seqlen, headdim) layout:

    >>> x = torch.randn(2, 4, 16, 8)
    >>> flashdl.torch.attention(x, x, x, layout="bhsd").shape
    torch.Size([2, 4, 16, 8])
    """
    # Default options on plain CPU tensors that need no autograd, with nothing that would intercept
    # the op (dispatch or function modes, functorch transforms): flashdl.attention's fast path,
    # the op's own implementation without its Python (a tiny call 25 -> 13 us; cpu_tuning.md
    # section 21). Anything else, and any call the fast path declines, takes the op.
    if (
        q.__class__ is _Tensor  # (a NumPy q is refused by the full path)
        and (causal is False or causal is True)
        and (return_lse is False or return_lse is True)
        and softmax_scale is None
        and seed is None
        and block_mask is None
        and alibi_slopes is None
        and bias is None
        and mask is None
        and sinks is None
        and deterministic is False
        and (schedule is _AUTO or schedule == _AUTO)
        and (layout is _BSHD or layout is _BHSD or layout == _BSHD or layout == _BHSD)
        and (window_size is _NO_WINDOW or _fast_path.int_pair(window_size, -1))
        and (dropout_p is _ZERO or (dropout_p.__class__ is float and dropout_p == 0.0))
        and (softcap is _ZERO or (softcap.__class__ is float and softcap == 0.0))
        and offset is _NO_OFFSET
        and block_size is _BLOCK
        and not is_compiling()
        and not dispatch_modes()
        and not function_modes()
        and not functorch_active()
    ):
        # SDPA's layout through (batch, seqlen, nheads, headdim) views (the full path words the
        # errors and checks the ranks of a heads-first call).
        bhsd = layout is _BHSD or (layout is not _BSHD and layout == _BHSD)
        arrays = (q, k, v)
        if not bhsd or (
            k.__class__ in TENSOR_TYPES
            and v.__class__ in TENSOR_TYPES
            and q.dim() == k.dim() == v.dim() == 4
        ):
            if q.requires_grad:  # forward_torch declines it: no transposed views made for it
                result = None
            else:
                if bhsd:
                    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                result = _fast_path.forward_torch(q, k, v, causal, return_lse)
            if result is not None:
                if not bhsd:
                    return result
                if return_lse:
                    return result[0].transpose(1, 2), result[1]
                return result.transpose(1, 2)
            # Declined (autograd, a GPU tensor, a refusal): the eager path with the defaults.
            if (
                _torch_eager.EAGER_PATH
                and is_tracing() is None
                and k.__class__ in TENSOR_TYPES
                and v.__class__ in TENSOR_TYPES
            ):
                out, lse = eager_attention(arrays, bhsd, DEFAULT_OPTIONS[causal])
                return (out, lse) if return_lse else out
            q, k, v = arrays
    bhsd = _args.is_heads_first(layout)
    return_lse = _checks.flag("return_lse", return_lse)
    check_tensors({"q": q, "k": k, "v": v}, "flashdl.torch.attention")
    arrays = (q, k, v)
    if bhsd:
        q, k, v = (_args.as_bshd(n, x) for n, x in (("q", q), ("k", k), ("v", v)))
    options = op_options(
        q,
        causal,
        softmax_scale,
        schedule,
        window_size,
        dropout_p,
        seed,
        offset,
        block_mask,
        block_size,
        deterministic,
        alibi_slopes,
        softcap,
        sinks,
        bias,
        mask,
    )
    if eager_ok((q, k, v) + options[-3:] + (options[5], options[7], options[9])):
        out, lse = eager_attention(arrays, bhsd, options)
        return (out, lse) if return_lse else out
    out, lse = call(attention_forward_op, arrays, bhsd, False, q, k, v, *options)
    if bhsd:
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


# Typing overloads, kept compact (a signature to a few lines, not a line per parameter).
# fmt: off
@overload
def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike, max_seqlen_q: int,
                     max_seqlen_k: int, *, return_lse: Literal[False] = ...,
                     **options: Unpack[TorchVarlenOptions]) -> torch.Tensor: ...
@overload
def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike, max_seqlen_q: int,
                     max_seqlen_k: int, *, return_lse: Literal[True],
                     **options: Unpack[TorchVarlenOptions]) -> Tuple[torch.Tensor, torch.Tensor]: ...
@overload
def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike, max_seqlen_q: int,
                     max_seqlen_k: int, *, return_lse: bool = ...,
                     **options: Unpack[TorchVarlenOptions]
                     ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]: ...
# fmt: on


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: ArrayLike,
    cu_seqlens_k: ArrayLike,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    schedule: str = "auto",
    window_size: Tuple[int, int] = (-1, -1),
    dropout_p: float = 0.0,
    seed: Optional[int] = None,
    offset: int = 0,
    block_mask: Optional[ArrayLike] = None,
    block_size: BlockSize = 128,
    deterministic: bool = False,
    alibi_slopes: Optional[ArrayLike] = None,
    softcap: float = 0.0,
    bias: Optional[ArrayLike] = None,
    mask: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None,
    return_lse: bool = False,
    layout: str = "thd",
    block_table: Optional[ArrayLike] = None,
    seqused_k: Optional[ArrayLike] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`flashdl.attention_varlen` for torch tensors, differentiable with respect to q, k and v.

    ``torch.compile`` and ``torch.export`` see the custom op ``flashdl::attention_varlen_forward``
    (backward ``flashdl::attention_varlen_backward``).

    Parameters
    ----------
    q : torch.Tensor (total_q, nheads, headdim)
        The queries of every sequence, packed.
    k, v : torch.Tensor (total_k, nheads_kv, headdim)
        The keys and values, packed.
    cu_seqlens_q, cu_seqlens_k : int32 tensor (batch + 1,)
        Cumulative sequence lengths, as in :func:`flashdl.attention_varlen`: CPU tensors (or NumPy
        arrays), or for CUDA q tensors on its device. Integer tensors of another type (int64, as
        ``torch.tensor`` makes them) are narrowed to int32 where every value fits.
    max_seqlen_q, max_seqlen_k : int
        Bounds on the sequence lengths.
    causal, softmax_scale, schedule, window_size, dropout_p, seed, offset : optional
        As in :func:`attention` and :func:`flashdl.attention_varlen`. With dropout, sequence ``b``
        gets the mask dense batch ``b`` would get.
    block_mask, block_size, deterministic, alibi_slopes, softcap : optional
        As in :func:`attention` and :func:`flashdl.attention_varlen`; with a block mask, sequence
        ``b`` gets its plane ``b`` (or the shared one), blocks counted from the sequence's start.
    return_lse : bool, default False
        Also return lse, float32 (nheads, total_q), without gradient.
    layout : {"thd", "htd"}, default "thd"
        ``"htd"`` takes (nheads, total, headdim) tensors through transposed views and returns out in
        that layout.
    block_table, seqused_k : int32 tensor, optional
        Paged keys and values, and the keys each sequence uses, as in
        :func:`flashdl.attention_varlen`: CPU tensors (or NumPy arrays), with ``cu_seqlens_q`` and
        ``cu_seqlens_k`` on the CPU too, also for CUDA q (the pages are then gathered on the
        device, on the current stream, as in :func:`flashdl.attention_varlen`).
        Forward only, as in flash-attn: the call is not a custom op then, and a backward through
        its output raises NotImplementedError.

    Returns
    -------
    out : torch.Tensor (total_q, nheads, headdim)
    lse : torch.Tensor, float32 (nheads, total_q)
        With ``return_lse=True``.

    Raises
    ------
    ValueError
        Bad shapes, offsets or options (the message names the argument).
    NotImplementedError
        The backward of a call with ``block_table`` or ``seqused_k``.
    TypeError
        An argument of the wrong type.

    Examples
    --------
    >>> import torch, flashdl.torch
    >>> cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    >>> q, k, v = (torch.randn(12, 2, 8, requires_grad=True) for _ in range(3))
    >>> out = flashdl.torch.attention_varlen(q, k, v, cu, cu, 7, 7, causal=True)
    >>> out.sum().backward()
    >>> out.shape, k.grad.shape
    (torch.Size([12, 2, 8]), torch.Size([12, 2, 8]))
    """
    if block_table is not None or seqused_k is not None:
        return _attention_varlen_paged(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            causal=causal,
            softmax_scale=softmax_scale,
            schedule=schedule,
            window_size=window_size,
            dropout_p=dropout_p,
            seed=seed,
            offset=offset,
            block_mask=block_mask,
            block_size=block_size,
            alibi_slopes=alibi_slopes,
            softcap=softcap,
            return_lse=return_lse,
            layout=layout,
            block_table=block_table,
            seqused_k=seqused_k,
        )
    heads_first = _args.is_heads_first(layout, varlen=True)
    return_lse = _checks.flag("return_lse", return_lse)
    check_tensors({"q": q, "k": k, "v": v}, "flashdl.torch.attention_varlen")
    arrays = (q, k, v)
    if heads_first:
        q, k, v = (_args.as_bshd(n, x, rank=3) for n, x in (("q", q), ("k", k), ("v", v)))
    options = op_options(
        q,
        causal,
        softmax_scale,
        schedule,
        window_size,
        dropout_p,
        seed,
        offset,
        block_mask,
        block_size,
        deterministic,
        alibi_slopes,
        softcap,
        sinks,
        bias,
        mask,
        rank=3,
    )
    cu_q, cu_k = (
        cu_tensor(n, x) for n, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
    )
    max_q, max_k = (
        int64(n, _args.max_seqlen(n, x), "an int that fits int64")
        for n, x in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k))
    )
    out, lse = call(
        varlen_forward_op, arrays, heads_first, True, q, k, v, cu_q, cu_k, max_q, max_k, *options
    )
    if heads_first:
        out = out.transpose(0, 1)
    return (out, lse) if return_lse else out


class _ForwardOnly(torch.autograd.Function):
    """out as it is, with a backward that refuses (paged varlen is forward only, as in
    flash-attn): gradients never stop silently at it."""

    @staticmethod
    def forward(ctx, out, what, *inputs):
        ctx.what = what
        return out.view_as(out)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"{ctx.what}: flashdl.torch.attention_varlen with paged keys "
            "and values (or seqused_k) is forward only, as in flash-attn; "
            "no backward"
        )


def _attention_varlen_paged(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    return_lse,
    block_table,
    seqused_k,
    **options,
):
    """attention_varlen with block_table or seqused_k: flashdl.attention_varlen on detached
    tensors, the output tied to the inputs by _ForwardOnly where they require grad."""
    check_tensors({"q": q, "k": k, "v": v}, "flashdl.torch.attention_varlen")
    cu_q, cu_k = (
        cu_tensor(n, x) for n, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
    )
    with torch.no_grad():
        out, lse = _attention_varlen(
            q.detach(),
            k.detach(),
            v.detach(),
            cu_q,
            cu_k,
            max_seqlen_q,
            max_seqlen_k,
            return_lse=True,
            block_table=block_table,
            seqused_k=seqused_k,
            **options,
        )
    needs = [x for x in (q, k, v) if x.requires_grad]
    if needs and torch.is_grad_enabled():
        what = "block_table" if block_table is not None else "seqused_k"
        out = _ForwardOnly.apply(out, what, *needs)
    return (out, lse) if return_lse else out
