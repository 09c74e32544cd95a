"""flashdl.attention_with_kvcache and flashdl.merge_states.

- Against a float64 NumPy oracle by flash-attn's rule (hypothesis: batches, ragged/empty/full
  cache lengths, seqlen_q, appended keys, page sizes, GQA/MQA, head dims, num_splits, causal and
  windows, ALiBi, softcap, every dtype), with the paged cache bitwise equal to the contiguous one
  (pages permuted, unused pages, unused rows and unused block_table entries poisoned), and the
  append checked bitwise on the caches' underlying memory (strided cache layouts too).
- num_splits: every split count agrees; merge_states(_list) equals attention over the union of key
  chunks, is associative to rounding, and ignores partials with lse -inf.
- Equal lengths, contiguous cache: equals flashdl.attention over the cache's first L keys.
- Empty batches and sequences; every validation error names its argument and writes nothing.
- PyTorch (in-place append, same storage) and JAX (read-only caches).
"""

import inspect
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flashdl
from attn_oracle import EPS, assert_lse, assert_rule, make, np_dtype

DTYPES = ["float64", "float32", "float16", "bfloat16"]


# --- the oracle: one sequence, float64 (exact=True) or the naive algorithm in the input precision


def naive(q, k, v, *, causal=False, window=(-1, -1), scale=None, softcap=0.0, slopes=None,
          dtype="float64", exact=True):
    """q (sq, h, d), k, v (n, hk, d) of one sequence -> out (sq, h, d) float64, lse (h, sq).

    Causal and windows bottom-right aligned (query i is key position i + n - sq); softcap then the
    ALiBi bias -slope * |i + n - sq - j| (flash-attn's order). exact=False rounds every
    intermediate to the input dtype (computing in float32), flash-attn's attention_ref with
    upcast=False: the naive low-precision forward of the acceptance rule."""
    comp = np.float64 if exact or dtype == "float64" else np.float32
    store = None if exact or dtype in ("float32", "float64") else np_dtype(dtype)

    def rnd(x):
        x = np.asarray(x, dtype=comp)
        return x if store is None else x.astype(store).astype(comp)

    sq, h, d = q.shape
    n, hk = k.shape[0], k.shape[1]
    g = h // hk
    scale = 1 / np.sqrt(d) if scale is None else scale
    qh = rnd(np.swapaxes(np.asarray(q, np.float64), 0, 1))                    # (h, sq, d)
    kh = rnd(np.repeat(np.swapaxes(np.asarray(k, np.float64), 0, 1), g, 0))  # (h, n, d)
    vh = rnd(np.repeat(np.swapaxes(np.asarray(v, np.float64), 0, 1), g, 0))
    s = rnd(np.matmul(qh, np.swapaxes(kh, -1, -2)) * scale)
    if softcap > 0:
        s = rnd(rnd(np.tanh(rnd(s / softcap))) * softcap)
    i = np.arange(sq)[:, None] + (n - sq)
    j = np.arange(n)[None, :]
    if slopes is not None:
        s = s + (-np.asarray(slopes, np.float64)[:, None, None] * np.abs(i - j)).astype(comp)
    left, right = window
    if causal:
        right = 0
    ok = np.ones((sq, n), dtype=bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    s = np.where(ok, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    m0 = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m0)
    tot = e.sum(axis=-1, keepdims=True)
    p = rnd(e / np.where(tot > 0, tot, 1))
    with np.errstate(divide="ignore"):
        lse = np.where(tot > 0, m0 + np.log(np.where(tot > 0, tot, 1)), -np.inf)[..., 0]
    o = rnd(np.matmul(p, vh))
    return np.swapaxes(o, 0, 1).astype(np.float64), lse.astype(np.float64)


def oracle_batch(q, keys, values, dtype, slopes=None, **kw):
    """The exact and naive low-precision results of a batch whose sequence b attends to
    keys[b], values[b] (slopes (batch, h) or None): (out, lse) exact and out naive, stacked like
    flashdl's results."""
    exact, low = [], []
    for b in range(q.shape[0]):
        sl = None if slopes is None else slopes[b]
        exact.append(naive(q[b], keys[b], values[b], dtype=dtype, slopes=sl, **kw))
        low.append(naive(q[b], keys[b], values[b], dtype=dtype, exact=False, slopes=sl, **kw)[0])
    return np.stack([o for o, _ in exact]), np.stack([x for _, x in exact]), np.stack(low)


def ulps_for(dtype, keys, d):
    """float32 slack for another summation order (attn_oracle.fwd_ulps): 2 sqrt(n + d)."""
    n = max([x.shape[0] for x in keys], default=0)
    return 2 * np.sqrt(n + d) if dtype == "float32" else 1.0


def bits(x):
    """The bytes of an array (NaN-safe bitwise comparison, any dtype)."""
    return np.ascontiguousarray(x).view(np.uint8)


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(bits(a), bits(b))


# --- caches with strided layouts: (base array, the (dim0, rows, nheads_kv, d) view passed in)


def alloc(shape, dtype, layout):
    """A NaN-filled base array and the 4-d view of it flashdl gets: 'bshd' (the view is the base),
    'bhsd' (heads before rows, transposed), 'padded' (headdim padded by 3, sliced)."""
    s0, s1, s2, s3 = shape
    if layout == "bshd":
        base = np.full(shape, np.nan, dtype)
        return base, base
    if layout == "bhsd":
        base = np.full((s0, s2, s1, s3), np.nan, dtype)
        return base, base.transpose(0, 2, 1, 3)
    base = np.full((s0, s1, s2, s3 + 3), np.nan, dtype)
    return base, base[..., :s3]


def view_of(base, layout, d):
    if layout == "bshd":
        return base
    if layout == "bhsd":
        return base.transpose(0, 2, 1, 3)
    return base[..., :d]


class Case:
    """A batch over a cache, in both a contiguous-per-sequence and a paged layout holding the same
    data. Rows at and beyond cache_seqlens[b] are NaN before the call (the first seqlen_new of them
    receive the new keys); pages no sequence owns are NaN; block_table entries past the pages a
    sequence uses are out of range (never read, never checked)."""

    def __init__(self, rng, *, batch, lens, seqlen_q, seqlen_new, h, hk, d, dtype, page_size,
                 max_pages, spare_pages, layout):
        dt = np_dtype(dtype)
        self.dtype, self.layout, self.d = dtype, layout, d
        self.lens = np.asarray(lens, np.int32)
        self.seqlen_new = seqlen_new
        cap = max_pages * page_size
        self.q = make(rng, (batch, seqlen_q, h, d), dtype)
        self.k = make(rng, (batch, seqlen_new, hk, d), dtype) if seqlen_new else None
        self.v = make(rng, (batch, seqlen_new, hk, d), dtype) if seqlen_new else None
        data_k = make(rng, (batch, cap, hk, d), dtype)
        data_v = make(rng, (batch, cap, hk, d), dtype)
        for b, n in enumerate(self.lens):
            data_k[b, n:] = np.nan
            data_v[b, n:] = np.nan
        # The keys each sequence must attend to, from the inputs (not from the written cache).
        self.keys = [np.concatenate([data_k[b, :n]] + ([self.k[b]] if seqlen_new else []))
                     for b, n in enumerate(self.lens)]
        self.values = [np.concatenate([data_v[b, :n]] + ([self.v[b]] if seqlen_new else []))
                       for b, n in enumerate(self.lens)]
        # The caches after a correct append (logical layout).
        after_k, after_v = data_k.copy(), data_v.copy()
        if seqlen_new:
            for b, n in enumerate(self.lens):
                after_k[b, n:n + seqlen_new] = self.k[b]
                after_v[b, n:n + seqlen_new] = self.v[b]

        # Contiguous: (batch, cap, hk, d).
        self.kc_base, kc = alloc((batch, cap, hk, d), dt, layout)
        self.vc_base, vc = alloc((batch, cap, hk, d), dt, layout)
        kc[...] = data_k
        vc[...] = data_v
        self.kc, self.vc = kc, vc
        self.kc_want, self.vc_want = self.kc_base.copy(), self.vc_base.copy()
        view_of(self.kc_want, layout, d)[...] = after_k
        view_of(self.vc_want, layout, d)[...] = after_v

        # Paged: logical page p of sequence b is physical page perm[b * max_pages + p].
        num_pages = batch * max_pages + spare_pages
        perm = rng.permutation(num_pages).astype(np.int32)
        table = perm[:batch * max_pages].reshape(batch, max_pages).copy()
        pages = (batch * max_pages, page_size, hk, d)

        def paged(data):
            base, view = alloc((num_pages, page_size, hk, d), dt, layout)
            view[table.ravel()] = data.reshape(pages)
            return base, view

        self.kp_base, self.kp = paged(data_k)
        self.vp_base, self.vp = paged(data_v)
        self.kp_want, _ = paged(after_k)
        self.vp_want, _ = paged(after_v)
        used = self.lens + seqlen_new
        for b in range(batch):  # entries past the used pages: garbage, never read
            first_unused = -(-int(used[b]) // page_size)
            junk = rng.choice([-1, num_pages, 2**31 - 1], size=max_pages - first_unused)
            table[b, first_unused:] = junk
        self.block_table = table

    def run_contiguous(self, **opts):
        return flashdl.attention_with_kvcache(self.q, self.kc, self.vc, cache_seqlens=self.lens,
                                              k=self.k, v=self.v, return_lse=True, **opts)

    def run_paged(self, **opts):
        return flashdl.attention_with_kvcache(self.q, self.kp, self.vp, cache_seqlens=self.lens,
                                              k=self.k, v=self.v, block_table=self.block_table,
                                              return_lse=True, **opts)


WINDOWS = [(-1, -1), (0, 0), (3, 0), (5, 2), (-1, 1), (2, -1)]
HEADS = [(1, 1), (2, 2), (2, 1), (4, 2), (4, 1), (8, 2), (8, 8)]  # GQA ratios 1, 2, 4; MQA


@st.composite
def cases(draw, dtype):
    batch = draw(st.integers(1, 4))
    seqlen_q = draw(st.sampled_from([1, 2, 7]))
    seqlen_new = draw(st.sampled_from([0, 1, 3]))
    page_size = draw(st.sampled_from([1, 3, 16, 64]))
    # Cache capacity before rounding to pages; 1100 keys let num_splits=0 choose two splits.
    target = draw(st.sampled_from([1, 9, 70, 200, 700, 1100]))
    max_pages = max(1, -(-(target + seqlen_new) // page_size))
    cap = max_pages * page_size
    room = cap - seqlen_new
    kinds = draw(st.lists(st.sampled_from(["zero", "one", "ragged", "full"]), min_size=batch,
                          max_size=batch))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    lens = [{"zero": 0, "one": min(1, room), "full": room,
             "ragged": int(rng.integers(0, room + 1))}[kind] for kind in kinds]
    h, hk = draw(st.sampled_from(HEADS))
    d = draw(st.sampled_from([5, 16, 40, 64, 128]))
    case = Case(rng, batch=batch, lens=lens, seqlen_q=seqlen_q, seqlen_new=seqlen_new, h=h, hk=hk,
                d=d, dtype=dtype, page_size=page_size, max_pages=max_pages,
                spare_pages=draw(st.integers(0, 3)),
                layout=draw(st.sampled_from(["bshd", "bshd", "bhsd", "padded"])))
    causal = draw(st.booleans())
    opts = dict(causal=causal, window_size=draw(st.sampled_from(WINDOWS)),
                num_splits=draw(st.sampled_from([0, 1, 2, 5])),
                softmax_scale=draw(st.sampled_from([None, 0.25])))
    mods = draw(st.sampled_from(["none", "none", "alibi", "alibi_bh", "softcap", "both"]))
    if mods in ("alibi", "both"):
        opts["alibi_slopes"] = rng.uniform(0.0, 1.0, size=h).astype(np.float32)
    if mods == "alibi_bh":
        opts["alibi_slopes"] = rng.uniform(0.0, 1.0, size=(batch, h)).astype(np.float32)
    if mods in ("softcap", "both"):
        opts["softcap"] = draw(st.sampled_from([1.5, 30.0]))
    return case, opts


def oracle_of(case, opts):
    slopes = opts.get("alibi_slopes")
    if slopes is not None:
        slopes = np.broadcast_to(slopes, (case.q.shape[0], case.q.shape[2]))
    return oracle_batch(case.q, case.keys, case.values, case.dtype, causal=opts["causal"],
                        window=opts["window_size"], scale=opts["softmax_scale"],
                        softcap=opts.get("softcap", 0.0), slopes=slopes)


def check_against_oracle(case, opts, out, lse):
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    assert lse.dtype == np.float32 and lse.shape == (case.q.shape[0], case.q.shape[2],
                                                     case.q.shape[1])
    o_ref, lse_ref, o_low = oracle_of(case, opts)
    assert_rule(out, o_ref, o_low, case.dtype, ulps=ulps_for(case.dtype, case.keys, case.d))
    assert_lse(lse, lse_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=max(150, settings.default.max_examples))  # ~1 s per dtype
@given(data=st.data())
def test_matches_oracle_paged_equals_contiguous_and_appends(dtype, data):
    case, opts = data.draw(cases(dtype))
    lens = case.lens.copy()
    out_c, lse_c = case.run_contiguous(**opts)
    out_p, lse_p = case.run_paged(**opts)
    assert np.array_equal(case.lens, lens), "cache_seqlens must not be modified"
    # The same keys in the same order: bitwise the same result.
    assert same_bits(out_c, out_p), "paged != contiguous (out)"
    assert same_bits(lse_c, lse_p), "paged != contiguous (lse)"
    check_against_oracle(case, opts, out_c, lse_c)
    # The append: rows [len, len + new) hold k and v, every other byte is unchanged.
    for name, got, want in (("k_cache", case.kc_base, case.kc_want),
                            ("v_cache", case.vc_base, case.vc_want),
                            ("paged k_cache", case.kp_base, case.kp_want),
                            ("paged v_cache", case.vp_base, case.vp_want)):
        assert same_bits(got, want), f"{name} after the append"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_steps_accumulate(dtype):
    """Step-by-step decoding (seqlen_q 1, one new key per step, cache_seqlens advanced by the
    caller) reads back every key appended earlier: step t equals the oracle over all t keys."""
    rng = np.random.default_rng(3)
    batch, h, hk, d, ps, steps = 3, 4, 2, 32, 4, 11
    dt = np_dtype(dtype)
    start = np.array([0, 5, 2], np.int32)
    max_pages = -(-(int(start.max()) + steps) // ps)
    kp = np.full((batch * max_pages + 1, ps, hk, d), np.nan, dt)
    vp = np.full_like(kp, np.nan)
    table = rng.permutation(batch * max_pages + 1)[:batch * max_pages].astype(np.int32)
    table = table.reshape(batch, max_pages)
    keys = [make(rng, (n, hk, d), dtype) for n in start]
    values = [make(rng, (n, hk, d), dtype) for n in start]
    for b, n in enumerate(start):  # prefill through the cache's pages
        for j in range(n):
            kp[table[b, j // ps], j % ps] = keys[b][j]
            vp[table[b, j // ps], j % ps] = values[b][j]
    lens = start.copy()
    for _ in range(steps):
        q = make(rng, (batch, 1, h, d), dtype)
        kn = make(rng, (batch, 1, hk, d), dtype)
        vn = make(rng, (batch, 1, hk, d), dtype)
        out, lse = flashdl.attention_with_kvcache(q, kp, vp, cache_seqlens=lens, k=kn, v=vn,
                                                  block_table=table, causal=True, return_lse=True)
        keys = [np.concatenate([keys[b], kn[b]]) for b in range(batch)]
        values = [np.concatenate([values[b], vn[b]]) for b in range(batch)]
        o_ref, lse_ref, o_low = oracle_batch(q, keys, values, dtype, causal=True)
        assert_rule(out, o_ref, o_low, dtype, ulps=ulps_for(dtype, keys, d))
        assert_lse(lse, lse_ref)
        lens = lens + 1


# --- num_splits and merge_states


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_num_splits_agree(dtype):
    rng = np.random.default_rng(11)
    lens = [1500, 700, 65, 0]  # long, ragged, empty: 64-key tiles, some splits empty
    case = Case(rng, batch=4, lens=lens, seqlen_q=2, seqlen_new=1, h=8, hk=2, d=64, dtype=dtype,
                page_size=16, max_pages=96, spare_pages=2, layout="bshd")
    opts = dict(causal=True, window_size=(-1, -1), softmax_scale=None)
    o_ref, lse_ref, o_low = oracle_of(case, opts)
    tol = {"float64": 1e-12, "float32": 4e-6, "bfloat16": 2 * EPS["bfloat16"]}[dtype]
    first = None
    for splits in [1, 0, 2, 3, 5, 7, 24, 1000]:
        kc, vc = case.kc.copy(), case.vc.copy()  # each call appends again at the same rows
        out, lse = flashdl.attention_with_kvcache(case.q, kc, vc, cache_seqlens=case.lens,
                                                  k=case.k, v=case.v, num_splits=splits,
                                                  return_lse=True, causal=True)
        assert_rule(out, o_ref, o_low, dtype, ulps=ulps_for(dtype, case.keys, 64),
                    what=f"out, num_splits={splits}")
        assert_lse(lse, lse_ref)
        if first is None:
            first = (out, lse)
            continue
        mag = max(1.0, float(np.max(np.abs(o_ref))))
        np.testing.assert_allclose(np.asarray(out, np.float64), np.asarray(first[0], np.float64),
                                   rtol=0, atol=tol * mag, err_msg=f"num_splits={splits} vs 1")
        np.testing.assert_allclose(lse, first[1], rtol=2e-6, atol=2e-6)


def test_num_splits_change_the_summation():
    """Splits are really taken (float32 results differ in the last bits from num_splits=1)."""
    rng = np.random.default_rng(12)
    case = Case(rng, batch=1, lens=[3000], seqlen_q=1, seqlen_new=0, h=4, hk=1, d=64,
                dtype="float32", page_size=64, max_pages=47, spare_pages=0, layout="bshd")
    one, _ = case.run_contiguous(num_splits=1)
    four, _ = case.run_contiguous(num_splits=4)
    auto, _ = case.run_contiguous(num_splits=0)
    assert not np.array_equal(one, four)
    np.testing.assert_allclose(four, one, rtol=0, atol=1e-5)
    np.testing.assert_allclose(auto, one, rtol=0, atol=1e-5)


def chunked(rng, dtype, bounds, b=2, sq=3, h=4, hk=2, d=24):
    """Attention of q over k, v and over the key chunks [bounds[i], bounds[i + 1])."""
    n = bounds[-1]
    q, k, v = make(rng, (b, sq, h, d), dtype), make(rng, (b, n, hk, d), dtype), \
        make(rng, (b, n, hk, d), dtype)
    whole = flashdl.attention(q, k, v, return_lse=True)
    parts = [flashdl.attention(q, k[:, a:z], v[:, a:z], return_lse=True)
             for a, z in zip(bounds[:-1], bounds[1:])]
    return whole, parts


def merge_f64(parts):
    """The merge in float64 from the partial results themselves."""
    lses = np.stack([np.asarray(x, np.float64) for _, x in parts])
    m = np.max(lses, axis=0)
    m0 = np.where(np.isfinite(m), m, 0)
    with np.errstate(divide="ignore"):
        lse = m0 + np.log(np.sum(np.exp(lses - m0), axis=0))
    lse = np.where(np.isfinite(m), lse, -np.inf)
    out = 0
    for o, x in parts:
        w = np.exp(np.asarray(x, np.float64) - np.where(np.isfinite(lse), lse, 0))
        w = np.where(np.isfinite(lse), w, 0)  # (b, h, s) -> (b, s, h, 1)
        out = out + np.swapaxes(w, 1, 2)[..., None] * np.asarray(o, np.float64)
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bounds", [[0, 40, 41, 100], [0, 0, 7, 7, 30], [0, 300, 301, 302]],
                         ids=["3-chunks", "empty-chunks", "uneven"])
def test_merge_states_equals_attention_over_the_union(dtype, bounds):
    rng = np.random.default_rng(zlib.crc32(repr((dtype, bounds)).encode()))
    (o_all, lse_all), parts = chunked(rng, dtype, bounds)
    out, lse = flashdl.merge_states_list([o for o, _ in parts], [x for _, x in parts])
    assert out.dtype == o_all.dtype and out.shape == o_all.shape
    assert lse.dtype == np.float32 and lse.shape == lse_all.shape
    mag = max(1.0, float(np.max(np.abs(np.asarray(o_all, np.float64)))))
    # Against attention over all keys: the partials' roundings plus the merge's.
    tol = {"float64": 1e-6, "float32": 1e-5, "float16": 4 * EPS["float16"],
           "bfloat16": 4 * EPS["bfloat16"]}[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float64), np.asarray(o_all, np.float64),
                               rtol=0, atol=tol * mag)
    np.testing.assert_allclose(lse, lse_all, rtol=2e-6, atol=2e-6)
    # Against the float64 merge of the same partials: one rounding to the dtype.
    o64, l64 = merge_f64(parts)
    np.testing.assert_allclose(np.asarray(out, np.float64), o64, rtol=0,
                               atol={"float64": 1e-12, "float32": 2e-7}.get(dtype, EPS[dtype])
                               * mag)
    np.testing.assert_allclose(lse, l64, rtol=1e-6, atol=1e-6)
    # merge_states on the first two equals merge_states_list on them.
    a, b = parts[0], parts[1]
    two = flashdl.merge_states(a[0], a[1], b[0], b[1])
    two_l = flashdl.merge_states_list([a[0], b[0]], [a[1], b[1]])
    assert same_bits(two[0], two_l[0]) and same_bits(two[1], two_l[1])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_merge_states_is_associative(dtype):
    rng = np.random.default_rng(5)
    _, (a, b, c) = chunked(rng, dtype, [0, 17, 50, 129])
    ab = flashdl.merge_states(*a, *b)
    left = flashdl.merge_states(*ab, *c)
    bc = flashdl.merge_states(*b, *c)
    right = flashdl.merge_states(*a, *bc)
    flat = flashdl.merge_states_list([a[0], b[0], c[0]], [a[1], b[1], c[1]])
    tol = 1e-6 if dtype == "float32" else 2 * EPS[dtype]
    for x, y in ((left, right), (left, flat), (right, flat)):
        np.testing.assert_allclose(np.asarray(x[0], np.float64), np.asarray(y[0], np.float64),
                                   rtol=0, atol=tol * 4)
        np.testing.assert_allclose(x[1], y[1], rtol=1e-6, atol=1e-6)


def test_merge_states_partial_with_no_keys_weighs_nothing():
    rng = np.random.default_rng(6)
    _, ((o, lse),) = chunked(rng, "float32", [0, 9])
    poison = np.full_like(o, np.nan)  # never read: its weight is exactly zero
    none = np.full_like(lse, -np.inf)
    for args in ((o, lse, poison, none), (poison, none, o, lse)):
        out, got = flashdl.merge_states(*args)
        assert same_bits(out, o) and same_bits(got, lse)
    out, got = flashdl.merge_states_list([poison, o, poison], [none, lse, none])
    assert same_bits(out, o) and same_bits(got, lse)
    out, got = flashdl.merge_states(poison, none, poison, none)
    assert np.all(out == 0) and np.all(np.isneginf(got))
    # Row by row: a row that saw no key in one partial takes the other's row unchanged.
    mixed = lse.copy()
    mixed[:, :, 0] = -np.inf
    o2 = o.copy()
    o2[:, 0] = np.nan
    out, got = flashdl.merge_states(o2, mixed, o, lse)
    assert not np.isnan(out).any()
    assert same_bits(out[:, 0], o[:, 0]) and same_bits(got[:, :, 0], lse[:, :, 0])


def test_merge_states_validation():
    rng = np.random.default_rng(7)
    _, ((o, lse), (o2, lse2)) = chunked(rng, "float32", [0, 4, 9])
    with pytest.raises(ValueError, match="outs"):
        flashdl.merge_states_list([], [])
    with pytest.raises(ValueError, match="lses"):
        flashdl.merge_states_list([o, o2], [lse])
    # merge_states names its own arguments (out_a, lse_a, out_b, lse_b), merge_states_list
    # the elements of its lists.
    with pytest.raises(ValueError, match=r"^out_b: .*the shape of out_a"):
        flashdl.merge_states(o, lse, o2[:, :2], lse2)
    with pytest.raises(ValueError, match=r"^outs\[1\]: .*the shape of outs\[0\]"):
        flashdl.merge_states_list([o, o2[:, :2]], [lse, lse2])
    with pytest.raises(ValueError, match=r"^lse_b:"):
        flashdl.merge_states(o, lse, o2, lse2[:, :, :2])
    with pytest.raises(TypeError, match=r"^lse_a:"):
        flashdl.merge_states(o, lse.astype(np.float64), o2, lse2)
    with pytest.raises(TypeError, match=r"^out_b:"):
        flashdl.merge_states(o, lse, o2.astype(np.float64), lse2)
    with pytest.raises(TypeError, match="outs, lses"):
        flashdl.merge_states_list(o, lse)


# --- equivalence with dense attention


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (6, 0)),
                                           (False, (4, 3))])
@pytest.mark.parametrize("seqlen_q,seqlen_new", [(1, 0), (7, 0), (3, 3), (1, 1)])
def test_equals_dense_attention(dtype, causal, window, seqlen_q, seqlen_new):
    rng = np.random.default_rng(zlib.crc32(repr((dtype, causal, window, seqlen_q)).encode()))
    b, h, hk, d, L, cap = 3, 6, 2, 40, 37, 50
    q = make(rng, (b, seqlen_q, h, d), dtype)
    kc, vc = make(rng, (b, cap, hk, d), dtype), make(rng, (b, cap, hk, d), dtype)
    kn, vn = make(rng, (b, seqlen_new, hk, d), dtype), make(rng, (b, seqlen_new, hk, d), dtype)
    k_all = np.concatenate([kc[:, :L], kn], axis=1)
    v_all = np.concatenate([vc[:, :L], vn], axis=1)
    opts = dict(causal=causal, window_size=window)
    want, want_lse = flashdl.attention(q, k_all, v_all, return_lse=True, **opts)
    new = dict(k=kn, v=vn) if seqlen_new else {}
    got, lse = flashdl.attention_with_kvcache(q, kc, vc, cache_seqlens=np.full(b, L, np.int32),
                                              return_lse=True, **new, **opts)
    mag = max(1.0, float(np.max(np.abs(np.asarray(want, np.float64)))))
    tol = {"float64": 1e-12, "float32": 2e-6, "float16": 2 * EPS["float16"],
           "bfloat16": 2 * EPS["bfloat16"]}[dtype]
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                               rtol=0, atol=tol * mag)
    inf = np.isneginf(want_lse)
    assert np.array_equal(np.isneginf(lse), inf)
    np.testing.assert_allclose(lse[~inf], want_lse[~inf], rtol=2e-6, atol=2e-6)


# --- empty cases


def test_empty_batch():
    q = np.zeros((0, 1, 4, 16), np.float32)
    kc = np.zeros((0, 8, 2, 16), np.float32)
    out, lse = flashdl.attention_with_kvcache(q, kc, kc.copy(), cache_seqlens=np.zeros(0, np.int32),
                                              k=np.zeros((0, 1, 2, 16), np.float32),
                                              v=np.zeros((0, 1, 2, 16), np.float32),
                                              return_lse=True)
    assert out.shape == (0, 1, 4, 16) and lse.shape == (0, 4, 1)
    pages = np.zeros((3, 4, 2, 16), np.float32)
    out = flashdl.attention_with_kvcache(q, pages, pages.copy(),
                                         cache_seqlens=np.zeros(0, np.int32),
                                         block_table=np.zeros((0, 2), np.int32))
    assert out.shape == (0, 1, 4, 16)


def test_no_queries_still_appends():
    rng = np.random.default_rng(8)
    q = make(rng, (2, 0, 4, 16))
    kc, vc = make(rng, (2, 8, 2, 16)), make(rng, (2, 8, 2, 16))
    kn, vn = make(rng, (2, 2, 2, 16)), make(rng, (2, 2, 2, 16))
    want_k, want_v = kc.copy(), vc.copy()
    lens = np.array([0, 6], np.int32)
    for b, n in enumerate(lens):
        want_k[b, n:n + 2], want_v[b, n:n + 2] = kn[b], vn[b]
    out, lse = flashdl.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k=kn, v=vn,
                                              return_lse=True)
    assert out.shape == (2, 0, 4, 16) and lse.shape == (2, 4, 0)
    assert same_bits(kc, want_k) and same_bits(vc, want_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("paged", [False, True])
def test_no_keys_gives_zero_and_minus_inf(dtype, paged):
    rng = np.random.default_rng(9)
    q = make(rng, (3, 2, 4, 8), dtype)
    shape = (5, 4, 2, 8) if paged else (3, 4, 2, 8)
    kc = np.full(shape, np.nan, np_dtype(dtype))  # nothing may be read
    table = dict(block_table=np.full((3, 2), -1, np.int32)) if paged else {}
    out, lse = flashdl.attention_with_kvcache(q, kc, kc.copy(), cache_seqlens=np.zeros(3, np.int32),
                                              return_lse=True, **table)
    assert np.all(np.asarray(out, np.float64) == 0) and np.all(np.isneginf(lse))
    # Causal rows that see nothing, next to rows that do.
    kc = make(rng, shape, dtype)
    table = dict(block_table=np.array([[4, 0], [1, 2], [3, -1]], np.int32)) if paged else {}
    out, lse = flashdl.attention_with_kvcache(q, kc, kc.copy(), causal=True, return_lse=True,
                                              cache_seqlens=np.array([1, 0, 3], np.int32), **table)
    assert np.all(np.asarray(out[0, 0], np.float64) == 0) and np.all(np.isneginf(lse[0, :, 0]))
    assert np.all(np.isfinite(lse[0, :, 1])) and np.all(np.isneginf(lse[1]))
    assert np.all(np.isfinite(lse[2]))


# --- validation: each error names its argument, and a failing call writes nothing


def kv_setup(paged=False):
    rng = np.random.default_rng(10)
    b, h, hk, d = 3, 4, 2, 16
    q = make(rng, (b, 2, h, d))
    kn, vn = make(rng, (b, 2, hk, d)), make(rng, (b, 2, hk, d))
    if paged:
        kc, vc = make(rng, (7, 4, hk, d)), make(rng, (7, 4, hk, d))
        table = np.array([[0, 1, 2], [3, 4, -1], [5, 6, 100]], np.int32)
        lens = np.array([5, 2, 3], np.int32)  # the last sequence's pages are checked last
    else:
        kc, vc = make(rng, (b, 10, hk, d)), make(rng, (b, 10, hk, d))
        table = None
        lens = np.array([5, 2, 3], np.int32)
    return dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=lens, k=kn, v=vn,
                block_table=table)


def call(args):
    a = dict(args)
    return flashdl.attention_with_kvcache(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), **a)


def bad(**change):
    def edit(args):
        args.update(change)
        return args
    return edit


def raises_and_writes_nothing(args, exc, match):
    kc, vc = args["k_cache"], args["v_cache"]
    before = (kc.copy(), vc.copy())
    lens = None if args.get("cache_seqlens") is None else np.array(args["cache_seqlens"],
                                                                    copy=True)
    with pytest.raises(exc, match=match):
        call(args)
    assert same_bits(kc, before[0]) and same_bits(vc, before[1]), "a failing call wrote the cache"
    if lens is not None and isinstance(args["cache_seqlens"], np.ndarray):
        assert np.array_equal(args["cache_seqlens"], lens)


I32 = np.int32

# (id, paged, edit of the arguments, exception, message start). Errors in the last sequence so
# that a call writing sequence by sequence before checking would be caught.
CASES = [
    ("len-beyond-capacity-no-new", False,
     bad(cache_seqlens=np.array([5, 2, 11], I32), k=None, v=None), ValueError, "cache_seqlens"),
    ("len-plus-new-beyond-capacity", False, bad(cache_seqlens=np.array([5, 2, 9], I32)),
     ValueError, "cache_seqlens"),
    ("paged-len-beyond-capacity", True, bad(cache_seqlens=np.array([5, 2, 11], I32)),
     ValueError, "cache_seqlens"),
    ("paged-no-new-beyond-capacity", True,
     bad(cache_seqlens=np.array([5, 2, 13], I32), k=None, v=None), ValueError, "cache_seqlens"),
    ("negative-len", False, bad(cache_seqlens=np.array([5, 2, -1], I32)), ValueError,
     "cache_seqlens"),
    ("cache_seqlens-int64-overflow", False,
     bad(cache_seqlens=np.array([5, 2**32 + 2, 3], np.int64)), ValueError,
     "cache_seqlens: expected int32 values"),
    ("cache_seqlens-float", False, bad(cache_seqlens=np.array([5, 2, 3], np.float32)), TypeError,
     "cache_seqlens"),
    ("cache_seqlens-shape", False, bad(cache_seqlens=np.array([5, 2], I32)), ValueError,
     "cache_seqlens"),
    ("cache_seqlens-2d", False, bad(cache_seqlens=np.array([[5, 2, 3]], I32)), ValueError,
     "cache_seqlens"),
    ("cache_seqlens-none", False, bad(cache_seqlens=None), TypeError, "cache_seqlens"),
    ("block_table-negative", True,
     bad(block_table=np.array([[0, 1, 2], [3, 4, -1], [-1, 6, 100]], I32)), ValueError,
     "block_table"),
    ("block_table-too-large", True,
     bad(block_table=np.array([[0, 1, 2], [3, 4, -1], [5, 7, 100]], I32)), ValueError,
     "block_table"),
    ("block_table-page-of-new-keys", True,
     bad(cache_seqlens=np.array([5, 2, 7], I32)), ValueError, "block_table"),  # page 2: 100
    ("block_table-float", True,
     bad(block_table=np.array([[0, 1, 2], [3, 4, 0], [5, 6, 0]], np.float32)), TypeError,
     "block_table"),
    ("block_table-int64-overflow", True,
     bad(block_table=np.array([[0, 1, 2], [3, 4, 0], [5, 6, -2**40]], np.int64)), ValueError,
     "block_table: expected int32 values"),
    ("block_table-rows", True, bad(block_table=np.array([[0, 1, 2], [3, 4, 0]], I32)),
     ValueError, "block_table"),
    ("k-nheads_kv", False, lambda a: bad(k=a["k"][:, :, :1], v=a["v"][:, :, :1])(a), ValueError,
     "k"),
    ("k-headdim", False, lambda a: bad(k=a["k"][..., :8], v=a["v"][..., :8])(a), ValueError,
     "k"),
    ("v-shape", False, lambda a: bad(v=a["v"][:, :1])(a), ValueError, "v"),
    ("k-batch", False, lambda a: bad(k=a["k"][:2], v=a["v"][:2])(a), ValueError, "k"),
    ("k-dtype", False, lambda a: bad(k=a["k"].astype(np.float64), v=a["v"].astype(np.float64))(a),
     TypeError, "k"),
    ("k-without-v", False, bad(v=None), ValueError, "v"),
    ("v-without-k", False, bad(k=None), ValueError, "k"),
    ("v_cache-shape", False, lambda a: bad(v_cache=np.zeros((3, 9, 2, 16), np.float32))(a),
     ValueError, "v_cache"),
    ("paged-v_cache-shape", True, lambda a: bad(v_cache=np.zeros((6, 4, 2, 16), np.float32))(a),
     ValueError, "v_cache"),
    ("cache-rows-below-batch", False,
     lambda a: bad(k_cache=np.zeros((2, 10, 2, 16), np.float32),
                   v_cache=np.zeros((2, 10, 2, 16), np.float32))(a), ValueError, "k_cache"),
    ("k-overlaps-cache", False, lambda a: bad(k=a["k_cache"][:, 8:])(a), ValueError,
     "k_cache"),
    ("same-array-for-both-caches", False, lambda a: bad(v_cache=a["k_cache"])(a), ValueError,
     "v_cache"),
    ("block_table-column-major", True,
     lambda a: bad(block_table=np.asfortranarray(a["block_table"]))(a), ValueError,
     "block_table"),
    ("pages-of-zero-rows", True, lambda a: bad(k_cache=a["k_cache"][:, :0],
                                                v_cache=a["v_cache"][:, :0])(a), ValueError,
     "k_cache"),
    ("num_splits-negative", False, bad(num_splits=-1), ValueError, "num_splits"),
    ("num_splits-float", False, bad(num_splits=2.0), TypeError, "num_splits"),
    ("num_splits-bool", False, bad(num_splits=True), TypeError, "num_splits"),
    ("num_splits-str", False, bad(num_splits="auto"), TypeError, "num_splits"),
    ("window", False, bad(window_size=(-2, 0)), ValueError, "window_size"),
    ("alibi-shape", False, bad(alibi_slopes=np.ones(3, np.float32)), ValueError, "alibi_slopes"),
    ("softcap-negative", False, bad(softcap=-1.0), ValueError, "softcap"),
]


@pytest.mark.parametrize("name,paged,edit,exc,match", CASES, ids=[c[0] for c in CASES])
def test_validation_names_the_argument_and_writes_nothing(name, paged, edit, exc, match):
    args = edit(kv_setup(paged))
    raises_and_writes_nothing(args, exc, rf"^{match}\b")


def test_validation_setup_is_valid():
    """The unedited arguments of the validation cases work (so each case fails for its edit), and
    a block_table entry past the pages a sequence uses (-1, 100 above) is never checked."""
    for paged in (False, True):
        args = kv_setup(paged)
        call(args)


# q's headdim or nheads vs the cache's: the message names the argument the caller passed
# (k_cache); the core, which sees the cache as its dense k, says "k" -- the keyword of the NEW keys
# in this API, which may not even have been given.
CACHE_MISMATCH = [
    ("q-headdim", lambda a: bad(q=a["q"][..., :8].copy())(a), ValueError),
    ("nheads-not-multiple", lambda a: bad(q=np.zeros((3, 2, 3, 16), np.float32))(a), ValueError),
    ("q-dtype", lambda a: bad(q=a["q"].astype(np.float64))(a), TypeError),
]


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("name,edit,exc", CACHE_MISMATCH, ids=[c[0] for c in CACHE_MISMATCH])
def test_q_vs_cache_mismatch_raises_and_writes_nothing(name, edit, exc, paged):
    args = edit(kv_setup(paged))
    raises_and_writes_nothing(args, exc, r"^(k_cache|q|k)\b")


@pytest.mark.parametrize("name,edit,exc", CACHE_MISMATCH, ids=[c[0] for c in CACHE_MISMATCH])
def test_q_vs_cache_mismatch_names_k_cache_or_q(name, edit, exc):
    args = edit(kv_setup())
    args["k"] = args["v"] = None
    with pytest.raises(exc, match=r"^(k_cache|q)\b"):
        call(args)


def test_index_arrays_with_any_strides():
    """cache_seqlens and block_table are read through their strides (block_table's last
    dimension contiguous); a list works for cache_seqlens and block_table."""
    args = dict(kv_setup(paged=True), k=None, v=None)
    want = call(args)
    lens, table = args["cache_seqlens"], args["block_table"]
    wide = np.full((3, 8), -5, np.int32)
    wide[:, 2:5] = table
    spaced = np.zeros(6, np.int32)
    spaced[::2] = lens
    for ls, tb in ((spaced[::2], wide[:, 2:5]), (lens[::-1].copy()[::-1], table),
                   (lens.tolist(), table.tolist())):
        assert same_bits(call(dict(args, cache_seqlens=ls, block_table=tb)), want)


def test_read_only_cache():
    args = kv_setup()
    for name in ("k_cache", "v_cache"):
        a = dict(args)
        a[name] = a[name].copy()
        a[name].flags.writeable = False
        raises_and_writes_nothing(a, ValueError, rf"^{name}\b")
    # Reading a read-only cache (no new keys) is fine.
    a = dict(args, k=None, v=None)
    a["k_cache"] = a["k_cache"].copy()
    a["k_cache"].flags.writeable = False
    a["v_cache"] = a["k_cache"]
    call(a)


def test_no_dropout_parameter():
    assert "dropout_p" not in inspect.signature(flashdl.attention_with_kvcache).parameters
    with pytest.raises(TypeError):
        call(dict(kv_setup(), dropout_p=0.1))


# --- frameworks


def test_torch_cpu_tensors_append_in_place():
    torch = pytest.importorskip("torch")
    case = Case(np.random.default_rng(13), batch=2, lens=[3, 9], seqlen_q=2, seqlen_new=2, h=4,
                hk=2, d=16, dtype="float32", page_size=4, max_pages=3, spare_pages=1,
                layout="bshd")
    want_out, want_lse = flashdl.attention_with_kvcache(
        case.q, case.kc.copy(), case.vc.copy(), cache_seqlens=case.lens, k=case.k, v=case.v,
        causal=True, return_lse=True)
    for paged in (False, True):
        kc = torch.from_numpy((case.kp if paged else case.kc).copy())
        vc = torch.from_numpy((case.vp if paged else case.vc).copy())
        ptr = (kc.data_ptr(), vc.data_ptr())
        table = dict(block_table=torch.from_numpy(case.block_table)) if paged else {}
        out, lse = flashdl.attention_with_kvcache(
            torch.from_numpy(case.q), kc, vc, cache_seqlens=torch.from_numpy(case.lens),
            k=torch.from_numpy(case.k), v=torch.from_numpy(case.v), causal=True,
            return_lse=True, **table)
        assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
        assert out.dtype == torch.float32 and lse.dtype == torch.float32
        assert same_bits(out.numpy(), want_out) and same_bits(lse.numpy(), want_lse)
        assert (kc.data_ptr(), vc.data_ptr()) == ptr
        want = (case.kp_want, case.vp_want) if paged else (case.kc_want, case.vc_want)
        assert same_bits(kc.numpy(), want[0]) and same_bits(vc.numpy(), want[1])


def test_torch_bfloat16_and_grad_rules():
    torch = pytest.importorskip("torch")
    q = torch.randn(2, 1, 4, 16, dtype=torch.bfloat16)
    kc = torch.randn(2, 8, 2, 16, dtype=torch.bfloat16)
    vc = torch.randn(2, 8, 2, 16, dtype=torch.bfloat16)
    kn = torch.randn(2, 1, 2, 16, dtype=torch.bfloat16)
    lens = torch.tensor([2, 7], dtype=torch.int32)
    out = flashdl.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k=kn, v=kn)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    assert torch.equal(kc[0, 2], kn[0, 0]) and torch.equal(vc[1, 7], kn[1, 0])
    assert lens.tolist() == [2, 7]
    # A cache that requires grad is not written (outside no_grad); under no_grad it is.
    kg = kc.clone().requires_grad_(True)
    before = kg.detach().clone()
    with pytest.raises(ValueError, match="^k_cache"):
        flashdl.attention_with_kvcache(q, kg, vc, cache_seqlens=[1, 1], k=kn, v=kn)
    assert torch.equal(kg.detach(), before)
    with torch.no_grad():
        flashdl.attention_with_kvcache(q, kg, vc, cache_seqlens=[1, 1], k=kn, v=kn)
    assert torch.equal(kg.detach()[:, 1], kn[:, 0])
    # Mixing frameworks is refused.
    with pytest.raises(ValueError, match="^k:"):
        flashdl.attention_with_kvcache(q.float().numpy(), kc.float().numpy(), vc.float().numpy(),
                                       cache_seqlens=[1, 1], k=kn.float(), v=kn.float())


