"""PyTorch autograd for flashdl: flashdl.torch.attention(q, k, v) with loss.backward() support.

The forward saves q, k, v, out and lse (and, with dropout, the seed and offset, not the mask);
the backward recomputes the attention matrix and the dropout mask block by block
(flashdl.attention_backward), as FlashAttention does, instead of storing them.
"""

from __future__ import annotations

from typing import Literal, Optional, Tuple, Union, overload

import torch

from . import _sdpa
from ._api import ArrayLike, BlockSize, _dropout
from ._api import attention as _attention
from ._api import attention_backward as _attention_backward
from ._api import attention_varlen as _attention_varlen
from ._api import attention_varlen_backward as _attention_varlen_backward
from ._kvcache import attention_with_kvcache as _attention_with_kvcache
from ._ring import ring_attention
from ._ring import shard as ring_shard
from ._ring import unshard as ring_unshard

__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "ring_attention",
           "ring_shard", "ring_unshard", "scaled_dot_product_attention"]


def _last_dim_contiguous(dout):
    """Autograd often hands over broadcast gradients (e.g. of .sum(): every stride 0); the
    kernels need a contiguous last dimension."""
    if dout.shape[-1] > 1 and dout.stride(-1) != 1:
        return dout.contiguous()
    return dout


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, schedule, window_size, dropout_p, seed,
                offset, block_mask, block_size, deterministic, alibi_slopes, softcap):
        opts = dict(causal=causal, softmax_scale=softmax_scale, schedule=schedule,
                    window_size=window_size, dropout_p=dropout_p, seed=seed, offset=offset,
                    block_mask=block_mask, block_size=block_size, alibi_slopes=alibi_slopes,
                    softcap=softcap)
        out, lse = _attention(q, k, v, return_lse=True, **opts)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.opts = opts
        ctx.deterministic = deterministic
        # lse is returned for callers that want it (return_lse=True); no gradient flows into it.
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _attention_backward(_last_dim_contiguous(dout), q, k, v, out, lse,
                                         deterministic=ctx.deterministic, **ctx.opts)
        return (dq, dk, dv) + (None,) * 12


def _torch_seed() -> int:
    """63 bits from torch's default CPU generator, so torch.manual_seed makes dropout repeatable."""
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64).item())


@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
              softmax_scale: Optional[float] = ..., schedule: str = ...,
              window_size: Tuple[int, int] = ..., dropout_p: float = ...,
              seed: Optional[int] = ..., offset: int = ..., block_mask: Optional[ArrayLike] = ...,
              block_size: BlockSize = ..., deterministic: bool = ...,
              alibi_slopes: Optional[ArrayLike] = ..., softcap: float = ...,
              return_lse: Literal[False] = ...) -> torch.Tensor: ...
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
              softmax_scale: Optional[float] = ..., schedule: str = ...,
              window_size: Tuple[int, int] = ..., dropout_p: float = ...,
              seed: Optional[int] = ..., offset: int = ..., block_mask: Optional[ArrayLike] = ...,
              block_size: BlockSize = ..., deterministic: bool = ...,
              alibi_slopes: Optional[ArrayLike] = ..., softcap: float = ...,
              return_lse: Literal[True]) -> Tuple[torch.Tensor, torch.Tensor]: ...
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
              softmax_scale: Optional[float] = ..., schedule: str = ...,
              window_size: Tuple[int, int] = ..., dropout_p: float = ...,
              seed: Optional[int] = ..., offset: int = ..., block_mask: Optional[ArrayLike] = ...,
              block_size: BlockSize = ..., deterministic: bool = ...,
              alibi_slopes: Optional[ArrayLike] = ..., softcap: float = ..., return_lse: bool = ...
              ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]: ...


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              softmax_scale: Optional[float] = None, schedule: str = "auto",
              window_size: Tuple[int, int] = (-1, -1), dropout_p: float = 0.0,
              seed: Optional[int] = None, offset: int = 0, block_mask: Optional[ArrayLike] = None,
              block_size: BlockSize = 128, deterministic: bool = False,
              alibi_slopes: Optional[ArrayLike] = None, softcap: float = 0.0,
              return_lse: bool = False
              ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """flashdl.attention for torch tensors, differentiable with respect to q, k and v.

    q (batch, seqlen_q, nheads, headdim); k, v (batch, seqlen_k, nheads_kv, headdim); CPU or
    CUDA tensors (on CUDA: float16 or bfloat16, the work on the current stream).

    deterministic: passed to the backward (flashdl.attention_backward). On CUDA, fa2 accumulates
    dq with float atomics by default, so dq may differ in the last bits from run to run;
    deterministic=True makes dq bitwise reproducible at some cost in speed. dk and dv are always
    reproducible, and so is every gradient on the CPU (for a given thread count).

    dropout_p in [0, 1) drops attention probabilities (kept ones scaled by 1 / (1 - dropout_p)),
    as flashdl.attention does; seed None draws one from torch's default CPU generator (so
    torch.manual_seed makes it repeatable), and the backward reuses that seed and offset: the
    mask is regenerated, never stored. Pass dropout_p=0 at evaluation time.

    block_mask, block_size: block-sparse attention as in flashdl.attention (a bool CPU tensor or
    NumPy array); the backward skips the same zero blocks.

    alibi_slopes (float32 (nheads,) or (batch, nheads), on the device of q; no gradient) and
    softcap (> 0: scores capped by softcap * tanh(score / softcap)) as in flashdl.attention.

    return_lse=True returns (out, lse), lse float32 (batch, nheads, seqlen_q) as in
    flashdl.attention; lse carries no gradient (it is marked non-differentiable).
    """
    if seed is None:
        seed = _torch_seed() if _dropout(dropout_p, 0, offset)[0] > 0 else 0
    dropout_p, seed, offset = _dropout(dropout_p, seed, offset)
    out, lse = _Attention.apply(q, k, v, causal, softmax_scale, schedule, window_size, dropout_p,
                                seed, offset, block_mask, block_size, bool(deterministic),
                                alibi_slopes, softcap)
    return (out, lse) if return_lse else out


