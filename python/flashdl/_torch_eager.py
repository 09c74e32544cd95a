"""flashdl.torch.attention outside torch.compile, export and tracing: a plain autograd.Function
over the extension, with the custom ops' results bit for bit.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from . import _args, _checks, _ext
from ._torch_ops import seed_int

# What would intercept an op (looked up once: a tiny call's fast-path check runs them each call).
dispatch_modes = torch._C._len_torch_dispatch_stack
function_modes = torch._C._len_torch_function_stack
functorch_active = torch._C._are_functorch_transforms_active
is_compiling = torch.compiler.is_compiling
_Tensor = torch.Tensor

# ---- the eager path ------------------------------------------------------------------------------
#
# Outside torch.compile, export and tracing, attention needs none of what the custom ops give:
# their dispatch, their registered autograd and the option processing that the NumPy-level API
# repeats in each of the forward and the backward cost a small training step more than its
# attention (cpu_tuning.md section 39). There attention is a plain autograd.Function over the
# extension: the options processed once a call (op_options, as for the ops), the same core calls
# with the same arguments, so the results are the ops' bit for bit (test_torch checks it).

TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
is_tracing = torch._C._get_tracing_state
_grad_enabled = torch.is_grad_enabled
_to_dlpack = torch.utils.dlpack.to_dlpack
_empty, _empty_like = torch.empty, torch.empty_like
_float32, _contiguous = torch.float32, torch.contiguous_format
# Tests set this False to run the ops where the eager path would run.
EAGER_PATH = True
# op_options of attention's defaults, by causal.
DEFAULT_OPTIONS = {
    c: (
        c,
        None,
        "auto",
        [-1, -1],
        0.0,
        None,
        0,
        None,
        [128, 128],
        None,
        0.0,
        False,
        None,
        None,
        None,
    )
    for c in (False, True)
}


def eager_ok(tensors) -> bool:
    """Whether a call may take the eager path: not under torch.compile, export or torch.jit
    tracing, no dispatch or function mode (FakeTensorMode, FunctionalTensorMode, proxy modes,
    FlopCounterMode), no functorch transform (vmap, grad), and every tensor a plain one (or a
    Parameter): anything that would see the op gets the op."""
    if (
        not EAGER_PATH
        or is_compiling()
        or dispatch_modes()
        or function_modes()
        or functorch_active()
        or is_tracing() is not None
    ):
        return False
    for x in tensors:
        if x is not None and x.__class__ not in TENSOR_TYPES:
            return False
    return True


def _capsule(x):
    """What the extension reads for a tensor that needs no grad (Frame.export, Frame.dest)."""
    return _to_dlpack(x) if x.__class__ is _Tensor and x.is_cpu else x


class _EagerCall:
    """One attention call's options as the extension's keywords (as _api.attention and
    attention_backward make them from the ops' arguments), made once for its forward and its
    backward; `plain`: every option at its default but causal (forward_default's call)."""

    __slots__ = ("arrays", "bhsd", "kw", "bias", "sinks", "deterministic", "plain", "cpu", "lse")
    lse: Optional[torch.Tensor]  # the forward's lse, until eager_attention hands it back

    def __init__(self, arrays, bhsd, options):
        (
            causal,
            softmax_scale,
            schedule,
            window,
            dropout_p,
            seed,
            offset,
            block_mask,
            block_size,
            alibi_slopes,
            softcap,
            deterministic,
            bias,
            mask,
            sinks,
        ) = options
        self.arrays, self.bhsd, self.deterministic = arrays, bhsd, deterministic
        kw = {"causal": causal}
        if softmax_scale is not None:
            kw["softmax_scale"] = softmax_scale
        if window[0] != -1 or window[1] != -1:
            kw.update(window_left=window[0], window_right=window[1])
        if schedule != "auto":
            kw["schedule"] = schedule
        if dropout_p != 0.0:
            kw.update(dropout_p=dropout_p, seed=seed_int(seed), offset=offset)
        elif offset != 0:
            kw["offset"] = offset
        # (block_mask, block_size, alibi_slopes and softcap as op_options checked them)
        if block_mask is not None or block_size[0] != 128 or block_size[1] != 128:
            kw.update(block_mask=block_mask, block_size_q=block_size[0], block_size_k=block_size[1])
        if alibi_slopes is not None or softcap != 0.0:
            kw.update(alibi_slopes=alibi_slopes, softcap=softcap)
        if bias is not None or mask is not None or sinks is not None:
            kw.update(_args.extras(sinks, bias, mask))
        self.kw, self.bias, self.sinks = kw, bias, sinks
        self.plain = len(kw) == 1

    def failed(self, err, tensors, names, arrays, bhsd):
        """Re-raises err of a call the extension refused as the full path words it: the checks
        Frame makes before the call first (_checks.readable), then _args.LayoutErrors' wording."""
        for name, x in zip(names, tensors):
            _checks.readable(name, x)
        with _args.LayoutErrors(arrays, bhsd):
            raise err

    def forward(self, q, k, v):
        """(out, lse), tensors that need no grad, of q, k, v (read, not recorded: they may
        require grad)."""
        # (Frame.empty's layout: contiguous; empty_like keeps a contiguous q's, a third cheaper)
        out = _empty_like(q) if q.is_contiguous() else _empty_like(q, memory_format=_contiguous)
        s = q.shape
        # A wrongly ranked q gets a placeholder lse (_args.lse_shape); the core then reports q.
        # (torch.empty's sizes as separate arguments: 0.3 us less than a tuple)
        b, h, sq = (s[0], s[2], s[1]) if len(s) == 4 else (0, 0, 0)
        # CPU tensors are exported here (as Frame does), skipping _capsule's tests; to_dlpack
        # exports a tensor that requires grad as it is (no detach: 0.28 us a tensor). Others go to
        # the extension as they are, detached: their __dlpack__ refuses one that requires grad.
        self.cpu = cpu = q.is_cpu and k.is_cpu and v.is_cpu
        export: Callable[..., Any]
        if cpu:
            export = _to_dlpack
            lse = _empty(b, h, sq, dtype=_float32)
        else:
            export = _capsule
            q, k, v = q.detach(), k.detach(), v.detach()
            lse = _empty(b, h, sq, dtype=_float32, device=q.device)
        try:
            if q.is_neg() or k.is_neg() or v.is_neg():  # to_dlpack would drop the sign
                raise ValueError("a negative-bit view")
            if self.plain and cpu:
                _ext.forward_default(
                    export(q), export(k), export(v), export(out), export(lse), self.kw["causal"]
                )
            else:
                _ext.forward(
                    export(q),
                    export(k),
                    export(v),
                    export(out),
                    export(lse),
                    stream=_stream(q),
                    **self.kw,
                )
        except Exception as err:  # noqa: BLE001 - re-raised, worded as the full path words it
            self.failed(err, (q, k, v), ("q", "k", "v"), self.arrays, self.bhsd)
        return out, lse

    def backward(self, dout, q, k, v, out, lse):
        """(dq, dk, dv, dbias or None, dsinks or None) as the backward op computes them (q, k, v
        may require grad, as in forward)."""
        # Autograd often hands over broadcast gradients (of .sum(): every stride 0); the kernels
        # need a contiguous last dimension (last_dim_contiguous).
        if dout.stride(-1) != 1 and dout.shape[-1] > 1:
            dout = dout.contiguous()
        dq = _empty_like(q) if q.is_contiguous() else _empty_like(q, memory_format=_contiguous)
        dk = _empty_like(k) if k.is_contiguous() else _empty_like(k, memory_format=_contiguous)
        dv = _empty_like(v) if v.is_contiguous() else _empty_like(v, memory_format=_contiguous)
        kw = self.kw
        dbias = dsinks = None
        cpu = self.cpu
        if self.bias is not None or self.sinks is not None or not cpu or self.deterministic:
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
            export: Callable[..., Any]
            if cpu:
                export = _to_dlpack
            else:
                export = _capsule
                q, k, v = q.detach(), k.detach(), v.detach()
            _ext.backward(
                _capsule(dout),
                export(q),
                export(k),
                export(v),
                export(out),
                export(lse),
                export(dq),
                export(dk),
                export(dv),
                **kw,
            )
        except Exception as err:  # noqa: BLE001 - re-raised, worded as the full path words it
            self.failed(err, (dout,), ("dout",), (q, k, v), False)
        return dq, dk, dv, dbias, dsinks


def _stream(x) -> int:
    """The caller's current stream on the device of x (0 off CUDA), as Frame takes it."""
    return int(torch.cuda.current_stream(x.device).cuda_stream) if x.is_cuda else 0


class _EagerAttention(torch.autograd.Function):
    """attention's autograd outside compilation: call (an _EagerCall) runs the forward and the
    backward; bias and sinks are inputs for their gradients (passed only where one is given: a
    call of q, k, v and call alone pays for four inputs). q, k, v, out and the gradients are in
    the caller's layout, transposed here for a heads-first call (views, no autograd nodes of their
    own: four fewer nodes a call). The one output is out: lse, which has no gradient, is left in
    call.lse (a tensor made here, without autograd history; not an output to mark
    non-differentiable). The saved tensors' version counters catch an in-place change before the
    backward."""

    @staticmethod
    def forward(ctx, q, k, v, call, bias=None, sinks=None):
        if call.bhsd:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out, call.lse = call.forward(q, k, v)
        ctx.call = call
        if call.bhsd:
            ctx.save_for_backward(q, k, v, out, call.lse, bias, sinks)
            return out.transpose(1, 2)
        # out itself is returned (no view made), saved detached (its version counter shared)
        ctx.save_for_backward(q, k, v, out.detach(), call.lse, bias, sinks)
        return out

    @staticmethod
    def backward(ctx, dout):
        if _grad_enabled():  # create_graph=True: no double backward
            return _EagerAttention._once_backward(ctx, dout)
        q, k, v, out, lse, _bias, _sinks = ctx.saved_tensors
        call = ctx.call
        if call.bhsd:
            dout = dout.transpose(1, 2)
        dq, dk, dv, dbias, dsinks = call.backward(dout, q, k, v, out, lse)
        if call.bhsd:
            dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        if dbias is None and dsinks is None:
            # (the gradients past the inputs given are None, which autograd allows)
            return dq, dk, dv, None, None, None
        needs = ctx.needs_input_grad
        return (dq, dk, dv, None, dbias if needs[4] else None, dsinks if needs[5] else None)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def _once_backward(ctx, dout):
        return _EagerAttention.backward(ctx, dout)


# autograd.Function.apply without its Python wrapper (a fifth of the eager forward's own time
# at 16 x 16): what the wrapper adds is for functorch transforms, which take the op here, and
# its unwrapping of dead functorch wrappers, done below.
_function_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _EagerAttention)
# The engine runs the backward node's `apply`, which torch's node class (BackwardCFunction)
# spends 0.5 us a call on (looking the backward up, checking vjp and boxed gradients): the
# node class of this Function calls its backward directly.
_EagerAttention._backward_cls.apply = _EagerAttention.backward  # type: ignore[attr-defined]
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def eager_attention(arrays, bhsd, options):
    """(out, lse) of the eager path, out in the layout of arrays (the caller's q, k, v): through
    _EagerAttention where autograd needs it."""
    call = _EagerCall(arrays, bhsd, options)
    bias, sinks = call.bias, call.sinks
    q, k, v = arrays
    if _grad_enabled() and (
        q.requires_grad
        or k.requires_grad
        or v.requires_grad
        or (bias is not None and bias.requires_grad)
        or (sinks is not None and sinks.requires_grad)
    ):
        if bias is None and sinks is None:
            out = _function_apply(_unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v), call)
        else:
            out = _function_apply(
                _unwrap_if_dead(q),
                _unwrap_if_dead(k),
                _unwrap_if_dead(v),
                call,
                None if bias is None else _unwrap_if_dead(bias),
                None if sinks is None else _unwrap_if_dead(sinks),
            )
        lse, call.lse = call.lse, None  # (the graph keeps call: not lse past the backward)
        return out, lse
    if not bhsd:
        return call.forward(q, k, v)
    out, lse = call.forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2), lse
