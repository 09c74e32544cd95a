"""flashdl.jax.attention_with_kvcache and merge_states: the KV cache and the state merge as XLA FFI
custom calls.

The cache append is a functional update: the custom call's updated caches alias its argument
caches (``input_output_aliases``), so under ``jax.jit(..., donate_argnums=...)`` the append writes
the donated buffers in place, and without donation XLA copies the caches first (the caller's
arrays are never written either way).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks, _jax_ffi

_jax_ffi.KVCACHE, _jax_ffi.MERGE = "flashdl_attention_kvcache", "flashdl_merge_states"


def _array(name, x, what):
    if not (isinstance(x, (jax.Array, np.ndarray)) or _checks.is_tracer(x)):
        raise TypeError(f"{name}: expected {what}, got {_checks.describe(x)}")
    return jnp.asarray(x)


def _int32(name, x, rank, what):
    x = _array(name, x, f"an int32 array {what}")
    if x.ndim != rank or x.dtype != jnp.int32:
        raise TypeError(
            f"{name}: expected an int32 array {what}, got {x.dtype} of shape {tuple(x.shape)}"
        )
    return x


def _check_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, block_table, batch_idx=None):
    """What Python can check at trace time; the core checks the rest (values of cache_seqlens and
    block_table, room in the cache) when the call runs (XLA's INVALID_ARGUMENT with its message)."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if x is not None and x.ndim != 4:
            raise ValueError(f"{name}: expected a rank-4 array, got shape {tuple(x.shape)}")
        if x is not None and x.dtype != q.dtype:
            raise TypeError(f"{name}: expected dtype {q.dtype} (the dtype of q), got {x.dtype}")
    if (k is None) != (v is None):
        missing = "v" if k is not None else "k"
        raise ValueError(f"{missing}: pass both k and v to append, or neither")
    b, _, h, d = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"v_cache: expected the shape of k_cache {tuple(k_cache.shape)}, got "
            f"{tuple(v_cache.shape)}"
        )
    hk = k_cache.shape[2]
    if k_cache.shape[3] != d or hk == 0 or h % hk:
        raise ValueError(
            f"k_cache: expected (…, nheads_kv, {d}) with nheads_kv dividing "
            f"nheads={h}, got {tuple(k_cache.shape)}"
        )
    if cache_seqlens.shape != (b,):
        raise ValueError(
            f"cache_seqlens: expected shape ({b},) (batch of q), got {tuple(cache_seqlens.shape)}"
        )
    if block_table is None and batch_idx is None and k_cache.shape[0] < b:
        # Sequence i reads cache row i (flash-attn's rule): a cache of more rows is fine.
        raise ValueError(
            f"k_cache: {k_cache.shape[0]} cache rows for the batch of q, {b}; "
            "expected at least one row per sequence"
        )
    if block_table is not None and block_table.shape[0] != b:
        raise ValueError(f"block_table: expected {b} rows (batch of q), got {block_table.shape[0]}")
    if k is not None:
        for name, x in (("k", k), ("v", v)):
            if x.shape[0] != b or x.shape[2:] != (hk, d):
                raise ValueError(
                    f"{name}: expected ({b}, seqlen_new, {hk}, {d}), got {tuple(x.shape)}"
                )


def _check_extras(q, rotary_cos, rotary_sin, batch_idx, leftpad, block_table):
    """Shapes and dtypes of the rotary tables, cache_batch_idx and cache_leftpad (their values,
    like cache_seqlens's, are checked when the call runs)."""
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError(
            f"{'rotary_sin' if rotary_cos is not None else 'rotary_cos'}: expected "
            "both rotary_cos and rotary_sin or neither"
        )
    b, d = q.shape[0], q.shape[3]
    if rotary_cos is not None:
        for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if x.dtype != q.dtype:
                raise TypeError(f"{name}: expected dtype {q.dtype} (the dtype of q), got {x.dtype}")
            if x.ndim != 2 or x.shape[1] == 0 or 2 * x.shape[1] > d:
                raise ValueError(
                    f"{name}: expected (seqlen_ro, rotary_dim / 2) with 0 < "
                    f"rotary_dim <= headdim={d}, got shape {tuple(x.shape)}"
                )
        if rotary_sin.shape != rotary_cos.shape:
            raise ValueError(
                f"rotary_sin: expected the shape of rotary_cos "
                f"{tuple(rotary_cos.shape)}, got {tuple(rotary_sin.shape)}"
            )
    for name, x in (("cache_batch_idx", batch_idx), ("cache_leftpad", leftpad)):
        if x is not None and x.shape != (b,):
            raise ValueError(f"{name}: expected shape ({b},) (batch of q), got {tuple(x.shape)}")
    if batch_idx is not None and block_table is not None:
        raise ValueError(
            "cache_batch_idx: not supported with a paged cache (block_table "
            "already maps each sequence to its pages)"
        )


