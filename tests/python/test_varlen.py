"""Variable-length batches (flash-attn's varlen layout): attention_varlen equals each sequence run
alone through flashdl.attention, bitwise for the same schedule on one thread, forward and
backward; it matches the float64 oracle per sequence (causal and windows aligned within each
sequence, GQA), also with many sequences dealt over several threads, reproducibly; empty
sequences; the (nheads, total_q) lse layout; torch autograd; every validation error."""

import numpy as np
import pytest

import flashdl
from attn_oracle import assert_lse, backward, forward, make

SCALE = 0.1875  # exact in float32
# (seqlen_q, seqlen_k) per sequence: equal, unequal both ways, no queries, no keys, both empty.
LENS = [(5, 5), (0, 4), (9, 13), (3, 0), (17, 6), (0, 0), (1, 1)]


def cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed(rng, lens, h, hk, d, dtype):
    sq, sk = [a for a, _ in lens], [b for _, b in lens]
    q = make(rng, (sum(sq), h, d), dtype)
    k = make(rng, (sum(sk), hk, d), dtype)
    v = make(rng, (sum(sk), hk, d), dtype)
    return q, k, v, cu(sq), cu(sk), max(sq), max(sk)


def run(lens, h=4, hk=2, d=16, dtype="float32", seed=0, **opts):
    rng = np.random.default_rng(seed)
    q, k, v, cq, ck, mq, mk = packed(rng, lens, h, hk, d, dtype)
    dout = make(rng, q.shape, dtype)
    out, lse = flashdl.attention_varlen(q, k, v, cq, ck, mq, mk, return_lse=True, **opts)
    grads = flashdl.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, mq, mk, **opts)
    return (q, k, v, dout, cq, ck), (out, lse), grads


def pieces(cq, ck, b):
    return slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])


@pytest.fixture
def threads():
    """flashdl.set_num_threads for one test; the default again afterwards."""
    yield flashdl.set_num_threads
    flashdl.set_num_threads(0)


# On more threads the CPU backend deals short sequences to threads whole (one thread each) while
# the dense call spreads one sequence over all of them: the sums then differ in rounding only
# (test_many_sequences_over_threads).
@pytest.mark.parametrize("schedule", ["fa1", "fa2", "reference"])
@pytest.mark.parametrize("causal", [False, True])
def test_equals_each_sequence_alone_bitwise(schedule, causal, threads):
    threads(1)
    opts = dict(causal=causal, schedule=schedule, softmax_scale=SCALE, window_size=(4, -1))
    (q, k, v, dout, cq, ck), (out, lse), (dq, dk, dv) = run(LENS, **opts)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    assert lse.dtype == np.float32
    for b in range(len(LENS)):
        sq_, sk_ = pieces(cq, ck, b)
        qb, kb, vb, dob = q[None, sq_], k[None, sk_], v[None, sk_], dout[None, sq_]
        o1, l1 = flashdl.attention(qb, kb, vb, return_lse=True, **opts)
        g1 = flashdl.attention_backward(dob, qb, kb, vb, o1, l1, **opts)
        assert np.array_equal(out[sq_], o1[0]), f"out of sequence {b}"
        assert np.array_equal(lse[:, sq_], l1[0]), f"lse of sequence {b}"
        for name, g, w, rows in (("dq", dq, g1[0], sq_), ("dk", dk, g1[1], sk_),
                                 ("dv", dv, g1[2], sk_)):
            assert np.array_equal(g[rows], w[0]), f"{name} of sequence {b}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,hk", [(4, 4), (4, 2), (3, 1)])
def test_matches_float64_oracle(causal, h, hk):
    opts = dict(causal=causal, softmax_scale=SCALE)
    (q, k, v, dout, cq, ck), (out, lse), (dq, dk, dv) = run(LENS, h=h, hk=hk, dtype="float64",
                                                            **opts)
    for b in range(len(LENS)):
        sq_, sk_ = pieces(cq, ck, b)
        args = (q[None, sq_], k[None, sk_], v[None, sk_])
        want_o, want_l = forward(*args, causal=causal, softmax_scale=SCALE)
        np.testing.assert_allclose(out[sq_], want_o[0], atol=1e-6)
        assert_lse(lse[:, sq_], want_l[0])
        want = backward(dout[None, sq_], *args, causal=causal, softmax_scale=SCALE)
        for g, w, rows in zip((dq, dk, dv), want, (sq_, sk_, sk_)):
            np.testing.assert_allclose(g[rows], w[0], atol=1e-6)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("schedule", ["fa1", "fa2"])
