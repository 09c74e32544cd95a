"""flashdl.attention_with_kvcache, paged flashdl.attention_varlen and flashdl.merge_states on torch
CUDA tensors.

- The decode kernel against the float64 oracle by flash-attn's rule (test_kvcache's Case and
  oracle: caches whose unused rows, pages and block_table entries are poison), contiguous and
  paged caches (paged bitwise equal to contiguous: the same keys in the same order), GQA/MQA,
  groups beyond one CTA's 16 rows, causal and windows, ALiBi and softcap, empty sequences, strided
  cache layouts, num_splits 1, chosen and several; the call is bitwise repeatable.
- The append on the device: the caches' underlying memory after the call equals, bitwise, what
  the CPU backend writes into copies of them (old rows, the new ones, poison elsewhere).
- Step-by-step decoding reads back every key appended on the device.
- A call no CUDA kernel serves (head dim 40, float32, a device with too little shared memory)
  raises before it writes anything.
- merge_states on CUDA arrays of every dtype equals the CPU's merge of copies (to a rounding),
  with chained launches (more than 8 parts) and partials with lse -inf holding NaN.
- Paged varlen (chunked prefill, block_table and seqused_k): bitwise the contiguous call on the
  keys used, close to the CPU's paged call, sensitive to the page mapping; the drop-in too.
Skipped unless flashdl sees a CUDA device and torch.cuda is usable."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import flashdl
from attn_oracle import EPS, assert_lse, assert_rule, make, np_dtype
from cuda_arrays import gpu_frameworks
from test_kvcache import Case, oracle_batch, oracle_of, same_bits, ulps_for

torch, _ = gpu_frameworks(need_torch=True)

DTYPES = ["float16", "bfloat16"]


def seed_of(*key):
    return zlib.crc32(repr(key).encode())


def to_cuda(x):
    """A NumPy array on the GPU, bit for bit (bfloat16 through its 16-bit pattern)."""
    x = np.ascontiguousarray(x)
    if x.dtype == np_dtype("bfloat16"):
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda()
    return torch.from_numpy(x).cuda()


def to_host(t, dtype):
    """A CUDA tensor back as a NumPy array of `dtype`, bit for bit."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).cpu().numpy().view(np_dtype("bfloat16"))
    return t.cpu().numpy().astype(np_dtype(dtype), copy=False)


def view_like(base, layout, d):
    """test_kvcache.view_of on a torch tensor: the 4-d cache view flashdl gets of its base."""
    if layout == "bshd":
        return base
    if layout == "bhsd":
        return base.permute(0, 2, 1, 3)
    return base[..., :d]


def run_cuda(case, paged, **opts):
    """The call on CUDA copies of the case's arrays (taken before any CPU call writes them):
    out, lse and the caches' bases afterwards, on the host."""
    kb = to_cuda(case.kp_base if paged else case.kc_base)
    vb = to_cuda(case.vp_base if paged else case.vc_base)
    slopes = opts.get("alibi_slopes")
    if slopes is not None:
        opts = dict(opts, alibi_slopes=torch.from_numpy(slopes).cuda())
    new = {} if case.k is None else dict(k=to_cuda(case.k), v=to_cuda(case.v))
    out, lse = flashdl.attention_with_kvcache(
        to_cuda(case.q), view_like(kb, case.layout, case.d), view_like(vb, case.layout, case.d),
        cache_seqlens=case.lens, block_table=case.block_table if paged else None,
        return_lse=True, **new, **opts)
    torch.cuda.synchronize()
    return (to_host(out, case.dtype), lse.cpu().numpy(), to_host(kb, case.dtype),
            to_host(vb, case.dtype))


# (batch, lens, seqlen_q, seqlen_new, h, hk, d, page_size, max_pages, layout, opts)
CONFIGS = {
    "decode-mha": (3, [1, 200, 0], 1, 1, 4, 4, 64, 16, 13, "bshd", dict(num_splits=1)),
    "decode-gqa-splits": (2, [700, 90], 1, 1, 8, 2, 128, 64, 12, "bshd", dict(num_splits=0)),
    "spec-mqa-causal": (2, [300, 4], 4, 4, 8, 1, 128, 32, 10, "padded",
                        dict(causal=True, num_splits=3)),
    "window-bhsd": (2, [500, 60], 3, 2, 4, 2, 96, 7, 72, "bhsd",
                    dict(causal=True, window_size=(40, 0), num_splits=0)),
    "empty-rows": (2, [3, 0], 9, 0, 2, 1, 32, 16, 1, "bshd", dict(causal=True)),
    "mods": (2, [250, 33], 2, 1, 4, 2, 128, 16, 17, "bshd",
             dict(causal=True, softcap=3.0, alibi="bh", num_splits=4)),
    "alibi-d256": (1, [130], 1, 1, 4, 4, 256, 64, 3, "padded", dict(alibi="h")),
    "d192-two-sided": (1, [90], 5, 0, 6, 2, 192, 16, 6, "bshd", dict(window_size=(16, 8))),
}


