"""Block-sparse attention: block_mask over blocks of block_size, against the float64 oracle with the
expanded element mask (built element by element here), forward and backward, fa1, fa2 and
reference, combined with causal, windows, GQA, dropout and per-(batch, head) masks; an all-true
mask is dense attention; zero blocks are never read (NaN there changes nothing); rows and keys
that only zero blocks cover get exact zeros; varlen takes one mask plane per sequence; torch and
JAX masks; every validation error names block_mask or block_size.
Speed against density is a benchmark (benchmarks/bench_block_sparse.py), not a test."""

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flashdl
import masked_oracle as mo
from attn_oracle import (assert_lse, assert_rule, backward, forward, fwd_ulps, grad_magnitude,
                         grad_ulps, make, make_qkv)

SCALE = 0.1875  # exact in float32: the oracle's scale is the core's
TOL = {"fa1": 2e-6, "fa2": 2e-6, "reference": 1e-10}


def nblocks(n, block):
    return -(-n // block)


def expand(mask, sq, sk, bq, bk):
    """The element mask (..., sq, sk) of a block mask, one element at a time:
    (i, j) is set iff mask[..., i // bq, j // bk]."""
    lead = mask.shape[:-2]
    out = np.zeros(lead + (sq, sk), dtype=bool)
    for idx in itertools.product(*(range(n) for n in lead)):
        for i in range(sq):
            for j in range(sk):
                out[idx + (i, j)] = mask[idx + (i // bq, j // bk)]
    return out


def random_mask(rng, shape, density):
    return rng.random(shape) < density


def mask_shape(kind, b, h, nbq, nbk):
    return {"shared": (nbq, nbk), "full": (b, h, nbq, nbk), "heads": (1, h, nbq, nbk),
            "batch": (b, 1, nbq, nbk)}[kind]


def check(b, sq, sk, h, hk, d, bq, bk, kind, density, schedule, causal=False, window=(-1, -1),
          dropout_p=0.0, seed=0):
    """Forward and backward in float64 against the masked oracle, and the exact zeros of rows and
    keys that see nothing."""
    rng = np.random.default_rng(seed)
    q, k, v = make_qkv(rng, b, sq, sk, h, hk, d, dtype="float64")
    dout = make(rng, q.shape, "float64")
    mask = random_mask(rng, mask_shape(kind, b, h, nblocks(sq, bq), nblocks(sk, bk)), density)
    opts = dict(causal=causal, window_size=window, schedule=schedule, softmax_scale=SCALE,
                block_mask=mask, block_size=(bq, bk), dropout_p=dropout_p, seed=seed)
    out, lse = flashdl.attention(q, k, v, return_lse=True, **opts)
    dq, dk, dv = flashdl.attention_backward(dout, q, k, v, out, lse, **opts)

    vis = mo.brute_visible(sq, sk, window[0], window[1], causal) & expand(mask, sq, sk, bq, bk)
    vis = np.broadcast_to(vis, (b, h, sq, sk))
    keep = flashdl.dropout_mask(b, h, sq, sk, dropout_p, seed) if dropout_p > 0 else None
    want_out, want_lse = mo.forward(q, k, v, vis, keep, dropout_p, softmax_scale=SCALE)
    mo.close(out, want_out, TOL[schedule], "out")
    assert_lse(lse, want_lse)
    want = mo.backward(dout, q, k, v, vis, keep, dropout_p, softmax_scale=SCALE)
    mag = grad_magnitude(want)
    for name, g, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        mo.close(g, w, TOL[schedule], name, magnitude=mag)

    empty = ~vis.any(axis=-1)  # (b, h, sq): rows that see no key
    assert np.all(np.swapaxes(out, 1, 2)[empty] == 0), "out of empty rows"
    assert np.all(np.isneginf(lse[empty])), "lse of empty rows"
    assert np.all(np.swapaxes(dq, 1, 2)[empty] == 0), "dq of empty rows"
    group = h // hk
    unseen = ~vis.reshape(b, hk, group, sq, sk).any(axis=(2, 3))  # (b, hk, sk)
    assert np.all(np.swapaxes(dk, 1, 2)[unseen] == 0), "dk of keys no query sees"
    assert np.all(np.swapaxes(dv, 1, 2)[unseen] == 0), "dv of keys no query sees"


def test_expand_is_the_block_predicate():
    """expand (the oracle's mask) and NumPy's repeat agree, including ragged last blocks."""
    rng = np.random.default_rng(0)
    for sq, sk, bq, bk in [(7, 9, 3, 4), (5, 5, 5, 5), (1, 13, 2, 20), (10, 3, 1, 1)]:
        m = random_mask(rng, (2, nblocks(sq, bq), nblocks(sk, bk)), 0.5)
        rep = np.repeat(np.repeat(m, bq, axis=-2), bk, axis=-1)[..., :sq, :sk]
        assert np.array_equal(expand(m, sq, sk, bq, bk), rep)


CASES = [  # (b, sq, sk, h, hk, d, bq, bk, kind, density, causal, window)
    (1, 97, 130, 2, 1, 16, 16, 32, "shared", 0.5, False, (-1, -1)),
    (2, 130, 97, 4, 2, 32, 32, 16, "full", 0.4, True, (-1, -1)),
    (1, 200, 200, 2, 2, 16, 64, 64, "heads", 0.5, False, (40, 3)),
    (2, 50, 70, 3, 1, 8, 7, 11, "batch", 0.6, True, (10, -1)),
    (1, 60, 60, 2, 1, 16, 1, 1, "shared", 0.3, False, (-1, -1)),   # element-level masks
    (1, 40, 30, 2, 2, 16, 128, 128, "full", 0.5, False, (-1, -1)),  # one block per head
    (1, 150, 260, 2, 1, 64, 48, 96, "shared", 0.5, False, (-1, 2)),  # the fa2 tile exactly
    (1, 100, 100, 2, 1, 16, 20, 20, "shared", 0.0, False, (-1, -1)),  # nothing visible
]


@pytest.mark.parametrize("schedule", ["fa1", "fa2", "reference"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_matches_masked_oracle(case, schedule):
    b, sq, sk, h, hk, d, bq, bk, kind, density, causal, window = case
    check(b, sq, sk, h, hk, d, bq, bk, kind, density, schedule, causal, window,
          seed=sq + sk + bq)


@pytest.mark.parametrize("schedule", ["fa1", "fa2", "reference"])
def test_with_dropout(schedule):
    check(2, 90, 75, 4, 2, 16, 16, 24, "full", 0.5, schedule, causal=True, dropout_p=0.3,
          seed=11)


@given(b=st.integers(1, 2), sq=st.integers(1, 80), sk=st.integers(1, 80),
       heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]), d=st.sampled_from([4, 16, 33]),
       bq=st.integers(1, 90), bk=st.integers(1, 90),
       kind=st.sampled_from(["shared", "full", "heads", "batch"]),
       density=st.sampled_from([0.0, 0.25, 0.5, 0.9, 1.0]), causal=st.booleans(),
       window=st.sampled_from([(-1, -1), (5, 0), (0, 7), (20, 20)]),
       dropout_p=st.sampled_from([0.0, 0.0, 0.4]), schedule=st.sampled_from(["fa1", "fa2"]))
def test_block_sparse_property(b, sq, sk, heads, d, bq, bk, kind, density, causal, window,
                               dropout_p, schedule):
    check(b, sq, sk, heads[0], heads[1], d, bq, bk, kind, density, schedule, causal, window,
          dropout_p, seed=sq * 97 + sk)


@pytest.mark.parametrize("schedule", ["fa1", "fa2", "reference"])
@pytest.mark.parametrize("block_size", [16, (48, 96), 128, (5, 300)])
def test_all_true_mask_is_dense_attention(schedule, block_size):
    rng = np.random.default_rng(3)
    q, k, v = make_qkv(rng, 1, 260, 300, 4, 2, 32, dtype="float32")
    dout = make(rng, q.shape, "float32")
    bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
    mask = np.ones((nblocks(260, bq), nblocks(300, bk)), dtype=bool)
    opts = dict(schedule=schedule, causal=True)
    dense, dlse = flashdl.attention(q, k, v, return_lse=True, **opts)
    got, lse = flashdl.attention(q, k, v, return_lse=True, block_mask=mask, block_size=block_size,
                                 **opts)
    np.testing.assert_allclose(got, dense, rtol=0, atol=2e-6)
    np.testing.assert_allclose(lse, dlse, rtol=0, atol=2e-6)
    g_dense = flashdl.attention_backward(dout, q, k, v, dense, dlse, **opts)
    g = flashdl.attention_backward(dout, q, k, v, got, lse, block_mask=mask,
                                   block_size=block_size, **opts)
    for a, w in zip(g, g_dense):
        np.testing.assert_allclose(a, w, rtol=0, atol=2e-5 * max(1.0, np.abs(w).max()))


@pytest.mark.parametrize("schedule", ["fa1", "fa2", "reference"])
def test_zero_blocks_are_never_read(schedule):
    """NaN in every q, k and v row that only zero blocks cover: a kernel that loaded or computed
    such a block (even to mask it afterwards) would spread the NaN (0 * NaN is NaN)."""
    rng = np.random.default_rng(4)
    b, sq, sk, h, hk, d, bq, bk = 2, 150, 170, 4, 2, 16, 32, 16
    q, k, v = make_qkv(rng, b, sq, sk, h, hk, d, dtype="float32")
    dout = make(rng, q.shape, "float32")
    mask = random_mask(rng, (b, h, nblocks(sq, bq), nblocks(sk, bk)), 0.5)
    mask[:, :, 1, :] = False  # query block 1 sees nothing, in every head
    mask[:, :, :, 2] = False  # key block 2 is seen by no query
    mask[:, :, :, -1] = False  # nor is the ragged last key block
    opts = dict(block_mask=mask, block_size=(bq, bk), schedule=schedule)
    out, lse = flashdl.attention(q, k, v, return_lse=True, **opts)
    grads = flashdl.attention_backward(dout, q, k, v, out, lse, **opts)

    dead_q = np.arange(sq) // bq == 1
    dead_k = (np.arange(sk) // bk == 2) | (np.arange(sk) // bk == nblocks(sk, bk) - 1)
    qp, kp, vp = q.copy(), k.copy(), v.copy()
    qp[:, dead_q] = np.nan
    kp[:, dead_k] = np.nan
    vp[:, dead_k] = np.nan
    out_p, lse_p = flashdl.attention(qp, kp, vp, return_lse=True, **opts)
    assert np.array_equal(out_p, out) and np.array_equal(lse_p, lse), "forward read a zero block"
    grads_p = flashdl.attention_backward(dout, qp, kp, vp, out, lse, **opts)
    for name, a, w in zip(("dq", "dk", "dv"), grads_p, grads):
        assert np.array_equal(a, w), f"{name}: the backward read a zero block"
    assert np.all(out[:, dead_q] == 0) and np.all(np.isneginf(lse[:, :, dead_q]))
    assert np.all(grads[1][:, dead_k] == 0) and np.all(grads[2][:, dead_k] == 0)


@pytest.mark.parametrize("schedule", ["fa1", "fa2"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_low_precision(dtype, schedule):
    """flash-attn's rule against the naive algorithm in the input precision, same mask."""
    rng = np.random.default_rng(5)
    q, k, v = make_qkv(rng, 2, 140, 120, 4, 2, 32, dtype=dtype)
    dout = make(rng, q.shape, dtype)
    mask = random_mask(rng, (2, 4, nblocks(140, 32), nblocks(120, 32)), 0.6)
    emask = expand(mask, 140, 120, 32, 32)
    opts = dict(schedule=schedule, causal=True, block_mask=mask, block_size=32)
    out, lse = flashdl.attention(q, k, v, return_lse=True, **opts)
    exact, exact_lse = forward(q, k, v, causal=True, mask=emask)
    low, _ = forward(q, k, v, causal=True, dtype=dtype, exact=False, mask=emask)
    assert_rule(out, exact, low, dtype, ulps=fwd_ulps(dtype, q, k))
    assert_lse(lse, exact_lse, rtol=1e-3, atol=1e-3)
    grads = flashdl.attention_backward(dout, q, k, v, out, lse, **opts)
    want = backward(dout, q, k, v, causal=True, mask=emask)
    naive = backward(dout, q, k, v, causal=True, dtype=dtype, exact=False, mask=emask)
    mag = grad_magnitude(want)
    for name, g, w, n, u in zip(("dq", "dk", "dv"), grads, want, naive, grad_ulps(dtype, q, k)):
        assert_rule(g, w, n, dtype, what=name, ulps=u, magnitude=mag, grad=True)


def test_threads_do_not_change_the_forward():
    rng = np.random.default_rng(6)
    q, k, v = make_qkv(rng, 2, 300, 280, 4, 2, 32, dtype="float32")
    mask = random_mask(rng, (2, 4, nblocks(300, 64), nblocks(280, 64)), 0.5)
    results = []
    for threads in (1, 2, 3):
        flashdl.set_num_threads(threads)
        results.append(flashdl.attention(q, k, v, block_mask=mask, block_size=64,
                                         return_lse=True))
    flashdl.set_num_threads(0)
    for out, lse in results[1:]:
        assert np.array_equal(out, results[0][0]) and np.array_equal(lse, results[0][1])


def test_mask_views_and_read_only_masks():
    """Any strides but a contiguous last dimension; a read-only mask is accepted and untouched."""
    rng = np.random.default_rng(7)
    q, k, v = make_qkv(rng, 2, 64, 64, 2, 2, 16, dtype="float32")
    big = random_mask(rng, (4, 2, 8, 16), 0.5)
    view = big[::2, :, ::2, 3:7]  # (2, 2, 4, 4): strided in every dimension but the last
    want = flashdl.attention(q, k, v, block_mask=np.ascontiguousarray(view), block_size=16)
    frozen = view.copy()
    frozen.flags.writeable = False
    before = frozen.copy()
    assert np.array_equal(flashdl.attention(q, k, v, block_mask=view, block_size=16), want)
    assert np.array_equal(flashdl.attention(q, k, v, block_mask=frozen, block_size=16), want)
    assert np.array_equal(frozen, before)


def test_varlen_takes_one_plane_per_sequence():
    """attention_varlen with a (batch, nheads, ...) mask equals each sequence run alone with its
    plane, bitwise; blocks are counted from each sequence's start. On one thread: gradients are
    bitwise reproducible for a given thread count, and varlen deals short sequences one thread
    each while a call alone uses every thread (its dQ partial sums then group differently)."""
    flashdl.set_num_threads(1)
    try:
        _varlen_planes_bitwise()
    finally:
        flashdl.set_num_threads(0)


def _varlen_planes_bitwise():
    rng = np.random.default_rng(8)
    lens = [(40, 50), (0, 9), (70, 33), (25, 0), (64, 64)]
    h, hk, d, bq, bk = 4, 2, 16, 16, 8
    sq, sk = [a for a, _ in lens], [b_ for _, b_ in lens]
    cq = np.concatenate([[0], np.cumsum(sq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(sk)]).astype(np.int32)
    q, k, v = (make(rng, (sum(sq), h, d)), make(rng, (sum(sk), hk, d)),
               make(rng, (sum(sk), hk, d)))
    dout = make(rng, q.shape)
    mask = random_mask(rng, (len(lens), h, nblocks(max(sq), bq), nblocks(max(sk), bk)), 0.6)
    opts = dict(causal=True, block_size=(bq, bk))
    out, lse = flashdl.attention_varlen(q, k, v, cq, ck, max(sq), max(sk), return_lse=True,
                                        block_mask=mask, **opts)
    dq, dk, dv = flashdl.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, max(sq),
                                                   max(sk), block_mask=mask, **opts)
    for s, (nq, nk) in enumerate(lens):
        rq, rk = slice(cq[s], cq[s + 1]), slice(ck[s], ck[s + 1])
        plane = mask[s:s + 1, :, :nblocks(nq, bq), :nblocks(nk, bk)]
        qb, kb, vb, dob = q[None, rq], k[None, rk], v[None, rk], dout[None, rq]
        o1, l1 = flashdl.attention(qb, kb, vb, return_lse=True, block_mask=plane, **opts)
        g1 = flashdl.attention_backward(dob, qb, kb, vb, o1, l1, block_mask=plane, **opts)
        assert np.array_equal(out[rq], o1[0]) and np.array_equal(lse[:, rq], l1[0]), s
        for g, w, rows in ((dq, g1[0], rq), (dk, g1[1], rk), (dv, g1[2], rk)):
            assert np.array_equal(g[rows], w[0]), s


def test_torch_autograd_with_a_block_mask():
    torch = pytest.importorskip("torch")
    import flashdl.torch as ft

    rng = np.random.default_rng(9)
    q, k, v = make_qkv(rng, 2, 90, 70, 4, 2, 16, dtype="float64")
    dout = make(rng, q.shape, "float64")
    mask = random_mask(rng, (2, 4, nblocks(90, 16), nblocks(70, 16)), 0.5)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out = ft.attention(tq, tk, tv, causal=True, block_mask=torch.from_numpy(mask),
                       block_size=16)
    out.backward(torch.from_numpy(dout))
    want_out, want_lse = flashdl.attention(q, k, v, causal=True, block_mask=mask, block_size=16,
                                           return_lse=True)
    np.testing.assert_array_equal(out.detach().numpy(), want_out)
    want = flashdl.attention_backward(dout, q, k, v, want_out, want_lse, causal=True,
                                      block_mask=mask, block_size=16)
    for t, w in zip((tq, tk, tv), want):
        np.testing.assert_array_equal(t.grad.numpy(), w)


def test_jax_mask():
    jnp = pytest.importorskip("jax.numpy")
    rng = np.random.default_rng(10)
    q, k, v = make_qkv(rng, 1, 50, 60, 2, 1, 16, dtype="float32")
    mask = random_mask(rng, (nblocks(50, 16), nblocks(60, 16)), 0.5)
    want = flashdl.attention(q, k, v, block_mask=mask, block_size=16)
    got = flashdl.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                            block_mask=jnp.asarray(mask), block_size=16)
    np.testing.assert_array_equal(np.asarray(got), want)


Q, K, V = make_qkv(np.random.default_rng(2), 2, 40, 30, 2, 1, 8)
GOOD = np.ones((3, 2), dtype=bool)  # block_size 16: ceil(40/16) x ceil(30/16)


@pytest.mark.parametrize("kwargs,exc,name", [
    (dict(block_mask=np.ones((3, 3), bool)), ValueError, "block_mask"),
    (dict(block_mask=np.ones((2, 2), bool)), ValueError, "block_mask"),
    (dict(block_mask=np.ones((2, 3, 2), bool)), ValueError, "block_mask"),
    (dict(block_mask=np.ones((3, 2, 3, 2), bool)), ValueError, "block_mask"),
    (dict(block_mask=np.ones((2, 3, 3, 2), bool)), ValueError, "block_mask"),
    (dict(block_mask=np.ones(3, bool)), ValueError, "block_mask"),
    (dict(block_mask=np.ones((3, 2), np.uint8)), TypeError, "block_mask"),
    (dict(block_mask=np.ones((3, 2), np.float32)), TypeError, "block_mask"),
    (dict(block_mask=np.ones((2, 3), bool).T), ValueError, "block_mask"),
    (dict(block_mask=[[True, True]] * 3), TypeError, "block_mask"),
    (dict(block_mask=GOOD, block_size=0), ValueError, "block_size"),
    (dict(block_mask=GOOD, block_size=(16, -1)), ValueError, "block_size"),
    (dict(block_mask=GOOD, block_size=1.5), TypeError, "block_size"),
    (dict(block_mask=GOOD, block_size=(16, 16, 16)), TypeError, "block_size"),
    (dict(block_mask=GOOD, block_size="16"), TypeError, "block_size"),
    (dict(block_size=None), TypeError, "block_size"),
])
def test_errors_name_the_argument(kwargs, exc, name):
    kwargs.setdefault("block_size", 16)
    out, lse = flashdl.attention(Q, K, V, return_lse=True)
    with pytest.raises(exc, match=rf"\b{name}\b"):
        flashdl.attention(Q, K, V, **kwargs)
    with pytest.raises(exc, match=rf"\b{name}\b"):
        flashdl.attention_backward(Q, Q, K, V, out, lse, **kwargs)


def test_good_mask_for_the_error_cases():
    """The shapes the error cases get wrong: (3, 2) and its broadcast forms are accepted."""
    for mask in (GOOD, np.ones((1, 1, 3, 2), bool), np.ones((2, 2, 3, 2), bool),
                 np.ones((1, 2, 3, 2), bool)):
        flashdl.attention(Q, K, V, block_mask=mask, block_size=16)
    # block_size without a mask is dense attention, still checked
    np.testing.assert_array_equal(flashdl.attention(Q, K, V, block_size=7),
                                  flashdl.attention(Q, K, V))


def test_huge_block_sizes_are_one_block():
    """A block longer than the sequence (up to 2**63 - 1) is one block covering it."""
    rng = np.random.default_rng(11)
    q, k, v = make_qkv(rng, 1, 30, 20, 2, 1, 8, dtype="float32")
    want = flashdl.attention(q, k, v, block_mask=np.ones((1, 1), bool), block_size=64)
    for block in (2**62, 2**63 - 1):
        got = flashdl.attention(q, k, v, block_mask=np.ones((1, 1), bool), block_size=block)
        np.testing.assert_array_equal(got, want)
        zero = flashdl.attention(q, k, v, block_mask=np.zeros((1, 1), bool), block_size=block)
        assert np.all(zero == 0)
    with pytest.raises(ValueError, match=r"\bblock_size\b"):
        flashdl.attention(q, k, v, block_mask=np.ones((1, 1), bool), block_size=2**63)


def test_varlen_mask_errors():
    cq = np.array([0, 10, 40], np.int32)
    ck = np.array([0, 30, 30], np.int32)
    q, k, v = Q.reshape(-1, 2, 8)[:40], K.reshape(-1, 1, 8)[:30], V.reshape(-1, 1, 8)[:30]
    ok = np.ones((2, 2, 2, 2), bool)  # 2 sequences, 2 heads, ceil(30/16) x ceil(30/16)
    flashdl.attention_varlen(q, k, v, cq, ck, 30, 30, block_mask=ok, block_size=16)
    for bad in (np.ones((3, 2, 2, 2), bool), np.ones((2, 2, 3, 2), bool)):
        with pytest.raises(ValueError, match=r"\bblock_mask\b"):
            flashdl.attention_varlen(q, k, v, cq, ck, 30, 30, block_mask=bad, block_size=16)
