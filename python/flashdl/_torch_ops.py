"""The torch.library custom ops of flashdl.torch (flashdl::attention_forward,
flashdl::attention_backward, flashdl::attention_varlen_forward, flashdl::attention_varlen_backward):
their schemas, fake (meta) implementations and registered autograd formulas, over the NumPy-level
flashdl.attention and flashdl.attention_backward. torch.compile (also with fullgraph=True) and
torch.export see one op each instead of breaking the graph at an opaque Python call.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from . import _args
from ._api import attention as _attention
from ._api import attention_backward as _attention_backward
from ._varlen import attention_varlen as _attention_varlen
from ._varlen import attention_varlen_backward as _attention_varlen_backward

if not hasattr(torch.library, "custom_op"):
    raise ImportError(
        f"flashdl.torch needs PyTorch >= 2.4 (torch.library.custom_op), found {torch.__version__}"
    )


def last_dim_contiguous(dout):
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


def seed_int(seed: Optional[torch.Tensor]) -> int:
    """The 64-bit dropout seed an op received: 0 for None, else the int64 value mod 2**64."""
    if seed is None:
        return 0
    if seed.dtype != torch.int64 or seed.dim() != 0:
        raise ValueError(
            "seed: expected a 0-dim int64 tensor (the 64-bit seed in two's "
            f"complement), got {seed.dtype} of shape {tuple(seed.shape)}"
        )
    return int(seed.item()) % 2**64


def _pair(x: List[int]) -> Tuple[int, int]:
    return x[0], x[1]


# The forward ops' implementations, by id(op): call runs them directly when nothing would
# intercept the op (see dispatch_free).
_EAGER_IMPLS: dict = {}


def _forward_op(name):
    """torch.library.custom_op(name) for a forward op, remembering its implementation."""

    def wrap(fn):
        op = torch.library.custom_op(name, fn, mutates_args=())
        _EAGER_IMPLS[id(op)] = fn
        return op

    return wrap


def dispatch_free(args) -> bool:
    """Whether an op call may run its implementation directly instead of through torch's
    dispatcher, which costs tens of microseconds a call (most of a small call's time): only when
    nothing would intercept it -- no autograd (no tensor argument requires grad while grad mode
    is on), no tensor subclass (FakeTensor, DTensor), no dispatch or function mode
    (FlopCounterMode, FakeTensorMode), no functorch transform (vmap, grad). The implementation is
    the op's own, so the result is the same."""
    if (
        torch._C._len_torch_dispatch_stack()
        or torch._C._len_torch_function_stack()
        or torch._C._are_functorch_transforms_active()
    ):
        return False
    grad = torch.is_grad_enabled()
    for a in args:
        if isinstance(a, torch.Tensor) and (
            type(a) is not torch.Tensor or (grad and a.requires_grad)
        ):
            return False
    return True


@_forward_op("flashdl::attention_forward")
def attention_forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: Optional[float],
    schedule: str,
    window_size: List[int],
    dropout_p: float,
    seed: Optional[torch.Tensor],
    offset: int,
    block_mask: Optional[torch.Tensor],
    block_size: List[int],
    alibi_slopes: Optional[torch.Tensor],
    softcap: float,
    deterministic: bool,
    bias: Optional[torch.Tensor],
    mask: Optional[torch.Tensor],
    sinks: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of flashdl.attention; deterministic is only for the backward (saved by the
    autograd formula), it does not change the forward."""
    return _attention(
        q,
        k,
        v,
        causal=causal,
        softmax_scale=softmax_scale,
        schedule=schedule,
        window_size=_pair(window_size),
        dropout_p=dropout_p,
        seed=seed_int(seed),
        offset=offset,
        block_mask=block_mask,
        block_size=_pair(block_size),
        alibi_slopes=alibi_slopes,
        softcap=softcap,
        bias=bias,
        mask=mask,
        sinks=sinks,
        return_lse=True,
    )


@attention_forward_op.register_fake
def _attention_forward_fake(q, k, v, *args):
    # Contiguous, like the real outputs (flashdl allocates them with torch.empty).
    return q.new_empty(q.shape), q.new_empty(_args.lse_shape(q), dtype=torch.float32)


@torch.library.custom_op("flashdl::attention_backward", mutates_args=())
def attention_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: Optional[float],
    schedule: str,
    window_size: List[int],
    dropout_p: float,
    seed: Optional[torch.Tensor],
    offset: int,
    block_mask: Optional[torch.Tensor],
    block_size: List[int],
    alibi_slopes: Optional[torch.Tensor],
    softcap: float,
    deterministic: bool,
    bias: Optional[torch.Tensor],
    mask: Optional[torch.Tensor],
    sinks: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dbias, dsinks) of flashdl.attention_backward; dbias, dsinks empty without
    a bias, sinks."""
    grads = _attention_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        causal=causal,
        softmax_scale=softmax_scale,
        schedule=schedule,
        window_size=_pair(window_size),
        deterministic=deterministic,
        dropout_p=dropout_p,
        seed=seed_int(seed),
        offset=offset,
        block_mask=block_mask,
        block_size=_pair(block_size),
        alibi_slopes=alibi_slopes,
        softcap=softcap,
        bias=bias,
        mask=mask,
        sinks=sinks,
    )
    return _with_extra_grads(q, grads, bias, sinks)


