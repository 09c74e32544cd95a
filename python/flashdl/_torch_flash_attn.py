"""The flash-attn drop-in's work below its public functions (flashdl.flash_attn): argument checks
worded as flash-attn's, the dense and varlen calls over flashdl.torch, and S_dmask, the attention
probabilities in the scaling of flash-attn's kernel that return_attn_probs=True returns.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple, TypeVar, Union

import torch

from . import _checks
from . import torch as _fdl
from ._api import dropout_mask as _dropout_mask
from ._frameworks import type_name
from ._torch_args import draw_seed

# return_attn_probs=True: (out, softmax_lse, S_dmask); False: out alone.
WithProbs = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]
OutOrProbs = Union[torch.Tensor, WithProbs]


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

    __module__ = "flashdl.flash_attn"  # (its public name)


_F = TypeVar("_F", bound=Callable[..., Any])


def flash_attn_errors(fn: _F) -> _F:
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


def maybe_contiguous(x):
    # flash-attn copies a tensor whose last dimension is strided; flashdl requires stride 1 there.
    return x.contiguous() if isinstance(x, torch.Tensor) and x.stride(-1) != 1 else x


# flashdl's own entry point for each drop-in, named when an array is not a torch tensor.
NATIVE = {
    "flash_attn_func": "flashdl.attention",
    "flash_attn_kvpacked_func": "flashdl.attention",
    "flash_attn_qkvpacked_func": "flashdl.attention",
    "flash_attn_varlen_func": "flashdl.attention_varlen",
    "flash_attn_varlen_kvpacked_func": "flashdl.attention_varlen",
    "flash_attn_varlen_qkvpacked_func": "flashdl.attention_varlen",
    "flash_attn_with_kvcache": "flashdl.attention_with_kvcache",
}


def check_tensors(fn, **arrays):
    """TypeError naming the first of arrays that is not a torch.Tensor: flash-attn's functions
    take torch tensors; flashdl's own (named) take NumPy, JAX and CuPy arrays too."""
    for name, x in arrays.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"{name}: {fn} takes torch tensors (as flash-attn), got "
                f"{type_name(x)}; "
                f"use {NATIVE[fn]} for NumPy, JAX or CuPy arrays"
            )


def score_mods(softcap, alibi_slopes):
    """flashdl's softcap and alibi_slopes keywords for flash-attn's arguments."""
    softcap = _checks.finite(
        "softcap", _checks.real("softcap", softcap, "a float"), "a finite float (<= 0: off)"
    )
    # flash-attn's kernel treats softcap <= 0 as off; flashdl takes 0 for that.
    return dict(softcap=softcap if softcap > 0 else 0.0, alibi_slopes=alibi_slopes)


def check_packed(fn, name, x, axis, n, layout):
    """Refuses a packed tensor whose packing axis is not n long (it would otherwise be sliced)."""
    shape = tuple(getattr(x, "shape", ()))
    check_tensors(fn, **{name: x})
    if len(shape) != len(layout.split(",")) or shape[axis] != n:
        raise ValueError(f"{name}: expected shape {layout} with {n} on axis {axis}, got {shape}")


def window_pair(window_size):
    # flash-attn's kernel treats any negative side as unbounded; flashdl takes only -1 for that.
    # Anything that is not a pair of ints is left for flashdl's own error (naming window_size).
    try:
        left, right = window_size
        return (-1 if left < -1 else left, -1 if right < -1 else right)
    except (TypeError, ValueError):
        return window_size


def seed_for(q, dropout_p, return_attn_probs):
    """The dropout seed: None (no dropout, or without return_attn_probs) lets flashdl.torch draw
    it from the generator of q's device as a tensor, which torch.compile keeps in the graph.
    return_attn_probs needs it as an int here (for flashdl.dropout_mask): the same draw
    (_torch_args.draw_seed), read back with .item(), a graph break under torch.compile
    (the probabilities are for tests, as in flash-attn)."""
    if not return_attn_probs or not isinstance(dropout_p, numbers.Real) or dropout_p <= 0:
        return None  # no dropout (or a bad dropout_p, which flashdl then reports)
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    return int(draw_seed(device).item())


def visible(sq, sk, causal, window, device):
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


def get_block_size_n(device, head_dim, is_dropout, is_causal):
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


def attn_probs(q, k, scale, causal, window, keep, softcap=0.0, slopes=None):
    """S_dmask for one dense batch: (batch, nheads, seqlen_q, seqlen_k) in q's dtype, in the
    scaling of flash-attn's kernel, so that code written for flash-attn (its tests'
    normalize_flash_attn_S) reads it unchanged.

    s_ij is the score q_i k_j * scale after softcap and the ALiBi bias (slopes: (nheads,) or
    (batch, nheads), or None). flash-attn's kernel walks the keys in blocks of width
    W = get_block_size_n(...) from the last block to the first and stores, for key j in block
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
    s = s.masked_fill(~visible(sq, sk, causal, window, q.device), -math.inf)
    width = get_block_size_n(q.device, q.shape[3], True, causal)
    nblocks = -(-sk // width)
    blocks = torch.nn.functional.pad(s, (0, nblocks * width - sk), value=-math.inf)
    m = blocks.reshape(*s.shape[:3], nblocks, width).amax(-1)
    m = m.flip(-1).cummax(-1).values.flip(-1)  # the running max, last block first
    m = m.repeat_interleave(width, dim=-1)[..., :sk]
    # No visible key in blocks J..last: every s of block J is -inf; 0 (not -inf) keeps exp at 0.
    p = torch.exp(s - m.masked_fill(m == -math.inf, 0.0))
    keep = torch.as_tensor(keep, device=q.device)
    return torch.where(keep, p, -p).to(q.dtype)


def slopes_row(slopes, b):
    """The slopes of sequence b: all of (nheads,) slopes, row b of (batch, nheads) ones."""
    if slopes is None or slopes.dim() != 2:
        return slopes
    return slopes[b]


def empty_probs(q):
    # flash-attn returns torch.empty(0) for S_dmask when there is no dropout.
    return torch.empty(0, dtype=q.dtype, device=q.device)


class Options(NamedTuple):
    """flash-attn's options after the arrays, in the order its functions take them."""

    dropout_p: float
    softmax_scale: Optional[float]
    causal: bool
    window_size: Tuple[int, int]
    softcap: float
    alibi_slopes: Optional[torch.Tensor]
    deterministic: bool
    return_attn_probs: bool


