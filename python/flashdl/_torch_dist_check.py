"""Argument checks that every rank of a torch.distributed group agrees on, so that bad input is
an error on every rank instead of a hang in a collective that some ranks never reach.

Each rank checks its own arguments, then one all_reduce (MAX) per group carries a vector of
(the index of a failed argument, every shape value and its negation): afterwards every rank knows
whether any rank failed, and the largest and smallest of each value over the ranks. Reducing the
same vector over two groups in turn (the Ulysses group, then the ring group) gives the maxima over
the whole 2-D grid of ranks.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ._frameworks import type_name


def torch_tensors(fn: str, **arrays) -> None:
    """TypeError naming the first of arrays that is not a torch.Tensor (torch.distributed moves
    tensors): before any collective, so every rank raises it alike."""
    for name, x in arrays.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"{name}: {fn} takes torch tensors (over torch.distributed), got "
                f"{type_name(x)}; flashdl.jax.ring_attention shards JAX arrays"
            )


def require_initialized(name: str = "group") -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{name}: torch.distributed is not initialised "
            "(call torch.distributed.init_process_group first)"
        )


def group_rank(group, name: str = "group") -> Tuple[int, int]:
    """(this process's rank in group, group size), or ValueError naming the argument when group
    is not a process group this process belongs to."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"{name}: expected a torch.distributed.ProcessGroup or None, got "
            f"{type(group).__name__} (a process that is not a member of a new_group "
            "gets a placeholder, not a group)"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"{name}: this process (global rank {dist.get_rank()}) is not a member of the group"
        )
    return rank, dist.get_world_size(group)


def global_rank(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


class Agreement:
    """Collects this rank's first argument error and the values that must be equal on every
    rank; :meth:`settle` reduces them over the groups and raises the same ValueError (naming an
    argument) on every rank if any rank failed or any value differs."""

    def __init__(self, names: Sequence[str]):
        self.names = list(names)  # the arguments an error can name, in a fixed order
        self.error: Optional[Tuple[str, str]] = None
        self.values: List[Tuple[str, str, int]] = []  # (argument, what, value)
        self.extra: Dict[str, int] = {}

    def fail(self, name: str, message: str) -> None:
        if self.error is None:
            self.error = (name, message)

    def equal(self, name: str, what: str, value: int) -> None:
        self.values.append((name, what, int(value)))

    def maximum(self, key: str, value: int) -> None:
        """A non-negative value to take the maximum of over the ranks (e.g. a seed only the
        first rank drew); :meth:`settle` returns the maxima."""
        self.extra[key] = int(value)

    def settle(self, groups: Sequence, device: torch.device) -> Dict[str, int]:
        code = 0 if self.error is None else 1 + self.names.index(self.error[0])
        vec = [code] + [x for _, _, v in self.values for x in (v, -v)] + list(self.extra.values())
        t = torch.tensor(vec, dtype=torch.int64)
        if device.type == "cuda":  # NCCL reduces device tensors only
            t = t.to(device)
        for g in groups:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
        got = t.tolist()
        if self.error is not None:
            raise ValueError(self.error[1])
        if got[0]:
            name = self.names[got[0] - 1]
            raise ValueError(
                f"{name}: rejected on another rank of the group (its error names "
                "the problem); every rank must pass valid arguments"
            )
        for i, (name, what, _) in enumerate(self.values):
            hi, lo = got[1 + 2 * i], -got[2 + 2 * i]
            if hi != lo:
                raise ValueError(
                    f"{name}: {what} differs across ranks (from {lo} to {hi}); "
                    "every rank must pass shards of the same shape"
                )
        return dict(zip(self.extra, got[1 + 2 * len(self.values) :]))
