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


# The options after q, k, v (and the varlen arguments) in every op's schema, in the forward's
# order, and their names.
_OPTIONS_SCHEMA = (
    "bool causal, float? softmax_scale, str schedule, SymInt[] window_size, float dropout_p, "
    "Tensor? seed, SymInt offset, Tensor? block_mask, SymInt[] block_size, Tensor? alibi_slopes, "
    "float softcap, bool deterministic, Tensor? bias, Tensor? mask, Tensor? sinks"
)
_OPTIONS = tuple(arg.split()[-1] for arg in _OPTIONS_SCHEMA.split(", "))
# The options with a gradient, in the order the backward ops return them.
_DIFFERENTIABLE = ("bias", "sinks")
_VARLEN_SCHEMA = (
    "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k"
)
_BACKWARD_SCHEMA = "Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse"
# (out, lse) of a forward op; (dq, dk, dv, dbias, dsinks) of a backward one.
_FORWARD_RESULTS = "(Tensor, Tensor)"
_BACKWARD_RESULTS = "(Tensor, Tensor, Tensor, Tensor, Tensor)"

# The forward ops' implementations, by id(op): call runs them directly when nothing would
# intercept the op (see dispatch_free).
_EAGER_IMPLS: dict = {}


def _op(name, inputs, results):
    """torch.library.custom_op(name) over an implementation taking inputs (a schema's leading
    arguments) and then the options (_OPTIONS_SCHEMA), one schema for the options of every op;
    a forward op's implementation is remembered for call."""

    def wrap(fn):
        schema = f"({inputs}, {_OPTIONS_SCHEMA}) -> {results}"
        op = torch.library.custom_op(name, fn, mutates_args=(), schema=schema)
        if results == _FORWARD_RESULTS:
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


def _keywords(options, backward: bool) -> dict:
    """flashdl.attention's (backward: attention_backward's) keywords for an op's options: the
    pairs as tuples, the seed as an int; deterministic only for the backward (the forward op
    takes it for the autograd formula to save, it does not change the forward)."""
    opts = dict(zip(_OPTIONS, options))
    opts.update(
        window_size=_pair(opts["window_size"]),
        block_size=_pair(opts["block_size"]),
        seed=seed_int(opts["seed"]),
    )
    if not backward:
        del opts["deterministic"]
    return opts


@_op("flashdl::attention_forward", "Tensor q, Tensor k, Tensor v", _FORWARD_RESULTS)
def attention_forward_op(q, k, v, *options):
    """(out, lse) of flashdl.attention."""
    return _attention(q, k, v, return_lse=True, **_keywords(options, backward=False))


@attention_forward_op.register_fake
def _attention_forward_fake(q, k, v, *args):
    # Contiguous, like the real outputs (flashdl allocates them with torch.empty).
    return q.new_empty(q.shape), q.new_empty(_args.lse_shape(q), dtype=torch.float32)


@_op("flashdl::attention_backward", _BACKWARD_SCHEMA, _BACKWARD_RESULTS)
def attention_backward_op(dout, q, k, v, out, lse, *options):
    """(dq, dk, dv, dbias, dsinks) of flashdl.attention_backward; dbias, dsinks empty without
    a bias, sinks."""
    opts = _keywords(options, backward=True)
    grads = _attention_backward(dout, q, k, v, out, lse, **opts)
    return _with_extra_grads(q, grads, opts["bias"], opts["sinks"])


def _with_extra_grads(q, grads, bias, sinks):
    """The backward ops' results: (dq, dk, dv, dbias, dsinks), dbias and dsinks empty tensors
    where no bias or sinks were given (an op's outputs are tensors, never None)."""
    dq, dk, dv, *extra = grads
    dbias = extra.pop(0) if bias is not None else q.new_empty((0,))
    dsinks = extra.pop(0) if sinks is not None else q.new_empty((0,), dtype=torch.float32)
    return dq, dk, dv, dbias, dsinks


def _backward_fake(dout, q, k, v, *args):
    """The backward ops' fake results (args end with the options: bias, mask, sinks)."""
    bias, sinks = args[-3], args[-1]
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
        bias.new_empty(bias.shape) if bias is not None else q.new_empty((0,)),
        q.new_empty(tuple(sinks.shape) if sinks is not None else (0,), dtype=torch.float32),
    )


attention_backward_op.register_fake(_backward_fake)


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


@_op(
    "flashdl::attention_varlen_forward",
    f"Tensor q, Tensor k, Tensor v, {_VARLEN_SCHEMA}",
    _FORWARD_RESULTS,
)
def varlen_forward_op(q, k, v, cu_q, cu_k, max_q, max_k, *options):
    """(out, lse) of flashdl.attention_varlen."""
    opts = _keywords(options, backward=False)
    return _attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, **opts)


@varlen_forward_op.register_fake
def _attention_varlen_forward_fake(q, k, v, *args):
    return q.new_empty(q.shape), q.new_empty(_args.varlen_lse_shape(q), dtype=torch.float32)


@_op(
    "flashdl::attention_varlen_backward",
    f"{_BACKWARD_SCHEMA}, {_VARLEN_SCHEMA}",
    _BACKWARD_RESULTS,
)
def varlen_backward_op(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *options):
    """(dq, dk, dv, dbias, dsinks) of flashdl.attention_varlen_backward (empty when not
    given)."""
    opts = _keywords(options, backward=True)
    grads = _attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, **opts)
    return _with_extra_grads(q, grads, opts["bias"], opts["sinks"])


varlen_backward_op.register_fake(_backward_fake)


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
