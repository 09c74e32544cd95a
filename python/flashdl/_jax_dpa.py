"""flashdl.jax.dot_product_attention: jax.nn.dot_product_attention's signature and semantics on
flashdl's custom call.

JAX's semantics, mapped onto the core's features (docs/howto/jax.md says what differs from
flashdl.jax.attention):

- ``is_causal`` and ``local_window_size`` are aligned top-left (key j is visible to query i iff
  i - left <= j <= i + right, and j <= i with is_causal), whatever T and S. The core's window is
  aligned bottom-right, so the call runs on the first T' queries and the first S' keys with the
  window shifted by S' - T': the rows past T' and the keys past S' are exactly those the window
  hides from every row (_plan), and the shifted window is then the top-left one.
- ``key_value_seq_lengths`` becomes a boolean mask of shape (B, 1, 1, S) (and-ed with ``mask``),
  O(B * S) memory; ``query_seq_lengths`` zeroes the rows past each length (JAX multiplies them
  by 0), so their cotangents are zero and they add nothing to the gradients.
- A row that sees no key: JAX masks with a large finite negative, so its softmax is uniform over
  all S keys and it returns the mean of ``value``; the core returns 0 with lse = -inf there, and
  such rows are replaced by that mean (its gradient flows to ``value``, as in JAX).
- ``return_residual``: the logsumexp of each row, (B, T, N) in the key's dtype, with JAX's large
  negative where a row sees nothing or lies past ``query_seq_lengths``; no gradient.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks
from ._jax_attention import attention

_DTYPES = ("float16", "bfloat16", "float32", "float64")
_IMPLEMENTATIONS = (None, "xla", "cudnn")


def as_array(name, x):
    if isinstance(x, (jax.Array, np.ndarray)) or _checks.is_tracer(x):
        return jnp.asarray(x)
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected an array, got {_checks.describe(x)}") from None


def _ensure_4d(name, x):
    """x with leading size-1 axes up to rank 4, as jax.nn.dot_product_attention does; more than
    four axes are refused naming the argument."""
    if x.ndim > 4:
        raise ValueError(
            f"{name}: expected at most 4 axes (BTNH or TNH for query, key and value; "
            f"BNTS or NTS for bias and mask), got shape {tuple(x.shape)}"
        )
    return x[(None,) * (4 - x.ndim)] if x.ndim < 4 else x


def _window(local_window_size):
    if local_window_size is None:
        return None
    if isinstance(local_window_size, (int, np.integer)) and not isinstance(local_window_size, bool):
        w = operator.index(local_window_size)
        return (w, w)
    if (
        isinstance(local_window_size, (tuple, list))
        and len(local_window_size) == 2
        and all(
            isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in local_window_size
        )
    ):
        return tuple(operator.index(w) for w in local_window_size)
    raise TypeError(
        "local_window_size: expected None, an int or a pair of ints (left, right) "
        f"(static Python values), got {_checks.describe(local_window_size)}"
    )


def _scale(scale, headdim):
    if scale is None:
        return 1.0 / math.sqrt(headdim) if headdim > 0 else 1.0
    if _checks.is_tracer(scale):
        raise TypeError(
            "scale: expected a static Python float (flashdl bakes it into the "
            "kernel call), got a traced value"
        )
    return _checks.finite("scale", _checks.real("scale", scale, "a float"), "a finite float")


def _plan(T, S, is_causal, window):
    """(T', S', (left', right')): the core runs on the first T' queries and first S' keys with
    the bottom-right window (left', right') (-1: unbounded), which is then JAX's top-left
    visibility i - L <= j <= i + R. Rows past T' and keys past S' see (are seen by) nothing.
    T' = 0 or S' = 0: every row sees nothing."""
    L = R = None  # None: unbounded
    if is_causal:
        R = 0
    if window is not None:
        L = window[0]
        R = window[1] if R is None else min(R, window[1])
    if L is not None and R is not None and L + R < 0:
        return 0, 0, (-1, -1)
    Tp = T if L is None else max(0, min(T, S + L))  # row i sees a key only if i - L < S
    Sp = S if R is None else max(0, min(S, Tp + R))  # key j is seen only if j <= T' - 1 + R
    if Tp == 0 or Sp == 0:
        return 0, 0, (-1, -1)
    left = -1 if L is None else L + Sp - Tp
    right = -1 if R is None else Tp + R - Sp
    assert left >= -1 and right >= -1 and (L is None or left >= 0) and (R is None or right >= 0)
    return Tp, Sp, (left, right)


def _check_extra(name, x, full):
    """bias / mask: each axis of x 1 or that of full (B, N, T, S), as JAX broadcasts them."""
    if any(d != 1 and d != f for d, f in zip(x.shape, full)):
        raise ValueError(
            f"{name}: expected a shape broadcastable to (B, N, T, S) = {full} "
            f"(each axis 1 or that size), got {tuple(x.shape)}"
        )


def _check_lengths(name, x, B):
    if x is None:
        return None
    x = as_array(name, x)
    if x.dtype != jnp.int32 or tuple(x.shape) != (B,):
        raise ValueError(
            f"{name}: expected an int32 array of shape ({B},) (one length per batch "
            f"entry), got {x.dtype} of shape {tuple(x.shape)}"
        )
    return x


def _bias_dtype(bias, q_dtype):
    """The dtype the bias reaches the core in: JAX adds it to float32 logits (float64 ones for
    float64 inputs), so a float16, bfloat16 or float32 bias goes in as it is (the core adds it in
    float32) and anything else is converted to the logits' dtype (jax.grad converts dBias back)."""
    logits = jnp.promote_types(q_dtype, jnp.float32)
    if logits == jnp.float64:
        return jnp.dtype(jnp.float64)
    if bias.dtype in (jnp.float16, jnp.bfloat16, jnp.float32):
        return bias.dtype
    return jnp.dtype(jnp.float32)


