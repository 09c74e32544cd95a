"""Additive attention bias (with dBias), boolean mask and learnable sinks (issue 28).

A float64 oracle with the sink as one more logit of no value, and the same naive algorithm in the
input precision, judge out, lse, dq, dk, dv, dbias and dsinks by flash-attn's 2x rule (3x for the
gradients); hypothesis draws broadcast patterns (size-1 axes, stride 0, transposed views), dtypes,
causal, windows, GQA. A zero bias and an all-True mask give plain attention bitwise on a key tile
with padding columns (over whole key tiles the plain forward folds the scale into exp2's FMA and
a row's first tile differs by that rounding: cpu_tuning.md section 36); varlen takes the bias
per packed row; bad input is refused naming the argument; inputs are never written.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashdl
from attn_oracle import (EPS, EPS_GRAD, _heads, _Round, f64, make, make_qkv, max_err, np_dtype,
                         softmax_scale_of, visible)

SCHEDULES = ["fa2", "fa1", "reference"]


def oracle(q, k, v, dout, causal=False, window=(-1, -1), bias=None, mask=None, sinks=None,
           dtype="float64", exact=True, softcap=0.0):
    """(out, lse, dq, dk, dv, dbias, dsinks) of naive attention with a bias (broadcastable to
    (b, h, sq, sk); dbias summed back to its shape), a bool mask and sinks (one logit per head in
    each row's denominator, no value); exact: float64, else rounded to dtype at each step."""
    rnd = _Round(dtype, exact)
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    scale = softmax_scale_of(d)
    qh, kh, vh, doh = (rnd(_heads(f64(q))), rnd(_heads(f64(k), g)), rnd(_heads(f64(v), g)),
                       rnd(_heads(f64(dout))))
    s = rnd(qh @ np.swapaxes(kh, -1, -2) * scale)
    gcap = None
    if softcap > 0:
        th = np.tanh(s / softcap)
        s, gcap = softcap * th, 1 - th * th
    if bias is not None:
        s = s + f64(bias)
    vis = np.broadcast_to(visible(sq, sk, causal, window), (b, h, sq, sk))
    if mask is not None:
        vis = vis & np.asarray(mask, dtype=bool)
    s = np.where(vis, s, -np.inf)
    if sinks is not None:
        col = np.broadcast_to(f64(sinks)[None, :, None, None], (b, h, sq, 1))
    else:
        col = np.full((b, h, sq, 1), -np.inf)
    full = np.concatenate([s, col], axis=-1)
    m = full.max(axis=-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0)
    e = np.exp(full - m_safe)
    l = e.sum(axis=-1, keepdims=True)
    pall = e / np.where(l > 0, l, 1)
    p, psink = rnd(pall[..., :sk]), pall[..., sk]
    with np.errstate(divide="ignore"):
        lse = np.where(l > 0, m_safe + np.log(np.where(l > 0, l, 1)), -np.inf)[..., 0]
    o = rnd(p @ vh)
    dv = np.swapaxes(p, -1, -2) @ doh
    dp = rnd(doh @ np.swapaxes(vh, -1, -2))
    delta = np.sum(doh * o, axis=-1, keepdims=True)
    ds = rnd(p * (dp - delta))
    dbias = None
    if bias is not None:
        shape = np.shape(bias)
        full_shape = (1,) * (4 - len(shape)) + tuple(shape)
        axes = tuple(a for a in range(4) if full_shape[a] == 1 and ds.shape[a] > 1)
        dbias = ds.sum(axis=axes, keepdims=True).reshape(shape)
    dsinks = None if sinks is None else -(psink * delta[..., 0]).sum(axis=(0, 2))
    if gcap is not None:
        ds = ds * gcap
    dq = rnd(ds @ kh * scale)
    dk = np.swapaxes(ds, -1, -2) @ qh * scale

    def group_sum(x):
        return np.swapaxes(rnd(x.reshape(b, hk, g, sk, d).sum(axis=2)), 1, 2)

    return (np.swapaxes(o, 1, 2), lse, np.swapaxes(dq, 1, 2), group_sum(dk), group_sum(dv),
            dbias, dsinks)


def check_rule(got, want, naive, dtype, what, grad=False, factor=None):
    """flash-attn's rule, 2x for out and 3x for gradients, eps scaled by the magnitude and by
    sqrt(n) ulps of float32 (a kernel sums in another order than NumPy)."""
    got = f64(got)
    assert not np.isnan(got).any(), f"{what}: NaN"
    factor = factor or (3.0 if grad else 2.0)
    magnitude = max(1.0, float(np.max(np.abs(want), initial=0.0)))
    ulps = 64.0 if dtype == "float32" else 1.0
    eps = (EPS_GRAD if grad else EPS)[dtype] * ulps * magnitude
    err, nerr = max_err(got, want), max_err(naive, want)
    assert err <= factor * nerr + eps, f"{what}: {err:.3e} > {factor}*{nerr:.3e} + {eps:.1e}"


def run(q, k, v, dout, schedule="fa2", **kw):
    """flashdl's forward and backward: (out, lse, dq, dk, dv, dbias or None, dsinks or None)."""
    out, lse = flashdl.attention(q, k, v, schedule=schedule, return_lse=True, **kw)
    grads = flashdl.attention_backward(dout, q, k, v, out, lse, schedule=schedule, **kw)
    dq, dk, dv, *extra = grads
    dbias = extra.pop(0) if kw.get("bias") is not None else None
    dsinks = extra.pop(0) if kw.get("sinks") is not None else None
    assert not extra
    return out, lse, dq, dk, dv, dbias, dsinks


def check_all(got, q, k, v, dout, dtype, **kw):
    want = oracle(q, k, v, dout, **kw)
    naive = oracle(q, k, v, dout, dtype=dtype, exact=False, **kw)
    names = ("out", "lse", "dq", "dk", "dv", "dbias", "dsinks")
    for i, name in enumerate(names):
        if want[i] is None:
            assert got[i] is None, name
            continue
        if name == "lse":
            inf = np.isneginf(want[1])
            assert np.array_equal(np.isneginf(f64(got[1])), inf), "lse: -inf where no key"
            np.testing.assert_allclose(f64(got[1])[~inf], want[1][~inf], rtol=2e-5, atol=2e-5)
            continue
        assert np.shape(got[i]) == np.shape(want[i]), name
        check_rule(got[i], want[i], naive[i], dtype, name, grad=i >= 2)


CASES = {
    # name: (b, sq, sk, h, hk, d, bias shape or None, mask shape or None, sinks, causal, window)
    "full bias": (2, 37, 53, 4, 4, 16, "bhqk", None, False, False, (-1, -1)),
    "head bias, mask, sinks, GQA causal": (2, 45, 45, 4, 2, 16, "1hqk", "b1qk", True, True,
                                           (-1, -1)),
    "row-broadcast bias, window": (1, 64, 97, 2, 1, 32, "bh1k", None, True, False, (13, 7)),
    "key-only bias, per-head mask": (2, 19, 130, 2, 2, 8, "k", "1hqk", False, False, (-1, -1)),
    "long queries, few keys (by_queries)": (1, 400, 40, 2, 1, 16, "1hqk", "11qk", True, False,
                                            (-1, -1)),
}


def draw_inputs(rng, case, dtype):
    b, sq, sk, h, hk, d, bshape, mshape, sinks, causal, window = case
    q, k, v = make_qkv(rng, b, sq, sk, h, hk, d, dtype)
    dout = make(rng, (b, sq, h, d), dtype)

    def shape_of(code):
        sizes = {"b": b, "h": h, "q": sq, "k": sk, "1": 1}
        return tuple(sizes[c] for c in code)

    kw = dict(causal=causal, window_size=window)
    if bshape is not None:
        kw["bias"] = (rng.standard_normal(shape_of(bshape)) * 2).astype(np.float32)
    if mshape is not None:
        m = rng.random(shape_of(mshape)) > 0.25
        m[..., 2, :] = False  # a row that keeps no key
        kw["mask"] = m
    if sinks:
        kw["sinks"] = (rng.standard_normal(h) * 2).astype(np.float32)
    return q, k, v, dout, kw


def oracle_kw(kw):
    return dict(causal=kw["causal"], window=kw["window_size"], bias=kw.get("bias"),
                mask=kw.get("mask"), sinks=kw.get("sinks"))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_oracle_rule(case, dtype, schedule):
    if schedule == "reference" and case[1] * case[2] > 10000:
        pytest.skip("the reference is the oracle's algorithm; big shapes cost time only")
    # A seed fixed per case (zlib.crc32, not hash(): str hashes change with every interpreter,
    # which drew new inputs on every run; about 1 draw in 400 of the row-broadcast float16 fa2
    # case has a dsinks error just past flash-attn's 3x rule, at ca4e438 as now).
    rng = np.random.default_rng(zlib.crc32(f"{case}{dtype}{schedule}".encode()))
    q, k, v, dout, kw = draw_inputs(rng, case, dtype)
    got = run(q, k, v, dout, schedule, **kw)
    check_all(got, q, k, v, dout, dtype, **oracle_kw(kw))


@pytest.mark.parametrize("bias_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("jump", [0.0, 12.0])
def test_bias_over_whole_key_tiles(bias_dtype, jump):
    """Three whole key tiles (96 keys each): after a row's first tile the bfloat16 fa2 forward
    adds the bias in the S micro-kernel's epilogue, against the row's earlier max; `jump` added
    to the second tile's bias takes every row past that max by more than 8 (log2 domain), and
    those rows are redone. The mask hides one score of the first tile and keeps all of the
    others (its later tiles take the same path as no mask); a bias broadcast over the batch."""
    rng = np.random.default_rng(7 + int(jump) + (bias_dtype == "bfloat16"))
    q, k, v = make_qkv(rng, 2, 50, 288, 4, 2, 64, "bfloat16")
    dout = make(rng, q.shape, "bfloat16")
    bias = rng.standard_normal((1, 4, 50, 288)) * 2
    bias[..., 96:192] += jump
    bias = bias.astype(np_dtype(bias_dtype))
    mask = np.ones((1, 1, 50, 288), bool)
    mask[..., 5, 10] = False
    got = run(q, k, v, dout, "fa2", bias=bias, mask=mask)
    check_all(got, q, k, v, dout, "bfloat16", bias=bias, mask=mask)


def test_softcap_alibi_then_bias_order():
    """The bias is added after the cap (and ALiBi), before the mask: scale, cap, ALiBi, bias."""
    rng = np.random.default_rng(3)
    q, k, v = make_qkv(rng, 1, 20, 24, 2, 2, 16)
    dout = make(rng, q.shape)
    bias = rng.standard_normal((1, 2, 20, 24)).astype(np.float32)
    for schedule in SCHEDULES:
        got = run(q, k, v, dout, schedule, bias=bias, softcap=1.5)
        check_all(got, q, k, v, dout, "float32", bias=bias, softcap=1.5)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_zero_bias_and_all_true_mask_are_plain_attention_bitwise(schedule, dtype, causal):
    rng = np.random.default_rng(1)
    q, k, v = make_qkv(rng, 2, 50, 70, 4, 2, 32, dtype)
    dout = make(rng, q.shape, dtype)
    plain = run(q, k, v, dout, schedule, causal=causal)
    extras = dict(bias=np.zeros((1, 4, 50, 70), np.float32), mask=np.ones((2, 1, 1, 70), bool))
    for kw in (dict(bias=extras["bias"]), dict(mask=extras["mask"]), extras):
        got = run(q, k, v, dout, schedule, causal=causal, **kw)
        for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
            assert np.array_equal(f64(got[i]), f64(plain[i]), equal_nan=True), (name, kw.keys())
        if "bias" in kw:
            assert got[5].shape == kw["bias"].shape


def test_sinks_of_minus_infinity_in_the_limit_and_empty_rows():
    """A very negative sink is plain attention; a row that sees no key gets out 0, lse = sink and
    no gradient."""
    rng = np.random.default_rng(4)
    q, k, v = make_qkv(rng, 1, 30, 30, 2, 2, 16)
    dout = make(rng, q.shape)
    plain = run(q, k, v, dout, causal=True)
    far = run(q, k, v, dout, causal=True, sinks=np.full(2, -1e4, np.float32))
    for i in range(5):
        np.testing.assert_allclose(f64(far[i]), f64(plain[i]), rtol=1e-6, atol=1e-7)
    mask = np.ones((1, 1, 30, 30), bool)
    mask[..., 5, :] = False
    sinks = np.array([0.5, -2.0], np.float32)
    out, lse, dq, *_ = run(q, k, v, dout, mask=mask, sinks=sinks)
    assert np.all(out[0, 5] == 0) and np.all(dq[0, 5] == 0)
    np.testing.assert_allclose(lse[0, :, 5], sinks, rtol=1e-6)


def test_dropout_with_bias_mask_sinks_matches_the_reference():
    """fa1 and fa2 against the float64 reference schedule (which applies the same Philox mask)."""
    rng = np.random.default_rng(5)
    q, k, v = make_qkv(rng, 2, 33, 41, 4, 2, 16)
    dout = make(rng, q.shape)
    kw = dict(bias=rng.standard_normal((1, 4, 33, 41)).astype(np.float32),
              mask=rng.random((2, 1, 33, 41)) > 0.2, sinks=rng.standard_normal(4).astype(np.float32),
              dropout_p=0.3, seed=11, causal=True)
    want = run(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
               dout.astype(np.float64), "reference", **kw)
    for schedule in ("fa1", "fa2"):
        got = run(q, k, v, dout, schedule, **kw)
        for i, name in enumerate(("out", "lse", "dq", "dk", "dv", "dbias", "dsinks")):
            scale = max(1.0, float(np.abs(want[i]).max()))
            assert max_err(got[i], want[i]) <= 2e-5 * scale, (schedule, name)


def test_tiles_the_mask_hides_are_skipped_and_correct():
    """A block-diagonal mask (whole 96-key tiles False) gives what the oracle gives."""
    rng = np.random.default_rng(6)
    q, k, v = make_qkv(rng, 1, 192, 384, 2, 2, 16)
    dout = make(rng, q.shape)
    mask = np.zeros((1, 1, 192, 384), bool)
    mask[..., :96, :192] = True
    mask[..., 96:, 192:] = True
    for schedule in ("fa1", "fa2"):
        got = run(q, k, v, dout, schedule, mask=mask)
        check_all(got, q, k, v, dout, "float32", mask=mask)


def test_dbias_is_deterministic_for_a_thread_count():
    rng = np.random.default_rng(7)
    q, k, v = make_qkv(rng, 3, 100, 120, 4, 2, 16)
    dout = make(rng, q.shape)
    bias = rng.standard_normal((1, 1, 100, 120)).astype(np.float32)
    first = run(q, k, v, dout, bias=bias, sinks=np.zeros(4, np.float32))
    for _ in range(3):
        again = run(q, k, v, dout, bias=bias, sinks=np.zeros(4, np.float32))
        assert np.array_equal(first[5], again[5]) and np.array_equal(first[6], again[6])


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("shape", [(1, 1, 1, 700), (1, 1, 130, 700), (2, 1, 130, 700),
                                   (1, 4, 1, 700)])
def test_broadcast_dbias_by_key_tiles(threads, shape):
    """fa2 sums a broadcast bias's dBias by key tiles (each thread its tiles' columns over every
    (batch, head), the tiles its slice shares with a neighbour summed in thread order): equal to
    the full-size bias's dBias summed over the broadcast axes, and to the float64 oracle, for
    thread counts whose slices cut key tiles between threads (8 tiles of 96 keys, 6 (batch,
    kv head) pairs), bitwise repeatable; out, lse, dk, dv bitwise those of the full-size bias."""
    import flashdl as fd
    rng = np.random.default_rng(30 + threads)
    q, k, v = make_qkv(rng, 2, 130, 700, 4, 2, 16)
    dout = make(rng, q.shape)
    bias = rng.standard_normal(shape).astype(np.float32)
    full = np.ascontiguousarray(np.broadcast_to(bias, (2, 4, 130, 700)))
    fd.set_num_threads(threads)
    try:
        got = run(q, k, v, dout, "fa2", bias=bias, causal=True)
        again = run(q, k, v, dout, "fa2", bias=bias, causal=True)
        ref = run(q, k, v, dout, "fa2", bias=full, causal=True)
    finally:
        fd.set_num_threads(0)
    assert np.array_equal(got[5], again[5])
    axes = tuple(a for a in range(4) if shape[a] == 1)
    np.testing.assert_allclose(got[5], ref[5].sum(axis=axes, keepdims=True), rtol=1e-5,
                               atol=1e-6)
    for i in (0, 1, 3, 4):  # out, lse, dk, dv: each from one task either way
        np.testing.assert_array_equal(got[i], ref[i])
    np.testing.assert_allclose(got[2], ref[2], rtol=1e-5, atol=1e-6)  # dQ: partials regrouped
    check_all(got, q, k, v, dout, "float32", bias=bias, causal=True)


@pytest.mark.parametrize("schedule", ["fa2", "fa1"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window_size": (5, 3)},
                                {"softcap": 5.0}, {"dropout_p": 0.2, "seed": 3},
                                {"mask": "random"}, {"broadcast": True}],
                         ids=["dense", "causal", "window", "softcap", "dropout", "mask",
                              "broadcast"])
def test_dbias_output_is_fully_written_over_a_poisoned_buffer(monkeypatch, schedule, dtype, kw):
    """The dense (no mask, full-size bias) backward no longer zeroes dbias first (the kernels
    store every element): a dbias buffer of NaN must come back equal to a zeroed one's."""
    from flashdl import _frameworks
    rng = np.random.default_rng(11)
    kw = dict(kw)
    q, k, v = make_qkv(rng, 2, 150, 330, 4, 2, 16, dtype=dtype)
    dout = make(rng, q.shape, dtype)
    rows = 1 if kw.pop("broadcast", False) else 150
    bias = make(rng, (2, 4, rows, 330), dtype)
    if kw.get("mask") == "random":
        kw["mask"] = rng.random((2, 1, 150, 330)) < 0.5
    fwd = {n: x for n, x in kw.items() if n != "seed"}
    out, lse, *seed = flashdl.attention(q, k, v, bias=bias, schedule=schedule, return_lse=True,
                                        return_seed="dropout_p" in kw, **fwd)
    if seed:
        kw["seed"] = seed[0]
    real_empty = _frameworks.Frame.empty

    def results(fill):
        def empty(self, shape, dt):
            x = real_empty(self, shape, dt)
            x.fill(fill)
            return x
        monkeypatch.setattr(_frameworks.Frame, "empty", empty)
        try:
            return flashdl.attention_backward(dout, q, k, v, out, lse, bias=bias,
                                              schedule=schedule, **kw)
        finally:
            monkeypatch.setattr(_frameworks.Frame, "empty", real_empty)
    poisoned, zeroed = results(np.nan), results(0)
    for a, b in zip(poisoned, zeroed):
        a, b = np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)
        assert np.array_equal(a, b)


broadcasts = st.tuples(st.sampled_from(["b", "1", "0"]), st.sampled_from(["h", "1", "0"]),
                       st.sampled_from(["q", "1", "0"]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(b=st.integers(1, 2), sq=st.integers(1, 70), sk=st.integers(1, 110),
       heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]), d=st.sampled_from([8, 16, 40]),
       bias_axes=broadcasts, mask_axes=st.one_of(st.none(), broadcasts),
       transposed=st.booleans(), sinks=st.booleans(), causal=st.booleans(),
       window=st.sampled_from([(-1, -1), (5, 3), (0, 0), (20, -1)]),
       dtype=st.sampled_from(["float32", "bfloat16"]), schedule=st.sampled_from(["fa1", "fa2"]),
       seed=st.integers(0, 2**31))
def test_hypothesis_broadcast_patterns(b, sq, sk, heads, d, bias_axes, mask_axes, transposed,
                                       sinks, causal, window, dtype, schedule, seed):
    """Leading axes full, size 1 or stride 0 (np.broadcast_to), the bias possibly a transposed
    view (keys not contiguous): forward and backward by the rule, dbias in the bias's shape."""
    h, hk = heads
    rng = np.random.default_rng(seed)
    q, k, v = make_qkv(rng, b, sq, sk, h, hk, d, dtype)
    dout = make(rng, q.shape, dtype)
    full = (b, h, sq)

    def array(axes, draw):
        shape = tuple(full[a] if c not in "10" else 1 for a, c in enumerate(axes)) + (sk,)
        x = draw(shape[:3] + (sk,))
        if transposed:
            x = np.ascontiguousarray(np.swapaxes(x, -1, -2)).swapaxes(-1, -2)
        target = tuple(full[a] if c == "0" else shape[a] for a, c in enumerate(axes)) + (sk,)
        return np.broadcast_to(x, target)

    bias = array(bias_axes, lambda s: rng.standard_normal(s).astype(np.float32))
    mask = None if mask_axes is None else array(mask_axes, lambda s: rng.random(s) > 0.3)
    kw = dict(bias=bias, mask=mask, causal=causal, window_size=window,
              sinks=(rng.standard_normal(h).astype(np.float32) if sinks else None))
    kw = {n: x for n, x in kw.items() if x is not None}
    got = run(q, k, v, dout, schedule, **kw)
    assert got[5].shape == bias.shape
    # dbias of a stride-0 axis is the gradient of the shared value: compare the compact one.
    compact = tuple(slice(0, 1) if bias.strides[a] == 0 and bias.shape[a] > 1 else slice(None)
                    for a in range(3))
    got = got[:5] + (np.asarray(got[5])[compact],) + got[6:]
    okw = oracle_kw(dict(kw, causal=causal, window_size=window))
    okw["bias"] = np.ascontiguousarray(bias[compact])
    check_all(got, q, k, v, dout, dtype, **okw)


def test_varlen_bias_per_packed_row_mask_and_sinks():
    """Sequence s of a varlen call is the dense call on its rows of the bias and mask; dbias
    holds each sequence's rows, dsinks sums over the sequences."""
    rng = np.random.default_rng(8)
    lens_q, lens_k = [7, 0, 30, 12], [9, 4, 25, 40]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    tq, tk, h, hk, d = cu_q[-1], cu_k[-1], 4, 2, 16
    q, k, v, dout = (make(rng, (tq, h, d)), make(rng, (tk, hk, d)), make(rng, (tk, hk, d)),
                     make(rng, (tq, h, d)))
    mk = max(lens_k)
    bias = rng.standard_normal((h, tq, mk)).astype(np.float32)
    mask = rng.random((1, tq, mk)) > 0.2
    sinks = rng.standard_normal(h).astype(np.float32)
    kw = dict(bias=bias, mask=mask, sinks=sinks, causal=True)
    out, lse = flashdl.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), mk, return_lse=True,
                                        **kw)
    dq, dk, dv, dbias, dsinks = flashdl.attention_varlen_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max(lens_q), mk, **kw)
    want_dsinks = np.zeros(h)
    for s in range(4):
        rq, rk = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        if lens_q[s] == 0:
            assert np.all(dk[rk] == 0) and np.all(dv[rk] == 0)
            continue
        sb = bias[None, :, rq, :lens_k[s]]
        sm = mask[None, :, rq, :lens_k[s]]
        want = oracle(q[None, rq], k[None, rk], v[None, rk], dout[None, rq], causal=True,
                      bias=sb, mask=sm, sinks=sinks)
        naive = oracle(q[None, rq], k[None, rk], v[None, rk], dout[None, rq], causal=True,
                       bias=sb, mask=sm, sinks=sinks, dtype="float32", exact=False)
        for got_x, i, name in ((out[rq], 0, "out"), (dq[rq], 2, "dq"), (dk[rk], 3, "dk"),
                               (dv[rk], 4, "dv"), (dbias[None, :, rq, :lens_k[s]], 5, "dbias")):
            check_rule(got_x[None] if name != "dbias" else got_x, want[i], naive[i], "float32",
                       f"seq {s} {name}", grad=i >= 2)
        assert np.all(dbias[:, rq, lens_k[s]:] == 0)  # keys past the sequence: no gradient
        want_dsinks += want[6]
    np.testing.assert_allclose(dsinks, want_dsinks, rtol=1e-4, atol=1e-5)


