"""Ulysses (all-to-all) context parallelism over torch.distributed:
flashdl.torch.ulysses_attention.

Each of the W ranks of a group holds a contiguous slice of the sequence with every head. One
all-to-all per tensor (DeepSpeed-Ulysses) turns that into the whole sequence for H / W of the
heads; flashdl attends locally over the whole sequence with every feature of a single-process
call; a last all-to-all turns the output back into sequence slices. The all-to-all is its own
inverse with the two axes swapped, which is its autograd rule.

Dropout: flashdl's mask is keyed by (seed, offset, batch * nheads + head, row, col). A rank runs
H / W heads, so its head index must be shifted by r H / W. The local call is made varlen over a
virtual batch of B W sequences of which only b W + r is non-empty: sequence b W + r of a call
with H / W heads gets the counter (b W + r) H / W + h = b H + (r H / W + h), exactly the
single-process key of batch b and global head r H / W + h; rows and columns are the sequence's
own. So the mask equals the single-process one bit for bit.
"""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import _args, _checks
from ._ring_plan import global_window
from ._torch_attention import attention, attention_varlen
from ._torch_dist_check import (
    Agreement,
    global_rank,
    group_rank,
    require_initialized,
    torch_tensors,
)

# Bytes this process sent in the all-to-alls of its last ulysses_attention (or
# context_parallel_attention) call: the forward's (q, k, v, out), the backward's once it has run
# (dout, dq, dk, dv), and return_lse's.
last_bytes_sent = {"forward": 0, "backward": 0, "lse": 0}


# Backends found without an all-to-all (torch's gloo before 2.12: "Backend gloo does not support
# alltoall"): their exchanges go by point-to-point sends and receives instead.
_NO_ALL_TO_ALL: set = set()


def _exchange(recv: List[torch.Tensor], send: List[torch.Tensor], group, rank: int) -> None:
    """recv[j] <- rank j's send[rank], for every j: dist.all_to_all, or, on a backend without it,
    one batch of isend/irecv pairs (the same bytes on the wire)."""
    backend = str(dist.get_backend(group))
    if backend not in _NO_ALL_TO_ALL:
        try:
            dist.all_to_all(recv, send, group=group)
            return
        except RuntimeError as e:
            if "alltoall" not in str(e).replace("_", "").lower():
                raise
            _NO_ALL_TO_ALL.add(backend)
    ops = []
    for j in range(len(send)):
        if j == rank:
            recv[j].copy_(send[j])
            continue
        peer = global_rank(group, j)
        ops.append(dist.P2POp(dist.isend, send[j], peer, group))
        ops.append(dist.P2POp(dist.irecv, recv[j], peer, group))
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _all_to_all(x: torch.Tensor, group, scatter: int, gather: int, tally: str) -> torch.Tensor:
    """Chunk j of x along `scatter` goes to rank j; the chunks received are concatenated along
    `gather` in rank order."""
    rank, world = group_rank(group)
    if world == 1:
        return x
    send = [c.contiguous() for c in x.chunk(world, dim=scatter)]
    recv = [torch.empty_like(c) for c in send]
    _exchange(recv, send, group, rank)
    last_bytes_sent[tally] += sum(
        c.numel() * c.element_size() for j, c in enumerate(send) if j != rank
    )
    return torch.cat(recv, dim=gather)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter, gather):
        ctx.group, ctx.scatter, ctx.gather = group, scatter, gather
        return _all_to_all(x, group, scatter, gather, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.gather, ctx.scatter, "backward"), None, None, None


def check_heads(agree: Agreement, nheads: int, nheads_kv: int, world: int) -> None:
    """Heads the group can split: nheads by W, and nheads_kv either split too or fewer than W
    and dividing it (each rank then gets the one kv head its query heads read)."""
    if nheads % world:
        agree.fail(
            "q",
            f"q: nheads ({nheads}) must be a multiple of the group size ({world}) "
            "to split the heads across its ranks",
        )
    elif nheads_kv % world and world % nheads_kv:
        agree.fail(
            "k",
            f"k: nheads_kv ({nheads_kv}) must be a multiple or a divisor of the "
            f"group size ({world})",
        )