def _large_negative(q_dtype):
    """JAX's masking value as its softmax sees it (float32): -0.7 * the float32 maximum, rounded
    as jax.nn's _get_large_negative rounds it."""
    logits = jnp.promote_types(q_dtype, jnp.float32)
    dmax = min(jnp.finfo(logits).max, jnp.finfo(jnp.float32).max)
    return jnp.asarray(-0.7 * dmax, dtype=logits).astype(jnp.float32)


def dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    scale: Optional[float] = None,
    is_causal: bool = False,
    query_seq_lengths: Any = None,
    key_value_seq_lengths: Any = None,
    local_window_size: Any = None,
    implementation: Optional[str] = None,
    return_residual: bool = False,
) -> Any:
    """``jax.nn.dot_product_attention`` on flashdl's kernels: the same arguments, layouts,
    semantics and return value.

    Traceable (``jax.jit``), differentiable with respect to query, key, value and bias
    (``jax.grad``: flashdl's backward), ``jax.vmap``-able, and partitioned over batch and heads
    under sharding like :func:`flashdl.jax.attention`. Memory O(B * N * T) beyond the inputs
    (the scores are never materialised), plus what ``bias`` and ``mask`` themselves take (they
    reach the kernel broadcast to one plane per (batch, head)).

    Parameters
    ----------
    query : array (B, T, N, H) or (T, N, H)
        float16, bfloat16, float32 or float64 (CPU), float16 or bfloat16 (CUDA).
    key, value : arrays (B, S, K, H) or (S, K, H), the dtype of query
        N a multiple of K (GQA, MQA).
    bias : array broadcastable to (B, N, T, S), optional
        Added to the scaled logits; differentiated (``jax.grad`` gives dBias in its shape).
    mask : bool array broadcastable to (B, N, T, S), optional
        True: the key takes part.
    scale : float, optional
        Static; default 1/sqrt(H).
    is_causal : bool
        Key j visible to query i iff j <= i (top-left aligned, as JAX's).
    query_seq_lengths, key_value_seq_lengths : int32 arrays (B,), optional
        Padding: rows past the query length are 0, keys past the key length are hidden.
    local_window_size : int or (int, int), optional
        Static; key j visible to query i iff i - left <= j <= i + right (an int: both sides).
    implementation : None, "xla" or "cudnn"
        None: flashdl. "xla" and "cudnn" call ``jax.nn.dot_product_attention`` with that
        implementation (what the caller asked for); any other value is a ValueError, as in JAX.
    return_residual : bool
        Also return the logsumexp of each row, (B, T, N) or (T, N) in the key's dtype, without
        gradient.

    Returns
    -------
    out : array of query's shape and dtype; ``(out, residual)`` with ``return_residual=True``.

    Notes
    -----
    A row that sees no key returns the mean of ``value`` over all S keys (JAX masks with a large
    finite negative, so such a row's softmax is uniform), with residual JAX's large negative. A
    bias of -inf or NaN where a row sees a key is outside what is matched (JAX's result then
    depends on how its masking value compares with it).
    """
    if implementation is not None and implementation not in ("xla", "cudnn"):
        raise ValueError(
            f"implementation: expected None (flashdl), 'xla' or 'cudnn' (JAX's own), "
            f"got {implementation!r}"
        )
    # The same arguments for JAX's own implementation and for flashdl's.
    arguments = dict(
        scale=scale,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        return_residual=return_residual,
    )
    if implementation is not None:
        # (implementation checked above; JAX's overloads take return_residual as a literal)
        return jax.nn.dot_product_attention(  # type: ignore[call-overload]
            query, key, value, bias, mask, implementation=implementation, **arguments
        )
    return attend(query, key, value, bias, mask, **arguments)


