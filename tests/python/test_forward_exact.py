"""Forward exactness against the float64 oracle (flash-attn's rule), and lse against the oracle."""

import zlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flashdl
from flashdl import _ext
from attn_oracle import (DTYPES, SCHEDULES, assert_lse, assert_rule, f64, forward, fwd_ulps,
                         make, make_qkv, np_dtype)

# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim)
SHAPES = [
    (1, 1, 1, 1, 1, 1),
    (2, 17, 17, 2, 2, 32),
    (1, 97, 33, 4, 2, 64),     # seqlen_q > seqlen_k (causal: empty rows), GQA
    (1, 33, 97, 3, 1, 16),     # seqlen_q < seqlen_k, MQA
    (1, 17, 97, 6, 2, 128),
    (2, 5, 9, 2, 2, 256),
    (1, 3, 5, 1, 1, 7),
    (1, 1, 97, 2, 1, 96),
]


def check(q, k, v, dtype, schedule, causal=False, window=(-1, -1), softmax_scale=None):
    out, lse = flashdl.attention(q, k, v, causal=causal, schedule=schedule, return_lse=True,
                                 window_size=window, softmax_scale=softmax_scale)
    assert isinstance(out, np.ndarray) and out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    kw = dict(causal=causal, window=window, softmax_scale=softmax_scale)
    o_ref, lse_ref = forward(q, k, v, **kw)
    o_low, _ = forward(q, k, v, dtype=dtype, exact=False, **kw)
    assert_rule(out, o_ref, o_low, dtype, ulps=fwd_ulps(dtype, q, k))
    assert_lse(lse, lse_ref)
    return out, lse


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_oracle(shape, dtype, schedule, causal):
    rng = np.random.default_rng(zlib.crc32(repr((shape, dtype, causal)).encode()))
    check(*make_qkv(rng, *shape, dtype=dtype), dtype, schedule, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("schedule", ["fa1", "fa2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_long_sequence(dtype, schedule, causal):
    rng = np.random.default_rng(7)
    check(*make_qkv(rng, 1, 1025, 1025, 1, 1, 64, dtype=dtype), dtype, schedule, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_keys_take_taller_query_tiles(dtype, causal):
    # 4,200 keys: a head's packed K and V outgrow 1 MiB in every dtype, so fa2's forward takes
    # 144-row query tiles (fa2_forward_block_rows): 300 rows are two whole tiles and one of 12.
    rng = np.random.default_rng(zlib.crc32(repr(("long keys", dtype, causal)).encode()))
    check(*make_qkv(rng, 1, 300, 4200, 8, 2, 64, dtype=dtype), dtype, "fa2", causal)


@pytest.mark.parametrize("seqlen_k", [64, 288])
@pytest.mark.parametrize("dtype", DTYPES)
def test_whole_key_tiles(dtype, seqlen_k):
    # Key tiles with no mask and no padding column: S stays unscaled, the scale goes into exp2
    # (scale_in_exp2), and the bfloat16 forward rounds P to pairs as it computes it
    # (exp_pairs); at 64 keys (one tile) it reads Q in place. 50 rows end in a micro-kernel
    # block of 2 real rows and 4 of padding; 4 heads over 2 kv heads.
    rng = np.random.default_rng(zlib.crc32(repr(("whole key tiles", dtype, seqlen_k)).encode()))
    check(*make_qkv(rng, 2, 50, seqlen_k, 4, 2, 64, dtype=dtype), dtype, "fa2", False)


@pytest.mark.parametrize("seqlen_k", [1, 16, 25, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_short_key_tile(dtype, seqlen_k):
    # Up to 32 keys, one key tile: the bfloat16 forward takes each row's max in the S
    # micro-kernel's epilogue, the columns past seqlen_k masked there (stale_reference_tile's
    # own mode); 50 rows end in a block of 2 real rows and 4 of padding.
    rng = np.random.default_rng(zlib.crc32(repr(("short key tile", dtype, seqlen_k)).encode()))
    check(*make_qkv(rng, 2, 50, seqlen_k, 4, 2, 64, dtype=dtype), dtype, "fa2", False)


@pytest.mark.parametrize("jump", [1.0, 2.5, 8.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scores_past_the_running_max(dtype, jump):
    # Three whole key tiles (96 keys each) whose second has its keys scaled by `jump`: a row's
    # scores there pass its max from the first tile by 0 to a few units (2.5) or by far more
    # than 8 in the log2 domain (8.0). The bfloat16 forward takes a plain tile after a row's first
    # against the row's earlier max, unscaled (stale_reference_tile), and redoes the rows whose
    # scores pass it by more than 8; at 2.5 some rows are redone and some keep P up to 2^8.
    rng = np.random.default_rng(zlib.crc32(repr(("past the max", dtype, jump)).encode()))
    q, k, v = make_qkv(rng, 1, 50, 288, 4, 2, 64, dtype=dtype)
    k[:, 96:192] = (f64(k[:, 96:192]) * jump).astype(k.dtype)
    check(q, k, v, dtype, "fa2", False)


@pytest.mark.parametrize("seqlen_k", [288, 20])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nonfinite_key_in_a_later_tile(dtype, bad, seqlen_k):
    # A NaN or infinite key in the second of three whole key tiles (or in a single tile of 20
    # keys), seen by every row: each row follows the float64 reference schedule (NaN where it
    # is: an infinite score's row, lse too; a -inf score is P = 0), also where the bfloat16
    # forward computes that tile against the rows' earlier max (or its own, in the epilogue).
    seed = zlib.crc32(repr(("nonfinite later", dtype, bad, seqlen_k)).encode())
    rng = np.random.default_rng(seed)
    q, k, v = make_qkv(rng, 1, 50, seqlen_k, 4, 2, 64, dtype=dtype)
    k[:, min(150, seqlen_k - 5), :, 3] = bad
    out, lse = flashdl.attention(q, k, v, schedule="fa2", return_lse=True)
    out64, lse64 = flashdl.attention(f64(q), f64(k), f64(v), schedule="reference",
                                     return_lse=True)
    for got, want in ((out, out64), (lse, lse64)):
        got = f64(got)
        assert np.array_equal(np.isnan(got), np.isnan(want))
        fin = np.isfinite(want)
        assert np.isfinite(got[fin]).all()
        np.testing.assert_allclose(got[fin], want[fin], rtol=2e-2, atol=2e-2)
    if bad == np.inf:
        assert np.isnan(out64).any() and np.isfinite(out64).any()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("window", [(0, 0), (3, 1), (8, -1), (-1, 2)])
def test_sliding_window(schedule, window):
    rng = np.random.default_rng(3)
    check(*make_qkv(rng, 1, 23, 31, 2, 1, 16), "float32", schedule, window=window)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("scale", [0.05, 1.0, 3.0])
def test_softmax_scale(schedule, scale):
    rng = np.random.default_rng(4)
    check(*make_qkv(rng, 1, 19, 23, 2, 2, 32, dtype="float64"), "float64", schedule,
          softmax_scale=scale)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transposed_and_strided_views(dtype, schedule):
    """A (b, h, s, d) array transposed to (b, s, h, d), step slices and negative strides: no copy,
    same answer as contiguous arrays."""
    rng = np.random.default_rng(5)
    b, sq, sk, h, hk, d = 2, 19, 26, 4, 2, 32
    q = make(rng, (b, h, sq, d), dtype).transpose(0, 2, 1, 3)
    k = make(rng, (b, hk, 2 * sk, d), dtype).transpose(0, 2, 1, 3)[:, ::2]
    v = make(rng, (2 * b, sk, hk, d), dtype)[::-2]
    for x in (q, k, v):
        assert not x.flags.c_contiguous
    for causal in (False, True):
        out, lse = check(q, k, v, dtype, schedule, causal)
        contiguous = [np.ascontiguousarray(x) for x in (q, k, v)]
        out_c, lse_c = flashdl.attention(*contiguous, causal=causal, schedule=schedule,
                                         return_lse=True)
        atol = 1e-6 if dtype == "float32" else 1e-2
        np.testing.assert_allclose(f64(out), f64(out_c), rtol=0, atol=atol)
        np.testing.assert_allclose(lse, lse_c, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_rows(dtype, schedule):
    """Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k queries see no key."""
    rng = np.random.default_rng(6)
    q, k, v = make_qkv(rng, 2, 13, 4, 2, 1, 8, dtype=dtype)
    out, lse = check(q, k, v, dtype, schedule, causal=True)
    assert np.all(f64(out)[:, :9] == 0)
    assert np.all(np.isneginf(lse[:, :, :9])) and np.all(np.isfinite(lse[:, :, 9:]))
    # a window that shows some rows nothing
    out, lse = check(q, k, v, dtype, schedule, window=(0, 0))
    assert np.all(f64(out)[:, :9] == 0) and np.all(np.isneginf(lse[:, :, :9]))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_large_scores_do_not_overflow(dtype, schedule):
    rng = np.random.default_rng(8)
    q, k, v = make_qkv(rng, 1, 9, 40, 1, 1, 16, dtype=dtype)
    q = (f64(q) * 30).astype(np_dtype(dtype))
    check(q, k, v, dtype, schedule, causal=True)


@st.composite
def layouts(draw):
    b = draw(st.integers(1, 2))
    sq, sk = draw(st.integers(1, 300)), draw(st.integers(0, 300))
    hk = draw(st.integers(1, 2))
    h = hk * draw(st.integers(1, 3))
    d = draw(st.sampled_from([1, 3, 16, 32, 64, 80, 128, 256]))
    dtype = draw(st.sampled_from(DTYPES))
    window = draw(st.sampled_from([(-1, -1), (-1, 0), (5, 0), (17, 3), (0, -1)]))
    transposed = draw(st.booleans())  # (b, h, s, d) storage viewed as (b, s, h, d)
    return b, sq, sk, h, hk, d, dtype, window, transposed


@given(layouts(), st.sampled_from(["fa1", "fa2"]), st.integers(0, 2**32 - 1))
def test_hypothesis_matches_oracle(layout, schedule, seed):
    b, sq, sk, h, hk, d, dtype, window, transposed = layout
    rng = np.random.default_rng(seed)

    def arr(s, n):
        if transposed:
            return make(rng, (b, n, s, d), dtype).transpose(0, 2, 1, 3)
        return make(rng, (b, s, n, d), dtype)

    check(arr(sq, h), arr(sk, hk), arr(sk, hk), dtype, schedule, window=window)


@pytest.mark.parametrize("sram_bytes", [1, 4096, 16384, 65536, 1 << 22])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fa1_on_chip_budget(dtype, sram_bytes):
    """Algorithm 1's tile sizes come from M: tiny and huge budgets give the same exact answer."""
    rng = np.random.default_rng(9)
    q, k, v = make_qkv(rng, 1, 150, 190, 2, 1, 64, dtype=dtype)
    for causal in (False, True):
        dt = "bfloat16" if dtype == "bfloat16" else None
        view = (lambda x: x.view(np.uint16)) if dt else (lambda x: x)
        out = np.empty_like(q)
        lse = np.empty((1, 2, 150), np.float32)
        _ext.forward(view(q), view(k), view(v), view(out), lse, dtype=dt, causal=causal,
                     schedule="fa1", sram_bytes=sram_bytes)
        o_ref, lse_ref = forward(q, k, v, causal=causal)
        o_low, _ = forward(q, k, v, causal=causal, dtype=dtype, exact=False)
        assert_rule(out, o_ref, o_low, dtype, ulps=fwd_ulps(dtype, q, k))
        assert_lse(lse, lse_ref)


@pytest.mark.parametrize("schedule", ["fa1", "fa2"])
def test_thread_count_does_not_change_the_result(schedule):
    rng = np.random.default_rng(10)
    q, k, v = make_qkv(rng, 3, 130, 170, 4, 2, 32)
    outs = []
    for threads in (1, 2, 3, 7):
        out = np.empty_like(q)
        lse = np.empty((3, 4, 130), np.float32)
        _ext.forward(q, k, v, out, lse, causal=True, schedule=schedule, num_threads=threads)
        outs.append((out, lse))
    for out, lse in outs[1:]:
        np.testing.assert_allclose(out, outs[0][0], rtol=0, atol=1e-6)
        np.testing.assert_allclose(lse, outs[0][1], rtol=1e-6, atol=1e-6)


# "auto" runs a few query rows per kv head over many keys with the KV-cache kernel (decoding
# through attention(); src/cpu/backend.cpp): seqlen_q x group <= 2 from 256 keys, <= 4 from 1024,
# <= 32 from 8192, <= 64 from 65536.
DECODE_SHAPES = [
    (1, 1, 256, 2, 2, 64),     # the smallest routed
    (2, 1, 1000, 8, 4, 32),    # GQA: 2 rows per kv head
    (1, 4, 1024, 2, 2, 32),    # 4 rows over 1024 keys
    (1, 32, 8192, 2, 2, 16),   # 32 rows over 8192 keys
    (1, 8, 65536, 8, 1, 16),   # MQA: 64 rows per kv head over 65536 keys
    (1, 3, 300, 2, 2, 16),     # 3 rows: fa2 (not routed)
]


@pytest.mark.parametrize("mods", [False, True], ids=["plain", "softcap-alibi"])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (100, 3)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_auto_few_queries_many_keys(shape, dtype, window, mods):
    rng = np.random.default_rng(zlib.crc32(repr((shape, dtype, window, mods)).encode()))
    q, k, v = make_qkv(rng, *shape, dtype=dtype)
    kw = dict(softcap=3.0, alibi_slopes=rng.uniform(0.01, 0.1, shape[3]).astype(np.float32)) \
        if mods else {}
    out, lse = flashdl.attention(q, k, v, window_size=window, return_lse=True, **kw)
    o_ref, lse_ref = forward(q, k, v, window=window, **kw)
    o_low, _ = forward(q, k, v, window=window, dtype=dtype, exact=False, **kw)
    assert_rule(out, o_ref, o_low, dtype, ulps=fwd_ulps(dtype, q, k))
    assert_lse(lse, lse_ref)
    # the same function as fa2, to rounding
    o2, l2 = flashdl.attention(q, k, v, window_size=window, return_lse=True, schedule="fa2", **kw)
    assert_lse(lse, l2)


def test_fast_path_is_the_full_path(monkeypatch):
    """flashdl.attention on aligned NumPy float16/32/64 arrays, or plain CPU torch tensors, with
    default options (causal and return_lse aside) skips the Python frame (a tiny call's time is
    mostly Python): it must give the full path's results bit for bit, take the fast path where it
    should (no Frame built), not where it should not, and raise the full path's errors, worded
    the same."""
    from flashdl import _api
    torch = pytest.importorskip("torch")

    rng = np.random.default_rng(7)
    full_path = lambda *a: None  # noqa: E731 - _fast_forward declining: the full path
    inputs = []
    for dtype in (np.float16, np.float32, np.float64):
        q = rng.standard_normal((2, 9, 4, 16)).astype(dtype)
        k, v = (rng.standard_normal((2, 11, 2, 16)).astype(dtype) for _ in range(2))
        inputs.append((q, k, v))
    for tdt in (torch.float32, torch.bfloat16):
        inputs.append(tuple(torch.from_numpy(x.astype(np.float32)).to(tdt) for x in inputs[1]))
    for q, k, v in inputs:
        for causal in (False, True):
            fast = flashdl.attention(q, k, v, causal=causal, return_lse=True)
            with monkeypatch.context() as m:
                m.setattr(_api, "_fast_forward", full_path)
                full = flashdl.attention(q, k, v, causal=causal, return_lse=True)
            for a, b in zip(fast, full):
                assert type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
                if isinstance(a, torch.Tensor):
                    assert torch.equal(a, b)
                else:
                    np.testing.assert_array_equal(a, b)
            alone = flashdl.attention(q, k, v, causal=causal)  # no lse: the core's scratch
            assert type(alone) is type(q)
            if isinstance(alone, torch.Tensor):
                assert alone.is_contiguous() and torch.equal(alone, fast[0])
            else:
                np.testing.assert_array_equal(alone, fast[0])

    q = rng.standard_normal((1, 5, 2, 8)).astype(np.float32)
    t = torch.from_numpy(q)

    def no_frame(*args, **kwargs):
        raise AssertionError("the full path ran")

    with monkeypatch.context() as m:
        m.setattr(_api, "Frame", no_frame)
        flashdl.attention(q, q, q)  # fast: no Frame
        flashdl.attention(q, q, q, causal=True, return_lse=True)
        flashdl.attention(t, t, t, seed=0, block_size=(128, 128))  # flashdl.torch's spelling
        tb = t.to(torch.bfloat16)
        flashdl.attention(tb, tb, tb, return_lse=True)
        for kwargs in ({"softmax_scale": 0.5}, {"window_size": (2, 0)}, {"schedule": "fa2"},
                       {"dropout_p": 0.1}, {"softcap": 1.0}, {"layout": "bhsd"}, {"seed": 3},
                       {"block_size": 64}, {"window_size": (-1.0, -1.0)},
                       {"block_size": (128, 128.0)}, {"block_size": 128.0}):
            for x in (q, t):
                with pytest.raises(AssertionError, match="the full path ran"):
                    flashdl.attention(x, x, x, **kwargs)
        for args in ((q, q.astype(np.float64), q), (q, q.tolist(), q), (q, t, q),
                     (t, t.double(), t), (t, t.requires_grad_(), t.detach())):
            with pytest.raises(AssertionError, match="the full path ran"):
                flashdl.attention(*args)  # mixed dtypes, types or grad: the full path's checks
    with pytest.raises(ValueError, match="requires grad"):  # the full path's refusal, still
        flashdl.attention(t, t, t)
    t = t.detach()

    heads_first_q = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)  # (b, h, s, d)
    heads_first_kv = rng.standard_normal((1, 2, 7, 8)).astype(np.float32)
    bad = [(q, q[:, :, :1, :4], q), (q, q, q[:, :3]), (q[0], q, q), (q, q.swapaxes(1, 2), q),
           (heads_first_q, heads_first_kv, heads_first_kv),  # the full path's layout= hint
           (t, t[:, :3], t)]
    for args in bad:
        with pytest.raises(ValueError) as fast_error:
            flashdl.attention(*args)
        with monkeypatch.context() as m:
            m.setattr(_api, "_fast_forward", full_path)
            with pytest.raises(ValueError) as full_error:
                flashdl.attention(*args)
        assert str(fast_error.value) == str(full_error.value)