def test_jax_reads_but_does_not_append():
    jnp = pytest.importorskip("jax.numpy")
    case = Case(np.random.default_rng(14), batch=2, lens=[3, 9], seqlen_q=1, seqlen_new=0, h=4,
                hk=2, d=16, dtype="float32", page_size=4, max_pages=3, spare_pages=1,
                layout="bshd")
    want = flashdl.attention_with_kvcache(case.q, case.kp, case.vp, cache_seqlens=case.lens,
                                          block_table=case.block_table)
    got = flashdl.attention_with_kvcache(jnp.asarray(case.q), jnp.asarray(case.kp),
                                         jnp.asarray(case.vp), cache_seqlens=case.lens,
                                         block_table=case.block_table)
    assert isinstance(got, type(jnp.asarray(case.q)))
    assert same_bits(np.asarray(got), want)
    kn = jnp.zeros((2, 1, 2, 16), jnp.float32)
    with pytest.raises(TypeError, match="^k_cache"):
        flashdl.attention_with_kvcache(jnp.asarray(case.q), jnp.asarray(case.kc),
                                       jnp.asarray(case.vc), cache_seqlens=case.lens, k=kn, v=kn)


def test_decode_example_runs_and_matches_full_recompute():
    """examples/decode_paged.py: greedy decoding over a paged cache gives the tokens of full
    recomputation (the example exits 1 otherwise)."""
    import pathlib
    import subprocess
    import sys

    example = pathlib.Path(__file__).resolve().parents[2] / "examples" / "decode_paged.py"
    got = subprocess.run([sys.executable, str(example), "--tokens", "12"], capture_output=True,
                         text=True, timeout=120)
    assert got.returncode == 0, got.stdout + got.stderr
    assert got.stdout.rstrip().endswith("OK")