def test_many_sequences_over_threads(n, schedule, threads):
    """40 sequences of 0 to 300 rows and one long enough to run alone on every thread: each
    matches the float64 oracle, and a second call is bitwise the first."""
    rng = np.random.default_rng(n)
    lens = [(int(a), int(b)) for a, b in rng.integers(0, 301, (40, 2))] + [(1200, 1100)]
    threads(n)
    opts = dict(causal=True, schedule=schedule, softmax_scale=SCALE)
    (q, k, v, dout, cq, ck), (out, lse), grads = run(lens, h=2, hk=1, d=8, dtype="float64",
                                                     seed=n, **opts)
    _, (out2, lse2), grads2 = run(lens, h=2, hk=1, d=8, dtype="float64", seed=n, **opts)
    for a, b in zip((out, lse) + grads, (out2, lse2) + grads2):
        assert np.array_equal(a, b)
    for b in range(len(lens)):
        sq_, sk_ = pieces(cq, ck, b)
        args = (q[None, sq_], k[None, sk_], v[None, sk_])
        want_o, want_l = forward(*args, causal=True, softmax_scale=SCALE)
        np.testing.assert_allclose(out[sq_], want_o[0], atol=1e-6, err_msg=f"out {b}")
        if sq_.stop > sq_.start:
            assert_lse(lse[:, sq_], want_l[0])
        want = backward(dout[None, sq_], *args, causal=True, softmax_scale=SCALE)
        for name, g, w, rows in zip(("dq", "dk", "dv"), grads, want, (sq_, sk_, sk_)):
            np.testing.assert_allclose(g[rows], w[0], atol=1e-6, err_msg=f"{name} {b}")


def test_causal_is_per_sequence():
    """Causal alignment restarts in each sequence: packing must not equal one long causal run."""
    lens = [(6, 6), (6, 6)]
    (q, k, v, dout, cq, ck), (out, lse), _ = run(lens, causal=True)
    whole = flashdl.attention(q[None], k[None], v[None], causal=True)[0]
    assert np.array_equal(out[:6], whole[:6])  # the first sequence sees the same keys
    assert not np.allclose(out[6:], whole[6:])  # the second must not see the first's keys
    # the first row of each sequence sees exactly its first key: out = that value row (GQA)
    np.testing.assert_allclose(out[6], np.repeat(v[6], 2, axis=0), rtol=1e-6)


def test_empty_sequences_and_batch():
    (q, k, v, dout, cq, ck), (out, lse), (dq, dk, dv) = run(LENS)
    b_nokeys = LENS.index((3, 0))
    rows, _ = pieces(cq, ck, b_nokeys)
    assert np.all(out[rows] == 0) and np.all(np.isneginf(lse[:, rows])) and np.all(dq[rows] == 0)
    _, keys = pieces(cq, ck, LENS.index((0, 4)))
    assert np.all(dk[keys] == 0) and np.all(dv[keys] == 0)
    # every sequence empty, and a batch of none
    for lens in ([(0, 0), (0, 3)], []):
        rng = np.random.default_rng(1)
        q, k, v, cq, ck, _, _ = packed(rng, lens or [(0, 0)], 2, 2, 8, "float32")
        cq, ck = (cq, ck) if lens else (cu([]), cu([]))
        out, lse = flashdl.attention_varlen(q, k, v, cq, ck, 0, 3, return_lse=True)
        assert out.shape == (0, 2, 8) and lse.shape == (2, 0)
        dq, dk, dv = flashdl.attention_varlen_backward(out, q, k, v, out, lse, cq, ck, 0, 3)
        assert dq.shape == q.shape and np.all(dk == 0) and np.all(dv == 0)


def test_float16_and_strided_inputs():
    """Half precision, and q given as a non-contiguous view (every stride but the last free)."""
    rng = np.random.default_rng(2)
    lens = [(7, 9), (4, 4)]
    q, k, v, cq, ck, mq, mk = packed(rng, lens, 2, 2, 8, "float16")
    qs = np.ascontiguousarray(np.swapaxes(q, 0, 1)).swapaxes(0, 1)  # (total, h, d), head-major
    out = flashdl.attention_varlen(qs, k, v, cq, ck, mq, mk, causal=True)
    assert out.dtype == np.float16
    for b in range(2):
        sq_, sk_ = pieces(cq, ck, b)
        want = flashdl.attention(q[None, sq_], k[None, sk_], v[None, sk_], causal=True)[0]
        assert np.array_equal(out[sq_], want)


