"""The dropout slice options (dropout_batch_offset, dropout_head_offset, dropout_nheads_total):
a call on a batch / head slice of q, k, v with the slice's offsets draws exactly that slice of
the whole call's mask, so its out, lse and gradients are bitwise the slice of the whole call's,
on every CPU schedule; bad values are refused naming the argument."""

import numpy as np
import pytest

import flashdl
from attn_oracle import make

SCHEDULES = ["fa1", "fa2", "reference", "auto"]
P, SEED = 0.3, 1234


def run(q, k, v, dout, schedule, **kw):
    out, lse = flashdl.attention(q, k, v, schedule=schedule, return_lse=True, **kw)
    grads = flashdl.attention_backward(dout, q, k, v, out, lse, schedule=schedule, **kw)
    return (out, lse) + tuple(grads)


def arrays(dtype, b=3, sq=37, sk=29, h=6, hk=3, d=16, seed=0):
    rng = np.random.default_rng(seed)
    q = make(rng, (b, sq, h, d), dtype)
    k = make(rng, (b, sk, hk, d), dtype)
    v = make(rng, (b, sk, hk, d), dtype)
    dout = make(rng, (b, sq, h, d), dtype)
    return q, k, v, dout


def sliced(x, bs, hs, lse=False):
    return x[bs, hs] if lse else x[bs, :, hs]


# (batch slice, query-head slice): head slices cover whole GQA groups (2 query heads per kv head)
SLICES = [(slice(1, 3), slice(0, 6)), (slice(0, 3), slice(2, 6)), (slice(2, 3), slice(4, 6)),
          (slice(1, 2), slice(2, 4))]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("bs,hs", SLICES)
def test_slice_call_is_the_slice_of_the_whole_call(schedule, dtype, bs, hs):
    q, k, v, dout = arrays(dtype)
    h = q.shape[2]
    kw = dict(dropout_p=P, seed=SEED, causal=True, offset=3)
    whole = run(q, k, v, dout, schedule, **kw)
    ks = slice(hs.start // 2, hs.stop // 2)  # the kv heads of the query-head slice
    args = (sliced(q, bs, hs), sliced(k, bs, ks), sliced(v, bs, ks), sliced(dout, bs, hs))
    part = run(*(np.ascontiguousarray(a) for a in args), schedule, dropout_batch_offset=bs.start,
               dropout_head_offset=hs.start, dropout_nheads_total=h, **kw)
    want = (sliced(whole[0], bs, hs), sliced(whole[1], bs, hs, lse=True),
            sliced(whole[2], bs, hs), sliced(whole[3], bs, ks), sliced(whole[4], bs, ks))
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), part, want):
        np.testing.assert_array_equal(g, w, err_msg=name)
    # and the offsets matter: the same slice without them draws another mask
    plain = run(*(np.ascontiguousarray(a) for a in args), schedule, **kw)
    assert not np.array_equal(plain[0], want[0])


def test_slice_mask_follows_the_formula():
    """out of a one-head, one-batch call with offsets (b0, h0) and nheads_total H is the undropped
    attention re-weighted by dropout_mask(...)[b0, h0] of the whole shape, checked through the
    reference schedule against the float64 oracle built from that mask."""
    rng = np.random.default_rng(3)
    B, H, sq, sk, d = 4, 5, 9, 11, 8
    q, k, v = (make(rng, (1, n, 1, d), "float64") for n in (sq, sk, sk))
    b0, h0 = 2, 3
    out = flashdl.attention(q, k, v, dropout_p=0.5, seed=SEED, schedule="reference",
                            dropout_batch_offset=b0, dropout_head_offset=h0,
                            dropout_nheads_total=H)
    keep = flashdl.dropout_mask(B, H, sq, sk, 0.5, SEED)[b0, h0]
    s = (q[0, :, 0] @ k[0, :, 0].T) / np.sqrt(d)
    pr = np.exp(s - s.max(1, keepdims=True))
    pr /= pr.sum(1, keepdims=True)
    want = (pr * keep / 0.5) @ v[0, :, 0]
    np.testing.assert_allclose(out[0, :, 0], want, rtol=1e-12, atol=1e-12)


def test_defaults_are_the_unsliced_call():
    q, k, v, dout = arrays("float32", seed=1)
    kw = dict(dropout_p=P, seed=SEED)
    a = run(q, k, v, dout, "fa2", **kw)
    b = run(q, k, v, dout, "fa2", dropout_batch_offset=0, dropout_head_offset=0,
            dropout_nheads_total=q.shape[2], **kw)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


BAD = [
    (dict(dropout_batch_offset=-1), ValueError, r"^dropout_batch_offset: expected 0 <= offset"),
    (dict(dropout_head_offset=-2), ValueError, r"^dropout_head_offset: expected 0 <= offset"),
    (dict(dropout_nheads_total=-1), ValueError, r"^dropout_nheads_total: expected 0"),
    (dict(dropout_head_offset=1), ValueError,
     r"^dropout_nheads_total: expected at least dropout_head_offset \+ nheads = 1 \+ 6 = 7 heads, "
     r"got 6 \(0: the nheads of q\)"),
    (dict(dropout_head_offset=3, dropout_nheads_total=8), ValueError,
     r"^dropout_nheads_total: expected at least .* = 9 heads, got 8$"),
    (dict(dropout_batch_offset=2**31, dropout_nheads_total=6), ValueError,
     r"^dropout_batch_offset: \(dropout_batch_offset \+ batch\) \* dropout_nheads_total"),
    (dict(dropout_batch_offset=2**32), ValueError, r"^dropout_batch_offset"),
    (dict(dropout_head_offset=1.0), TypeError, r"^dropout_head_offset: expected an int"),
    (dict(dropout_nheads_total="6"), TypeError, r"^dropout_nheads_total: expected an int"),
]


@pytest.mark.parametrize("kw,err,msg", BAD)
def test_bad_values_name_the_argument(kw, err, msg):
    q, k, v, dout = arrays("float32", b=1, sq=4, sk=4)
    with pytest.raises(err, match=msg):
        flashdl.attention(q, k, v, dropout_p=P, seed=SEED, **kw)
    out, lse = flashdl.attention(q, k, v, dropout_p=P, seed=SEED, return_lse=True)
    with pytest.raises(err, match=msg):
        flashdl.attention_backward(dout, q, k, v, out, lse, dropout_p=P, seed=SEED, **kw)


def test_zero_length_slice():
    q, k, v, dout = arrays("float32", b=0)
    out = flashdl.attention(q, k, v, dropout_p=P, seed=SEED, dropout_batch_offset=5,
                            dropout_head_offset=2, dropout_nheads_total=9)
    assert out.shape == q.shape
