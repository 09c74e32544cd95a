"""A flash-attn 2.x drop-in: `import flashdl.flash_attn as flash_attn`.

flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func, flash_attn_varlen_func,
flash_attn_varlen_qkvpacked_func and flash_attn_varlen_kvpacked_func with flash-attn 2.x's
signatures, defaults and return values, over flashdl.torch (autograd) on CPU or CUDA tensors.
Same layouts as flash-attn: q (batch, seqlen, nheads, headdim), qkv (batch, seqlen, 3, nheads,
headdim), kv (batch, seqlen, 2, nheads_k, headdim); varlen (total, nheads, headdim) with int32
cu_seqlens; unpad_input and pad_input are flash_attn.bert_padding's, to go between padded batches
and that layout. flash-attn's own test module runs against this one: tools/flash_attn_upstream.py,
docs/migrating/flash_attn_tests.md. Differences from flash-attn (also in
docs/migrating/index.md, "From flash-attn"):

- block_table (paged KV) and seqused_k in flash_attn_varlen_func: forward only (as
  flash-attn). On a GPU, block_table, seqused_k and both cu_seqlens are copied to the host first
  (flashdl checks the tables there: a synchronisation); the pages are then gathered on the device
  (tests pass on an H100).
  flash_attn_with_kvcache is flashdl.attention_with_kvcache: block_table (any page size),
  cache_seqlens (an int, a CPU int32 tensor or None), k/v appended in place, num_splits,
  softcap, alibi_slopes, rotary_cos/rotary_sin, cache_batch_idx and cache_leftpad; without
  cache_batch_idx, sequence b uses cache row b (a cache may have more rows, as in flash-attn);
  rotary tables without new k, v are refused, as in flash-attn.
  cache_seqlens, block_table, cache_batch_idx and cache_leftpad on a GPU are copied to the host first
  (flashdl reads them there: one synchronisation); the CUDA path passes its tests on an H100.
- softmax_lse of a query that sees no key is -inf (flashdl's contract; flash-attn gives +inf).
- With alibi_slopes and causal=True, softmax_lse is the lse of the biased scores as written
  (-slope * |i + seqlen_k - seqlen_q - j|); flash-attn's causal kernel adds slope * j instead, the
  same softmax shifted per row, so its lse is larger by slope * (i + seqlen_k - seqlen_q). out and
  the gradients are the same.
- torch.compile and torch.export see flashdl.torch's custom ops (no graph break, dropout
  included), except return_attn_probs=True with dropout: the seed is then read back as an int
  (.item()) to rebuild the mask, a graph break (and a synchronisation on CUDA).
- Invalid arguments raise flashdl's messages naming the argument: TypeError for a wrong type
  (a NumPy or JAX array included: these functions take torch tensors), and for a wrong value
  ArgumentError, which is both a ValueError (flashdl's class) and a RuntimeError (what
  flash-attn's C++ checks raise), so handlers written for either catch it. What flashdl accepts
  beyond flash-attn (CPU, float32, any page size, ...) and refuses that flash-attn accepts
  (non-finite scales, softcaps and slopes) is listed in docs/migrating/index.md.

S_dmask (return_attn_probs=True with dropout; an empty tensor without, as flash-attn) is in
the scaling of flash-attn's kernel (see _torch_flash_attn.attn_probs): (batch, nheads, seqlen_q, seqlen_k)
in q's dtype (varlen: sequence b in the top-left of plane b, zeros elsewhere); for key j in key
block J (width _get_block_size_n(...), flash-attn's sm80 table), exp(s_ij - m_iJ), m_iJ the
largest visible score of row i in blocks J..last (the kernel's running maximum: it walks the
blocks from the last one), 0 where key j is invisible, negated where dropout dropped it. The
probabilities are block J times exp(m_iJ - lse_i), which is what flash-attn's tests'
normalize_flash_attn_S computes. Unlike flash-attn's, the sequence lengths are not rounded up to
128 (its tests crop them anyway).

This module only adapts arguments: validation and every kernel are flashdl's.
"""

from __future__ import annotations

import numbers
from typing import Any, Dict, Literal, Optional, Tuple, Union, overload

import numpy as np
import torch

