"""flashdl inside compiled JAX programs: jax.jit, jax.grad / jax.vjp and jax.vmap.

    import flashdl.jax
    out = jax.jit(flashdl.jax.attention, static_argnames="causal")(q, k, v, causal=True)
    dq = jax.grad(lambda q: flashdl.jax.attention(q, k, v).sum())(q)

Each call lowers to an XLA FFI custom call (jax.ffi.ffi_call) whose handler is flashdl's C++ (the
CPU backend; the CUDA backend on XLA's stream where flashdl and jax both have CUDA): no host round
trip, no callback. The gradient is a jax.custom_vjp whose backward is flashdl's backward, which
recomputes the attention matrix from the saved lse. The handlers are registered with XLA on the
first call; docs/howto/jax.md says how they are built without jax and which XLA FFI versions they fit.

Also here: attention_with_kvcache (the append a donatable functional update) and merge_states
(_jax_kvcache), ring_attention for shard_map over a sequence-sharded mesh axis (_jax_ring); the
dense calls are partitioned over batch and heads under jax.jit sharding (_jax_partition);
dot_product_attention, jax.nn.dot_product_attention's signature and semantics (_jax_dpa), and
flax_attention, an attention_fn for Flax's attention modules (_jax_flax).

flashdl.attention (the eager DLPack entry point) also takes JAX arrays, but cannot be traced.
"""

from ._jax_attention import attention, attention_varlen
from ._jax_dpa import dot_product_attention
from ._jax_flax import flax_attention
from ._jax_kvcache import attention_with_kvcache, merge_states
from ._jax_ring import ring_attention, ring_permute, ring_unpermute

__all__ = [
    "attention",
    "attention_varlen",
    "attention_with_kvcache",
    "dot_product_attention",
    "flax_attention",
    "merge_states",
    "ring_attention",
    "ring_permute",
    "ring_unpermute",
]

# Defined in _jax_attention; this module is their public home (help(), pickling by name).
attention.__module__ = attention_varlen.__module__ = __name__