def test_zero_length_inputs():
    rng = np.random.default_rng(9)
    q, k, v = make_qkv(rng, 2, 0, 5, 2, 2, 8)
    kw = dict(bias=np.ones((2, 2, 0, 5), np.float32), sinks=np.ones(2, np.float32))
    out, lse = flashdl.attention(q, k, v, return_lse=True, **kw)
    dq, dk, dv, dbias, dsinks = flashdl.attention_backward(np.ones_like(out), q, k, v, out, lse,
                                                           **kw)
    assert dbias.shape == (2, 2, 0, 5) and np.all(dsinks == 0) and np.all(dk == 0)
    q, k, v = make_qkv(rng, 1, 4, 0, 2, 2, 8)
    out, lse = flashdl.attention(q, k, v, return_lse=True, bias=np.zeros((4, 0), np.float32),
                                 sinks=np.array([1.0, 2.0], np.float32))
    assert np.all(out == 0)
    np.testing.assert_allclose(lse[0], [[1.0] * 4, [2.0] * 4])


def test_inputs_are_not_written():
    rng = np.random.default_rng(10)
    q, k, v = make_qkv(rng, 1, 20, 20, 2, 2, 8)
    kw = dict(bias=rng.standard_normal((1, 2, 20, 20)).astype(np.float32),
              mask=rng.random((20, 20)) > 0.3, sinks=rng.standard_normal(2).astype(np.float32))
    saved = {n: x.copy() for n, x in kw.items()}
    run(q, k, v, make(rng, q.shape), **kw)
    for n, x in kw.items():
        assert np.array_equal(x, saved[n]), n


