"""Hugging Face transformers attention backend: flashdl computes the attention of transformers
models (transformers >= 5), forward and backward.

    import flashdl.transformers
    name = flashdl.transformers.register()                  # "fdl"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)

register() adds attention_forward to transformers.AttentionInterface and attention_mask_interface
to transformers.AttentionMaskInterface under one name (transformers refuses names containing
"flash" outside its kernel hub, so the default is "fdl"). What it supports, in transformers'
terms:

- causal (bottom-right aligned with a KV cache) and bidirectional attention (the module's
  is_causal, or the is_causal argument); GQA/MQA natively; scaling, softcap (Gemma 2), dropout
  (flashdl's Philox dropout, seeded from the generator of the tensors' device); a value head
  dim smaller than the query's (padded with zeros, cropped from the output, as transformers'
  flash integration does).
- sliding_window=w (Mistral, Qwen2, Gemma 2): key j visible to query i iff i - w < j <= i, the
  masks of "eager" and "sdpa", i.e. flashdl window_size=(w - 1, 0). As in transformers' flash
  integration, the window is the sliding_window argument the model passes to the attention
  function; the mask interface passes a 2-D mask (or None) on only for mask patterns that are
  plain causal, causal with a sliding window, or bidirectional, checked entry by entry where
  they are not transformers' plain causal and bidirectional functions.
- padding (a 2-D attention_mask): the tokens are unpadded into flashdl.torch.attention_varlen and
  the output padded back, as transformers' flash-attention integration does; right, left and
  inner padding, in training, prefill and decoding (DynamicCache, StaticCache, sliding caches).
  The output rows of padding queries of causal attention are zeros (as in transformers' flash
  integration; "eager" computes values there that no real token reads); bidirectional attention
  with a 2-D mask computes every query row as "eager" does.
- packed sequences (position_ids restarting, which transformers turns into a block-diagonal
  mask), chunked attention and any other 4-D boolean mask (or additive float mask of 0 and -inf)
  that is exactly a set of causal or bidirectional sequences with this layer's window: such a
  mask is decomposed into varlen sequences and checked entry by entry against them (a token
  that does not attend to itself is padding: nothing may attend to it, its output row is zeros);
  cu_seq_lens_q/cu_seq_lens_k/max_length_q/max_length_k keyword arguments without a mask run the
  varlen path directly, as in transformers' flash integration.

- any other 4-D mask (an additive float bias, per-head masks, bidirectional image-token blocks,
  a 4-D mask with a KV cache) runs as flashdl's bias (float) or mask (bool), the mask alone
  deciding what each query sees, as "sdpa" does; gpt-oss's attention sinks (s_aux) run with their
  gradient.

Refused with NotImplementedError naming the feature, never approximated: 4-D masks of other
dtypes, a sliding window with padding between tokens (its distances would count the
padding), bidirectional sliding windows that matter (transformers' own implementations disagree
on their width), position_bias, paged caches (continuous batching),
BlockMask (flex attention) masks. output_attentions=True returns None as the weights (with a
warning), as transformers' flash and sdpa integrations do.
"""

from __future__ import annotations

import numbers
import operator
import os
import warnings
import weakref
from typing import Any, Optional, Tuple

import torch

from . import _checks
from . import torch as _fdl

__all__ = ["attention_forward", "attention_mask_interface", "register"]

DEFAULT_NAME = "fdl"

# Keyword arguments transformers may pass to an attention function that flashdl cannot honour.
_REFUSED = {
    "position_bias": "an additive position_bias",
    "cache": "a paged cache (continuous batching)",
    "block_table": "a paged cache (block_table)",
    "k_cache": "a paged cache (k_cache)",
    "v_cache": "a paged cache (v_cache)",
}

# Rows of mask evaluated at once when checking a mask pattern (bounds the memory to ~4M bools).
_CHECK_ELEMENTS = 1 << 22


def _transformers():
    try:
        import transformers
        import transformers.masking_utils
    except ImportError as err:
        raise ImportError(
            "flashdl.transformers needs the transformers package (pip install transformers)"
        ) from err
    if not hasattr(transformers, "AttentionMaskInterface"):
        raise ImportError(
            "flashdl.transformers needs transformers >= 5 (AttentionInterface and "
            f"AttentionMaskInterface); found {transformers.__version__}"
        )
    return transformers