def _bias_mask_sinks(q, k_cache, block_table, sinks, bias, mask):
    """sinks float32 (nheads,); bias (float) and mask (bool) of rank <= 4 as rank-4 arrays
    broadcastable to (batch, nheads, seqlen_q, capacity), checked at trace time by name."""
    b, sq, h, _ = q.shape
    capacity = (
        block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
    )
    if sinks is not None:
        sinks = _array("sinks", sinks, "a float32 array of shape (nheads,)")
        if sinks.dtype != jnp.float32 or sinks.shape != (h,):
            raise TypeError(
                f"sinks: expected a float32 array of shape ({h},) (nheads,), got "
                f"{sinks.dtype} of shape {tuple(sinks.shape)}"
            )
    want = (b, h, sq, capacity)
    out: list = []
    for name, x, kinds in (("bias", bias, "f"), ("mask", mask, "b")):
        if x is None:
            out.append(None)
            continue
        x = _array(name, x, "a bool array" if kinds == "b" else "a float array")
        if (kinds == "b" and x.dtype != jnp.bool_) or (
            kinds == "f" and x.dtype not in (jnp.float32, jnp.float16, jnp.bfloat16)
        ):
            raise TypeError(
                f"{name}: expected dtype "
                f"{'bool' if kinds == 'b' else 'float32, float16 or bfloat16'}, got "
                f"{x.dtype}"
            )
        shape = (1,) * (4 - x.ndim) + tuple(x.shape)
        if (
            not 1 <= x.ndim <= 4
            or shape[3] != capacity
            or any(s not in (1, w) for s, w in zip(shape[:3], want[:3]))
        ):
            raise ValueError(
                f"{name}: expected a shape broadcastable to {want} (batch or 1, "
                f"nheads or 1, seqlen_q or 1, capacity), got {tuple(x.shape)}"
            )
        out.append(x.reshape(shape))
    return sinks, out[0], out[1]


