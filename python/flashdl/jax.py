"""flashdl inside compiled JAX programs: jax.jit, jax.grad / jax.vjp and jax.vmap.

    import flashdl.jax
    out = jax.jit(flashdl.jax.attention, static_argnames="causal")(q, k, v, causal=True)
    dq = jax.grad(lambda q: flashdl.jax.attention(q, k, v).sum())(q)

Each call lowers to an XLA FFI custom call (jax.ffi.ffi_call) whose handler is flashdl's C++ (the
CPU backend; the CUDA backend on XLA's stream where flashdl and jax both have CUDA): no host round
trip, no callback. The gradient is a jax.custom_vjp whose backward is flashdl's backward, which
recomputes the attention matrix from the saved lse. The handlers are registered with XLA on the
first call; docs/jax.md says how they are built without jax and which XLA FFI versions they fit.

flashdl.attention (the eager DLPack entry point) also takes JAX arrays, but cannot be traced.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks, _ext
from ._api import _layout, _LayoutErrors, _scalars, _score_mods

__all__ = ["attention", "attention_varlen"]

_FWD, _BWD = "flashdl_attention_fwd", "flashdl_attention_bwd"
_VARLEN_FWD, _VARLEN_BWD = "flashdl_attention_varlen_fwd", "flashdl_attention_varlen_bwd"


@functools.lru_cache(maxsize=None)
def _register() -> None:
    """Registers the handlers with XLA, once per process, for each platform that both this build
    and jax have. The backends are initialised first, so a refused registration raises here (an
    XLA FFI version this jaxlib no longer accepts) instead of breaking the backend later."""
    jax_platforms = {d.platform for d in jax.devices()} | {"cpu"}
    for name, platform, capsule in _ext.xla_ffi_targets():
        jax_name = "gpu" if platform == "CUDA" else platform
        if jax_name not in jax_platforms:
            continue
        jax.devices(jax_name)
        try:
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
        except Exception as err:  # jaxlib raises its own runtime error type
            raise RuntimeError(f"flashdl.jax: XLA refused flashdl's {name} handler for "
                               f"{platform}: {err}") from None


class _Config(NamedTuple):
    """The static (hashable) options of one call; they become the custom call's attributes."""
    causal: bool
    softmax_scale: float  # NaN: 1/sqrt(headdim) (made explicit by _resolved before the call)
    window_left: int
    window_right: int
    schedule: str
    softcap: float
    deterministic: bool

    def attrs(self, backward: bool) -> dict:
        a = dict(causal=self.causal, softmax_scale=np.float64(self.softmax_scale),
                 window_left=np.int64(self.window_left), window_right=np.int64(self.window_right),
                 schedule=self.schedule, softcap=np.float64(self.softcap))
        if backward:
            a["deterministic"] = self.deterministic
        return a


def _config(causal, softmax_scale, window_size, schedule, softcap, deterministic) -> _Config:
    causal, scale, schedule, (left, right) = _scalars(causal, softmax_scale, schedule,
                                                      window_size)
    cap = _score_mods(None, softcap)["softcap"]
    return _Config(causal, math.nan if scale is None else scale, left, right, schedule, cap,
                   _checks.flag("deterministic", deterministic))


def _stand_in(shape, dtype, writable=False):
    """A NumPy array of the given shape and dtype backed by one row of zeros: every axis but the
    last has stride 0, so it costs the memory of its last axis whatever its shape. The core's
    checks (validate_only) read shapes, dtypes and strides, never the elements."""
    row = np.zeros(max(shape[-1], 1) if shape else 1, dtype)
    strides = (0,) * (len(shape) - 1) + (row.itemsize,) if shape else ()
    return np.lib.stride_tricks.as_strided(row, shape, strides, writeable=writable)


def _probe(x, name):
    """A stand-in (_stand_in) for the traced array x: x's shape and dtype (bfloat16 as uint16,
    which the extension reads back with dtype='bfloat16'), and whether it is bfloat16."""
    shape = tuple(x.shape)
    if len(shape) == 0:
        raise ValueError(f"{name}: expected an array, got a scalar")
    dtype = jnp.dtype(x.dtype)
    as_np = np.uint16 if dtype == jnp.bfloat16 else dtype
    return _stand_in(shape, as_np), dtype == jnp.bfloat16