@pytest.mark.parametrize("kw,exc,match", [
    (dict(bias=np.zeros((2, 3, 5, 6), np.float32)), ValueError, r"^bias: expected a shape "
     r"broadcastable to \(2, 3, 5, 7\)"),
    (dict(bias=np.zeros((5, 6), np.float32)), ValueError, "^bias: expected a shape"),
    (dict(bias=np.zeros((1, 1, 1, 2, 5, 7), np.float32)), ValueError, "^bias: expected an array "
     "of rank 1 to 4"),
    (dict(bias=np.zeros((2, 3, 5, 7), np.int32)), TypeError, "^bias: expected dtype float32, float16 or "
     "bfloat16 .* got int32"),
    (dict(bias=[[0.0]]), TypeError, "^bias: expected None or a float array"),
    (dict(mask=np.ones((4, 7), bool)), ValueError, "^mask: expected a shape"),
    (dict(mask=np.ones((5, 7), np.float32)), TypeError, "^mask: expected dtype bool"),
    (dict(mask=np.ones((5, 7), np.int64)), TypeError, "^mask: unsupported dtype int64"),
    (dict(sinks=np.zeros(2, np.float32)), ValueError, r"^sinks: expected shape \(3,\)"),
    (dict(sinks=np.zeros(3, np.float64)), TypeError, "^sinks: expected dtype float32"),
    (dict(sinks=np.array([0, np.nan, 0], np.float32)), ValueError, "^sinks: expected finite"),
])
def test_bad_input_is_refused_naming_the_argument(kw, exc, match):
    rng = np.random.default_rng(0)
    q, k, v = make_qkv(rng, 2, 5, 7, 3, 3, 8)
    with pytest.raises(exc, match=match):
        flashdl.attention(q, k, v, **kw)


