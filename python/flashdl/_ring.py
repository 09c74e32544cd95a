"""Ring attention (context parallelism) over torch.distributed: flashdl.torch.ring_attention.

Each of the W ranks of a process group holds a shard of the sequence. K and V travel around the
ring (rank r sends to r + 1 and receives from r - 1, batch_isend_irecv, the next block in flight
while the current one is computed); every rank attends its queries to each block with flashdl's
kernels and merges the partial results by their logsumexp (the seeds' softmax decomposition),
so the result is exact attention over the whole sequence. The backward sends K, V and float32
accumulators of their gradients around the ring; dQ stays local. Each (query chunk, key chunk)
pair is skipped when causality hides it, computed unmasked when it is fully visible, and with
flashdl's causal mask on the diagonal (chunks of equal length, so bottom-right alignment is the
global one).

Layouts: "contiguous" (rank r holds chunk r of W) and "zigzag" (rank r holds chunks r and
2W - 1 - r of 2W, which balances causal work); shard and unshard convert a full tensor.
"""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ._api import attention as _attention
from ._api import attention_backward as _attention_backward

LAYOUTS = ("zigzag", "contiguous")

# Bytes this process sent in its last ring_attention forward and backward (for benchmarks).
last_bytes_sent = {"forward": 0, "backward": 0}


def _chunks_of(rank: int, world: int, layout: str) -> List[int]:
    """The global chunk indices rank holds, in order: chunks of s / W (contiguous) or of
    s / 2W (zigzag) rows."""
    return [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected 'zigzag' or 'contiguous', got {layout!r}")


def shard(x: torch.Tensor, rank: int, world_size: int, layout: str = "zigzag",
          dim: int = 1) -> torch.Tensor:
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
    _check_layout(layout)
    parts = world_size if layout == "contiguous" else 2 * world_size
    if x.shape[dim] % parts:
        raise ValueError(f"x: sequence length {x.shape[dim]} (dim {dim}) must be a multiple of "
                         f"{parts} for layout {layout!r} over {world_size} ranks")
    pieces = x.chunk(parts, dim=dim)
    return torch.cat([pieces[c] for c in _chunks_of(rank, world_size, layout)], dim=dim)


def unshard(local: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
            layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
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
    _check_layout(layout)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local.contiguous(), group=group)
    per_rank = 1 if layout == "contiguous" else 2
    pieces: List[Optional[torch.Tensor]] = [None] * (world * per_rank)
    for r, t in enumerate(gathered):
        for c, piece in zip(_chunks_of(r, world, layout), t.chunk(per_rank, dim=dim)):
            pieces[c] = piece
    return torch.cat(pieces, dim=dim)  # type: ignore[arg-type]


def _visibility(qc: int, kc: int, causal: bool) -> Optional[bool]:
    """How query chunk qc sees key chunk kc: None (not at all), False (fully: no mask), True
    (the diagonal: flashdl's causal mask)."""
    if not causal or kc < qc:
        return False
    return True if kc == qc else None


def _merge_into(acc: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor) -> None:
    """acc, acc_lse (float32) <- the merge of (acc, acc_lse) and (out, lse): the weights of
    detail::merge_weights (include/flashdl/detail/softmax.hpp), in torch ops so that it runs on
    the tensors' own device. Rows with lse -inf on both sides stay 0 / -inf."""
    m = torch.maximum(acc_lse, lse)
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    wa, wb = torch.exp(acc_lse - m_safe), torch.exp(lse - m_safe)
    total = wa + wb
    nz = total > 0
    inv = torch.where(nz, 1.0 / torch.where(nz, total, torch.ones_like(total)),
                      torch.zeros_like(total))
    # (b, h, s) weights against (b, s, h, d) outputs.
    wa_o, wb_o = ((w * inv).transpose(1, 2).unsqueeze(-1) for w in (wa, wb))
    acc.mul_(wa_o).add_(out.float() * wb_o)
    acc_lse.copy_(torch.where(nz, m_safe + torch.log(torch.where(nz, total,
                                                                 torch.ones_like(total))),
                              torch.full_like(total, float("-inf"))))


class _Ring:
    """One call's ring: neighbours in the group, and a step that sends tensors to the next rank
    while receiving the previous rank's into fresh buffers."""

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        to_global = (lambda r: r) if group is None else (
            lambda r: dist.get_global_rank(group, r))
        self.next = to_global((self.rank + 1) % self.world)
        self.prev = to_global((self.rank - 1) % self.world)
        self.bytes_sent = 0

    def start(self, tensors: List[torch.Tensor]):
        """Posts sends of tensors to the next rank and receives of same-shaped buffers from the
        previous one; returns (requests, buffers)."""
        bufs = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, b, self.prev, self.group) for b in bufs]
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


