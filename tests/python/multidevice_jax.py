"""flashdl.jax on a mesh of 4 CPU devices: sharded jit calls with no collective, ring attention
over a sequence-sharded axis. Run by test_jax_multidevice.py in a subprocess whose XLA_FLAGS make
4 host devices (the flag must be set before jax initialises its backends, so these cases cannot
share a process with the rest of the suite). Not collected on its own (no test_ prefix)."""

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import flashdl  # noqa: E402
import flashdl.jax as fj  # noqa: E402
from attn_oracle import assert_rule, backward, forward  # noqa: E402

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
W = 4


def setup_module():
    assert len(jax.devices()) == W, "run with XLA_FLAGS=--xla_force_host_platform_device_count=4"


def arrays(shapes, dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    return [np.asarray(rng.standard_normal(s), dtype=dtype) for s in shapes]


def collectives(compiled_text):
    return sorted({c for c in COLLECTIVES if re.search(rf"\b{c}(-start)?\(", compiled_text)})


MESHES = {  # (mesh shape, axis names), spec of q/k/v
    "batch": (((4,), ("data",)), P("data")),
    "heads": (((4,), ("model",)), P(None, None, "model")),
    "batch+heads": (((2, 2), ("data", "model")), P("data", None, "model")),
}


@pytest.mark.parametrize("name", list(MESHES))
def test_sharded_jit_has_no_collective_and_matches(name):
    (shape, axes), spec = MESHES[name]
    mesh = Mesh(np.array(jax.devices()).reshape(shape), axes)
    q, k, v, dout = arrays([(4, 24, 8, 16), (4, 24, 4, 16), (4, 24, 4, 16), (4, 24, 8, 16)])
    sh = NamedSharding(mesh, spec)
    qs, ks, vs, ds = (jax.device_put(x, sh) for x in (q, k, v, dout))
    slopes = np.linspace(0.05, 0.4, 8).astype(np.float32)
    opts = dict(causal=True, softcap=5.0)
    fwd = jax.jit(lambda q, k, v: fj.attention(q, k, v, alibi_slopes=slopes, **opts))
    assert collectives(fwd.lower(qs, ks, vs).compile().as_text()) == []
    out = fwd(qs, ks, vs)
    assert out.sharding.is_equivalent_to(sh, 4)
    e_out, e_lse = flashdl.attention(q, k, v, alibi_slopes=slopes, return_lse=True, **opts)
    np.testing.assert_array_equal(np.asarray(out), e_out)

    def loss(q, k, v, d):
        return (fj.attention(q, k, v, alibi_slopes=slopes, **opts) * d).sum()
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    assert collectives(grad.lower(qs, ks, vs, ds).compile().as_text()) == []
    got = grad(qs, ks, vs, ds)
    want = flashdl.attention_backward(dout, q, k, v, e_out, e_lse, alibi_slopes=slopes, **opts)
    for g, e in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), e)


@pytest.mark.parametrize("name", list(MESHES))
def test_sharded_bias_mask_sinks(name):
    """bias, mask and sinks reach each shard as its (batch, head) planes: the forward has no
    collective and every result is the eager call's (dBias and dSinks are summed over the shards
    by the transpose of their broadcast, so within 1e-6)."""
    (shape, axes), spec = MESHES[name]
    mesh = Mesh(np.array(jax.devices()).reshape(shape), axes)
    q, k, v, dout = arrays([(4, 24, 8, 16), (4, 24, 4, 16), (4, 24, 4, 16), (4, 24, 8, 16)],
                           seed=5)
    rng = np.random.default_rng(6)
    bias = rng.standard_normal((1, 8, 24, 24)).astype(np.float32)
    mask = rng.random((4, 1, 24, 24)) < 0.7
    sinks = rng.standard_normal((8,)).astype(np.float32)
    kw = dict(bias=bias, mask=mask, sinks=sinks, causal=True)
    sh = NamedSharding(mesh, spec)
    qs, ks, vs, ds = (jax.device_put(x, sh) for x in (q, k, v, dout))
    fwd = jax.jit(lambda q, k, v: fj.attention(q, k, v, **kw))
    assert collectives(fwd.lower(qs, ks, vs).compile().as_text()) == []
    e_out, e_lse = flashdl.attention(q, k, v, return_lse=True, **kw)
    np.testing.assert_array_equal(np.asarray(fwd(qs, ks, vs)), e_out)

    def loss(q, k, v, b, s, d):
        return (fj.attention(q, k, v, bias=b, mask=mask, sinks=s, causal=True) * d).sum()
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(qs, ks, vs, bias, sinks, ds)
    want = flashdl.attention_backward(dout, q, k, v, e_out, e_lse, **kw)
    for i, (g, e) in enumerate(zip(got, want)):
        np.testing.assert_allclose(np.asarray(g), e, rtol=1e-6, atol=1e-6 if i >= 3 else 0)