@pytest.mark.parametrize("bhsd", [False, True])
@pytest.mark.parametrize("append", [True, False])
def test_cache_with_more_rows_than_the_batch(append, bhsd):
    """No cache_batch_idx: sequence b reads (and appends to) cache row b, as flash-attn ("we
    assume that the batch indices are [0, 1, ..., batch_size - 1]"), so a cache preallocated for
    a larger batch works; its other rows stay bitwise unchanged, and the result is the call on
    the first batch rows (the same cache cut to them)."""
    a = kv_setup()
    rng = np.random.default_rng(52)
    extra = make(rng, (2,) + a["k_cache"].shape[1:]), make(rng, (2,) + a["v_cache"].shape[1:])
    big_k, big_v = (np.concatenate([c, e]) for c, e in zip((a["k_cache"], a["v_cache"]), extra))
    small_k, small_v = a["k_cache"].copy(), a["v_cache"].copy()
    kw = dict(cache_seqlens=a["cache_seqlens"], causal=True, return_lse=True)
    if append:
        kw.update(k=a["k"], v=a["v"])
    q = a["q"]
    if bhsd:  # Hugging Face's cache layout, through transposed views
        t = lambda x: np.ascontiguousarray(x.swapaxes(1, 2))  # noqa: E731
        q, big_k, big_v, small_k, small_v = (t(x) for x in (q, big_k, big_v, small_k, small_v))
        if append:
            kw.update(k=t(a["k"]), v=t(a["v"]))
        kw.update(layout="bhsd")
    before = big_k[3:].copy(), big_v[3:].copy()
    out, lse = flashdl.attention_with_kvcache(q, big_k, big_v, **kw)
    want, want_lse = flashdl.attention_with_kvcache(q, small_k, small_v, **kw)
    assert same_bits(out, want) and same_bits(lse, want_lse)
    assert same_bits(big_k[:3], small_k) and same_bits(big_v[:3], small_v)
    assert same_bits(big_k[3:], before[0]) and same_bits(big_v[3:], before[1])


