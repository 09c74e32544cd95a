"""Sliding windows: window_size=(left, right) against a float64 oracle built from the contract's
predicate evaluated element by element (masked_oracle.brute_visible), forward and backward, fa1
and fa2, seqlen_q != seqlen_k both ways, with causal and GQA; rows that see no key give out 0,
lse -inf and zero gradients; bad window_size values are named in the error."""

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flashdl
import masked_oracle as mo
from attn_oracle import assert_lse, assert_rule, forward, fwd_ulps, make, make_qkv, visible

WINDOWS = [-1, 0, 1, 5, 40]
SCALE = 0.1875  # exact in float32: the oracle's scale is the core's
TOL = {"fa1": 2e-6, "fa2": 2e-6, "reference": 1e-10}


def check(b, sq, sk, h, hk, d, left, right, causal, schedule, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = make_qkv(rng, b, sq, sk, h, hk, d, dtype="float64")
    dout = make(rng, q.shape, "float64")
    opts = dict(causal=causal, window_size=(left, right), schedule=schedule, softmax_scale=SCALE)
    out, lse = flashdl.attention(q, k, v, return_lse=True, **opts)
    dq, dk, dv = flashdl.attention_backward(dout, q, k, v, out, lse, **opts)

    vis = mo.brute_visible(sq, sk, left, right, causal)
    want_out, want_lse = mo.forward(q, k, v, vis, softmax_scale=SCALE)
    tol = TOL[schedule]
    mo.close(out, want_out, tol, "out")
    assert_lse(lse, want_lse)
    want = mo.backward(dout, q, k, v, vis, softmax_scale=SCALE)
    mag = max(1.0, max(float(np.max(np.abs(g), initial=0.0)) for g in want))
    for name, g, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        mo.close(g, w, tol, name, magnitude=mag)

    # rows that see no key: exactly 0 and -inf; keys no row sees: exactly zero gradients
    empty_rows = ~vis.any(axis=1)
    assert np.all(out[:, empty_rows] == 0) and np.all(dq[:, empty_rows] == 0)
    assert np.all(np.isneginf(lse[:, :, empty_rows]))
    unseen = ~vis.any(axis=0)
    assert np.all(dk[:, unseen] == 0) and np.all(dv[:, unseen] == 0)


def test_vectorised_oracle_predicate_agrees():
    """attn_oracle.visible (used by the other test files) is the same predicate."""
    for sq, sk, left, right, causal in itertools.product([1, 7, 12], [1, 9, 12], WINDOWS,
                                                         WINDOWS, [False, True]):
        assert np.array_equal(visible(sq, sk, causal, (left, right)),
                              mo.brute_visible(sq, sk, left, right, causal))


@pytest.mark.parametrize("schedule", ["fa1", "fa2"])
@pytest.mark.parametrize("sq,sk", [(23, 41), (41, 23)], ids=["sq<sk", "sq>sk"])
def test_every_window(sq, sk, schedule):
    for n, (left, right) in enumerate(itertools.product(WINDOWS, WINDOWS)):
        check(1, sq, sk, 4, 2, 16, left, right, False, schedule, seed=n)
    for left in WINDOWS:
        check(1, sq, sk, 4, 2, 16, left, -1, True, schedule, seed=left + 1)


@pytest.mark.parametrize("schedule", ["fa1", "fa2", "reference"])
@pytest.mark.parametrize("sq,sk", [(150, 260), (260, 150), (200, 200)])
def test_many_blocks(sq, sk, schedule):
    """Long enough for several query and key blocks: the kernels skip blocks no row can see and
    mask only the blocks the window's edges cross."""
    for left, right in [(5, 40), (40, 1), (0, 0), (-1, 5), (70, -1)]:
        check(1, sq, sk, 2, 1, 32, left, right, False, schedule, seed=sq + left + 1)


@given(b=st.integers(1, 2), sq=st.integers(1, 48), sk=st.integers(1, 48),
       heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3), (4, 1)]),
       d=st.sampled_from([4, 16, 33, 64]), left=st.sampled_from(WINDOWS),
       right=st.sampled_from(WINDOWS), causal=st.booleans(),
       schedule=st.sampled_from(["fa1", "fa2"]))
def test_window_property(b, sq, sk, heads, d, left, right, causal, schedule):
    check(b, sq, sk, heads[0], heads[1], d, left, right, causal, schedule, seed=sq * 64 + sk)


@pytest.mark.parametrize("schedule", ["fa1", "fa2"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_low_precision(dtype, schedule):
    """flash-attn's rule against the naive algorithm in the input precision."""
    rng = np.random.default_rng(5)
    q, k, v = make_qkv(rng, 2, 70, 45, 4, 2, 32, dtype=dtype)
    for window in [(5, 1), (0, 40), (-1, 0)]:
        out, lse = flashdl.attention(q, k, v, schedule=schedule, window_size=window,
                                     return_lse=True)
        exact, exact_lse = forward(q, k, v, window=window)
        low, _ = forward(q, k, v, window=window, dtype=dtype, exact=False)
        assert_rule(out, exact, low, dtype, ulps=fwd_ulps(dtype, q, k), what=f"out {window}")
        assert_lse(lse, exact_lse, rtol=1e-3, atol=1e-3)


Q, K, V = make_qkv(np.random.default_rng(2), 1, 4, 6, 2, 1, 8)


@pytest.mark.parametrize("window,exc", [
    ((-2, 0), ValueError), ((0, -2), ValueError), ((-5, -5), ValueError),
    ((1.5, 0), TypeError), ((0, "1"), TypeError), (3, TypeError), ((1, 2, 3), TypeError),
    (None, TypeError),
])
def test_window_errors(window, exc):
    out, lse = flashdl.attention(Q, K, V, return_lse=True)
    with pytest.raises(exc, match=r"\bwindow_size\b"):
        flashdl.attention(Q, K, V, window_size=window)
    with pytest.raises(exc, match=r"\bwindow_size\b"):
        flashdl.attention_backward(Q, Q, K, V, out, lse, window_size=window)
