"""flashdl.jax.ring_attention: context parallelism over a sequence-sharded axis of JAX's mesh.

Called inside ``jax.shard_map`` (or any context with a named mapped axis): each of the W devices
holds s / W rows of q, k and v. K and V travel around the ring with ``lax.ppermute`` (device i
sends to i + 1); at each step every device attends its queries to the block it holds with
flashdl's kernels (the dense custom call) and merges the partial result into its running (out,
lse) with flashdl's merge (the merge_states custom call). The backward (a ``jax.custom_vjp``)
sends K, V and float32 accumulators of their gradients around the ring; dq stays local; the
accumulators return to their owner in one final ppermute.

Which (query chunk, key chunk) pairs are computed, and with which window, is the torch ring's
plan (_ring_plan): pairs nothing in which is visible are skipped, fully visible ones run
unmasked, and the rest are trimmed to their visible rows and keys with flashdl's window shifted by
the chunks' offset. In SPMD every device runs the same program while its rank is a traced value,
so each ring step is a ``lax.switch`` over the distinct per-rank plans of that step (W at most;
with the zigzag layout and a causal mask there are two besides step 0: all queries against the
first key chunk, or the second query chunk against both). K and V travel only as many hops as
the farthest visible pair needs.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp

from . import _checks, _jax_ffi
from ._ring_plan import Block, check_layout, chunks_of, global_window, last_step, pair_block


class _Ring(NamedTuple):
    axis_name: Any
    world: int
    layout: str
    chunk: int  # rows per chunk (s_local / 2 for zigzag)
    last: int  # the last ring step with a visible pair
    plans: tuple  # plans[t][r]: the Blocks of rank r at step t (_plans)
    cfg: Any  # flashdl.jax._Config of the whole call (window replaced per block)


def _coalesce(blocks):
    """Unmasked blocks (local rows [q0, q1) x local keys [k0, k1)) that share their rows and
    have adjacent keys, or share their keys and have adjacent rows, are one unmasked call: fewer,
    larger kernel calls and merges (zigzag's causal steps become one call each)."""
    blocks = list(blocks)
    merged = True
    while merged:
        merged = False
        for i, a in enumerate(blocks):
            for j, b in enumerate(blocks):
                if i == j or a.window is not None or b.window is not None:
                    continue
                if (a.q0, a.q1) == (b.q0, b.q1) and a.k1 == b.k0:
                    new = Block(a.q0, a.q1, a.k0, b.k1, None)
                elif (a.k0, a.k1) == (b.k0, b.k1) and a.q1 == b.q0:
                    new = Block(a.q0, b.q1, a.k0, a.k1, None)
                else:
                    continue
                blocks = [x for n, x in enumerate(blocks) if n not in (i, j)] + [new]
                merged = True
                break
            if merged:
                break
    return tuple(sorted(blocks))


def _plans(world, layout, c, left, right, last):
    """plans[t][r]: the blocks rank r computes at step t, as Blocks in its local rows and in the
    local rows of the K/V it holds then (chunk i of a rank is local rows [i c, (i + 1) c))."""
    plans = []
    for t in range(last + 1):
        per_rank = []
        for r in range(world):
            owner = (r - t) % world
            blocks = []
            for ia, a in enumerate(chunks_of(r, world, layout)):
                for ib, b in enumerate(chunks_of(owner, world, layout)):
                    blk = pair_block(a, b, c, left, right)
                    if blk is not None and blk.q1 > blk.q0 and blk.k1 > blk.k0:
                        blocks.append(
                            Block(
                                ia * c + blk.q0,
                                ia * c + blk.q1,
                                ib * c + blk.k0,
                                ib * c + blk.k1,
                                blk.window,
                            )
                        )
            n = len(chunks_of(r, world, layout))
            if t == 0 and right == 0 and left >= n * c * world and blocks:
                # A rank's own chunks under a plain causal mask: causal over its local rows in
                # either layout (zigzag's chunk 2W - 1 - r sees all of chunk r, and chunk r none
                # of it), so one causal call instead of a diagonal, a full and a diagonal block.
                blocks = [Block(0, n * c, 0, n * c, (-1, 0))]
            per_rank.append(_coalesce(blocks))
        plans.append(tuple(per_rank))
    return tuple(plans)


def _block_cfg(ring, blk):
    left, right = (-1, -1) if blk.window is None else blk.window
    return ring.cfg._replace(causal=False, window_left=left, window_right=right)


def _switch(ring, t, fn, *operands):
    """fn(plan, *operands) for this device's plan at step t: a lax.switch over the distinct
    plans of the step (no switch when every rank has the same plan)."""
    plans = ring.plans[t]
    distinct = list(dict.fromkeys(plans))
    if len(distinct) == 1:
        return fn(distinct[0], *operands)
    table = jnp.array([distinct.index(p) for p in plans], jnp.int32)
    index = table[jax.lax.axis_index(ring.axis_name)]
    return jax.lax.switch(index, [functools.partial(fn, p) for p in distinct], *operands)


def _send(ring, xs, hops=1):
    perm = [(i, (i + hops) % ring.world) for i in range(ring.world)]
    return tuple(jax.lax.ppermute(x, ring.axis_name, perm) for x in xs)


def _ring_forward(ring, q, k, v):
    # Built from q, so that they vary over the mesh axes as q does (shard_map's typing).
    acc = jnp.zeros_like(q, jnp.float32)
    acc_lse = jnp.full_like(jnp.swapaxes(q[..., 0], 1, 2), -jnp.inf, jnp.float32)

    def step(plan, q, k, v, acc, acc_lse):
        for blk in plan:
            rows, keys = slice(blk.q0, blk.q1), slice(blk.k0, blk.k1)
            out, lse = _jax_ffi.forward(q[:, rows], k[:, keys], v[:, keys], _block_cfg(ring, blk))
            o, l = _jax_ffi.merge_call(
                (acc[:, rows], out.astype(jnp.float32)), (acc_lse[:, :, rows], lse)
            )
            acc, acc_lse = acc.at[:, rows].set(o), acc_lse.at[:, :, rows].set(l)
        return acc, acc_lse

    for t in range(ring.last + 1):
        acc, acc_lse = _switch(ring, t, step, q, k, v, acc, acc_lse)
        if t < ring.last:
            k, v = _send(ring, (k, v))
    return acc.astype(q.dtype), acc_lse


def _ring_backward(ring, dout, q, k, v, out, lse):
    dq = jnp.zeros_like(q, jnp.float32)
    dk, dv = jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32)

    def step(plan, dout, q, k, v, out, lse, dq, dk, dv):
        for blk in plan:
            rows, keys = slice(blk.q0, blk.q1), slice(blk.k0, blk.k1)
            gq, gk, gv = _jax_ffi.backward(
                dout[:, rows],
                q[:, rows],
                k[:, keys],
                v[:, keys],
                out[:, rows],
                lse[:, :, rows],
                _block_cfg(ring, blk),
            )
            dq = dq.at[:, rows].add(gq.astype(jnp.float32))
            dk = dk.at[:, keys].add(gk.astype(jnp.float32))
            dv = dv.at[:, keys].add(gv.astype(jnp.float32))
        return dq, dk, dv

    for t in range(ring.last + 1):
        dq, dk, dv = _switch(ring, t, step, dout, q, k, v, out, lse, dq, dk, dv)
        if t < ring.last:
            k, v, dk, dv = _send(ring, (k, v, dk, dv))
    if ring.last:  # the accumulators of owner r - last go home
        dk, dv = _send(ring, (dk, dv), hops=-ring.last)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring, q, k, v):
    return _ring_forward(ring, q, k, v)