from . import _checks
from . import torch as _fdl
from ._torch_flash_attn import ArgumentError
from ._torch_flash_attn import OutOrProbs as _OutOrProbs
from ._torch_flash_attn import WithProbs as _WithProbs
from ._torch_flash_attn import check_packed as _packed
from ._torch_flash_attn import check_tensors as _tensors
from ._torch_flash_attn import dense as _dense
from ._torch_flash_attn import flash_attn_errors as _flash_attn_errors
from ._torch_flash_attn import get_block_size_n as _get_block_size_n  # noqa: F401 (flash-attn's name, for its tests)
from ._torch_flash_attn import maybe_contiguous as _maybe_contiguous
from ._torch_flash_attn import score_mods as _score_mods
from ._torch_flash_attn import window_pair as _window
from ._torch_flash_attn_varlen import (
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)

__all__ = [
    "ArgumentError",
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
    "unpad_input",
    "pad_input",
]
# Defined in _torch_flash_attn_varlen; this module is their public home (help(), pickling by
# name).
for _f in (
    flash_attn_varlen_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
):
    _f.__module__ = __name__
del _f


# Typing overloads, kept compact (a signature to a few lines, not a line per parameter).
# fmt: off
@overload
def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = ...,
                    softmax_scale: Optional[float] = ..., causal: bool = ...,
                    window_size: Tuple[int, int] = ..., softcap: float = ...,
                    alibi_slopes: Optional[torch.Tensor] = ..., deterministic: bool = ...,
                    return_attn_probs: Literal[False] = ...) -> torch.Tensor: ...
@overload
def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = ...,
                    softmax_scale: Optional[float] = ..., causal: bool = ...,
                    window_size: Tuple[int, int] = ..., softcap: float = ...,
                    alibi_slopes: Optional[torch.Tensor] = ..., deterministic: bool = ..., *,
                    return_attn_probs: Literal[True]
                    ) -> _WithProbs: ...
@overload
def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = ...,
                    softmax_scale: Optional[float] = ..., causal: bool = ...,
                    window_size: Tuple[int, int] = ..., softcap: float = ...,
                    alibi_slopes: Optional[torch.Tensor] = ..., deterministic: bool = ...,
                    return_attn_probs: bool = ...
                    ) -> _OutOrProbs: ...
# fmt: on


