"""flashdl inside compiled JAX programs: jax.jit, jax.grad / jax.vjp and jax.vmap.

    import flashdl.jax
    out = jax.jit(flashdl.jax.attention, static_argnames="causal")(q, k, v, causal=True)
    dq = jax.grad(lambda q: flashdl.jax.attention(q, k, v).sum())(q)

Each call lowers to an XLA FFI custom call (jax.ffi.ffi_call) whose handler is flashdl's C++ (the
CPU backend; the CUDA backend on XLA's stream where flashdl and jax both have CUDA): no host round
trip, no callback. The gradient is a jax.custom_vjp whose backward is flashdl's backward, which
recomputes the attention matrix from the saved lse. The handlers are registered with XLA on the
first call; docs/jax.md says how they are built without jax and which XLA FFI versions they fit.

Also here: attention_with_kvcache (the append a donatable functional update) and merge_states
(_jax_kvcache), ring_attention for shard_map over a sequence-sharded mesh axis (_jax_ring); the
dense calls are partitioned over batch and heads under jax.jit sharding (_jax_partition);
dot_product_attention, jax.nn.dot_product_attention's signature and semantics (_jax_dpa), and
flax_attention, an attention_fn for Flax's attention modules (_jax_flax).

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
from ._api import _block_sparse, _dropout_p, _layout, _LayoutErrors, _scalars, _score_mods
from ._api import _full_rank, _unsigned
from ._jax_partition import partitioned

__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "dot_product_attention",
           "flax_attention", "merge_states", "ring_attention", "ring_permute", "ring_unpermute"]

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
        a = dict(causal=self.causal, softmax_scale=np.float64(self.softmax_scale),
                 window_left=np.int64(self.window_left), window_right=np.int64(self.window_right),
                 schedule=self.schedule, softcap=np.float64(self.softcap))
        if backward:
            a["deterministic"] = self.deterministic
        # The optional features travel only when used, so a plain call's HLO is unchanged.
        if self.dropout_p > 0:
            a.update(dropout_p=np.float64(self.dropout_p), offset=np.int64(self.offset))
        if self.has_block_mask:
            a.update(has_block_mask=True, block_size_q=np.int64(self.block_size_q),
                     block_size_k=np.int64(self.block_size_k))
        if self.has_alibi:
            a["has_alibi"] = True
        for name in ("has_bias", "has_mask", "has_sinks"):
            if getattr(self, name):
                a[name] = True
        return a


def _config(causal, softmax_scale, window_size, schedule, softcap, deterministic,
            dropout_p=0.0, offset=0, block_mask=None, block_size=128,
            alibi_slopes=None, bias=None, mask=None, sinks=None) -> _Config:
    causal, scale, schedule, (left, right) = _scalars(causal, softmax_scale, schedule,
                                                      window_size)
    cap = _score_mods(None, softcap)["softcap"]
    dropout_p = _dropout_p(dropout_p)
    offset = _unsigned("offset", offset, 32)
    sparse = _block_sparse(None, block_size)
    return _Config(causal, math.nan if scale is None else scale, left, right, schedule, cap,
                   _checks.flag("deterministic", deterministic), dropout_p, offset,
                   block_mask is not None, sparse["block_size_q"], sparse["block_size_k"],
                   alibi_slopes is not None, bias is not None, mask is not None,
                   sinks is not None)


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


def _check(entry, arrays, cfg, extra=(), optional=None):
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
                schedule=cfg.schedule, softcap=cfg.softcap, validate_only=True,
                dropout_p=cfg.dropout_p, offset=cfg.offset)
    for name, x in (optional or {}).items():  # block_mask, alibi_slopes, bias, mask, sinks
        if x is not None:
            dtype = jnp.dtype(x.dtype)
            dtype = np.dtype(np.uint16) if dtype == jnp.bfloat16 else dtype  # as q's, above
            opts[name] = _stand_in(tuple(x.shape), dtype) if x.ndim else np.zeros((), dtype)
    if cfg.has_block_mask:
        opts.update(block_size_q=cfg.block_size_q, block_size_k=cfg.block_size_k)
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


def _slice_attrs(dropout_nheads_total):
    """The attribute of a sharded dropout call: the heads of the whole call (0: unsharded)."""
    return {"dropout_nheads_total": np.int64(dropout_nheads_total)} if dropout_nheads_total else {}


def _raw_forward(cfg, vmap_method="broadcast_all", dropout_nheads_total=0):
    """The forward custom call for cfg, as a function of (q, k, v, *extras). Its
    with_nheads_total(n) is the call of one shard of a sharded dropout call over n heads in all
    (_jax_partition), whose seed operand then carries the shard's batch and head offsets."""
    def call(q, k, v, *extras):
        _register()
        fn = jax.ffi.ffi_call(_FWD, _fwd_outputs(q), vmap_method=vmap_method)
        return tuple(fn(q, k, v, *extras, **cfg.attrs(False),
                        **_slice_attrs(dropout_nheads_total)))
    call.with_nheads_total = lambda n: _raw_forward(cfg, vmap_method, n)
    return call