def make_case(name, dtype):
    batch, lens, sq, new, h, hk, d, ps, pages, layout, extra = CONFIGS[name]
    rng = np.random.default_rng(seed_of(name, dtype))
    case = Case(rng, batch=batch, lens=lens, seqlen_q=sq, seqlen_new=new, h=h, hk=hk, d=d,
                dtype=dtype, page_size=ps, max_pages=pages, spare_pages=2, layout=layout)
    opts = dict(causal=False, window_size=(-1, -1), softmax_scale=None)
    opts.update({k: v for k, v in extra.items() if k != "alibi"})
    if extra.get("alibi") == "h":
        opts["alibi_slopes"] = rng.uniform(0.0, 1.0, size=h).astype(np.float32)
    elif extra.get("alibi") == "bh":
        opts["alibi_slopes"] = rng.uniform(0.0, 1.0, size=(batch, h)).astype(np.float32)
    return case, opts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_oracle_and_appends_like_the_cpu(name, dtype):
    case, opts = make_case(name, dtype)
    out_c, lse_c, kc, vc = run_cuda(case, paged=False, **opts)
    out_p, lse_p, kp, vp = run_cuda(case, paged=True, **opts)
    assert same_bits(out_c, out_p), "paged != contiguous (out)"
    assert same_bits(lse_c, lse_p), "paged != contiguous (lse)"
    o_ref, lse_ref, o_low = oracle_of(case, opts)
    assert_rule(out_c, o_ref, o_low, dtype, ulps=ulps_for(dtype, case.keys, case.d))
    assert_lse(lse_c, lse_ref)
    # The CPU backend on the host arrays writes the caches the device must have written.
    case.run_contiguous(**opts)
    case.run_paged(**opts)
    for what, got, cpu in (("k_cache", kc, case.kc_base), ("v_cache", vc, case.vc_base),
                           ("paged k_cache", kp, case.kp_base),
                           ("paged v_cache", vp, case.vp_base)):
        assert same_bits(got, cpu), f"{what} after the append on the device"
    assert same_bits(kc, case.kc_want) and same_bits(kp, case.kp_want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_num_splits_agree_and_repeat_bitwise(dtype):
    case, opts = make_case("decode-gqa-splits", dtype)
    case.seqlen_new, case.k, case.v = 0, None, None  # read only: every call sees the same cache
    case.keys = [k[:n] for k, n in zip(case.keys, case.lens)]
    case.values = [v[:n] for v, n in zip(case.values, case.lens)]
    o_ref, lse_ref, o_low = oracle_of(case, opts)
    for splits in (1, 2, 0, 11, 1000):
        out, lse, _, _ = run_cuda(case, paged=True, **dict(opts, num_splits=splits))
        assert_rule(out, o_ref, o_low, dtype)
        assert_lse(lse, lse_ref)
        again = run_cuda(case, paged=True, **dict(opts, num_splits=splits))
        assert same_bits(out, again[0]) and same_bits(lse, again[1]), f"num_splits={splits}"


def test_decode_steps_on_the_device():
    """One query and one new key per step, the cache on the GPU throughout: step t attends to
    every key appended before it (the oracle over the keys so far)."""
    rng = np.random.default_rng(8)
    batch, h, hk, d, ps, steps, dtype = 2, 8, 2, 64, 16, 40, "float16"
    start = np.array([3, 17], np.int32)
    pages = -(-(int(start.max()) + steps) // ps)
    table = rng.permutation(batch * pages).astype(np.int32).reshape(batch, pages)
    kp = torch.full((batch * pages, ps, hk, d), float("nan"), device="cuda",
                    dtype=torch.float16)
    vp = torch.full_like(kp, float("nan"))
    keys = [make(rng, (int(n), hk, d), dtype) for n in start]
    values = [make(rng, (int(n), hk, d), dtype) for n in start]
    for b, n in enumerate(start):
        for j in range(int(n)):
            kp[table[b, j // ps], j % ps] = to_cuda(keys[b][j])
            vp[table[b, j // ps], j % ps] = to_cuda(values[b][j])
    lens = start.copy()
    for _ in range(steps):
        q = make(rng, (batch, 1, h, d), dtype)
        k, v = make(rng, (batch, 1, hk, d), dtype), make(rng, (batch, 1, hk, d), dtype)
        out, lse = flashdl.attention_with_kvcache(
            to_cuda(q), kp, vp, cache_seqlens=lens, k=to_cuda(k), v=to_cuda(v),
            block_table=table, causal=True, return_lse=True)
        keys = [np.concatenate([keys[b], k[b]]) for b in range(batch)]
        values = [np.concatenate([values[b], v[b]]) for b in range(batch)]
        o_ref, lse_ref, o_low = oracle_batch(q, keys, values, dtype, causal=True)
        assert_rule(to_host(out, dtype), o_ref, o_low, dtype)
        assert_lse(lse.cpu().numpy(), lse_ref)
        lens = lens + 1


UNSERVED = {  # (dtype, head dim, FLASHDL_CUDA_SMEM_LIMIT, exception, message)
    "headdim 40": ("float16", 40, None, ValueError, "got 40"),
    "float32": ("float32", 64, None, TypeError, "got float32"),
    # The decode kernel's plan refuses the device before the append kernel runs.
    "16 KiB of shared memory": ("float16", 128, "16384", RuntimeError, "shared memory"),
}


@pytest.mark.parametrize("what", sorted(UNSERVED))
def test_unserved_call_writes_nothing(what, monkeypatch):
    dtype, d, smem, exc, match = UNSERVED[what]
    if smem is not None:  # read by the launchers at every call
        monkeypatch.setenv("FLASHDL_CUDA_SMEM_LIMIT", smem)
    rng = np.random.default_rng(9)
    case = Case(rng, batch=2, lens=[5, 9], seqlen_q=1, seqlen_new=1, h=4, hk=2, d=d, dtype=dtype,
                page_size=16, max_pages=2, spare_pages=0, layout="bshd")
    kb, vb = to_cuda(case.kc_base), to_cuda(case.vc_base)
    with pytest.raises(exc, match=match):
        flashdl.attention_with_kvcache(to_cuda(case.q), kb, vb, cache_seqlens=case.lens,
                                       k=to_cuda(case.k), v=to_cuda(case.v))
    torch.cuda.synchronize()
    assert same_bits(to_host(kb, dtype), case.kc_base) and same_bits(to_host(vb, dtype),
                                                                     case.vc_base)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("parts", [1, 3, 10])
def test_merge_states_on_cuda_equals_the_cpu(dtype, parts):
    rng = np.random.default_rng(seed_of("merge", dtype, parts))
    b, s, h, d = 2, 3, 4, 72
    outs = [make(rng, (b, s, h, d), dtype) for _ in range(parts)]
    lses = [rng.uniform(-4, 4, size=(b, h, s)).astype(np.float32) for _ in range(parts)]
    for o, x in zip(outs, lses):  # a partial that saw no key holds anything and weighs nothing
        x[:, 0, 1] = -np.inf
        o[:, 1, 0] = np.nan
    lses[0][1, 2, :] = -np.inf
    out_cpu, lse_cpu = flashdl.merge_states_list(outs, lses)
    out, lse = flashdl.merge_states_list([to_cuda(o) for o in outs], [to_cuda(x) for x in lses])
    torch.cuda.synchronize()
    assert out.is_cuda and lse.is_cuda
    got, got_lse = to_host(out, dtype), lse.cpu().numpy()
    assert not np.isnan(np.asarray(got, np.float64)).any()
    mag = max(1.0, float(np.max(np.abs(np.asarray(out_cpu, np.float64)))))
    # The CPU merges in float64, the GPU in float32 (float64 for float64): one rounding apart.
    tol = {"float64": 1e-12, "float32": 1e-6}.get(dtype, EPS[dtype]) * mag
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(out_cpu, np.float64),
                               rtol=0, atol=tol)
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(lse_cpu))
    fin = np.isfinite(lse_cpu)
    np.testing.assert_allclose(got_lse[fin], lse_cpu[fin], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("paged", [False, True])
def test_rotary_batch_idx_leftpad_on_the_device_equal_the_cpu(dtype, paged):
    """Rotary (fused), cache_batch_idx and cache_leftpad on CUDA tensors: the caches after the
    call bitwise equal to what the CPU backend writes into copies, out within rounding."""
    rng = np.random.default_rng(seed_of("serving", dtype, paged))
    b, sq, h, hk, d, cap, rd = 2, 2, 8, 2, 128, 64, 64
    q = make(rng, (b, sq, h, d), dtype)
    kn, vn = make(rng, (b, 2, hk, d), dtype), make(rng, (b, 2, hk, d), dtype)
    ang = rng.random((cap, rd // 2)) * 6.28
    cos, sin = np.cos(ang).astype(np_dtype(dtype)), np.sin(ang).astype(np_dtype(dtype))
    lens, pads = np.array([20, 41], np.int32), np.array([3, 0], np.int32)
    if paged:
        kc, vc = make(rng, (9, 16, hk, d), dtype), make(rng, (9, 16, hk, d), dtype)
        extra = dict(block_table=np.array([[4, 0, 7, 2], [1, 8, 3, 5]], np.int32))
    else:
        kc, vc = make(rng, (3, cap, hk, d), dtype), make(rng, (3, cap, hk, d), dtype)
        extra = dict(cache_batch_idx=np.array([2, 0], np.int32))
    kw = dict(cache_seqlens=lens, cache_leftpad=pads, causal=True, return_lse=True, **extra)
    kc_h, vc_h = kc.copy(), vc.copy()
    out_h, lse_h = flashdl.attention_with_kvcache(q, kc_h, vc_h, k=kn, v=vn, rotary_cos=cos,
                                                  rotary_sin=sin, **kw)
    kc_d, vc_d = to_cuda(kc), to_cuda(vc)
    out_d, lse_d = flashdl.attention_with_kvcache(
        to_cuda(q), kc_d, vc_d, k=to_cuda(kn), v=to_cuda(vn), rotary_cos=to_cuda(cos),
        rotary_sin=to_cuda(sin), **kw)
    torch.cuda.synchronize()
    assert same_bits(to_host(kc_d, dtype), kc_h) and same_bits(to_host(vc_d, dtype), vc_h)
    err = np.abs(to_host(out_d, dtype).astype(np.float64) - out_h.astype(np.float64)).max()
    assert err <= (4e-3 if dtype == "float16" else 3e-2)
    assert np.allclose(lse_d.cpu().numpy(), lse_h, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_varlen_on_the_device_equals_contiguous_and_the_cpu(dtype):
    """Chunked prefill over a paged pool on CUDA tensors (pages shuffled, spare pages and unused
    rows NaN, table entries past the used pages no page's id; block_table, seqused_k and the
    offsets host arrays): out and lse bitwise those of the contiguous CUDA call on the keys each
    sequence uses, close to the CPU backend's paged call; a page swap between two sequences
    changes out; the drop-in, with every index tensor on the GPU, gives the same bits."""
    import flashdl.flash_attn as fa
    from test_kvcache_serving import cu, paged_pool

    rng = np.random.default_rng(seed_of("paged varlen", dtype))
    lens_k, lens_q, used = [70, 9, 33, 0], [20, 0, 33, 2], [70, 5, 33, 0]
    h, hk, d, ps = 4, 2, 64, 16
    kp, vp, table, ks, vs = paged_pool(rng, lens_k, ps, hk, d, dtype)
    q = make(rng, (sum(lens_q), h, d), dtype)
    cq, ck, seqused = cu(lens_q), cu(lens_k), np.array(used, np.int32)
    max_q, max_k = max(lens_q), max(lens_k)
    kw = dict(causal=True, return_lse=True)
    qd, kpd, vpd = to_cuda(q), to_cuda(kp), to_cuda(vp)

    def paged(tab):
        return flashdl.attention_varlen(qd, kpd, vpd, cq, ck, max_q, max_k, block_table=tab,
                                        seqused_k=seqused, **kw)

    out_d, lse_d = paged(table)
    kc = np.concatenate([k[:u] for k, u in zip(ks, used)])
    vc = np.concatenate([v[:u] for v, u in zip(vs, used)])
    out_c, lse_c = flashdl.attention_varlen(qd, to_cuda(kc), to_cuda(vc), cq, cu(used), max_q,
                                            max_k, **kw)
    torch.cuda.synchronize()
    got = to_host(out_d, dtype)
    assert same_bits(got, to_host(out_c, dtype))
    assert np.array_equal(lse_d.cpu().numpy(), lse_c.cpu().numpy())

    out_h, lse_h = flashdl.attention_varlen(q, kp, vp, cq, ck, max_q, max_k, block_table=table,
                                            seqused_k=seqused, **kw)
    err = np.abs(got.astype(np.float64) - out_h.astype(np.float64)).max()
    assert err <= (4e-3 if dtype == "float16" else 3e-2)
    assert np.array_equal(np.isneginf(lse_d.cpu().numpy()), np.isneginf(lse_h))
    fin = np.isfinite(lse_h)
    np.testing.assert_allclose(lse_d.cpu().numpy()[fin], lse_h[fin], atol=1e-3)

    swapped = table.copy()
    swapped[0, 0], swapped[2, 0] = table[2, 0], table[0, 0]
    out_s, _ = paged(swapped)
    torch.cuda.synchronize()
    assert not same_bits(to_host(out_s, dtype), got)

    gpu = lambda x: torch.from_numpy(x).cuda()  # noqa: E731
    out_f = fa.flash_attn_varlen_func(qd, kpd, vpd, gpu(cq), gpu(ck), max_q, max_k, causal=True,
                                      block_table=gpu(table), seqused_k=gpu(seqused))
    torch.cuda.synchronize()
    assert same_bits(to_host(out_f, dtype), got)