def attend(
    query,
    key,
    value,
    bias,
    mask,
    *,
    scale,
    is_causal,
    query_seq_lengths,
    key_value_seq_lengths,
    local_window_size,
    return_residual,
    dropout_p=0.0,
    seed=None,
):
    """dot_product_attention's work, with flashdl's dropout (the Flax adapter's): dropout_p on
    the probabilities, the Philox mask keyed by seed (see flashdl.jax.attention)."""
    is_causal = _checks.flag("is_causal", is_causal)
    return_residual = _checks.flag("return_residual", return_residual)
    window = _window(local_window_size)
    names = ("query", "key", "value")
    query, key, value = (as_array(n, x) for n, x in zip(names, (query, key, value)))
    output_shape = tuple(query.shape)
    q, k, v = (_ensure_4d(n, x) for n, x in zip(names, (query, key, value)))
    B, S, K, H = k.shape
    _, T, N, _ = q.shape
    if jnp.dtype(k.dtype).name not in _DTYPES:
        raise TypeError(f"key: expected dtype float16, bfloat16, float32 or float64, got {k.dtype}")
    for n, x, want in (("value", v, (B, S, K, H)), ("query", q, (B, T, N, H))):
        if x.dtype != k.dtype:
            raise ValueError(f"{n}: expected the dtype of key ({k.dtype}), got {x.dtype}")
        if tuple(x.shape) != want:
            what = "the shape of key" if n == "value" else "the batch and head dim of key"
            raise ValueError(
                f"{n}: expected {what}, shape {want}, got {tuple(x.shape)} "
                f"(given {tuple(value.shape if n == 'value' else output_shape)})"
            )
    if K == 0 or N % K != 0:
        raise ValueError(
            f"query: the number of query heads must be a multiple of the key/value "
            f"heads, got {N} vs {K}"
        )
    full = (B, N, T, S)
    if bias is not None:
        bias = _ensure_4d("bias", as_array("bias", bias))
        _check_extra("bias", bias, full)
    if mask is not None:
        mask = _ensure_4d("mask", as_array("mask", mask))
        if mask.dtype != jnp.bool_:
            raise ValueError(
                f"mask: expected dtype bool (True: attend; an additive mask goes "
                f"in bias), got {mask.dtype}"
            )
        _check_extra("mask", mask, full)
    q_len = _check_lengths("query_seq_lengths", query_seq_lengths, B)
    kv_len = _check_lengths("key_value_seq_lengths", key_value_seq_lengths, B)
    scale = _scale(scale, H)

    Tp, Sp, window_lr = _plan(T, S, is_causal, window)
    if kv_len is not None:
        kv_mask = jnp.arange(S, dtype=jnp.int32) < kv_len[:, None, None, None]
        mask = kv_mask if mask is None else jnp.logical_and(mask, kv_mask)
    # Keys are never skipped: a row that sees none still averages over all S of them.
    v_mean = jnp.mean(v, axis=1, dtype=jnp.promote_types(v.dtype, jnp.float32)).astype(v.dtype)
    v_mean = jnp.repeat(v_mean, N // K, axis=1)[:, None]  # (B, 1, N, H), query head h -> h // G
    if Tp > 0:

        def rows_keys(x):
            if x is None:
                return None
            x = jnp.broadcast_to(x, x.shape[:3] + (S,))  # the core wants the key axis whole
            return x[:, :, : Tp if x.shape[2] != 1 else 1, :Sp]

        if bias is not None:
            bias = bias.astype(_bias_dtype(bias, q.dtype))
        out, lse = attention(
            q[:, :Tp],
            k[:, :Sp],
            v[:, :Sp],
            softmax_scale=scale,
            window_size=window_lr,
            bias=rows_keys(bias),
            mask=rows_keys(mask),
            return_lse=True,
            dropout_p=dropout_p,
            seed=seed,
        )
        lse = jnp.swapaxes(lse, 1, 2)  # (B, T', N)
        empty = lse == -jnp.inf
        if Tp < T:
            out = jnp.concatenate([out, jnp.zeros((B, T - Tp, N, H), out.dtype)], axis=1)
            lse = jnp.concatenate([lse, jnp.zeros((B, T - Tp, N), lse.dtype)], axis=1)
            empty = jnp.concatenate([empty, jnp.ones((B, T - Tp, N), bool)], axis=1)
        out = jnp.where(empty[..., None], v_mean, out)
    else:  # no row sees a key
        out = jnp.broadcast_to(v_mean, (B, T, N, H))
        lse = jnp.zeros((B, T, N), jnp.float32)
        empty = jnp.ones((B, T, N), bool)
    if q_len is not None:
        q_valid = jnp.arange(T, dtype=jnp.int32)[None, :] < q_len[:, None]  # (B, T)
        out = out * q_valid[:, :, None, None].astype(out.dtype)
        empty = jnp.logical_or(empty, ~q_valid[:, :, None])
    out = jnp.reshape(out, output_shape)
    if not return_residual:
        return out
    residual = jnp.where(empty, _large_negative(q.dtype), lse).astype(k.dtype)
    return out, jax.lax.stop_gradient(jnp.reshape(residual, output_shape[:-1]))