def test_sharded_block_mask_and_vmap():
    mesh = Mesh(np.array(jax.devices()), ("data",))
    q, k, v = arrays([(4, 32, 2, 8)] * 3, seed=1)
    mask = np.random.default_rng(2).random((4, 1, 2, 2)) < 0.7
    sh = NamedSharding(mesh, P("data"))
    f = jax.jit(lambda q, k, v, m: fj.attention(q, k, v, block_mask=m, block_size=16))
    args = [jax.device_put(x, sh) for x in (q, k, v, mask)]
    assert collectives(f.lower(*args).compile().as_text()) == []
    np.testing.assert_array_equal(np.asarray(f(*args)),
                                  flashdl.attention(q, k, v, block_mask=mask, block_size=16))
    # vmap over a sharded leading axis: folded into the batch, still no collective
    g = jax.jit(jax.vmap(lambda q, k, v: fj.attention(q, k, v, causal=True)))
    stacked = [jax.device_put(x.reshape(4, 1, 32, 2, 8), sh) for x in (q, k, v)]
    assert collectives(g.lower(*stacked).compile().as_text()) == []
    np.testing.assert_array_equal(np.asarray(g(*stacked))[:, 0],
                                  flashdl.attention(q, k, v, causal=True))


DROPOUT_MESHES = dict(MESHES, **{  # several mesh axes on one dimension: linearised, major first
    "batch over 2 axes": (((2, 2), ("x", "y")), P(("x", "y"))),
    "heads over 2 axes (minor first)": (((2, 2), ("x", "y")), P(None, None, ("y", "x"))),
})


@pytest.mark.parametrize("name", list(DROPOUT_MESHES))
def test_sharded_dropout_has_no_collective_and_is_the_unsharded_call(name):
    """Each shard draws its slice of the whole call's mask (its batch and head offsets travel
    with the seed): no collective, and out and the gradients are bitwise the unsharded jit
    call's and the eager call's with the same seed (GQA: 8 query heads over 4 kv heads)."""
    (shape, axes), spec = DROPOUT_MESHES[name]
    mesh = Mesh(np.array(jax.devices()).reshape(shape), axes)
    q, k, v, dout = arrays([(4, 24, 8, 16), (4, 24, 4, 16), (4, 24, 4, 16), (4, 24, 8, 16)],
                           seed=4)
    sh = NamedSharding(mesh, spec)
    qs, ks, vs, ds = (jax.device_put(x, sh) for x in (q, k, v, dout))
    opts = dict(dropout_p=0.3, offset=5, causal=True)
    seed = jnp.array([99, 7], jnp.uint32)  # a traced seed, as a training step passes it
    fwd = jax.jit(lambda q, k, v, s: fj.attention(q, k, v, seed=s, **opts))
    assert collectives(fwd.lower(qs, ks, vs, seed).compile().as_text()) == []
    out = fwd(qs, ks, vs, seed)
    assert out.sharding.is_equivalent_to(sh, 4)
    unsharded = fwd(q, k, v, seed)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(unsharded))
    eager_seed = 99 + (7 << 32)
    e_out, e_lse = flashdl.attention(q, k, v, seed=eager_seed, return_lse=True, **opts)
    np.testing.assert_array_equal(np.asarray(out), e_out)

    def loss(q, k, v, d, s):
        return (fj.attention(q, k, v, seed=s, **opts) * d).sum()
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    assert collectives(grad.lower(qs, ks, vs, ds, seed).compile().as_text()) == []
    got = grad(qs, ks, vs, ds, seed)
    plain = grad(q, k, v, dout, seed)
    want = flashdl.attention_backward(dout, q, k, v, e_out, e_lse, seed=eager_seed, **opts)
    for g, p_, e in zip(got, plain, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(p_))
        np.testing.assert_array_equal(np.asarray(g), e)