def _raw_backward(cfg, vmap_method="broadcast_all", dropout_nheads_total=0):
    def call(dout, q, k, v, out, lse, *extras):
        _register()
        shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
        shapes += _extra_grad_shapes(cfg, extras)
        fn = jax.ffi.ffi_call(_BWD, shapes, vmap_method=vmap_method)
        return tuple(fn(dout, q, k, v, out, lse, *extras, **cfg.attrs(True),
                        **_slice_attrs(dropout_nheads_total)))
    call.with_nheads_total = lambda n: _raw_backward(cfg, vmap_method, n)
    return call


@functools.lru_cache(maxsize=None)
def _calls(cfg):
    """(forward, backward) custom calls for cfg, partitioned over batch and heads
    (_jax_partition). A sharded call with dropout draws, on each shard, that shard's slice of the
    whole call's mask: the partition passes the shard's batch and head offsets (from
    jax.lax.axis_index) with the seed. jax.vmap folds into the batch, except with dropout, where
    the elements run one by one (each draws the mask of the whole call, as the eager call
    would)."""
    return (partitioned("fwd", cfg, _raw_forward(cfg)),
            partitioned("bwd", cfg, _raw_backward(cfg)))


def _forward(q, k, v, cfg, extras=()):
    return _calls(cfg)[0](q, k, v, *extras)


def _backward(dout, q, k, v, out, lse, cfg, extras=()):
    return _calls(cfg)[1](dout, q, k, v, out, lse, *extras)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, extras, cfg):
    return _forward(q, k, v, cfg, extras)


def _attention_fwd(q, k, v, extras, cfg):
    out, lse = _forward(q, k, v, cfg, extras)
    return (out, lse), (q, k, v, out, lse, extras)


def _attention_bwd(cfg, residuals, cotangents):
    # lse leaves attention() under stop_gradient, so its cotangent is zero: dout alone flows.
    dout, _ = cotangents
    *arrays, extras = residuals
    dq, dk, dv, *grads = _backward(dout, *arrays, cfg, extras)
    return dq, dk, dv, _extra_cotangents(cfg, extras, grads)


def _extra_names(cfg):
    """The names of a call's optional arrays, in the handlers' order (xla_ffi.cpp)."""
    return [n for n, on in (("block_mask", cfg.has_block_mask), ("alibi_slopes", cfg.has_alibi),
                            ("bias", cfg.has_bias), ("mask", cfg.has_mask),
                            ("sinks", cfg.has_sinks), ("seed", cfg.dropout_p > 0)) if on]


def _extra_grad_shapes(cfg, extras):
    """The backward's results after dq, dk, dv: dbias (the bias's shape and dtype, as it reaches
    the handler) with a bias, dsinks (float32, the sinks' shape) with sinks."""
    named = dict(zip(_extra_names(cfg), extras))
    return tuple(jax.ShapeDtypeStruct(named[n].shape, named[n].dtype if n == "bias" else
                                      jnp.float32)
                 for n in ("bias", "sinks") if n in named)