def register(name: str = DEFAULT_NAME) -> str:
    """Registers flashdl as the attention implementation ``name`` of transformers and returns it.

    Use the name as ``from_pretrained(..., attn_implementation=name)``,
    ``from_config(..., attn_implementation=name)`` or ``model.set_attn_implementation(name)``.
    Registering again under the same name is a no-op.

    Parameters
    ----------
    name : str, default "fdl"
        May not contain "flash" (transformers reserves those names for flash-attn and its kernel
        hub), "sdpa" or "flex_attention" (transformers runs those implementations' checks on such
        names), nor look like a hub kernel ("org/repo"), nor be "eager" or "paged|...".

    Returns
    -------
    str
        ``name``.

    Raises
    ------
    ValueError
        A reserved name, or one another implementation holds.
    TypeError
        ``name`` not a str.
    ImportError
        transformers older than 5 (no ``AttentionMaskInterface``).

    Examples
    --------
    >>> import flashdl.transformers
    >>> flashdl.transformers.register()
    'fdl'
    """
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str, got {type(name).__name__}")
    reserved = [word for word in ("flash", "sdpa", "flex_attention") if word in name]
    if (
        not name
        or reserved
        or "/" in name
        or ":" in name
        or name == "eager"
        or name.startswith("paged|")
    ):
        why = (
            f"contains {reserved[0]!r}, which transformers reserves"
            if reserved
            else "is reserved by transformers or looks like a hub kernel"
        )
        raise ValueError(f"name: {name!r} {why}; choose another (default {DEFAULT_NAME!r})")
    transformers = _transformers()
    functions = transformers.AttentionInterface()
    masks = transformers.AttentionMaskInterface()
    for interface, ours, what in (
        (functions, attention_forward, "AttentionInterface"),
        (masks, attention_mask_interface, "AttentionMaskInterface"),
    ):
        if name in interface and interface[name] is not ours:
            raise ValueError(
                f"name: {name!r} is already registered in transformers' {what} by "
                "another implementation"
            )
    transformers.AttentionInterface.register(name, attention_forward)
    transformers.AttentionMaskInterface.register(name, attention_mask_interface)
    return name


# --- The mask interface: what create_causal_mask & co. hand to attention_forward ---------------


