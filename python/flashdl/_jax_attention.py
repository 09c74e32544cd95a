"""flashdl.jax.attention and attention_varlen: jax.custom_vjp functions over flashdl's XLA FFI
custom calls (_jax_ffi), traceable under jax.jit, jax.grad / jax.vjp and jax.vmap.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _args, _checks, _ext, _jax_ffi


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, extras, cfg):
    return _jax_ffi.forward(q, k, v, cfg, extras)


def _attention_fwd(q, k, v, extras, cfg):
    out, lse = _jax_ffi.forward(q, k, v, cfg, extras)
    return (out, lse), (q, k, v, out, lse, extras)


def _attention_bwd(cfg, residuals, cotangents):
    # lse leaves attention() under stop_gradient, so its cotangent is zero: dout alone flows.
    dout, _ = cotangents
    q, k, v, out, lse, extras = residuals
    dq, dk, dv, *grads = _jax_ffi.backward(dout, q, k, v, out, lse, cfg, extras)
    return dq, dk, dv, _extra_cotangents(cfg, extras, grads)


def _extra_cotangents(cfg, extras, grads):
    """The cotangents of the optional arrays: dbias and dsinks (grads, in that order) for the bias
    and the sinks; None (no gradient) for the block mask, slopes, boolean mask and seed."""
    grads = iter(grads)
    return tuple(next(grads) if n in ("bias", "sinks") else None for n in _jax_ffi.extra_names(cfg))


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: Tuple[int, int] = (-1, -1),
    schedule: str = "auto",
    softcap: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
    layout: str = "bshd",
    dropout_p: float = 0.0,
    seed: Any = None,
    offset: int = 0,
    block_mask: Any = None,
    block_size: Any = 128,
    alibi_slopes: Any = None,
    bias: Any = None,
    mask: Any = None,
    sinks: Any = None,
) -> Any:
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
    device computes its own shard with no collective (docs/howto/jax.md); a sharded sequence axis is
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
    bhsd = _args.is_heads_first(layout)
    block_mask, alibi_slopes = _optional_arrays(block_mask, alibi_slopes)
    bias, mask, sinks = _bias_mask_sinks(bias, mask, sinks, 4)
    cfg = _jax_ffi.config(
        causal,
        softmax_scale,
        window_size,
        schedule,
        softcap,
        deterministic,
        dropout_p,
        offset,
        block_mask,
        block_size,
        alibi_slopes,
        bias,
        mask,
        sinks,
    )
    seed_arr = _seed(seed, cfg.dropout_p)
    with _args.LayoutErrors((q, k, v), bhsd):
        if bhsd:
            q, k, v = (_heads_second(n, x, 4) for n, x in (("q", q), ("k", k), ("v", v)))
        _jax_ffi.check(
            _jax_ffi.check_dense,
            {"q": q, "k": k, "v": v},
            cfg,
            optional=dict(
                block_mask=block_mask, alibi_slopes=alibi_slopes, bias=bias, mask=mask, sinks=sinks
            ),
        )
    extras = _dense_extras(q, block_mask, alibi_slopes, seed_arr, bias, mask, sinks)
    out, lse = _attention(q, k, v, extras, _jax_ffi.resolved(cfg, q))
    if bhsd:
        out = jnp.swapaxes(out, 1, 2)
    return (out, jax.lax.stop_gradient(lse)) if return_lse else out


def _optional_arrays(block_mask, alibi_slopes):
    """block_mask and alibi_slopes as JAX arrays (NumPy arrays and traced values alike)."""
    out = []
    for name, x, what in (
        ("block_mask", block_mask, "a bool array"),
        ("alibi_slopes", alibi_slopes, "a float32 array"),
    ):
        if x is not None and not (isinstance(x, (jax.Array, np.ndarray)) or _checks.is_tracer(x)):
            raise TypeError(f"{name}: expected None or {what}, got {_checks.describe(x)}")
        out.append(None if x is None else jnp.asarray(x))
    return out


def _bias_mask_sinks(bias, mask, sinks, rank):
    """bias, mask and sinks as JAX arrays, bias and mask of rank `rank` (fewer axes are leading
    size-1 ones, as NumPy broadcasts; the core checks the rest on these shapes)."""
    layout = (
        "(batch, nheads, seqlen_q, seqlen_k)" if rank == 4 else "(nheads, total_q, max_seqlen_k)"
    )
    out = []
    for name, x, what in (
        ("bias", bias, "a float array"),
        ("mask", mask, "a bool array"),
        ("sinks", sinks, "a float32 array of shape (nheads,)"),
    ):
        if x is not None and not (isinstance(x, (jax.Array, np.ndarray)) or _checks.is_tracer(x)):
            raise TypeError(f"{name}: expected None or {what}, got {_checks.describe(x)}")
        if x is not None:
            given = jnp.dtype(x.dtype)
            x = jnp.asarray(x)
            if jnp.dtype(x.dtype) != given:  # float64 without jax_enable_x64
                raise TypeError(
                    f"{name}: expected {what}, got {given} (JAX would convert it to "
                    f"{jnp.dtype(x.dtype)})"
                )
            if name != "sinks":
                x = _args.full_rank(name, x, rank, layout)
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
        raise TypeError(
            "seed: dropout_p > 0 under flashdl.jax needs a seed: an int in "
            "[0, 2**64) or a traced uint32 array of shape (2,) (e.g. "
            "jax.random.key_data(key)); none is drawn, since a seed drawn while "
            "tracing would repeat on every call of the compiled program"
        )
    if isinstance(seed, (jax.Array, np.ndarray)) or _checks.is_tracer(seed):
        if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
            seed = jax.random.key_data(seed)
        dtype, shape = jnp.dtype(seed.dtype), tuple(seed.shape)
        if dtype == jnp.uint32 and shape == (2,):
            return seed
        if dtype == jnp.uint32 and shape == ():
            return jnp.stack([seed, jnp.zeros((), jnp.uint32)])
        if dtype == jnp.uint64 and shape == ():
            return jnp.stack(
                [(seed & 0xFFFFFFFF).astype(jnp.uint32), (seed >> 32).astype(jnp.uint32)]
            )
        raise TypeError(
            "seed: expected an int, a uint32 array of shape (2,) (low word, high "
            "word), a uint32 scalar or a uint64 scalar, got "
            f"{dtype} of shape {shape}"
        )
    value = _args.unsigned("seed", seed, 64)
    return jnp.array([value & 0xFFFFFFFF, value >> 32], dtype=jnp.uint32)


def _heads_second(name, x, rank):
    """A heads-first array ((batch, nheads, seqlen, headdim), or (nheads, total, headdim)) in
    flashdl's order, transposed by XLA."""
    if jnp.ndim(x) != rank:
        layout, axes = (
            ("bhsd", "(batch, nheads, seqlen, headdim)")
            if rank == 4
            else ("htd", "(nheads, total, headdim)")
        )
        raise ValueError(
            f"{name}: with layout={layout!r} expected a rank-{rank} array {axes}, "
            f"got shape {jnp.shape(x)}"
        )
    return jnp.swapaxes(x, rank - 3, rank - 2)