class _AttentionVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                softmax_scale, schedule, window_size, dropout_p, seed, offset, block_mask,
                block_size, deterministic, alibi_slopes, softcap):
        opts = dict(causal=causal, softmax_scale=softmax_scale, schedule=schedule,
                    window_size=window_size, dropout_p=dropout_p, seed=seed, offset=offset,
                    block_mask=block_mask, block_size=block_size, alibi_slopes=alibi_slopes,
                    softcap=softcap)
        out, lse = _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, return_lse=True, **opts)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        ctx.opts = opts
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _attention_varlen_backward(_last_dim_contiguous(dout), q, k, v, out, lse,
                                                *ctx.varlen, deterministic=ctx.deterministic,
                                                **ctx.opts)
        return (dq, dk, dv) + (None,) * 16


@overload
def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike, max_seqlen_q: int,
                     max_seqlen_k: int, *, causal: bool = ...,
                     softmax_scale: Optional[float] = ..., schedule: str = ...,
                     window_size: Tuple[int, int] = ..., dropout_p: float = ...,
                     seed: Optional[int] = ..., offset: int = ...,
                     block_mask: Optional[ArrayLike] = ..., block_size: BlockSize = ...,
                     deterministic: bool = ..., alibi_slopes: Optional[ArrayLike] = ...,
                     softcap: float = ..., return_lse: Literal[False] = ...
                     ) -> torch.Tensor: ...
@overload
def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike, max_seqlen_q: int,
                     max_seqlen_k: int, *, causal: bool = ...,
                     softmax_scale: Optional[float] = ..., schedule: str = ...,
                     window_size: Tuple[int, int] = ..., dropout_p: float = ...,
                     seed: Optional[int] = ..., offset: int = ...,
                     block_mask: Optional[ArrayLike] = ..., block_size: BlockSize = ...,
                     deterministic: bool = ..., alibi_slopes: Optional[ArrayLike] = ...,
                     softcap: float = ..., return_lse: Literal[True]
                     ) -> Tuple[torch.Tensor, torch.Tensor]: ...