def test_varlen_bias_shape_is_checked():
    rng = np.random.default_rng(0)
    cu = np.array([0, 3, 8], np.int32)
    q = make(rng, (8, 2, 8))
    with pytest.raises(ValueError, match=r"^bias: expected a shape broadcastable to \(2, 8, 5\)"):
        flashdl.attention_varlen(q, q, q, cu, cu, 5, 5, bias=np.zeros((2, 8, 4), np.float32))


def test_bfloat16_bias_from_numpy():
    rng = np.random.default_rng(12)
    q, k, v = make_qkv(rng, 1, 16, 16, 2, 2, 16, "bfloat16")
    dout = make(rng, q.shape, "bfloat16")
    bias = make(rng, (1, 2, 16, 16), "bfloat16")
    got = run(q, k, v, dout, bias=bias)
    assert got[5].dtype == np_dtype("bfloat16")
    check_all(got, q, k, v, dout, "bfloat16", bias=f64(bias))


# --- torch: autograd for bias and sinks, SDPA's attn_mask -------------------------------------

def _torch():
    return pytest.importorskip("torch")


def torch_reference(q, k, v, bias=None, mask=None, sinks=None, causal=False):
    """Eager float64 attention in torch's autograd, (b, s, h, d) layout, sinks as gpt-oss does."""
    torch = _torch()
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    kr, vr = (x.repeat_interleave(h // hk, 2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, kr) / d**0.5
    if bias is not None:
        s = s + bias
    vis = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        vis = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    if mask is not None:
        vis = vis & mask
    s = s.masked_fill(~vis, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double()[None, :, None, None].expand(b, h, sq, 1)], -1)
    p = torch.nan_to_num(s.softmax(-1))[..., :sk]
    return torch.einsum("bhqk,bkhd->bqhd", p, vr)


@pytest.mark.parametrize("schedule", ["reference", "fa2", "fa1"])
def test_torch_gradcheck_bias_and_sinks(schedule):
    torch = _torch()
    import flashdl.torch as ft
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 5, 2, 4, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 6, 1, 4, dtype=torch.float64, generator=g, requires_grad=True)
            for _ in range(2))
    bias = torch.randn(2, 1, 6, dtype=torch.float64, generator=g, requires_grad=True)
    sinks = torch.randn(2, generator=g, requires_grad=True)
    mask = torch.rand(5, 6, generator=g) > 0.2

    def f(q, k, v, bias, sinks):
        return ft.attention(q, k, v, bias=bias, mask=mask, sinks=sinks, schedule=schedule,
                            causal=True)
    # fa1/fa2 rebuild P from the float32 lse: float32-accurate gradients of float64 inputs.
    tol = dict(atol=1e-9, rtol=1e-7) if schedule == "reference" else dict(atol=2e-5, rtol=1e-3)
    # sinks are float32 (their numerical derivative needs a float32-sized step).
    assert torch.autograd.gradcheck(lambda q, k, v, b: f(q, k, v, b, sinks.detach()),
                                    (q, k, v, bias), **tol)
    out = f(q, k, v, bias, sinks)
    want = torch_reference(q, k, v, bias[None], mask, sinks, causal=True)
    grad = torch.randn(out.shape, dtype=torch.float64, generator=g)
    got = torch.autograd.grad(out, (q, k, v, bias, sinks), grad)
    exp = torch.autograd.grad(want, (q, k, v, bias, sinks), grad)
    for name, a, b in zip(("dq", "dk", "dv", "dbias", "dsinks"), got, exp):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-5, msg=name)


