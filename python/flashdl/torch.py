"""PyTorch autograd for flashdl: flashdl.torch.attention(q, k, v) with loss.backward() support.

attention and attention_varlen are torch.library custom ops (flashdl::attention_forward,
flashdl::attention_backward, flashdl::attention_varlen_forward, flashdl::attention_varlen_backward)
with fake (meta) implementations and a registered autograd formula, so torch.compile (also with
fullgraph=True) and torch.export see one op each instead of breaking the graph at an opaque
Python call. The forward saves q, k, v, out and lse (and, with dropout, the seed tensor and the
offset, not the mask); the backward recomputes the attention matrix and the dropout mask block
by block (flashdl.attention_backward), as FlashAttention does, instead of storing them.

In eager mode (nothing compiling, exporting, tracing or intercepting ops) attention skips the ops:
a plain autograd.Function calls the extension directly, with the same results bit for bit.
"""

from __future__ import annotations

from typing import List, Literal, Optional, Tuple, Union, overload

import numpy as np
import torch

from . import _api, _checks, _ext, _sdpa
from ._api import (_FLOATS_FWD, ArrayLike, BlockSize, _as_bshd, _block_sparse, _compact,
                   _cu_seqlens, _extras, _full_rank,
                   _dropout, _int32_index, _layout, _LayoutErrors, _lse_shape, _max_seqlen,
                   _scalars, _score_mods, _varlen_lse_shape)
from ._api import attention as _attention
from ._api import attention_backward as _attention_backward
from ._api import attention_varlen as _attention_varlen
from ._api import attention_varlen_backward as _attention_varlen_backward
from ._context_parallel import (context_parallel_attention, context_parallel_groups,
                                context_parallel_shard, context_parallel_unshard)
from ._frameworks import Frame
from ._kvcache import attention_with_kvcache as _attention_with_kvcache
from ._ring import ring_attention
from ._ring import shard as ring_shard
from ._ring import unshard as ring_unshard
from ._ulysses import ulysses_attention

# What would intercept an op (looked up once: a tiny call's fast-path check runs them each call).
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._len_torch_function_stack
_functorch_active = torch._C._are_functorch_transforms_active
_is_compiling = torch.compiler.is_compiling
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

if not hasattr(torch.library, "custom_op"):
    raise ImportError("flashdl.torch needs PyTorch >= 2.4 (torch.library.custom_op), found "
                      f"{torch.__version__}")

__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "context_parallel_attention",
           "context_parallel_groups", "context_parallel_shard", "context_parallel_unshard",
           "ring_attention", "ring_shard", "ring_unshard", "scaled_dot_product_attention",
           "ulysses_attention"]


def _last_dim_contiguous(dout):
    """Autograd often hands over broadcast gradients (e.g. of .sum(): every stride 0); the
    kernels need a contiguous last dimension."""
    if dout.shape[-1] > 1 and dout.stride(-1) != 1:
        return dout.contiguous()
    return dout


# ---- the custom ops ------------------------------------------------------------------------------
#
# Their schemas take only tensors, ints, floats, bools, strs and lists of ints: the public
# functions below validate every argument (naming it) and convert NumPy arrays to tensors first.
# The dropout seed crosses as a 0-dim int64 tensor holding the 64-bit seed in two's complement
# (None without dropout), so that a seed drawn under torch.compile stays a tensor in the graph;
# the implementations read it back as a host int (on CUDA, one synchronisation).

def _seed_int(seed: Optional[torch.Tensor]) -> int:
    """The 64-bit dropout seed an op received: 0 for None, else the int64 value mod 2**64."""
    if seed is None:
        return 0
    if seed.dtype != torch.int64 or seed.dim() != 0:
        raise ValueError("seed: expected a 0-dim int64 tensor (the 64-bit seed in two's "
                         f"complement), got {seed.dtype} of shape {tuple(seed.shape)}")
    return int(seed.item()) % 2**64


def _pair(x: List[int]) -> Tuple[int, int]:
    return x[0], x[1]


# The forward ops' implementations, by id(op): _call runs them directly when nothing would
# intercept the op (see _dispatch_free).
_EAGER_IMPLS: dict = {}


def _forward_op(name):
    """torch.library.custom_op(name) for a forward op, remembering its implementation."""
    def wrap(fn):
        op = torch.library.custom_op(name, fn, mutates_args=())
        _EAGER_IMPLS[id(op)] = fn
        return op
    return wrap


def _dispatch_free(args) -> bool:
    """Whether an op call may run its implementation directly instead of through torch's
    dispatcher, which costs tens of microseconds a call (most of a small call's time): only when
    nothing would intercept it -- no autograd (no tensor argument requires grad while grad mode
    is on), no tensor subclass (FakeTensor, DTensor), no dispatch or function mode
    (FlopCounterMode, FakeTensorMode), no functorch transform (vmap, grad). The implementation is
    the op's own, so the result is the same."""
    if (torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack()
            or torch._C._are_functorch_transforms_active()):
        return False
    grad = torch.is_grad_enabled()
    for a in args:
        if isinstance(a, torch.Tensor) and (type(a) is not torch.Tensor
                                            or (grad and a.requires_grad)):
            return False
    return True


