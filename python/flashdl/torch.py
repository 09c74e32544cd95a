"""PyTorch autograd for flashdl: flashdl.torch.attention(q, k, v) with loss.backward() support.

attention and attention_varlen are torch.library custom ops (flashdl::attention_forward,
flashdl::attention_backward, flashdl::attention_varlen_forward, flashdl::attention_varlen_backward)
with fake (meta) implementations and a registered autograd formula, so torch.compile (also with
fullgraph=True) and torch.export see one op each instead of breaking the graph at an opaque
Python call. The forward saves q, k, v, out and lse (and, with dropout, the seed tensor and the
offset, not the mask); the backward recomputes the attention matrix and the dropout mask block
by block (flashdl.attention_backward), as FlashAttention does, instead of storing them.

In eager mode (nothing compiling, exporting, tracing or intercepting ops) attention skips the ops:
a plain autograd.Function calls the extension directly, with the same results bit for bit.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from . import _torch_sdpa
from ._args import ArrayLike
from ._kvcache import attention_with_kvcache as _attention_with_kvcache
from ._torch_attention import attention, attention_varlen
from ._torch_context_parallel import (
    context_parallel_attention,
    context_parallel_groups,
    context_parallel_shard,
    context_parallel_unshard,
)
from ._torch_ring import ring_attention
from ._torch_ring import shard as ring_shard
from ._torch_ring import unshard as ring_unshard
from ._torch_ulysses import ulysses_attention

__all__ = [
    "attention",
    "attention_varlen",
    "attention_with_kvcache",
    "context_parallel_attention",
    "context_parallel_groups",
    "context_parallel_shard",
    "context_parallel_unshard",
    "ring_attention",
    "ring_shard",
    "ring_unshard",
    "scaled_dot_product_attention",
    "ulysses_attention",
]
# Defined in _torch_attention; this module is their public home (help(), pickling by name).
attention.__module__ = attention_varlen.__module__ = __name__


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` computed by flashdl, autograd included.

    PyTorch's signature, layout and semantics, over :func:`attention` with transposed views (no
    copies; a strided last dimension is copied, as flashdl needs stride 1 there), so it is a custom
    op for ``torch.compile`` and ``torch.export``. Errors name PyTorch's arguments.

    Parameters
    ----------
    query : torch.Tensor (batch, heads, seq_q, dim)
        Or rank 3, (batch, seq_q, dim).
    key, value : torch.Tensor (batch, heads_kv, seq_k, dim)
        Or rank 3. value's head dim must equal query's.
    attn_mask : torch.Tensor, optional
        Broadcastable to (batch, heads, seq_q, seq_k): a bool mask (True: the key takes part;
        flashdl's ``mask``, tiles it hides entirely are skipped) or a float mask added to the
        scores (flashdl's ``bias``, read in place, with its gradient when it requires grad). A
        query row that the mask leaves no key gets output 0 (not NaN).
    dropout_p : float, default 0.0
        flashdl's Philox dropout with a seed drawn from the generator of query's device
        (``torch.manual_seed`` repeats it): the same distribution as torch's dropout, not the same
        mask as torch's RNG stream would give.
    is_causal : bool, default False
        PyTorch's TOP-LEFT alignment: key ``j`` visible to query ``i`` iff ``j <= i`` (unlike
        :func:`attention`'s bottom-right ``causal``; the two agree when ``seq_q == seq_k``).
    scale : float, optional
        None is ``1 / sqrt(dim)``.
    enable_gqa : bool, default False
        True allows ``heads_kv`` dividing ``heads`` (query head ``h`` reads kv head
        ``h // (heads // heads_kv)``); with False the heads must be equal, or ``heads_kv`` 1 (torch
        broadcasts it).

    Returns
    -------
    torch.Tensor (batch, heads, seq_q, dim)
        A view of flashdl's (batch, seq_q, heads, dim) output (rank 3 for rank-3 inputs).

    Raises
    ------
    ValueError
        Shapes that do not fit (e.g. different head counts without ``enable_gqa``).
    TypeError
        An argument of the wrong type (e.g. ``is_causal`` not a bool).

    Examples
    --------
    >>> import torch, torch.nn.functional as F, flashdl.torch
    >>> q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    >>> out = flashdl.torch.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5)
    True
    """
    _torch_sdpa.check_layout(query, key, value, enable_gqa)
    rank3 = query.dim() == 3
    seq = 1 if rank3 else 2  # the seq axis in PyTorch's layout
    sq, sk = query.shape[seq], key.shape[seq]
    shape = (query.shape[0], sq, sk) if rank3 else (query.shape[0], query.shape[1], sq, sk)
    _torch_sdpa.check_mask(attn_mask, shape, query.dtype)
    keep, causal, window = _torch_sdpa.causal_args(is_causal, sq, sk)
    bias, mask = _torch_sdpa.mask_args(attn_mask, rank3, sk, keep)

    def flashdl_layout(x: torch.Tensor, n: int) -> torch.Tensor:
        x = x.narrow(seq, 0, n)  # a view; only top-left causal with sq < sk drops keys
        x = x.unsqueeze(2) if rank3 else x.transpose(1, 2)
        return x.contiguous() if x.shape[-1] > 1 and x.stride(-1) != 1 else x

    try:
        out = attention(
            flashdl_layout(query, sq),
            flashdl_layout(key, keep),
            flashdl_layout(value, keep),
            causal=causal,
            softmax_scale=scale,
            window_size=window,
            dropout_p=dropout_p,
            bias=bias,
            mask=mask,
        )
    except (ValueError, TypeError) as err:
        raise _torch_sdpa.renamed(err) from None
    return out.squeeze(2) if rank3 else out.transpose(1, 2)


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cache_seqlens: ArrayLike,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    block_table: Optional[ArrayLike] = None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: Tuple[int, int] = (-1, -1),
    num_splits: int = 0,
    return_lse: bool = False,
    alibi_slopes: Optional[ArrayLike] = None,
    softcap: float = 0.0,
    layout: str = "bshd",
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    rotary_interleaved: bool = False,
    cache_batch_idx: Optional[ArrayLike] = None,
    cache_leftpad: Optional[ArrayLike] = None,
    sinks: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`flashdl.attention_with_kvcache` for torch tensors (decoding; no autograd).

    Runs under ``torch.no_grad()`` and appends ``k``, ``v`` into ``k_cache``, ``v_cache`` in place
    when given.

    Parameters
    ----------
    q : torch.Tensor (batch, seqlen_q, nheads, headdim)
    k_cache, v_cache : torch.Tensor
        (batch, seqlen_cache, nheads_kv, headdim), or paged (num_pages, page_size, nheads_kv,
        headdim) with ``block_table``.
    cache_seqlens : int32 tensor (batch,)
        A CPU tensor (or NumPy array), also for CUDA q (copied to the device on the current
        stream).
    k, v, block_table, causal, softmax_scale, window_size, num_splits, return_lse, alibi_slopes, softcap : optional
        As in :func:`flashdl.attention_with_kvcache` (``block_table`` a CPU int32 tensor or NumPy
        array).
    layout : {"bshd", "bhsd"}, default "bshd"
        ``"bhsd"``: q, k, v and out (batch, nheads, seqlen, headdim), the caches (batch, nheads_kv,
        seqlen_cache, headdim) as Hugging Face keeps them, read and written through transposed views.
    rotary_cos, rotary_sin, rotary_interleaved, cache_batch_idx, cache_leftpad : optional
        As in :func:`flashdl.attention_with_kvcache` (CPU tensors only yet).
    sinks : torch.Tensor, float32 (nheads,), optional
        Attention sinks (gpt-oss's ``s_aux``), as in :func:`flashdl.attention_with_kvcache` (no
        gradient here).
    bias, mask : torch.Tensor, optional
        An additive bias and a boolean mask (True = keep) broadcastable to (batch, nheads,
        seqlen_q, seqlen_cache), as in :func:`flashdl.attention_with_kvcache` (no gradient).

    Returns
    -------
    out : torch.Tensor (batch, seqlen_q, nheads, headdim)
    lse : torch.Tensor, float32 (batch, nheads, seqlen_q)
        With ``return_lse=True``.

    Raises
    ------
    ValueError
        As :func:`flashdl.attention_with_kvcache`.
    TypeError
        An argument of the wrong type.

    Examples
    --------
    >>> import torch, flashdl.torch
    >>> k_cache, v_cache = torch.zeros(1, 8, 2, 16), torch.zeros(1, 8, 2, 16)
    >>> lens = torch.tensor([2], dtype=torch.int32)
    >>> q, k, v = torch.randn(1, 1, 4, 16), torch.randn(1, 1, 2, 16), torch.randn(1, 1, 2, 16)
    >>> out = flashdl.torch.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, k=k, v=v)
    >>> out.shape, torch.equal(k_cache[0, 2], k[0, 0])
    (torch.Size([1, 1, 4, 16]), True)
    """
    with torch.no_grad():
        return _attention_with_kvcache(
            q,
            k_cache,
            v_cache,
            cache_seqlens=cache_seqlens,
            k=k,
            v=v,
            block_table=block_table,
            causal=causal,
            softmax_scale=softmax_scale,
            window_size=window_size,
            num_splits=num_splits,
            return_lse=return_lse,
            alibi_slopes=alibi_slopes,
            softcap=softcap,
            layout=layout,
            rotary_cos=rotary_cos,
            rotary_sin=rotary_sin,
            rotary_interleaved=rotary_interleaved,
            cache_batch_idx=cache_batch_idx,
            cache_leftpad=cache_leftpad,
            sinks=sinks,
            bias=bias,
            mask=mask,
        )