# ---- variable-length batches (flash-attn's packed layout) ---------------------------------------


class _Varlen(NamedTuple):
    max_seqlen_q: int
    max_seqlen_k: int

    def attrs(self) -> dict:
        return dict(
            max_seqlen_q=np.int64(self.max_seqlen_q), max_seqlen_k=np.int64(self.max_seqlen_k)
        )


def _varlen_forward(q, k, v, cu_q, cu_k, extras, cfg, lens):
    _jax_ffi.register()
    total, h, _ = q.shape
    shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((h, total), jnp.float32))
    call = jax.ffi.ffi_call(_jax_ffi.VARLEN_FWD, shapes, vmap_method="sequential")
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
    shapes += _jax_ffi.extra_grad_shapes(cfg, extras)
    call = jax.ffi.ffi_call(_jax_ffi.VARLEN_BWD, shapes, vmap_method="sequential")
    dq, dk, dv, *grads = call(
        dout, q, k, v, out, lse, cu_q, cu_k, *extras, **cfg.attrs(True), **lens.attrs()
    )
    # the offsets, block mask, slopes, boolean mask and seed are not differentiated
    return dq, dk, dv, None, None, _extra_cotangents(cfg, extras, grads)


_attention_varlen.defvjp(_attention_varlen_fwd, _attention_varlen_bwd)