def to_heads(q, k, v, group, seq_dim: int) -> Tuple[torch.Tensor, ...]:
    """Sequence-sharded (…, s_local, nheads, d) to head-sharded (…, W s_local, nheads / W, d);
    kv heads fewer than the ranks are first repeated so that each rank gets the one its query
    heads read."""
    world = dist.get_world_size(group)
    head_dim = seq_dim + 1
    hk = k.shape[head_dim]
    if hk % world:
        k, v = (x.repeat_interleave(world // hk, dim=head_dim) for x in (k, v))
    return tuple(_AllToAll.apply(x, group, head_dim, seq_dim) for x in (q, k, v))


def to_sequence(out: torch.Tensor, group, seq_dim: int) -> torch.Tensor:
    """The inverse of :func:`to_heads` for one tensor."""
    return _AllToAll.apply(out, group, seq_dim, seq_dim + 1)


def lse_to_sequence(lse: torch.Tensor, group, varlen: bool) -> torch.Tensor:
    """lse of the local heads over the whole sequence, (b, h / W, s) or (h / W, total), to every
    head over this rank's rows, (b, h, s_local) or (h, total_local); no gradient."""
    head, seq = (0, 1) if varlen else (1, 2)
    return _all_to_all(lse, group, seq, head, "lse")


def _heads_of(x, rank: int, world: int, nheads: int, batched_dims: int, virtual: bool):
    """This rank's part of a per-head array: ALiBi slopes (nheads,) or (batch, nheads)
    (batched_dims 2), a block mask (nbq, nbk) or (batch, nheads, nbq, nbk) (batched_dims 4), a
    heads axis of size 1 or nbq, nbk alone being shared. With the virtual batch of the dropout
    path, batch planes are repeated W times (plane b lands on sequence b W + r)."""
    if not isinstance(x, torch.Tensor):
        return x
    head_axis = x.dim() - 1 if batched_dims == 2 else (1 if x.dim() == 4 else None)
    if head_axis is not None and x.shape[head_axis] == nheads:
        per = nheads // world
        x = x.narrow(head_axis, rank * per, per)
    if virtual and x.dim() == batched_dims and x.shape[0] > 1:
        x = x.repeat_interleave(world, dim=0)
    return x


def _virtual_cu(cu: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Cumulative lengths of the virtual batch: sequence b W + r has sequence b's length, the
    others none."""
    lengths = torch.diff(cu.to(torch.int64))
    virtual = torch.zeros(lengths.numel() * world, dtype=torch.int64, device=cu.device)
    virtual[rank::world] = lengths
    return torch.cat([virtual.new_zeros(1), virtual.cumsum(0)]).to(torch.int32)


def _validate(q, k, v, group, varlen, cu_q, cu_k) -> Tuple[Agreement, int, int]:
    rank, world = group_rank(group)
    agree = Agreement(["q", "k", "cu_seqlens_q", "cu_seqlens_k"])
    dims = 3 if varlen else 4
    if q.dim() != dims or k.dim() != dims or v.dim() != dims:
        shape = "(total_local, nheads, headdim)" if varlen else "(batch, s_local, nheads, headdim)"
        agree.fail(
            "q",
            f"q: expected q, k and v of {dims} dimensions {shape}, got "
            f"{q.dim()}, {k.dim()}, {v.dim()}",
        )
    elif k.shape[:-2] != v.shape[:-2]:
        agree.fail(
            "k",
            f"k: expected k and v of the same length, got {tuple(k.shape)} and {tuple(v.shape)}",
        )
    else:
        check_heads(agree, q.shape[-2], k.shape[-2], world)
        if varlen:
            for name, cu, x in (("cu_seqlens_q", cu_q, q), ("cu_seqlens_k", cu_k, k)):
                total = int(cu[-1]) if cu.numel() else -1
                if total != world * x.shape[0]:
                    agree.fail(
                        name,
                        f"{name}: the sequences end at {total}, expected "
                        f"{world} ranks x {x.shape[0]} local rows",
                    )
    seq = 0 if varlen else 1
    for name, what, x in (
        ("q", "the shard length of q", q.shape[seq] if q.dim() > seq else 0),
        ("k", "the shard length of k", k.shape[seq] if k.dim() > seq else 0),
        ("q", "nheads", q.shape[-2]),
        ("k", "nheads_kv", k.shape[-2]),
        ("q", "headdim", q.shape[-1]),
        ("q", "batch", q.shape[0]),
    ):
        agree.equal(name, what, x)
    return agree, rank, world


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: Tuple[int, int] = (-1, -1),
    dropout_p: float = 0.0,
    seed: Optional[int] = None,
    offset: int = 0,
    alibi_slopes: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
    block_mask: Optional[torch.Tensor] = None,
    block_size: Union[int, Tuple[int, int]] = 128,
    schedule: str = "auto",
    deterministic: bool = False,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    return_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact attention over a sequence sharded across a group, by all-to-all over the heads.

    DeepSpeed-Ulysses context parallelism, differentiable with respect to q, k and v: an
    all-to-all gives each of the W ranks the whole sequence for ``nheads / W`` heads, flashdl
    attends locally (so every option of :func:`attention` works as in one process), and an
    all-to-all returns the output to sequence slices. Each rank sends ``(W - 1) / W`` of each of
    q, k, v and out in the forward.

    Parameters
    ----------
    q : torch.Tensor (batch, s_local, nheads, headdim), or (total_local, nheads, headdim) packed
        This rank's contiguous slice of the sequence (rank r holds rows ``[r s_local, (r + 1)
        s_local)``; ``ring_shard(x, r, W, layout="contiguous")`` makes it). ``nheads`` must be a
        multiple of W. Packed (varlen) sequences are sliced the same way over the total length,
        regardless of where sequences begin and end.
    k, v : torch.Tensor (batch, s_local_k, nheads_kv, headdim), or (total_local_k, ...) packed
        ``nheads_kv`` a multiple of W, or a divisor of W (kv heads are then repeated so that each
        rank gets the one its query heads read; their gradients are summed back).
    group : torch.distributed.ProcessGroup, optional
        The group (None: the default group).
    causal, softmax_scale, window_size, softcap, schedule, deterministic : optional
        As in :func:`attention`, over global positions.
    alibi_slopes, block_mask, block_size : optional
        As in :func:`attention`, over global positions and global heads: ``alibi_slopes``
        (nheads,) or (batch, nheads) and a ``block_mask`` with a heads axis hold every head (each
        rank takes its own).
    dropout_p, seed, offset : optional
        Dropout with exactly the mask of a single-process :func:`attention` call with the same
        ``(seed, offset)``. ``seed=None`` draws one on the group's first rank (from torch's
        generator) and shares it.
    cu_seqlens_q, cu_seqlens_k : int32 tensor (nseqs + 1,), optional
        Packed sequences (as in :func:`attention_varlen`): the offsets of the whole packed
        sequence (the same on every rank), ending at W times the local length.
    max_seqlen_q, max_seqlen_k : int, optional
        Bounds on the sequence lengths (None: computed from the offsets).
    return_lse : bool, default False
        Also return the float32 lse of this rank's rows, (batch, nheads, s_local) or
        (nheads, total_local), without gradient.

    Returns
    -------
    out : torch.Tensor, the shape of q
        This rank's rows of attention over the whole sequence.
    lse : torch.Tensor, float32
        With ``return_lse=True``.

    Raises
    ------
    RuntimeError
        torch.distributed is not initialised.
    ValueError
        ``nheads`` not a multiple of W (names ``q``), ``nheads_kv`` neither a multiple nor a
        divisor of W (``k``), shards of different shapes across ranks, offsets that do not end at
        W times the local length (``cu_seqlens_q``/``cu_seqlens_k``), or a ``group`` this process
        is not in; raised on every rank. Options the local call rejects, as :func:`attention`.

    Examples
    --------
    It needs several processes (``torchrun --nproc-per-node 2 script.py``):

    .. code-block:: python

        import torch, torch.distributed as dist, flashdl.torch as ft
        dist.init_process_group("gloo")
        r, W = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        q_full, k_full, v_full = (torch.randn(1, 1024, 8, 64) for _ in range(3))
        q, k, v = (ft.ring_shard(x, r, W, layout="contiguous").requires_grad_()
                   for x in (q_full, k_full, v_full))
        out = ft.ulysses_attention(q, k, v, causal=True, dropout_p=0.1, seed=1)
        out.sum().backward()
        full = ft.ring_unshard(out.detach(), layout="contiguous")
    """

    # This rank's own arguments by flashdl.attention's rules, before any collective (the
    # attention call after the all-to-all checks the rest).
    torch_tensors("ulysses_attention", q=q, k=k, v=v)
    return_lse = _checks.flag("return_lse", return_lse)
    causal, softmax_scale, schedule, window_size = _args.scalars(
        causal, softmax_scale, schedule, window_size
    )
    global_window(causal, window_size)  # the values too (each side >= -1)
    dropout_p = _args.dropout_probability(dropout_p)
    require_initialized()
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen and (cu_seqlens_q is None or cu_seqlens_k is None):
        raise ValueError(
            "cu_seqlens_q: pass both cu_seqlens_q and cu_seqlens_k for packed sequences, or neither"
        )
    if varlen:
        cu_seqlens_q, cu_seqlens_k = (torch.as_tensor(x) for x in (cu_seqlens_q, cu_seqlens_k))
    agree, rank, world = _validate(q, k, v, group, varlen, cu_seqlens_q, cu_seqlens_k)
    dropout = dropout_p > 0
    if dropout and seed is None:
        agree.maximum("seed", int(torch.randint(0, 2**62, (1,))) if rank == 0 else 0)
    shared = agree.settle([group], q.device)
    seed = shared.get("seed", seed)
    last_bytes_sent.update(forward=0, backward=0, lse=0)

    seq_dim = 0 if varlen else 1
    nheads = q.shape[-2]
    qh, kh, vh = to_heads(q, k, v, group, seq_dim)
    virtual = dropout and world > 1
    opts = dict(
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=window_size,
        dropout_p=dropout_p,
        seed=seed,
        offset=offset,
        softcap=softcap,
        block_size=block_size,
        schedule=schedule,
        deterministic=deterministic,
        alibi_slopes=_heads_of(alibi_slopes, rank, world, nheads, 2, virtual),
        block_mask=_heads_of(block_mask, rank, world, nheads, 4, virtual),
        return_lse=True,
    )
    if not varlen and not virtual:
        out, lse = attention(qh, kh, vh, **opts)
        return _result(out, lse, group, seq_dim, False, return_lse)
    flat: Tuple[torch.Tensor, ...]
    bounds: List[Optional[int]]
    if varlen:
        assert cu_seqlens_q is not None and cu_seqlens_k is not None  # (varlen: both, as checked)
        flat = (qh, kh, vh)
        cus = [cu_seqlens_q, cu_seqlens_k]
        bounds = [max_seqlen_q, max_seqlen_k]
    else:  # dense with dropout: the virtual batch of packed sequences (see the module's notes)
        b, sq, sk = qh.shape[0], qh.shape[1], kh.shape[1]
        flat = tuple(x.reshape(-1, *x.shape[2:]) for x in (qh, kh, vh))
        cus = [torch.arange(b + 1, dtype=torch.int32) * n for n in (sq, sk)]
        bounds = [sq, sk]
    lengths = [
        int(torch.diff(cu).max()) if m is None and cu.numel() > 1 else (m or 0)
        for m, cu in zip(bounds, cus)
    ]
    if virtual:
        cus = [_virtual_cu(cu, rank, world) for cu in cus]
    out, lse = attention_varlen(
        flat[0], flat[1], flat[2], cus[0], cus[1], lengths[0], lengths[1], **opts
    )
    if not varlen:  # back from the virtual batch: (b sq, h, d) and (h, b sq)
        out = out.view(qh.shape)
        lse = lse.view(lse.shape[0], qh.shape[0], -1).transpose(0, 1)
    return _result(out, lse, group, seq_dim, varlen, return_lse)


def _result(out, lse, group, seq_dim, varlen, return_lse):
    out = to_sequence(out, group, seq_dim)
    if not return_lse:
        return out
    return out, lse_to_sequence(lse.contiguous(), group, varlen)
