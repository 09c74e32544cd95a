"""flashdl.jax.attention_with_kvcache with rotary embedding, cache_batch_idx and cache_leftpad
(issue 29): under jax.jit (the append donated and not) and jax.vmap, each result bitwise equal to
the eager flashdl.attention_with_kvcache on the same NumPy arrays (the same kernels), the extras'
shapes and dtypes refused at trace time naming the argument, their values when the call runs, and
a plain call's HLO free of the extras' attributes."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import flashdl  # noqa: E402
import flashdl.jax as fj  # noqa: E402

B, S, HK, H, D, NEW, ROWS = 3, 32, 2, 4, 16, 3, 5


def arrays(shapes, dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    return [np.asarray(rng.standard_normal(s), dtype=dtype) for s in shapes]


def rotary(rotary_dim, seqlen_ro=S, dtype="float32"):
    inv = 1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    ang = np.arange(seqlen_ro)[:, None] * inv[None, :]
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("extras", ["rotary", "batch_idx", "leftpad", "all"])
def test_append_matches_eager_bitwise(interleaved, causal, extras):
    kc, vc = arrays([(ROWS, S, HK, D)] * 2, seed=1)
    q, kn, vn = arrays([(B, NEW, H, D), (B, NEW, HK, D), (B, NEW, HK, D)], seed=2)
    n = np.array([5, 20, 11], np.int32)
    kw = {}
    if extras in ("rotary", "all"):
        cos, sin = rotary(D // 2 if interleaved else D)
        kw.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)
    if extras in ("batch_idx", "all"):
        kw.update(cache_batch_idx=np.array([4, 0, 2], np.int32))
    else:
        kc, vc = kc[:B].copy(), vc[:B].copy()
    if extras in ("leftpad", "all"):
        kw.update(cache_leftpad=np.array([2, 0, 11], np.int32))
    e_k, e_v = kc.copy(), vc.copy()
    e_out, e_lse = flashdl.attention_with_kvcache(q, e_k, e_v, cache_seqlens=n, k=kn, v=vn,
                                                  causal=causal, return_lse=True, **kw)

    def step(q, kc, vc, n, k, v, kw):
        return fj.attention_with_kvcache(q, kc, vc, cache_seqlens=n, k=k, v=v, causal=causal,
                                         return_lse=True, **kw)
    j_kc = jnp.asarray(kc)
    jkw = {key: (val if isinstance(val, bool) else jnp.asarray(val)) for key, val in kw.items()}
    static = {key: val for key, val in jkw.items() if isinstance(val, bool)}
    dyn = {key: val for key, val in jkw.items() if not isinstance(val, bool)}
    f = jax.jit(lambda q, kc, vc, n, k, v, d: step(q, kc, vc, n, k, v, {**d, **static}))
    out, lse, new_k, new_v = f(q, j_kc, jnp.asarray(vc), n, kn, vn, dyn)
    np.testing.assert_array_equal(np.asarray(out), e_out)
    np.testing.assert_array_equal(np.asarray(lse), e_lse)
    np.testing.assert_array_equal(np.asarray(new_k), e_k)
    np.testing.assert_array_equal(np.asarray(new_v), e_v)
    np.testing.assert_array_equal(np.asarray(j_kc), kc)  # not donated: never written
    if extras != "batch_idx":  # the extras change the result (so the test can fail)
        plain = fj.attention_with_kvcache(q, jnp.asarray(kc[:B] if extras == "all" else kc),
                                          jnp.asarray(vc[:B] if extras == "all" else vc),
                                          cache_seqlens=n, k=kn, v=vn, causal=causal)[0]
        assert not np.array_equal(np.asarray(plain), e_out)
    donated = jnp.asarray(kc)
    g = jax.jit(lambda q, kc, vc, n, k, v, d: step(q, kc, vc, n, k, v, {**d, **static}),
                donate_argnums=(1, 2))
    res = g(q, donated, jnp.asarray(vc), n, kn, vn, dyn)
    assert donated.is_deleted()
    np.testing.assert_array_equal(np.asarray(res[0]), e_out)
    np.testing.assert_array_equal(np.asarray(res[2]), e_k)


def test_paged_rotary_leftpad_matches_eager():
    kc, vc = arrays([(B, S, HK, D)] * 2, seed=3)
    q, kn, vn = arrays([(B, 1, H, D), (B, 1, HK, D), (B, 1, HK, D)], seed=4)
    n = np.array([7, 0, 30], np.int32)
    cos, sin = rotary(8)
    kw = dict(rotary_cos=cos, rotary_sin=sin, cache_leftpad=np.array([3, 0, 1], np.int32),
              causal=True)
    e_k, e_v = kc.copy(), vc.copy()
    e_out = flashdl.attention_with_kvcache(q, e_k, e_v, cache_seqlens=n, k=kn, v=vn, **kw)
    pages = B * S // 4  # pages of 4 rows, in reverse order
    table = (pages - 1 - np.arange(pages)).reshape(B, S // 4).astype(np.int32)
    pk, pv = (x.reshape(pages, 4, HK, D)[::-1].copy() for x in (kc, vc))
    out, new_k, _ = jax.jit(lambda *a: fj.attention_with_kvcache(
        a[0], a[1], a[2], cache_seqlens=a[3], k=a[4], v=a[5], block_table=a[6], **kw))(
            q, pk, pv, n, kn, vn, table)
    np.testing.assert_array_equal(np.asarray(out), e_out)
    np.testing.assert_array_equal(np.asarray(new_k)[::-1].reshape(B, S, HK, D), e_k)


def test_vmap_read_only_with_extras():
    kc, vc = arrays([(ROWS, S, HK, D)] * 2, seed=5)
    (q,) = arrays([(2, B, 2, H, D)], seed=6)
    n = np.array([4, 32, 9], np.int32)
    cos, sin = rotary(D, S + 1)  # q's rows rotate at cache_seqlens[b] (not causal): up to 32
    kw = dict(rotary_cos=cos, rotary_sin=sin, cache_batch_idx=np.array([1, 3, 0], np.int32),
              cache_leftpad=np.array([0, 5, 9], np.int32))
    got = jax.vmap(lambda q: fj.attention_with_kvcache(q, kc, vc, cache_seqlens=n, **kw))(q)
    for i in range(q.shape[0]):
        e = flashdl.attention_with_kvcache(q[i], kc, vc, cache_seqlens=n, **kw)
        np.testing.assert_array_equal(np.asarray(got[i]), e)


def test_plain_hlo_unchanged_and_extras_in_hlo():
    kc = jnp.zeros((2, 8, 1, 8), jnp.float32)
    q = jnp.ones((2, 1, 1, 8), jnp.float32)
    n = jnp.array([1, 2], jnp.int32)
    plain = jax.jit(lambda q: fj.attention_with_kvcache(q, kc, kc, cache_seqlens=n)).lower(q)
    text = plain.as_text()
    assert "has_rotary" not in text and "has_batch_idx" not in text and \
        "has_leftpad" not in text and "rotary_interleaved" not in text
    cos, sin = (jnp.asarray(x) for x in rotary(8, 8))
    ext = jax.jit(lambda q: fj.attention_with_kvcache(
        q, kc, kc, cache_seqlens=n, rotary_cos=cos, rotary_sin=sin,
        cache_leftpad=jnp.zeros(2, jnp.int32))).lower(q).as_text()
    assert "has_rotary" in ext and "has_leftpad" in ext and "has_batch_idx" not in ext


def test_errors_name_the_argument():
    kc, vc = arrays([(2, 8, 1, 8)] * 2, seed=7)
    (q,) = arrays([(2, 1, 2, 8)], seed=8)
    n = np.array([3, 8], np.int32)
    cos, sin = rotary(8, 8)

    def call(**kw):
        return fj.attention_with_kvcache(q, kc, vc, cache_seqlens=n, **kw)
    with pytest.raises(ValueError, match=r"^rotary_sin: expected both"):
        call(rotary_cos=cos)
    with pytest.raises(ValueError, match=r"^rotary_cos: expected both"):
        call(rotary_sin=sin)
    with pytest.raises(TypeError, match=r"^rotary_cos: expected dtype float32"):
        call(rotary_cos=cos.astype(np.float16), rotary_sin=sin)
    with pytest.raises(ValueError, match=r"^rotary_cos: expected \(seqlen_ro, rotary_dim / 2\)"):
        call(rotary_cos=rotary(10, 8)[0], rotary_sin=rotary(10, 8)[1])
    with pytest.raises(ValueError, match=r"^rotary_sin: expected the shape of rotary_cos"):
        call(rotary_cos=cos, rotary_sin=sin[:4])
    with pytest.raises(TypeError, match=r"^rotary_interleaved"):
        call(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=1)
    with pytest.raises(TypeError, match=r"^cache_batch_idx: expected an int32 array"):
        call(cache_batch_idx=np.array([0, 1], np.float32))
    with pytest.raises(ValueError, match=r"^cache_batch_idx: expected shape \(2,\)"):
        call(cache_batch_idx=np.array([0], np.int32))
    with pytest.raises(TypeError, match=r"^cache_leftpad: expected an int32 array"):
        call(cache_leftpad=[0, 1])
    with pytest.raises(ValueError, match=r"^cache_leftpad: expected shape \(2,\)"):
        call(cache_leftpad=np.zeros(3, np.int32))
    with pytest.raises(ValueError, match=r"^cache_batch_idx: not supported with a paged cache"):
        call(cache_batch_idx=np.array([0, 1], np.int32),
             block_table=np.array([[0], [1]], np.int32))
    # values: when the call runs, with the core's message
    with pytest.raises(Exception, match=r"cache_leftpad"):
        jax.block_until_ready(call(cache_leftpad=np.array([4, 0], np.int32)))
    with pytest.raises(Exception, match=r"cache_batch_idx"):
        jax.block_until_ready(call(cache_batch_idx=np.array([0, 2], np.int32)))
    with pytest.raises(Exception, match=r"cache_batch_idx"):  # repeated where k, v are appended
        jax.block_until_ready(fj.attention_with_kvcache(
            q, kc, vc, cache_seqlens=np.array([1, 1], np.int32), k=kc[:, :1], v=vc[:, :1],
            cache_batch_idx=np.array([1, 1], np.int32)))


# ---- sinks, bias and boolean mask (issue 28) ------------------------------------------------------

def _bias_mask_sinks(seed, dtype="float32"):
    rng = np.random.default_rng(seed)
    bias = rng.standard_normal((B, H, NEW, S)).astype(dtype)
    mask = rng.random((B, 1, NEW, S)) < 0.8
    sinks = (rng.standard_normal(H) * 2).astype(np.float32)
    return bias, mask, sinks


@pytest.mark.parametrize("which", ["sinks", "bias", "mask", "all", "row bias + leftpad"])
def test_bias_mask_sinks_match_eager_bitwise(which):
    """Under jax.jit (the append donated) the cache call with sinks, a bias and/or a mask equals the
    eager call on the same arrays bit for bit, out, lse and the caches."""
    kc, vc = arrays([(B, S, HK, D)] * 2, seed=11)
    q, kn, vn = arrays([(B, NEW, H, D), (B, NEW, HK, D), (B, NEW, HK, D)], seed=12)
    n = np.array([5, 20, 11], np.int32)
    bias, mask, sinks = _bias_mask_sinks(13)
    kw = {"sinks": dict(sinks=sinks), "bias": dict(bias=bias), "mask": dict(mask=mask),
          "all": dict(sinks=sinks, bias=bias, mask=mask),
          "row bias + leftpad": dict(bias=bias[0, :, :1], cache_leftpad=np.array([2, 0, 7],
                                                                               np.int32))}[which]
    e_k, e_v = kc.copy(), vc.copy()
    e_out, e_lse = flashdl.attention_with_kvcache(q, e_k, e_v, cache_seqlens=n, k=kn, v=vn,
                                                  causal=True, return_lse=True, **kw)
    f = jax.jit(lambda q, kc, vc, n, k, v, d: fj.attention_with_kvcache(
        q, kc, vc, cache_seqlens=n, k=k, v=v, causal=True, return_lse=True, **d),
        donate_argnums=(1, 2))
    out, lse, new_k, new_v = f(q, jnp.asarray(kc), jnp.asarray(vc), n, kn, vn,
                               {key: jnp.asarray(val) for key, val in kw.items()})
    np.testing.assert_array_equal(np.asarray(out), e_out)
    np.testing.assert_array_equal(np.asarray(lse), e_lse)
    np.testing.assert_array_equal(np.asarray(new_k), e_k)
    np.testing.assert_array_equal(np.asarray(new_v), e_v)


def test_bias_mask_sinks_vmap_and_hlo():
    kc, vc = arrays([(B, S, HK, D)] * 2, seed=14)
    (q,) = arrays([(2, B, NEW, H, D)], seed=15)
    n = np.array([4, 29, 9], np.int32)
    bias, mask, sinks = _bias_mask_sinks(16)
    kw = dict(sinks=sinks, bias=bias, mask=mask)
    got = jax.vmap(lambda q: fj.attention_with_kvcache(q, kc, vc, cache_seqlens=n, **kw))(q)
    for i in range(q.shape[0]):
        e = flashdl.attention_with_kvcache(q[i], kc, vc, cache_seqlens=n, **kw)
        np.testing.assert_array_equal(np.asarray(got[i]), e)
    text = jax.jit(lambda q: fj.attention_with_kvcache(q[0], kc, vc, cache_seqlens=n)).lower(
        q).as_text()
    assert "has_sinks" not in text and "has_bias" not in text and "has_mask" not in text
    text = jax.jit(lambda q: fj.attention_with_kvcache(q[0], kc, vc, cache_seqlens=n,
                                                       **kw)).lower(q).as_text()
    assert "has_sinks" in text and "has_bias" in text and "has_mask" in text


def test_bias_mask_sinks_errors_name_the_argument():
    kc, vc = arrays([(B, S, HK, D)] * 2, seed=17)
    (q,) = arrays([(B, NEW, H, D)], seed=18)
    n = np.array([3, 8, 1], np.int32)

    def call(**kw):
        return fj.attention_with_kvcache(q, kc, vc, cache_seqlens=n, **kw)
    with pytest.raises(TypeError, match=r"^sinks: expected a float32 array of shape \(4,\)"):
        call(sinks=np.zeros(3, np.float32))
    with pytest.raises(TypeError, match=r"^sinks: expected a float32"):
        call(sinks=np.zeros(4, np.int32))
    with pytest.raises(ValueError, match=r"^bias: expected a shape broadcastable to \(3, 4, 3, 32\)"):
        call(bias=np.zeros((3, 4, 3, 31), np.float32))
    with pytest.raises(ValueError, match=r"^bias: expected a shape broadcastable"):
        call(bias=np.zeros((2, 4, 3, 32), np.float32))
    with pytest.raises(TypeError, match=r"^bias: expected dtype float32, float16 or bfloat16"):
        call(bias=np.zeros((32,), np.int32))
    with pytest.raises(TypeError, match=r"^mask: expected dtype bool"):
        call(mask=np.ones((32,), np.float32))
    with pytest.raises(ValueError, match=r"^mask: expected a shape broadcastable"):
        call(mask=np.ones((1, 1, 1, 1, 32), bool))
    # NaN sinks: the core refuses them when the call runs (host values on the CPU)
    with pytest.raises(Exception, match=r"sinks: expected finite"):
        jax.block_until_ready(call(sinks=np.array([0, np.nan, 0, 0], np.float32)))
