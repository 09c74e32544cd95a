"""flash-attn's varlen drop-ins of flashdl.flash_attn (flash_attn_varlen_func and its packed
forms): batches of sequences of different lengths packed with no padding, over
flashdl.torch.attention_varlen.
"""

from __future__ import annotations

from typing import Literal, Optional, Tuple, overload

import torch

from ._torch_flash_attn import OutOrProbs as _OutOrProbs
from ._torch_flash_attn import WithProbs as _WithProbs
from ._torch_flash_attn import check_packed as _packed
from ._torch_flash_attn import check_tensors as _tensors
from ._torch_flash_attn import flash_attn_errors as _flash_attn_errors
from ._torch_flash_attn import varlen as _varlen


# Typing overloads, kept compact (a signature to a few lines, not a line per parameter).
# fmt: off
@overload
def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = ...,
                           softmax_scale: Optional[float] = ..., causal: bool = ...,
                           window_size: Tuple[int, int] = ..., softcap: float = ...,
                           alibi_slopes: Optional[torch.Tensor] = ..., deterministic: bool = ...,
                           return_attn_probs: Literal[False] = ...,
                           block_table: Optional[torch.Tensor] = ...,
                           seqused_k: Optional[torch.Tensor] = ...) -> torch.Tensor: ...
@overload
def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = ...,
                           softmax_scale: Optional[float] = ..., causal: bool = ...,
                           window_size: Tuple[int, int] = ..., softcap: float = ...,
                           alibi_slopes: Optional[torch.Tensor] = ..., deterministic: bool = ...,
                           *, return_attn_probs: Literal[True],
                           block_table: Optional[torch.Tensor] = ...,
                           seqused_k: Optional[torch.Tensor] = ...
                           ) -> _WithProbs: ...
@overload
def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = ...,
                           softmax_scale: Optional[float] = ..., causal: bool = ...,
                           window_size: Tuple[int, int] = ..., softcap: float = ...,
                           alibi_slopes: Optional[torch.Tensor] = ..., deterministic: bool = ...,
                           return_attn_probs: bool = ...,
                           block_table: Optional[torch.Tensor] = ...,
                           seqused_k: Optional[torch.Tensor] = ...
                           ) -> _OutOrProbs: ...
# fmt: on


@_flash_attn_errors
def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
) -> _OutOrProbs:
    """flash-attn's ``flash_attn_varlen_func``, over :func:`flashdl.torch.attention_varlen`.

    Parameters
    ----------
    q : torch.Tensor (total_q, nheads, headdim)
    k, v : torch.Tensor (total_k, nheads_k, headdim)
    cu_seqlens_q, cu_seqlens_k : int32 tensor (batch + 1,)
        Cumulative sequence lengths, on the CPU or on q's CUDA device.
    max_seqlen_q, max_seqlen_k : int
    dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs : optional
        As in :func:`flash_attn_func`, per sequence.
    block_table : int32 tensor (batch, max_num_blocks_per_seq), optional
        Paged k, v (num_blocks, page_block_size, nheads_k, headdim), any page size: chunked
        prefill over a paged KV cache (flashdl.attention_varlen's ``block_table``). Forward only,
        as in flash-attn. A GPU table is copied to the host (with seqused_k and both cu_seqlens);
        on CUDA the used pages are gathered into stream-ordered buffers (tests pass on an H100).
    seqused_k : int32 tensor (batch,), optional
        Keys each sequence uses (flash-attn's private varlen forward's argument; a flashdl
        extension here).

    Returns
    -------
    out : torch.Tensor (total_q, nheads, headdim)
        Or with ``return_attn_probs=True`` ``(out, softmax_lse, S_dmask)``: softmax_lse float32
        (nheads, total_q), S_dmask (batch, nheads, max_seqlen_q, max_seqlen_k).

    Raises
    ------
    NotImplementedError
        The backward of a call with ``block_table`` or ``seqused_k``.
    ArgumentError
        An invalid argument value (a ``ValueError`` and a ``RuntimeError``).
    TypeError
        An argument of the wrong type.

    Examples
    --------
    >>> import torch, flashdl.flash_attn as flash_attn
    >>> cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    >>> q, k, v = (torch.randn(10, 2, 8) for _ in range(3))
    >>> flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True).shape
    torch.Size([10, 2, 8])
    """
    return _varlen(
        "flash_attn_varlen_func",
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        block_table=block_table,
        seqused_k=seqused_k,
    )


# Typing overloads, kept compact (a signature to a few lines, not a line per parameter).
# fmt: off
@overload
def flash_attn_varlen_qkvpacked_func(qkv: torch.Tensor, cu_seqlens: torch.Tensor,
                                     max_seqlen: int, dropout_p: float = ...,
                                     softmax_scale: Optional[float] = ..., causal: bool = ...,
                                     window_size: Tuple[int, int] = ..., softcap: float = ...,
                                     alibi_slopes: Optional[torch.Tensor] = ...,
                                     deterministic: bool = ...,
                                     return_attn_probs: Literal[False] = ...) -> torch.Tensor: ...
