"""Ring attention (context parallelism) over torch.distributed: flashdl.torch.ring_attention.

Each of the W ranks of a process group holds a shard of the sequence. K and V travel around the
ring (rank r sends to r + 1 and receives from r - 1, batch_isend_irecv, the next block in flight
while the current one is computed); every rank attends its queries to each block with flashdl's
kernels and merges the partial results by their logsumexp (the seeds' softmax decomposition),
so the result is exact attention over the whole sequence. The backward sends K, V and float32
accumulators of their gradients around the ring; dQ stays local. Each (query chunk, key chunk)
pair is classified from its global row and column ranges under the causal mask or the sliding
window (_ring_plan): skipped when nothing in it is visible, computed unmasked when everything is,
and otherwise trimmed to its visible rows and keys and computed with flashdl's window shifted by
the chunks' offset. K and V travel only as many hops as the farthest visible pair needs.

Layouts: "contiguous" (rank r holds chunk r of W) and "zigzag" (rank r holds chunks r and
2W - 1 - r of 2W, which balances causal work); shard and unshard convert a full tensor.
"""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import _args, _checks
from ._api import attention as _attention
from ._api import attention_backward as _attention_backward
from ._ring_plan import Block, check_layout, chunks_of, global_window, last_step, pair_block
from ._torch_dist_check import (
    Agreement,
    global_rank,
    group_rank,
    require_initialized,
    torch_tensors,
)

# Bytes this process sent in its last ring_attention forward and backward (for benchmarks).
last_bytes_sent = {"forward": 0, "backward": 0}


def shard(
    x: torch.Tensor, rank: int, world_size: int, layout: str = "zigzag", dim: int = 1
) -> torch.Tensor:
    """This rank's shard of a full tensor, for :func:`ring_attention`.

    ``x`` is split along ``dim`` (the sequence) into W (``"contiguous"``) or 2W (``"zigzag"``)
    equal chunks; rank r takes chunk r, or chunks r and 2W - 1 - r concatenated.

    Parameters
    ----------
    x : torch.Tensor
        The full tensor, e.g. (batch, seqlen, nheads, headdim).
    rank : int
        This rank.
    world_size : int
        W, the number of ranks.
    layout : {"zigzag", "contiguous"}, default "zigzag"
        As in :func:`ring_attention`.
    dim : int, default 1
        The sequence axis.

    Returns
    -------
    torch.Tensor
        The shard, with ``x.shape[dim] / W`` rows along ``dim``.

    Raises
    ------
    ValueError
        A bad ``layout``, or a sequence length that does not divide evenly.

    Examples
    --------
    >>> import torch, flashdl.torch as ft
    >>> x = torch.arange(8).view(1, 8, 1, 1)
    >>> ft.ring_shard(x, 0, 2).flatten().tolist(), ft.ring_shard(x, 1, 2).flatten().tolist()
    ([0, 1, 6, 7], [2, 3, 4, 5])
    """
    check_layout(layout)
    world_size = _checks.integer("world_size", world_size, "an int >= 1 (the number of ranks)", 1)
    rank = _checks.integer(
        "rank", rank, f"an int in [0, {world_size}) (world_size {world_size})", 0, world_size
    )
    dim = _checks.integer(
        "dim", dim, f"an axis of x, in [-{x.dim()}, {x.dim()})", -x.dim(), x.dim()
    )
    parts = world_size if layout == "contiguous" else 2 * world_size
    if x.shape[dim] % parts:
        raise ValueError(
            f"x: sequence length {x.shape[dim]} (dim {dim}) must be a multiple of "
            f"{parts} for layout {layout!r} over {world_size} ranks"
        )
    pieces = x.chunk(parts, dim=dim)
    return torch.cat([pieces[c] for c in chunks_of(rank, world_size, layout)], dim=dim)


def unshard(
    local: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    layout: str = "zigzag",
    dim: int = 1,
) -> torch.Tensor:
    """The full tensor from every rank's shard, in sequence order: the inverse of :func:`ring_shard`.

    An ``all_gather`` over ``group``, so every rank of the group must call it.

    Parameters
    ----------
    local : torch.Tensor
        This rank's shard (e.g. the output of :func:`ring_attention`).
    group : torch.distributed.ProcessGroup, optional
        The group (None: the default group).
    layout : {"zigzag", "contiguous"}, default "zigzag"
        The layout the shards were made with.
    dim : int, default 1
        The sequence axis.

    Returns
    -------
    torch.Tensor
        The full tensor, W times as long along ``dim``.

    Raises
    ------
    ValueError
        A bad ``layout``.

    Examples
    --------
    Needs an initialised process group (see :func:`ring_attention`)::

        full_out = flashdl.torch.ring_unshard(out.detach())
    """
    check_layout(layout)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local.contiguous(), group=group)
    per_rank = 1 if layout == "contiguous" else 2
    pieces: List[Optional[torch.Tensor]] = [None] * (world * per_rank)
    for r, t in enumerate(gathered):
        for c, piece in zip(chunks_of(r, world, layout), t.chunk(per_rank, dim=dim)):
            pieces[c] = piece
    return torch.cat(pieces, dim=dim)  # type: ignore[arg-type]