def _prepare(fn, q, k, v, o: Options):
    """What the dense and varlen calls share before flashdl.torch: q, k and v checked and made
    contiguous where flash-attn would copy them, and flashdl.torch's keywords for the options
    (return_lse=True: flash-attn's results with return_attn_probs need lse)."""
    check_tensors(fn, q=q, k=k, v=v)
    mods = score_mods(o.softcap, o.alibi_slopes)
    q, k, v = (maybe_contiguous(x) for x in (q, k, v))
    keywords: Dict[str, Any] = dict(
        causal=o.causal,
        softmax_scale=o.softmax_scale,
        window_size=window_pair(o.window_size),
        dropout_p=o.dropout_p,
        seed=seed_for(q, o.dropout_p, o.return_attn_probs),
        deterministic=o.deterministic,
        return_lse=True,
        **mods,
    )
    return q, k, v, keywords


def _probs_args(kw, headdim):
    """attn_probs' arguments after q, k and keep for flashdl.torch's keywords kw: the scale
    (1/sqrt(headdim) where None), causal, the window, softcap and the slopes."""
    scale = kw["softmax_scale"]
    scale = 1.0 / math.sqrt(headdim) if scale is None else float(scale)
    return scale, kw["causal"], kw["window_size"], kw["softcap"], kw["alibi_slopes"]


def dense(fn, q, k, v, *options):
    """flash_attn_func and its packed forms over flashdl.torch.attention; options: Options."""
    o = Options(*options)
    q, k, v, kw = _prepare(fn, q, k, v, o)
    out, lse = _fdl.attention(q, k, v, **kw)
    if not o.return_attn_probs:
        return out
    if not o.dropout_p > 0:
        return out, lse, empty_probs(q)
    b, sq, h, d = q.shape
    scale, causal, window, softcap, slopes = _probs_args(kw, d)
    keep = _dropout_mask(b, h, sq, k.shape[1], o.dropout_p, kw["seed"])
    with torch.no_grad():
        probs = attn_probs(q.detach(), k.detach(), scale, causal, window, keep, softcap, slopes)
    return out, lse, probs


def varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *options, **paged):
    """flash_attn_varlen_func and its packed forms over flashdl.torch.attention_varlen; options:
    Options; paged: block_table and seqused_k (flash_attn_varlen_func's)."""
    o = Options(*options)
    q, k, v, kw = _prepare(fn, q, k, v, o)
    if any(x is not None for x in paged.values()):
        # flash-attn takes these on the GPU; flashdl checks them on the host, with the offsets.
        kw.update((n, x.cpu() if isinstance(x, torch.Tensor) else x) for n, x in paged.items())
        cu_seqlens_q, cu_seqlens_k = (
            c.cpu() if isinstance(c, torch.Tensor) else c for c in (cu_seqlens_q, cu_seqlens_k)
        )
        if o.return_attn_probs and o.dropout_p > 0:
            raise NotImplementedError(
                "block_table: return_attn_probs with dropout and paged "
                "keys is not implemented (use return_attn_probs=False)"
            )
    out, lse = _fdl.attention_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw
    )
    if not o.return_attn_probs:
        return out
    if not o.dropout_p > 0:
        return out, lse, empty_probs(q)
    # Sequence b gets dense batch b's dropout mask (flashdl.attention_varlen), so its S_dmask sits
    # in the top-left corner of plane b, zeros elsewhere, as in flash-attn's layout; its key
    # blocks start at its own first key, as in flash-attn's kernel.
    cq, ck = (torch.as_tensor(c).tolist() for c in (cu_seqlens_q, cu_seqlens_k))
    batch, h, d = len(cq) - 1, q.shape[1], q.shape[2]
    scale, causal, window, softcap, slopes = _probs_args(kw, d)
    keep = _dropout_mask(batch, h, max_seqlen_q, max_seqlen_k, o.dropout_p, kw["seed"])
    probs = torch.zeros(batch, h, max_seqlen_q, max_seqlen_k, dtype=q.dtype, device=q.device)
    with torch.no_grad():
        for b in range(batch):
            sq, sk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
            probs[b, :, :sq, :sk] = attn_probs(
                q.detach()[None, cq[b] : cq[b + 1]],
                k.detach()[None, ck[b] : ck[b + 1]],
                scale,
                causal,
                window,
                keep[b : b + 1, :, :sq, :sk],
                softcap,
                slopes_row(slopes, b),
            )[0]
    return out, lse, probs
