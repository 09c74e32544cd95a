"""flashdl.jax feature parity under jit: dropout with a traced seed, block masks, ALiBi, softcap
(with grad and vmap), the KV cache as a functional update, merge_states. Each result is compared
bitwise with the eager flashdl call on the same arrays (the same kernels), and the eager calls are
tested against the oracles elsewhere."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import flashdl  # noqa: E402
import flashdl.jax as fj  # noqa: E402

SEED = 0x1234_5678_9ABC  # above 2**32: the high word matters


def arrays(shapes, dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    return [np.asarray(rng.standard_normal(s), dtype=dtype) for s in shapes]


def words(seed):
    return jnp.array([seed & 0xFFFFFFFF, seed >> 32], jnp.uint32)


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_traced_seed_matches_eager_forward_and_backward(causal):
    q, k, v, dout = arrays([(2, 19, 4, 16), (2, 23, 2, 16), (2, 23, 2, 16), (2, 19, 4, 16)])
    opts = dict(causal=causal, dropout_p=0.25, offset=7)
    fwd = jax.jit(lambda q, k, v, s: fj.attention(q, k, v, seed=s, return_lse=True, **opts))
    out, lse = fwd(q, k, v, words(SEED))
    e_out, e_lse = flashdl.attention(q, k, v, seed=SEED, return_lse=True, **opts)
    np.testing.assert_array_equal(np.asarray(out), e_out)
    np.testing.assert_array_equal(np.asarray(lse), e_lse)
    # another seed is another mask; a Python int seed is the same mask as its words
    other = fwd(q, k, v, words(SEED + 1))[0]
    assert not np.array_equal(np.asarray(other), e_out)
    static = jax.jit(lambda q, k, v: fj.attention(q, k, v, seed=SEED, **opts))(q, k, v)
    np.testing.assert_array_equal(np.asarray(static), e_out)

    def loss(q, k, v, s):
        return (fj.attention(q, k, v, seed=s, **opts) * dout).sum()
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, words(SEED))
    expect = flashdl.attention_backward(dout, q, k, v, e_out, e_lse, seed=SEED, **opts)
    for g, e in zip(grads, expect):
        np.testing.assert_array_equal(np.asarray(g), e)


def test_dropout_seed_forms_and_errors():
    q, k, v = arrays([(1, 8, 2, 8)] * 3)
    e = flashdl.attention(q, k, v, dropout_p=0.5, seed=5)
    for s in (jnp.uint32(5), jnp.array([5, 0], jnp.uint32)):
        got = jax.jit(lambda q, s: fj.attention(q, k, v, dropout_p=0.5, seed=s))(q, s)
        np.testing.assert_array_equal(np.asarray(got), e)
    key = jax.random.key(3)  # a typed key: its threefry words are the seed
    kd = np.asarray(jax.random.key_data(key)).astype(np.uint64)
    got = fj.attention(q, k, v, dropout_p=0.5, seed=key)
    e_key = flashdl.attention(q, k, v, dropout_p=0.5, seed=int(kd[0] | (kd[1] << np.uint64(32))))
    np.testing.assert_array_equal(np.asarray(got), e_key)
    with pytest.raises(TypeError, match=r"^seed: dropout_p > 0"):
        jax.jit(lambda q: fj.attention(q, k, v, dropout_p=0.1))(q)
    with pytest.raises(TypeError, match=r"^seed: expected"):
        fj.attention(q, k, v, dropout_p=0.1, seed=jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match=r"dropout_p"):
        fj.attention(q, k, v, dropout_p=1.5, seed=1)
    with pytest.raises(TypeError, match=r"^dropout_p"):
        jax.jit(lambda q, p: fj.attention(q, k, v, dropout_p=p, seed=1))(q, 0.1)


def test_dropout_vmap_runs_each_element_with_its_own_seed():
    q, k, v = arrays([(3, 2, 10, 2, 8)] * 3)
    seeds = jnp.array([[1, 0], [2, 0], [3, 0]], jnp.uint32)
    got = jax.vmap(lambda q, k, v, s: fj.attention(q, k, v, dropout_p=0.3, seed=s))(q, k, v, seeds)
    for i in range(3):
        e = flashdl.attention(q[i], k[i], v[i], dropout_p=0.3, seed=i + 1)
        np.testing.assert_array_equal(np.asarray(got[i]), e)


@pytest.mark.parametrize("mask_shape", [(2, 3), (1, 4, 2, 3), (2, 1, 2, 3)])
def test_block_mask_alibi_softcap_jit_grad_vmap(mask_shape):
    q, k, v, dout = arrays([(2, 20, 4, 16), (2, 40, 2, 16), (2, 40, 2, 16), (2, 20, 4, 16)])
    rng = np.random.default_rng(1)
    mask = rng.random(mask_shape) < 0.6
    slopes = rng.uniform(0.01, 0.5, (4,)).astype(np.float32)
    opts = dict(block_size=(16, 16), softcap=3.0, causal=True)

    def f(q, k, v, m, s):
        return fj.attention(q, k, v, block_mask=m, alibi_slopes=s, return_lse=True, **opts)
    out, lse = jax.jit(f)(q, k, v, mask, slopes)
    e_out, e_lse = flashdl.attention(q, k, v, block_mask=mask, alibi_slopes=slopes,
                                     return_lse=True, **opts)
    np.testing.assert_array_equal(np.asarray(out), e_out)
    np.testing.assert_array_equal(np.asarray(lse), e_lse)
    grads = jax.jit(jax.grad(lambda q, k, v: (f(q, k, v, mask, slopes)[0] * dout).sum(),
                             argnums=(0, 1, 2)))(q, k, v)
    expect = flashdl.attention_backward(dout, q, k, v, e_out, e_lse, block_mask=mask,
                                        alibi_slopes=slopes, **opts)
    for g, e in zip(grads, expect):
        np.testing.assert_array_equal(np.asarray(g), e)
    # vmap over q only: folded into the batch, the same as one call per element
    qs = np.stack([q, q[::-1]])
    got = jax.vmap(lambda q: f(q, k, v, mask, slopes)[0])(qs)
    for i in range(2):
        e = flashdl.attention(qs[i], k, v, block_mask=mask, alibi_slopes=slopes, **opts)
        np.testing.assert_array_equal(np.asarray(got[i]), e)


def test_block_mask_and_alibi_errors_name_the_argument():
    q, k, v = arrays([(2, 20, 4, 16)] * 3)
    with pytest.raises(ValueError, match=r"block_mask"):
        fj.attention(q, k, v, block_mask=np.ones((3, 3), bool), block_size=16)
    with pytest.raises(TypeError, match=r"block_mask"):
        fj.attention(q, k, v, block_mask=np.ones((2, 2), np.int32), block_size=16)
    with pytest.raises(TypeError, match=r"^block_mask"):
        fj.attention(q, k, v, block_mask=[[True]], block_size=16)
    with pytest.raises(ValueError, match=r"alibi_slopes"):
        fj.attention(q, k, v, alibi_slopes=np.ones((3,), np.float32))
    with pytest.raises(TypeError, match=r"^block_size"):
        jax.jit(lambda q, b: fj.attention(q, k, v, block_mask=np.ones((2, 2), bool),
                                          block_size=b))(q, 16)


def test_plain_call_hlo_is_unchanged():
    q = jnp.ones((1, 4, 1, 8), jnp.float32)
    text = jax.jit(lambda q: fj.attention(q, q, q)).lower(q).as_text()
    assert "dropout_p" not in text and "has_alibi" not in text and "has_block_mask" not in text


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_append_is_functional_and_donatable(paged):
    b, s, hk, h, d, new = 2, 32, 2, 4, 16, 3
    kc, vc = arrays([(b, s, hk, d)] * 2, seed=1)
    q, kn, vn = arrays([(b, new, h, d), (b, new, hk, d), (b, new, hk, d)], seed=2)
    n = np.array([5, 20], np.int32)
    slopes = np.linspace(0.1, 0.4, h).astype(np.float32)
    opts = dict(causal=True, alibi_slopes=slopes, softcap=4.0)
    e_k, e_v = kc.copy(), vc.copy()
    e_out, e_lse = flashdl.attention_with_kvcache(q, e_k, e_v, cache_seqlens=n, k=kn, v=vn,
                                                  return_lse=True, **opts)
    table = None
    if paged:  # pages of 4 rows, in reverse order
        pages = b * s // 4
        table = (pages - 1 - np.arange(pages)).reshape(b, s // 4).astype(np.int32)
        kc, vc = (x.reshape(pages, 4, hk, d)[::-1].copy() for x in (kc, vc))
    kc0 = kc.copy()

    def step(q, kc, vc, n, k, v, table):
        return fj.attention_with_kvcache(q, kc, vc, cache_seqlens=n, k=k, v=v,
                                         block_table=table, return_lse=True, **opts)
    j_kc = jnp.asarray(kc)
    out, lse, new_k, new_v = jax.jit(step)(q, j_kc, jnp.asarray(vc), n, kn, vn, table)
    np.testing.assert_array_equal(np.asarray(out), e_out)
    np.testing.assert_array_equal(np.asarray(lse), e_lse)
    np.testing.assert_array_equal(np.asarray(j_kc), kc0)  # not donated: never written
    if paged:
        new_k = np.asarray(new_k)[::-1].reshape(b, s, hk, d)
        new_v = np.asarray(new_v)[::-1].reshape(b, s, hk, d)
    np.testing.assert_array_equal(np.asarray(new_k), e_k)
    np.testing.assert_array_equal(np.asarray(new_v), e_v)
    # donated: the append reuses the cache buffers
    donated = jnp.asarray(kc)
    res = jax.jit(step, donate_argnums=(1, 2))(q, donated, jnp.asarray(vc), n, kn, vn, table)
    assert donated.is_deleted()
    np.testing.assert_array_equal(np.asarray(res[0]), e_out)


def test_kvcache_read_only_vmap_and_errors():
    kc, vc = arrays([(2, 16, 1, 8)] * 2, seed=3)
    (q,) = arrays([(3, 2, 1, 2, 8)], seed=4)
    n = np.array([4, 16], np.int32)
    got = jax.vmap(lambda q: fj.attention_with_kvcache(q, kc, vc, cache_seqlens=n))(q)
    for i in range(3):
        e = flashdl.attention_with_kvcache(q[i], kc, vc, cache_seqlens=n)
        np.testing.assert_array_equal(np.asarray(got[i]), e)
    with pytest.raises(TypeError, match=r"^cache_seqlens"):
        fj.attention_with_kvcache(q[0], kc, vc, cache_seqlens=n.astype(np.float32))
    with pytest.raises(ValueError, match=r"^v: pass both"):
        fj.attention_with_kvcache(q[0], kc, vc, cache_seqlens=n, k=kc[:, :1])
    with pytest.raises(ValueError, match=r"^cache_seqlens: expected shape \(2,\)"):
        fj.attention_with_kvcache(q[0], kc, vc, cache_seqlens=n[:1])
    with pytest.raises(Exception, match=r"cache_seqlens.*capacity"):  # values: when it runs
        fj.attention_with_kvcache(q[0], kc, vc, cache_seqlens=np.array([16, 16], np.int32),
                                  k=kc[:, :1], v=vc[:, :1])


def test_merge_states_jit_grad_vmap():
    q, k, v = arrays([(2, 6, 2, 8), (2, 20, 2, 8), (2, 20, 2, 8)], seed=5)
    parts = [flashdl.attention(q, k[:, a:b], v[:, a:b], return_lse=True)
             for a, b in ((0, 7), (7, 7), (7, 20))]  # the middle one is empty: lse -inf
    outs, lses = [p[0] for p in parts], [p[1] for p in parts]
    out, lse = jax.jit(fj.merge_states)(outs, lses)
    e_out, e_lse = flashdl.merge_states_list(outs, lses)
    np.testing.assert_array_equal(np.asarray(out), e_out)
    np.testing.assert_array_equal(np.asarray(lse), e_lse)

    def ref(outs, lses):
        lse = jax.nn.logsumexp(jnp.stack(lses), axis=0)
        return sum(jnp.swapaxes(jnp.exp(l - lse), -1, -2)[..., None] * o
                   for o, l in zip(outs, lses)), lse
    w = arrays([(2, 6, 2, 8)], seed=6)[0]

    def loss(fn):
        return lambda outs, lses: (lambda r: (r[0] * w).sum() + (r[1] ** 2).sum())(
            fn(outs, lses))
    got = jax.jit(jax.grad(loss(fj.merge_states), argnums=(0, 1)))(outs[::2], lses[::2])
    want = jax.jit(jax.grad(loss(ref), argnums=(0, 1)))(outs[::2], lses[::2])
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-6)
    vm = jax.vmap(fj.merge_states)([np.stack([o, o]) for o in outs],
                                   [np.stack([l, l]) for l in lses])
    np.testing.assert_array_equal(np.asarray(vm[0][1]), e_out)
    with pytest.raises(ValueError, match=r"^lses: expected one lse per output"):
        fj.merge_states(outs, lses[:2])
    with pytest.raises(ValueError, match=r"^lses\[1\]"):
        fj.merge_states(outs[:2], [lses[0], lses[1][:1]])
    with pytest.raises(ValueError, match=r"^outs\[1\]"):
        fj.merge_states([outs[0], outs[1][:, :2]], lses[:2])


def test_zero_length_inputs():
    q, k, v = (np.zeros((0, 5, 2, 8), np.float32),) * 3
    out = jax.jit(lambda q, k, v: fj.attention(q, k, v, dropout_p=0.1, seed=1,
                                               alibi_slopes=np.ones(2, np.float32)))(q, k, v)
    assert out.shape == q.shape
    out, lse = fj.merge_states([np.zeros((1, 0, 2, 8), np.float32)],
                               [np.zeros((1, 2, 0), np.float32)])
    assert out.shape == (1, 0, 2, 8) and lse.shape == (1, 2, 0)


def test_varlen_dropout_block_mask_alibi_match_eager():
    cu = np.array([0, 7, 7, 20], np.int32)
    q, k, v, dout = arrays([(20, 4, 16), (20, 2, 16), (20, 2, 16), (20, 4, 16)], seed=7)
    mask = np.random.default_rng(8).random((3, 1, 2, 2)) < 0.7
    slopes = np.linspace(0.1, 0.3, 4).astype(np.float32)
    opts = dict(causal=True, dropout_p=0.2, offset=1, block_size=8, softcap=2.0)

    def f(q, k, v, s):
        return fj.attention_varlen(q, k, v, cu, cu, 13, 13, seed=s, block_mask=mask,
                                   alibi_slopes=slopes, return_lse=True, **opts)
    out, lse = jax.jit(f)(q, k, v, words(SEED))
    e_out, e_lse = flashdl.attention_varlen(q, k, v, cu, cu, 13, 13, seed=SEED, block_mask=mask,
                                            alibi_slopes=slopes, return_lse=True, **opts)
    np.testing.assert_array_equal(np.asarray(out), e_out)
    np.testing.assert_array_equal(np.asarray(lse), e_lse)
    grads = jax.jit(jax.grad(lambda q, k, v: (f(q, k, v, words(SEED))[0] * dout).sum(),
                             argnums=(0, 1, 2)))(q, k, v)
    want = flashdl.attention_varlen_backward(dout, q, k, v, e_out, e_lse, cu, cu, 13, 13,
                                             seed=SEED, block_mask=mask, alibi_slopes=slopes,
                                             **opts)
    for g, e in zip(grads, want):
        np.testing.assert_array_equal(np.asarray(g), e)


def test_zero_length_kvcache_and_ring():
    from jax.sharding import Mesh, PartitionSpec as P
    out = fj.attention_with_kvcache(jnp.zeros((0, 1, 2, 8)), jnp.zeros((0, 4, 1, 8)),
                                    jnp.zeros((0, 4, 1, 8)),
                                    cache_seqlens=jnp.zeros((0,), jnp.int32))
    assert out.shape == (0, 1, 2, 8)
    mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
    ring = jax.shard_map(lambda q: fj.ring_attention(q, q, q, axis_name="sp", causal=True,
                                                     return_lse=True),
                         mesh=mesh, in_specs=P(None, "sp"), out_specs=(P(None, "sp"),
                                                                       P(None, None, "sp")))
    out, lse = jax.jit(ring)(jnp.zeros((1, 0, 2, 8)))
    assert out.shape == (1, 0, 2, 8) and lse.shape == (1, 2, 0)
    dq = jax.grad(lambda q: ring(q)[0].sum())(jnp.zeros((1, 0, 2, 8)))
    assert dq.shape == (1, 0, 2, 8)