def _check_varlen(probes, opts, lens, nseq):
    q, k, v = probes["q"], probes["k"], probes["v"]
    cu = np.zeros(nseq + 1, np.int32)  # validate_only: its values are not read
    out = _jax_ffi.stand_in(q.shape, q.dtype, writable=True)
    lse = _jax_ffi.stand_in(
        (q.shape[1], q.shape[0]) if q.ndim == 3 else (0, 0), np.float32, writable=True
    )
    _ext.forward_varlen(q, k, v, cu, cu, lens.max_seqlen_q, lens.max_seqlen_k, out, lse, **opts)


def attention_varlen(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: Tuple[int, int] = (-1, -1),
    schedule: str = "auto",
    softcap: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
    layout: str = "thd",
    dropout_p: float = 0.0,
    seed: Any = None,
    offset: int = 0,
    block_mask: Any = None,
    block_size: Any = 128,
    alibi_slopes: Any = None,
    bias: Any = None,
    mask: Any = None,
    sinks: Any = None,
) -> Any:
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
    heads_first = _args.is_heads_first(layout, varlen=True)
    block_mask, alibi_slopes = _optional_arrays(block_mask, alibi_slopes)
    bias, mask, sinks = _bias_mask_sinks(bias, mask, sinks, 3)
    cfg = _jax_ffi.config(
        causal,
        softmax_scale,
        window_size,
        schedule,
        softcap,
        deterministic,
        dropout_p,
        offset,
        block_mask,
        block_size,
        alibi_slopes,
        bias,
        mask,
        sinks,
    )
    seed_arr = _seed(seed, cfg.dropout_p)
    lens = _Varlen(
        _static_int("max_seqlen_q", max_seqlen_q), _static_int("max_seqlen_k", max_seqlen_k)
    )
    cu_seqlens_q, cu_seqlens_k = (
        _offsets(n, cu)
        for n, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
    )
    nseq = jnp.shape(cu_seqlens_q)[0] - 1
    if jnp.shape(cu_seqlens_k)[0] - 1 != nseq or nseq < 0:
        raise ValueError(
            "cu_seqlens_k: expected the shape of cu_seqlens_q "
            f"{jnp.shape(cu_seqlens_q)}, got {jnp.shape(cu_seqlens_k)}"
        )
    with _args.LayoutErrors((q, k, v), heads_first, varlen=True):
        if heads_first:
            q, k, v = (_heads_second(n, x, 3) for n, x in (("q", q), ("k", k), ("v", v)))
        _jax_ffi.check(
            _check_varlen,
            {"q": q, "k": k, "v": v},
            cfg,
            (lens, nseq),
            optional=dict(
                block_mask=block_mask, alibi_slopes=alibi_slopes, bias=bias, mask=mask, sinks=sinks
            ),
        )
    extras = tuple(
        x for x in (block_mask, alibi_slopes, bias, mask, sinks, seed_arr) if x is not None
    )
    out, lse = _attention_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, extras, _jax_ffi.resolved(cfg, q), lens
    )
    if heads_first:
        out = jnp.swapaxes(out, 0, 1)
    return (out, jax.lax.stop_gradient(lse)) if return_lse else out


def _offsets(name, cu):
    """cu_seqlens as the int32 (batch + 1,) array the handlers read: other integer dtypes are
    converted (values known at trace time must fit int32)."""
    dtype = jnp.result_type(cu)
    if jnp.ndim(cu) != 1 or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(
            f"{name}: expected an int32 array (batch + 1,), got {dtype} of shape {jnp.shape(cu)}"
        )
    if dtype == jnp.int32:
        return cu
    if not isinstance(cu, jax.core.Tracer):
        values = np.asarray(cu)
        if values.size and (values.min() < -(2**31) or values.max() >= 2**31):
            raise ValueError(
                f"{name}: expected int32 values, got "
                f"{values.max() if values.max() >= 2**31 else values.min()}"
            )
    return jnp.asarray(cu).astype(jnp.int32)


def _static_int(name, x) -> int:
    """A static int (a traced value, a float or a bool is a TypeError naming the argument)."""
    return _checks.integer(name, x, "a static int that fits int64")
