"""What serving engines pass to the KV-cache call and to varlen (issue 33): rotary embedding fused
into flashdl.attention_with_kvcache, cache_batch_idx, cache_leftpad; paged attention_varlen
(block_table, seqused_k) for chunked prefill.

- Against the float64 oracle by flash-attn's rule (hypothesis over rotary dims and styles, page
  sizes, left pads, batch-index permutations, causal / windowed / neither, GQA, every dtype);
  the appended keys are checked bitwise against the rotation computed in NumPy the way the
  contract says (float32 products rounded, then the difference; float64 for float64).
- Every refused call leaves both caches bitwise unchanged (and names the argument).
- Paged varlen equals, bit for bit, the same call on the gathered contiguous keys; chunked
  prefill over a paged pool equals the contiguous computation; torch and the flash-attn drop-in.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashdl
import flashdl.flash_attn as flash_attn
import flashdl.torch
from attn_oracle import EPS, assert_rule, make, np_dtype
from test_kvcache import naive, same_bits

DTYPES = ["float64", "float32", "float16", "bfloat16"]


def rope(x, cos, sin, pos, interleaved, comp):
    """x (rows, heads, d) rotated at positions pos (rows,): in comp (np.float32 or np.float64),
    products rounded then summed, as the contract says; returns comp values."""
    x = np.asarray(x, np.float64).astype(comp)
    c = np.asarray(cos, np.float64).astype(comp)[pos][:, None, :]
    s = np.asarray(sin, np.float64).astype(comp)[pos][:, None, :]
    half = c.shape[-1]
    rd = 2 * half
    i1 = np.arange(half) * 2 if interleaved else np.arange(half)
    i2 = i1 + 1 if interleaved else i1 + half
    y = x.copy()
    x1, x2 = x[..., i1], x[..., i2]
    y[..., i1] = (x1 * c) - (x2 * s)
    y[..., i2] = (x1 * s) + (x2 * c)
    assert rd <= x.shape[-1]
    return y


def rounded(x, dtype):
    """comp values rounded to the storage dtype, as float64."""
    return np.asarray(np.asarray(x).astype(np_dtype(dtype)), np.float64)


@st.composite
def serving_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    batch = draw(st.integers(1, 3))
    hk = draw(st.sampled_from([1, 2]))
    h = hk * draw(st.sampled_from([1, 2]))
    d = draw(st.sampled_from([8, 16, 40]))
    rotary_dim = draw(st.sampled_from([0] + list(range(2, d + 1, 2))))
    paged = draw(st.booleans())
    page_size = draw(st.sampled_from([1, 3, 4, 16])) if paged else None
    capacity = draw(st.integers(1, 24))
    seqlen_new = draw(st.integers(0, min(3, capacity)))
    seqlen_q = draw(st.integers(1, 4))
    lens = [draw(st.integers(0, capacity - seqlen_new)) for _ in range(batch)]
    leftpad = draw(st.booleans())
    pads = [draw(st.integers(0, n)) for n in lens] if leftpad else None
    extra = 0 if paged else draw(st.integers(0, 2))
    perm = draw(st.permutations(list(range(batch + extra))))[:batch]
    use_idx = not paged and draw(st.booleans())
    mode = draw(st.sampled_from(["none", "causal", "window"]))
    window = (draw(st.integers(0, 6)), draw(st.integers(-1, 2))) if mode == "window" else (-1, -1)
    return dict(dtype=dtype, batch=batch, h=h, hk=hk, d=d, rotary_dim=rotary_dim,
                interleaved=draw(st.booleans()), page_size=page_size, capacity=capacity,
                seqlen_new=seqlen_new, seqlen_q=seqlen_q, lens=lens, pads=pads,
                batch_idx=perm if use_idx else None, cache_rows=batch + (extra if use_idx else 0),
                causal=mode == "causal", window=window, seed=draw(st.integers(0, 2**16)))


def build(c):
    """The call's arrays, the caches' initial contents, and the block table (paged)."""
    rng = np.random.default_rng(c["seed"])
    dt, d, hk = c["dtype"], c["d"], c["hk"]
    q = make(rng, (c["batch"], c["seqlen_q"], c["h"], d), dt)
    kn = make(rng, (c["batch"], c["seqlen_new"], hk, d), dt)
    vn = make(rng, (c["batch"], c["seqlen_new"], hk, d), dt)
    rd = c["rotary_dim"]
    ro = None
    if rd:
        ang = rng.random((c["capacity"] + c["seqlen_q"], rd // 2)) * 2 * np.pi
        ro = (np.cos(ang).astype(np_dtype(dt)), np.sin(ang).astype(np_dtype(dt)))
    # Logical caches: (batch, capacity, hk, d) per sequence, NaN past cache_seqlens.
    logical = []
    for b in range(c["batch"]):
        k = make(rng, (c["capacity"], hk, d), dt)
        v = make(rng, (c["capacity"], hk, d), dt)
        k[c["lens"][b]:] = np.nan
        v[c["lens"][b]:] = np.nan
        logical.append((k, v))
    table = None
    if c["page_size"]:
        P = c["page_size"]
        per = -(-c["capacity"] // P)
        npages = c["batch"] * per + 2
        order = rng.permutation(npages)
        table = order[:c["batch"] * per].reshape(c["batch"], per).astype(np.int32)
        kc = np.full((npages, P, hk, d), np.nan, np_dtype(dt))
        vc = np.full((npages, P, hk, d), np.nan, np_dtype(dt))
        for b, (k, v) in enumerate(logical):
            for j in range(c["capacity"]):
                kc[table[b, j // P], j % P] = k[j]
                vc[table[b, j // P], j % P] = v[j]
    else:
        kc = np.full((c["cache_rows"], c["capacity"], hk, d), np.nan, np_dtype(dt))
        vc = kc.copy()
        rows = c["batch_idx"] if c["batch_idx"] is not None else list(range(c["batch"]))
        for b, (k, v) in enumerate(logical):
            kc[rows[b]], vc[rows[b]] = k, v
    return q, kn, vn, ro, kc, vc, table, logical


def run_case(c, q, kn, vn, ro, kc, vc, table):
    kw = {}
    if ro is not None:
        kw.update(rotary_cos=ro[0], rotary_sin=ro[1], rotary_interleaved=c["interleaved"])
    if c["batch_idx"] is not None:
        kw["cache_batch_idx"] = np.array(c["batch_idx"], np.int32)
    if c["pads"] is not None:
        kw["cache_leftpad"] = np.array(c["pads"], np.int32)
    new = dict(k=kn, v=vn) if c["seqlen_new"] else {}
    return flashdl.attention_with_kvcache(
        q, kc, vc, cache_seqlens=np.array(c["lens"], np.int32), block_table=table,
        causal=c["causal"], window_size=c["window"], return_lse=True, **new, **kw)


@settings(deadline=None)
@given(serving_cases())
def test_rotary_leftpad_batch_idx_against_float64_oracle(c):
    q, kn, vn, ro, kc, vc, table, logical = build(c)
    dt, d = c["dtype"], c["d"]
    comp = np.float64 if dt == "float64" else np.float32
    untouched = kc.copy(), vc.copy()
    out, lse = run_case(c, q, kn, vn, ro, kc, vc, table)
    exact_o, naive_o, exact_l = [], [], []
    # flash-attn's rule: a window side of at least the cache's capacity (paged: the pages of
    # block_table) counts as unbounded.
    cap = table.shape[1] * c["page_size"] if c["page_size"] else c["capacity"]
    windowed = c["causal"] or any(0 <= w < cap for w in c["window"])
    for b in range(c["batch"]):
        L, n = c["lens"][b], c["seqlen_new"]
        pad = c["pads"][b] if c["pads"] is not None else 0
        k_new = np.asarray(kn[b], np.float64)
        qb = np.asarray(q[b], np.float64)
        q_low = qb
        if ro is not None:
            pos_k = L + np.arange(n)
            k_new = rounded(rope(kn[b], *ro, pos_k, c["interleaved"], comp), dt)
            pos_q = L + (np.arange(c["seqlen_q"]) if windowed else np.zeros(c["seqlen_q"], int))
            # The contract: q rotated in comp, rounded once to the dtype, then attended with;
            # the oracle attends exactly with that q.
            qb = q_low = rounded(rope(q[b], *ro, pos_q, c["interleaved"], comp), dt)
        # The appended rows, bitwise: the rotation above rounded to the dtype.
        for j in range(n):
            if c["page_size"]:
                P = c["page_size"]
                got = kc[table[b, (L + j) // P], (L + j) % P]
                got_v = vc[table[b, (L + j) // P], (L + j) % P]
            else:
                r = c["batch_idx"][b] if c["batch_idx"] is not None else b
                got, got_v = kc[r, L + j], vc[r, L + j]
            assert np.array_equal(np.asarray(got, np.float64), k_new[j])
            assert same_bits(np.asarray(got_v), np.asarray(vn[b, j]))
        keys = np.concatenate([np.asarray(logical[b][0][pad:L], np.float64), k_new])
        vals = np.concatenate([np.asarray(logical[b][1][pad:L], np.float64),
                               np.asarray(vn[b], np.float64)])
        o, l = naive(qb, keys, vals, causal=c["causal"], window=c["window"], dtype=dt)
        lo, _ = naive(q_low, keys, vals, causal=c["causal"], window=c["window"], dtype=dt,
                      exact=False)
        exact_o.append(o)
        exact_l.append(l)
        naive_o.append(lo)
    assert_rule(np.asarray(out, np.float64), np.stack(exact_o), np.stack(naive_o), dt)
    finite = np.isfinite(np.stack(exact_l))
    assert np.array_equal(np.isfinite(lse), finite)
    assert np.allclose(lse[finite], np.stack(exact_l)[finite], rtol=1e-4, atol=1e-4)
    # Cache rows no sequence appends to are as they were.
    mask = np.ones(kc.shape[:2], bool)
    for b in range(c["batch"]):
        for j in range(c["lens"][b], c["lens"][b] + c["seqlen_new"]):
            if c["page_size"]:
                mask[table[b, j // c["page_size"]], j % c["page_size"]] = False
            else:
                mask[c["batch_idx"][b] if c["batch_idx"] is not None else b, j] = False
    assert same_bits(kc[mask], untouched[0][mask]) and same_bits(vc[mask], untouched[1][mask])


def _base(dtype="float32", paged=False):
    rng = np.random.default_rng(7)
    q = make(rng, (2, 2, 4, 16), dtype)
    kn, vn = make(rng, (2, 2, 2, 16), dtype), make(rng, (2, 2, 2, 16), dtype)
    if paged:
        kc, vc = make(rng, (6, 4, 2, 16), dtype), make(rng, (6, 4, 2, 16), dtype)
        extra = dict(block_table=np.array([[0, 1, 2], [3, 4, 5]], np.int32))
    else:
        kc, vc = make(rng, (3, 12, 2, 16), dtype), make(rng, (3, 12, 2, 16), dtype)
        extra = dict(cache_batch_idx=np.array([2, 0], np.int32))
    ang = rng.random((12, 4))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    return q, kc, vc, kn, vn, cos, sin, extra


REFUSALS = [
    ("cache_batch_idx", dict(cache_batch_idx=np.array([1, 1], np.int32))),   # collide
    ("cache_batch_idx", dict(cache_batch_idx=np.array([0, 3], np.int32))),   # out of range
    ("cache_batch_idx", dict(cache_batch_idx=np.array([-1, 0], np.int32))),
    ("cache_batch_idx", dict(cache_batch_idx=np.array([0, 1, 2], np.int32))),
    ("cache_batch_idx", dict(cache_batch_idx=np.array([0.0, 1.0], np.float32))),
    ("cache_leftpad", dict(cache_leftpad=np.array([0, 6], np.int32))),       # > cache_seqlens
    ("cache_leftpad", dict(cache_leftpad=np.array([-1, 0], np.int32))),
    ("cache_leftpad", dict(cache_leftpad=np.array([0], np.int32))),
    ("rotary_cos", dict(rotary_cos="short", rotary_sin="short_sin")),       # too few positions
    ("rotary_cos", dict(rotary_cos="wide", rotary_sin="wide")),             # rotary_dim > d
    ("rotary_sin", dict(rotary_sin="shape")),
    ("rotary_cos", dict(rotary_cos="dtype", rotary_sin="dtype")),
    ("rotary_sin", dict(rotary_sin=None, rotary_cos="ok")),
    ("cache_seqlens", dict(cache_seqlens=np.array([5, 11], np.int32))),     # no room
]


@pytest.mark.parametrize("name,bad", REFUSALS, ids=[f"{n}-{i}" for i, (n, _) in
                                                     enumerate(REFUSALS)])
def test_refused_calls_leave_the_cache_bitwise_unchanged(name, bad):
    q, kc, vc, kn, vn, cos, sin, extra = _base()
    kw = dict(cache_seqlens=np.array([5, 3], np.int32), rotary_cos=cos, rotary_sin=sin,
              cache_leftpad=np.array([1, 0], np.int32), **extra)
    special = {"short": cos[:6], "short_sin": sin[:6], "wide": np.ones((4, 9), np.float32),
               "shape": sin[:, :3], "dtype": cos.astype(np.float64), "ok": cos}
    for k, v in bad.items():
        kw[k] = special[v] if isinstance(v, str) else v
    before = kc.copy(), vc.copy()
    with pytest.raises((ValueError, TypeError), match=f"^{name}: "):
        flashdl.attention_with_kvcache(q, kc, vc, k=kn, v=vn, causal=True, **kw)
    assert same_bits(kc, before[0]) and same_bits(vc, before[1])


def test_paged_refusals_leave_the_cache_unchanged():
    q, kc, vc, kn, vn, cos, sin, extra = _base(paged=True)
    before = kc.copy(), vc.copy()
    lens = np.array([3, 2], np.int32)
    cases = [("cache_batch_idx", dict(cache_batch_idx=np.array([0, 1], np.int32), **extra)),
             # both sequences append at position 3: row 3 of page 0 for both
             ("block_table", dict(block_table=np.array([[0, 1, 2], [0, 4, 5]], np.int32),
                                  cache_seqlens=np.array([3, 3], np.int32)))]
    for name, kw in cases:
        kw.setdefault("cache_seqlens", lens)
        with pytest.raises(ValueError, match=f"^{name}: "):
            flashdl.attention_with_kvcache(q, kc, vc, k=kn, v=vn, rotary_cos=cos,
                                           rotary_sin=sin, **kw)
        assert same_bits(kc, before[0]) and same_bits(vc, before[1])


def test_duplicate_batch_idx_without_append_is_valid_and_reads_the_same_row():
    q, kc, vc, kn, vn, cos, sin, extra = _base()
    lens = np.array([7, 7], np.int32)
    out = flashdl.attention_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                         cache_batch_idx=np.array([1, 1], np.int32))
    ref = flashdl.attention(q, kc[[1, 1], :7], vc[[1, 1], :7])
    assert np.allclose(out, ref, atol=1e-6)


def test_leftpad_equals_the_cache_without_its_pad_and_rotary_positions_stay_absolute():
    """Keys before cache_leftpad are invisible and causal counts from it: the same call on the
    cache shifted left by the pad agrees -- except rotary positions, which are absolute."""
    q, kc, vc, kn, vn, cos, sin, extra = _base()
    kc, vc = kc[:2].copy(), vc[:2].copy()
    kc[0, :3] = np.nan  # the pad: never read
    lens, pads = np.array([8, 5], np.int32), np.array([3, 0], np.int32)
    out = flashdl.attention_with_kvcache(q, kc.copy(), vc.copy(), cache_seqlens=lens,
                                         k=kn, v=vn, causal=True, cache_leftpad=pads)
    shifted_k = np.concatenate([kc[:1, 3:], np.zeros_like(kc[:1, :3])], 1)
    shifted_v = np.concatenate([vc[:1, 3:], np.zeros_like(vc[:1, :3])], 1)
    one = flashdl.attention_with_kvcache(q[:1], shifted_k, shifted_v,
                                         cache_seqlens=np.array([5], np.int32), k=kn[:1],
                                         v=vn[:1], causal=True)
    assert np.isfinite(out).all()
    assert np.allclose(out[:1], one, atol=1e-6)


def test_rotary_without_causal_puts_every_query_row_at_cache_seqlens():
    q, kc, vc, kn, vn, cos, sin, extra = _base()
    lens = np.array([4, 6], np.int32)
    a = flashdl.attention_with_kvcache(q, kc[:2].copy(), vc[:2].copy(), cache_seqlens=lens,
                                       rotary_cos=cos, rotary_sin=sin)
    # q rows rotated by hand at position cache_seqlens (both rows), then no rotary.
    qr = np.stack([rope(q[b], cos, sin, np.full(2, lens[b]), False, np.float32)
                   for b in range(2)]).astype(np.float32)
    b = flashdl.attention_with_kvcache(qr, kc[:2].copy(), vc[:2].copy(), cache_seqlens=lens)
    assert np.array_equal(a, b)


# --- paged varlen ------------------------------------------------------------------------------


def paged_pool(rng, lens, page_size, hk, d, dtype, spare=3):
    """A pool of pages holding each sequence's keys (pages shuffled, spare pages NaN) and the
    contiguous keys it holds."""
    per = [max(1, -(-n // page_size)) for n in lens]
    npages = sum(per) + spare
    order = rng.permutation(npages)
    table = np.full((len(lens), max(per)), npages + 5, np.int32)  # past the pages: never read
    kp = np.full((npages, page_size, hk, d), np.nan, np_dtype(dtype))
    vp = kp.copy()
    ks, vs, at = [], [], 0
    for b, n in enumerate(lens):
        pages = order[at:at + per[b]]
        at += per[b]
        table[b, :per[b]] = pages
        k, v = make(rng, (n, hk, d), dtype), make(rng, (n, hk, d), dtype)
        for j in range(n):
            kp[pages[j // page_size], j % page_size] = k[j]
            vp[pages[j // page_size], j % page_size] = v[j]
        ks.append(k)
        vs.append(v)
    return kp, vp, table, ks, vs


def cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


@settings(deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 40)), min_size=1, max_size=4),
       st.sampled_from([1, 2, 5, 16]), st.sampled_from(["float32", "float16", "bfloat16"]),
       st.booleans(), st.booleans(), st.integers(0, 2**16))
def test_paged_varlen_equals_contiguous_bitwise(shapes, page_size, dtype, causal, used, seed):
    rng = np.random.default_rng(seed)
    lens_q = [a for a, _ in shapes]
    lens_k = [b for _, b in shapes]
    kp, vp, table, ks, vs = paged_pool(rng, lens_k, page_size, 2, 16, dtype)
    q = make(rng, (sum(lens_q), 4, 16), dtype)
    seqused = [int(rng.integers(0, n + 1)) for n in lens_k] if used else lens_k
    kw = dict(seqused_k=np.array(seqused, np.int32)) if used else {}
    out, lse = flashdl.attention_varlen(q, kp, vp, cu(lens_q), cu(lens_k), max(lens_q),
                                        max(lens_k), causal=causal, block_table=table,
                                        return_lse=True, **kw)
    kc = np.concatenate([k[:n] for k, n in zip(ks, seqused)]).astype(np_dtype(dtype))
    vc = np.concatenate([v[:n] for v, n in zip(vs, seqused)]).astype(np_dtype(dtype))
    ref, ref_lse = flashdl.attention_varlen(q, kc.reshape(-1, 2, 16), vc.reshape(-1, 2, 16),
                                            cu(lens_q), cu(seqused), max(lens_q), max(lens_k),
                                            causal=causal, return_lse=True)
    assert same_bits(np.asarray(out), np.asarray(ref)) and same_bits(lse, ref_lse)
    # seqused_k on contiguous keys: the same again.
    if used:
        kk = np.concatenate(ks).astype(np_dtype(dtype)).reshape(-1, 2, 16)
        vv = np.concatenate(vs).astype(np_dtype(dtype)).reshape(-1, 2, 16)
        again = flashdl.attention_varlen(q, kk, vv, cu(lens_q), cu(lens_k), max(lens_q),
                                         max(lens_k), causal=causal, **kw)
        assert same_bits(np.asarray(again), np.asarray(ref))


def test_chunked_prefill_over_a_paged_pool_equals_the_contiguous_computation():
    """Two sequences prefilled in chunks: each chunk's rows against every key written so far,
    through the page table, bitwise equal to the same chunk on contiguous keys, and within
    rounding of one causal call over the whole sequence."""
    rng = np.random.default_rng(3)
    P, hk, h, d = 8, 2, 4, 32
    lens = [37, 20]
    npages = 12
    kp = np.full((npages, P, hk, d), np.nan, np.float32)
    vp = kp.copy()
    table = np.array([[5, 0, 9, 2, 7], [1, 11, 3, 8, 8]], np.int32)
    ks = [make(rng, (n, hk, d)) for n in lens]
    vs = [make(rng, (n, hk, d)) for n in lens]
    qs = [make(rng, (n, h, d)) for n in lens]
    done = [0, 0]
    outs = [[], []]
    while done != lens:
        step = [min(n - x, int(rng.integers(1, 13))) for n, x in zip(lens, done)]
        for b in range(2):  # write the chunk's keys into the pool
            for j in range(done[b], done[b] + step[b]):
                kp[table[b, j // P], j % P] = ks[b][j]
                vp[table[b, j // P], j % P] = vs[b][j]
        q = np.concatenate([qs[b][done[b]:done[b] + step[b]] for b in range(2)])
        upto = [x + s for x, s in zip(done, step)]
        out = flashdl.attention_varlen(q, kp, vp, cu(step), cu(upto), max(step), max(upto),
                                       causal=True, block_table=table)
        kc = np.concatenate([ks[b][:upto[b]] for b in range(2)])
        vc = np.concatenate([vs[b][:upto[b]] for b in range(2)])
        ref = flashdl.attention_varlen(q, kc, vc, cu(step), cu(upto), max(step), max(upto),
                                       causal=True)
        assert same_bits(out, ref)
        at = cu(step)
        for b in range(2):
            outs[b].append(out[at[b]:at[b + 1]])
        done = upto
    for b in range(2):
        whole = flashdl.attention(qs[b][None], ks[b][None], vs[b][None], causal=True)[0]
        assert np.allclose(np.concatenate(outs[b]), whole, atol=2e-6)


def test_paged_varlen_refusals_name_the_argument():
    rng = np.random.default_rng(0)
    kp, vp, table, ks, vs = paged_pool(rng, [5, 3], 4, 2, 8, "float32")
    q = make(rng, (4, 2, 8))
    cq, ck = cu([2, 2]), cu([5, 3])
    call = lambda **kw: flashdl.attention_varlen(  # noqa: E731
        q, kw.pop("k", kp), kw.pop("v", vp), kw.pop("cu_k", cq), kw.pop("cu_kk", ck), 2, 5,
        **kw)
    cases = [
        ("block_table", dict(block_table=table[:1])),
        ("block_table", dict(block_table=np.where(table == table[0, 0], 99, table)
                             .astype(np.int32))),
        ("block_table", dict(block_table=table, cu_kk=cu([9, 3]))),
        ("seqused_k", dict(block_table=table, seqused_k=np.array([6, 0], np.int32))),
        ("seqused_k", dict(block_table=table, seqused_k=np.array([1], np.int32))),
        ("k", dict(block_table=table, k=kp[0])),
        ("v", dict(block_table=table, v=vp[:, :2])),
        ("cu_seqlens_k", dict(block_table=table, cu_kk=np.array([1, 5, 8], np.int32))),
        ("layout", dict(block_table=table, layout="htd")),
    ]
    for name, kw in cases:
        with pytest.raises((ValueError, TypeError), match=f"^{name}: "):
            call(**kw)


def test_torch_and_drop_in_paged_varlen_forward_only():
    rng = np.random.default_rng(1)
    kp, vp, table, ks, vs = paged_pool(rng, [9, 4], 4, 1, 16, "float32")
    q = torch.from_numpy(make(rng, (7, 2, 16))).requires_grad_()
    cq, ck = torch.tensor(cu([3, 4])), torch.tensor(cu([9, 4]))
    tk, tv, tt = torch.from_numpy(kp), torch.from_numpy(vp), torch.from_numpy(table)
    out = flash_attn.flash_attn_varlen_func(q, tk, tv, cq, ck, 4, 9, causal=True,
                                            block_table=tt)
    ref = flashdl.torch.attention_varlen(
        q.detach(), torch.from_numpy(np.concatenate(ks)), torch.from_numpy(np.concatenate(vs)),
        cq, ck, 4, 9, causal=True)
    assert torch.equal(out.detach(), ref)
    with pytest.raises(NotImplementedError, match="^block_table: "):
        out.sum().backward()
    used = flashdl.torch.attention_varlen(q.detach(), tk, tv, cq, ck, 4, 9, causal=True,
                                          block_table=tt, seqused_k=torch.tensor([9, 2],
                                                                                 dtype=torch.int32))
    assert used.shape == q.shape and not used.requires_grad


def test_drop_in_with_kvcache_rotary_batch_idx_leftpad():
    """flash-attn's defaults (rotary_interleaved=True) through the drop-in: equal to flashdl's
    own call with the same arguments, the torch cache written in place."""
    torch.manual_seed(0)
    q = torch.randn(2, 1, 4, 16)
    kc, vc = torch.randn(3, 10, 2, 16), torch.randn(3, 10, 2, 16)
    k, v = torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    ang = torch.rand(10, 4)
    cos, sin = ang.cos(), ang.sin()
    lens = torch.tensor([4, 6], dtype=torch.int32)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    pads = torch.tensor([1, 0], dtype=torch.int32)
    kc2, vc2 = kc.clone(), vc.clone()
    out = flash_attn.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin,
                                             cache_seqlens=lens, cache_batch_idx=idx,
                                             cache_leftpad=pads, causal=True)
    ref = flashdl.attention_with_kvcache(q.numpy(), kc2.numpy(), vc2.numpy(),
                                         cache_seqlens=lens.numpy(), k=k.numpy(), v=v.numpy(),
                                         rotary_cos=cos.numpy(), rotary_sin=sin.numpy(),
                                         rotary_interleaved=True, cache_batch_idx=idx.numpy(),
                                         cache_leftpad=pads.numpy(), causal=True)
    assert np.array_equal(out.numpy(), ref)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert not torch.equal(kc[2, 4], k[0, 0])  # rotated before it was written
    assert torch.equal(kc[2, 4, :, 8:], k[0, 0, :, 8:])  # past rotary_dim: as given


@pytest.mark.parametrize("chunk", ["8", "3"])
def test_continuous_batching_example_matches_full_recompute(chunk):
    """examples/continuous_batching.py: requests arriving and leaving over one paged pool,
    chunked prefill then decoding with fused rotary, give the tokens of full recomputation (the
    example exits 1 otherwise)."""
    import pathlib
    import subprocess
    import sys

    example = (pathlib.Path(__file__).resolve().parents[2] / "examples" /
               "continuous_batching.py")
    got = subprocess.run([sys.executable, str(example), "--chunk", chunk], capture_output=True,
                         text=True, timeout=120)
    assert got.returncode == 0, got.stdout + got.stderr
    assert got.stdout.rstrip().endswith("OK") and "MISMATCH" not in got.stdout