def attention_mask_interface(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    mask_function: Any = None,
    attention_mask: Optional[torch.Tensor] = None,
    local_size: Optional[int] = None,
    use_vmap: bool = False,
    device: Any = "cpu",
    **kwargs: Any,
) -> Optional[torch.Tensor]:
    """transformers' mask interface for flashdl (``masking_utils.create_causal_mask`` and the others
    call it).

    Parameters
    ----------
    batch_size, q_length, kv_length : int
    q_offset, kv_offset : int, default 0
        Positions of the first query and key.
    mask_function : callable, optional
        transformers' mask pattern (default: causal).
    attention_mask : torch.Tensor (batch, seqlen), optional
        The 2-D padding mask.
    local_size : int, optional
        A sliding window.
    use_vmap : bool, default False
    device : torch.device or str, default "cpu"
    **kwargs
        Ignored.

    Returns
    -------
    torch.Tensor or None
        When the pattern of ``mask_function`` is plain causal (with the sliding window
        ``local_size``, if any) or plain bidirectional, what transformers' flash-attention
        integration returns: None without padding, else the 2-D bool padding mask of the keys,
        (batch, n), where n is the number of key slots up to the last query (a StaticCache's unused
        tail is left out). Otherwise (packed sequences, chunks, block-wise or custom overlays) the
        4-D bool mask "sdpa" would get; :func:`attention_forward` decomposes it into varlen sequences
        or refuses it.

    Raises
    ------
    NotImplementedError
        Causal queries that do not end the keys.
    ValueError
        An ``attention_mask`` that is not 2-D or is shorter than the keys.

    Examples
    --------
    >>> import torch, flashdl.transformers
    >>> print(flashdl.transformers.attention_mask_interface(2, 4, 4))       # causal, no padding
    None
    >>> pad = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])                    # left padding
    >>> flashdl.transformers.attention_mask_interface(2, 4, 4, attention_mask=pad)
    tensor([[False,  True,  True,  True],
            [ True,  True,  True,  True]])
    """
    transformers = _transformers()
    masking = transformers.masking_utils
    if mask_function is None:
        mask_function = masking.causal_mask_function
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    # transformers' sdpa_mask arguments for this grid: the 4-D mask below, and _pattern's probes.
    grid = dict(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
        use_vmap=use_vmap,
        device=device,
    )
    kind = _pattern(masking, grid)
    if kind is None:
        return masking.sdpa_mask(**grid)
    # Key slots that exist: a causal layer's queries are its last slots (a StaticCache's keys
    # beyond them are unused, as they are masked for "sdpa"); bidirectional layers keep all.
    n = kv_length
    if kind == "causal":
        n = q_offset + q_length - kv_offset
        if not q_length <= n <= kv_length:
            raise NotImplementedError(
                f"flashdl attention: queries at positions [{q_offset}, {q_offset + q_length}) "
                f"do not end the keys at [{kv_offset}, {kv_offset + kv_length})"
            )
    if attention_mask is None:
        return (
            None if n == kv_length else torch.ones(batch_size, n, dtype=torch.bool, device=device)
        )
    if attention_mask.dim() != 2:
        raise ValueError(
            "attention_mask: expected a 2-D padding mask (batch, seqlen), got shape "
            f"{tuple(attention_mask.shape)}"
        )
    # The last column of the 2-D mask is the last token, as in transformers' flash integration;
    # so a mask this function returned (generate() feeds it back in) means the same again.
    if attention_mask.shape[1] < n:
        raise ValueError(
            f"attention_mask: a 2-D mask of {attention_mask.shape[1]} tokens for "
            f"{n} keys (positions [{kv_offset}, {kv_offset + n}))"
        )
    padding = attention_mask.to(device=device, dtype=torch.bool)[:, attention_mask.shape[1] - n :]
    if n == kv_length and bool(padding.all()):
        return None
    return padding


