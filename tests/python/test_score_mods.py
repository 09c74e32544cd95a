"""Score modifiers: softcap (logit soft-capping, Gemma 2, Grok) and ALiBi slopes (BLOOM, MPT), in
flash-attn's order: s = scale q.k, s = softcap tanh(s / softcap), s -= slope |i + sk - sq - j|,
then the mask and the softmax; lse of the modified scores; the backward carries the cap's
1 - tanh^2 and gives the slopes no gradient.

fa1, fa2 and the reference against the float64 oracle with the same modifiers (flash-attn's rules:
2x the naive low-precision error for outputs, 3x for gradients, the naive algorithm applying the
modifiers too), every dtype; lse; central differences; properties (a huge cap is no cap, zero
slopes are plain attention bit for bit, causal ALiBi is a linear bias shifted per row, (nheads,)
slopes equal their broadcast); hypothesis combinations with dropout, block masks, varlen, GQA and
windows; the torch autograd path against a float64 torch reference."""

import zlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flashdl
import masked_oracle as mo
from attn_oracle import (DTYPES, SCHEDULES, assert_lse, assert_rule, backward, f64, forward,
                         fwd_ulps, grad_magnitude, grad_ulps, make, make_qkv, max_err, visible)

SCALE = 0.1875  # exact in float32: the oracle's scale is the core's
# float64 results against the float64 oracle: fa1/fa2 re-read the float32 lse in the backward
# (attn_oracle.EPS_GRAD), the reference recomputes everything in float64.
TOL = {"fa1": 2e-6, "fa2": 2e-6, "reference": 1e-10}
MODS = ["softcap", "alibi_h", "alibi_bh", "both"]


def bloom_slopes(h):
    """ALiBi's geometric slopes 2^(-8 (i + 1) / h) (Press et al.), float32."""
    return (2.0 ** (-8.0 * (np.arange(h) + 1) / h)).astype(np.float32)


def mods_of(kind, rng, b, h, cap):
    """flashdl's keywords for a modifier kind: 'softcap' (cap), 'alibi_h' (BLOOM's (nheads,)
    slopes), 'alibi_bh' (random (batch, nheads) slopes), 'both' (cap and (batch, nheads))."""
    softcap = cap if kind in ("softcap", "both") else 0.0
    slopes = None
    if kind == "alibi_h":
        slopes = bloom_slopes(h)
    elif kind in ("alibi_bh", "both"):
        slopes = rng.uniform(0.0, 1.0, (b, h)).astype(np.float32)
    return dict(softcap=softcap, alibi_slopes=slopes)


def oracle_kw(opts):
    """attn_oracle's keywords for flashdl's options."""
    return dict(causal=opts.get("causal", False), window=opts.get("window_size", (-1, -1)),
                softmax_scale=opts.get("softmax_scale"), softcap=opts.get("softcap", 0.0),
                alibi_slopes=opts.get("alibi_slopes"))


def run(q, k, v, schedule, dout=None, **opts):
    out, lse = flashdl.attention(q, k, v, schedule=schedule, return_lse=True, **opts)
    assert isinstance(out, np.ndarray) and out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    if dout is None:
        return out, lse
    grads = flashdl.attention_backward(dout, q, k, v, out, lse, schedule=schedule, **opts)
    for g, like in zip(grads, (q, k, v)):
        assert g.shape == like.shape and g.dtype == like.dtype
    return (out, lse) + tuple(grads)


# --- forward, lse and backward against the oracle, every schedule and dtype ---------------------

CASES = [  # b, sq, sk, h, hk, d, causal, window, softcap
    (2, 97, 97, 4, 2, 33, True, (-1, -1), 1.5),    # causal, GQA, odd headdim
    (1, 97, 40, 4, 1, 17, True, (-1, -1), 5.0),    # seqlen_q > seqlen_k: empty causal rows; MQA
    (2, 40, 97, 4, 2, 64, False, (8, 3), 30.0),    # seqlen_q < seqlen_k, a window
    (2, 97, 13, 4, 4, 16, False, (-1, -1), 1.0),   # seqlen_q > seqlen_k, full
    (1, 1, 1, 2, 2, 8, False, (-1, -1), 0.5),      # seqlen 1
    (1, 1, 97, 4, 2, 7, True, (-1, -1), 2.0),      # one query (decoding) over 97 keys
]


def case_id(c):
    return "x".join(map(str, c[:6])) + ("-causal" if c[6] else "") + (
        f"-w{c[7][0]}_{c[7][1]}" if c[7] != (-1, -1) else "") + f"-cap{c[8]}"


