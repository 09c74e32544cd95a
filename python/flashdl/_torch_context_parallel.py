"""2-D context parallelism over torch.distributed: Ulysses (all-to-all over the heads) inside each
group of U ranks, ring attention across the R groups; flashdl.torch.context_parallel_attention.

The sequence is cut into the ring's shards (zigzag or contiguous over R); each ring shard is cut
into U contiguous slices, one per rank of a Ulysses group. The Ulysses all-to-all gives every
rank its ring shard for nheads / U heads, the ring runs over those heads between the ranks that
hold the same heads (one rank of each Ulysses group), and an all-to-all returns the output to
sequence slices. U = 1 is plain ring attention, R = 1 plain Ulysses.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import _checks, _torch_ulysses
from ._ring_plan import check_layout
from ._torch_dist_check import Agreement, group_rank, require_initialized
from ._torch_ring import RingAttention, ring_args
from ._torch_ring import shard as ring_shard
from ._torch_ring import unshard as ring_unshard


def context_parallel_groups(
    ring_size: int, ulysses_size: int
) -> Tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This process's ring group and Ulysses group of a ``ring_size`` x ``ulysses_size`` grid.

    Global rank ``g`` is Ulysses rank ``g % ulysses_size`` of Ulysses group ``g // ulysses_size``
    (consecutive ranks, e.g. the GPUs of one node, do the all-to-all) and ring rank
    ``g // ulysses_size`` of ring group ``g % ulysses_size``. Every rank of the default group must
    call it (``torch.distributed.new_group`` is collective).

    Parameters
    ----------
    ring_size : int
        R, the number of Ulysses groups (ranks of each ring).
    ulysses_size : int
        U, the ranks of each Ulysses group.

    Returns
    -------
    ring_group, ulysses_group : torch.distributed.ProcessGroup
        For :func:`context_parallel_attention`.

    Raises
    ------
    RuntimeError
        torch.distributed is not initialised.
    ValueError
        ``ring_size * ulysses_size`` is not the world size.

    Examples
    --------
    .. code-block:: python

        ring_group, ulysses_group = flashdl.torch.context_parallel_groups(2, 4)  # 8 ranks
    """
    require_initialized("ring_size")
    world, rank = dist.get_world_size(), dist.get_rank()
    if ring_size < 1 or ulysses_size < 1 or ring_size * ulysses_size != world:
        raise ValueError(
            f"ring_size: ring_size x ulysses_size ({ring_size} x {ulysses_size}) "
            f"must be the world size, {world}"
        )
    mine = {}
    for g in range(ring_size):  # the same calls, in the same order, on every rank
        grp = dist.new_group(list(range(g * ulysses_size, (g + 1) * ulysses_size)))
        if g == rank // ulysses_size:
            mine["ulysses"] = grp
    for u in range(ulysses_size):
        grp = dist.new_group(list(range(u, world, ulysses_size)))
        if u == rank % ulysses_size:
            mine["ring"] = grp
    return mine["ring"], mine["ulysses"]