def _check(entry, arrays, cfg, extra=()):
    """Runs the core's own argument checks at trace time on stand-ins of `arrays` (a dict name ->
    traced array) with their shapes and dtypes (_probe), so a bad call raises the core's
    ValueError or TypeError naming the argument, with the caller's shapes, before anything is
    compiled. The core only checks (validate_only): nothing is computed or written."""
    q_dtype = jnp.dtype(arrays["q"].dtype)
    for name, x in arrays.items():  # as the core words it; bfloat16 reaches it as uint16 below
        if name != "q" and jnp.dtype(x.dtype) != q_dtype:
            raise TypeError(f"{name}: expected dtype {q_dtype} (the dtype of q), "
                            f"got {jnp.dtype(x.dtype)}")
    probes, bf16 = {}, False
    for name, x in arrays.items():
        probes[name], bf16 = _probe(x, name)
    opts = dict(dtype="bfloat16" if bf16 else None, causal=cfg.causal,
                softmax_scale=None if math.isnan(cfg.softmax_scale) else cfg.softmax_scale,
                window_left=cfg.window_left, window_right=cfg.window_right,
                schedule=cfg.schedule, softcap=cfg.softcap, validate_only=True)
    entry(probes, opts, *extra)


def _fwd_outputs(q):
    *batch, sq, h, _ = q.shape
    return (jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((*batch, h, sq), jnp.float32))


def _resolved(cfg, q):
    """cfg with the default scale made explicit (1/sqrt(headdim), as the core computes it): a NaN
    attribute would never compare equal to itself and defeat JAX's caching of eager calls."""
    if not math.isnan(cfg.softmax_scale):
        return cfg
    d = q.shape[-1]
    return cfg._replace(softmax_scale=1.0 / math.sqrt(d) if d > 0 else 1.0)


def _forward(q, k, v, cfg):
    _register()
    call = jax.ffi.ffi_call(_FWD, _fwd_outputs(q), vmap_method="broadcast_all")
    return call(q, k, v, **cfg.attrs(False))


def _backward(dout, q, k, v, out, lse, cfg):
    _register()
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    call = jax.ffi.ffi_call(_BWD, shapes, vmap_method="broadcast_all")
    return call(dout, q, k, v, out, lse, **cfg.attrs(True))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, cfg):
    return _forward(q, k, v, cfg)


def _attention_fwd(q, k, v, cfg):
    out, lse = _forward(q, k, v, cfg)
    return (out, lse), (q, k, v, out, lse)


def _attention_bwd(cfg, residuals, cotangents):
    # lse leaves attention() under stop_gradient, so its cotangent is zero: dout alone flows.
    dout, _ = cotangents
    return _backward(dout, *residuals, cfg)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _check_dense(probes, opts):
    q, k, v = probes["q"], probes["k"], probes["v"]
    out = _stand_in(q.shape, q.dtype, writable=True)
    lse = _stand_in((q.shape[0], q.shape[2], q.shape[1]) if q.ndim == 4 else (0, 0, 0),
                    np.float32, writable=True)
    _ext.forward(q, k, v, out, lse, **opts)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
              softmax_scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1),
              schedule: str = "auto", softcap: float = 0.0, deterministic: bool = False,
              return_lse: bool = False, layout: str = "bshd") -> Any:
    """:func:`flashdl.attention` for JAX programs: traceable and differentiable with respect to q, k, v.

    Works under ``jax.jit``, ``jax.grad`` / ``jax.vjp`` (a ``jax.custom_vjp`` whose backward is
    flashdl's) and ``jax.vmap`` (any leading mapped axes fold into the batch: one kernel launch).
    Each call lowers to an XLA FFI custom call whose handler is flashdl's C++: no callback, no host
    round trip. Arguments are checked at trace time by the core's own checks.

    Parameters
    ----------
    q : jax.Array (batch, seqlen_q, nheads, headdim)
        float32, float64, float16 or bfloat16 on the CPU (float16, bfloat16 on CUDA).
    k, v : jax.Array (batch, seqlen_k, nheads_kv, headdim)
        ``nheads`` a multiple of ``nheads_kv``.
    causal, softmax_scale, window_size, schedule, softcap : optional
        As in :func:`flashdl.attention`. Static: Python values, not traced.
    deterministic : bool, default False
        Passed to the backward (bitwise reproducible dq on CUDA; the CPU is always reproducible).
    return_lse : bool, default False
        Also return lse, float32 (batch, nheads, seqlen_q), under ``jax.lax.stop_gradient`` (no
        gradient flows through lse, as in flash-attn).
    layout : {"bshd", "bhsd"}, default "bshd"
        ``"bhsd"`` takes (batch, nheads, seqlen, headdim) arrays and returns out in that layout
        (transposed in the program: JAX has no views). Errors quote the caller's shapes.

    Returns
    -------
    out : jax.Array (batch, seqlen_q, nheads, headdim)
    lse : jax.Array, float32 (batch, nheads, seqlen_q)
        With ``return_lse=True``.

    Raises
    ------
    ValueError
        Bad shapes, dtypes or options, at trace time (the message names the argument).
    TypeError
        An argument of the wrong type.

    Notes
    -----
    Not here yet: dropout, block masks, ALiBi slopes (use :func:`flashdl.attention` eagerly). The
    CUDA handlers are compiled but have not run on a GPU.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, flashdl.jax
    >>> q = k = v = jnp.ones((2, 16, 4, 8), jnp.float32)
    >>> loss = lambda q, k, v: flashdl.jax.attention(q, k, v, causal=True).sum()
    >>> dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    >>> dq.shape
    (2, 16, 4, 8)
    >>> jax.vmap(flashdl.jax.attention)(q[None], k[None], v[None]).shape     # folded into the batch
    (1, 2, 16, 4, 8)
    """
    return_lse = _checks.flag("return_lse", return_lse)
    bhsd = _layout(layout)
    cfg = _config(causal, softmax_scale, window_size, schedule, softcap, deterministic)
    with _LayoutErrors((q, k, v), bhsd):
        if bhsd:
            q, k, v = (_heads_second(n, x, 4) for n, x in (("q", q), ("k", k), ("v", v)))
        _check(_check_dense, {"q": q, "k": k, "v": v}, cfg)
    out, lse = _attention(q, k, v, _resolved(cfg, q))
    if bhsd:
        out = jnp.swapaxes(out, 1, 2)
    return (out, jax.lax.stop_gradient(lse)) if return_lse else out