def test_torch_expanded_bias_gets_the_summed_gradient():
    """A bias broadcast with expand (stride 0) reaches its base tensor's gradient once."""
    torch = _torch()
    import flashdl.torch as ft
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 9, 2, 8, dtype=torch.float64, generator=g, requires_grad=True)
               for _ in range(3))
    base = torch.randn(1, 2, 9, 9, dtype=torch.float64, generator=g, requires_grad=True)
    out = ft.attention(q, k, v, bias=base.expand(3, 2, 9, 9))
    want = torch_reference(q, k, v, base)
    got = torch.autograd.grad(out.sum(), (base,))[0]
    exp = torch.autograd.grad(want.sum(), (base,))[0]
    torch.testing.assert_close(got, exp, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["float", "float expanded", "bool", "rank-2 float causal"])
def test_sdpa_attn_mask_runs_in_flashdl(kind):
    torch = _torch()
    import torch.nn.functional as F

    import flashdl.torch as ft
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 11, 8, dtype=torch.float64, generator=g, requires_grad=True)
               for _ in range(3))
    causal = False
    if kind == "float":
        m = torch.randn(2, 4, 11, 11, dtype=torch.float64, generator=g, requires_grad=True)
        leaf = m
    elif kind == "float expanded":
        leaf = torch.randn(4, 1, 11, dtype=torch.float64, generator=g, requires_grad=True)
        m = leaf.expand(2, 4, 11, 11)
    elif kind == "bool":
        m = torch.rand(2, 1, 11, 11, generator=g) > 0.3
        leaf = None
    else:
        leaf = torch.randn(11, 11, dtype=torch.float64, generator=g, requires_grad=True)
        m = leaf
    got = ft.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    inputs = (q, k, v) + ((leaf,) if leaf is not None else ())
    grad = torch.randn(got.shape, dtype=torch.float64, generator=g)
    for a, b in zip(torch.autograd.grad(got, inputs, grad), torch.autograd.grad(want, inputs, grad)):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-5)