def problem(case, kind, dtype):
    """q (x2: scores up to ~10, so that the caps bite and the slopes matter), k, v, dout and the
    options of a case."""
    b, sq, sk, h, hk, d, causal, window, cap = case
    rng = np.random.default_rng(zlib.crc32(repr((case, kind, dtype)).encode()))
    q, k, v = make_qkv(rng, b, sq, sk, h, hk, d, dtype=dtype)
    q = (f64(q) * 2).astype(q.dtype)  # exact: a power of two
    dout = make(rng, q.shape, dtype)
    opts = dict(causal=causal, window_size=window, **mods_of(kind, rng, b, h, cap))
    return q, k, v, dout, opts


@pytest.mark.parametrize("kind", MODS)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_forward_and_lse_match_oracle(case, dtype, schedule, kind):
    q, k, v, _, opts = problem(case, kind, dtype)
    out, lse = run(q, k, v, schedule, **opts)
    kw = oracle_kw(opts)
    o_ref, lse_ref = forward(q, k, v, **kw)
    o_low, _ = forward(q, k, v, dtype=dtype, exact=False, **kw)
    assert_rule(out, o_ref, o_low, dtype, ulps=fwd_ulps(dtype, q, k))
    assert_lse(lse, lse_ref)


BACKWARD_CASES = [CASES[0], CASES[1], CASES[2], CASES[5]]


@pytest.mark.parametrize("kind", MODS)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", BACKWARD_CASES, ids=case_id)
def test_backward_matches_oracle(case, dtype, schedule, kind):
    q, k, v, dout, opts = problem(case, kind, dtype)
    got = run(q, k, v, schedule, dout, **opts)[2:]
    kw = oracle_kw(opts)
    exact = backward(dout, q, k, v, **kw)
    low = backward(dout, q, k, v, dtype=dtype, exact=False, **kw)
    mag = grad_magnitude(exact)
    for name, g, e, lo, u in zip(("dq", "dk", "dv"), got, exact, low, grad_ulps(dtype, q, k)):
        assert_rule(g, e, lo, dtype, factor=3.0, what=name, ulps=u, grad=True, magnitude=mag)
        if dtype == "float64":  # the rule's eps is float32's here; hold float64 to its own
            mo.close(g, e, TOL[schedule], name, magnitude=mag)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("causal,shape", [(False, (1, 4, 5, 2, 1, 3)), (True, (1, 5, 3, 2, 2, 2)),
                                          (True, (2, 3, 6, 2, 1, 3))])
def test_numerical_gradients_float64(schedule, causal, shape):
    """Central differences of the float64 reference forward with both modifiers against the
    analytic gradients, and against the oracle's (which checks the oracle's backward: the cap's
    derivative and a bias without gradient)."""
    rng = np.random.default_rng(31)
    b, sq, sk, h, hk, d = shape
    q, k, v = make_qkv(rng, b, sq, sk, h, hk, d, dtype="float64")
    q *= 3  # scores of several units: the cap is far from linear
    dout = make(rng, q.shape, "float64")
    opts = dict(causal=causal, softcap=1.25, alibi_slopes=rng.uniform(0.1, 1.0, (b, h))
                .astype(np.float32), window_size=(3, -1))

    def f(q, k, v):
        return flashdl.attention(q, k, v, schedule="reference", **opts)

    numeric = mo.numerical_grads(f, [q, k, v], dout)
    analytic = run(q, k, v, schedule, dout, **opts)[2:]
    oracle = backward(dout, q, k, v, **oracle_kw(opts))
    for name, a, n, o in zip(("dq", "dk", "dv"), analytic, numeric, oracle):
        np.testing.assert_allclose(o, n, rtol=1e-6, atol=1e-8, err_msg=f"oracle {name}")
        np.testing.assert_allclose(a, n, rtol=1e-6, atol=max(1e-8, TOL[schedule]),
                                   err_msg=f"{schedule} {name}")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_saturated_cap_and_steep_slopes(schedule):
    """Scores far beyond the cap (tanh saturated: its derivative ~0, so dq and dk vanish where
    the probabilities are set by the cap alone) and slopes steep enough that each row sees only
    its diagonal key: results match the oracle and nothing is NaN."""
    rng = np.random.default_rng(32)
    q, k, v = make_qkv(rng, 1, 33, 33, 2, 1, 16, dtype="float32")
    dout = make(rng, q.shape)
    q = q * 40
    for opts in (dict(softcap=0.5), dict(alibi_slopes=np.array([60.0, 1e4], np.float32),
                                         causal=True),
                 dict(softcap=0.5, alibi_slopes=np.array([0.0, 200.0], np.float32))):
        out, lse, dq, dk, dv = run(q, k, v, schedule, dout, **opts)
        kw = oracle_kw(opts)
        o_ref, lse_ref = forward(q, k, v, **kw)
        o_low, _ = forward(q, k, v, dtype="float32", exact=False, **kw)
        assert_rule(out, o_ref, o_low, "float32", ulps=fwd_ulps("float32", q, k))
        assert_lse(lse, lse_ref)
        exact = backward(dout, q, k, v, **kw)
        low = backward(dout, q, k, v, dtype="float32", exact=False, **kw)
        mag = grad_magnitude(exact)
        for name, g, e, lo, u in zip(("dq", "dk", "dv"), (dq, dk, dv), exact, low,
                                     grad_ulps("float32", q, k)):
            assert_rule(g, e, lo, "float32", factor=3.0, what=f"{opts} {name}", ulps=u,
                        grad=True, magnitude=mag)
    # the steepest slope (1e4, causal): out is exactly the diagonal value row of head 1
    out = flashdl.attention(q, k, v, schedule=schedule, causal=True,
                            alibi_slopes=np.array([60.0, 1e4], np.float32))
    np.testing.assert_array_equal(out[:, :, 1], v[:, :, 0])


