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

from . import _ext
from ._api import _scalars, _score_mods

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
                   bool(deterministic))


def _probe(x, name):
    """A zero-length NumPy stand-in for the traced array x: x's shape with the leading axis 0 and
    x's dtype (bfloat16 as uint16, which the extension reads back with dtype='bfloat16')."""
    shape = tuple(x.shape)
    if len(shape) == 0:
        raise ValueError(f"{name}: expected an array, got a scalar")
    dtype = jnp.dtype(x.dtype)
    as_np = np.uint16 if dtype == jnp.bfloat16 else dtype
    return np.empty((0,) + shape[1:], as_np), dtype == jnp.bfloat16


def _check(entry, arrays, cfg, extra=(), same_first=True):
    """Runs the core's own argument checks at trace time on zero-length stand-ins of `arrays` (a
    dict name -> traced array), so a bad call raises the core's ValueError or TypeError naming
    the argument before anything is compiled. Only the axes past the first are probed, so with
    same_first the first axes (the batch) of q, k and v are compared here."""
    q_dtype = jnp.dtype(arrays["q"].dtype)
    for name, x in arrays.items():  # as the core words it; bfloat16 reaches it as uint16 below
        if name != "q" and jnp.dtype(x.dtype) != q_dtype:
            raise TypeError(f"{name}: expected dtype {q_dtype} (the dtype of q), "
                            f"got {jnp.dtype(x.dtype)}")
    probes, bf16 = {}, False
    for name, x in arrays.items():
        probes[name], bf16 = _probe(x, name)
    first = {n: tuple(x.shape)[0] for n, x in arrays.items() if n in ("q", "k", "v")}
    if same_first and len(set(first.values())) > 1:
        raise ValueError("k, v: expected the batch (first axis) of q, got "
                         + ", ".join(f"{n} {s}" for n, s in first.items()))
    opts = dict(dtype="bfloat16" if bf16 else None, causal=cfg.causal,
                softmax_scale=None if math.isnan(cfg.softmax_scale) else cfg.softmax_scale,
                window_left=cfg.window_left, window_right=cfg.window_right,
                schedule=cfg.schedule, softcap=cfg.softcap)
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
    out = np.empty_like(q)
    lse = np.empty((0,) + ((q.shape[2], q.shape[1]) if q.ndim == 4 else (0, 0)), np.float32)
    _ext.forward(q, k, v, out, lse, **opts)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
              softmax_scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1),
              schedule: str = "auto", softcap: float = 0.0, deterministic: bool = False,
              return_lse: bool = False) -> Any:
    """flashdl.attention for JAX programs: traceable (jit, grad, vjp, vmap), differentiable with
    respect to q, k and v.

    q (batch, seqlen_q, nheads, headdim); k, v (batch, seqlen_k, nheads_kv, headdim), nheads a
    multiple of nheads_kv; float32, float64, float16 or bfloat16 on the CPU (float16, bfloat16 on
    CUDA). causal (bottom-right aligned), softmax_scale (None: 1/sqrt(headdim)), window_size,
    schedule ('auto', 'fa1', 'fa2', 'reference') and softcap as in flashdl.attention; they are
    static (Python values, not traced). deterministic is passed to the backward (bitwise
    reproducible dq on CUDA; the CPU is always reproducible). return_lse=True returns (out, lse),
    lse float32 (batch, nheads, seqlen_q), under jax.lax.stop_gradient (no gradient flows
    through lse, as in flash-attn). jax.vmap over any leading axes folds them into the batch.
    Not here yet: dropout, block masks, ALiBi slopes (use flashdl.attention eagerly).
    """
    cfg = _config(causal, softmax_scale, window_size, schedule, softcap, deterministic)
    _check(_check_dense, {"q": q, "k": k, "v": v}, cfg)
    out, lse = _attention(q, k, v, _resolved(cfg, q))
    return (out, jax.lax.stop_gradient(lse)) if return_lse else out


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
    cu = np.zeros(nseq + 1, np.int32)  # every sequence empty: shapes and options are checked
    out = np.empty_like(q)
    lse = np.empty(((q.shape[1] if q.ndim == 3 else 0), 0), np.float32)
    _ext.forward_varlen(q, k, v, cu, cu, lens.max_seqlen_q, lens.max_seqlen_k, out, lse, **opts)


def attention_varlen(q: jax.Array, k: jax.Array, v: jax.Array, cu_seqlens_q: jax.Array,
                     cu_seqlens_k: jax.Array, max_seqlen_q: int, max_seqlen_k: int, *,
                     causal: bool = False, softmax_scale: Optional[float] = None,
                     window_size: Tuple[int, int] = (-1, -1), schedule: str = "auto",
                     softcap: float = 0.0, deterministic: bool = False,
                     return_lse: bool = False) -> Any:
    """flashdl.attention_varlen for JAX programs (flash-attn's packed layout): traceable,
    differentiable with respect to q, k and v.

    q (total_q, nheads, headdim); k, v (total_k, nheads_kv, headdim); cu_seqlens_q,
    cu_seqlens_k int32 (batch + 1,) arrays (traced values are fine: on the CPU the handler checks
    them when it runs, and a bad one raises there); max_seqlen_q, max_seqlen_k static ints
    bounding every sequence. Options as in attention. return_lse=True returns (out, lse), lse
    float32 (nheads, total_q), without gradient. jax.vmap runs the batch of calls one by one.
    """
    cfg = _config(causal, softmax_scale, window_size, schedule, softcap, deterministic)
    lens = _Varlen(_static_int("max_seqlen_q", max_seqlen_q),
                   _static_int("max_seqlen_k", max_seqlen_k))
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if jnp.ndim(cu) != 1 or jnp.result_type(cu) != jnp.int32:
            raise TypeError(f"{name}: expected an int32 array (batch + 1,), got "
                            f"{jnp.result_type(cu)} of shape {jnp.shape(cu)}")
    nseq = jnp.shape(cu_seqlens_q)[0] - 1
    if jnp.shape(cu_seqlens_k)[0] - 1 != nseq or nseq < 0:
        raise ValueError("cu_seqlens_k: expected the shape of cu_seqlens_q "
                         f"{jnp.shape(cu_seqlens_q)}, got {jnp.shape(cu_seqlens_k)}")
    _check(_check_varlen, {"q": q, "k": k, "v": v}, cfg, (lens, nseq), same_first=False)
    out, lse = _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, _resolved(cfg, q), lens)
    return (out, jax.lax.stop_gradient(lse)) if return_lse else out


def _static_int(name, x) -> int:
    try:
        return int(np.asarray(x).item()) if not isinstance(x, int) else x
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise TypeError(f"{name}: expected a static int (not a traced value)") from None