def attention_with_kvcache(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    cache_seqlens: jax.Array,
    k: Optional[jax.Array] = None,
    v: Optional[jax.Array] = None,
    block_table: Optional[jax.Array] = None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: Tuple[int, int] = (-1, -1),
    num_splits: int = 0,
    return_lse: bool = False,
    alibi_slopes: Optional[jax.Array] = None,
    softcap: float = 0.0,
    rotary_cos: Optional[jax.Array] = None,
    rotary_sin: Optional[jax.Array] = None,
    rotary_interleaved: bool = False,
    cache_batch_idx: Optional[jax.Array] = None,
    cache_leftpad: Optional[jax.Array] = None,
    sinks: Optional[jax.Array] = None,
    bias: Optional[jax.Array] = None,
    mask: Optional[jax.Array] = None,
) -> Any:
    """:func:`flashdl.attention_with_kvcache` for JAX programs; the append is a functional update.

    Parameters are those of :func:`flashdl.attention_with_kvcache` (layout ``"bshd"``, contiguous or
    paged caches), rotary embedding (``rotary_cos``, ``rotary_sin``, ``rotary_interleaved``),
    ``cache_batch_idx``, ``cache_leftpad``, ``sinks``, ``bias`` and ``mask`` included;
    ``cache_seqlens``, ``block_table``, ``cache_batch_idx`` and ``cache_leftpad`` are int32 arrays,
    traced values welcome (their values are checked when the call runs). ``sinks``: float32
    (nheads,); ``bias`` (float32, float16 or bfloat16) and ``mask`` (bool): broadcastable to
    (batch, nheads, seqlen_q, capacity), fewer axes leading size-1 ones, passed as they are (a
    size-1 axis is not expanded). The rotary tables, cache_batch_idx, cache_leftpad, sinks, bias
    and mask are extra operands of the custom call only when given (a plain call's HLO is
    unchanged). No gradient (inference); ``jax.vmap`` runs the calls one by one.

    Returns
    -------
    out, or (out, lse)
        Without ``k``, ``v``.
    (out, k_cache, v_cache), or (out, lse, k_cache, v_cache)
        With ``k``, ``v``: the caches with the new rows written at ``cache_seqlens`` onward.
        Donate the caches (``jax.jit(f, donate_argnums=...)``) to append in place; otherwise XLA
        copies them first. ``cache_seqlens`` is not changed: add ``seqlen_new`` for the next step.

    Raises
    ------
    ValueError, TypeError
        At trace time for shapes and dtypes (naming the argument); when the call runs for
        values (no room in the cache, a page index out of range): XLA's error with the core's
        message.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, flashdl.jax as fj
    >>> kc, vc = jnp.zeros((2, 16, 1, 8), jnp.float32), jnp.zeros((2, 16, 1, 8), jnp.float32)
    >>> q = knew = vnew = jnp.ones((2, 1, 1, 8), jnp.float32)
    >>> step = jax.jit(lambda q, kc, vc, n, k, v: fj.attention_with_kvcache(
    ...     q, kc, vc, cache_seqlens=n, k=k, v=v), donate_argnums=(1, 2))
    >>> out, kc, vc = step(q, kc, vc, jnp.array([3, 5], jnp.int32), knew, vnew)
    >>> out.shape, float(kc[0, 3, 0, 0]), float(kc[0, 4, 0, 0])
    ((2, 1, 1, 8), 1.0, 0.0)
    """
    return_lse = _checks.flag("return_lse", return_lse)
    num_splits = _checks.integer("num_splits", num_splits, "an int >= 0 (0: chosen)", 0, 2**62)
    q, k_cache, v_cache = (
        _array(n, x, "a JAX array")
        for n, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache))
    )
    k = None if k is None else _array("k", k, "a JAX array")
    v = None if v is None else _array("v", v, "a JAX array")
    cache_seqlens = _int32("cache_seqlens", cache_seqlens, 1, "(batch,)")
    if block_table is not None:
        block_table = _int32("block_table", block_table, 2, "(batch, max_pages)")
    if alibi_slopes is not None:
        alibi_slopes = _array("alibi_slopes", alibi_slopes, "a float32 array")
    rotary_interleaved = _checks.flag("rotary_interleaved", rotary_interleaved)
    if rotary_cos is not None:
        rotary_cos = _array("rotary_cos", rotary_cos, "a JAX array")
    if rotary_sin is not None:
        rotary_sin = _array("rotary_sin", rotary_sin, "a JAX array")
    if cache_batch_idx is not None:
        cache_batch_idx = _int32("cache_batch_idx", cache_batch_idx, 1, "(batch,)")
    if cache_leftpad is not None:
        cache_leftpad = _int32("cache_leftpad", cache_leftpad, 1, "(batch,)")
    _check_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, block_table, cache_batch_idx)
    _check_extras(q, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table)
    sinks, bias, mask = _bias_mask_sinks(q, k_cache, block_table, sinks, bias, mask)
    cfg = _jax_ffi.config(causal, softmax_scale, window_size, "auto", softcap, False)
    # The scalar options' values by flashdl.attention's rules at trace time (the core's ValueError
    # naming the argument), not as XLA's INVALID_ARGUMENT when the call runs.
    _jax_ffi.check(_jax_ffi.check_dense, {"q": q, "k": q, "v": q}, cfg)
    cfg = _jax_ffi.resolved(cfg, q)
    attrs = cfg.attrs(False)
    attrs.update(
        num_splits=np.int64(num_splits),
        has_new=k is not None,
        has_block_table=block_table is not None,
        has_alibi=alibi_slopes is not None,
    )
    args = (
        [q, k_cache, v_cache, cache_seqlens]
        + ([k, v] if k is not None else [])
        + ([block_table] if block_table is not None else [])
        + ([alibi_slopes] if alibi_slopes is not None else [])
    )
    if rotary_cos is not None:  # the extras' attributes only when used: plain HLO unchanged
        attrs.update(has_rotary=True, rotary_interleaved=rotary_interleaved)
        args += [rotary_cos, rotary_sin]
    if cache_batch_idx is not None:
        attrs.update(has_batch_idx=True)
        args.append(cache_batch_idx)
    if cache_leftpad is not None:
        attrs.update(has_leftpad=True)
        args.append(cache_leftpad)
    for name, x in (("sinks", sinks), ("bias", bias), ("mask", mask)):
        if x is not None:
            attrs[f"has_{name}"] = True
            args.append(x)
    b, sq, h, _ = q.shape
    shapes = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, sq), jnp.float32)]
    aliases = None
    if k is not None:
        shapes += [jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)] * 2
        aliases = {1: 2, 2: 3}
    _jax_ffi.register()
    call = jax.ffi.ffi_call(
        _jax_ffi.KVCACHE, tuple(shapes), vmap_method="sequential", input_output_aliases=aliases
    )
    res = call(*args, **attrs)
    out, lse = res[0], res[1]
    head = (out, lse) if return_lse else (out,)
    if k is None:
        return head if return_lse else out
    return head + (res[2], res[3])


