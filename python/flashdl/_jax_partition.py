"""How flashdl.jax's custom calls meet JAX's sharding and jax.vmap.

Sharding: each dense custom call (forward and backward) is wrapped in
``jax.experimental.custom_partitioning`` with a Shardy sharding rule in einsum notation (``b s h
d, b t k d, b t k d -> b s h d, b h s`` for the forward). The batch factor ``b`` and the head
factors ``h`` (query heads) and ``k`` (kv heads) may be sharded; the sequence and head-dimension
factors must be replicated. The partition callback then checks that q, k and v are sharded
alike over batch and heads (a mismatch raises, naming the argument) and lowers the very same
custom call on each device's shard: no all-gather, no collective at all, because attention is
independent across batch entries and across kv-head groups. With dropout the shard's call also
gets its batch and head offsets in the whole call (traced, from jax.lax.axis_index, appended to
the seed operand; _sliced_dropout), so each shard draws its slice of the unsharded call's mask
and the sharded result is bitwise the unsharded one. docs/howto/jax.md says why this and not
an internal shard_map (which would need the mesh at trace time, which jit under automatic
sharding does not have).

jax.vmap: custom_partitioning has no batching rule, so the partitioned call sits inside a
``jax.custom_batching.custom_vmap`` whose rule folds the mapped axis into the batch (one kernel
launch for the whole vmapped batch, as ``vmap_method="broadcast_all"`` did before).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# The role of each array of a call: its factors in the sharding rule.
_Q, _KV, _LSE, _MASK, _ALIBI = "b s h d", "b t k d", "b h s", "b h x y", "b h"
# bias, mask (rows: seqlen_q or 1) and sinks, broadcast to one plane (one row) per (batch, head)
_BIAS, _BOOL_MASK, _SINKS = "b h r c", "b h m n", "b h"
# the dropout seed, uint32 (2,): replicated (every shard draws from the same stream)
_SEED = "z"
_REPLICATED = ("s", "t", "d", "x", "y", "r", "c", "m", "n", "z")


def _extra_roles(cfg):
    """(name, role) of the optional arrays of a dense call, in the handlers' order."""
    return [
        (n, r)
        for n, r, on in (
            ("block_mask", _MASK, cfg.has_block_mask),
            ("alibi_slopes", _ALIBI, cfg.has_alibi),
            ("bias", _BIAS, cfg.has_bias),
            ("mask", _BOOL_MASK, cfg.has_mask),
            ("sinks", _SINKS, cfg.has_sinks),
            ("seed", _SEED, cfg.dropout_p > 0),
        )
        if on
    ]


def _roles(kind, cfg):
    extra_names = [n for n, _ in _extra_roles(cfg)]
    extras = [r for _, r in _extra_roles(cfg)]
    if kind == "fwd":
        return ["q", "k", "v"] + extra_names, [_Q, _KV, _KV] + extras, [_Q, _LSE]
    grads = ([_BIAS] if cfg.has_bias else []) + ([_SINKS] if cfg.has_sinks else [])
    return (
        ["dout", "q", "k", "v", "out", "lse"] + extra_names,
        [_Q, _Q, _KV, _KV, _Q, _LSE] + extras,
        [_Q, _KV, _KV] + grads,
    )


def _entry(spec, i):
    return spec[i] if i < len(spec) else None


def _axes(entry):
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _spec(role, batch, heads):
    return P(*[batch if f == "b" else heads if f in ("h", "k") else None for f in role.split()])


def _shards(mesh, entry):
    return math.prod(mesh.shape[a] for a in _axes(entry))


def _sliced_dropout(raw, seed_at, q_shape, mesh, batch, heads):
    """raw for one shard of a call with dropout: the seed operand grows from (2,) to (4,) with
    the shard's batch and head offsets in the whole call, and the call gets the whole call's head
    count, so the shard draws exactly its slice of the unsharded call's mask (the handler reads
    them with the seed, xla_ffi.cpp). One program runs on every shard, so the offsets are traced
    values: jax.lax.axis_index over the mesh axes that shard the dimension (several axes give the
    linearised index, major first, the order in which they split it) times the local extent."""
    local_b = q_shape[0] // max(_shards(mesh, batch), 1)
    local_h = q_shape[2] // max(_shards(mesh, heads), 1)

    def offset(entry, local):
        axes = _axes(entry)
        if not axes:
            return jnp.zeros((), jnp.uint32)
        return jax.lax.axis_index(axes).astype(jnp.uint32) * jnp.uint32(local)

    def lower(*args):
        seed = jnp.concatenate(
            [args[seed_at], jnp.stack([offset(batch, local_b), offset(heads, local_h)])]
        )
        args = args[:seed_at] + (seed,) + args[seed_at + 1 :]
        return sliced(*args)

    sliced = raw.with_nheads_total(q_shape[2])
    return lower