@_forward_op("flashdl::attention_forward")
def _attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       softmax_scale: Optional[float], schedule: str, window_size: List[int],
                       dropout_p: float, seed: Optional[torch.Tensor], offset: int,
                       block_mask: Optional[torch.Tensor], block_size: List[int],
                       alibi_slopes: Optional[torch.Tensor], softcap: float,
                       deterministic: bool, bias: Optional[torch.Tensor],
        mask: Optional[torch.Tensor], sinks: Optional[torch.Tensor]
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of flashdl.attention; deterministic is only for the backward (saved by the
    autograd formula), it does not change the forward."""
    return _attention(q, k, v, causal=causal, softmax_scale=softmax_scale, schedule=schedule,
                      window_size=_pair(window_size), dropout_p=dropout_p, seed=_seed_int(seed),
                      offset=offset, block_mask=block_mask, block_size=_pair(block_size),
                      alibi_slopes=alibi_slopes, softcap=softcap, bias=bias, mask=mask, sinks=sinks,
                      return_lse=True)


@_attention_forward.register_fake
def _attention_forward_fake(q, k, v, *args):
    # Contiguous, like the real outputs (flashdl allocates them with torch.empty).
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q), dtype=torch.float32)


@torch.library.custom_op("flashdl::attention_backward", mutates_args=())
def _attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, lse: torch.Tensor, causal: bool,
                           softmax_scale: Optional[float], schedule: str,
                           window_size: List[int], dropout_p: float,
                           seed: Optional[torch.Tensor], offset: int,
                           block_mask: Optional[torch.Tensor], block_size: List[int],
                           alibi_slopes: Optional[torch.Tensor], softcap: float,
                           deterministic: bool, bias: Optional[torch.Tensor],
        mask: Optional[torch.Tensor], sinks: Optional[torch.Tensor]
                           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                 torch.Tensor]:
    """(dq, dk, dv, dbias, dsinks) of flashdl.attention_backward; dbias, dsinks empty without
    a bias, sinks."""
    grads = _attention_backward(dout, q, k, v, out, lse, causal=causal,
                                softmax_scale=softmax_scale, schedule=schedule,
                                window_size=_pair(window_size), deterministic=deterministic,
                                dropout_p=dropout_p, seed=_seed_int(seed), offset=offset,
                                block_mask=block_mask, block_size=_pair(block_size),
                                alibi_slopes=alibi_slopes, softcap=softcap, bias=bias, mask=mask,
                                sinks=sinks)
    return _with_extra_grads(q, grads, bias, sinks)


def _with_extra_grads(q, grads, bias, sinks):
    """The backward ops' results: (dq, dk, dv, dbias, dsinks), dbias and dsinks empty tensors
    where no bias or sinks were given (an op's outputs are tensors, never None)."""
    dq, dk, dv, *extra = grads
    dbias = extra.pop(0) if bias is not None else q.new_empty((0,))
    dsinks = extra.pop(0) if sinks is not None else q.new_empty((0,), dtype=torch.float32)
    return dq, dk, dv, dbias, dsinks


def _extra_grads_fake(q, bias, sinks):
    return (bias.new_empty(bias.shape) if bias is not None else q.new_empty((0,)),
            q.new_empty(tuple(sinks.shape) if sinks is not None else (0,), dtype=torch.float32))


@_attention_backward_op.register_fake
def _attention_backward_fake(dout, q, k, v, *args):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)) + \
        _extra_grads_fake(q, args[-3], args[-1])


# The options after q, k, v (and the varlen arguments) in both schemas, in the forward's order.
_OPTIONS = ("causal", "softmax_scale", "schedule", "window_size", "dropout_p", "seed", "offset",
            "block_mask", "block_size", "alibi_slopes", "softcap", "deterministic", "bias", "mask",
            "sinks")
# The options with a gradient, in the order the backward ops return them.
_DIFFERENTIABLE = ("bias", "sinks")


def _save(ctx, tensors, out, lse, options):
    """Saves what a backward op needs: the inputs' tensors, out, lse and the options (the seed,
    block_mask, alibi_slopes and sinks tensors through save_for_backward, the rest as
    attributes)."""
    opts = dict(zip(_OPTIONS, options))
    ctx.save_for_backward(*tensors, out, lse, opts.pop("seed"), opts.pop("block_mask"),
                          opts.pop("alibi_slopes"), opts.pop("bias"), opts.pop("mask"),
                          opts.pop("sinks"))
    ctx.opts = opts
    # lse is returned for callers that want it (return_lse=True); no gradient flows into it.
    ctx.mark_non_differentiable(lse)


def _saved(ctx):
    """(tensors, out, lse, options) as _save kept them, the options as backward-op keywords."""
    *tensors, out, lse, seed, block_mask, alibi_slopes, bias, mask, sinks = ctx.saved_tensors
    return tensors, out, lse, dict(ctx.opts, seed=seed, block_mask=block_mask,
                                   alibi_slopes=alibi_slopes, bias=bias, mask=mask, sinks=sinks)


def _option_grads(ctx, first, opts, extra):
    """The gradients of the options (None but for the differentiable ones that were given and
    need one); first: the index of the first option among the forward op's inputs."""
    grads = [None] * len(_OPTIONS)
    for name, g in zip(_DIFFERENTIABLE, extra):
        i = _OPTIONS.index(name)
        if opts[name] is not None and ctx.needs_input_grad[first + i]:
            grads[i] = g
    return tuple(grads)


def _attention_setup(ctx, inputs, output):
    _save(ctx, inputs[:3], *output, inputs[3:])


def _attention_grad(ctx, dout, _dlse):
    (q, k, v), out, lse, opts = _saved(ctx)
    dq, dk, dv, *extra = _attention_backward_op(_last_dim_contiguous(dout), q, k, v, out, lse,
                                                **opts)
    return (dq, dk, dv) + _option_grads(ctx, 3, opts, extra)


_attention_forward.register_autograd(_attention_grad, setup_context=_attention_setup)


@_forward_op("flashdl::attention_varlen_forward")
def _attention_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                              max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                              softmax_scale: Optional[float], schedule: str,
                              window_size: List[int], dropout_p: float,
                              seed: Optional[torch.Tensor], offset: int,
                              block_mask: Optional[torch.Tensor], block_size: List[int],
                              alibi_slopes: Optional[torch.Tensor], softcap: float,
                              deterministic: bool, bias: Optional[torch.Tensor],
        mask: Optional[torch.Tensor], sinks: Optional[torch.Tensor]
                              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of flashdl.attention_varlen; deterministic only for the backward."""
    return _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             causal=causal, softmax_scale=softmax_scale, schedule=schedule,
                             window_size=_pair(window_size), dropout_p=dropout_p,
                             seed=_seed_int(seed), offset=offset, block_mask=block_mask,
                             block_size=_pair(block_size), alibi_slopes=alibi_slopes,
                             softcap=softcap, bias=bias, mask=mask, sinks=sinks, return_lse=True)


@_attention_varlen_forward.register_fake
def _attention_varlen_forward_fake(q, k, v, *args):
    return q.new_empty(q.shape), q.new_empty(_varlen_lse_shape(q), dtype=torch.float32)


@torch.library.custom_op("flashdl::attention_varlen_backward", mutates_args=())
def _attention_varlen_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                  v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                  cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                                  max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                                  softmax_scale: Optional[float], schedule: str,
                                  window_size: List[int], dropout_p: float,
                                  seed: Optional[torch.Tensor], offset: int,
                                  block_mask: Optional[torch.Tensor], block_size: List[int],
                                  alibi_slopes: Optional[torch.Tensor], softcap: float,
                                  deterministic: bool, bias: Optional[torch.Tensor],
        mask: Optional[torch.Tensor], sinks: Optional[torch.Tensor]
                                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                             torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dbias, dsinks) of flashdl.attention_varlen_backward (empty when not
    given)."""
    grads = _attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                      max_seqlen_q, max_seqlen_k, causal=causal,
                                      softmax_scale=softmax_scale, schedule=schedule,
                                      window_size=_pair(window_size),
                                      deterministic=deterministic, dropout_p=dropout_p,
                                      seed=_seed_int(seed), offset=offset, block_mask=block_mask,
                                      block_size=_pair(block_size), alibi_slopes=alibi_slopes,
                                      softcap=softcap, bias=bias, mask=mask, sinks=sinks)
    return _with_extra_grads(q, grads, bias, sinks)


