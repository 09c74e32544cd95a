"""A flash-attn 2.x drop-in: `import flashdl.flash_attn as flash_attn`.

flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func, flash_attn_varlen_func,
flash_attn_varlen_qkvpacked_func and flash_attn_varlen_kvpacked_func with flash-attn 2.x's
signatures, defaults and return values, over flashdl.torch (autograd) on CPU or CUDA tensors.
Same layouts as flash-attn: q (batch, seqlen, nheads, headdim), qkv (batch, seqlen, 3, nheads,
headdim), kv (batch, seqlen, 2, nheads_k, headdim); varlen (total, nheads, headdim) with int32
cu_seqlens; unpad_input and pad_input are flash_attn.bert_padding's, to go between padded batches
and that layout. flash-attn's own test module runs against this one: tools/flash_attn_upstream.py,
docs/flash_attn_tests.md. Differences from flash-attn (also in docs/migrating.md, "From
flash-attn"):

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
  (non-finite scales, softcaps and slopes) is listed in docs/migrating.md.

S_dmask (return_attn_probs=True with dropout; an empty tensor without, as flash-attn) is in
the scaling of flash-attn's kernel (see _attn_probs below): (batch, nheads, seqlen_q, seqlen_k)
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

import math
import numbers
import functools
from typing import Any, Callable, Literal, Optional, Tuple, TypeVar, Union, overload

import numpy as np
import torch

from . import _checks
from . import torch as _fdl
from ._api import dropout_mask as _dropout_mask
from ._frameworks import type_name
from ._torch_args import draw_seed

__all__ = ["ArgumentError", "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache", "unpad_input",
           "pad_input"]

# return_attn_probs=True: (out, softmax_lse, S_dmask); False: out alone.
_WithProbs = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]
_OutOrProbs = Union[torch.Tensor, _WithProbs]


class ArgumentError(ValueError, RuntimeError):
    """An invalid argument: flashdl's ``ValueError``, and the ``RuntimeError`` flash-attn raises.

    Handlers written for either catch it.

    Examples
    --------
    >>> import torch, flashdl.flash_attn as flash_attn
    >>> try:
    ...     flash_attn.flash_attn_func(torch.randn(1, 4, 3, 8), torch.randn(1, 4, 2, 8),
    ...                                torch.randn(1, 4, 2, 8))
    ... except RuntimeError as err:
    ...     print(type(err).__name__, isinstance(err, ValueError))
    ArgumentError True
    """


_F = TypeVar("_F", bound=Callable[..., Any])


def _flash_attn_errors(fn: _F) -> _F:
    """fn with flashdl's ValueErrors re-raised as ArgumentError (same message)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ArgumentError:
            raise
        except ValueError as e:
            raise ArgumentError(str(e)) from e
    return wrapper  # type: ignore[return-value]


def _maybe_contiguous(x):
    # flash-attn copies a tensor whose last dimension is strided; flashdl requires stride 1 there.
    return x.contiguous() if isinstance(x, torch.Tensor) and x.stride(-1) != 1 else x


# flashdl's own entry point for each drop-in, named when an array is not a torch tensor.
_NATIVE = {"flash_attn_func": "flashdl.attention", "flash_attn_kvpacked_func": "flashdl.attention",
           "flash_attn_qkvpacked_func": "flashdl.attention",
           "flash_attn_varlen_func": "flashdl.attention_varlen",
           "flash_attn_varlen_kvpacked_func": "flashdl.attention_varlen",
           "flash_attn_varlen_qkvpacked_func": "flashdl.attention_varlen",
           "flash_attn_with_kvcache": "flashdl.attention_with_kvcache"}


def _tensors(fn, **arrays):
    """TypeError naming the first of arrays that is not a torch.Tensor: flash-attn's functions
    take torch tensors; flashdl's own (named) take NumPy, JAX and CuPy arrays too."""
    for name, x in arrays.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: {fn} takes torch tensors (as flash-attn), got "
                            f"{type_name(x)}; "
                            f"use {_NATIVE[fn]} for NumPy, JAX or CuPy arrays")


def _score_mods(softcap, alibi_slopes):
    """flashdl's softcap and alibi_slopes keywords for flash-attn's arguments."""
    softcap = _checks.finite("softcap", _checks.real("softcap", softcap, "a float"),
                             "a finite float (<= 0: off)")
    # flash-attn's kernel treats softcap <= 0 as off; flashdl takes 0 for that.
    return dict(softcap=softcap if softcap > 0 else 0.0, alibi_slopes=alibi_slopes)