def _partition_rule(kind, cfg, raw):
    names, in_roles, out_roles = _roles(kind, cfg)
    q_at = names.index("q")

    def partition(mesh, arg_shapes, result_shape):
        specs = [getattr(a.sharding, "spec", P()) for a in arg_shapes]
        batch, heads = _entry(specs[q_at], 0), _entry(specs[q_at], 2)
        for name, role, spec, shape in zip(names, in_roles, specs, arg_shapes):
            factors = role.split()
            for i, f in enumerate(factors):
                got = _axes(_entry(spec, i))
                want = _axes(batch) if f == "b" else _axes(heads) if f in ("h", "k") else None
                if want is not None and got != want:
                    raise ValueError(
                        f"{name}: sharded over {got or 'no mesh axis'} along its "
                        f"{'batch' if f == 'b' else 'heads'} axis, but q over "
                        f"{want or 'no mesh axis'}: q, k, v (and dout, out, lse) must be sharded "
                        "alike over batch and heads"
                    )
                if f in ("b", "h", "k") and shape.shape[i] % max(_shards(mesh, _entry(spec, i)), 1):
                    raise ValueError(
                        f"{name}: axis {i} of size {shape.shape[i]} does not split evenly over "
                        f"{_shards(mesh, _entry(spec, i))} devices"
                    )
        hk = arg_shapes[names.index("k")].shape[2]
        if hk % _shards(mesh, heads):
            raise ValueError(
                f"k: {hk} kv heads do not split evenly over the "
                f"{_shards(mesh, heads)} devices that shard the heads of q"
            )
        arg_sh = tuple(NamedSharding(mesh, _spec(r, batch, heads)) for r in in_roles)
        res_sh = tuple(NamedSharding(mesh, _spec(r, batch, heads)) for r in out_roles)
        if cfg.dropout_p > 0:
            lower = _sliced_dropout(
                raw, names.index("seed"), arg_shapes[q_at].shape, mesh, batch, heads
            )
            return mesh, lower, res_sh, arg_sh
        return mesh, raw, res_sh, arg_sh

    def infer(mesh, arg_shapes, result_shape):  # the GSPMD partitioner (Shardy off)
        spec = getattr(arg_shapes[q_at].sharding, "spec", P())
        return tuple(
            NamedSharding(mesh, _spec(r, _entry(spec, 0), _entry(spec, 2))) for r in out_roles
        )

    rule = ", ".join(in_roles) + " -> " + ", ".join(out_roles)
    return partition, infer, rule


def _fold_vmap(fn, nout, names=(), serial=False):
    """fn under jax.custom_batching.custom_vmap: a mapped axis folds into the batch axis. Sinks
    (one logit per head, shared by the whole batch) cannot fold: mapped sinks are refused. serial:
    the elements run one by one (jax.lax.map) instead: the backward with sinks, whose dSinks sums
    over the whole batch it is given, so a folded call would mix the elements' gradients; and
    dropout, whose mask is keyed by the batch index within the call."""
    f = jax.custom_batching.custom_vmap(fn)

    @f.def_vmap
    def rule(axis_size, in_batched, *args):
        if "sinks" in names and in_batched[names.index("sinks")]:
            raise ValueError(
                "sinks: jax.vmap over sinks is not supported (the sinks are one "
                "logit per head, shared by every batch entry); map q, k, v (and "
                "bias, mask) and pass sinks unmapped (in_axes=None)"
            )
        args = tuple(
            x if b else jnp.broadcast_to(x, (axis_size,) + x.shape)
            for x, b in zip(args, in_batched)
        )
        if serial:
            return tuple(jax.lax.map(lambda xs: f(*xs), tuple(args))), (True,) * nout
        batch = args[0].shape[1]
        outs = f(*(x.reshape((axis_size * batch,) + x.shape[2:]) for x in args))
        return tuple(o.reshape((axis_size, batch) + o.shape[1:]) for o in outs), (True,) * nout

    return f


@functools.lru_cache(maxsize=None)
def partitioned(kind, cfg, raw):
    """The custom call `raw` (a function of the call's arrays, for the static config cfg) as a
    partitioned, vmappable function of the same arrays."""
    cp = custom_partitioning(raw)
    partition, infer, rule = _partition_rule(kind, cfg, raw)
    order = list(dict.fromkeys(rule.replace(",", " ").replace("->", " ").split()))
    # Shardy wants the special factors in the order of their first appearance in the rule.
    replicated = tuple(sorted((f for f in _REPLICATED if f in order), key=order.index))
    cp.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=rule,
        need_replication_factors=replicated,
    )
    names, _, out_roles = _roles(kind, cfg)
    # serial with dropout: a folded call would draw the masks of batch entries the elements do
    # not have (each element of the map draws the mask of its own call, as the eager call would).
    serial = (kind == "bwd" and cfg.has_sinks) or cfg.dropout_p > 0
    return _fold_vmap(cp, len(out_roles), tuple(names), serial)