def _extra_cotangents(cfg, extras, grads):
    """The cotangents of the optional arrays: dbias and dsinks (grads, in that order) for the bias
    and the sinks; None (no gradient) for the block mask, slopes, boolean mask and seed."""
    grads = iter(grads)
    return tuple(next(grads) if n in ("bias", "sinks") else None for n in _extra_names(cfg))


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
              return_lse: bool = False, layout: str = "bshd", dropout_p: float = 0.0,
              seed: Any = None, offset: int = 0, block_mask: Any = None,
              block_size: Any = 128, alibi_slopes: Any = None, bias: Any = None,
              mask: Any = None, sinks: Any = None) -> Any:
    """:func:`flashdl.attention` for JAX programs: traceable and differentiable with respect to q,
    k, v (and ``bias``, ``sinks``).

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
    dropout_p : float, default 0.0
        Static. As in :func:`flashdl.attention`: the same Philox mask for the same
        ``(seed, offset)`` (:func:`flashdl.dropout_mask`), forward and backward.
    seed : int or jax.Array, required when ``dropout_p > 0``
        A Python int in ``[0, 2**64)`` (baked into the program), or a traced value: a uint32
        array of shape (2,) (low word, high word; ``jax.random.key_data`` of a threefry key is
        one), a uint32 scalar, or a uint64 scalar (with ``jax_enable_x64``). Never drawn here: a
        seed drawn at trace time would repeat on every call of the compiled program.
    offset : int, default 0
        Static; as in :func:`flashdl.attention`.
    block_mask : bool array, optional
        As in :func:`flashdl.attention` (traced values are fine); ``block_size`` static.
    alibi_slopes : float32 array (nheads,) or (batch, nheads), optional
        As in :func:`flashdl.attention` (traced values are fine); not differentiated.
    bias : float array, optional
        An additive bias broadcastable to (batch, nheads, seqlen_q, seqlen_k) (the last axis
        seqlen_k), as in :func:`flashdl.attention`; differentiated (``jax.grad`` gives dBias in
        its shape). CPU only: CUDA arrays raise the core's NotImplementedError (XLA's
        ``UNIMPLEMENTED``). It reaches the kernel broadcast over batch and heads (one plane per
        (batch, head), so it shards and folds with q): a (seqlen_q, seqlen_k) bias costs
        batch * nheads planes of memory.
    mask : bool array, optional
        True = attend, the bias's shapes; not differentiated. CPU only, as ``bias``.
    sinks : float32 array (nheads,), optional
        Attention sinks, as in :func:`flashdl.attention`; differentiated. CPU only. Under
        ``jax.vmap`` they must be unmapped (one array for every mapped element).

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
    Under ``jax.jit`` with q, k, v sharded over batch and/or heads (``NamedSharding``), each
    device computes its own shard with no collective (docs/jax.md); a sharded sequence axis is
    gathered (use :func:`ring_attention`). With dropout, each shard draws its slice of the
    unsharded call's mask (its batch and head offsets, from ``jax.lax.axis_index``, travel with
    the seed), so a sharded call is bitwise the unsharded one. The CUDA handlers pass their
    tests on an H100; dropout under jit on CUDA copies its traced seed to the host on XLA's
    stream (a stream synchronisation per call; not yet run on a GPU, sharded or not).

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
    block_mask, alibi_slopes = _optional_arrays(block_mask, alibi_slopes)
    bias, mask, sinks = _bias_mask_sinks(bias, mask, sinks, 4)
    cfg = _config(causal, softmax_scale, window_size, schedule, softcap, deterministic,
                  dropout_p, offset, block_mask, block_size, alibi_slopes, bias, mask, sinks)
    seed_arr = _seed(seed, cfg.dropout_p)
    with _LayoutErrors((q, k, v), bhsd):
        if bhsd:
            q, k, v = (_heads_second(n, x, 4) for n, x in (("q", q), ("k", k), ("v", v)))
        _check(_check_dense, {"q": q, "k": k, "v": v}, cfg,
               optional=dict(block_mask=block_mask, alibi_slopes=alibi_slopes, bias=bias,
                             mask=mask, sinks=sinks))
    extras = _dense_extras(q, block_mask, alibi_slopes, seed_arr, bias, mask, sinks)
    out, lse = _attention(q, k, v, extras, _resolved(cfg, q))
    if bhsd:
        out = jnp.swapaxes(out, 1, 2)
    return (out, jax.lax.stop_gradient(lse)) if return_lse else out


def _optional_arrays(block_mask, alibi_slopes):
    """block_mask and alibi_slopes as JAX arrays (NumPy arrays and traced values alike)."""
    out = []
    for name, x, what in (("block_mask", block_mask, "a bool array"),
                          ("alibi_slopes", alibi_slopes, "a float32 array")):
        if x is not None and not (isinstance(x, (jax.Array, np.ndarray))
                                  or _checks.is_tracer(x)):
            raise TypeError(f"{name}: expected None or {what}, got {_checks.describe(x)}")
        out.append(None if x is None else jnp.asarray(x))
    return out


def _bias_mask_sinks(bias, mask, sinks, rank):
    """bias, mask and sinks as JAX arrays, bias and mask of rank `rank` (fewer axes are leading
    size-1 ones, as NumPy broadcasts; the core checks the rest on these shapes)."""
    layout = ("(batch, nheads, seqlen_q, seqlen_k)" if rank == 4
              else "(nheads, total_q, max_seqlen_k)")
    out = []
    for name, x, what in (("bias", bias, "a float array"), ("mask", mask, "a bool array"),
                          ("sinks", sinks, "a float32 array of shape (nheads,)")):
        if x is not None and not (isinstance(x, (jax.Array, np.ndarray))
                                  or _checks.is_tracer(x)):
            raise TypeError(f"{name}: expected None or {what}, got {_checks.describe(x)}")
        if x is not None:
            given = jnp.dtype(x.dtype)
            x = jnp.asarray(x)
            if jnp.dtype(x.dtype) != given:  # float64 without jax_enable_x64
                raise TypeError(f"{name}: expected {what}, got {given} (JAX would convert it to "
                                f"{jnp.dtype(x.dtype)})")
            if name != "sinks":
                x = _full_rank(name, x, rank, layout)
        out.append(x)
    return out


def _dense_extras(q, block_mask, alibi_slopes, seed, bias=None, mask=None, sinks=None):
    """The optional arrays of a dense call, in the handlers' order, broadcast to one plane per
    (batch, head) so that they shard and fold with q's batch and heads (the core has checked
    their shapes on the caller's arrays already). Sinks become one (nheads,) row per batch entry
    (the handler reads the first; dSinks comes back in the first row, zeros in the others, so
    the transpose of the broadcast sums it)."""
    b, h = q.shape[0], q.shape[2]
    extras = []
    if block_mask is not None:
        m = block_mask if block_mask.ndim == 4 else block_mask[None, None]
        extras.append(jnp.broadcast_to(m, (b, h) + m.shape[2:]))
    if alibi_slopes is not None:
        extras.append(jnp.broadcast_to(alibi_slopes, (b, h)))
    for x in (bias, mask):
        if x is not None:
            extras.append(jnp.broadcast_to(x, (b, h) + x.shape[2:]))
    if sinks is not None:
        extras.append(jnp.broadcast_to(sinks, (b, h)))
    if seed is not None:
        extras.append(seed)
    return tuple(extras)


def _seed(seed, dropout_p):
    """The dropout seed as the uint32 (2,) array (low word, high word) the handlers read; None
    without dropout. A Python int becomes a constant; traced values are converted in the
    program."""
    if dropout_p == 0:
        return None
    if seed is None:
        raise TypeError("seed: dropout_p > 0 under flashdl.jax needs a seed: an int in "
                        "[0, 2**64) or a traced uint32 array of shape (2,) (e.g. "
                        "jax.random.key_data(key)); none is drawn, since a seed drawn while "
                        "tracing would repeat on every call of the compiled program")
    if isinstance(seed, (jax.Array, np.ndarray)) or _checks.is_tracer(seed):
        if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
            seed = jax.random.key_data(seed)
        dtype, shape = jnp.dtype(seed.dtype), tuple(seed.shape)
        if dtype == jnp.uint32 and shape == (2,):
            return seed
        if dtype == jnp.uint32 and shape == ():
            return jnp.stack([seed, jnp.zeros((), jnp.uint32)])
        if dtype == jnp.uint64 and shape == ():
            return jnp.stack([(seed & 0xFFFFFFFF).astype(jnp.uint32),
                              (seed >> 32).astype(jnp.uint32)])
        raise TypeError("seed: expected an int, a uint32 array of shape (2,) (low word, high "
                        "word), a uint32 scalar or a uint64 scalar, got "
                        f"{dtype} of shape {shape}")
    value = _unsigned("seed", seed, 64)
    return jnp.array([value & 0xFFFFFFFF, value >> 32], dtype=jnp.uint32)


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


def _varlen_forward(q, k, v, cu_q, cu_k, extras, cfg, lens):
    _register()
    total, h, _ = q.shape
    shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((h, total), jnp.float32))
    call = jax.ffi.ffi_call(_VARLEN_FWD, shapes, vmap_method="sequential")
    return call(q, k, v, cu_q, cu_k, *extras, **cfg.attrs(False), **lens.attrs())


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _attention_varlen(q, k, v, cu_q, cu_k, extras, cfg, lens):
    return _varlen_forward(q, k, v, cu_q, cu_k, extras, cfg, lens)


def _attention_varlen_fwd(q, k, v, cu_q, cu_k, extras, cfg, lens):
    out, lse = _varlen_forward(q, k, v, cu_q, cu_k, extras, cfg, lens)
    return (out, lse), (q, k, v, out, lse, cu_q, cu_k, extras)


def _attention_varlen_bwd(cfg, lens, residuals, cotangents):
    dout, _ = cotangents
    q, k, v, out, lse, cu_q, cu_k, extras = residuals
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    shapes += _extra_grad_shapes(cfg, extras)
    call = jax.ffi.ffi_call(_VARLEN_BWD, shapes, vmap_method="sequential")
    dq, dk, dv, *grads = call(dout, q, k, v, out, lse, cu_q, cu_k, *extras, **cfg.attrs(True),
                              **lens.attrs())
    # the offsets, block mask, slopes, boolean mask and seed are not differentiated
    return dq, dk, dv, None, None, _extra_cotangents(cfg, extras, grads)


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
                     return_lse: bool = False, layout: str = "thd", dropout_p: float = 0.0,
                     seed: Any = None, offset: int = 0, block_mask: Any = None,
                     block_size: Any = 128, alibi_slopes: Any = None, bias: Any = None,
                     mask: Any = None, sinks: Any = None) -> Any:
    """:func:`flashdl.attention_varlen` for JAX programs (flash-attn's packed layout).

    Traceable and differentiable with respect to q, k and v (and bias, sinks), like
    :func:`attention`. ``jax.vmap`` runs a batch of calls one by one.

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
    dropout_p, seed, offset, block_mask, block_size, alibi_slopes : optional
        As in :func:`attention` (the mask of sequence ``b`` is that of dense batch ``b``), and
        block masks and slopes as in :func:`flashdl.attention_varlen`.
    bias, mask, sinks : optional
        As in :func:`flashdl.attention_varlen`: bias and mask broadcastable to (nheads, total_q,
        max_seqlen_k) (row r of the packed queries, columns counted from its sequence's first
        key), sinks float32 (nheads,); bias and sinks are differentiated. CPU only.

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
    block_mask, alibi_slopes = _optional_arrays(block_mask, alibi_slopes)
    bias, mask, sinks = _bias_mask_sinks(bias, mask, sinks, 3)
    cfg = _config(causal, softmax_scale, window_size, schedule, softcap, deterministic,
                  dropout_p, offset, block_mask, block_size, alibi_slopes, bias, mask, sinks)
    seed_arr = _seed(seed, cfg.dropout_p)
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
        _check(_check_varlen, {"q": q, "k": k, "v": v}, cfg, (lens, nseq),
               optional=dict(block_mask=block_mask, alibi_slopes=alibi_slopes, bias=bias,
                             mask=mask, sinks=sinks))
    extras = tuple(x for x in (block_mask, alibi_slopes, bias, mask, sinks, seed_arr)
                   if x is not None)
    out, lse = _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, extras,
                                 _resolved(cfg, q), lens)
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


from ._jax_kvcache import attention_with_kvcache, merge_states  # noqa: E402
from ._jax_ring import ring_attention, ring_permute, ring_unpermute  # noqa: E402
from ._jax_dpa import dot_product_attention  # noqa: E402
from ._jax_flax import flax_attention  # noqa: E402