def _ring_fwd(ring, q, k, v):
    out, lse = _ring_forward(ring, q, k, v)
    return (out, lse), (q, k, v, out, lse)


def _ring_bwd(ring, res, cot):
    dout, _ = cot  # lse leaves under stop_gradient
    return _ring_backward(ring, dout, *res)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _world(axis_name):
    try:
        return int(jax.lax.axis_size(axis_name))
    except Exception:  # NameError (unbound axis) and jax's own errors alike
        raise ValueError(
            f"axis_name: {axis_name!r} is not a mapped axis here; call "
            "ring_attention inside jax.shard_map over a mesh with that axis, the "
            "sequence sharded over it"
        ) from None


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis_name: Any,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softmax_scale: Optional[float] = None,
    softcap: float = 0.0,
    layout: str = "zigzag",
    schedule: str = "auto",
    deterministic: bool = False,
    return_lse: bool = False,
) -> Any:
    """Exact attention over a sequence sharded along the mesh axis ``axis_name`` (ring attention).

    For use inside ``jax.shard_map``: q, k, v are this device's shards (batch, s / W, heads,
    headdim) of a sequence split over the W devices of ``axis_name`` in ``layout`` order
    (:func:`ring_permute` puts a full array in that order). The result is this device's rows of
    attention over the whole sequence, differentiable with respect to q, k, v (a
    ``jax.custom_vjp`` whose backward is a second ring).

    Parameters
    ----------
    q : jax.Array (batch, s_local, nheads, headdim)
    k, v : jax.Array (batch, s_local, nheads_kv, headdim)
        The same local length as q (self-attention over one sequence).
    axis_name : hashable
        The mesh axis the sequence is sharded over (static).
    causal, window_size, softmax_scale, softcap, schedule, deterministic : optional
        As in :func:`attention`, over the global sequence (static).
    layout : {"zigzag", "contiguous"}, default "zigzag"
        ``"zigzag"``: device i holds chunks i and 2W - 1 - i of 2W (balances causal work);
        ``"contiguous"``: chunk i of W.
    return_lse : bool, default False
        Also return lse, float32 (batch, nheads, s_local), without gradient.

    Returns
    -------
    out : jax.Array (batch, s_local, nheads, headdim)
    lse : jax.Array, with ``return_lse=True``

    Raises
    ------
    ValueError
        At trace time: ``axis_name`` not a mapped axis here, local lengths that differ or do not
        split into the layout's chunks, bad shapes or options (the message names the argument).

    Examples
    --------
    >>> import jax, numpy as np, flashdl.jax as fj
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
    >>> f = jax.jit(jax.shard_map(lambda q, k, v: fj.ring_attention(q, k, v, axis_name="sp",
    ...     causal=True), mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp")))
    >>> q = np.random.randn(1, 16, 2, 8).astype(np.float32)
    >>> f(q, q, q).shape
    (1, 16, 2, 8)
    """
    return_lse = _checks.flag("return_lse", return_lse)
    check_layout(layout)
    cfg = _jax_ffi.config(causal, softmax_scale, window_size, schedule, softcap, deterministic)
    _jax_ffi.check(_jax_ffi.check_dense, {"q": q, "k": k, "v": v}, cfg)
    world = _world(axis_name)
    s, sk = q.shape[1], k.shape[1]
    if sk != s:
        raise ValueError(
            f"k: expected the local sequence length of q ({s}), got {sk}: ring "
            "attention is self-attention over one sequence sharded alike"
        )
    n = len(chunks_of(0, world, layout))
    if s % n:
        raise ValueError(
            f"q: local sequence length {s} does not split into the {n} chunks of "
            f"layout {layout!r}; the global length must be a multiple of "
            f"{n * world}"
        )
    c = s // n
    left, right = global_window(cfg.causal, (cfg.window_left, cfg.window_right))
    last = last_step(world, layout, c, left, right) if c else 0
    ring = _Ring(
        axis_name,
        world,
        layout,
        c,
        last,
        _plans(world, layout, c, left, right, last),
        _jax_ffi.resolved(cfg, q),
    )
    out, lse = _ring(ring, q, k, v)
    return (out, jax.lax.stop_gradient(lse)) if return_lse else out