def test_extreme_finite_modifiers():
    """Validation accepts softcaps of 0 or in [1e-30, 1e30], scales up to 1e30 in magnitude and any
    finite float32 slopes; such values (the limits included) must then give a finite answer
    equal to the oracle's (slopes of 3e38 leave each causal row its diagonal key), and others
    be refused with the argument named."""
    rng = np.random.default_rng(33)
    failures = []
    for dtype in ["float64", "float32", "bfloat16"]:
        q, k, v = make_qkv(rng, 1, 9, 9, 2, 2, 16, dtype=dtype)
        dout = make(rng, q.shape, dtype)
        for schedule in SCHEDULES:
            for opts in (dict(softcap=1e38), dict(softcap=1e300), dict(softcap=1e-30),
                         dict(softcap=1e-30, softmax_scale=1e30),
                         dict(softcap=1e30, softmax_scale=1e-30),
                         dict(alibi_slopes=np.full(2, 3e38, np.float32), causal=True)):
                try:
                    out, lse, *grads = run(q, k, v, schedule, dout, **opts)
                except ValueError as e:
                    if "softcap" in str(e) or "alibi_slopes" in str(e):
                        continue
                    raise
                o_ref = forward(q, k, v, **oracle_kw(opts))[0]  # float64: no overflow
                tol = {"float64": 1e-10, "float32": 5e-6, "bfloat16": 2.0**-7}[dtype]
                if np.isnan(f64(out)).any() or any(np.isnan(f64(g)).any() for g in grads) or \
                        not max_err(out, o_ref) <= tol:
                    failures.append(f"{dtype} {schedule} {list(opts)[0]}="
                                    f"{np.max(list(opts.values())[0])}: error "
                                    f"{max_err(out, o_ref):.3g}")
    assert not failures, "; ".join(failures)