# ---- sinks in the KV cache ------------------------------------------------------------------------

def _paged(kc, vc, page=16):
    """The contiguous float32 caches kc, vc (2, 256, 2, 32) as a page pool in reversed page order:
    (block_table, k pages, v pages)."""
    table = np.arange(2 * 256 // page, dtype=np.int32).reshape(2, -1)[:, ::-1].copy()
    pk = np.empty((2 * 256 // page, page, 2, 32), np.float32)
    pv = np.empty_like(pk)
    for b in range(2):
        for i, pg in enumerate(table[b]):
            pk[pg] = kc[b, i * page:(i + 1) * page]
            pv[pg] = vc[b, i * page:(i + 1) * page]
    return table, pk, pv


def _kv_inputs(rng, dtype, b=2, sq=3, h=4, hk=2, d=32, cap=700):
    q = make(rng, (b, sq, h, d), dtype)
    kc, vc = make(rng, (b, cap, hk, d), dtype), make(rng, (b, cap, hk, d), dtype)
    sinks = (rng.standard_normal(h) * 3).astype(np.float32)
    return q, kc, vc, sinks


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("num_splits", [1, 2, 4])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(), dict(causal=True, window_size=(200, 0)),
                                dict(softcap=5.0)])
def test_kvcache_sinks_against_the_oracle(dtype, num_splits, kw):
    """attention_with_kvcache with sinks (split-KV or not): the sink joins each row's denominator
    once, after the splits merge; out and lse by the float64 oracle's rule, over the keys each
    sequence uses."""
    rng = np.random.default_rng(num_splits)
    q, kc, vc, sinks = _kv_inputs(rng, dtype)
    lens = np.array([650, 333], np.int32)
    out, lse = flashdl.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, sinks=sinks,
                                              num_splits=num_splits, return_lse=True, **kw)
    for b, n in enumerate(lens):
        args = (q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], q[b:b + 1])
        okw = dict(causal=kw.get("causal", False), window=kw.get("window_size", (-1, -1)),
                   softcap=kw.get("softcap", 0.0), sinks=sinks)
        want = oracle(*args, **okw)
        naive = oracle(*args, dtype=dtype, exact=False, **okw)
        check_rule(out[b:b + 1], want[0], naive[0], dtype, f"out[{b}]")
        np.testing.assert_allclose(lse[b:b + 1], want[1], rtol=1e-5, atol=2e-5)


def test_kvcache_sinks_paged_append_and_empty_rows():
    """Paged equals contiguous bitwise with sinks and an append; a sequence with no key gets out 0
    and lse = its head's sink (the sink is its whole denominator)."""
    rng = np.random.default_rng(3)
    q, kc, vc, sinks = _kv_inputs(rng, "float32", b=2, sq=1, cap=256)
    k_new, v_new = (make(rng, (2, 1, 2, 32)) for _ in range(2))
    lens = np.array([100, 0], np.int32)
    kc2, vc2 = kc.copy(), vc.copy()
    out, lse = flashdl.attention_with_kvcache(q, kc2, vc2, cache_seqlens=lens, k=k_new, v=v_new,
                                              sinks=sinks, causal=True, return_lse=True)
    table, pk, pv = _paged(kc, vc)
    out_p, lse_p = flashdl.attention_with_kvcache(q, pk, pv, cache_seqlens=lens, k=k_new, v=v_new,
                                                  block_table=table, sinks=sinks, causal=True,
                                                  return_lse=True)
    np.testing.assert_array_equal(out_p, out)
    np.testing.assert_array_equal(lse_p, lse)
    # No key at all: a zero-length cache and no append.
    out0, lse0 = flashdl.attention_with_kvcache(q, kc, vc, cache_seqlens=np.zeros(2, np.int32),
                                                sinks=sinks, return_lse=True)
    assert not out0.any()
    np.testing.assert_allclose(lse0, np.broadcast_to(sinks[None, :, None], lse0.shape),
                               rtol=1e-6, atol=0)  # via the exp2 domain: an ulp