@_attention_varlen_backward_op.register_fake
def _attention_varlen_backward_fake(dout, q, k, v, *args):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)) + \
        _extra_grads_fake(q, args[-3], args[-1])


def _attention_varlen_setup(ctx, inputs, output):
    _save(ctx, inputs[:5], *output, inputs[7:])
    ctx.max_seqlens = inputs[5:7]


def _attention_varlen_grad(ctx, dout, _dlse):
    (q, k, v, cu_q, cu_k), out, lse, opts = _saved(ctx)
    dq, dk, dv, *extra = _attention_varlen_backward_op(_last_dim_contiguous(dout), q, k, v, out,
                                                       lse, cu_q, cu_k, *ctx.max_seqlens, **opts)
    return (dq, dk, dv) + (None,) * 4 + _option_grads(ctx, 7, opts, extra)


_attention_varlen_forward.register_autograd(_attention_varlen_grad,
                                            setup_context=_attention_varlen_setup)


# ---- arguments: validated here, in the public API's order, then converted for the ops --------

def _tensors(arrays: dict, api: str) -> None:
    """q, k, v must be torch tensors: the framework errors of flashdl.attention for mixed or
    unknown arrays, a TypeError pointing to flashdl.attention for other frameworks' arrays."""
    if all(isinstance(x, torch.Tensor) for x in arrays.values()):
        return
    Frame(arrays, _FLOATS_FWD)  # raises for mixed frameworks and for non-arrays
    name = next(n for n, x in arrays.items() if not isinstance(x, torch.Tensor))
    raise TypeError(f"{name}: expected a torch.Tensor ({api} is for torch tensors; "
                    f"flashdl.{api.split('.')[-1]} takes other arrays), "
                    f"got {type(arrays[name]).__name__}")


def _draw_seed(device: torch.device) -> torch.Tensor:
    """A 0-dim int64 tensor of 63 random bits from the generator of device (torch.cuda's for a
    CUDA device, the CPU one otherwise), where torch's own dropout draws from: torch.manual_seed
    makes dropout repeatable, and under torch.compile the draw is an op of the graph (no
    .item()). flashdl.flash_attn draws its seeds here too."""
    return torch.randint(0, 2**63 - 1, (), dtype=torch.int64, device=device)


def _seed_tensor(dropout_p, seed, offset, device):
    """(dropout_p, seed tensor or None, offset) for the ops: seed None draws one (only when
    dropout_p > 0); an int seed in [0, 2**64) becomes its int64 two's complement."""
    if seed is None:
        dropout_p, _, offset = _dropout(dropout_p, 0, offset)
        return dropout_p, (_draw_seed(device) if dropout_p > 0 else None), offset
    dropout_p, seed, offset = _dropout(dropout_p, seed, offset)
    if not dropout_p > 0:
        return dropout_p, None, offset  # the seed selects nothing without dropout
    return dropout_p, torch.tensor(seed - 2**64 if seed >= 2**63 else seed,
                                   dtype=torch.int64), offset


def _as_tensor(name: str, x):
    """x for an op's schema: None, a tensor, or any other DLPack array (NumPy's included) as a
    tensor sharing its memory. A read-only NumPy array is copied first (torch cannot wrap one);
    under torch.compile, torch.from_numpy is what Dynamo traces (it makes the array a tensor)."""
    if x is None or isinstance(x, torch.Tensor):
        return x
    try:
        if isinstance(x, np.ndarray):
            if torch.compiler.is_compiling() or x.flags.writeable:
                return torch.from_numpy(x)
            return torch.from_numpy(x.copy(order="K"))
        if hasattr(x, "__dlpack__"):
            return torch.from_dlpack(x)
    except (TypeError, ValueError, RuntimeError, BufferError) as err:
        raise TypeError(f"{name}: cannot pass this {type(x).__name__} to torch ({err})") from None
    return x  # not an array: the caller's check names it


def _int64(name: str, x: int, what: str) -> int:
    if not -2**63 <= x < 2**63:
        raise ValueError(f"{name}: expected {what}, got {x}")
    return x


def _op_options(q, causal, softmax_scale, schedule, window_size, dropout_p, seed, offset,
                block_mask, block_size, deterministic, alibi_slopes, softcap, sinks=None,
                bias=None, mask=None, rank=4):
    """The ops' option arguments (_OPTIONS) from the public ones, every bad one named."""
    dropout_p, seed, offset = _seed_tensor(dropout_p, seed, offset, q.device)
    causal, softmax_scale, schedule, window = _scalars(causal, softmax_scale, schedule,
                                                       window_size)
    window = list(window)
    sparse = _block_sparse(_as_tensor("block_mask", block_mask), block_size)
    mods = _score_mods(_as_tensor("alibi_slopes", alibi_slopes), softcap)
    return (causal, softmax_scale, schedule, window, dropout_p, seed, offset, sparse["block_mask"],
            [sparse["block_size_q"], sparse["block_size_k"]], mods["alibi_slopes"],
            mods["softcap"], _checks.flag("deterministic", deterministic),
            *_extra_tensors(bias, mask, sinks, rank))


