"""Backward: fa1/fa2 against the float64 reference backward and the naive algorithm in the input
precision; central differences of the float64 forward against the analytic gradients."""

import zlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flashdl
from attn_oracle import assert_rule, backward, grad_magnitude, grad_ulps, make, make_qkv
from masked_oracle import numerical_grads

SHAPES = [
    (1, 1, 1, 1, 1, 8),
    (2, 17, 17, 2, 2, 32),
    (1, 29, 13, 4, 2, 64),    # seqlen_q > seqlen_k: causal empty rows, GQA
    (1, 13, 40, 3, 1, 16),    # MQA
    (1, 9, 11, 2, 1, 128),
]


def grads(dout, q, k, v, schedule, causal, window=(-1, -1)):
    out, lse = flashdl.attention(q, k, v, causal=causal, schedule=schedule, return_lse=True,
                                 window_size=window)
    g = flashdl.attention_backward(dout, q, k, v, out, lse, causal=causal, schedule=schedule,
                                   window_size=window)
    for x, like in zip(g, (q, k, v)):
        assert isinstance(x, np.ndarray) and x.shape == like.shape and x.dtype == like.dtype
    return g


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("schedule", ["fa1", "fa2"])
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference_backward(shape, dtype, schedule, causal):
    rng = np.random.default_rng(zlib.crc32(repr((shape, dtype, causal)).encode()))
    q, k, v = make_qkv(rng, *shape, dtype=dtype)
    dout = make(rng, q.shape, dtype)
    got = grads(dout, q, k, v, schedule, causal)
    ref = grads(dout, q, k, v, "reference", causal)
    exact = backward(dout, q, k, v, causal=causal)
    low = backward(dout, q, k, v, causal=causal, dtype=dtype, exact=False)
    for name, g, r, e, lo, u in zip(("dq", "dk", "dv"), got, ref, exact, low,
                                    grad_ulps(dtype, q, k)):
        # the reference schedule is the float64 oracle rounded to the dtype once
        assert_rule(r, e, lo, dtype, factor=1.0, what=f"reference {name}")
        assert_rule(g, e, lo, dtype, factor=3.0, what=name, ulps=u, grad=True,
                    magnitude=grad_magnitude(exact))


@pytest.mark.parametrize("schedule", ["fa1", "fa2", "reference"])
def test_window_backward(schedule):
    rng = np.random.default_rng(11)
    q, k, v = make_qkv(rng, 1, 15, 21, 2, 1, 16, dtype="float64")
    dout = make(rng, q.shape, "float64")
    for window in [(3, 1), (0, 0), (-1, 2)]:
        got = grads(dout, q, k, v, schedule, False, window)
        for g, e in zip(got, backward(dout, q, k, v, window=window)):
            np.testing.assert_allclose(g, e, rtol=0, atol=F64_ATOL[schedule])


@pytest.mark.parametrize("schedule", ["fa1", "fa2", "reference"])
def test_empty_rows_have_zero_gradients(schedule):
    rng = np.random.default_rng(12)
    q, k, v = make_qkv(rng, 1, 10, 3, 2, 2, 8)
    dout = make(rng, q.shape)
    dq, dk, dv = grads(dout, q, k, v, schedule, causal=True)
    assert np.all(dq[:, :7] == 0)
    assert not any(np.isnan(x).any() for x in (dq, dk, dv))


# float64 gradients of fa1/fa2 re-read the float32 lse (the contract), so they are ~1e-7 accurate;
# the reference recomputes everything in float64.
F64_ATOL = {"reference": 1e-11, "fa1": 1e-6, "fa2": 1e-6}


@pytest.mark.parametrize("schedule", ["reference", "fa1", "fa2"])
@pytest.mark.parametrize("causal,shape", [(False, (1, 3, 4, 2, 1, 3)), (True, (1, 4, 3, 2, 2, 2)),
                                          (True, (2, 3, 5, 2, 1, 3))])