def _with_extra_grads(q, grads, bias, sinks):
    """The backward ops' results: (dq, dk, dv, dbias, dsinks), dbias and dsinks empty tensors
    where no bias or sinks were given (an op's outputs are tensors, never None)."""
    dq, dk, dv, *extra = grads
    dbias = extra.pop(0) if bias is not None else q.new_empty((0,))
    dsinks = extra.pop(0) if sinks is not None else q.new_empty((0,), dtype=torch.float32)
    return dq, dk, dv, dbias, dsinks


def _extra_grads_fake(q, bias, sinks):
    return (
        bias.new_empty(bias.shape) if bias is not None else q.new_empty((0,)),
        q.new_empty(tuple(sinks.shape) if sinks is not None else (0,), dtype=torch.float32),
    )


@attention_backward_op.register_fake
def _attention_backward_fake(dout, q, k, v, *args):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)) + _extra_grads_fake(
        q, args[-3], args[-1]
    )


# The options after q, k, v (and the varlen arguments) in both schemas, in the forward's order.
_OPTIONS = (
    "causal",
    "softmax_scale",
    "schedule",
    "window_size",
    "dropout_p",
    "seed",
    "offset",
    "block_mask",
    "block_size",
    "alibi_slopes",
    "softcap",
    "deterministic",
    "bias",
    "mask",
    "sinks",
)
# The options with a gradient, in the order the backward ops return them.
_DIFFERENTIABLE = ("bias", "sinks")


def _save(ctx, tensors, out, lse, options):
    """Saves what a backward op needs: the inputs' tensors, out, lse and the options (the seed,
    block_mask, alibi_slopes and sinks tensors through save_for_backward, the rest as
    attributes)."""
    opts = dict(zip(_OPTIONS, options))
    ctx.save_for_backward(
        *tensors,
        out,
        lse,
        opts.pop("seed"),
        opts.pop("block_mask"),
        opts.pop("alibi_slopes"),
        opts.pop("bias"),
        opts.pop("mask"),
        opts.pop("sinks"),
    )
    ctx.opts = opts
    # lse is returned for callers that want it (return_lse=True); no gradient flows into it.
    ctx.mark_non_differentiable(lse)


def _saved(ctx):
    """(tensors, out, lse, options) as _save kept them, the options as backward-op keywords."""
    *tensors, out, lse, seed, block_mask, alibi_slopes, bias, mask, sinks = ctx.saved_tensors
    return (
        tensors,
        out,
        lse,
        dict(
            ctx.opts,
            seed=seed,
            block_mask=block_mask,
            alibi_slopes=alibi_slopes,
            bias=bias,
            mask=mask,
            sinks=sinks,
        ),
    )


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
    out, lse = output
    _save(ctx, inputs[:3], out, lse, inputs[3:])