def _heads_second(name, x, rank):
    """A heads-first array ((batch, nheads, seqlen, headdim), or (nheads, total, headdim)) in
    flashdl's order, transposed by XLA."""
    if jnp.ndim(x) != rank:
        layout, axes = (("bhsd", "(batch, nheads, seqlen, headdim)") if rank == 4
                        else ("htd", "(nheads, total, headdim)"))
        raise ValueError(f"{name}: with layout={layout!r} expected a rank-{rank} array {axes}, "
                         f"got shape {jnp.shape(x)}")
    return jnp.swapaxes(x, rank - 3, rank - 2)


# ---- variable-length batches (flash-attn's packed layout) ---------------------------------------

class _Varlen(NamedTuple):
    max_seqlen_q: int
    max_seqlen_k: int

    def attrs(self) -> dict:
        return dict(max_seqlen_q=np.int64(self.max_seqlen_q),
                    max_seqlen_k=np.int64(self.max_seqlen_k))


def _varlen_forward(q, k, v, cu_q, cu_k, cfg, lens):
    _register()
    total, h, _ = q.shape
    shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((h, total), jnp.float32))
    call = jax.ffi.ffi_call(_VARLEN_FWD, shapes, vmap_method="sequential")
    return call(q, k, v, cu_q, cu_k, **cfg.attrs(False), **lens.attrs())


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention_varlen(q, k, v, cu_q, cu_k, cfg, lens):
    return _varlen_forward(q, k, v, cu_q, cu_k, cfg, lens)


def _attention_varlen_fwd(q, k, v, cu_q, cu_k, cfg, lens):
    out, lse = _varlen_forward(q, k, v, cu_q, cu_k, cfg, lens)
    return (out, lse), (q, k, v, out, lse, cu_q, cu_k)


def _attention_varlen_bwd(cfg, lens, residuals, cotangents):
    dout, _ = cotangents
    q, k, v, out, lse, cu_q, cu_k = residuals
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    call = jax.ffi.ffi_call(_VARLEN_BWD, shapes, vmap_method="sequential")
    dq, dk, dv = call(dout, q, k, v, out, lse, cu_q, cu_k, **cfg.attrs(True), **lens.attrs())
    return dq, dk, dv, None, None  # the offsets are integers: no cotangent


_attention_varlen.defvjp(_attention_varlen_fwd, _attention_varlen_bwd)


def _check_varlen(probes, opts, lens, nseq):
    q, k, v = probes["q"], probes["k"], probes["v"]
    cu = np.zeros(nseq + 1, np.int32)  # validate_only: its values are not read
    out = _stand_in(q.shape, q.dtype, writable=True)
    lse = _stand_in((q.shape[1], q.shape[0]) if q.ndim == 3 else (0, 0), np.float32,
                    writable=True)
    _ext.forward_varlen(q, k, v, cu, cu, lens.max_seqlen_q, lens.max_seqlen_k, out, lse, **opts)