def _pattern(masking, grid):
    """'causal' or 'bidirectional' when mask_function is that pattern (with the window local_size
    where given) over this grid (sdpa_mask's arguments), else None. transformers' own two plain
    patterns are known by identity; any other is evaluated, a block of rows at a time, without
    padding or window, and compared entry by entry."""
    mask_function, local_size = grid["mask_function"], grid["local_size"]
    if local_size is None and mask_function is masking.causal_mask_function:
        return "causal"
    if local_size is None and mask_function is masking.bidirectional_mask_function:
        return "bidirectional"
    batch_size, q_length, kv_length = grid["batch_size"], grid["q_length"], grid["kv_length"]
    q_offset, kv_offset, device = grid["q_offset"], grid["kv_offset"], grid["device"]
    probe = {n: x for n, x in grid.items() if n != "local_size"}
    probe["attention_mask"] = None
    candidates = {"causal": True, "bidirectional": True}
    rows = max(1, _CHECK_ELEMENTS // max(1, batch_size * kv_length))
    kv = torch.arange(kv_length, device=device)[None, :] + kv_offset
    for r0 in range(0, q_length, rows):
        r1 = min(q_length, r0 + rows)
        got = masking.sdpa_mask(**dict(probe, q_length=r1 - r0, q_offset=q_offset + r0))
        q = torch.arange(r0, r1, device=device)[:, None] + q_offset
        expected = {"causal": kv <= q, "bidirectional": torch.ones_like(kv <= q)}
        if local_size is not None:
            expected["causal"] = expected["causal"] & (kv > q - local_size)
            expected["bidirectional"] = (q - kv).abs() <= local_size
        for kind in list(candidates):
            if not torch.equal(got, expected[kind].expand_as(got)):
                del candidates[kind]
        if not candidates:
            return None
    return next(iter(candidates)) if q_length > 0 else "causal"


# --- The attention function ------------------------------------------------------------------


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs: Any,
) -> Tuple[torch.Tensor, None]:
    """flashdl's attention with transformers' attention-function signature.

    transformers calls it for every attention layer of a model whose implementation is the name
    :func:`register` returned; causal and bidirectional layers, GQA, sliding windows, softcap,
    dropout, padding (unpadded into the varlen path) and packed sequences are handled, anything else
    raises ``NotImplementedError`` naming it.

    Parameters
    ----------
    module : torch.nn.Module
        The attention layer (its ``is_causal`` attribute is read).
    query : torch.Tensor (batch, heads, seq_q, dim)
    key, value : torch.Tensor (batch, heads_kv, seq_k, dim)
    attention_mask : torch.Tensor, optional
        None, a 2-D padding mask (batch, n) of the first ``n <= seq_k`` keys (the queries are the
        last ``seq_q`` of them when causal), or a 4-D mask that is exactly causal or bidirectional
        sequences (as :func:`attention_mask_interface` returns it).
    dropout : float, default 0.0
    scaling : float, optional
        The softmax scale (None: ``1 / sqrt(dim)``).
    sliding_window : int, optional
    softcap : float, optional
    is_causal : bool, optional
        Overrides ``module.is_causal``.
    **kwargs
        Other keyword arguments transformers passes: ``s_aux`` (gpt-oss's attention sinks, one
        logit per query head, differentiable) runs in flashdl; additive position biases and paged
        caches raise ``NotImplementedError``.

    Returns
    -------
    out : torch.Tensor (batch, seq_q, heads, dim_v)
    weights : None
        No attention weights (``output_attentions=True`` warns).

    Raises
    ------
    NotImplementedError
        A mask or feature flashdl cannot compute exactly.
    ValueError
        A mask of the wrong shape.

    Examples
    --------
    >>> import torch, flashdl.transformers
    >>> layer = torch.nn.Module()
    >>> layer.is_causal = True
    >>> q, kv = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)      # GQA: 4 heads, 2 kv heads
    >>> out, weights = flashdl.transformers.attention_forward(layer, q, kv, kv, None)
    >>> out.shape, weights
    (torch.Size([1, 6, 4, 8]), None)
    """
    for name, what in _REFUSED.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"flashdl attention does not support {what}")
    if kwargs.get("output_attentions", False):
        warnings.warn(
            "flashdl attention does not return attention weights "
            "(output_attentions=True): they are None",
            stacklevel=2,
        )
    for arg, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(
                f"{arg}: expected a rank-4 tensor (batch, heads, seqlen, headdim), "
                f"got {getattr(x, 'shape', type(x).__name__)}"
            )
    causal = (
        bool(getattr(module, "is_causal", True))
        if is_causal is None
        else _checks.flag("is_causal", is_causal)
    )
    seq_q, seq_k = query.shape[2], key.shape[2]
    head_dim, v_head_dim = query.shape[-1], value.shape[-1]
    deterministic = kwargs.get("deterministic")
    if deterministic is None:
        deterministic = os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"
    opts = dict(
        causal=causal,
        softmax_scale=_scalar("scaling", scaling),
        window_size=_window_size(sliding_window, causal, seq_k),
        dropout_p=dropout,
        softcap=_scalar("softcap", softcap) or 0.0,
        deterministic=_checks.flag("deterministic", deterministic),
        sinks=_sinks(kwargs.get("s_aux")),
    )

    # flashdl's layout (batch, seqlen, heads, dim): transposed views, not copies.
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if v_head_dim < head_dim:
        v = torch.nn.functional.pad(v, (0, head_dim - v_head_dim))
    elif v_head_dim > head_dim:
        raise NotImplementedError(
            f"flashdl attention: value head dim {v_head_dim} > query head dim {head_dim}"
        )

    if attention_mask is None:
        varlen = {
            x: kwargs.get(x)
            for x in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
        }
        if all(x is not None for x in varlen.values()):
            out = _packed(q, k, v, varlen, opts)
        else:
            out = _fdl.attention(q, k, v, **opts)
    elif not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() not in (2, 4):
        shape = getattr(attention_mask, "shape", None)
        raise NotImplementedError(
            "flashdl attention: attention_mask must be None, a 2-D padding mask or a 4-D mask "
            f"tensor, got {type(attention_mask).__name__}"
            + (f" of shape {tuple(shape)}" if shape is not None else "")
        )
    elif attention_mask.dim() == 2:
        out = _run_varlen(
            q,
            k,
            v,
            _from_padding(attention_mask, causal, opts["window_size"], q.shape[0], seq_q, seq_k),
            opts,
        )
    else:
        try:
            plan = _from_4d(attention_mask, causal, opts["window_size"], q.shape[0], seq_q, seq_k)
        except _NotSequences:
            out = _masked(q, k, v, attention_mask, opts)
        else:
            out = _run_varlen(q, k, v, plan, opts)
    return out[..., :v_head_dim], None


