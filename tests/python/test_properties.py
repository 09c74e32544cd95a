"""Properties of exact attention over hypothesis-drawn shapes (float64 and float32 inputs)."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import flashdl
from attn_oracle import f64, visible

FAST = ["fa1", "fa2"]


@st.composite
def problems(draw, min_sk=1, causal=None):
    b = draw(st.integers(1, 2))
    sq = draw(st.integers(1, 40))
    sk = draw(st.integers(min_sk, 40))
    hk = draw(st.integers(1, 2))
    h = hk * draw(st.integers(1, 3))
    d = draw(st.sampled_from([1, 2, 8, 16, 32, 64]))
    dtype = draw(st.sampled_from(["float64", "float32"]))
    schedule = draw(st.sampled_from(FAST))
    causal = draw(st.booleans()) if causal is None else causal
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((b, sq, h, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hk, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hk, d)).astype(dtype)
    return dict(q=q, k=k, v=v, causal=causal, schedule=schedule, rng=rng)


def tol(x):
    return 1e-12 if x.dtype == np.float64 else 2e-6


def run(p, q=None, k=None, v=None, **kw):
    opts = dict(causal=p["causal"], schedule=p["schedule"])
    opts.update(kw)
    return flashdl.attention(p["q"] if q is None else q, p["k"] if k is None else k,
                             p["v"] if v is None else v, **opts)


def has_key(p):
    """(sq,) bool: rows that see at least one key."""
    sq, sk = p["q"].shape[1], p["k"].shape[1]
    return visible(sq, sk, p["causal"]).any(axis=1)


@given(problems(causal=False))
def test_permuting_keys_with_values(p):
    perm = p["rng"].permutation(p["k"].shape[1])
    out = run(p)
    out_perm = run(p, k=p["k"][:, perm], v=p["v"][:, perm])
    np.testing.assert_allclose(out_perm, out, rtol=0, atol=8 * tol(out))


@given(problems(), st.floats(-4, 4).filter(lambda c: abs(c) > 1e-3))
def test_scaling_v_scales_out(p, c):
    out = f64(run(p))
    out_c = f64(run(p, v=(f64(p["v"]) * c).astype(p["v"].dtype)))
    np.testing.assert_allclose(out_c, out * c, rtol=0, atol=8 * tol(p["v"]) * (1 + abs(c)))


@given(problems())
def test_shifting_v_shifts_out(p):
    """Rows sum to one: v + u gives out + u on rows that see a key (and 0 on the others)."""
    u = p["rng"].standard_normal(p["v"].shape[-1])
    out = f64(run(p))
    out_u = f64(run(p, v=(f64(p["v"]) + u).astype(p["v"].dtype)))
    expect = out + u * has_key(p)[None, :, None, None]
    np.testing.assert_allclose(out_u, expect, rtol=0, atol=16 * tol(p["v"]))


@given(problems(causal=True), st.data())
def test_causal_ignores_future_keys(p, data):
    """Rows i only see keys j <= i + sk - sq: changing later keys/values leaves them unchanged."""
    sq, sk = p["q"].shape[1], p["k"].shape[1]
    cut = data.draw(st.integers(0, sk - 1))
    k2, v2 = p["k"].copy(), p["v"].copy()
    k2[:, cut:] = p["rng"].standard_normal(k2[:, cut:].shape) * 3
    v2[:, cut:] = p["rng"].standard_normal(v2[:, cut:].shape) * 3
    rows = np.arange(sq) + sk - sq < cut  # rows whose last visible key is before the cut
    out, out2 = run(p), run(p, k=k2, v=v2)
    np.testing.assert_array_equal(out[:, rows], out2[:, rows])


@given(problems())
def test_rows_in_convex_hull_of_v(p):
    sq, sk = p["q"].shape[1], p["k"].shape[1]
    h, hk = p["q"].shape[2], p["k"].shape[2]
    out = f64(run(p))
    vis = visible(sq, sk, p["causal"])
    v = np.repeat(f64(p["v"]), h // hk, axis=2)  # (b, sk, h, d)
    for i in range(sq):
        if not vis[i].any():
            assert np.all(out[:, i] == 0)
            continue
        vv = v[:, vis[i]]
        slack = 4 * tol(p["v"]) * (1 + np.abs(vv).max())
        assert np.all(out[:, i] >= vv.min(axis=1) - slack)
        assert np.all(out[:, i] <= vv.max(axis=1) + slack)


@given(problems(min_sk=2, causal=False), st.data())
def test_merging_halves_through_lse(p, data):
    """Attention over keys [0, m) and [m, sk) merged with lse weights equals attention over all."""
    m = data.draw(st.integers(1, p["k"].shape[1] - 1))
    o, lse = run(p, return_lse=True)
    oa, la = run(p, k=p["k"][:, :m], v=p["v"][:, :m], return_lse=True)
    ob, lb = run(p, k=p["k"][:, m:], v=p["v"][:, m:], return_lse=True)
    la, lb = f64(la), f64(lb)
    lse_ab = np.logaddexp(la, lb)
    np.testing.assert_allclose(lse_ab, lse, rtol=1e-5, atol=1e-5)
    wa = np.exp(la - lse_ab).transpose(0, 2, 1)[..., None]  # (b, sq, h, 1)
    wb = np.exp(lb - lse_ab).transpose(0, 2, 1)[..., None]
    merged = wa * f64(oa) + wb * f64(ob)
    # lse is float32: the weights carry its rounding
    np.testing.assert_allclose(merged, f64(o), rtol=0, atol=1e-5)


@given(problems(), st.sampled_from([(-1, -1), (2, 0), (0, 3)]))
def test_fa1_agrees_with_fa2(p, window):
    kw = dict(window_size=window, return_lse=True)
    o1, l1 = run(p, schedule="fa1", **kw)
    o2, l2 = run(p, schedule="fa2", **kw)
    np.testing.assert_allclose(f64(o1), f64(o2), rtol=0, atol=8 * tol(o1))
    np.testing.assert_allclose(l1, l2, rtol=1e-6, atol=1e-6)