def _check_shards(q, k, v, ring: _Ring, layout: str):
    """Every rank's shards have the same shape (all_reduce of the lengths), divisible into the
    layout's chunks: a clear error instead of a hang or a wrong answer."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q: expected q (batch, s_local, nheads, headdim) and k, v "
                         "(batch, s_local, nheads_kv, headdim)")
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError(f"k: expected the local shard length of q, {q.shape[1]}, got "
                         f"{k.shape[1]} (k) and {v.shape[1]} (v)")
    sizes = torch.tensor([q.shape[1], -q.shape[1]], dtype=torch.int64)
    if q.device.type == "cuda":
        sizes = sizes.to(q.device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=ring.group)
    longest, shortest = int(sizes[0]), -int(sizes[1])
    if longest != shortest:
        raise ValueError(f"q: shard lengths differ across ranks (from {shortest} to {longest}); "
                         "ring_attention needs equal shards (pad the sequence to a multiple of "
                         "the layout's chunk count, see flashdl.torch.ring_shard)")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"q: layout 'zigzag' holds two chunks per rank, so the shard length "
                         f"must be even, got {q.shape[1]}")


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, softmax_scale, layout):
        ring = _Ring(group)
        _check_shards(q, k, v, ring, layout)
        mine = _chunks_of(ring.rank, ring.world, layout)
        n = len(mine)
        qs = _split_rows(q, n)
        acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        acc_lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"),
                             dtype=torch.float32, device=q.device)
        accs, acc_lses = _split_rows(acc, n), _split_lse(acc_lse, n)
        kv = [k, v]
        for step in range(ring.world):
            owner = (ring.rank - step) % ring.world
            reqs = bufs = None
            if step + 1 < ring.world:
                reqs, bufs = ring.start(kv)
            ks, vs = _split_rows(kv[0], n), _split_rows(kv[1], n)
            for a, qa in zip(mine, range(n)):
                for b, kb in zip(_chunks_of(owner, ring.world, layout), range(n)):
                    seen = _visibility(a, b, causal)
                    if seen is None:
                        continue
                    out, lse = _attention(qs[qa], ks[kb], vs[kb], causal=seen,
                                          softmax_scale=softmax_scale, return_lse=True)
                    _merge_into(accs[qa], acc_lses[qa], out, lse)
            if reqs is not None:
                _Ring.wait(reqs)
                kv = bufs
        out = acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc_lse)
        ctx.group, ctx.causal, ctx.scale, ctx.layout = group, causal, softmax_scale, layout
        last_bytes_sent["forward"] = ring.bytes_sent
        ctx.mark_non_differentiable(acc_lse)
        return out, acc_lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        mine = _chunks_of(ring.rank, ring.world, ctx.layout)
        n = len(mine)
        dout = dout.contiguous()
        qs, dos, outs = _split_rows(q, n), _split_rows(dout, n), _split_rows(out, n)
        lses = _split_lse(lse, n)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dqs = _split_rows(dq, n)
        # K, V and their gradients' float32 accumulators travel together; after W hops the
        # accumulators are back with the rank that owns the block.
        travel = [k, v, torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                  torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
        for step in range(ring.world):
            owner = (ring.rank - step) % ring.world
            ks, vs = _split_rows(travel[0], n), _split_rows(travel[1], n)
            dks, dvs = _split_rows(travel[2], n), _split_rows(travel[3], n)
            for a, qa in zip(mine, range(n)):
                for b, kb in zip(_chunks_of(owner, ring.world, ctx.layout), range(n)):
                    seen = _visibility(a, b, ctx.causal)
                    if seen is None:
                        continue
                    g_q, g_k, g_v = _attention_backward(dos[qa], qs[qa], ks[kb], vs[kb],
                                                        outs[qa], lses[qa], causal=seen,
                                                        softmax_scale=ctx.scale)
                    dqs[qa].add_(g_q.float())
                    dks[kb].add_(g_k.float())
                    dvs[kb].add_(g_v.float())
            if ring.world == 1:
                break
            # Send on: K, V for the next step (not after the last), the accumulators always.
            sending = travel if step + 1 < ring.world else travel[2:]
            reqs, bufs = ring.start(sending)
            _Ring.wait(reqs)
            travel = bufs if step + 1 < ring.world else travel[:2] + bufs
        last_bytes_sent["backward"] = ring.bytes_sent
        return (dq.to(q.dtype), travel[2].to(k.dtype), travel[3].to(v.dtype), None, None, None,
                None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                   group: Optional[dist.ProcessGroup] = None, causal: bool = False,
                   softmax_scale: Optional[float] = None,
                   window_size: Tuple[int, int] = (-1, -1), layout: str = "zigzag",
                   return_lse: bool = False
                   ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact attention over a sequence sharded across the ranks of a torch.distributed group.

    Ring attention (context parallelism), differentiable with respect to q, k and v. K and V travel
    around the ring (``batch_isend_irecv``, the next block in flight while the current one is
    computed), partial results merge by their lse; the backward sends K, V and float32 gradient
    accumulators around while dQ stays local. Causal pairs of chunks are skipped or computed without
    a mask where they can be.

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
        Only ``(-1, -1)`` is supported so far.
    layout : {"zigzag", "contiguous"}, default "zigzag"
        How the sequence is sharded: ``"zigzag"`` (rank r holds chunks r and 2W - 1 - r of 2W)
        balances causal work; ``"contiguous"`` gives rank r the r-th slice.
    return_lse : bool, default False
        Also return the float32 lse (batch, nheads, s_local), without gradient.

    Returns
    -------
    out : torch.Tensor (batch, s_local, nheads, headdim)
        This rank's rows of attention over the whole sequence.
    lse : torch.Tensor, float32 (batch, nheads, s_local)
        With ``return_lse=True``.

    Raises
    ------
    NotImplementedError
        ``window_size`` other than ``(-1, -1)``.
    RuntimeError
        torch.distributed is not initialised.
    ValueError
        A bad ``layout``, or shards of different lengths across ranks (raised on every rank).

    Notes
    -----
    Works with any backend torch.distributed offers for the tensors' device: gloo for CPU tensors
    (tested with 2-4 processes), NCCL for CUDA ones (not yet run). It needs several processes, so
    the example is not run here; launch with ``torchrun --nproc-per-node 2 script.py``::

        import torch, torch.distributed as dist, flashdl.torch as ft
        dist.init_process_group("gloo")
        r, W = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        q_full, k_full, v_full = (torch.randn(1, 1024, 8, 64) for _ in range(3))
        q, k, v = (ft.ring_shard(x, r, W).requires_grad_() for x in (q_full, k_full, v_full))
        out = ft.ring_attention(q, k, v, causal=True)        # this rank's rows
        out.sum().backward()
    """
    _check_layout(layout)
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError("window_size: ring_attention supports only (-1, -1) so far "
                                  f"(got {tuple(window_size)})")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("group: torch.distributed is not initialised "
                           "(call torch.distributed.init_process_group first)")
    out, lse = _RingAttention.apply(q, k, v, group, bool(causal), softmax_scale, layout)
    return (out, lse) if return_lse else out