def _merge_into(
    acc: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> None:
    """acc, acc_lse (float32) <- the merge of (acc, acc_lse) and (out, lse): the weights of
    detail::merge_weights (include/flashdl/detail/softmax.hpp), in torch ops so that it runs on
    the tensors' own device. Rows with lse -inf on both sides stay 0 / -inf."""
    m = torch.maximum(acc_lse, lse)
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    wa, wb = torch.exp(acc_lse - m_safe), torch.exp(lse - m_safe)
    total = wa + wb
    nz = total > 0
    inv = torch.where(
        nz, 1.0 / torch.where(nz, total, torch.ones_like(total)), torch.zeros_like(total)
    )
    # (b, h, s) weights against (b, s, h, d) outputs.
    wa_o, wb_o = ((w * inv).transpose(1, 2).unsqueeze(-1) for w in (wa, wb))
    acc.mul_(wa_o).add_(out.float() * wb_o)
    acc_lse.copy_(
        torch.where(
            nz,
            m_safe + torch.log(torch.where(nz, total, torch.ones_like(total))),
            torch.full_like(total, float("-inf")),
        )
    )


class _Ring:
    """One call's ring: neighbours in the group, and a step that sends tensors to the next rank
    while receiving the previous rank's into fresh buffers."""

    def __init__(self, group):
        self.group = group
        self.rank, self.world = group_rank(group)
        self.bytes_sent = 0

    def peer(self, hops: int) -> int:
        """The global rank `hops` ahead in the ring (negative: behind)."""
        return global_rank(self.group, (self.rank + hops) % self.world)

    def start(self, tensors: List[torch.Tensor], hops: int = 1):
        """Posts sends of tensors to the rank `hops` ahead and receives of same-shaped buffers
        from the rank `hops` behind; returns (requests, buffers)."""
        bufs = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.peer(hops), self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, b, self.peer(-hops), self.group) for b in bufs]
        self.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
        return dist.batch_isend_irecv(ops), bufs

    @staticmethod
    def wait(reqs):
        for req in reqs:
            req.wait()


def _split_rows(x: torch.Tensor, n: int) -> Tuple[torch.Tensor, ...]:
    return x.chunk(n, dim=1) if n > 1 else (x,)


def _split_lse(x: torch.Tensor, n: int) -> Tuple[torch.Tensor, ...]:
    return x.chunk(n, dim=2) if n > 1 else (x,)


def check_shards(q, k, v, layout: str, groups) -> None:
    """Every rank's shards have the same shape (one all_reduce per group in `groups`), of a
    length the layout's chunks divide: the same ValueError on every rank instead of a hang."""
    agree = Agreement(["q", "k"])
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        agree.fail(
            "q",
            "q: expected q (batch, s_local, nheads, headdim) and k, v "
            f"(batch, s_local, nheads_kv, headdim), got {q.dim()}-D, {k.dim()}-D, "
            f"{v.dim()}-D",
        )
    elif k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        agree.fail(
            "k",
            f"k: expected the local shard length of q, {q.shape[1]}, got "
            f"{k.shape[1]} (k) and {v.shape[1]} (v)",
        )
    elif layout == "zigzag" and q.shape[1] % 2:
        agree.fail(
            "q",
            "q: layout 'zigzag' holds two chunks per rank, so the shard length "
            f"must be even, got {q.shape[1]}",
        )
    for name, what, x in (
        ("q", "the shard length", q.shape[1]),
        ("q", "the batch", q.shape[0]),
        ("q", "nheads", q.shape[-2]),
        ("k", "nheads_kv", k.shape[-2]),
    ):
        agree.equal(name, what, x if q.dim() == 4 else -1)
    agree.settle(groups, q.device)


def _blocks(mine, theirs, c, window):
    """(query chunk slot, key chunk slot, Block) of the pairs to compute at one step."""
    for qa, a in enumerate(mine):
        for kb, b in enumerate(theirs):
            blk = pair_block(a, b, c, *window)
            if blk is not None:
                yield qa, kb, blk


def _window_of(blk: Block):
    return (-1, -1) if blk.window is None else blk.window


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, window, softmax_scale, layout):
        ring = _Ring(group)
        mine = chunks_of(ring.rank, ring.world, layout)
        n = len(mine)
        c = q.shape[1] // n
        last = last_step(ring.world, layout, c, *window)
        qs = _split_rows(q, n)
        acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        acc_lse = torch.full(
            (q.shape[0], q.shape[2], q.shape[1]),
            float("-inf"),
            dtype=torch.float32,
            device=q.device,
        )
        accs, acc_lses = _split_rows(acc, n), _split_lse(acc_lse, n)
        kv = [k, v]
        empty = [True] * n  # nothing merged into this query chunk yet: copy, do not merge
        for step in range(last + 1):
            owner = (ring.rank - step) % ring.world
            pending = ring.start(kv) if step < last else None
            ks, vs = _split_rows(kv[0], n), _split_rows(kv[1], n)
            for qa, kb, blk in _blocks(mine, chunks_of(owner, ring.world, layout), c, window):
                rows, keys = slice(blk.q0, blk.q1), slice(blk.k0, blk.k1)
                out, lse = _attention(
                    qs[qa][:, rows],
                    ks[kb][:, keys],
                    vs[kb][:, keys],
                    window_size=_window_of(blk),
                    softmax_scale=softmax_scale,
                    return_lse=True,
                )
                if empty[qa]:
                    accs[qa][:, rows].copy_(out)
                    acc_lses[qa][:, :, rows].copy_(lse)
                    empty[qa] = False
                else:
                    _merge_into(accs[qa][:, rows], acc_lses[qa][:, :, rows], out, lse)
            if pending is not None:
                reqs, bufs = pending
                _Ring.wait(reqs)
                kv = bufs
        out = acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc_lse)
        ctx.group, ctx.window, ctx.scale, ctx.layout = group, window, softmax_scale, layout
        last_bytes_sent["forward"] = ring.bytes_sent
        ctx.mark_non_differentiable(acc_lse)
        return out, acc_lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        mine = chunks_of(ring.rank, ring.world, ctx.layout)
        n = len(mine)
        c = q.shape[1] // n
        last = last_step(ring.world, ctx.layout, c, *ctx.window)
        dout = dout.contiguous()
        qs, dos, outs = _split_rows(q, n), _split_rows(dout, n), _split_rows(out, n)
        lses = _split_lse(lse, n)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dqs = _split_rows(dq, n)
        # K, V and their gradients' float32 accumulators travel together for `last` hops; then
        # the accumulators go straight back to the rank that owns the block.
        travel = [
            k,
            v,
            torch.zeros(k.shape, dtype=torch.float32, device=k.device),
            torch.zeros(v.shape, dtype=torch.float32, device=v.device),
        ]
        for step in range(last + 1):
            owner = (ring.rank - step) % ring.world
            ks, vs = _split_rows(travel[0], n), _split_rows(travel[1], n)
            dks, dvs = _split_rows(travel[2], n), _split_rows(travel[3], n)
            for qa, kb, blk in _blocks(
                mine, chunks_of(owner, ring.world, ctx.layout), c, ctx.window
            ):
                rows, keys = slice(blk.q0, blk.q1), slice(blk.k0, blk.k1)
                g_q, g_k, g_v = _attention_backward(
                    dos[qa][:, rows],
                    qs[qa][:, rows],
                    ks[kb][:, keys],
                    vs[kb][:, keys],
                    outs[qa][:, rows],
                    lses[qa][:, :, rows],
                    window_size=_window_of(blk),
                    softmax_scale=ctx.scale,
                )
                dqs[qa][:, rows].add_(g_q.float())
                dks[kb][:, keys].add_(g_k.float())
                dvs[kb][:, keys].add_(g_v.float())
            if step < last:
                reqs, travel = ring.start(travel)
                _Ring.wait(reqs)
            elif last > 0:  # home: the owner is `last` ranks behind
                reqs, bufs = ring.start(travel[2:], hops=-last)
                _Ring.wait(reqs)
                travel = travel[:2] + bufs
        last_bytes_sent["backward"] = ring.bytes_sent
        return (
            dq.to(q.dtype),
            travel[2].to(k.dtype),
            travel[3].to(v.dtype),
            None,
            None,
            None,
            None,
        )


def ring_args(fn, q, k, v, causal, softmax_scale, window_size, layout):
    """The checks of one rank's own arguments, by flashdl.attention's rules, before any
    collective: (global window, softmax_scale)."""
    torch_tensors(fn, q=q, k=k, v=v)
    check_layout(layout)
    _, softmax_scale, _, _ = _args.scalars(False, softmax_scale, "auto", (-1, -1))
    return global_window(causal, window_size), softmax_scale


def ring_apply(q, k, v, group, window, softmax_scale, layout):
    """The differentiable ring over `group` (arguments checked by ring_args) after the checks
    every rank agrees on: (out, lse)."""
    group_rank(group)
    check_shards(q, k, v, layout, [group])
    return RingAttention.apply(q, k, v, group, window, softmax_scale, layout)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: Tuple[int, int] = (-1, -1),
    layout: str = "zigzag",
    return_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact attention over a sequence sharded across the ranks of a torch.distributed group.

    Ring attention (context parallelism), differentiable with respect to q, k and v. K and V travel
    around the ring (``batch_isend_irecv``, the next block in flight while the current one is
    computed), partial results merge by their lse; the backward sends K, V and float32 gradient
    accumulators around while dQ stays local. Each pair of (query chunk, key chunk) is classified
    by its global positions: skipped when the causal mask or the window hides all of it,
    computed without a mask when all of it is visible, and otherwise trimmed to its visible rows
    and keys and computed with flashdl's window shifted by the chunks' offset. K and V travel only
    as far as the farthest visible pair (a window narrower than a chunk, contiguous layout: one
    hop).

    Parameters
    ----------
    q : torch.Tensor (batch, s_local, nheads, headdim)
        This rank's shard of the queries (:func:`ring_shard` makes it from the full tensor).
    k, v : torch.Tensor (batch, s_local, nheads_kv, headdim)
        This rank's shards of the keys and values. Every rank must pass shards of the same length.
    group : torch.distributed.ProcessGroup, optional
        The group (None: the default group).
    causal : bool, default False
        Causal over global positions.
    softmax_scale : float, optional
        None is ``1 / sqrt(headdim)``.
    window_size : (int, int), default (-1, -1)
        Sliding window over global positions: key j is visible to query i iff
        ``i - left <= j <= i + right`` (-1: unbounded); with ``causal=True`` right is 0.
    layout : {"zigzag", "contiguous"}, default "zigzag"
        How the sequence is sharded: ``"zigzag"`` (rank r holds chunks r and 2W - 1 - r of 2W)
        balances causal work; ``"contiguous"`` gives rank r the r-th slice.
    return_lse : bool, default False
        Also return the float32 lse (batch, nheads, s_local), without gradient.

    Returns
    -------
    out : torch.Tensor (batch, s_local, nheads, headdim)
        This rank's rows of attention over the whole sequence (a row that sees no key: 0).
    lse : torch.Tensor, float32 (batch, nheads, s_local)
        With ``return_lse=True``.

    Raises
    ------
    RuntimeError
        torch.distributed is not initialised.
    ValueError
        A bad ``layout`` or ``window_size``, a ``group`` this process is not in, or shards of
        different shapes across ranks or of a length the layout cannot split (raised on every
        rank of the group).
    TypeError
        A ``window_size`` that is not a pair of ints.

    Notes
    -----
    Works with any backend torch.distributed offers for the tensors' device: gloo for CPU tensors
    (tested with 2-4 processes), NCCL for CUDA ones (not yet run). It needs several processes, so
    the example is not run here; launch with ``torchrun --nproc-per-node 2 script.py``:

    .. code-block:: python

        import torch, torch.distributed as dist, flashdl.torch as ft
        dist.init_process_group("gloo")
        r, W = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        q_full, k_full, v_full = (torch.randn(1, 1024, 8, 64) for _ in range(3))
        q, k, v = (ft.ring_shard(x, r, W).requires_grad_() for x in (q_full, k_full, v_full))
        out = ft.ring_attention(q, k, v, causal=True)        # this rank's rows
        out.sum().backward()
        out = ft.ring_attention(q, k, v, causal=True, window_size=(128, 0))  # sliding window
    """
    return_lse = _checks.flag("return_lse", return_lse)
    window, softmax_scale = ring_args(
        "ring_attention", q, k, v, causal, softmax_scale, window_size, layout
    )
    require_initialized()
    out, lse = ring_apply(q, k, v, group, window, softmax_scale, layout)
    return (out, lse) if return_lse else out