def attention_varlen(q: jax.Array, k: jax.Array, v: jax.Array, cu_seqlens_q: jax.Array,
                     cu_seqlens_k: jax.Array, max_seqlen_q: int, max_seqlen_k: int, *,
                     causal: bool = False, softmax_scale: Optional[float] = None,
                     window_size: Tuple[int, int] = (-1, -1), schedule: str = "auto",
                     softcap: float = 0.0, deterministic: bool = False,
                     return_lse: bool = False, layout: str = "thd") -> Any:
    """:func:`flashdl.attention_varlen` for JAX programs (flash-attn's packed layout).

    Traceable and differentiable with respect to q, k and v, like :func:`attention`. ``jax.vmap``
    runs a batch of calls one by one.

    Parameters
    ----------
    q : jax.Array (total_q, nheads, headdim)
    k, v : jax.Array (total_k, nheads_kv, headdim)
    cu_seqlens_q, cu_seqlens_k : int32 jax.Array (batch + 1,)
        Cumulative sequence lengths (traced values are fine: on the CPU the handler checks them when
        it runs, and a bad one raises there). Integer arrays of another dtype (int64 under
        ``jax_enable_x64``) are converted to int32; known values must fit.
    max_seqlen_q, max_seqlen_k : int
        Static ints bounding every sequence.
    causal, softmax_scale, window_size, schedule, softcap, deterministic : optional
        As in :func:`attention`, per sequence.
    return_lse : bool, default False
        Also return lse, float32 (nheads, total_q), without gradient.
    layout : {"thd", "htd"}, default "thd"
        ``"htd"`` takes (nheads, total, headdim) arrays and returns out in that layout (transposed in
        the program).

    Returns
    -------
    out : jax.Array (total_q, nheads, headdim)
    lse : jax.Array, float32 (nheads, total_q)
        With ``return_lse=True``.

    Raises
    ------
    ValueError
        Bad shapes or options at trace time; bad offsets when the call runs (XLA's
        ``INVALID_ARGUMENT`` with the core's message).
    TypeError
        An argument of the wrong type.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, numpy as np, flashdl.jax
    >>> cu = jnp.array([0, 3, 10], jnp.int32)
    >>> q = k = v = jnp.asarray(np.random.randn(10, 2, 8), jnp.float32)
    >>> f = jax.jit(lambda q, k, v, cu: flashdl.jax.attention_varlen(q, k, v, cu, cu, 7, 7,
    ...                                                              causal=True))
    >>> f(q, k, v, cu).shape
    (10, 2, 8)
    """
    return_lse = _checks.flag("return_lse", return_lse)
    heads_first = _layout(layout, varlen=True)
    cfg = _config(causal, softmax_scale, window_size, schedule, softcap, deterministic)
    lens = _Varlen(_static_int("max_seqlen_q", max_seqlen_q),
                   _static_int("max_seqlen_k", max_seqlen_k))
    cu_seqlens_q, cu_seqlens_k = (_offsets(n, cu) for n, cu in (
        ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)))
    nseq = jnp.shape(cu_seqlens_q)[0] - 1
    if jnp.shape(cu_seqlens_k)[0] - 1 != nseq or nseq < 0:
        raise ValueError("cu_seqlens_k: expected the shape of cu_seqlens_q "
                         f"{jnp.shape(cu_seqlens_q)}, got {jnp.shape(cu_seqlens_k)}")
    with _LayoutErrors((q, k, v), heads_first, varlen=True):
        if heads_first:
            q, k, v = (_heads_second(n, x, 3) for n, x in (("q", q), ("k", k), ("v", v)))
        _check(_check_varlen, {"q": q, "k": k, "v": v}, cfg, (lens, nseq))
    out, lse = _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, _resolved(cfg, q), lens)
    if heads_first:
        out = jnp.swapaxes(out, 0, 1)
    return (out, jax.lax.stop_gradient(lse)) if return_lse else out


def _offsets(name, cu):
    """cu_seqlens as the int32 (batch + 1,) array the handlers read: other integer dtypes are
    converted (values known at trace time must fit int32)."""
    dtype = jnp.result_type(cu)
    if jnp.ndim(cu) != 1 or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name}: expected an int32 array (batch + 1,), got "
                        f"{dtype} of shape {jnp.shape(cu)}")
    if dtype == jnp.int32:
        return cu
    if not isinstance(cu, jax.core.Tracer):
        values = np.asarray(cu)
        if values.size and (values.min() < -2**31 or values.max() >= 2**31):
            raise ValueError(f"{name}: expected int32 values, got "
                             f"{values.max() if values.max() >= 2**31 else values.min()}")
    return jnp.asarray(cu).astype(jnp.int32)


def _static_int(name, x) -> int:
    """A static int (a traced value, a float or a bool is a TypeError naming the argument)."""
    return _checks.integer(name, x, "a static int that fits int64")