@overload
def flash_attn_varlen_qkvpacked_func(qkv: torch.Tensor, cu_seqlens: torch.Tensor,
                                     max_seqlen: int, dropout_p: float = ...,
                                     softmax_scale: Optional[float] = ..., causal: bool = ...,
                                     window_size: Tuple[int, int] = ..., softcap: float = ...,
                                     alibi_slopes: Optional[torch.Tensor] = ...,
                                     deterministic: bool = ..., *,
                                     return_attn_probs: Literal[True]
                                     ) -> _WithProbs: ...
@overload
def flash_attn_varlen_qkvpacked_func(qkv: torch.Tensor, cu_seqlens: torch.Tensor,
                                     max_seqlen: int, dropout_p: float = ...,
                                     softmax_scale: Optional[float] = ..., causal: bool = ...,
                                     window_size: Tuple[int, int] = ..., softcap: float = ...,
                                     alibi_slopes: Optional[torch.Tensor] = ...,
                                     deterministic: bool = ..., return_attn_probs: bool = ...
                                     ) -> _OutOrProbs: ...
# fmt: on


@_flash_attn_errors
def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> _OutOrProbs:
    """flash-attn's ``flash_attn_varlen_qkvpacked_func``: packed sequences, q, k and v in one tensor.

    Parameters
    ----------
    qkv : torch.Tensor (total, 3, nheads, headdim)
    cu_seqlens : int32 tensor (batch + 1,)
        For queries and keys alike.
    max_seqlen : int
    dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs : optional
        As in :func:`flash_attn_func`.

    Returns
    -------
    out : torch.Tensor (total, nheads, headdim)
        Or ``(out, softmax_lse, S_dmask)`` as :func:`flash_attn_varlen_func`.

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
    >>> cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    >>> flash_attn.flash_attn_varlen_qkvpacked_func(torch.randn(9, 3, 2, 8), cu, 5).shape
    torch.Size([9, 2, 8])
    """
    fn = "flash_attn_varlen_qkvpacked_func"
    _packed(fn, "qkv", qkv, 1, 3, "(total, 3, nheads, headdim)")
    return _varlen(
        fn,
        qkv[:, 0],
        qkv[:, 1],
        qkv[:, 2],
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
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
def flash_attn_varlen_kvpacked_func(q: torch.Tensor, kv: torch.Tensor,
                                    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = ...,
                                    softmax_scale: Optional[float] = ..., causal: bool = ...,
                                    window_size: Tuple[int, int] = ..., softcap: float = ...,
                                    alibi_slopes: Optional[torch.Tensor] = ...,
                                    deterministic: bool = ...,
                                    return_attn_probs: Literal[False] = ...) -> torch.Tensor: ...
@overload
def flash_attn_varlen_kvpacked_func(q: torch.Tensor, kv: torch.Tensor,
                                    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = ...,
                                    softmax_scale: Optional[float] = ..., causal: bool = ...,
                                    window_size: Tuple[int, int] = ..., softcap: float = ...,
                                    alibi_slopes: Optional[torch.Tensor] = ...,
                                    deterministic: bool = ..., *, return_attn_probs: Literal[True]
                                    ) -> _WithProbs: ...
@overload
def flash_attn_varlen_kvpacked_func(q: torch.Tensor, kv: torch.Tensor,
                                    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = ...,
                                    softmax_scale: Optional[float] = ..., causal: bool = ...,
                                    window_size: Tuple[int, int] = ..., softcap: float = ...,
                                    alibi_slopes: Optional[torch.Tensor] = ...,
                                    deterministic: bool = ..., return_attn_probs: bool = ...
                                    ) -> _OutOrProbs: ...
# fmt: on


@_flash_attn_errors
def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> _OutOrProbs:
    """flash-attn's ``flash_attn_varlen_kvpacked_func``: packed sequences, k and v in one tensor.

    Parameters
    ----------
    q : torch.Tensor (total_q, nheads, headdim)
    kv : torch.Tensor (total_k, 2, nheads_k, headdim)
    cu_seqlens_q, cu_seqlens_k : int32 tensor (batch + 1,)
    max_seqlen_q, max_seqlen_k : int
    dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs : optional
        As in :func:`flash_attn_func`.

    Returns
    -------
    out : torch.Tensor (total_q, nheads, headdim)
        Or ``(out, softmax_lse, S_dmask)`` as :func:`flash_attn_varlen_func`.

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
    >>> cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    >>> q, kv = torch.randn(9, 2, 8), torch.randn(9, 2, 1, 8)
    >>> flash_attn.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 5, 5).shape
    torch.Size([9, 2, 8])
    """
    fn = "flash_attn_varlen_kvpacked_func"
    _tensors(fn, q=q)
    _packed(fn, "kv", kv, 1, 2, "(total_k, 2, nheads_kv, headdim)")
    return _varlen(
        fn,
        q,
        kv[:, 0],
        kv[:, 1],
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )
