"""flashdl.torch's arguments: validated in the public API's order (the argument layer, _args, for
the options every front end shares), then converted to what the custom ops' schemas take.
"""

from __future__ import annotations

import numpy as np
import torch

from . import _args, _checks
from ._frameworks import Frame


def check_tensors(arrays: dict, api: str) -> None:
    """q, k, v must be torch tensors: the framework errors of flashdl.attention for mixed or
    unknown arrays, a TypeError pointing to flashdl.attention for other frameworks' arrays."""
    if all(isinstance(x, torch.Tensor) for x in arrays.values()):
        return
    Frame(arrays, _args.FLOATS_FWD)  # raises for mixed frameworks and for non-arrays
    name = next(n for n, x in arrays.items() if not isinstance(x, torch.Tensor))
    raise TypeError(
        f"{name}: expected a torch.Tensor ({api} is for torch tensors; "
        f"flashdl.{api.split('.')[-1]} takes other arrays), "
        f"got {type(arrays[name]).__name__}"
    )


def draw_seed(device: torch.device) -> torch.Tensor:
    """A 0-dim int64 tensor of 63 random bits from the generator of device (torch.cuda's for a
    CUDA device, the CPU one otherwise), where torch's own dropout draws from: torch.manual_seed
    makes dropout repeatable, and under torch.compile the draw is an op of the graph (no
    .item()). flashdl.flash_attn draws its seeds here too."""
    return torch.randint(0, 2**63 - 1, (), dtype=torch.int64, device=device)


def seed_tensor(dropout_p, seed, offset, device):
    """(dropout_p, seed tensor or None, offset) for the ops: seed None draws one (only when
    dropout_p > 0); an int seed in [0, 2**64) becomes its int64 two's complement."""
    if seed is None:
        dropout_p, _, offset = _args.dropout_args(dropout_p, 0, offset)
        return dropout_p, (draw_seed(device) if dropout_p > 0 else None), offset
    dropout_p, seed, offset = _args.dropout_args(dropout_p, seed, offset)
    if not dropout_p > 0:
        return dropout_p, None, offset  # the seed selects nothing without dropout
    return (
        dropout_p,
        torch.tensor(seed - 2**64 if seed >= 2**63 else seed, dtype=torch.int64),
        offset,
    )


def as_tensor(name: str, x):
    """x for an op's schema: None, a tensor, or any other DLPack array (NumPy's included) as a
    tensor sharing its memory. A read-only NumPy array is copied first (torch cannot wrap one);
    under torch.compile, torch.from_numpy is what Dynamo traces (it makes the array a tensor)."""
    if x is None or isinstance(x, torch.Tensor):
        return x
    try:
        if isinstance(x, np.ndarray):
            if torch.compiler.is_compiling() or x.flags.writeable:
                return torch.from_numpy(x)
            return torch.from_numpy(x.copy(order="K"))
        if hasattr(x, "__dlpack__"):
            return torch.from_dlpack(x)
    except (TypeError, ValueError, RuntimeError, BufferError) as err:
        raise TypeError(f"{name}: cannot pass this {type(x).__name__} to torch ({err})") from None
    return x  # not an array: the caller's check names it


def int64(name: str, x: int, what: str) -> int:
    if not -(2**63) <= x < 2**63:
        raise ValueError(f"{name}: expected {what}, got {x}")
    return x


def op_options(
    q,
    causal,
    softmax_scale,
    schedule,
    window_size,
    dropout_p,
    seed,
    offset,
    block_mask,
    block_size,
    deterministic,
    alibi_slopes,
    softcap,
    sinks=None,
    bias=None,
    mask=None,
    rank=4,
):
    """The ops' option arguments (_OPTIONS) from the public ones, every bad one named."""
    dropout_p, seed, offset = seed_tensor(dropout_p, seed, offset, q.device)
    causal, softmax_scale, schedule, window = _args.scalars(
        causal, softmax_scale, schedule, window_size
    )
    window = list(window)
    sparse = _args.block_sparse(as_tensor("block_mask", block_mask), block_size)
    mods = _args.score_mods(as_tensor("alibi_slopes", alibi_slopes), softcap)
    return (
        causal,
        softmax_scale,
        schedule,
        window,
        dropout_p,
        seed,
        offset,
        sparse["block_mask"],
        [sparse["block_size_q"], sparse["block_size_k"]],
        mods["alibi_slopes"],
        mods["softcap"],
        _checks.flag("deterministic", deterministic),
        *_extra_tensors(bias, mask, sinks, rank),
    )


def _extra_tensors(bias, mask, sinks, rank):
    """(bias, mask, sinks) for the ops' schemas: tensors (gradients kept) of full rank, the bias
    with its broadcast (stride-0) axes narrowed to size 1, the shape its gradient takes."""
    layout = (
        "(batch, nheads, seqlen_q, seqlen_k)" if rank == 4 else "(nheads, total_q, max_seqlen_k)"
    )
    out = []
    for name, x in (("bias", bias), ("mask", mask)):
        x = as_tensor(name, x)
        if x is not None:
            if not isinstance(x, torch.Tensor):
                raise TypeError(
                    f"{name}: expected None or a tensor broadcastable to {layout}, "
                    f"got {type(x).__name__}"
                )
            x = _args.full_rank(name, x, rank, layout)
            if name == "bias":
                x = _args.compact(x)
        out.append(x)
    return out[0], out[1], _sinks_tensor(sinks)


def _sinks_tensor(sinks):
    """sinks for the ops' schema: None or a tensor (gradient kept); the core checks the rest."""
    sinks = as_tensor("sinks", sinks)
    if sinks is not None and not isinstance(sinks, torch.Tensor):
        raise TypeError(
            "sinks: expected None or a float32 tensor of shape (nheads,), got "
            f"{type(sinks).__name__}"
        )
    return sinks


def cu_tensor(name, x):
    """cu_seqlens for the varlen ops: a tensor, integer dtypes narrowed to int32 where their
    values fit (a GPU tensor of another integer dtype is refused, naming the conversion)."""
    x = as_tensor(name, x)
    if (
        isinstance(x, torch.Tensor)
        and x.dtype not in (torch.int32, torch.bool)
        and not x.is_floating_point()
        and not x.is_complex()
    ):
        if torch.compiler.is_compiling():
            x = x.to(torch.int32)
        else:
            x = as_tensor(name, _args.int32_index(name, x.detach()))
    return _args.cu_seqlens(name, x)