# --- properties ------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_huge_softcap_is_no_softcap(dtype, schedule):
    """softcap 1e6: c tanh(s / c) = s (1 - s^2 / 3c^2 ...), no cap to the precision of the dtype."""
    rng = np.random.default_rng(40)
    q, k, v = make_qkv(rng, 2, 45, 37, 4, 2, 32, dtype=dtype)
    dout = make(rng, q.shape, dtype)
    plain = run(q, k, v, schedule, dout, causal=True)
    capped = run(q, k, v, schedule, dout, causal=True, softcap=1e6)
    # float64: s^3 / 3c^2 ~ 1e-10; float32: the kernels' rational tanh is good to ~1.3e-7 near 0;
    # bfloat16: the float32 arithmetic's differences, rounded to the dtype (one ulp).
    tol = {"float64": 1e-9, "float32": 2e-6, "bfloat16": 2.0**-7}[dtype]
    for name, a, c in zip(("out", "lse", "dq", "dk", "dv"), plain, capped):
        if name == "lse":
            np.testing.assert_allclose(c, a, rtol=1e-6, atol=1e-6)
        else:
            mo.close(c, f64(a), tol, name)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_slopes_are_plain_attention_bitwise(dtype, schedule):
    """All-zero slopes add nothing: out, lse and the gradients equal plain attention's bit for bit
    (also with a cap: equal to the cap alone), in every schedule."""
    rng = np.random.default_rng(41)
    q, k, v = make_qkv(rng, 2, 37, 45, 4, 2, 16, dtype=dtype)
    dout = make(rng, q.shape, dtype)
    for zeros in (np.zeros(4, np.float32), np.zeros((2, 4), np.float32)):
        for extra in (dict(causal=True), dict(window_size=(5, 2), softcap=3.0)):
            plain = run(q, k, v, schedule, dout, **extra)
            biased = run(q, k, v, schedule, dout, alibi_slopes=zeros, **extra)
            for name, a, c in zip(("out", "lse", "dq", "dk", "dv"), plain, biased):
                assert np.array_equal(a, c), f"{name} ({zeros.shape}, {extra})"


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("sq,sk", [(33, 33), (20, 45), (45, 20)])
def test_causal_alibi_is_a_shifted_linear_bias(schedule, sq, sk):
    """Causal: every visible key has j <= i + sk - sq, so -slope |i + sk - sq - j| =
    slope j - slope (i + sk - sq): a linear bias slope * j plus a per-row constant, which the
    softmax ignores. out equals the oracle's with the explicit bias slope * j; lse differs from
    that oracle's by exactly the row constant. Without causal the |.| matters: not equal."""
    rng = np.random.default_rng(zlib.crc32(repr((sq, sk)).encode()))
    b, h, hk, d = 2, 4, 2, 16
    q, k, v = make_qkv(rng, b, sq, sk, h, hk, d, dtype="float64")
    dout = make(rng, q.shape, "float64")
    slopes = rng.uniform(0.05, 0.5, (b, h)).astype(np.float32)
    linear = f64(slopes)[:, :, None, None] * np.arange(sk)[None, None, None, :]
    out, lse, *grads = run(q, k, v, schedule, dout, causal=True, alibi_slopes=slopes,
                           softmax_scale=SCALE)
    o_lin, lse_lin = forward(q, k, v, causal=True, bias=linear, softmax_scale=SCALE)
    mo.close(out, o_lin, TOL[schedule], "out")
    row = f64(slopes)[:, :, None] * (np.arange(sq) + sk - sq)[None, None, :]  # (b, h, sq)
    assert_lse(lse, np.where(np.isneginf(lse_lin), -np.inf, lse_lin - row))
    want = backward(dout, q, k, v, causal=True, bias=linear, softmax_scale=SCALE)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        mo.close(g, w, TOL[schedule], name, magnitude=grad_magnitude(want))
    # the same bias without causal is not ALiBi: keys after the diagonal are penalised by ALiBi
    full = flashdl.attention(q, k, v, schedule=schedule, alibi_slopes=slopes, softmax_scale=SCALE)
    o_full_lin = forward(q, k, v, bias=linear, softmax_scale=SCALE)[0]
    assert max_err(full, o_full_lin) > 1e-3
    mo.close(full, forward(q, k, v, alibi_slopes=slopes, softmax_scale=SCALE)[0],
             TOL[schedule], "non-causal out")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_head_slopes_equal_their_broadcast(dtype, schedule):
    """(nheads,) slopes give bit for bit what the same row repeated to (batch, nheads) gives, as a
    copy or as a stride-0 view; and a (batch, nheads) array's rows really are per batch."""
    rng = np.random.default_rng(42)
    b, h = 3, 4
    q, k, v = make_qkv(rng, b, 29, 31, h, 2, 16, dtype=dtype)
    dout = make(rng, q.shape, dtype)
    slopes = rng.uniform(0.05, 1.0, h).astype(np.float32)
    opts = dict(causal=False, window_size=(6, 4), softcap=4.0)
    shared = run(q, k, v, schedule, dout, alibi_slopes=slopes, **opts)
    view = np.broadcast_to(slopes, (b, h))
    assert view.strides[0] == 0
    for tiled in (np.tile(slopes, (b, 1)), view):
        got = run(q, k, v, schedule, dout, alibi_slopes=tiled, **opts)
        for name, a, c in zip(("out", "lse", "dq", "dk", "dv"), shared, got):
            assert np.array_equal(a, c), f"{name} (batch stride {tiled.strides[0]})"
    # a different row for batch 1 changes batch 1, and only it
    rows = np.tile(slopes, (b, 1))
    rows[1] *= 3
    other = run(q, k, v, schedule, dout, alibi_slopes=rows, **opts)
    for name, a, c in zip(("out", "lse", "dq", "dk", "dv"), shared, other):  # batch is axis 0
        assert np.array_equal(np.delete(a, 1, axis=0), np.delete(c, 1, axis=0)), name
        assert not np.array_equal(a[1], c[1]), name


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_slopes_follow_the_query_head(schedule):
    """With GQA, the slope is the query head's: permuting the query heads together with their
    slopes permutes the output heads."""
    rng = np.random.default_rng(43)
    q, k, v = make_qkv(rng, 1, 23, 23, 4, 1, 16, dtype="float64")
    slopes = np.array([0.05, 0.3, 0.7, 1.5], np.float32)
    perm = np.array([2, 0, 3, 1])
    out = flashdl.attention(q, k, v, schedule=schedule, causal=True, alibi_slopes=slopes)
    out_p = flashdl.attention(np.ascontiguousarray(q[:, :, perm]), k, v, schedule=schedule,
                              causal=True, alibi_slopes=slopes[perm])
    np.testing.assert_array_equal(out_p, out[:, :, perm])