def _extra_tensors(bias, mask, sinks, rank):
    """(bias, mask, sinks) for the ops' schemas: tensors (gradients kept) of full rank, the bias
    with its broadcast (stride-0) axes narrowed to size 1, the shape its gradient takes."""
    layout = ("(batch, nheads, seqlen_q, seqlen_k)" if rank == 4
              else "(nheads, total_q, max_seqlen_k)")
    out = []
    for name, x in (("bias", bias), ("mask", mask)):
        x = _as_tensor(name, x)
        if x is not None:
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name}: expected None or a tensor broadcastable to {layout}, "
                                f"got {type(x).__name__}")
            x = _full_rank(name, x, rank, layout)
            if name == "bias":
                x = _compact(x)
        out.append(x)
    return out[0], out[1], _sinks_tensor(sinks)


def _sinks_tensor(sinks):
    """sinks for the ops' schema: None or a tensor (gradient kept); the core checks the rest."""
    sinks = _as_tensor("sinks", sinks)
    if sinks is not None and not isinstance(sinks, torch.Tensor):
        raise TypeError("sinks: expected None or a float32 tensor of shape (nheads,), got "
                        f"{type(sinks).__name__}")
    return sinks


def _call(op, arrays, heads_first, varlen, *args):
    """op(*args), its ValueErrors reworded for the caller's layout and shapes (_LayoutErrors);
    under torch.compile the op is called as it is (its fake implementation checks nothing)."""
    if torch.compiler.is_compiling():
        return op(*args)
    with _LayoutErrors(arrays, heads_first, varlen=varlen):
        impl = _EAGER_IMPLS.get(id(op))
        if impl is not None and _dispatch_free(args):
            return impl(*args)
        return op(*args)


# ---- the eager path ------------------------------------------------------------------------------
#
# Outside torch.compile, export and tracing, attention needs none of what the custom ops give:
# their dispatch, their registered autograd and the option processing that the NumPy-level API
# repeats in each of the forward and the backward cost a small training step more than its
# attention (cpu_tuning.md section 39). There attention is a plain autograd.Function over the
# extension: the options processed once a call (_op_options, as for the ops), the same core calls
# with the same arguments, so the results are the ops' bit for bit (test_torch checks it).

_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_is_tracing = torch._C._get_tracing_state
_grad_enabled = torch.is_grad_enabled
_to_dlpack = torch.utils.dlpack.to_dlpack
_empty, _empty_like = torch.empty, torch.empty_like
_float32, _contiguous = torch.float32, torch.contiguous_format
# Tests set this False to run the ops where the eager path would run.
_EAGER_PATH = True
# _op_options of attention's defaults, by causal.
_DEFAULT_OPTIONS = {c: (c, None, _AUTO, [-1, -1], 0.0, None, 0, None, [128, 128], None, 0.0, False,
                        None, None, None) for c in (False, True)}


def _eager_ok(tensors) -> bool:
    """Whether a call may take the eager path: not under torch.compile, export or torch.jit
    tracing, no dispatch or function mode (FakeTensorMode, FunctionalTensorMode, proxy modes,
    FlopCounterMode), no functorch transform (vmap, grad), and every tensor a plain one (or a
    Parameter): anything that would see the op gets the op."""
    if (not _EAGER_PATH or _is_compiling() or _dispatch_modes() or _function_modes()
            or _functorch_active() or _is_tracing() is not None):
        return False
    for x in tensors:
        if x is not None and x.__class__ not in _TENSOR_TYPES:
            return False
    return True


def _capsule(x):
    """What the extension reads for a tensor that needs no grad (Frame.export, Frame.dest)."""
    return _to_dlpack(x) if x.__class__ is _Tensor and x.is_cpu else x


def _contiguous_like(x):
    """A contiguous uninitialised tensor shaped and typed like x (Frame.empty)."""
    return _empty_like(x) if x.is_contiguous() else _empty_like(x, memory_format=_contiguous)


class _EagerCall:
    """One attention call's options as the extension's keywords (as _api.attention and
    attention_backward make them from the ops' arguments), made once for its forward and its
    backward; `plain`: every option at its default but causal (forward_default's call)."""

    __slots__ = ("arrays", "bhsd", "kw", "bias", "sinks", "deterministic", "plain")

    def __init__(self, arrays, bhsd, options):
        (causal, softmax_scale, schedule, window, dropout_p, seed, offset, block_mask, block_size,
         alibi_slopes, softcap, deterministic, bias, mask, sinks) = options
        self.arrays, self.bhsd, self.deterministic = arrays, bhsd, deterministic
        kw = {"causal": causal}
        if softmax_scale is not None:
            kw["softmax_scale"] = softmax_scale
        if window[0] != -1 or window[1] != -1:
            kw.update(window_left=window[0], window_right=window[1])
        if schedule != "auto":
            kw["schedule"] = schedule
        if dropout_p != 0.0:
            kw.update(dropout_p=dropout_p, seed=_seed_int(seed), offset=offset)
        elif offset != 0:
            kw["offset"] = offset
        # (block_mask, block_size, alibi_slopes and softcap as _op_options checked them)
        if block_mask is not None or block_size[0] != 128 or block_size[1] != 128:
            kw.update(block_mask=block_mask, block_size_q=block_size[0],
                      block_size_k=block_size[1])
        if alibi_slopes is not None or softcap != 0.0:
            kw.update(alibi_slopes=alibi_slopes, softcap=softcap)
        if bias is not None or mask is not None or sinks is not None:
            kw.update(_extras(sinks, bias, mask))
        self.kw, self.bias, self.sinks = kw, bias, sinks
        self.plain = len(kw) == 1

    def failed(self, err, tensors, names, arrays, bhsd):
        """Re-raises err of a call the extension refused as the full path words it: the checks
        Frame makes before the call first (_checks.readable), then _LayoutErrors' wording."""
        for name, x in zip(names, tensors):
            _checks.readable(name, x)
        with _LayoutErrors(arrays, bhsd):
            raise err

    def forward(self, q, k, v):
        """(out, lse) of tensors that need no grad (the Function detaches them)."""
        out = _contiguous_like(q)
        lse = _empty(_lse_shape(q), dtype=_float32, device=q.device)
        try:
            if q.is_neg() or k.is_neg() or v.is_neg():  # to_dlpack would drop the sign
                raise ValueError("a negative-bit view")
            if self.plain and q.is_cpu:
                _ext.forward_default(_capsule(q), _capsule(k), _capsule(v), _capsule(out),
                                     _capsule(lse), self.kw["causal"])
            else:
                _ext.forward(_capsule(q), _capsule(k), _capsule(v), _capsule(out),
                             _capsule(lse), stream=_stream(q), **self.kw)
        except Exception as err:  # noqa: BLE001 - re-raised, worded as the full path words it
            self.failed(err, (q, k, v), ("q", "k", "v"), self.arrays, self.bhsd)
        return out, lse

    def backward(self, dout, q, k, v, out, lse):
        """(dq, dk, dv, dbias or None, dsinks or None) as the backward op computes them, from
        tensors that need no grad."""
        dout = _last_dim_contiguous(dout)
        dq, dk, dv = _contiguous_like(q), _contiguous_like(k), _contiguous_like(v)
        kw = self.kw
        dbias = dsinks = None
        if self.bias is not None or self.sinks is not None or q.is_cuda or self.deterministic:
            kw = dict(kw, stream=_stream(q), deterministic=self.deterministic)
            if self.bias is not None:
                dbias = _empty(self.bias.shape, dtype=self.bias.dtype, device=q.device)
                kw["dbias"] = _capsule(dbias)
            if self.sinks is not None:
                dsinks = _empty((q.shape[2],), dtype=_float32, device=q.device)
                kw["dsinks"] = _capsule(dsinks)
        try:
            if dout.is_neg():
                raise ValueError("a negative-bit view")
            if dout.requires_grad:  # (create_graph)
                dout = dout.detach()
            _ext.backward(_capsule(dout), _capsule(q), _capsule(k), _capsule(v), _capsule(out),
                          _capsule(lse), _capsule(dq), _capsule(dk), _capsule(dv), **kw)
        except Exception as err:  # noqa: BLE001 - re-raised, worded as the full path words it
            self.failed(err, (dout,), ("dout",), (q, k, v), False)
        return dq, dk, dv, dbias, dsinks