def test_torch_autograd():
    torch = pytest.importorskip("torch")
    import flashdl.torch

    rng = np.random.default_rng(3)
    q, k, v, cq, ck, mq, mk = packed(rng, LENS, 4, 2, 16, "float64")
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    tcq, tck = torch.from_numpy(cq), torch.from_numpy(ck)
    out = flashdl.torch.attention_varlen(tq, tk, tv, tcq, tck, mq, mk, causal=True)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    dout = torch.tensor(make(rng, q.shape, "float64"))
    (out * dout).sum().backward()
    o_np, lse = flashdl.attention_varlen(q, k, v, cq, ck, mq, mk, causal=True, return_lse=True)
    want = flashdl.attention_varlen_backward(dout.numpy(), q, k, v, o_np, lse, cq, ck, mq, mk,
                                             causal=True)
    assert np.array_equal(out.detach().numpy(), o_np)
    for t, w in zip((tq, tk, tv), want):
        assert np.array_equal(t.grad.numpy(), w)
    # the functional API takes torch cu_seqlens too and answers in torch
    o2 = flashdl.attention_varlen(tq.detach(), tk.detach(), tv.detach(), tcq, tck, mq, mk,
                                  causal=True)
    assert isinstance(o2, torch.Tensor) and torch.equal(o2, out.detach())


def valid():
    rng = np.random.default_rng(4)
    q, k, v, cq, ck, mq, mk = packed(rng, [(3, 4), (5, 2)], 2, 2, 8, "float32")
    return dict(q=q, k=k, v=v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk)


def call(a, **opts):
    return flashdl.attention_varlen(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"],
                                    a["max_seqlen_q"], a["max_seqlen_k"], **opts)


def call_bwd(a, **opts):
    out, lse = call(valid(), return_lse=True)
    b = valid()
    return flashdl.attention_varlen_backward(out, b["q"], b["k"], b["v"], out, lse,
                                             a["cu_seqlens_q"], a["cu_seqlens_k"],
                                             a["max_seqlen_q"], a["max_seqlen_k"], **opts)


BAD = [
    ("cu_seqlens_q", lambda a: a["cu_seqlens_q"].astype(np.int64) + 2**32, ValueError,
     "cu_seqlens_q: expected int32 values"),
    ("cu_seqlens_k", lambda a: a["cu_seqlens_k"].astype(np.float32), TypeError, "int32"),
    ("cu_seqlens_q", lambda a: a["cu_seqlens_q"] + 1, ValueError, r"\[0\] == 0"),
    ("cu_seqlens_q", lambda a: np.array([0, 5, 3, 8], np.int32), ValueError, "non-decreasing"),
    ("cu_seqlens_k", lambda a: np.array([0, 4, 5], np.int32), ValueError, "total_k = 6"),
    ("cu_seqlens_q", lambda a: np.array([0, 2, 7], np.int32), ValueError, "total_q = 8"),
    ("cu_seqlens_q", lambda a: a["cu_seqlens_q"][None], ValueError, "rank 1"),
    ("cu_seqlens_k", lambda a: np.array([0, 2, 4, 6], np.int32), ValueError, r"as cu_seqlens_q"),
    ("cu_seqlens_q", lambda a: np.zeros(0, np.int32), ValueError, "empty"),
    ("max_seqlen_q", lambda a: 4, ValueError, "length 5, more than max_seqlen_q = 4"),
    ("max_seqlen_k", lambda a: 3, ValueError, "length 4, more than max_seqlen_k = 3"),
    ("max_seqlen_k", lambda a: -1, ValueError, ">= 0"),
    ("max_seqlen_q", lambda a: 2.5, TypeError, "int"),
    ("cu_seqlens_q", lambda a: [0, 3, 8], TypeError, "int32 array"),
    ("q", lambda a: a["q"][None], ValueError, r"rank 3 \(total_q, nheads, headdim\)"),
    ("k", lambda a: a["k"][:, :, :4], ValueError, "headdim"),
    ("v", lambda a: a["v"][:5], ValueError, "the shape of k"),
]


@pytest.mark.parametrize("fn", [call, call_bwd])
@pytest.mark.parametrize("arg,change,exc,match", BAD)
def test_validation_errors_name_the_argument(fn, arg, change, exc, match):
    a = valid()
    a[arg] = change(a)
    if fn is call_bwd and arg in ("q", "k", "v"):
        pytest.skip("the backward takes q, k, v with out and lse; covered by the forward")
    with pytest.raises(exc, match=match) as info:
        fn(a)
    assert str(info.value).startswith(arg + ":"), str(info.value)