def test_caller_arrays_unchanged():
    rng = np.random.default_rng(44)
    q, k, v = make_qkv(rng, 2, 17, 19, 4, 2, 8)
    dout = make(rng, q.shape)
    slopes = rng.uniform(0, 1, (2, 4)).astype(np.float32)
    saved = [x.copy() for x in (q, k, v, dout, slopes)]
    for schedule in SCHEDULES:
        run(q, k, v, schedule, dout, alibi_slopes=slopes, softcap=2.0, causal=True)
    for x, y in zip((q, k, v, dout, slopes), saved):
        assert np.array_equal(x, y)
    frozen = slopes.copy()
    frozen.flags.writeable = False  # read-only slopes are accepted
    assert np.array_equal(flashdl.attention(q, k, v, alibi_slopes=frozen),
                          flashdl.attention(q, k, v, alibi_slopes=slopes))


# --- combinations (hypothesis, float64 against the masked oracle) ------------------------------

def nblocks(n, block):
    return -(-n // block)


def expand(mask, sq, sk, bq, bk):
    """The element mask (..., sq, sk) of a block mask."""
    return np.repeat(np.repeat(mask, bq, axis=-2), bk, axis=-1)[..., :sq, :sk]


@st.composite
def slopes_st(draw, b, h):
    """None, (h,) or (b, h) float32 slopes, some zero, some negative (ALiBi does not forbid it)."""
    kind = draw(st.sampled_from([None, "h", "bh"]))
    if kind is None:
        return None
    shape = (h,) if kind == "h" else (b, h)
    vals = st.sampled_from([0.0, 0.0625, 0.25, 0.5, 1.0, 2.0, -0.125])
    return np.array(draw(st.lists(vals, min_size=int(np.prod(shape)),
                                  max_size=int(np.prod(shape))))).reshape(shape).astype(np.float32)


@given(b=st.integers(1, 2), sq=st.integers(1, 40), sk=st.integers(1, 40),
       heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3), (4, 1)]),
       d=st.sampled_from([3, 8, 16, 33]), causal=st.booleans(),
       window=st.sampled_from([(-1, -1), (5, 0), (0, 7), (3, 3)]),
       softcap=st.sampled_from([0.0, 0.75, 3.0, 50.0]),
       dropout_p=st.sampled_from([0.0, 0.3]),
       block=st.sampled_from([None, (4, 8), (16, 3), (64, 64)]),
       schedule=st.sampled_from(["fa1", "fa2"]), data=st.data())
def test_hypothesis_with_dropout_block_mask_gqa_windows(b, sq, sk, heads, d, causal, window,
                                                        softcap, dropout_p, block, schedule,
                                                        data):
    """Every combination against the float64 oracle with the explicit dropout keep-mask
    (flashdl.dropout_mask) and the expanded block mask: out, lse, dq, dk, dv."""
    h, hk = heads
    slopes = data.draw(slopes_st(b, h))
    seed = sq * 131 + sk * 7 + d
    rng = np.random.default_rng(seed)
    q, k, v = make_qkv(rng, b, sq, sk, h, hk, d, dtype="float64")
    q *= 2
    dout = make(rng, q.shape, "float64")
    opts = dict(causal=causal, window_size=window, softmax_scale=SCALE, softcap=softcap,
                alibi_slopes=slopes, dropout_p=dropout_p, seed=seed)
    vis = mo.brute_visible(sq, sk, window[0], window[1], causal)
    if block is not None:
        bq, bk = block
        mask = rng.random((b, h, nblocks(sq, bq), nblocks(sk, bk))) < 0.6
        opts.update(block_mask=mask, block_size=block)
        vis = vis & expand(mask, sq, sk, bq, bk)
    vis = np.broadcast_to(vis, (b, h, sq, sk))
    keep = flashdl.dropout_mask(b, h, sq, sk, dropout_p, seed) if dropout_p > 0 else None
    out, lse, *grads = run(q, k, v, schedule, dout, **opts)
    mods = dict(softmax_scale=SCALE, softcap=softcap, alibi_slopes=slopes)
    want_out, want_lse = mo.forward(q, k, v, vis, keep, dropout_p, **mods)
    mo.close(out, want_out, TOL[schedule], "out")
    assert_lse(lse, want_lse)
    want = mo.backward(dout, q, k, v, vis, keep, dropout_p, **mods)
    mag = grad_magnitude(want)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        mo.close(g, w, TOL[schedule], name, magnitude=mag)