class _NotSequences(NotImplementedError):
    """A 4-D mask that is not a set of varlen sequences: it runs as flashdl's mask or bias."""


def _masked(q, k, v, attention_mask, opts):
    """A 4-D mask that the varlen path cannot express (per-head masks, additive float biases,
    bidirectional blocks, masks with a KV cache), as "sdpa" takes it: the mask alone says which
    keys each query sees (is_causal and the window are already in it), a bool mask as flashdl's
    mask, a float one as flashdl's bias (its gradient flows when it requires grad)."""
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    m = attention_mask
    if m.shape[-2:] != (sq, sk) or m.shape[0] not in (1, b):
        raise ValueError(
            f"attention_mask: expected a 4-D mask ({b} or 1, heads or 1, {sq}, "
            f"{sk}), got shape {tuple(m.shape)}"
        )
    run = dict(opts, causal=False, window_size=(-1, -1))
    if m.dtype == torch.bool:
        return _fdl.attention(q, k, v, mask=m, **run)
    if not m.is_floating_point():
        raise NotImplementedError(f"flashdl attention: a 4-D attention_mask of dtype {m.dtype}")
    return _fdl.attention(q, k, v, bias=m, **run)


def _scalar(name, x):
    """scaling or softcap as a float (None stays None); a tensor that requires grad is refused,
    as it would get no gradient."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor) and x.requires_grad:
        raise NotImplementedError(
            f"{name}: a learnable {name} (a tensor that requires grad) is "
            "not supported by flashdl attention: it would get no gradient"
        )
    value = (
        float(x)
        if isinstance(x, torch.Tensor) and x.numel() == 1
        else _checks.real(name, x, "None or a float")
    )
    return _checks.finite(name, value, "None or a finite float")


def _sinks(s_aux):
    """gpt-oss's attention sinks (s_aux: one logit per query head, a parameter of the model's
    dtype) as flashdl's float32 sinks; the conversion is differentiable, so the parameter gets
    its gradient."""
    if s_aux is None:
        return None
    if not isinstance(s_aux, torch.Tensor) or not s_aux.is_floating_point():
        raise TypeError(
            "s_aux: expected None or a float tensor of shape (num_attention_heads,), "
            f"got {getattr(s_aux, 'dtype', type(s_aux).__name__)}"
        )
    return s_aux.to(torch.float32)


def _window_size(sliding_window, causal, seq_k):
    """transformers' sliding_window=w (key j visible to query i iff i - w < j <= i, the masks of
    "eager" and "sdpa") as flashdl's window_size (w - 1, 0)."""
    if sliding_window is None:
        return (-1, -1)
    if (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, numbers.Integral)
        or sliding_window < 1
    ):
        raise ValueError(f"sliding_window: expected None or an int >= 1, got {sliding_window!r}")
    w = operator.index(sliding_window)
    if causal:
        return (w - 1, 0)
    if seq_k > w:
        # "eager"/"sdpa" keep |i - j| <= w here, transformers' flash integration |i - j| < w.
        raise NotImplementedError(
            "flashdl attention: a sliding window with bidirectional (is_causal=False) attention"
        )
    return (-1, -1)


class _Varlen:
    """Where the tokens of a varlen call come from: flat indices into (batch * seq_q) and
    (batch * seq_k), the cumulative lengths (int32, CPU) and the longest sequences."""

    def __init__(self, idx_q, idx_k, cu_q, cu_k):
        self.idx_q, self.idx_k, self.cu_q, self.cu_k = idx_q, idx_k, cu_q, cu_k
        self.max_q = int((cu_q[1:] - cu_q[:-1]).max()) if len(cu_q) > 1 else 0
        self.max_k = int((cu_k[1:] - cu_k[:-1]).max()) if len(cu_k) > 1 else 0