# ---- merge_states ------------------------------------------------------------------------------


@jax.custom_vjp
def _merge(outs, lses):
    return _jax_ffi.merge_call(outs, lses)


def _merge_fwd(outs, lses):
    out, lse = _jax_ffi.merge_call(outs, lses)
    return (out, lse), (outs, lses, out, lse)


def _merge_bwd(res, cot):
    """out = sum_i w_i outs[i], lse = log sum_i exp(lses[i]), w_i = exp(lses[i] - lse) (0 where
    lses[i] is -inf): d outs[i] = w_i dout, d lses[i] = w_i (dlse + <dout, outs[i] - out>)."""
    outs, lses, out, lse = res
    dout, dlse = cot
    d_outs, d_lses = [], []
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    for o, l in zip(outs, lses):
        w = jnp.where(jnp.isneginf(l), 0.0, jnp.exp(l - safe))  # (..., h, s)
        wt = jnp.swapaxes(w, -1, -2)[..., None]  # (..., s, h, 1)
        d_outs.append((wt * dout.astype(jnp.float32)).astype(o.dtype))
        dot = jnp.sum(
            dout.astype(jnp.float32) * (o.astype(jnp.float32) - out.astype(jnp.float32)), axis=-1
        )
        d_lses.append(w * (dlse + jnp.swapaxes(dot, -1, -2)))
    return tuple(d_outs), tuple(d_lses)


_merge.defvjp(_merge_fwd, _merge_bwd)


def merge_states(
    outs: Sequence[jax.Array], lses: Sequence[jax.Array]
) -> Tuple[jax.Array, jax.Array]:
    """:func:`flashdl.merge_states_list` for JAX programs: ``(out, lse)`` over the union of disjoint
    key sets, from the partial results over each, by flashdl's merge (a custom call).

    Traceable, differentiable with respect to every ``outs[i]`` and ``lses[i]`` (a closed-form
    backward in the program), and vmappable (mapped axes fold into the batch).

    Parameters
    ----------
    outs : sequence of jax.Array (batch, seqlen, nheads, headdim)
        At least one; all of one shape and dtype.
    lses : sequence of float32 jax.Array (batch, nheads, seqlen)
        One per output.

    Returns
    -------
    out : jax.Array, like outs[0]
    lse : float32 jax.Array (batch, nheads, seqlen)

    Examples
    --------
    >>> import jax, jax.numpy as jnp, flashdl.jax as fj
    >>> o = jnp.ones((1, 4, 2, 8), jnp.float32); l = jnp.zeros((1, 2, 4), jnp.float32)
    >>> out, lse = jax.jit(fj.merge_states)([o, 2 * o], [l, l])
    >>> float(out[0, 0, 0, 0]), round(float(lse[0, 0, 0]), 4)
    (1.5, 0.6931)
    """
    if isinstance(outs, (jax.Array, np.ndarray)) or isinstance(lses, (jax.Array, np.ndarray)):
        raise TypeError("outs, lses: expected sequences (lists) of arrays, got an array")
    outs = [_array(f"outs[{i}]", o, "a JAX array") for i, o in enumerate(outs)]
    lses = [_array(f"lses[{i}]", x, "a float32 JAX array") for i, x in enumerate(lses)]
    if not outs or len(outs) != len(lses):
        raise ValueError(
            f"lses: expected one lse per output ({len(outs)} outputs, at least one), "
            f"got {len(lses)}"
        )
    o0 = outs[0]
    if o0.ndim != 4:
        raise ValueError(
            f"outs[0]: expected (batch, seqlen, nheads, headdim), got shape {tuple(o0.shape)}"
        )
    if jnp.dtype(o0.dtype) not in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64):
        # As flashdl.merge_states: refused when traced, not by XLA when the call runs.
        raise TypeError(
            f"outs[0]: expected dtype float16, bfloat16, float32 or float64, got {o0.dtype}"
        )
    b, s, h, _ = o0.shape
    for i, (o, l) in enumerate(zip(outs, lses)):
        if o.shape != o0.shape or o.dtype != o0.dtype:
            raise ValueError(
                f"outs[{i}]: expected {o0.dtype} of shape {tuple(o0.shape)} (that "
                f"of outs[0]), got {o.dtype} of shape {tuple(o.shape)}"
            )
        if l.shape != (b, h, s) or l.dtype != jnp.float32:
            raise ValueError(
                f"lses[{i}]: expected float32 of shape {(b, h, s)}, got {l.dtype} "
                f"of shape {tuple(l.shape)}"
            )
    return _merge(tuple(outs), tuple(lses))