def _stream(x) -> int:
    """The caller's current stream on the device of x (0 off CUDA), as Frame takes it."""
    return int(torch.cuda.current_stream(x.device).cuda_stream) if x.is_cuda else 0


class _EagerAttention(torch.autograd.Function):
    """attention's autograd outside compilation: call (an _EagerCall) runs the forward and the
    backward; bias and sinks are inputs for their gradients. q, k, v, out and the gradients are
    in the caller's layout, transposed here for a heads-first call (views, no autograd nodes of
    their own: four fewer nodes a call). The tensors are saved detached (sharing their version
    counters: an in-place change before the backward is still caught)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, sinks, call):
        q, k, v = q.detach(), k.detach(), v.detach()
        if call.bhsd:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out, lse = call.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse, bias, sinks)
        ctx.call = call
        # lse is returned for callers that want it (return_lse=True); no gradient flows into it.
        ctx.mark_non_differentiable(lse)
        return (out.transpose(1, 2) if call.bhsd else out.view_as(out)), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if _grad_enabled():  # create_graph=True: no double backward
            return _EagerAttention._once_backward(ctx, dout, _dlse)
        q, k, v, out, lse, _bias, _sinks = ctx.saved_tensors
        call = ctx.call
        dq, dk, dv, dbias, dsinks = call.backward(dout.transpose(1, 2) if call.bhsd else dout,
                                                  q, k, v, out, lse)
        if call.bhsd:
            dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        needs = ctx.needs_input_grad
        return (dq, dk, dv, dbias if needs[3] else None, dsinks if needs[4] else None, None)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def _once_backward(ctx, dout, _dlse):
        return _EagerAttention.backward(ctx, dout, _dlse)


# autograd.Function.apply without its Python wrapper (a fifth of the eager forward's own time
# at 16 x 16): what the wrapper adds is for functorch transforms, which take the op here, and
# its unwrapping of dead functorch wrappers, done below.
_function_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _EagerAttention)
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def _eager_attention(arrays, bhsd, options):
    """(out, lse) of the eager path, out in the layout of arrays (the caller's q, k, v): through
    _EagerAttention where autograd needs it."""
    call = _EagerCall(arrays, bhsd, options)
    bias, sinks = call.bias, call.sinks
    q, k, v = arrays
    if _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or
                            (bias is not None and bias.requires_grad) or
                            (sinks is not None and sinks.requires_grad)):
        return _function_apply(_unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v),
                               None if bias is None else _unwrap_if_dead(bias),
                               None if sinks is None else _unwrap_if_dead(sinks), call)
    q, k, v = q.detach(), k.detach(), v.detach()
    if not bhsd:
        return call.forward(q, k, v)
    out, lse = call.forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2), lse


def _cu_tensor(name, x):
    """cu_seqlens for the varlen ops: a tensor, integer dtypes narrowed to int32 where their
    values fit (a GPU tensor of another integer dtype is refused, naming the conversion)."""
    x = _as_tensor(name, x)
    if isinstance(x, torch.Tensor) and x.dtype not in (torch.int32, torch.bool) and \
            not x.is_floating_point() and not x.is_complex():
        if torch.compiler.is_compiling():
            x = x.to(torch.int32)
        else:
            x = _as_tensor(name, _int32_index(name, x.detach()))
    return _cu_seqlens(name, x)


@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
              softmax_scale: Optional[float] = ..., schedule: str = ...,
              window_size: Tuple[int, int] = ..., dropout_p: float = ...,
              seed: Optional[int] = ..., offset: int = ..., block_mask: Optional[ArrayLike] = ...,
              block_size: BlockSize = ..., deterministic: bool = ...,
              alibi_slopes: Optional[ArrayLike] = ..., softcap: float = ...,
              bias: Optional[ArrayLike] = ..., mask: Optional[ArrayLike] = ...,
              sinks: Optional[ArrayLike] = ..., return_lse: Literal[False] = ..., layout: str = ...) -> torch.Tensor: ...
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
              softmax_scale: Optional[float] = ..., schedule: str = ...,
              window_size: Tuple[int, int] = ..., dropout_p: float = ...,
              seed: Optional[int] = ..., offset: int = ..., block_mask: Optional[ArrayLike] = ...,
              block_size: BlockSize = ..., deterministic: bool = ...,
              alibi_slopes: Optional[ArrayLike] = ..., softcap: float = ...,
              bias: Optional[ArrayLike] = ..., mask: Optional[ArrayLike] = ...,
              sinks: Optional[ArrayLike] = ..., return_lse: Literal[True], layout: str = ...
              ) -> Tuple[torch.Tensor, torch.Tensor]: ...
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
              softmax_scale: Optional[float] = ..., schedule: str = ...,
              window_size: Tuple[int, int] = ..., dropout_p: float = ...,
              seed: Optional[int] = ..., offset: int = ..., block_mask: Optional[ArrayLike] = ...,
              block_size: BlockSize = ..., deterministic: bool = ...,
              alibi_slopes: Optional[ArrayLike] = ..., softcap: float = ...,
              bias: Optional[ArrayLike] = ..., mask: Optional[ArrayLike] = ...,
              sinks: Optional[ArrayLike] = ..., return_lse: bool = ...,
              layout: str = ...) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]: ...


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              softmax_scale: Optional[float] = None, schedule: str = _AUTO,
              window_size: Tuple[int, int] = _NO_WINDOW, dropout_p: float = _ZERO,
              seed: Optional[int] = None, offset: int = _NO_OFFSET,
              block_mask: Optional[ArrayLike] = None, block_size: BlockSize = _BLOCK,
              deterministic: bool = False, alibi_slopes: Optional[ArrayLike] = None,
              softcap: float = _ZERO, bias: Optional[ArrayLike] = None,
              mask: Optional[ArrayLike] = None, sinks: Optional[ArrayLike] = None,
              return_lse: bool = False, layout: str = _BSHD
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
    if (q.__class__ is _Tensor  # (a NumPy q is refused by the full path)
            and (causal is False or causal is True) and (return_lse is False or return_lse is True)
            and softmax_scale is None and seed is None and block_mask is None
            and alibi_slopes is None and bias is None and mask is None and sinks is None
            and deterministic is False and (schedule is _AUTO or schedule == _AUTO)
            and (layout is _BSHD or layout is _BHSD or layout == _BSHD or layout == _BHSD)
            and (window_size is _NO_WINDOW
                 or (window_size.__class__ is tuple and window_size == _NO_WINDOW))
            and (dropout_p is _ZERO or (dropout_p.__class__ is float and dropout_p == 0.0))
            and (softcap is _ZERO or (softcap.__class__ is float and softcap == 0.0))
            and offset is _NO_OFFSET and block_size is _BLOCK
            and not _is_compiling() and not _dispatch_modes() and not _function_modes()
            and not _functorch_active()):
        # SDPA's layout through (batch, seqlen, nheads, headdim) views (the full path words the
        # errors and checks the ranks of a heads-first call).
        bhsd = layout is _BHSD or (layout is not _BSHD and layout == _BHSD)
        arrays = (q, k, v)
        if not bhsd or (k.__class__ in _TENSOR_TYPES and v.__class__ in _TENSOR_TYPES
                        and q.dim() == k.dim() == v.dim() == 4):
            if bhsd:
                q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            result = _api._fast_forward_torch(q, k, v, causal, return_lse)
            if result is not None:
                if not bhsd:
                    return result
                if return_lse:
                    return result[0].transpose(1, 2), result[1]
                return result.transpose(1, 2)
            # Declined (autograd, a GPU tensor, a refusal): the eager path with the defaults.
            if _EAGER_PATH and _is_tracing() is None and k.__class__ in _TENSOR_TYPES and \
                    v.__class__ in _TENSOR_TYPES:
                out, lse = _eager_attention(arrays, bhsd, _DEFAULT_OPTIONS[causal])
                return (out, lse) if return_lse else out
            q, k, v = arrays
    bhsd = _layout(layout)
    return_lse = _checks.flag("return_lse", return_lse)
    _tensors({"q": q, "k": k, "v": v}, "flashdl.torch.attention")
    arrays = (q, k, v)
    if bhsd:
        q, k, v = (_as_bshd(n, x) for n, x in (("q", q), ("k", k), ("v", v)))
    options = _op_options(q, causal, softmax_scale, schedule, window_size, dropout_p, seed,
                          offset, block_mask, block_size, deterministic, alibi_slopes, softcap,
                          sinks, bias, mask)
    if _eager_ok((q, k, v) + options[-3:] + (options[5], options[7], options[9])):
        out, lse = _eager_attention(arrays, bhsd, options)
        return (out, lse) if return_lse else out
    out, lse = _call(_attention_forward, arrays, bhsd, False, q, k, v, *options)
    if bhsd:
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


@overload
def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike, max_seqlen_q: int,
                     max_seqlen_k: int, *, causal: bool = ...,
                     softmax_scale: Optional[float] = ..., schedule: str = ...,
                     window_size: Tuple[int, int] = ..., dropout_p: float = ...,
                     seed: Optional[int] = ..., offset: int = ...,
                     block_mask: Optional[ArrayLike] = ..., block_size: BlockSize = ...,
                     deterministic: bool = ..., alibi_slopes: Optional[ArrayLike] = ...,
                     softcap: float = ..., bias: Optional[ArrayLike] = ...,
                     mask: Optional[ArrayLike] = ..., sinks: Optional[ArrayLike] = ..., return_lse: Literal[False] = ...,
                     layout: str = ..., block_table: Optional[ArrayLike] = ...,
                     seqused_k: Optional[ArrayLike] = ...) -> torch.Tensor: ...
@overload
def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike, max_seqlen_q: int,
                     max_seqlen_k: int, *, causal: bool = ...,
                     softmax_scale: Optional[float] = ..., schedule: str = ...,
                     window_size: Tuple[int, int] = ..., dropout_p: float = ...,
                     seed: Optional[int] = ..., offset: int = ...,
                     block_mask: Optional[ArrayLike] = ..., block_size: BlockSize = ...,
                     deterministic: bool = ..., alibi_slopes: Optional[ArrayLike] = ...,
                     softcap: float = ..., bias: Optional[ArrayLike] = ...,
                     mask: Optional[ArrayLike] = ..., sinks: Optional[ArrayLike] = ..., return_lse: Literal[True],
                     layout: str = ..., block_table: Optional[ArrayLike] = ...,
                     seqused_k: Optional[ArrayLike] = ...) -> Tuple[torch.Tensor, torch.Tensor]: ...
@overload
def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike, max_seqlen_q: int,
                     max_seqlen_k: int, *, causal: bool = ...,
                     softmax_scale: Optional[float] = ..., schedule: str = ...,
                     window_size: Tuple[int, int] = ..., dropout_p: float = ...,
                     seed: Optional[int] = ..., offset: int = ...,
                     block_mask: Optional[ArrayLike] = ..., block_size: BlockSize = ...,
                     deterministic: bool = ..., alibi_slopes: Optional[ArrayLike] = ...,
                     softcap: float = ..., bias: Optional[ArrayLike] = ...,
                     mask: Optional[ArrayLike] = ..., sinks: Optional[ArrayLike] = ..., return_lse: bool = ...,
                     layout: str = ..., block_table: Optional[ArrayLike] = ...,
                     seqused_k: Optional[ArrayLike] = ...
                     ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]: ...


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike, max_seqlen_q: int,
                     max_seqlen_k: int, *, causal: bool = False,
                     softmax_scale: Optional[float] = None, schedule: str = "auto",
                     window_size: Tuple[int, int] = (-1, -1), dropout_p: float = 0.0,
                     seed: Optional[int] = None, offset: int = 0,
                     block_mask: Optional[ArrayLike] = None, block_size: BlockSize = 128,
                     deterministic: bool = False, alibi_slopes: Optional[ArrayLike] = None,
                     softcap: float = 0.0, bias: Optional[ArrayLike] = None,
                     mask: Optional[ArrayLike] = None, sinks: Optional[ArrayLike] = None,
                     return_lse: bool = False, layout: str = "thd",
                     block_table: Optional[ArrayLike] = None,
                     seqused_k: Optional[ArrayLike] = None
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
    causal, softmax_scale, schedule, window_size, dropout_p, seed, offset, block_mask, block_size, deterministic, alibi_slopes, softcap : optional
        As in :func:`attention` and :func:`flashdl.attention_varlen`. With dropout, sequence ``b``
        gets the mask dense batch ``b`` would get; with a block mask, its plane ``b`` (or the shared
        one), blocks counted from the sequence's start.
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
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
            softmax_scale=softmax_scale, schedule=schedule, window_size=window_size,
            dropout_p=dropout_p, seed=seed, offset=offset, block_mask=block_mask,
            block_size=block_size, alibi_slopes=alibi_slopes, softcap=softcap,
            return_lse=return_lse, layout=layout, block_table=block_table, seqused_k=seqused_k)
    heads_first = _layout(layout, varlen=True)
    return_lse = _checks.flag("return_lse", return_lse)
    _tensors({"q": q, "k": k, "v": v}, "flashdl.torch.attention_varlen")
    arrays = (q, k, v)
    if heads_first:
        q, k, v = (_as_bshd(n, x, rank=3) for n, x in (("q", q), ("k", k), ("v", v)))
    options = _op_options(q, causal, softmax_scale, schedule, window_size, dropout_p, seed, offset,
                          block_mask, block_size, deterministic, alibi_slopes, softcap, sinks,
                          bias, mask, rank=3)
    cu_q, cu_k = (_cu_tensor(n, x) for n, x in (("cu_seqlens_q", cu_seqlens_q),
                                                  ("cu_seqlens_k", cu_seqlens_k)))
    max_q, max_k = (_int64(n, _max_seqlen(n, x), "an int that fits int64") for n, x in (
        ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)))
    out, lse = _call(_attention_varlen_forward, arrays, heads_first, True, q, k, v, cu_q, cu_k,
                     max_q, max_k, *options)
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
        raise NotImplementedError(f"{ctx.what}: flashdl.torch.attention_varlen with paged keys "
                                  "and values (or seqused_k) is forward only, as in flash-attn; "
                                  "no backward")


def _attention_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            *, return_lse, block_table, seqused_k, **options):
    """attention_varlen with block_table or seqused_k: flashdl.attention_varlen on detached
    tensors, the output tied to the inputs by _ForwardOnly where they require grad."""
    _tensors({"q": q, "k": k, "v": v}, "flashdl.torch.attention_varlen")
    cu_q, cu_k = (_cu_tensor(n, x) for n, x in (("cu_seqlens_q", cu_seqlens_q),
                                                  ("cu_seqlens_k", cu_seqlens_k)))
    with torch.no_grad():
        out, lse = _attention_varlen(q.detach(), k.detach(), v.detach(), cu_q, cu_k,
                                     max_seqlen_q, max_seqlen_k, return_lse=True,
                                     block_table=block_table, seqused_k=seqused_k, **options)
    needs = [x for x in (q, k, v) if x.requires_grad]
    if needs and torch.is_grad_enabled():
        what = "block_table" if block_table is not None else "seqused_k"
        out = _ForwardOnly.apply(out, what, *needs)
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, *, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` computed by flashdl, autograd included.

    PyTorch's signature, layout and semantics, over :func:`attention` with transposed views (no
    copies; a strided last dimension is copied, as flashdl needs stride 1 there), so it is a custom
    op for ``torch.compile`` and ``torch.export``. Errors name PyTorch's arguments.

    Parameters
    ----------
    query : torch.Tensor (batch, heads, seq_q, dim)
        Or rank 3, (batch, seq_q, dim).
    key, value : torch.Tensor (batch, heads_kv, seq_k, dim)
        Or rank 3. value's head dim must equal query's.
    attn_mask : torch.Tensor, optional
        Broadcastable to (batch, heads, seq_q, seq_k): a bool mask (True: the key takes part;
        flashdl's ``mask``, tiles it hides entirely are skipped) or a float mask added to the
        scores (flashdl's ``bias``, read in place, with its gradient when it requires grad). A
        query row that the mask leaves no key gets output 0 (not NaN).
    dropout_p : float, default 0.0
        flashdl's Philox dropout with a seed drawn from the generator of query's device
        (``torch.manual_seed`` repeats it): the same distribution as torch's dropout, not the same
        mask as torch's RNG stream would give.
    is_causal : bool, default False
        PyTorch's TOP-LEFT alignment: key ``j`` visible to query ``i`` iff ``j <= i`` (unlike
        :func:`attention`'s bottom-right ``causal``; the two agree when ``seq_q == seq_k``).
    scale : float, optional
        None is ``1 / sqrt(dim)``.
    enable_gqa : bool, default False
        True allows ``heads_kv`` dividing ``heads`` (query head ``h`` reads kv head
        ``h // (heads // heads_kv)``); with False the heads must be equal, or ``heads_kv`` 1 (torch
        broadcasts it).

    Returns
    -------
    torch.Tensor (batch, heads, seq_q, dim)
        A view of flashdl's (batch, seq_q, heads, dim) output (rank 3 for rank-3 inputs).

    Raises
    ------
    ValueError
        Shapes that do not fit (e.g. different head counts without ``enable_gqa``).
    TypeError
        An argument of the wrong type (e.g. ``is_causal`` not a bool).

    Examples
    --------
    >>> import torch, torch.nn.functional as F, flashdl.torch
    >>> q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    >>> out = flashdl.torch.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5)
    True
    """
    _sdpa.check_layout(query, key, value, enable_gqa)
    rank3 = query.dim() == 3
    seq = 1 if rank3 else 2  # the seq axis in PyTorch's layout
    sq, sk = query.shape[seq], key.shape[seq]
    shape = (query.shape[0], sq, sk) if rank3 else (query.shape[0], query.shape[1], sq, sk)
    _sdpa.check_mask(attn_mask, shape, query.dtype)
    keep, causal, window = _sdpa.causal_args(is_causal, sq, sk)
    bias, mask = _sdpa.mask_args(attn_mask, rank3, sk, keep)

    def flashdl_layout(x: torch.Tensor, n: int) -> torch.Tensor:
        x = x.narrow(seq, 0, n)  # a view; only top-left causal with sq < sk drops keys
        x = x.unsqueeze(2) if rank3 else x.transpose(1, 2)
        return x.contiguous() if x.shape[-1] > 1 and x.stride(-1) != 1 else x

    try:
        out = attention(flashdl_layout(query, sq), flashdl_layout(key, keep),
                        flashdl_layout(value, keep), causal=causal, softmax_scale=scale,
                        window_size=window, dropout_p=dropout_p, bias=bias, mask=mask)
    except (ValueError, TypeError) as err:
        raise _sdpa.renamed(err) from None
    return out.squeeze(2) if rank3 else out.transpose(1, 2)


def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                           cache_seqlens: ArrayLike, k: Optional[torch.Tensor] = None,
                           v: Optional[torch.Tensor] = None,
                           block_table: Optional[ArrayLike] = None, causal: bool = False,
                           softmax_scale: Optional[float] = None,
                           window_size: Tuple[int, int] = (-1, -1), num_splits: int = 0,
                           return_lse: bool = False, alibi_slopes: Optional[ArrayLike] = None,
                           softcap: float = 0.0, layout: str = "bshd",
                           rotary_cos: Optional[torch.Tensor] = None,
                           rotary_sin: Optional[torch.Tensor] = None,
                           rotary_interleaved: bool = False,
                           cache_batch_idx: Optional[ArrayLike] = None,
                           cache_leftpad: Optional[ArrayLike] = None,
                           sinks: Optional[torch.Tensor] = None,
                           bias: Optional[torch.Tensor] = None,
                           mask: Optional[torch.Tensor] = None
                           ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`flashdl.attention_with_kvcache` for torch tensors (decoding; no autograd).

    Runs under ``torch.no_grad()`` and appends ``k``, ``v`` into ``k_cache``, ``v_cache`` in place
    when given.

    Parameters
    ----------
    q : torch.Tensor (batch, seqlen_q, nheads, headdim)
    k_cache, v_cache : torch.Tensor
        (batch, seqlen_cache, nheads_kv, headdim), or paged (num_pages, page_size, nheads_kv,
        headdim) with ``block_table``.
    cache_seqlens : int32 tensor (batch,)
        A CPU tensor (or NumPy array), also for CUDA q (copied to the device on the current
        stream).
    k, v, block_table, causal, softmax_scale, window_size, num_splits, return_lse, alibi_slopes, softcap : optional
        As in :func:`flashdl.attention_with_kvcache` (``block_table`` a CPU int32 tensor or NumPy
        array).
    layout : {"bshd", "bhsd"}, default "bshd"
        ``"bhsd"``: q, k, v and out (batch, nheads, seqlen, headdim), the caches (batch, nheads_kv,
        seqlen_cache, headdim) as Hugging Face keeps them, read and written through transposed views.
    rotary_cos, rotary_sin, rotary_interleaved, cache_batch_idx, cache_leftpad : optional
        As in :func:`flashdl.attention_with_kvcache` (CPU tensors only yet).
    sinks : torch.Tensor, float32 (nheads,), optional
        Attention sinks (gpt-oss's ``s_aux``), as in :func:`flashdl.attention_with_kvcache` (no
        gradient here).
    bias, mask : torch.Tensor, optional
        An additive bias and a boolean mask (True = keep) broadcastable to (batch, nheads,
        seqlen_q, seqlen_cache), as in :func:`flashdl.attention_with_kvcache` (no gradient).

    Returns
    -------
    out : torch.Tensor (batch, seqlen_q, nheads, headdim)
    lse : torch.Tensor, float32 (batch, nheads, seqlen_q)
        With ``return_lse=True``.

    Raises
    ------
    ValueError
        As :func:`flashdl.attention_with_kvcache`.
    TypeError
        An argument of the wrong type.

    Examples
    --------
    >>> import torch, flashdl.torch
    >>> k_cache, v_cache = torch.zeros(1, 8, 2, 16), torch.zeros(1, 8, 2, 16)
    >>> lens = torch.tensor([2], dtype=torch.int32)
    >>> q, k, v = torch.randn(1, 1, 4, 16), torch.randn(1, 1, 2, 16), torch.randn(1, 1, 2, 16)
    >>> out = flashdl.torch.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, k=k, v=v)
    >>> out.shape, torch.equal(k_cache[0, 2], k[0, 0])
    (torch.Size([1, 1, 4, 16]), True)
    """
    with torch.no_grad():
        return _attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, k=k,
                                       v=v, block_table=block_table, causal=causal,
                                       softmax_scale=softmax_scale, window_size=window_size,
                                       num_splits=num_splits, return_lse=return_lse,
                                       alibi_slopes=alibi_slopes, softcap=softcap,
                                       layout=layout, rotary_cos=rotary_cos,
                                       rotary_sin=rotary_sin,
                                       rotary_interleaved=rotary_interleaved,
                                       cache_batch_idx=cache_batch_idx,
                                       cache_leftpad=cache_leftpad, sinks=sinks, bias=bias,
                                       mask=mask)