def _cumulative(lengths):
    return torch.nn.functional.pad(torch.cumsum(lengths.to("cpu", torch.int64), 0), (1, 0)).to(
        torch.int32
    )


def _from_padding(mask, causal, window, batch, seq_q, seq_k):
    """A 2-D padding mask (batch, n) as varlen sequences: the valid keys among the first n, and
    the valid queries (causal: the last seq_q of the n slots; bidirectional: all of them)."""
    if mask.shape[0] != batch:
        raise ValueError(
            f"attention_mask: expected {batch} rows (the batch), got shape {tuple(mask.shape)}"
        )
    n = mask.shape[1]
    if not (seq_q <= n <= seq_k if causal else n <= seq_k):
        raise ValueError(
            f"attention_mask: a 2-D mask of {n} keys does not fit seq_q={seq_q}, "
            f"seq_k={seq_k}" + (" (causal: seq_q <= n <= seq_k)" if causal else "")
        )
    valid_k = mask.to(torch.bool)
    if causal:
        valid_q = valid_k[:, n - seq_q :]
        if 0 <= window[0] < n - 1:
            # After unpadding, the window counts tokens: padding between two tokens would be
            # counted by "eager" but not by flashdl.
            pos = torch.arange(n, device=mask.device)
            count = valid_k.sum(1)
            first = torch.where(valid_k, pos, n).amin(1)
            last = torch.where(valid_k, pos, -1).amax(1)
            if bool(((count > 0) & (last - first + 1 != count)).any()):
                raise NotImplementedError(
                    "flashdl attention: a sliding window with padding between tokens (a 2-D "
                    "attention_mask with zeros inside a sequence)"
                )
    else:
        valid_q = torch.ones(batch, seq_q, dtype=torch.bool, device=mask.device)
    keep = valid_q.any(1)  # a row with no query is left out altogether
    valid_q, valid_k = valid_q & keep[:, None], valid_k & keep[:, None]
    if n < seq_k:
        valid_k = torch.nn.functional.pad(valid_k, (0, seq_k - n), value=False)
    return _Varlen(
        valid_q.flatten().nonzero().flatten(),
        valid_k.flatten().nonzero().flatten(),
        _cumulative(valid_q.sum(1)[keep]),
        _cumulative(valid_k.sum(1)[keep]),
    )


# The decompositions of the last few 4-D masks: every layer of a forward gets the same one (or
# one per layer type).
_DECOMPOSED: list = []