@given(sq=st.integers(1, 60), sk=st.integers(1, 60),
       heads=st.sampled_from([(2, 1), (4, 2), (2, 2)]), d=st.sampled_from([8, 16, 24]),
       window=st.sampled_from([(-1, -1), (-1, 0), (9, 2)]),
       softcap=st.sampled_from([0.0, 1.0, 10.0]), dtype=st.sampled_from(["float32", "bfloat16"]),
       schedule=st.sampled_from(["fa1", "fa2"]), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_hypothesis_low_precision(sq, sk, heads, d, window, softcap, dtype, schedule, seed,
                                  data):
    """flash-attn's rules in float32 and bfloat16: 2x for out, 3x for the gradients."""
    h, hk = heads
    slopes = data.draw(slopes_st(1, h))
    rng = np.random.default_rng(seed)
    q, k, v = make_qkv(rng, 1, sq, sk, h, hk, d, dtype=dtype)
    q = (f64(q) * 2).astype(q.dtype)
    dout = make(rng, q.shape, dtype)
    opts = dict(window_size=window, softcap=softcap, alibi_slopes=slopes)
    out, lse, *got = run(q, k, v, schedule, dout, **opts)
    kw = oracle_kw(opts)
    o_ref, lse_ref = forward(q, k, v, **kw)
    o_low, _ = forward(q, k, v, dtype=dtype, exact=False, **kw)
    assert_rule(out, o_ref, o_low, dtype, ulps=fwd_ulps(dtype, q, k))
    assert_lse(lse, lse_ref)
    exact = backward(dout, q, k, v, **kw)
    low = backward(dout, q, k, v, dtype=dtype, exact=False, **kw)
    mag = grad_magnitude(exact)
    for name, g, e, lo, u in zip(("dq", "dk", "dv"), got, exact, low, grad_ulps(dtype, q, k)):
        assert_rule(g, e, lo, dtype, factor=3.0, what=name, ulps=u, grad=True, magnitude=mag)


# --- varlen: per-sequence alignment and slopes rows ------------------------------------------

def cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def varlen_run(q, k, v, dout, cq, ck, mq, mk, **opts):
    out, lse = flashdl.attention_varlen(q, k, v, cq, ck, mq, mk, return_lse=True, **opts)
    grads = flashdl.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, mq, mk, **opts)
    return (out, lse) + tuple(grads)


LENS = [(5, 5), (0, 4), (9, 13), (3, 0), (17, 6), (0, 0), (1, 1), (12, 30)]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (4, 2)), (False, (-1, -1))])
@pytest.mark.parametrize("per_sequence", [True, False], ids=["slopes_bh", "slopes_h"])
def test_varlen_equals_each_sequence_alone(schedule, causal, window, per_sequence):
    """Sequence b uses slopes row b (or the shared row) with i and j counted within it: bit for
    bit each sequence run alone through attention with that row."""
    rng = np.random.default_rng(50)
    h, hk, d = 4, 2, 16
    sq, sk = [a for a, _ in LENS], [b_ for _, b_ in LENS]
    cq, ck = cu(sq), cu(sk)
    q, k, v = make(rng, (sum(sq), h, d)), make(rng, (sum(sk), hk, d)), make(rng, (sum(sk), hk, d))
    dout = make(rng, q.shape)
    slopes = rng.uniform(0.05, 1.0, (len(LENS), h) if per_sequence else (h,)).astype(np.float32)
    opts = dict(schedule=schedule, causal=causal, window_size=window, softcap=2.5,
                alibi_slopes=slopes)
    out, lse, dq, dk, dv = varlen_run(q, k, v, dout, cq, ck, max(sq), max(sk), **opts)
    for s in range(len(LENS)):
        rq, rk = slice(cq[s], cq[s + 1]), slice(ck[s], ck[s + 1])
        alone = dict(opts, alibi_slopes=slopes[s] if per_sequence else slopes)
        o1, l1, *g1 = run(q[None, rq], k[None, rk], v[None, rk], schedule, dout[None, rq],
                          **{key: val for key, val in alone.items() if key != "schedule"})
        assert np.array_equal(out[rq], o1[0]) and np.array_equal(lse[:, rq], l1[0]), s
        for name, g, w, rows in (("dq", dq, g1[0], rq), ("dk", dk, g1[1], rk),
                                 ("dv", dv, g1[2], rk)):
            assert np.array_equal(g[rows], w[0]), f"{name} of sequence {s}"