def context_parallel_shard(
    x: torch.Tensor,
    ring_rank: int,
    ring_size: int,
    ulysses_rank: int,
    ulysses_size: int,
    layout: str = "zigzag",
    dim: int = 1,
) -> torch.Tensor:
    """This rank's shard of a full tensor, for :func:`context_parallel_attention`.

    The ring shard of :func:`ring_shard` (over ``ring_size`` ranks) cut into ``ulysses_size``
    contiguous slices; this rank takes slice ``ulysses_rank``.

    Parameters
    ----------
    x : torch.Tensor
        The full tensor, e.g. (batch, seqlen, nheads, headdim).
    ring_rank, ring_size : int
        This rank's place in its ring group, and R.
    ulysses_rank, ulysses_size : int
        This rank's place in its Ulysses group, and U.
    layout : {"zigzag", "contiguous"}, default "zigzag"
        The ring's layout.
    dim : int, default 1
        The sequence axis.

    Returns
    -------
    torch.Tensor
        ``x.shape[dim] / (R U)`` rows along ``dim``.

    Raises
    ------
    ValueError
        A bad ``layout``, or a length that does not split evenly.

    Examples
    --------
    >>> import torch, flashdl.torch as ft
    >>> x = torch.arange(8).view(1, 8, 1, 1)
    >>> [ft.context_parallel_shard(x, r, 2, u, 2).flatten().tolist()
    ...  for r in range(2) for u in range(2)]
    [[0, 1], [6, 7], [2, 3], [4, 5]]
    """
    ulysses_size = _checks.integer(
        "ulysses_size", ulysses_size, "an int >= 1 (the ranks of a Ulysses group)", 1
    )
    ulysses_rank = _checks.integer(
        "ulysses_rank",
        ulysses_rank,
        f"an int in [0, {ulysses_size}) (ulysses_size {ulysses_size})",
        0,
        ulysses_size,
    )
    piece = ring_shard(x, ring_rank, ring_size, layout, dim)
    if piece.shape[dim] % ulysses_size:
        raise ValueError(
            f"x: a ring shard of {piece.shape[dim]} rows (dim {dim}) does not split "
            f"into {ulysses_size} equal Ulysses slices"
        )
    return piece.chunk(ulysses_size, dim=dim)[ulysses_rank]


def context_parallel_unshard(
    local: torch.Tensor,
    ring_group: Optional[dist.ProcessGroup],
    ulysses_group: Optional[dist.ProcessGroup],
    layout: str = "zigzag",
    dim: int = 1,
) -> torch.Tensor:
    """The full tensor from every rank's shard: the inverse of :func:`context_parallel_shard`.

    An ``all_gather`` in the Ulysses group, then one in the ring group: every rank must call it.

    Parameters
    ----------
    local : torch.Tensor
        This rank's shard (e.g. the output of :func:`context_parallel_attention`).
    ring_group, ulysses_group : torch.distributed.ProcessGroup
        The groups of the call.
    layout : {"zigzag", "contiguous"}, default "zigzag"
        The ring's layout.
    dim : int, default 1
        The sequence axis.

    Returns
    -------
    torch.Tensor
        The full tensor, R U times as long along ``dim``.

    Raises
    ------
    ValueError
        A bad ``layout``.

    Examples
    --------
    .. code-block:: python

        full_out = flashdl.torch.context_parallel_unshard(out.detach(), ring_group, ulysses_group)
    """
    check_layout(layout)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(ulysses_group))]
    dist.all_gather(parts, local.contiguous(), group=ulysses_group)
    return ring_unshard(torch.cat(parts, dim=dim), ring_group, layout, dim)


