"""flashdl.jax.flax_attention: an ``attention_fn`` for Flax's attention modules, linen's
``MultiHeadDotProductAttention`` and nnx's ``MultiHeadAttention``:

    nnx.MultiHeadAttention(..., attention_fn=flashdl.jax.flax_attention)
    nn.MultiHeadDotProductAttention(..., attention_fn=flashdl.jax.flax_attention)

It takes the arguments those modules pass (Flax's ``dot_product_attention`` signature) and runs
flashdl.jax.dot_product_attention's work on them (_jax_dpa._attend). Flax itself is not imported:
this module only speaks its calling convention.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from . import _checks
from ._jax_dpa import as_array, attend


def _flat(name, x, batch):
    """bias or mask (broadcastable to batch + (heads, T, S)) with the batch axes folded into one,
    as q's are."""
    if x is None:
        return None
    x = as_array(name, x)
    if x.ndim < 3:
        x = x[(None,) * (3 - x.ndim)]
    try:
        x = jnp.broadcast_to(x, batch + tuple(x.shape[-3:]))
    except ValueError:
        raise ValueError(
            f"{name}: expected a shape broadcastable to batch + (heads, q_length, "
            f"kv_length) with batch {batch}, got {tuple(x.shape)}"
        ) from None
    return x.reshape((-1,) + tuple(x.shape[-3:]))


def flax_attention(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    broadcast_dropout: bool = True,
    dropout_rng: Any = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    force_fp32_for_softmax: bool = False,
    is_causal: bool = False,
) -> Any:
    """Flax's ``dot_product_attention`` on flashdl's kernels, to pass as ``attention_fn``.

    Parameters
    ----------
    query : array ``[batch..., q_length, num_heads, head_dim]``
    key, value : arrays ``[batch..., kv_length, num_kv_heads, head_dim]``
        ``num_heads`` a multiple of ``num_kv_heads`` (nnx's ``num_kv_heads``).
    bias : array broadcastable to ``[batch..., num_heads, q_length, kv_length]``, optional
        Added to the scaled logits; differentiated.
    mask : array of that shape, optional
        Nonzero / True: attend (Flax's ``make_causal_mask``, ``make_attention_mask``).
    broadcast_dropout : bool
        Accepted; flashdl draws its dropout mask per (batch, head, row, key) either way (Flax's
        default True shares one mask across batch and heads).
    dropout_rng : PRNG key, needed with dropout
        flashdl's Philox seed is drawn from it (``jax.random.bits(dropout_rng, (2,), uint32)``).
    dropout_rate : float
        Static. Applied to the attention probabilities, kept ones scaled by
        ``1 / (1 - dropout_rate)`` as in Flax, when ``deterministic`` is False.
    deterministic : bool
        True: no dropout.
    dtype : dtype, optional
        The computation dtype: query, key and value are converted to it (Flax's
        ``promote_dtype``); None: their common dtype.
    precision, force_fp32_for_softmax
        Accepted and unused: flashdl computes the scores and the softmax in float32 (float64 for
        float64 inputs) whatever they say.
    module : None
        Flax passes its module when asked to sow the attention weights; flashdl never forms them,
        so a module is refused (ValueError) rather than sowing nothing.
    is_causal : bool
        nnx's flag: key j visible to query i iff j <= i.

    Returns
    -------
    array ``[batch..., q_length, num_heads, head_dim]``

    Notes
    -----
    A row whose mask hides every key returns the mean of ``value`` (Flax's softmax over a row of
    equal masked logits is uniform). Dropout follows flashdl's Philox mask, not
    ``jax.random.bernoulli``: results with dropout match Flax's in distribution, not bitwise.
    """
    del precision, force_fp32_for_softmax, broadcast_dropout
    if module is not None:
        raise ValueError(
            "module: flashdl never forms the attention weights, so it cannot sow "
            "them; call the Flax module with sow_weights=False"
        )
    names = ("query", "key", "value")
    query, key, value = (as_array(n, x) for n, x in zip(names, (query, key, value)))
    dtype = jnp.result_type(query, key, value) if dtype is None else jnp.dtype(dtype)
    query, key, value = (x.astype(dtype) for x in (query, key, value))
    for n, x in zip(names, (query, key, value)):
        if x.ndim < 3:
            raise ValueError(
                f"{n}: expected [batch..., length, heads, head_dim], got shape {tuple(x.shape)}"
            )
    batch = tuple(query.shape[:-3])
    if len(batch) > 1:
        query, key, value = (x.reshape((-1,) + tuple(x.shape[-3:])) for x in (query, key, value))
        bias, mask = _flat("bias", bias, batch), _flat("mask", mask, batch)
    if mask is not None:
        mask = as_array("mask", mask).astype(bool)
    dropout_p, seed = 0.0, None
    deterministic = _checks.flag("deterministic", deterministic)
    if not deterministic and dropout_rate != 0:
        if dropout_rng is None:
            raise ValueError(
                "dropout_rng: expected a PRNG key when dropout_rate > 0 and "
                "deterministic is False, got None"
            )
        dropout_p = dropout_rate
        seed = jax.random.bits(dropout_rng, (2,), jnp.uint32)
    out = attend(
        query,
        key,
        value,
        bias,
        mask,
        scale=None,
        is_causal=is_causal,
        query_seq_lengths=None,
        key_value_seq_lengths=None,
        local_window_size=None,
        return_residual=False,
        dropout_p=dropout_p,
        seed=seed,
    )
    return out.reshape(batch + tuple(out.shape[-3:])) if len(batch) > 1 else out
