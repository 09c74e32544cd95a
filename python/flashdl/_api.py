"""flashdl.attention and attention_backward: any DLPack array in, the caller's array type out.

Outputs are allocated with the caller's framework on the caller's device and the C++ core writes
into them (destination passing). The core validates shapes, dtypes, devices and options and names
the bad argument; this layer adds only what Python alone knows (array types, frameworks, streams).
"""

from __future__ import annotations

import operator

from . import _ext
from ._frameworks import Frame

_FLOATS_FWD = ("q", "k", "v")
_FLOATS_BWD = ("dout", "q", "k", "v", "out")


def _window(window_size):
    try:
        left, right = window_size
        return operator.index(left), operator.index(right)
    except (TypeError, ValueError):
        raise TypeError("window_size: expected a pair (left, right) of ints, -1 for unbounded, "
                        f"got {window_size!r}") from None


def _options(causal, softmax_scale, schedule, window_size, frame):
    if not isinstance(schedule, str):
        raise TypeError(f"schedule: expected a str ('auto', 'fa1', 'fa2' or 'reference'), "
                        f"got {type(schedule).__name__}")
    if softmax_scale is not None:
        try:
            softmax_scale = float(softmax_scale)
        except (TypeError, ValueError):
            raise TypeError("softmax_scale: expected a float or None, "
                            f"got {type(softmax_scale).__name__}") from None
    left, right = _window(window_size)
    return dict(dtype=frame.dtype, softmax_scale=softmax_scale, causal=bool(causal),
                window_left=left, window_right=right, schedule=schedule, stream=frame.stream)


def _lse_shape(q):
    shape = tuple(q.shape)
    # A wrongly ranked q gets a placeholder; the core then reports q itself.
    return (shape[0], shape[2], shape[1]) if len(shape) == 4 else (0, 0, 0)


def attention(q, k, v, *, causal=False, softmax_scale=None, schedule="auto", return_lse=False,
              window_size=(-1, -1)):
    """Exact attention softmax(q k^T * scale) v, computed without materialising the N x N matrix.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim), with
    nheads a multiple of nheads_kv (GQA/MQA). The last dimension must be contiguous; any other
    strides work (a (batch, nheads, seqlen, headdim) array transposed to this layout is fine).
    causal is bottom-right aligned: key j is visible to query i iff j <= i + seqlen_k - seqlen_q.
    softmax_scale defaults to 1/sqrt(headdim). schedule: 'auto', 'fa1', 'fa2' or 'reference'
    (naive float64, the test oracle). window_size=(left, right) limits the visible keys, -1 for
    unbounded.

    Returns out (like q, in the caller's framework and device), or (out, lse) with
    return_lse=True, lse float32 (batch, nheads, seqlen_q), the natural-log sum of exp of the
    scaled scores (-inf, with out 0, for a query that sees no key).
    """
    frame = Frame({"q": q, "k": k, "v": v}, _FLOATS_FWD)
    opts = _options(causal, softmax_scale, schedule, window_size, frame)
    out = frame.empty(q.shape, q.dtype)
    lse = frame.empty(_lse_shape(q), frame.float32())
    _ext.forward(frame.export(q), frame.export(k), frame.export(v), frame.dest(out),
                 frame.dest(lse), **opts)
    out, lse = frame.finish(out), frame.finish(lse)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None,
                       schedule="auto", window_size=(-1, -1), deterministic=False):
    """Gradients (dq, dk, dv) of attention(q, k, v) for the upstream gradient dout.

    out and lse are what attention(..., return_lse=True) returned for the same arguments and
    options. dq, dk, dv come back shaped and typed like q, k, v; with GQA, dk and dv sum over
    the query heads of each group.
    """
    frame = Frame({"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse}, _FLOATS_BWD)
    opts = _options(causal, softmax_scale, schedule, window_size, frame)
    dq = frame.empty(q.shape, q.dtype)
    dk = frame.empty(k.shape, k.dtype)
    dv = frame.empty(v.shape, v.dtype)
    _ext.backward(frame.export(dout), frame.export(q), frame.export(k), frame.export(v),
                  frame.export(out), frame.export(lse), frame.dest(dq), frame.dest(dk),
                  frame.dest(dv), deterministic=bool(deterministic), **opts)
    return frame.finish(dq), frame.finish(dk), frame.finish(dv)