def test_backward_gradient_arrays_are_checked():
    a = valid()
    out, lse = call(a, return_lse=True)
    with pytest.raises(ValueError, match=r"lse: expected shape \(2, 8\)"):
        flashdl.attention_varlen_backward(out, a["q"], a["k"], a["v"], out, lse.T.copy(),
                                          a["cu_seqlens_q"], a["cu_seqlens_k"], 5, 4)
    with pytest.raises(ValueError, match="dout"):
        flashdl.attention_varlen_backward(out[:7], a["q"], a["k"], a["v"], out, lse,
                                          a["cu_seqlens_q"], a["cu_seqlens_k"], 5, 4)


@pytest.mark.parametrize("schedule", ["fa2", "fa1", "reference"])
def test_dropout_mask_of_sequence_b_is_that_of_batch_b(schedule):
    # Equal lengths: the varlen batch is a dense batch; with the same seed and offset, sequence b
    # must drop exactly what batch b drops in the dense call.
    rng = np.random.default_rng(7)
    b, s, h, d = 3, 19, 2, 8
    q, k, v, dout = (rng.standard_normal((b, s, h, d)).astype(np.float32) for _ in range(4))
    opts = dict(schedule=schedule, dropout_p=0.3, seed=1234, offset=5, causal=True)
    out, lse = flashdl.attention(q, k, v, return_lse=True, **opts)
    grads = flashdl.attention_backward(dout, q, k, v, out, lse, **opts)
    c = cu([s] * b)
    flat = [x.reshape(b * s, h, d) for x in (q, k, v, dout)]
    out_v, lse_v = flashdl.attention_varlen(*flat[:3], c, c, s, s, return_lse=True, **opts)
    np.testing.assert_array_equal(out_v, out.reshape(b * s, h, d))
    np.testing.assert_array_equal(lse_v, lse.transpose(1, 0, 2).reshape(h, b * s))
    grads_v = flashdl.attention_varlen_backward(flat[3], *flat[:3], out_v, lse_v, c, c, s, s,
                                                **opts)
    for g, gv in zip(grads, grads_v):
        np.testing.assert_allclose(gv, g.reshape(gv.shape), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["fa1", "fa2"])
@pytest.mark.parametrize("cu_on", ["cpu", "cuda"])
def test_cuda_one_launch_equals_each_sequence_alone(schedule, cu_on):
    """CUDA: the whole packed batch in one launch (offsets on the host, copied over, or on the
    device, read there) equals each sequence run alone through flashdl.attention: bitwise for fa2
    (the same tiles from each sequence's start; deterministic=True for dq), within float16
    rounding for fa1 (its tiles are sized from max_seqlen rather than each sequence)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or flashdl.info()["cuda_device_count"] == 0:
        pytest.skip("no CUDA device")
    lens = [(5, 5), (0, 4), (70, 130), (3, 0), (129, 64), (0, 0), (1, 1)]
    rng = np.random.default_rng(3)
    q, k, v, cq, ck, mq, mk = packed(rng, lens, 4, 2, 64, "float32")
    q, k, v = (torch.tensor(x, device="cuda", dtype=torch.float16) for x in (q, k, v))
    dout = torch.randn_like(q)
    tcq, tck = (torch.tensor(c, device=cu_on) for c in (cq, ck))
    opts = dict(causal=True, window_size=(32, -1), schedule=schedule)
    out, lse = flashdl.attention_varlen(q, k, v, tcq, tck, mq, mk, return_lse=True, **opts)
    grads = flashdl.attention_varlen_backward(dout, q, k, v, out, lse, tcq, tck, mq, mk,
                                              deterministic=True, **opts)
    torch.cuda.synchronize()

    def same(a, b, what):
        if schedule == "fa2":
            assert torch.equal(a, b), what
        else:
            torch.testing.assert_close(a.float(), b.float(), atol=4e-3, rtol=2e-3, msg=what)

    for b in range(len(lens)):
        sq_, sk_ = pieces(cq, ck, b)
        qb, kb, vb, dob = q[None, sq_], k[None, sk_], v[None, sk_], dout[None, sq_]
        o1, l1 = flashdl.attention(qb, kb, vb, return_lse=True, **opts)
        g1 = flashdl.attention_backward(dob, qb, kb, vb, o1, l1, deterministic=True, **opts)
        same(out[sq_], o1[0], f"out of sequence {b}")
        same(lse[:, sq_], l1[0], f"lse of sequence {b}")
        for name, g, w, rows in (("dq", grads[0], g1[0], sq_), ("dk", grads[1], g1[1], sk_),
                                 ("dv", grads[2], g1[2], sk_)):
            same(g[rows], w[0], f"{name} of sequence {b}")