@overload
def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike, max_seqlen_q: int,
                     max_seqlen_k: int, *, causal: bool = ...,
                     softmax_scale: Optional[float] = ..., schedule: str = ...,
                     window_size: Tuple[int, int] = ..., dropout_p: float = ...,
                     seed: Optional[int] = ..., offset: int = ...,
                     block_mask: Optional[ArrayLike] = ..., block_size: BlockSize = ...,
                     deterministic: bool = ..., alibi_slopes: Optional[ArrayLike] = ...,
                     softcap: float = ..., return_lse: bool = ...
                     ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]: ...


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike, max_seqlen_q: int,
                     max_seqlen_k: int, *, causal: bool = False,
                     softmax_scale: Optional[float] = None, schedule: str = "auto",
                     window_size: Tuple[int, int] = (-1, -1), dropout_p: float = 0.0,
                     seed: Optional[int] = None, offset: int = 0,
                     block_mask: Optional[ArrayLike] = None, block_size: BlockSize = 128,
                     deterministic: bool = False, alibi_slopes: Optional[ArrayLike] = None,
                     softcap: float = 0.0, return_lse: bool = False
                     ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """flashdl.attention_varlen for torch tensors, differentiable with respect to q, k and v.

    q (total_q, nheads, headdim); k, v (total_k, nheads_kv, headdim); cu_seqlens_q,
    cu_seqlens_k int32 (batch + 1,) CPU tensors (or NumPy arrays), or for CUDA q tensors on
    its device (see flashdl.attention_varlen). With
    dropout, sequence b gets the mask dense batch b would get (flashdl.dropout_mask); with a
    block_mask, its plane b (or the shared one), blocks counted from the sequence's start.
    deterministic and return_lse (lse (nheads, total_q), no gradient) as in attention.
    """
    if seed is None:
        seed = _torch_seed() if _dropout(dropout_p, 0, offset)[0] > 0 else 0
    dropout_p, seed, offset = _dropout(dropout_p, seed, offset)
    out, lse = _AttentionVarlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      max_seqlen_k, causal, softmax_scale, schedule, window_size,
                                      dropout_p, seed, offset, block_mask, block_size,
                                      bool(deterministic), alibi_slopes, softcap)
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, *, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """torch.nn.functional.scaled_dot_product_attention computed by flashdl (autograd included).

    PyTorch's signature and layout: query (batch, heads, seq_q, dim), key and value
    (batch, heads_kv, seq_k, dim) (or rank 3, (batch, seq, dim)); returns (batch, heads, seq_q,
    dim) as a view of flashdl's (batch, seq_q, heads, dim) output. The inputs reach flashdl as
    transposed views, not copies (a strided last dimension is copied, as flashdl needs stride 1
    there).

    is_causal is PyTorch's TOP-LEFT alignment (key j visible to query i iff j <= i), unlike
    flashdl.torch.attention's bottom-right causal; the two agree when seq_q == seq_k.
    enable_gqa=True allows heads_kv dividing heads (query head h reads kv head
    h // (heads // heads_kv)); with False the heads must be equal, or heads_kv 1 (torch
    broadcasts it). scale None is 1/sqrt(dim). attn_mask: None or an all-True bool mask
    (float masks and other bool masks raise NotImplementedError). dropout_p > 0 uses flashdl's
    Philox dropout with a seed drawn from torch's CPU generator (torch.manual_seed repeats it):
    the same distribution as torch's dropout, but not the same mask as torch's RNG stream would
    give. Value's head dim must equal query's.
    """
    _sdpa.check_layout(query, key, value, enable_gqa)
    rank3 = query.dim() == 3
    seq = 1 if rank3 else 2  # the seq axis in PyTorch's layout
    sq, sk = query.shape[seq], key.shape[seq]
    shape = (query.shape[0], sq, sk) if rank3 else (query.shape[0], query.shape[1], sq, sk)
    _sdpa.check_mask(attn_mask, shape)
    keep, causal, window = _sdpa.causal_args(is_causal, sq, sk)

    def flashdl_layout(x: torch.Tensor, n: int) -> torch.Tensor:
        x = x.narrow(seq, 0, n)  # a view; only top-left causal with sq < sk drops keys
        x = x.unsqueeze(2) if rank3 else x.transpose(1, 2)
        return x.contiguous() if x.shape[-1] > 1 and x.stride(-1) != 1 else x

    try:
        out = attention(flashdl_layout(query, sq), flashdl_layout(key, keep),
                        flashdl_layout(value, keep), causal=causal, softmax_scale=scale,
                        window_size=window, dropout_p=dropout_p)
    except (ValueError, TypeError) as err:
        raise _sdpa.renamed(err) from None
    return out.squeeze(2) if rank3 else out.transpose(1, 2)


def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                           cache_seqlens: ArrayLike, k: Optional[torch.Tensor] = None,
                           v: Optional[torch.Tensor] = None,
                           block_table: Optional[ArrayLike] = None, causal: bool = False,
                           softmax_scale: Optional[float] = None,
                           window_size: Tuple[int, int] = (-1, -1), num_splits: int = 0,
                           return_lse: bool = False, alibi_slopes: Optional[ArrayLike] = None,
                           softcap: float = 0.0
                           ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """flashdl.attention_with_kvcache for torch tensors (decoding; no autograd): runs under
    torch.no_grad(), appends k, v into k_cache, v_cache in place when given. cache_seqlens and
    block_table: int32 CPU tensors (or NumPy arrays), also for CUDA q (copied to the device on
    the current stream; the CUDA path is written, not yet run on a GPU)."""
    with torch.no_grad():
        return _attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, k=k,
                                       v=v, block_table=block_table, causal=causal,
                                       softmax_scale=softmax_scale, window_size=window_size,
                                       num_splits=num_splits, return_lse=return_lse,
                                       alibi_slopes=alibi_slopes, softcap=softcap)