def _from_4d(mask, causal, window, batch, seq_q, seq_k):
    """A 4-D mask as varlen sequences, when it is exactly one: each token that attends to itself
    is live; live tokens split into runs (a run ends where a token does not see the live token
    before it); the mask must then equal causal (or bidirectional) attention with this layer's
    window within each run, in the run's own positions, and nothing across runs. A token that
    does not attend to itself must be padding: no query may attend to it, and its own output row
    is zeros."""
    try:
        key = (weakref.ref(mask), mask._version, causal, window, batch, seq_q, seq_k)
    except RuntimeError:  # inference tensors have no version counter: no caching
        key = None
    if key is not None:
        for cached, result in _DECOMPOSED:
            if cached[0]() is mask and cached[1:] == key[1:]:
                return result
    if seq_q != seq_k:
        raise _NotSequences(
            "flashdl attention: a 4-D attention_mask with a KV cache "
            f"(seq_q {seq_q} != seq_k {seq_k})"
        )
    if mask.shape[0] not in (1, batch) or tuple(mask.shape[2:]) != (seq_q, seq_k):
        raise ValueError(
            f"attention_mask: expected a 4-D mask ({batch} or 1, heads or 1, "
            f"{seq_q}, {seq_k}), got shape {tuple(mask.shape)}"
        )
    if mask.dtype == torch.bool:
        visible = mask
    elif mask.is_floating_point():
        visible = mask == 0
        hidden = (mask == float("-inf")) | (mask <= torch.finfo(mask.dtype).min)
        if not bool((visible | hidden).all()):
            raise _NotSequences(
                "flashdl attention: a float attention_mask with values "
                "other than 0 and -inf (an additive bias)"
            )
    else:
        raise _NotSequences(f"flashdl attention: a 4-D attention_mask of dtype {mask.dtype}")
    visible = visible.to("cpu")
    if visible.shape[1] > 1 and not bool((visible == visible[:, :1]).all()):
        raise _NotSequences("flashdl attention: a 4-D attention_mask that differs between heads")
    m = visible[:, 0].expand(batch, seq_q, seq_k)
    n = seq_q
    pos = torch.arange(n)
    live = m.diagonal(dim1=1, dim2=2)
    if bool((m.any(1) & ~live).any()):
        raise _NotSequences(
            "flashdl attention: a 4-D attention_mask in which a query attends to a key that "
            "does not attend to itself"
        )
    # The live token before each token, -1 if none.
    before = torch.where(live, pos, -1).cummax(1).values
    before = torch.nn.functional.pad(before[:, :-1], (1, 0), value=-1)
    sees_before = m.gather(2, before.clamp(min=0)[:, :, None])[:, :, 0] & (before >= 0)
    start = live & ~sees_before
    run = start.cumsum(1)  # run number of each token within its row (padding: that of before)
    count = live.cumsum(1)
    run_start = torch.where(start, count, 0).cummax(1).values
    rank = count - run_start  # position of a live token within its run
    left, right = window
    if causal:
        right = 0
    d = rank[:, :, None] - rank[:, None, :]
    expected = live[:, :, None] & live[:, None, :] & (run[:, :, None] == run[:, None, :])
    if left >= 0:
        expected &= d <= left
    if right >= 0:
        expected &= -d <= right
    if not torch.equal(m[live], expected[live]):
        raise _NotSequences(
            "flashdl attention: a 4-D attention_mask that is not a set of "
            f"{'causal' if causal else 'bidirectional'} sequences (packed sequences, chunks, "
            f"padding) with this layer's window (flashdl window_size {window}): e.g. "
            "bidirectional blocks, or another window than the sliding_window argument"
        )
    # Runs are numbered 1, 2, ... in each row; their lengths, row after row.
    per_row = [torch.bincount(run[b][live[b]] - 1) for b in range(batch) if bool(live[b].any())]
    lengths = torch.cat(per_row) if per_row else torch.zeros(0, dtype=torch.int64)
    idx = live.flatten().nonzero().flatten().to(mask.device)
    cu = _cumulative(lengths)
    result = _Varlen(idx, idx, cu, cu)
    if key is not None:
        _DECOMPOSED[:] = [(key, result)] + _DECOMPOSED[:3]
    return result


def _packed(q, k, v, varlen, opts):
    """transformers' padding-free kwargs (cu_seq_lens_q/k, max_length_q/k): the batch's tokens
    are one flat sequence of sequences, as in its flash integration."""
    b, sq, h, d = q.shape
    out = _fdl.attention_varlen(
        q.reshape(-1, h, d),
        k.reshape(-1, *k.shape[2:]),
        v.reshape(-1, *v.shape[2:]),
        cu_seqlens_q=_cpu_int32(varlen["cu_seq_lens_q"]),
        cu_seqlens_k=_cpu_int32(varlen["cu_seq_lens_k"]),
        max_seqlen_q=int(varlen["max_length_q"]),
        max_seqlen_k=int(varlen["max_length_k"]),
        **opts,
    )
    return out.view(b, sq, h, d)


def _cpu_int32(cu):
    return torch.as_tensor(cu).to("cpu", torch.int32)


def _run_varlen(q, k, v, plan, opts):
    b, sq, h, d = q.shape
    flat_q = q.reshape(b * sq, h, d)
    out = flat_q.new_zeros(b * sq, h, d)
    if plan.idx_q.numel() == 0:
        return out.view(b, sq, h, d)
    flat_k, flat_v = (x.reshape(-1, *x.shape[2:]) for x in (k, v))
    got = _fdl.attention_varlen(
        flat_q.index_select(0, plan.idx_q),
        flat_k.index_select(0, plan.idx_k),
        flat_v.index_select(0, plan.idx_k),
        cu_seqlens_q=plan.cu_q,
        cu_seqlens_k=plan.cu_k,
        max_seqlen_q=plan.max_q,
        max_seqlen_k=plan.max_k,
        **opts,
    )
    return out.index_copy(0, plan.idx_q, got).view(b, sq, h, d)