@given(lens=st.lists(st.tuples(st.integers(0, 25), st.integers(0, 25)), min_size=1, max_size=4),
       heads=st.sampled_from([(2, 1), (4, 2), (3, 3)]), d=st.sampled_from([4, 16]),
       causal=st.booleans(), window=st.sampled_from([(-1, -1), (3, 0), (2, 5)]),
       softcap=st.sampled_from([0.0, 0.8, 6.0]), per_sequence=st.booleans(),
       schedule=st.sampled_from(["fa1", "fa2"]))
def test_hypothesis_varlen_matches_oracle(lens, heads, d, causal, window, softcap, per_sequence,
                                          schedule):
    """float64 varlen against the oracle of each sequence with its own slopes row."""
    h, hk = heads
    rng = np.random.default_rng(zlib.crc32(repr(lens).encode()))
    sq, sk = [a for a, _ in lens], [b_ for _, b_ in lens]
    cq, ck = cu(sq), cu(sk)
    q = make(rng, (sum(sq), h, d), "float64") * 2
    k, v = make(rng, (sum(sk), hk, d), "float64"), make(rng, (sum(sk), hk, d), "float64")
    dout = make(rng, q.shape, "float64")
    slopes = rng.uniform(0.0, 1.0, (len(lens), h) if per_sequence else (h,)).astype(np.float32)
    opts = dict(schedule=schedule, causal=causal, window_size=window, softcap=softcap,
                alibi_slopes=slopes, softmax_scale=SCALE)
    out, lse, dq, dk, dv = varlen_run(q, k, v, dout, cq, ck, max(sq), max(sk), **opts)
    for s in range(len(lens)):
        rq, rk = slice(cq[s], cq[s + 1]), slice(ck[s], ck[s + 1])
        args = (q[None, rq], k[None, rk], v[None, rk])
        kw = dict(causal=causal, window=window, softcap=softcap, softmax_scale=SCALE,
                  alibi_slopes=slopes[s] if per_sequence else slopes)
        want_o, want_l = forward(*args, **kw)
        mo.close(out[rq], want_o[0], TOL[schedule], f"out of sequence {s}")
        assert_lse(lse[:, rq], want_l[0])
        want = backward(dout[None, rq], *args, **kw)
        mag = grad_magnitude(want)
        for name, g, w, rows in zip(("dq", "dk", "dv"), (dq, dk, dv), want, (rq, rk, rk)):
            mo.close(g[rows], w[0], TOL[schedule], f"{name} of sequence {s}", magnitude=mag)


# --- torch ------------------------------------------------------------------------------------