def _packed(fn, name, x, axis, n, layout):
    """Refuses a packed tensor whose packing axis is not n long (it would otherwise be sliced)."""
    shape = tuple(getattr(x, "shape", ()))
    _tensors(fn, **{name: x})
    if len(shape) != len(layout.split(",")) or shape[axis] != n:
        raise ValueError(f"{name}: expected shape {layout} with {n} on axis {axis}, "
                         f"got {shape}")


def _window(window_size):
    # flash-attn's kernel treats any negative side as unbounded; flashdl takes only -1 for that.
    # Anything that is not a pair of ints is left for flashdl's own error (naming window_size).
    try:
        left, right = window_size
        return (-1 if left < -1 else left, -1 if right < -1 else right)
    except (TypeError, ValueError):
        return window_size


def _seed(q, dropout_p, return_attn_probs):
    """The dropout seed: None (no dropout, or without return_attn_probs) lets flashdl.torch draw
    it from the generator of q's device as a tensor, which torch.compile keeps in the graph.
    return_attn_probs needs it as an int here (for flashdl.dropout_mask): the same draw
    (_torch_args.draw_seed), read back with .item(), a graph break under torch.compile
    (the probabilities are for tests, as in flash-attn)."""
    if not return_attn_probs or not isinstance(dropout_p, numbers.Real) or dropout_p <= 0:
        return None  # no dropout (or a bad dropout_p, which flashdl then reports)
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    return int(draw_seed(device).item())