def _check(q, k, v, ring_group, ulysses_group, layout) -> None:
    me = dist.get_rank()
    (_, ring_size), (_, uly_size) = (
        group_rank(ring_group, "ring_group"),
        group_rank(ulysses_group, "ulysses_group"),
    )
    if ring_size > 1 and uly_size > 1:
        common = set(dist.get_process_group_ranks(ring_group)) & set(
            dist.get_process_group_ranks(ulysses_group)
        )
        if common != {me}:
            raise ValueError(
                f"ulysses_group: must share only this process (rank {me}) with "
                f"ring_group, shares ranks {sorted(common)} (see "
                "flashdl.torch.context_parallel_groups)"
            )
    agree = Agreement(["q", "k"])
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        agree.fail(
            "q",
            "q: expected q (batch, s_local, nheads, headdim) and k, v "
            f"(batch, s_local, nheads_kv, headdim), got {q.dim()}-D, {k.dim()}-D, "
            f"{v.dim()}-D",
        )
    elif k.shape[1] != q.shape[1] or v.shape[:-1] != k.shape[:-1]:
        agree.fail(
            "k",
            f"k: expected k and v of q's shard length {q.shape[1]}, got "
            f"{tuple(k.shape)} and {tuple(v.shape)}",
        )
    else:
        _torch_ulysses.check_heads(agree, q.shape[2], k.shape[2], uly_size)
        if layout == "zigzag" and (q.shape[1] * uly_size) % 2:
            agree.fail(
                "q",
                "q: layout 'zigzag' holds two chunks per ring rank, so the ring "
                f"shard ({uly_size} x {q.shape[1]} rows) must be even",
            )
    for name, what, i in (
        ("q", "the shard length", 1),
        ("q", "the batch", 0),
        ("q", "nheads", 2),
        ("k", "nheads_kv", 2),
        ("q", "headdim", 3),
    ):
        x = k if name == "k" else q
        agree.equal(name, what, x.shape[i] if x.dim() == 4 else -1)
    agree.settle([ulysses_group, ring_group], q.device)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ring_group: Optional[dist.ProcessGroup],
    ulysses_group: Optional[dist.ProcessGroup],
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: Tuple[int, int] = (-1, -1),
    layout: str = "zigzag",
    return_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact attention over a sequence sharded across a 2-D grid: Ulysses inside, ring across.

    Differentiable with respect to q, k and v. An all-to-all inside ``ulysses_group`` (U ranks)
    gives each rank its ring shard for ``nheads / U`` heads; :func:`ring_attention` runs over
    ``ring_group`` (R ranks) on those heads, with causal and window skipping; an all-to-all
    returns the output to this rank's rows. Per rank the forward sends the ring's
    ``2 (R - 1) b (U s_local) (nheads_kv / U) d`` elements (for nheads_kv >= U) plus Ulysses'
    ``(U - 1) / U`` of q, k, v and out.

    Parameters
    ----------
    q : torch.Tensor (batch, s_local, nheads, headdim)
        This rank's shard (:func:`context_parallel_shard` makes it). ``nheads`` a multiple of U.
    k, v : torch.Tensor (batch, s_local, nheads_kv, headdim)
        ``nheads_kv`` a multiple or a divisor of U.
    ring_group, ulysses_group : torch.distributed.ProcessGroup or None
        The ring and Ulysses groups of this process (:func:`context_parallel_groups` makes
        them); they must share only this process. None is the default group (for the other
        one of size 1).
    causal, softmax_scale, window_size, layout : optional
        As in :func:`ring_attention`, over global positions.
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
    RuntimeError
        torch.distributed is not initialised.
    ValueError
        Groups this process is not in or that share other ranks (names ``ring_group`` or
        ``ulysses_group``), heads that do not split over U, shards of different shapes, a bad
        ``layout`` or ``window_size``: raised on every rank.

    Examples
    --------
    Four processes as 2 rings x 2 Ulysses ranks (``torchrun --nproc-per-node 4 script.py``):

    .. code-block:: python

        import torch, torch.distributed as dist, flashdl.torch as ft
        dist.init_process_group("gloo")
        ring, uly = ft.context_parallel_groups(ring_size=2, ulysses_size=2)
        rr, ur = dist.get_rank(ring), dist.get_rank(uly)
        torch.manual_seed(0)
        q_full, k_full, v_full = (torch.randn(1, 4096, 8, 64) for _ in range(3))
        q, k, v = (ft.context_parallel_shard(x, rr, 2, ur, 2).requires_grad_()
                   for x in (q_full, k_full, v_full))
        out = ft.context_parallel_attention(q, k, v, ring_group=ring, ulysses_group=uly,
                                            causal=True, window_size=(512, 0))
        out.sum().backward()
        full = ft.context_parallel_unshard(out.detach(), ring, uly)
    """
    return_lse = _checks.flag("return_lse", return_lse)
    window, softmax_scale = ring_args(
        "context_parallel_attention", q, k, v, causal, softmax_scale, window_size, layout
    )
    require_initialized("ring_group")
    _check(q, k, v, ring_group, ulysses_group, layout)
    _torch_ulysses.last_bytes_sent.update(forward=0, backward=0, lse=0)
    qh, kh, vh = _torch_ulysses.to_heads(q, k, v, ulysses_group, 1)
    out, lse = RingAttention.apply(qh, kh, vh, ring_group, window, softmax_scale, layout)
    out = _torch_ulysses.to_sequence(out, ulysses_group, 1)
    if not return_lse:
        return out
    return out, _torch_ulysses.lse_to_sequence(lse, ulysses_group, varlen=False)