def torch_reference(torch, q, k, v, causal=False, window=(-1, -1), softcap=0.0, slopes=None,
                    scale=None):
    """Attention with the modifiers in float64 torch, written independently of the NumPy oracle:
    autograd gives its gradients. Rows that see no key give 0."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1 / np.sqrt(d) if scale is None else scale
    kh = k.transpose(1, 2).repeat_interleave(h // hk, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(h // hk, dim=1)
    s = q.transpose(1, 2) @ kh.transpose(-1, -2) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        sl = torch.as_tensor(np.asarray(slopes), dtype=torch.float64).expand(b, h)
        i = torch.arange(sq, dtype=torch.float64)[:, None] + (sk - sq)
        j = torch.arange(sk, dtype=torch.float64)[None, :]
        s = s - sl[:, :, None, None] * (i - j).abs()
    vis = torch.as_tensor(visible(sq, sk, causal, window))
    empty = ~vis.any(dim=-1, keepdim=True)
    s = s.masked_fill(~vis, -torch.inf).masked_fill(empty, 0.0)
    p = torch.softmax(s, dim=-1) * (~empty)
    return (p @ vh).transpose(1, 2)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("slopes_shape", ["h", "bh"])
def test_torch_autograd_matches_float64_reference(schedule, dtype, slopes_shape):
    """flashdl.torch.attention with both modifiers, forward and backward, against a float64 torch
    reference's autograd and the NumPy oracle; slopes given as a torch tensor that requires grad
    are accepted and get no gradient."""
    torch = pytest.importorskip("torch")
    import flashdl.torch as ft

    rng = np.random.default_rng(60)
    b, sq, sk, h, hk, d = 2, 29, 37, 4, 2, 16
    q, k, v = make_qkv(rng, b, sq, sk, h, hk, d, dtype="float64")
    q *= 2
    dout = make(rng, q.shape, "float64")
    slopes_np = rng.uniform(0.05, 1.0, (h,) if slopes_shape == "h" else (b, h)).astype(np.float32)
    tdt = getattr(torch, dtype)
    leaves = [torch.tensor(x, dtype=tdt, requires_grad=True) for x in (q, k, v)]
    slopes = torch.tensor(slopes_np, requires_grad=True)
    opts = dict(causal=True, window_size=(20, -1), softcap=2.0)
    out = ft.attention(*leaves, schedule=schedule, alibi_slopes=slopes, **opts)
    assert isinstance(out, torch.Tensor) and out.dtype == tdt and out.requires_grad
    out.backward(torch.tensor(dout, dtype=tdt))
    assert slopes.grad is None
    assert np.array_equal(slopes.detach().numpy(), slopes_np)

    ref_leaves = [torch.tensor(f64(x.detach().numpy()), requires_grad=True) for x in leaves]
    ref = torch_reference(torch, *ref_leaves, causal=True, window=(20, -1), softcap=2.0,
                          slopes=slopes_np)
    ref.backward(torch.tensor(dout))
    tol = {"float64": TOL[schedule], "float32": 4e-6}[dtype]
    want_grads = [x.grad.numpy() for x in ref_leaves]
    mag = grad_magnitude(want_grads)
    mo.close(out.detach().double().numpy(), ref.detach().numpy(), tol, "out")
    for name, x, w in zip(("dq", "dk", "dv"), leaves, want_grads):
        mo.close(x.grad.double().numpy(), w, 4 * tol, name, magnitude=mag)
    # the torch reference and the NumPy oracle agree (two independent oracles)
    oracle = backward(dout, *(x.detach().numpy() for x in ref_leaves), causal=True,
                      window=(20, -1), softcap=2.0, alibi_slopes=slopes_np)
    for name, o, w in zip(("dq", "dk", "dv"), oracle, want_grads):
        np.testing.assert_allclose(o, w, rtol=1e-10, atol=1e-12, err_msg=name)


def test_torch_varlen_autograd_with_modifiers():
    """flashdl.torch.attention_varlen with (batch, nheads) torch slopes and a cap equals the
    NumPy-level varlen forward and backward, bit for bit."""
    torch = pytest.importorskip("torch")
    import flashdl.torch as ft

    rng = np.random.default_rng(61)
    lens = [(7, 9), (0, 3), (13, 5), (4, 4)]
    h, hk, d = 4, 2, 8
    sq, sk = [a for a, _ in lens], [b_ for _, b_ in lens]
    cq, ck = cu(sq), cu(sk)
    q, k, v = (make(rng, (sum(sq), h, d), "float64"), make(rng, (sum(sk), hk, d), "float64"),
               make(rng, (sum(sk), hk, d), "float64"))
    dout = make(rng, q.shape, "float64")
    slopes = rng.uniform(0.05, 1.0, (len(lens), h)).astype(np.float32)
    opts = dict(causal=True, softcap=1.5)
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    tslopes = torch.tensor(slopes, requires_grad=True)
    out = ft.attention_varlen(*leaves, torch.from_numpy(cq), torch.from_numpy(ck), max(sq),
                              max(sk), alibi_slopes=tslopes, **opts)
    out.backward(torch.from_numpy(dout))
    assert tslopes.grad is None
    want = varlen_run(q, k, v, dout, cq, ck, max(sq), max(sk), alibi_slopes=slopes, **opts)
    assert np.array_equal(out.detach().numpy(), want[0])
    for name, x, w in zip(("dq", "dk", "dv"), leaves, want[2:]):
        assert np.array_equal(x.grad.numpy(), w), name


def test_torch_functional_api_takes_torch_slopes():
    """flashdl.attention with torch q takes torch (CPU) slopes as well as NumPy ones."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(62)
    q, k, v = make_qkv(rng, 2, 11, 13, 4, 1, 8)
    slopes = bloom_slopes(4)
    want = flashdl.attention(q, k, v, alibi_slopes=slopes, softcap=3.0)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    for s in (torch.from_numpy(slopes), slopes):
        got = flashdl.attention(tq, tk, tv, alibi_slopes=s, softcap=3.0)
        assert isinstance(got, torch.Tensor) and np.array_equal(got.numpy(), want)