def test_decode_shaped_attention_with_sinks_matches_fa2():
    """schedule="auto" sends decode-shaped calls (one query row, long keys) to the KV-cache
    kernel; with sinks too now: the same result as fa2 within float32 rounding."""
    rng = np.random.default_rng(4)
    q, k, v = make_qkv(rng, 2, 1, 3000, 4, 2, 64)
    sinks = (rng.standard_normal(4) * 3).astype(np.float32)
    out, lse = flashdl.attention(q, k, v, sinks=sinks, return_lse=True)
    out2, lse2 = flashdl.attention(q, k, v, sinks=sinks, return_lse=True, schedule="fa2")
    np.testing.assert_allclose(out, out2, rtol=0, atol=2e-6)
    np.testing.assert_allclose(lse, lse2, rtol=0, atol=2e-6)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(sinks=np.zeros(3, np.float32)), ValueError, r"^sinks: expected shape \(4,\)"),
    (dict(sinks=np.zeros(4, np.float64)), TypeError, "^sinks: expected dtype float32"),
    (dict(sinks=np.array([0, np.inf, 0, 0], np.float32)), ValueError, "^sinks: expected finite"),
    (dict(bias=np.zeros((1, 4, 3, 699), np.float32)), ValueError,
     r"^bias: expected a shape broadcastable to \(2, 4, 3, 700\)"),
    (dict(bias=np.zeros((1, 4, 3, 700), np.int32)), TypeError, "^bias: "),
    (dict(mask=np.ones((2, 4, 3, 700), np.float32)), TypeError, "^mask: "),
    (dict(mask=np.ones((3, 4, 3, 700), bool)), ValueError, "^mask: expected a shape"),
])
def test_kvcache_bad_sinks_are_refused_and_the_cache_is_untouched(kw, exc, match):
    rng = np.random.default_rng(5)
    q, kc, vc, _ = _kv_inputs(rng, "float32")
    k_new, v_new = (make(rng, (2, 3, 2, 32)) for _ in range(2))
    before = kc.copy(), vc.copy()
    with pytest.raises(exc, match=match):
        flashdl.attention_with_kvcache(q, kc, vc, cache_seqlens=np.array([5, 6], np.int32),
                                       k=k_new, v=v_new, **kw)
    np.testing.assert_array_equal(kc, before[0])
    np.testing.assert_array_equal(vc, before[1])


def test_kvcache_sinks_torch_front_end():
    torch = pytest.importorskip("torch")
    import flashdl.torch as fdt
    rng = np.random.default_rng(6)
    q, kc, vc, sinks = _kv_inputs(rng, "float32")
    lens = np.array([650, 333], np.int32)
    want = flashdl.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, sinks=sinks, causal=True)
    got = fdt.attention_with_kvcache(*(torch.from_numpy(x) for x in (q, kc, vc)),
                                     cache_seqlens=torch.from_numpy(lens), causal=True,
                                     sinks=torch.from_numpy(sinks))
    np.testing.assert_array_equal(got.numpy(), want)


# ---- bias and boolean mask in the KV cache ----------------------------------------------------------

def _kv_bias_mask(rng, b, h, sq, cap, keep=0.8):
    bias = (rng.standard_normal((b, h, sq, cap)) * 2).astype(np.float32)
    mask = rng.random((b, 1, sq, cap)) < keep
    return bias, mask


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("num_splits", [1, 2, 4])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(), dict(causal=True, window_size=(200, 0)),
                                dict(softcap=5.0)])
def test_kvcache_bias_and_mask_against_the_oracle(dtype, num_splits, kw):
    """attention_with_kvcache with a bias and a boolean mask over the cache's positions (split-KV
    or not, with sinks): out and lse by the float64 oracle's rule over the keys each sequence
    uses, the bias and mask read at those keys' columns."""
    rng = np.random.default_rng(10 + num_splits)
    q, kc, vc, sinks = _kv_inputs(rng, dtype)
    bias, mask = _kv_bias_mask(rng, 2, 4, 3, 700)
    lens = np.array([650, 333], np.int32)
    for extra in (dict(), dict(sinks=sinks)):
        out, lse = flashdl.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, bias=bias,
                                                  mask=mask, num_splits=num_splits,
                                                  return_lse=True, **kw, **extra)
        for b, n in enumerate(lens):
            args = (q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], q[b:b + 1])
            okw = dict(causal=kw.get("causal", False), window=kw.get("window_size", (-1, -1)),
                       softcap=kw.get("softcap", 0.0), bias=bias[b:b + 1, ..., :n],
                       mask=mask[b:b + 1, ..., :n], **extra)
            want = oracle(*args, **okw)
            naive = oracle(*args, dtype=dtype, exact=False, **okw)
            check_rule(out[b:b + 1], want[0], naive[0], dtype, f"out[{b}]")
            np.testing.assert_allclose(lse[b:b + 1], want[1], rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("shape", ["2d", "head row", "transposed", "stride 0", "bf16 (b,1,1,cap)"])
def test_kvcache_bias_broadcasts_like_attention(shape):
    """Broadcast biases (size-1 axes, fewer axes, a transposed view, stride 0, bfloat16) read in
    place: the cache call equals flashdl.attention on each sequence's keys with the same bias."""
    rng = np.random.default_rng(20)
    q, kc, vc, _ = _kv_inputs(rng, "float32", cap=300)
    lens = np.array([280, 97], np.int32)
    if shape == "2d":
        bias = rng.standard_normal((3, 300)).astype(np.float32)
    elif shape == "head row":
        bias = rng.standard_normal((1, 4, 1, 300)).astype(np.float32)
    elif shape == "transposed":
        bias = rng.standard_normal((300, 3)).astype(np.float32).T
    elif shape == "stride 0":
        bias = np.broadcast_to(rng.standard_normal((1, 1, 1, 300)).astype(np.float32),
                               (2, 4, 3, 300))
    else:
        ml_dtypes = pytest.importorskip("ml_dtypes")
        bias = rng.standard_normal((2, 1, 1, 300)).astype(ml_dtypes.bfloat16)
    full = np.broadcast_to(bias, (2, 4, 3, 300))
    for splits in (1, 3):
        out = flashdl.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, bias=bias,
                                             causal=True, num_splits=splits)
        for b, n in enumerate(lens):
            want = flashdl.attention(q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], causal=True,
                                     bias=np.ascontiguousarray(full[b:b + 1, ..., :n]),
                                     schedule="reference")
            np.testing.assert_allclose(out[b:b + 1], want, rtol=0, atol=3e-6)


