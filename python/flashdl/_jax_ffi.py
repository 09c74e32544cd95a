"""flashdl's XLA FFI handlers seen from JAX: their registration with XLA (once per process), the
static options of a call (its custom call's attributes), the core's argument checks at trace time,
and the raw forward and backward custom calls that flashdl.jax's attention, KV cache, ring
attention and state merge are built from.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _args, _checks, _ext
from ._jax_partition import partitioned

FWD, BWD = "flashdl_attention_fwd", "flashdl_attention_bwd"
VARLEN_FWD, VARLEN_BWD = "flashdl_attention_varlen_fwd", "flashdl_attention_varlen_bwd"
KVCACHE, MERGE = "flashdl_attention_kvcache", "flashdl_merge_states"


@functools.lru_cache(maxsize=None)
def register() -> None:
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
            raise RuntimeError(
                f"flashdl.jax: XLA refused flashdl's {name} handler for {platform}: {err}"
            ) from None


class Config(NamedTuple):
    """The static (hashable) options of one call; they become the custom call's attributes."""

    causal: bool
    softmax_scale: float  # NaN: 1/sqrt(headdim) (made explicit by resolved before the call)
    window_left: int
    window_right: int
    schedule: str
    softcap: float
    deterministic: bool
    dropout_p: float = 0.0
    offset: int = 0
    has_block_mask: bool = False
    block_size_q: int = 128
    block_size_k: int = 128
    has_alibi: bool = False
    has_bias: bool = False
    has_mask: bool = False
    has_sinks: bool = False

    def attrs(self, backward: bool) -> dict:
        a = dict(
            causal=self.causal,
            softmax_scale=np.float64(self.softmax_scale),
            window_left=np.int64(self.window_left),
            window_right=np.int64(self.window_right),
            schedule=self.schedule,
            softcap=np.float64(self.softcap),
        )
        if backward:
            a["deterministic"] = self.deterministic
        # The optional features travel only when used, so a plain call's HLO is unchanged.
        if self.dropout_p > 0:
            a.update(dropout_p=np.float64(self.dropout_p), offset=np.int64(self.offset))
        if self.has_block_mask:
            a.update(
                has_block_mask=True,
                block_size_q=np.int64(self.block_size_q),
                block_size_k=np.int64(self.block_size_k),
            )
        if self.has_alibi:
            a["has_alibi"] = True
        for name in ("has_bias", "has_mask", "has_sinks"):
            if getattr(self, name):
                a[name] = True
        return a


def config(
    causal,
    softmax_scale,
    window_size,
    schedule,
    softcap,
    deterministic,
    dropout_p=0.0,
    offset=0,
    block_mask=None,
    block_size=128,
    alibi_slopes=None,
    bias=None,
    mask=None,
    sinks=None,
) -> Config:
    causal, scale, schedule, (left, right) = _args.scalars(
        causal, softmax_scale, schedule, window_size
    )
    cap = _args.score_mods(None, softcap)["softcap"]
    dropout_p = _args.dropout_probability(dropout_p)
    offset = _args.unsigned("offset", offset, 32)
    sparse = _args.block_sparse(None, block_size)
    return Config(
        causal,
        math.nan if scale is None else scale,
        left,
        right,
        schedule,
        cap,
        _checks.flag("deterministic", deterministic),
        dropout_p,
        offset,
        block_mask is not None,
        sparse["block_size_q"],
        sparse["block_size_k"],
        alibi_slopes is not None,
        bias is not None,
        mask is not None,
        sinks is not None,
    )


def stand_in(shape, dtype, writable=False):
    """A NumPy array of the given shape and dtype backed by one row of zeros: every axis but the
    last has stride 0, so it costs the memory of its last axis whatever its shape. The core's
    checks (validate_only) read shapes, dtypes and strides, never the elements."""
    row = np.zeros(max(shape[-1], 1) if shape else 1, dtype)
    strides = (0,) * (len(shape) - 1) + (row.itemsize,) if shape else ()
    return np.lib.stride_tricks.as_strided(row, shape, strides, writeable=writable)


def probe(x, name):
    """A stand-in (stand_in) for the traced array x: x's shape and dtype (bfloat16 as uint16,
    which the extension reads back with dtype='bfloat16'), and whether it is bfloat16."""
    shape = tuple(x.shape)
    if len(shape) == 0:
        raise ValueError(f"{name}: expected an array, got a scalar")
    dtype = jnp.dtype(x.dtype)
    as_np = np.uint16 if dtype == jnp.bfloat16 else dtype
    return stand_in(shape, as_np), dtype == jnp.bfloat16


def check(entry, arrays, cfg, extra=(), optional=None):
    """Runs the core's own argument checks at trace time on stand-ins of `arrays` (a dict name ->
    traced array) with their shapes and dtypes (probe), so a bad call raises the core's
    ValueError or TypeError naming the argument, with the caller's shapes, before anything is
    compiled. The core only checks (validate_only): nothing is computed or written."""
    q_dtype = jnp.dtype(arrays["q"].dtype)
    for name, x in arrays.items():  # as the core words it; bfloat16 reaches it as uint16 below
        if name != "q" and jnp.dtype(x.dtype) != q_dtype:
            raise TypeError(
                f"{name}: expected dtype {q_dtype} (the dtype of q), got {jnp.dtype(x.dtype)}"
            )
    probes, bf16 = {}, False
    for name, x in arrays.items():
        probes[name], bf16 = probe(x, name)
    opts = dict(
        dtype="bfloat16" if bf16 else None,
        causal=cfg.causal,
        softmax_scale=None if math.isnan(cfg.softmax_scale) else cfg.softmax_scale,
        window_left=cfg.window_left,
        window_right=cfg.window_right,
        schedule=cfg.schedule,
        softcap=cfg.softcap,
        validate_only=True,
        dropout_p=cfg.dropout_p,
        offset=cfg.offset,
    )
    for name, x in (optional or {}).items():  # block_mask, alibi_slopes, bias, mask, sinks
        if x is not None:
            dtype = jnp.dtype(x.dtype)
            dtype = np.dtype(np.uint16) if dtype == jnp.bfloat16 else dtype  # as q's, above
            opts[name] = stand_in(tuple(x.shape), dtype) if x.ndim else np.zeros((), dtype)
    if cfg.has_block_mask:
        opts.update(block_size_q=cfg.block_size_q, block_size_k=cfg.block_size_k)
    entry(probes, opts, *extra)