def test_sharded_dropout_with_extras_and_vmap():
    """Dropout beside bias, sinks and ALiBi on a batch+heads mesh, and jax.vmap of a sharded
    dropout call (each element draws the mask of its own call, as unsharded)."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    q, k, v = arrays([(2, 16, 4, 8), (2, 16, 2, 8), (2, 16, 2, 8)], seed=8)
    rng = np.random.default_rng(9)
    kw = dict(bias=rng.standard_normal((1, 4, 16, 16)).astype(np.float32),
              sinks=rng.standard_normal((4,)).astype(np.float32),
              alibi_slopes=np.linspace(0.1, 0.4, 4).astype(np.float32),
              dropout_p=0.25, seed=3)
    sh = NamedSharding(mesh, P("data", None, "model"))
    args = [jax.device_put(x, sh) for x in (q, k, v)]
    f = jax.jit(lambda q, k, v: fj.attention(q, k, v, **kw))
    assert collectives(f.lower(*args).compile().as_text()) == []
    np.testing.assert_array_equal(np.asarray(f(*args)), flashdl.attention(q, k, v, **kw))
    stacked = [jax.device_put(np.stack([x, x[::-1]]), NamedSharding(mesh, P(None, "data")))
               for x in (q, k, v)]
    g = jax.jit(jax.vmap(lambda q, k, v: fj.attention(q, k, v, dropout_p=0.25, seed=3)))
    got = np.asarray(g(*stacked))
    for i in range(2):
        np.testing.assert_array_equal(
            got[i], flashdl.attention(*(np.asarray(x)[i] for x in stacked), dropout_p=0.25,
                                      seed=3))


def test_mismatched_shardings_name_the_argument():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    q, k, v = arrays([(4, 8, 4, 8)] * 3)
    qs = jax.device_put(q, NamedSharding(mesh, P("data", None, "model")))
    ks = jax.device_put(k, NamedSharding(mesh, P("model", None, "data")))
    vs = jax.device_put(v, NamedSharding(mesh, P("data", None, "model")))
    with pytest.raises(Exception, match=r"k: sharded over \('model',\) along its batch axis"):
        jax.jit(lambda q, k, v: fj.attention(q, k, v)).lower(qs, ks, vs).compile()


def _ring_fn(mesh, **opts):
    spec = P(None, "sp")
    return jax.shard_map(lambda q, k, v: fj.ring_attention(q, k, v, axis_name="sp",
                                                           return_lse=True, **opts),
                         mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, P(None, None, "sp")))


RING = [  # layout, causal, window, dtype
    ("zigzag", True, (-1, -1), "float32"),
    ("zigzag", True, (-1, -1), "bfloat16"),
    ("contiguous", False, (-1, -1), "float32"),
    ("zigzag", False, (9, 4), "float32"),
    ("contiguous", True, (20, -1), "bfloat16"),
]


@pytest.mark.parametrize("layout,causal,window,dtype", RING)
def test_ring_attention_matches_single_device(layout, causal, window, dtype):
    """Forward and backward against the float64 oracle under flash-attn's rule, with the same
    attention computed in the input precision by the oracle as the low-precision baseline."""
    mesh = Mesh(np.array(jax.devices()), ("sp",))
    b, s, h, hk, d = 2, 64, 4, 2, 16
    q, k, v, dout = (jnp.asarray(x, dtype) for x in arrays(
        [(b, s, h, d), (b, s, hk, d), (b, s, hk, d), (b, s, h, d)], seed=3))
    opts = dict(causal=causal, window_size=window, layout=layout)
    ring = _ring_fn(mesh, **opts)

    def perm(x, axis=1):
        return fj.ring_permute(x, W, layout=layout, axis=axis)

    def unperm(x, axis=1):
        return fj.ring_unpermute(x, W, layout=layout, axis=axis)
    out, lse = jax.jit(lambda q, k, v: ring(perm(q), perm(k), perm(v)))(q, k, v)
    out, lse = unperm(out), unperm(lse, axis=2)
    f64 = [np.asarray(x, np.float64) for x in (q, k, v, dout)]
    o_ref, lse_ref = forward(*f64[:3], causal=causal, window=window)
    o_low, _ = forward(*f64[:3], causal=causal, window=window, dtype=dtype, exact=False)
    assert_rule(np.asarray(out, np.float64), o_ref, o_low, dtype)
    np.testing.assert_allclose(np.asarray(lse), lse_ref, rtol=1e-5, atol=1e-5)

    def loss(q, k, v):
        o = unperm(ring(perm(q), perm(k), perm(v))[0])
        return (o.astype(jnp.float32) * dout.astype(jnp.float32)).sum()
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    ref = backward(f64[3], *f64[:3], causal=causal, window=window)
    low = backward(f64[3], *f64[:3], causal=causal, window=window, dtype=dtype, exact=False)
    for g, r, lo in zip(grads, ref, low):
        assert g.dtype == q.dtype
        assert_rule(np.asarray(g, np.float64), r, lo, dtype)


def test_ring_forward_moves_exactly_the_model_bytes():
    """2 (W - 1) b s_local h_kv d elements per device in the forward (K and V, W - 1 hops), read
    off the compiled HLO's collective-permutes; nothing else is communicated. float32: XLA's CPU
    backend widens 16-bit collectives to float32 (same element count, twice the bytes)."""
    mesh = Mesh(np.array(jax.devices()), ("sp",))
    b, s, h, hk, d = 2, 64, 4, 2, 16
    q = jnp.zeros((b, s, h, d), jnp.float32)
    kv = jnp.zeros((b, s, hk, d), jnp.float32)
    text = jax.jit(_ring_fn(mesh, causal=True)).lower(q, kv, kv).compile().as_text()
    sent = 0
    for m in re.finditer(r"= (\w+)\[([\d,]*)\][^=]*? collective-permute(?:-start)?\(", text):
        dims = [int(x) for x in m.group(2).split(",") if x]
        sent += int(np.prod(dims)) * {"f32": 4, "bf16": 2, "f16": 2}[m.group(1)]
    assert collectives(text) == ["collective-permute"]
    assert sent == 2 * (W - 1) * b * (s // W) * hk * d * 4


def test_ring_errors_name_the_argument():
    mesh = Mesh(np.array(jax.devices()), ("sp",))
    q = jnp.zeros((1, 8 * W, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"^axis_name: 'seq' is not a mapped axis"):
        jax.shard_map(lambda q: fj.ring_attention(q, q, q, axis_name="seq"), mesh=mesh,
                      in_specs=P(None, "sp"), out_specs=P(None, "sp"))(q)
    with pytest.raises(ValueError, match=r"^axis_name"):
        fj.ring_attention(q, q, q, axis_name="sp")  # outside shard_map
    odd = jnp.zeros((1, 3 * W, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"^q: local sequence length 3 does not split"):
        jax.shard_map(lambda q: fj.ring_attention(q, q, q, axis_name="sp"), mesh=mesh,
                      in_specs=P(None, "sp"), out_specs=P(None, "sp"))(odd)
    with pytest.raises(ValueError, match=r"^k: expected the local sequence length"):
        jax.shard_map(lambda q, k: fj.ring_attention(q, k, k, axis_name="sp"), mesh=mesh,
                      in_specs=P(None, "sp"), out_specs=P(None, "sp"))(q, q[:, :4 * W])
    with pytest.raises(ValueError, match=r"^layout"):
        jax.shard_map(lambda q: fj.ring_attention(q, q, q, axis_name="sp", layout="ring"),
                      mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))(q)
    with pytest.raises(TypeError, match=r"^causal"):
        jax.jit(jax.shard_map(lambda q, c: fj.ring_attention(q, q, q, axis_name="sp", causal=c),
                              mesh=mesh, in_specs=(P(None, "sp"), P()),
                              out_specs=P(None, "sp")))(q, True)
    with pytest.raises(ValueError, match=r"^x: sequence length 6 must be a multiple of 8"):
        fj.ring_permute(jnp.zeros((1, 6)), W)