def test_kvcache_bias_mask_paged_append_leftpad():
    """Paged equals contiguous bitwise with a bias, a mask and an append; with cache_leftpad the
    bias and mask columns are cache positions (key j of the sequence at column leftpad + j)."""
    rng = np.random.default_rng(21)
    q, kc, vc, _ = _kv_inputs(rng, "float32", b=2, sq=2, cap=256)
    k_new, v_new = (make(rng, (2, 2, 2, 32)) for _ in range(2))
    bias, mask = _kv_bias_mask(rng, 2, 4, 2, 256)
    lens = np.array([100, 37], np.int32)
    kc2, vc2 = kc.copy(), vc.copy()
    kw = dict(cache_seqlens=lens, k=k_new, v=v_new, bias=bias, mask=mask, causal=True,
              return_lse=True)
    out, lse = flashdl.attention_with_kvcache(q, kc2, vc2, **kw)
    table, pk, pv = _paged(kc, vc)
    out_p, lse_p = flashdl.attention_with_kvcache(q, pk, pv, block_table=table, **kw)
    np.testing.assert_array_equal(out_p, out)
    np.testing.assert_array_equal(lse_p, lse)
    # Left padding: sequence b's keys are cache positions [pad, lens + 2); the oracle on them,
    # with the bias and mask columns of the same positions.
    pad = np.array([10, 30], np.int32)
    out_l, lse_l = flashdl.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, bias=bias,
                                                  mask=mask, causal=True, return_lse=True,
                                                  cache_leftpad=pad)
    for b in range(2):
        lo, hi = pad[b], lens[b]
        args = (q[b:b + 1], kc[b:b + 1, lo:hi], vc[b:b + 1, lo:hi], q[b:b + 1])
        okw = dict(causal=True, bias=bias[b:b + 1, ..., lo:hi], mask=mask[b:b + 1, ..., lo:hi])
        want = oracle(*args, **okw)
        np.testing.assert_allclose(out_l[b:b + 1], want[0], rtol=0, atol=2e-6)
        np.testing.assert_allclose(lse_l[b:b + 1], want[1], rtol=1e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_kvcache_mask_hides_nan_keys_and_empty_rows(dtype, num_splits):
    """Keys the mask hides never reach a row, NaN and Inf in their K, V and bias included; NaN
    bias past a sequence's length is never read; a row whose keys are all hidden gets out 0 and
    lse -inf (the sink with sinks)."""
    rng = np.random.default_rng(22 + num_splits)
    q, kc, vc, sinks = _kv_inputs(rng, dtype, sq=2, cap=300)
    lens = np.array([250, 120], np.int32)
    bias, mask = _kv_bias_mask(rng, 2, 4, 2, 300, keep=0.9)
    hidden = np.array([3, 40, 41, 64, 65, 130, 200, 249])  # in tiles of seen keys, both splits
    mask[0, :, :, hidden] = False
    clean = flashdl.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, bias=bias, mask=mask,
                                           num_splits=num_splits, return_lse=True)
    kp, vp, bp = kc.copy(), vc.copy(), bias.copy()
    kp[0, hidden[::2], :, 0] = np.inf
    vp[0, hidden, :, 1] = np.nan
    vp[0, hidden[1::2], :, 2] = -np.inf
    bp[0, :, :, hidden] = np.nan
    bp[:, :, :, 250:] = np.nan  # past every sequence's keys
    got = flashdl.attention_with_kvcache(q, kp, vp, cache_seqlens=lens, bias=bp, mask=mask,
                                         num_splits=num_splits, return_lse=True)
    np.testing.assert_array_equal(got[0], clean[0])
    np.testing.assert_array_equal(got[1], clean[1])
    # Every key of sequence 1's second row hidden.
    m2 = mask.copy()
    m2[1, :, 1, :] = False
    out, lse = flashdl.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, mask=m2,
                                              num_splits=num_splits, return_lse=True)
    assert not np.asarray(out[1, 1], np.float32).any() and np.isneginf(lse[1, :, 1]).all()
    assert np.isfinite(lse[1, :, 0]).all()
    out, lse = flashdl.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, mask=m2,
                                              sinks=sinks, num_splits=num_splits,
                                              return_lse=True)
    assert not np.asarray(out[1, 1], np.float32).any()
    np.testing.assert_allclose(lse[1, :, 1], sinks, rtol=1e-6)


def test_kvcache_bias_mask_torch_front_end():
    torch = pytest.importorskip("torch")
    import flashdl.torch as fdt
    rng = np.random.default_rng(23)
    q, kc, vc, _ = _kv_inputs(rng, "float32")
    bias, mask = _kv_bias_mask(rng, 2, 4, 3, 700)
    lens = np.array([650, 333], np.int32)
    want = flashdl.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, bias=bias, mask=mask,
                                          causal=True)
    t = torch.from_numpy
    got = fdt.attention_with_kvcache(t(q), t(kc), t(vc), cache_seqlens=t(lens), causal=True,
                                     bias=t(bias), mask=t(mask))
    np.testing.assert_array_equal(got.numpy(), want)