def fwd_outputs(q):
    *batch, sq, h, _ = q.shape
    return (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((*batch, h, sq), jnp.float32),
    )


def resolved(cfg, q):
    """cfg with the default scale made explicit (1/sqrt(headdim), as the core computes it): a NaN
    attribute would never compare equal to itself and defeat JAX's caching of eager calls."""
    if not math.isnan(cfg.softmax_scale):
        return cfg
    d = q.shape[-1]
    return cfg._replace(softmax_scale=1.0 / math.sqrt(d) if d > 0 else 1.0)


def slice_attrs(dropout_nheads_total):
    """The attribute of a sharded dropout call: the heads of the whole call (0: unsharded)."""
    return {"dropout_nheads_total": np.int64(dropout_nheads_total)} if dropout_nheads_total else {}


def raw_forward(cfg, vmap_method="broadcast_all", dropout_nheads_total=0):
    """The forward custom call for cfg, as a function of (q, k, v, *extras). Its
    with_nheads_total(n) is the call of one shard of a sharded dropout call over n heads in all
    (_jax_partition), whose seed operand then carries the shard's batch and head offsets."""

    def call(q, k, v, *extras):
        register()
        fn = jax.ffi.ffi_call(FWD, fwd_outputs(q), vmap_method=vmap_method)
        return tuple(fn(q, k, v, *extras, **cfg.attrs(False), **slice_attrs(dropout_nheads_total)))

    call.with_nheads_total = lambda n: raw_forward(cfg, vmap_method, n)  # type: ignore[attr-defined]
    return call


def extra_names(cfg):
    """The names of a call's optional arrays, in the handlers' order (xla_ffi.cpp)."""
    return [
        n
        for n, on in (
            ("block_mask", cfg.has_block_mask),
            ("alibi_slopes", cfg.has_alibi),
            ("bias", cfg.has_bias),
            ("mask", cfg.has_mask),
            ("sinks", cfg.has_sinks),
            ("seed", cfg.dropout_p > 0),
        )
        if on
    ]


def extra_grad_shapes(cfg, extras):
    """The backward's results after dq, dk, dv: dbias (the bias's shape and dtype, as it reaches
    the handler) with a bias, dsinks (float32, the sinks' shape) with sinks."""
    named = dict(zip(extra_names(cfg), extras))
    return tuple(
        jax.ShapeDtypeStruct(named[n].shape, named[n].dtype if n == "bias" else jnp.float32)
        for n in ("bias", "sinks")
        if n in named
    )


def raw_backward(cfg, vmap_method="broadcast_all", dropout_nheads_total=0):
    def call(dout, q, k, v, out, lse, *extras):
        register()
        shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
        shapes += extra_grad_shapes(cfg, extras)
        fn = jax.ffi.ffi_call(BWD, shapes, vmap_method=vmap_method)
        return tuple(
            fn(
                dout,
                q,
                k,
                v,
                out,
                lse,
                *extras,
                **cfg.attrs(True),
                **slice_attrs(dropout_nheads_total),
            )
        )

    call.with_nheads_total = lambda n: raw_backward(cfg, vmap_method, n)  # type: ignore[attr-defined]
    return call


@functools.lru_cache(maxsize=None)
def calls(cfg):
    """(forward, backward) custom calls for cfg, partitioned over batch and heads
    (_jax_partition). A sharded call with dropout draws, on each shard, that shard's slice of the
    whole call's mask: the partition passes the shard's batch and head offsets (from
    jax.lax.axis_index) with the seed. jax.vmap folds into the batch, except with dropout, where
    the elements run one by one (each draws the mask of the whole call, as the eager call
    would)."""
    return (partitioned("fwd", cfg, raw_forward(cfg)), partitioned("bwd", cfg, raw_backward(cfg)))


def forward(q, k, v, cfg, extras=()):
    return calls(cfg)[0](q, k, v, *extras)


def backward(dout, q, k, v, out, lse, cfg, extras=()):
    return calls(cfg)[1](dout, q, k, v, out, lse, *extras)


def check_dense(probes, opts):
    q, k, v = probes["q"], probes["k"], probes["v"]
    out = stand_in(q.shape, q.dtype, writable=True)
    lse = stand_in(
        (q.shape[0], q.shape[2], q.shape[1]) if q.ndim == 4 else (0, 0, 0),
        np.float32,
        writable=True,
    )
    _ext.forward(q, k, v, out, lse, **opts)


def merge_call(outs, lses):
    register()
    o = outs[0]
    shapes = (
        jax.ShapeDtypeStruct(o.shape, o.dtype),
        jax.ShapeDtypeStruct(lses[0].shape, jnp.float32),
    )
    return tuple(jax.ffi.ffi_call(MERGE, shapes, vmap_method="broadcast_all")(*outs, *lses))