@_flash_attn_errors
def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> _OutOrProbs:
    """flash-attn's ``flash_attn_func``, over :func:`flashdl.torch.attention` (autograd into q, k, v).

    Same argument names, defaults, layouts and return values as flash-attn 2.x; CPU and CUDA
    tensors. Causal and windows are bottom-right aligned.

    Parameters
    ----------
    q : torch.Tensor (batch, seqlen_q, nheads, headdim)
    k, v : torch.Tensor (batch, seqlen_k, nheads_k, headdim)
        ``nheads`` a multiple of ``nheads_k`` (MQA / GQA).
    dropout_p : float, default 0.0
        The seed is drawn from the generator of q's device (``torch.manual_seed`` repeats it; the
        mask is flashdl's, not flash-attn's).
    softmax_scale : float, optional
        None is ``1 / sqrt(headdim)``.
    causal : bool, default False
    window_size : (int, int), default (-1, -1)
        Any negative side is unbounded, as in flash-attn's kernel.
    softcap : float, default 0.0
    alibi_slopes : float32 tensor (nheads,) or (batch, nheads), optional
    deterministic : bool, default False
        Bitwise reproducible dq in the backward on CUDA.
    return_attn_probs : bool, default False
        Also return ``softmax_lse`` and ``S_dmask`` (testing only; see :doc:`/migrating/index`).

    Returns
    -------
    out : torch.Tensor (batch, seqlen_q, nheads, headdim)
    softmax_lse : torch.Tensor, float32 (batch, nheads, seqlen_q)
        With ``return_attn_probs=True``: ``(out, softmax_lse, S_dmask)``. ``-inf`` for a
        query that sees no key (flash-attn gives ``+inf``).
    S_dmask : torch.Tensor
        With ``return_attn_probs=True``: (batch, nheads, seqlen_q, seqlen_k) in flash-attn's
        scaling with dropout, an empty tensor without.

    Raises
    ------
    ArgumentError
        An invalid argument value (both a ``ValueError`` and the ``RuntimeError`` flash-attn
        raises); the message names the argument.
    TypeError
        An argument of the wrong type.

    Examples
    --------
    >>> import torch, flashdl.flash_attn as flash_attn
    >>> q, k, v = (torch.randn(2, 16, 4, 8, requires_grad=True) for _ in range(3))
    >>> out = flash_attn.flash_attn_func(q, k, v, causal=True)
    >>> out.sum().backward()
    >>> out.shape
    torch.Size([2, 16, 4, 8])
    """
    return _dense(
        "flash_attn_func",
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


# Typing overloads, kept compact (a signature to a few lines, not a line per parameter).
# fmt: off
@overload
def flash_attn_qkvpacked_func(qkv: torch.Tensor, dropout_p: float = ...,
                              softmax_scale: Optional[float] = ..., causal: bool = ...,
                              window_size: Tuple[int, int] = ..., softcap: float = ...,
                              alibi_slopes: Optional[torch.Tensor] = ...,
                              deterministic: bool = ..., return_attn_probs: Literal[False] = ...
                              ) -> torch.Tensor: ...
@overload
def flash_attn_qkvpacked_func(qkv: torch.Tensor, dropout_p: float = ...,
                              softmax_scale: Optional[float] = ..., causal: bool = ...,
                              window_size: Tuple[int, int] = ..., softcap: float = ...,
                              alibi_slopes: Optional[torch.Tensor] = ...,
                              deterministic: bool = ..., *, return_attn_probs: Literal[True]
                              ) -> _WithProbs: ...
@overload
def flash_attn_qkvpacked_func(qkv: torch.Tensor, dropout_p: float = ...,
                              softmax_scale: Optional[float] = ..., causal: bool = ...,
                              window_size: Tuple[int, int] = ..., softcap: float = ...,
                              alibi_slopes: Optional[torch.Tensor] = ...,
                              deterministic: bool = ..., return_attn_probs: bool = ...
                              ) -> _OutOrProbs: ...
# fmt: on


@_flash_attn_errors
def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> _OutOrProbs:
    """flash-attn's ``flash_attn_qkvpacked_func``: q, k and v packed in one tensor.

    Parameters
    ----------
    qkv : torch.Tensor (batch, seqlen, 3, nheads, headdim)
        The gradient flows back into qkv.
    dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs : optional
        As in :func:`flash_attn_func`.

    Returns
    -------
    out : torch.Tensor (batch, seqlen, nheads, headdim)
        Or ``(out, softmax_lse, S_dmask)`` with ``return_attn_probs=True``, as
        :func:`flash_attn_func`.

    Raises
    ------
    ArgumentError
        An invalid argument value (both a ``ValueError`` and the ``RuntimeError`` flash-attn
        raises); the message names the argument.
    TypeError
        An argument of the wrong type.

    Examples
    --------
    >>> import torch, flashdl.flash_attn as flash_attn
    >>> qkv = torch.randn(2, 16, 3, 4, 8)
    >>> flash_attn.flash_attn_qkvpacked_func(qkv, causal=True).shape
    torch.Size([2, 16, 4, 8])
    """
    fn = "flash_attn_qkvpacked_func"
    _packed(fn, "qkv", qkv, 2, 3, "(batch, seqlen, 3, nheads, headdim)")
    return _dense(
        fn,
        qkv[:, :, 0],
        qkv[:, :, 1],
        qkv[:, :, 2],
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


# Typing overloads, kept compact (a signature to a few lines, not a line per parameter).
# fmt: off
@overload
def flash_attn_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, dropout_p: float = ...,
                             softmax_scale: Optional[float] = ..., causal: bool = ...,
                             window_size: Tuple[int, int] = ..., softcap: float = ...,
                             alibi_slopes: Optional[torch.Tensor] = ...,
                             deterministic: bool = ..., return_attn_probs: Literal[False] = ...
                             ) -> torch.Tensor: ...
@overload
def flash_attn_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, dropout_p: float = ...,
                             softmax_scale: Optional[float] = ..., causal: bool = ...,
                             window_size: Tuple[int, int] = ..., softcap: float = ...,
                             alibi_slopes: Optional[torch.Tensor] = ...,
                             deterministic: bool = ..., *, return_attn_probs: Literal[True]
                             ) -> _WithProbs: ...
@overload
def flash_attn_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, dropout_p: float = ...,
                             softmax_scale: Optional[float] = ..., causal: bool = ...,
                             window_size: Tuple[int, int] = ..., softcap: float = ...,
                             alibi_slopes: Optional[torch.Tensor] = ...,
                             deterministic: bool = ..., return_attn_probs: bool = ...
                             ) -> _OutOrProbs: ...
# fmt: on