def test_numerical_gradients_float64(schedule, causal, shape):
    rng = np.random.default_rng(13)
    q, k, v = make_qkv(rng, *shape, dtype="float64")
    dout = make(rng, q.shape, "float64")

    def f(q, k, v):
        return flashdl.attention(q, k, v, causal=causal, schedule="reference")

    numeric = numerical_grads(f, [q, k, v], dout)
    analytic = grads(dout, q, k, v, schedule, causal)
    for name, a, n in zip(("dq", "dk", "dv"), analytic, numeric):
        np.testing.assert_allclose(a, n, rtol=1e-6, atol=max(1e-8, F64_ATOL[schedule]),
                                   err_msg=name)


@given(st.integers(1, 200), st.integers(1, 200), st.integers(1, 2), st.integers(1, 3),
       st.sampled_from([1, 16, 64, 128]), st.sampled_from([(-1, -1), (-1, 0), (9, 2)]),
       st.sampled_from(["fa1", "fa2"]), st.sampled_from(["float32", "bfloat16"]),
       st.integers(0, 2**32 - 1))
def test_hypothesis_backward(sq, sk, hk, group, d, window, schedule, dtype, seed):
    rng = np.random.default_rng(seed)
    q, k, v = make_qkv(rng, 1, sq, sk, hk * group, hk, d, dtype=dtype)
    dout = make(rng, q.shape, dtype)
    got = grads(dout, q, k, v, schedule, False, window)
    exact = backward(dout, q, k, v, window=window)
    low = backward(dout, q, k, v, window=window, dtype=dtype, exact=False)
    for name, g, e, lo, u in zip(("dq", "dk", "dv"), got, exact, low, grad_ulps(dtype, q, k)):
        assert_rule(g, e, lo, dtype, factor=3.0, what=name, ulps=u, grad=True,
                    magnitude=grad_magnitude(exact))


# fa2's backward swaps its loops where query tiles (48 rows) outnumber key tiles (96 keys) four
# times or more (long queries over few keys; src/cpu/fa2.inl): shapes on both sides of that choice.
LOOP_ORDER_SHAPES = [
    (2, 300, 40, 4, 2, 64),    # 7 query tiles, 1 key tile: queries outer
    (1, 500, 150, 3, 1, 32),   # 11 query tiles, 2 key tiles: queries outer
    (1, 150, 300, 2, 2, 64),   # keys outer
]


@pytest.mark.parametrize("mods", [False, True], ids=["plain", "softcap-alibi"])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (50, 7)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", LOOP_ORDER_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fa2_backward_loop_orders(shape, dtype, window, mods):
    rng = np.random.default_rng(zlib.crc32(repr((shape, dtype, window, mods)).encode()))
    q, k, v = make_qkv(rng, *shape, dtype=dtype)
    dout = make(rng, q.shape, dtype)
    kw = dict(softcap=2.0, alibi_slopes=rng.uniform(0.05, 0.5, shape[3]).astype(np.float32)) \
        if mods else {}
    out, lse = flashdl.attention(q, k, v, window_size=window, return_lse=True, **kw)
    got = flashdl.attention_backward(dout, q, k, v, out, lse, window_size=window, **kw)
    again = flashdl.attention_backward(dout, q, k, v, out, lse, window_size=window, **kw)
    exact = backward(dout, q, k, v, window=window, **kw)
    low = backward(dout, q, k, v, window=window, dtype=dtype, exact=False, **kw)
    for name, g, a, e, lo, u in zip(("dq", "dk", "dv"), got, again, exact, low,
                                    grad_ulps(dtype, q, k)):
        np.testing.assert_array_equal(g, a, err_msg=f"{name}: not reproducible")
        assert_rule(g, e, lo, dtype, factor=3.0, what=name, ulps=u, grad=True,
                    magnitude=grad_magnitude(exact))


