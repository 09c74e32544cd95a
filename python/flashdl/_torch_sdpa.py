"""Argument mapping for flashdl.torch.scaled_dot_product_attention (PyTorch's SDPA drop-in).

Only what PyTorch's semantics define and flashdl's core cannot know is decided here: the
(batch, heads, seq, dim) layout, top-left causal alignment, enable_gqa, attn_mask. Shapes,
dtypes, devices and the remaining options are validated by the core, whose messages name q, k, v
and softmax_scale; _renamed maps those names back to PyTorch's.
"""

from __future__ import annotations

import torch

from . import _checks

# flashdl's argument name -> PyTorch's, for the leading "name:" of a core error.
_TORCH_NAMES = {"q": "query", "k": "key", "v": "value", "softmax_scale": "scale"}


def check_layout(query, key, value, enable_gqa):
    """Rank 3 (batch, seq, dim) or 4 (batch, heads, seq, dim) tensors, heads as torch allows."""
    enable_gqa = _checks.flag("enable_gqa", enable_gqa)  # torch: "must be bool"
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() not in (3, 4) or x.dim() != query.dim():
            raise ValueError(
                f"{name}: expected rank 4 (batch, heads, seq, dim) or rank 3 "
                f"(batch, seq, dim), the rank of query, got shape {tuple(x.shape)}"
            )
    if value.shape[-1] != query.shape[-1]:
        raise NotImplementedError(
            f"value: flashdl needs the head dim of value equal to that of query and key "
            f"({query.shape[-1]}), got {value.shape[-1]}"
        )
    hq, hk = query.shape[-3], key.shape[-3]
    if query.dim() == 3 or hq == hk:
        return
    if hq < hk or hq % hk != 0:
        raise ValueError(f"key: {hk} heads do not divide the {hq} heads of query")
    # torch broadcasts a single kv head even without enable_gqa; more need enable_gqa=True.
    if hk != 1 and not enable_gqa:
        raise ValueError(
            f"key: {hk} heads for {hq} query heads needs enable_gqa=True "
            f"(grouped-query attention), or as many heads as query"
        )


def check_mask(attn_mask, shape, query_dtype):
    """None, a bool mask (True = take part in attention) or a float mask (added to the scores),
    broadcastable to the scores' shape: flashdl's mask or bias. As torch: a float mask is float32
    or the dtype of query."""
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(
            f"attn_mask: expected None or a torch.Tensor, got {type(attn_mask).__name__}"
        )
    try:
        # The mask may broadcast to the scores' shape but not enlarge it.
        fits = torch.broadcast_shapes(attn_mask.shape, shape) == torch.Size(shape)
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"attn_mask: shape {tuple(attn_mask.shape)} does not broadcast to "
            f"the scores' shape {tuple(shape)}"
        )
    if attn_mask.dtype not in (torch.bool, torch.float32, query_dtype):
        raise TypeError(
            f"attn_mask: expected dtype torch.bool, torch.float32 or that of query "
            f"({query_dtype}), as torch's scaled_dot_product_attention, got "
            f"{attn_mask.dtype}"
        )


def mask_args(attn_mask, rank3, seqlen_k, keep):
    """flashdl's (bias, mask) for attn_mask: rank 4 (batch, heads, seq_q, keys) views, the keys
    cut to the `keep` that causal_args attends to, a key axis of size 1 expanded (stride 0)."""
    if attn_mask is None:
        return None, None
    m = attn_mask
    if rank3:
        m = m[(None,) * (3 - m.dim())].unsqueeze(1)  # (batch, 1, seq_q, keys)
    if m.shape[-1] == seqlen_k and keep < seqlen_k:
        m = m.narrow(-1, 0, keep)
    elif m.shape[-1] != keep:
        m = m.expand(*m.shape[:-1], keep)
    return (None, m) if m.dtype == torch.bool else (m, None)


def causal_args(is_causal, seqlen_q, seqlen_k):
    """(keys to keep, flashdl causal, window_size) for PyTorch's TOP-LEFT causal mask.

    torch: key j is visible to query i iff j <= i. flashdl's window (left=-1, right) keeps
    j <= i + (seqlen_k - seqlen_q) + right, so right = seqlen_q - seqlen_k when that is >= 0.
    When seqlen_q < seqlen_k no query sees a key j >= seqlen_q: attending to the first seqlen_q
    keys (a view) with flashdl's bottom-right causal, which is then top-left, is exact, and
    autograd gives the dropped keys zero gradient.
    """
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal: expected a bool, got {type(is_causal).__name__}")
    if not is_causal:
        return seqlen_k, False, (-1, -1)
    if seqlen_q <= seqlen_k:
        return seqlen_q, True, (-1, -1)
    return seqlen_k, False, (-1, seqlen_q - seqlen_k)


def renamed(err):
    """A core error (ValueError/TypeError) with its leading flashdl name replaced by torch's."""
    msg = str(err)
    name, sep, rest = msg.partition(":")
    if sep and name in _TORCH_NAMES:
        msg = f"{_TORCH_NAMES[name]}:{rest}"
    return type(err)(msg)