def _order(world, layout, n_rows):
    check_layout(layout)
    world = _checks.integer("world_size", world, "an int >= 1 (the devices of the ring)", 1)
    n = world if layout == "contiguous" else 2 * world
    if n_rows % n:
        raise ValueError(
            f"x: sequence length {n_rows} must be a multiple of {n} for layout "
            f"{layout!r} over {world} devices"
        )
    c = n_rows // n
    chunks = [a for r in range(world) for a in chunks_of(r, world, layout)]
    return [i for a in chunks for i in range(a * c, (a + 1) * c)]


def ring_permute(
    x: jax.Array, world_size: int, *, layout: str = "zigzag", axis: int = 1
) -> jax.Array:
    """A full array's sequence axis in ring order: sharding the result evenly over ``world_size``
    devices (``PartitionSpec`` on that axis) gives each device its :func:`ring_attention` shard.

    Examples
    --------
    >>> import jax.numpy as jnp, flashdl.jax as fj
    >>> fj.ring_permute(jnp.arange(8)[None], 2).tolist()
    [[0, 1, 6, 7, 2, 3, 4, 5]]
    """
    axis = _checks.integer("axis", axis, f"an axis of x, in [-{x.ndim}, {x.ndim})", -x.ndim, x.ndim)
    return jnp.take(x, jnp.array(_order(world_size, layout, x.shape[axis])), axis=axis)


def ring_unpermute(
    x: jax.Array, world_size: int, *, layout: str = "zigzag", axis: int = 1
) -> jax.Array:
    """The inverse of :func:`ring_permute`: sequence order back from ring order."""
    axis = _checks.integer("axis", axis, f"an axis of x, in [-{x.ndim}, {x.ndim})", -x.ndim, x.ndim)
    order = _order(world_size, layout, x.shape[axis])
    inverse = [0] * len(order)
    for i, j in enumerate(order):
        inverse[j] = i
    return jnp.take(x, jnp.array(inverse, jnp.int32), axis=axis)
