"""flashdl.jax with an additive bias (dBias), a boolean mask and learnable sinks (dSinks), issue 28:
eager, under jax.jit, jax.grad and jax.vmap, dense and varlen. Each result is compared with the
eager flashdl call on the same NumPy arrays (the same kernels: bitwise, dBias within 1e-6 where
JAX sums a broadcast bias's gradient over batch and heads), and with the float64 oracle of
test_bias_mask_sinks.py by flash-attn's rule."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import flashdl  # noqa: E402
import flashdl.jax as fj  # noqa: E402
from test_bias_mask_sinks import check_all  # noqa: E402

B, SQ, SK, H, HK, D = 2, 19, 27, 4, 2, 16


def arrays(shapes, dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    return [np.asarray(rng.standard_normal(s), dtype=dtype) for s in shapes]


def qkv(seed=0):
    return arrays([(B, SQ, H, D), (B, SK, HK, D), (B, SK, HK, D), (B, SQ, H, D)], seed=seed)


def extras(bias_shape, mask_shape, with_sinks, seed=1):
    rng = np.random.default_rng(seed)
    bias = None if bias_shape is None else rng.standard_normal(bias_shape).astype(np.float32)
    mask = None if mask_shape is None else rng.random(mask_shape) < 0.7
    sinks = rng.standard_normal((H,)).astype(np.float32) if with_sinks else None
    return bias, mask, sinks


def eager(q, k, v, dout, **kw):
    """(out, lse, dq, dk, dv, dbias or None, dsinks or None) of the eager calls."""
    out, lse = flashdl.attention(q, k, v, return_lse=True, **kw)
    dq, dk, dv, *rest = flashdl.attention_backward(dout, q, k, v, out, lse, **kw)
    dbias = rest.pop(0) if kw.get("bias") is not None else None
    dsinks = rest.pop(0) if kw.get("sinks") is not None else None
    return out, lse, dq, dk, dv, dbias, dsinks


def jax_grads(q, k, v, dout, bias, mask, sinks, jit=True, **opts):
    """dq, dk, dv, dbias, dsinks of (attention * dout).sum() by jax.grad (None where not given)."""
    def loss(q, k, v, bias, sinks):
        return (fj.attention(q, k, v, bias=bias, mask=mask, sinks=sinks, **opts) * dout).sum()
    argnums = (0, 1, 2) + ((3,) if bias is not None else ()) + ((4,) if sinks is not None else ())
    g = jax.grad(loss, argnums=argnums)
    got = list((jax.jit(g) if jit else g)(q, k, v, bias, sinks))
    dq, dk, dv = got[:3]
    rest = got[3:]
    dbias = rest.pop(0) if bias is not None else None
    dsinks = rest.pop(0) if sinks is not None else None
    return dq, dk, dv, dbias, dsinks


def assert_same(got, want, what, close=False):
    assert (got is None) == (want is None), what
    if want is None:
        return
    got = np.asarray(got)
    assert got.shape == np.shape(want), (what, got.shape, np.shape(want))
    if close:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


CASES = {
    # name: (bias shape, mask shape, sinks, causal)
    "full bias": ((B, H, SQ, SK), None, False, False),
    "head bias, mask, sinks, causal": ((1, H, SQ, SK), (B, 1, SQ, SK), True, True),
    "2-d bias": ((SQ, SK), None, False, True),
    "key-only bias, per-head mask": ((SK,), (1, H, SQ, SK), False, False),
    "row-broadcast bias, sinks": ((B, H, 1, SK), None, True, False),
    "mask only": (None, (SQ, SK), False, False),
    "sinks only": (None, None, True, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_grads_match_eager_and_oracle(name):
    bias_shape, mask_shape, with_sinks, causal = CASES[name]
    q, k, v, dout = qkv()
    bias, mask, sinks = extras(bias_shape, mask_shape, with_sinks)
    kw = dict(bias=bias, mask=mask, sinks=sinks, causal=causal)
    want = eager(q, k, v, dout, **kw)
    # eager and jitted forward: the eager call's bits
    out, lse = fj.attention(q, k, v, return_lse=True, **kw)
    assert_same(out, want[0], "out (eager)")
    assert_same(lse, want[1], "lse (eager)")
    out, lse = jax.jit(lambda q, k, v, b, m, s: fj.attention(
        q, k, v, bias=b, mask=m, sinks=s, causal=causal, return_lse=True))(q, k, v, bias, mask,
                                                                          sinks)
    assert_same(out, want[0], "out (jit)")
    assert_same(lse, want[1], "lse (jit)")
    # jax.grad with respect to q, k, v, bias and sinks (eagerly and under jit)
    for jit in (False, True):
        got = jax_grads(q, k, v, dout, bias, mask, sinks, jit=jit, causal=causal)
        for g, w, n in zip(got, want[2:], ("dq", "dk", "dv", "dbias", "dsinks")):
            # dBias of a bias broadcast over batch or heads: JAX sums the per-plane gradients
            assert_same(g, w, f"{n} (jit={jit})", close=n == "dbias")
    # and the float64 oracle
    check_all((out, lse) + got, q, k, v, dout, "float32", causal=causal, bias=bias, mask=mask,
              sinks=sinks)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_fully_masked_rows(with_sinks):
    q, k, v, dout = qkv(seed=3)
    bias, mask, sinks = extras((B, H, SQ, SK), (B, H, SQ, SK), with_sinks, seed=4)
    mask[0, :, 3] = False  # every head of row 3 of batch 0 sees no key
    mask[1, 2, 5:9] = False
    kw = dict(bias=bias, mask=mask, sinks=sinks)
    want = eager(q, k, v, dout, **kw)
    out, lse = jax.jit(lambda q, k, v: fj.attention(q, k, v, return_lse=True, **kw))(q, k, v)
    assert_same(out, want[0], "out")
    assert_same(lse, want[1], "lse")
    assert not np.asarray(out[0, 3]).any()
    if with_sinks:
        np.testing.assert_allclose(np.asarray(lse)[0, :, 3], sinks, rtol=1e-6)
    else:
        assert np.isneginf(np.asarray(lse)[0, :, 3]).all()
    got = jax_grads(q, k, v, dout, bias, mask, sinks)
    for g, w, n in zip(got, want[2:], ("dq", "dk", "dv", "dbias", "dsinks")):
        assert_same(g, w, n, close=n == "dbias")
        if g is not None:
            assert np.isfinite(np.asarray(g)).all(), n
    assert not np.asarray(got[3])[0, :, 3].any()  # no gradient through a masked row's bias


def test_mask_has_no_gradient_and_bias_dtype_is_kept():
    q, k, v, dout = qkv(seed=5)
    bias, mask, _ = extras((H, SQ, SK), (SQ, SK), False, seed=6)
    f = lambda m: (fj.attention(q, k, v, bias=bias, mask=m) * dout).sum()  # noqa: E731
    with pytest.raises(TypeError):  # bool inputs have no gradient in JAX
        jax.grad(f)(mask)
    # the gradient of a float input that the mask is made from is zero, not an error
    m = jax.grad(lambda x: f(x > 0).astype(jnp.float32))(np.ones((SQ, SK), np.float32))
    assert not np.asarray(m).any()
    # a float16 bias with float16 q, k, v: dbias in float16
    q16, k16, v16, d16 = (x.astype(np.float16) for x in (q, k, v, dout))
    b16 = bias.astype(np.float16)
    g = jax.grad(lambda b: (fj.attention(q16, k16, v16, bias=b).astype(jnp.float32)
                            * d16.astype(np.float32)).sum())(b16)
    assert g.dtype == jnp.float16 and g.shape == b16.shape


def test_bhsd_layout():
    q, k, v, dout = qkv(seed=7)
    bias, mask, sinks = extras((1, H, SQ, SK), (B, 1, SQ, SK), True, seed=8)
    kw = dict(bias=bias, mask=mask, sinks=sinks, causal=True)
    t = lambda x: np.ascontiguousarray(np.swapaxes(x, 1, 2))  # noqa: E731
    want = flashdl.attention(q, k, v, **kw)
    got = jax.jit(lambda q, k, v: fj.attention(q, k, v, layout="bhsd", **kw))(t(q), t(k), t(v))
    np.testing.assert_array_equal(np.asarray(got), t(want))


def test_vmap_unmapped_and_mapped_extras():
    q, k, v, dout = qkv(seed=9)
    bias, mask, sinks = extras((1, H, SQ, SK), (B, 1, SQ, SK), True, seed=10)
    qs, ks, vs = (np.stack([x, x[::-1] * 0.5]) for x in (q, k, v))
    # extras not mapped: every element sees the same bias, mask and sinks
    got = jax.jit(jax.vmap(lambda q, k, v: fj.attention(q, k, v, bias=bias, mask=mask,
                                                        sinks=sinks, causal=True)))(qs, ks, vs)
    for i in range(2):
        want = flashdl.attention(qs[i], ks[i], vs[i], bias=bias, mask=mask, sinks=sinks,
                                 causal=True)
        np.testing.assert_array_equal(np.asarray(got[i]), want)
    # bias and mask mapped too (one per element), sinks not
    biases = np.stack([bias, -bias])
    masks = np.stack([mask, ~mask])
    f = lambda q, k, v, b, m: fj.attention(q, k, v, bias=b, mask=m, sinks=sinks)  # noqa: E731
    got = jax.vmap(f)(qs, ks, vs, biases, masks)
    for i in range(2):
        want = flashdl.attention(qs[i], ks[i], vs[i], bias=biases[i], mask=masks[i], sinks=sinks)
        np.testing.assert_array_equal(np.asarray(got[i]), want)
    # vmap of the gradient: dbias and dsinks per element
    douts = np.stack([dout, dout * 2])

    def loss(q, k, v, b, s, d):
        return (fj.attention(q, k, v, bias=b, mask=mask, sinks=s) * d).sum()
    grads = jax.vmap(jax.grad(loss, argnums=(0, 1, 2, 3, 4)),
                     in_axes=(0, 0, 0, None, None, 0))(qs, ks, vs, bias, sinks, douts)
    for i in range(2):
        kw = dict(bias=bias, mask=mask, sinks=sinks)
        want = eager(qs[i], ks[i], vs[i], douts[i], **kw)
        for g, w, n in zip(grads, want[2:], ("dq", "dk", "dv", "dbias", "dsinks")):
            assert_same(np.asarray(g)[i], w, n, close=n == "dbias")
    # mapped sinks are refused, naming the argument
    with pytest.raises(ValueError, match=r"^sinks: jax.vmap"):
        jax.vmap(lambda q, s: fj.attention(q, k, v, sinks=s))(qs, np.stack([sinks, sinks]))


def test_errors_name_the_argument():
    q, k, v, _ = qkv()
    bias, mask, sinks = extras((B, H, SQ, SK), (B, H, SQ, SK), True)
    with pytest.raises(ValueError, match=r"^bias"):
        fj.attention(q, k, v, bias=bias[:, :, :, :5])
    with pytest.raises(ValueError, match=r"^bias"):
        jax.jit(lambda q, b: fj.attention(q, k, v, bias=b))(q, np.zeros((3, SQ, SK), np.float32))
    with pytest.raises(ValueError, match=r"^bias"):
        fj.attention(q, k, v, bias=bias[None])
    with pytest.raises(TypeError, match=r"^bias"):
        fj.attention(q, k, v, bias=[[0.0]])
    with pytest.raises(ValueError, match=r"^mask"):
        fj.attention(q, k, v, mask=mask[:, :, :3])
    with pytest.raises(TypeError, match=r"^mask"):
        fj.attention(q, k, v, mask=mask.astype(np.int32))
    with pytest.raises(ValueError, match=r"^sinks"):
        fj.attention(q, k, v, sinks=sinks[:3])
    with pytest.raises(TypeError, match=r"^sinks"):
        fj.attention(q, k, v, sinks=sinks.astype(np.float64))


def test_plain_call_hlo_has_no_extras():
    q = jnp.ones((1, 4, 1, 8), jnp.float32)
    text = jax.jit(lambda q: fj.attention(q, q, q)).lower(q).as_text()
    assert "has_bias" not in text and "has_mask" not in text and "has_sinks" not in text
    text = jax.jit(lambda q: fj.attention(q, q, q, sinks=jnp.zeros((1,)))).lower(q).as_text()
    assert "has_sinks" in text and "has_bias" not in text


def test_varlen_matches_eager():
    cu = np.array([0, 7, 7, 20], np.int32)
    q, k, v, dout = arrays([(20, 4, 16), (20, 2, 16), (20, 2, 16), (20, 4, 16)], seed=11)
    rng = np.random.default_rng(12)
    bias = rng.standard_normal((4, 20, 13)).astype(np.float32)
    mask = rng.random((1, 20, 13)) < 0.7
    sinks = rng.standard_normal((4,)).astype(np.float32)
    kw = dict(bias=bias, mask=mask, sinks=sinks, causal=True)

    def f(q, k, v, b, s):
        return fj.attention_varlen(q, k, v, cu, cu, 13, 13, bias=b, mask=mask, sinks=s,
                                   causal=True, return_lse=True)
    out, lse = jax.jit(f)(q, k, v, bias, sinks)
    e_out, e_lse = flashdl.attention_varlen(q, k, v, cu, cu, 13, 13, return_lse=True, **kw)
    np.testing.assert_array_equal(np.asarray(out), e_out)
    np.testing.assert_array_equal(np.asarray(lse), e_lse)
    grads = jax.jit(jax.grad(lambda *a: (f(*a)[0] * dout).sum(), argnums=(0, 1, 2, 3, 4)))(
        q, k, v, bias, sinks)
    want = flashdl.attention_varlen_backward(dout, q, k, v, e_out, e_lse, cu, cu, 13, 13, **kw)
    assert len(want) == 5
    for g, e in zip(grads, want):
        np.testing.assert_array_equal(np.asarray(g), e)
    # a broadcast (total_q or 1) bias: dbias summed back to its shape
    b1 = bias[:1, :1]
    g = jax.grad(lambda b: (f(q, k, v, b, sinks)[0] * dout).sum())(b1)
    w = flashdl.attention_varlen_backward(dout, q, k, v, *flashdl.attention_varlen(
        q, k, v, cu, cu, 13, 13, return_lse=True, bias=b1, mask=mask, sinks=sinks, causal=True),
        cu, cu, 13, 13, bias=b1, mask=mask, sinks=sinks, causal=True)[3]
    assert_same(g, w, "dbias (broadcast)", close=True)
    with pytest.raises(ValueError, match=r"^bias"):
        fj.attention_varlen(q, k, v, cu, cu, 13, 13, bias=bias[:, :, :4])