def _attention_grad(ctx, dout, _dlse):
    (q, k, v), out, lse, opts = _saved(ctx)
    dq, dk, dv, *extra = attention_backward_op(last_dim_contiguous(dout), q, k, v, out, lse, **opts)
    return (dq, dk, dv) + _option_grads(ctx, 3, opts, extra)


attention_forward_op.register_autograd(_attention_grad, setup_context=_attention_setup)


@_forward_op("flashdl::attention_varlen_forward")
def varlen_forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: Optional[float],
    schedule: str,
    window_size: List[int],
    dropout_p: float,
    seed: Optional[torch.Tensor],
    offset: int,
    block_mask: Optional[torch.Tensor],
    block_size: List[int],
    alibi_slopes: Optional[torch.Tensor],
    softcap: float,
    deterministic: bool,
    bias: Optional[torch.Tensor],
    mask: Optional[torch.Tensor],
    sinks: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of flashdl.attention_varlen; deterministic only for the backward."""
    return _attention_varlen(
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
        window_size=_pair(window_size),
        dropout_p=dropout_p,
        seed=seed_int(seed),
        offset=offset,
        block_mask=block_mask,
        block_size=_pair(block_size),
        alibi_slopes=alibi_slopes,
        softcap=softcap,
        bias=bias,
        mask=mask,
        sinks=sinks,
        return_lse=True,
    )


@varlen_forward_op.register_fake
def _attention_varlen_forward_fake(q, k, v, *args):
    return q.new_empty(q.shape), q.new_empty(_args.varlen_lse_shape(q), dtype=torch.float32)


@torch.library.custom_op("flashdl::attention_varlen_backward", mutates_args=())
def varlen_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: Optional[float],
    schedule: str,
    window_size: List[int],
    dropout_p: float,
    seed: Optional[torch.Tensor],
    offset: int,
    block_mask: Optional[torch.Tensor],
    block_size: List[int],
    alibi_slopes: Optional[torch.Tensor],
    softcap: float,
    deterministic: bool,
    bias: Optional[torch.Tensor],
    mask: Optional[torch.Tensor],
    sinks: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dbias, dsinks) of flashdl.attention_varlen_backward (empty when not
    given)."""
    grads = _attention_varlen_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal=causal,
        softmax_scale=softmax_scale,
        schedule=schedule,
        window_size=_pair(window_size),
        deterministic=deterministic,
        dropout_p=dropout_p,
        seed=seed_int(seed),
        offset=offset,
        block_mask=block_mask,
        block_size=_pair(block_size),
        alibi_slopes=alibi_slopes,
        softcap=softcap,
        bias=bias,
        mask=mask,
        sinks=sinks,
    )
    return _with_extra_grads(q, grads, bias, sinks)


@varlen_backward_op.register_fake
def _attention_varlen_backward_fake(dout, q, k, v, *args):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)) + _extra_grads_fake(
        q, args[-3], args[-1]
    )


def _attention_varlen_setup(ctx, inputs, output):
    out, lse = output
    _save(ctx, inputs[:5], out, lse, inputs[7:])
    ctx.max_seqlens = inputs[5:7]


def _attention_varlen_grad(ctx, dout, _dlse):
    (q, k, v, cu_q, cu_k), out, lse, opts = _saved(ctx)
    dq, dk, dv, *extra = varlen_backward_op(
        last_dim_contiguous(dout), q, k, v, out, lse, cu_q, cu_k, *ctx.max_seqlens, **opts
    )
    return (dq, dk, dv) + (None,) * 4 + _option_grads(ctx, 7, opts, extra)


varlen_forward_op.register_autograd(_attention_varlen_grad, setup_context=_attention_varlen_setup)


def call(op, arrays, heads_first, varlen, *args):
    """op(*args), its ValueErrors reworded for the caller's layout and shapes (_args.LayoutErrors);
    under torch.compile the op is called as it is (its fake implementation checks nothing)."""
    if torch.compiler.is_compiling():
        return op(*args)
    with _args.LayoutErrors(arrays, heads_first, varlen=varlen):
        impl = _EAGER_IMPLS.get(id(op))
        if impl is not None and dispatch_free(args):
            return impl(*args)
        return op(*args)