def _visible(sq, sk, causal, window, device):
    """(sq, sk) bool, DESIGN.md's predicate (bottom-right aligned; causal is right = 0)."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """The key-block width of flash-attn's sm80 forward kernel (flash-attn's function of this
    name and signature, which its tests import to undo S_dmask's per-block scaling). S_dmask
    exists only with dropout, where flash-attn's widths do not depend on the GPU or on causal:
    device and is_causal are there for the signature."""
    if head_dim <= 32:
        return 128
    if head_dim <= 64:
        return 64 if is_dropout else 128
    if head_dim <= 96:
        return 64
    if head_dim <= 128:
        return 32 if is_dropout else 64
    return 64


def _attn_probs(q, k, scale, causal, window, keep, softcap=0.0, slopes=None):
    """S_dmask for one dense batch: (batch, nheads, seqlen_q, seqlen_k) in q's dtype, in the
    scaling of flash-attn's kernel, so that code written for flash-attn (its tests'
    normalize_flash_attn_S) reads it unchanged.

    s_ij is the score q_i k_j * scale after softcap and the ALiBi bias (slopes: (nheads,) or
    (batch, nheads), or None). flash-attn's kernel walks the keys in blocks of width
    W = _get_block_size_n(...) from the last block to the first and stores, for key j in block
    J, exp(s_ij - m_iJ), m_iJ the largest visible score of row i in blocks J..last: entries are
    in [0, 1], 0 where key j is invisible to query i. The probability exp(s_ij - lse_i) is that
    times exp(m_iJ - lse_i). Entries dropout dropped are negated: the sign bit (torch.signbit)
    is exactly ~flashdl.dropout_mask(...) for every entry, zeros included, and `S_dmask >= 0`
    recovers the keep-mask wherever the entry is not 0. flash-attn rounds the sequence lengths
    up to 128 and its tests crop that; here there is nothing to crop.
    Only for testing, as in flash-attn: it materialises the seqlen_q x seqlen_k matrix.
    """
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = q.shape[2] // k.shape[2]
    kk = k.to(work).repeat_interleave(group, dim=2) if group > 1 else k.to(work)
    s = torch.einsum("bihd,bjhd->bhij", q.to(work), kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    sq, sk = q.shape[1], k.shape[1]
    if slopes is not None:
        slopes = torch.as_tensor(slopes, device=q.device).to(work)
        slopes = slopes.reshape(-1, q.shape[2])[..., None, None]  # (1 or batch, nheads, 1, 1)
        i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
        j = torch.arange(sk, device=q.device)[None, :]
        s = s - slopes * (i - j).abs().to(work)
    s = s.masked_fill(~_visible(sq, sk, causal, window, q.device), -math.inf)
    width = _get_block_size_n(q.device, q.shape[3], True, causal)
    nblocks = -(-sk // width)
    blocks = torch.nn.functional.pad(s, (0, nblocks * width - sk), value=-math.inf)
    m = blocks.reshape(*s.shape[:3], nblocks, width).amax(-1)
    m = m.flip(-1).cummax(-1).values.flip(-1)  # the running max, last block first
    m = m.repeat_interleave(width, dim=-1)[..., :sk]
    # No visible key in blocks J..last: every s of block J is -inf; 0 (not -inf) keeps exp at 0.
    p = torch.exp(s - m.masked_fill(m == -math.inf, 0.0))
    keep = torch.as_tensor(keep, device=q.device)
    return torch.where(keep, p, -p).to(q.dtype)


def _slopes_row(slopes, b):
    """The slopes of sequence b: all of (nheads,) slopes, row b of (batch, nheads) ones."""
    if slopes is None or slopes.dim() != 2:
        return slopes
    return slopes[b]


def _empty_probs(q):
    # flash-attn returns torch.empty(0) for S_dmask when there is no dropout.
    return torch.empty(0, dtype=q.dtype, device=q.device)


def _dense(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
           deterministic, return_attn_probs):
    _tensors(fn, q=q, k=k, v=v)
    mods = _score_mods(softcap, alibi_slopes)
    q, k, v = (_maybe_contiguous(x) for x in (q, k, v))
    window = _window(window_size)
    seed = _seed(q, dropout_p, return_attn_probs)
    out, lse = _fdl.attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                              window_size=window, dropout_p=dropout_p, seed=seed,
                              deterministic=deterministic, return_lse=True, **mods)
    if not return_attn_probs:
        return out
    if not dropout_p > 0:
        return out, lse, _empty_probs(q)
    b, sq, h, d = q.shape
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    keep = _dropout_mask(b, h, sq, k.shape[1], dropout_p, seed)
    with torch.no_grad():
        probs = _attn_probs(q.detach(), k.detach(), scale, causal, window, keep,
                            mods["softcap"], mods["alibi_slopes"])
    return out, lse, probs


def _varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs, block_table=None, seqused_k=None):
    _tensors(fn, q=q, k=k, v=v)
    mods = _score_mods(softcap, alibi_slopes)
    q, k, v = (_maybe_contiguous(x) for x in (q, k, v))
    window = _window(window_size)
    seed = _seed(q, dropout_p, return_attn_probs)
    paged = {}
    if block_table is not None or seqused_k is not None:
        # flash-attn takes these on the GPU; flashdl checks them on the host, with the offsets.
        paged = {n: x.cpu() if isinstance(x, torch.Tensor) else x
                 for n, x in (("block_table", block_table), ("seqused_k", seqused_k))}
        cu_seqlens_q, cu_seqlens_k = (c.cpu() if isinstance(c, torch.Tensor) else c
                                      for c in (cu_seqlens_q, cu_seqlens_k))
        if return_attn_probs and dropout_p > 0:
            raise NotImplementedError("block_table: return_attn_probs with dropout and paged "
                                      "keys is not implemented (use return_attn_probs=False)")
    out, lse = _fdl.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
                                     window_size=window, dropout_p=dropout_p, seed=seed,
                                     deterministic=deterministic, return_lse=True, **mods,
                                     **paged)
    if not return_attn_probs:
        return out
    if not dropout_p > 0:
        return out, lse, _empty_probs(q)
    # Sequence b gets dense batch b's dropout mask (flashdl.attention_varlen), so its S_dmask sits
    # in the top-left corner of plane b, zeros elsewhere, as in flash-attn's layout; its key
    # blocks start at its own first key, as in flash-attn's kernel.
    cq, ck = (torch.as_tensor(c).tolist() for c in (cu_seqlens_q, cu_seqlens_k))
    batch, h, d = len(cq) - 1, q.shape[1], q.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    keep = _dropout_mask(batch, h, max_seqlen_q, max_seqlen_k, dropout_p, seed)
    probs = torch.zeros(batch, h, max_seqlen_q, max_seqlen_k, dtype=q.dtype, device=q.device)
    with torch.no_grad():
        for b in range(batch):
            sq, sk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
            probs[b, :, :sq, :sk] = _attn_probs(
                q.detach()[None, cq[b]:cq[b + 1]], k.detach()[None, ck[b]:ck[b + 1]], scale,
                causal, window, keep[b:b + 1, :, :sq, :sk], mods["softcap"],
                _slopes_row(mods["alibi_slopes"], b))[0]
    return out, lse, probs


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


@_flash_attn_errors
def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: Optional[float] = None, causal: bool = False,
                    window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[torch.Tensor] = None, deterministic: bool = False,
                    return_attn_probs: bool = False
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
        Also return ``softmax_lse`` and ``S_dmask`` (testing only; see :doc:`/migrating`).

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
    return _dense("flash_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size,
                  softcap, alibi_slopes, deterministic, return_attn_probs)


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


@_flash_attn_errors
def flash_attn_qkvpacked_func(qkv: torch.Tensor, dropout_p: float = 0.0,
                              softmax_scale: Optional[float] = None, causal: bool = False,
                              window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: Optional[torch.Tensor] = None,
                              deterministic: bool = False, return_attn_probs: bool = False
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
    return _dense(fn, qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                  window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


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


@_flash_attn_errors
def flash_attn_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, dropout_p: float = 0.0,
                             softmax_scale: Optional[float] = None, causal: bool = False,
                             window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: Optional[torch.Tensor] = None,
                             deterministic: bool = False, return_attn_probs: bool = False
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
    return _dense(fn, q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size,
                  softcap, alibi_slopes, deterministic, return_attn_probs)


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


@_flash_attn_errors
def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[torch.Tensor] = None,
                           deterministic: bool = False, return_attn_probs: bool = False,
                           block_table: Optional[torch.Tensor] = None,
                           seqused_k: Optional[torch.Tensor] = None
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
    return _varlen("flash_attn_varlen_func", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                   alibi_slopes, deterministic, return_attn_probs, block_table, seqused_k)


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


@_flash_attn_errors
def flash_attn_varlen_qkvpacked_func(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                                     dropout_p: float = 0.0,
                                     softmax_scale: Optional[float] = None, causal: bool = False,
                                     window_size: Tuple[int, int] = (-1, -1),
                                     softcap: float = 0.0,
                                     alibi_slopes: Optional[torch.Tensor] = None,
                                     deterministic: bool = False, return_attn_probs: bool = False
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
    return _varlen(fn, qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen,
                   max_seqlen, dropout_p, softmax_scale, causal, window_size, softcap,
                   alibi_slopes, deterministic, return_attn_probs)


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


@_flash_attn_errors
def flash_attn_varlen_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                                    max_seqlen_k: int, dropout_p: float = 0.0,
                                    softmax_scale: Optional[float] = None, causal: bool = False,
                                    window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes: Optional[torch.Tensor] = None,
                                    deterministic: bool = False, return_attn_probs: bool = False
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
    return _varlen(fn, q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                   alibi_slopes, deterministic, return_attn_probs)


@_flash_attn_errors
def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
                            rotary_cos: Optional[torch.Tensor] = None,
                            rotary_sin: Optional[torch.Tensor] = None,
                            cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
                            cache_batch_idx: Optional[torch.Tensor] = None,
                            cache_leftpad: Optional[torch.Tensor] = None,
                            block_table: Optional[torch.Tensor] = None,
                            softmax_scale: Optional[float] = None, causal: bool = False,
                            window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True,
                            alibi_slopes: Optional[torch.Tensor] = None, num_splits: int = 0,
                            return_softmax_lse: bool = False
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
        raise ValueError("rotary_cos: rotary embedding is given, so the new keys and values to "
                         "append to the cache (k and v) must be given too, as in flash-attn; "
                         "flashdl.attention_with_kvcache also rotates q alone")
    batch = q.shape[0]
    if cache_seqlens is None:
        cache_seqlens = torch.full((batch,), k_cache.shape[1] - (0 if k is None else k.shape[1]),
                                   dtype=torch.int32)
    elif isinstance(cache_seqlens, (numbers.Integral, bool, np.bool_)):
        cache_seqlens = torch.full((batch,), _checks.integer(
            "cache_seqlens", cache_seqlens, "an int32 tensor (batch,) or an int in [0, 2**31)",
            0, 2**31), dtype=torch.int32)
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
    rotary = {}
    if rotary_cos is not None or rotary_sin is not None:
        rotary = dict(rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                      rotary_interleaved=rotary_interleaved)
    mods = _score_mods(softcap, alibi_slopes)
    with torch.no_grad():
        return _fdl.attention_with_kvcache(
            _maybe_contiguous(q), k_cache, v_cache, cache_seqlens=cache_seqlens, k=k, v=v,
            block_table=block_table, softmax_scale=softmax_scale, causal=causal,
            window_size=_window(window_size), num_splits=num_splits,
            return_lse=return_softmax_lse, cache_batch_idx=cache_batch_idx,
            cache_leftpad=cache_leftpad, **rotary, **mods)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                unused_mask: Optional[torch.Tensor] = None
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


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int
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