@_flash_attn_errors
def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> _OutOrProbs:
    """flash-attn's ``flash_attn_kvpacked_func``: k and v packed in one tensor.

    Parameters
    ----------
    q : torch.Tensor (batch, seqlen_q, nheads, headdim)
    kv : torch.Tensor (batch, seqlen_k, 2, nheads_k, headdim)
        The gradient flows back into kv.
    dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs : optional
        As in :func:`flash_attn_func`.

    Returns
    -------
    out : torch.Tensor (batch, seqlen_q, nheads, headdim)
        Or ``(out, softmax_lse, S_dmask)`` with ``return_attn_probs=True``.

    Raises
    ------
    ArgumentError
        An invalid argument value (both a ``ValueError`` and the ``RuntimeError`` flash-attn
        raises); the message names the argument.
    TypeError
        An argument of the wrong type.

    Examples
    --------
    >>> import torch, flashdl.flash_attn as flash_attn
    >>> q, kv = torch.randn(1, 8, 4, 16), torch.randn(1, 12, 2, 2, 16)
    >>> flash_attn.flash_attn_kvpacked_func(q, kv, causal=True).shape
    torch.Size([1, 8, 4, 16])
    """
    fn = "flash_attn_kvpacked_func"
    _tensors(fn, q=q)
    _packed(fn, "kv", kv, 2, 2, "(batch, seqlen_k, 2, nheads_kv, headdim)")
    return _dense(
        fn,
        q,
        kv[:, :, 0],
        kv[:, :, 1],
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


@_flash_attn_errors
def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """flash-attn's ``flash_attn_with_kvcache``, over :func:`flashdl.attention_with_kvcache`.

    No autograd, as in flash-attn. ``cache_seqlens`` and ``block_table`` on a GPU are copied to
    the host first (one synchronisation).

    Parameters
    ----------
    q : torch.Tensor (batch, seqlen_q, nheads, headdim)
    k_cache, v_cache : torch.Tensor
        (batch_cache, seqlen_cache, nheads_k, headdim), or paged (num_blocks, page_block_size,
        nheads_k, headdim) with ``block_table`` (any page size).
    k, v : torch.Tensor (batch, seqlen_new, nheads_k, headdim), optional
        Written into the caches in place at ``cache_seqlens``.
    rotary_cos, rotary_sin : torch.Tensor (seqlen_ro, rotary_dim / 2), optional
        Rotary embedding of q and the new k (flashdl.attention_with_kvcache's); the cache keeps
        rotated keys. ``rotary_interleaved`` (default True, as flash-attn): GPT-J pairs.
    cache_batch_idx : int32 tensor (batch,), optional
        The cache row of each sequence (contiguous caches).
    cache_leftpad : int32 tensor (batch,), optional
        The first visible cache position of each sequence.
    cache_seqlens : int or int32 tensor (batch,), optional
        Tokens already in each cache: an int (every sequence), a tensor, or None (the caches are
        full).
    block_table : int32 tensor (batch, max_num_blocks_per_seq), optional
    softmax_scale, causal, window_size, softcap, alibi_slopes : optional
        As in :func:`flash_attn_func`.
    num_splits : int, default 0
        Split-KV parts; 0 chooses.
    return_softmax_lse : bool, default False

    Returns
    -------
    out : torch.Tensor (batch, seqlen_q, nheads, headdim)
        Or ``(out, softmax_lse)`` with ``return_softmax_lse=True``.

    Raises
    ------
    ArgumentError
        An invalid argument value (a ``ValueError`` and a ``RuntimeError``).
    TypeError
        An argument of the wrong type.

    Examples
    --------
    >>> import torch, flashdl.flash_attn as flash_attn
    >>> k_cache, v_cache = torch.zeros(2, 8, 1, 16), torch.zeros(2, 8, 1, 16)
    >>> q, k, v = torch.randn(2, 1, 2, 16), torch.randn(2, 1, 1, 16), torch.randn(2, 1, 1, 16)
    >>> out = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3)
    >>> out.shape, torch.equal(k_cache[:, 3], k[:, 0])
    (torch.Size([2, 1, 2, 16]), True)
    """
    _tensors("flash_attn_with_kvcache", q=q, k_cache=k_cache, v_cache=v_cache)
    if rotary_cos is not None and rotary_sin is not None and k is None:
        # flash-attn: "If rotary cos/sin are provided, new key / value to be appended to KV cache
        # must also be provided" (only one of the tables: flashdl's "both or neither" below).
        raise ValueError(
            "rotary_cos: rotary embedding is given, so the new keys and values to "
            "append to the cache (k and v) must be given too, as in flash-attn; "
            "flashdl.attention_with_kvcache also rotates q alone"
        )
    batch = q.shape[0]
    if cache_seqlens is None:
        cache_seqlens = torch.full(
            (batch,), k_cache.shape[1] - (0 if k is None else k.shape[1]), dtype=torch.int32
        )
    elif isinstance(cache_seqlens, (numbers.Integral, bool, np.bool_)):
        cache_seqlens = torch.full(
            (batch,),
            _checks.integer(
                "cache_seqlens",
                cache_seqlens,
                "an int32 tensor (batch,) or an int in [0, 2**31)",
                0,
                2**31,
            ),
            dtype=torch.int32,
        )
    # flash-attn takes these on the GPU; flashdl checks them on the host.
    if isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.device.type != "cpu":
        cache_seqlens = cache_seqlens.cpu()
    # flash-attn takes these on the GPU too; flashdl reads them on the host.
    if isinstance(cache_leftpad, torch.Tensor) and cache_leftpad.device.type != "cpu":
        cache_leftpad = cache_leftpad.cpu()
    if isinstance(cache_batch_idx, torch.Tensor) and cache_batch_idx.device.type != "cpu":
        cache_batch_idx = cache_batch_idx.cpu()
    if isinstance(block_table, torch.Tensor) and block_table.device.type != "cpu":
        block_table = block_table.cpu()
    rotary: Dict[str, Any] = {}
    if rotary_cos is not None or rotary_sin is not None:
        rotary = dict(
            rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved
        )
    mods = _score_mods(softcap, alibi_slopes)
    with torch.no_grad():
        return _fdl.attention_with_kvcache(
            _maybe_contiguous(q),
            k_cache,
            v_cache,
            cache_seqlens=cache_seqlens,
            k=k,
            v=v,
            block_table=block_table,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=_window(window_size),
            num_splits=num_splits,
            return_lse=return_softmax_lse,
            cache_batch_idx=cache_batch_idx,
            cache_leftpad=cache_leftpad,
            **rotary,
            **mods,
        )


def unpad_input(
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor,
    unused_mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """``flash_attn.bert_padding.unpad_input``: from a padded batch to the varlen layout.

    Parameters
    ----------
    hidden_states : torch.Tensor (batch, seqlen, ...)
    attention_mask : torch.Tensor (batch, seqlen)
        bool or 0/1, true for the tokens to keep.
    unused_mask : torch.Tensor (batch, seqlen), optional
        Tokens that are kept (allocated) but not counted as used.

    Returns
    -------
    hidden_states : torch.Tensor (total, ...)
        The kept tokens in batch-major order; the gradient flows back into the input.
    indices : int64 tensor (total,)
        Their indices into the flattened (batch * seqlen) tokens.
    cu_seqlens : int32 tensor (batch + 1,)
    max_seqlen : int
    seqused : int32 tensor (batch,)
        The tokens of ``attention_mask`` alone.

    Examples
    --------
    >>> import torch, flashdl.flash_attn as flash_attn
    >>> x = torch.randn(2, 4, 8)
    >>> mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    >>> packed, idx, cu, max_len, used = flash_attn.unpad_input(x, mask)
    >>> packed.shape, cu.tolist(), max_len
    (torch.Size([5, 8]), [0, 3, 5], 3)
    >>> flash_attn.pad_input(packed, idx, 2, 4).shape
    torch.Size([2, 4, 8])
    """
    all_masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, max_seqlen, used


def pad_input(
    hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int
) -> torch.Tensor:
    """``flash_attn.bert_padding.pad_input``: the inverse of :func:`unpad_input`.

    Parameters
    ----------
    hidden_states : torch.Tensor (total, ...)
        Packed tokens; the gradient flows back into it.
    indices : int64 tensor (total,)
        Their rows in the flattened (batch * seqlen) batch, as :func:`unpad_input` returned them.
    batch, seqlen : int
        The padded shape.

    Returns
    -------
    torch.Tensor (batch, seqlen, ...)
        Zeros where no token was placed.

    Examples
    --------
    >>> import torch, flashdl.flash_attn as flash_attn
    >>> packed = torch.ones(3, 2)
    >>> flash_attn.pad_input(packed, torch.tensor([0, 1, 4]), 2, 3)[:, :, 0]
    tensor([[1., 1., 0.],
            [0., 1., 0.]])
    """
    out = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
    out = out.index_put((indices,), hidden_states)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