def test_cache_with_more_rows_than_the_batch_torch_and_jax():
    """The same through PyTorch (in place) and JAX (read only)."""
    torch = pytest.importorskip("torch")
    a = kv_setup()
    big = [torch.from_numpy(np.concatenate([c, np.full_like(c[:1], 7.0)]))
           for c in (a["k_cache"], a["v_cache"])]
    lens = a["cache_seqlens"]
    out = flashdl.attention_with_kvcache(torch.from_numpy(a["q"]), *big, cache_seqlens=lens,
                                         k=torch.from_numpy(a["k"]), v=torch.from_numpy(a["v"]))
    want = flashdl.attention_with_kvcache(a["q"], a["k_cache"], a["v_cache"], cache_seqlens=lens,
                                          k=a["k"], v=a["v"])
    assert np.array_equal(out.numpy(), want)
    assert all(bool((c[3] == 7.0).all()) for c in big)
    jnp = pytest.importorskip("jax.numpy")
    import flashdl.jax as fj

    got = fj.attention_with_kvcache(jnp.asarray(a["q"]), *(jnp.asarray(c.numpy()) for c in big),
                                    cache_seqlens=jnp.asarray(lens + 2))
    want = flashdl.attention_with_kvcache(a["q"], a["k_cache"], a["v_cache"],
                                          cache_seqlens=lens + 2)
    assert np.array_equal(np.asarray(got), want)