def test_backward_fast_path_is_the_full_path(monkeypatch):
    """flashdl.attention_backward on aligned NumPy float16/32/64 arrays with default options
    (causal aside) skips the Python frame (at 16 x 16 the full path's Python was half the call):
    the full path's gradients bit for bit, no Frame built, the full path for any other option,
    mixed types or dtypes, and its errors, worded the same; the caller's arrays untouched."""
    from flashdl import _api

    rng = np.random.default_rng(11)
    full_path = lambda *a: None  # noqa: E731 - _fast_backward declining: the full path
    for dtype in (np.float16, np.float32, np.float64):
        for b, sq, sk, h, hk in ((2, 9, 11, 4, 2), (1, 16, 16, 8, 8), (1, 0, 5, 2, 1)):
            q, k, v = make_qkv(rng, b, sq, sk, h, hk, 16, dtype)
            dout = rng.standard_normal(q.shape).astype(dtype)
            for causal in (False, True):
                out, lse = flashdl.attention(q, k, v, causal=causal, return_lse=True)
                before = [x.copy() for x in (dout, q, k, v, out, lse)]
                fast = flashdl.attention_backward(dout, q, k, v, out, lse, causal=causal)
                with monkeypatch.context() as m:
                    m.setattr(_api, "_fast_backward", full_path)
                    full = flashdl.attention_backward(dout, q, k, v, out, lse, causal=causal)
                for a, c in zip(fast, full):
                    assert type(a) is np.ndarray and a.dtype == c.dtype and a.shape == c.shape
                    np.testing.assert_array_equal(a, c)
                for x, y in zip(before, (dout, q, k, v, out, lse)):
                    np.testing.assert_array_equal(x, y)

    q = rng.standard_normal((1, 5, 2, 8)).astype(np.float32)
    out, lse = flashdl.attention(q, q, q, return_lse=True)

    def no_frame(*args, **kwargs):
        raise AssertionError("the full path ran")

    with monkeypatch.context() as m:
        m.setattr(_api, "Frame", no_frame)
        flashdl.attention_backward(q, q, q, q, out, lse)  # fast: no Frame
        flashdl.attention_backward(q, q, q, q, out, lse, causal=True, seed=0, block_size=(128, 128))
        for kwargs in ({"softmax_scale": 0.5}, {"window_size": (2, 0)}, {"schedule": "fa2"},
                       {"dropout_p": 0.1, "seed": 1}, {"softcap": 1.0}, {"seed": 3},
                       {"deterministic": True}, {"block_size": 64}, {"dropout_p": 0},
                       {"window_size": (-1.0, -1.0)}, {"block_size": (128, 128.0)},
                       {"block_size": np.array([128, 128])}):
            with pytest.raises(AssertionError, match="the full path ran"):
                flashdl.attention_backward(q, q, q, q, out, lse, **kwargs)
        for args in ((q, q.astype(np.float64), q, q, out, lse), (q.tolist(), q, q, q, out, lse),
                     (q, q, q, q, out, lse.tolist())):
            with pytest.raises(AssertionError, match="the full path ran"):
                flashdl.attention_backward(*args)  # mixed dtypes or types: the full path's checks
    bad = [(q, q, q, q, out, lse[:, :1]), (q, q, q[:, :3], q, out, lse), (q[:, :4], q, q, q, out, lse),
           (q, q, q, q, out, lse.astype(np.float64)), (q, q, q, q, out[0], lse)]
    for args in bad:
        with pytest.raises((ValueError, TypeError)) as fast_error:
            flashdl.attention_backward(*args)
        with monkeypatch.context() as m:
            m.setattr(_api, "_fast_backward", full_path)
            with pytest.raises((ValueError, TypeError)) as full_error:
                flashdl.attention_backward(*args)
        assert type(fast_error.value) is type(full_error.value)
        assert str(fast_error.value) == str(full_error.value)
