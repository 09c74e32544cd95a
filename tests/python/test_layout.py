"""layout= on every entry point: heads-first arrays ((batch, nheads, seqlen, headdim), 'bhsd';
(nheads, total, headdim), 'htd', for packed batches) give exactly the results of the same data
in flashdl's own order, returned in the caller's layout, for NumPy, bfloat16 NumPy, PyTorch and
JAX, eager and traced; bad layouts and ranks name the argument; shapes that only fit the other
layout say so and name layout=; the caller's arrays are not written (except the KV cache, which
is appended through the view)."""

import numpy as np
import pytest

import flashdl
from attn_oracle import make, np_dtype


def bhsd_inputs(dtype="float32", b=2, h=4, hk=2, sq=33, sk=40, d=16, seed=0):
    rng = np.random.default_rng(seed)
    return (make(rng, (b, h, sq, d), dtype), make(rng, (b, hk, sk, d), dtype),
            make(rng, (b, hk, sk, d), dtype))


def to_bshd(*xs):
    return [x.swapaxes(1, 2) for x in xs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("schedule", ["fa1", "fa2"])
@pytest.mark.parametrize("causal", [False, True])
def test_bhsd_equals_bshd_forward_and_backward(dtype, schedule, causal):
    q, k, v = bhsd_inputs(dtype)
    before = [x.copy() for x in (q, k, v)]
    opts = dict(schedule=schedule, causal=causal, window_size=(9, -1))
    out, lse = flashdl.attention(q, k, v, layout="bhsd", return_lse=True, **opts)
    ref, ref_lse = flashdl.attention(*to_bshd(q, k, v), return_lse=True, **opts)
    assert out.shape == q.shape and out.dtype == np_dtype(dtype) and out.flags["C_CONTIGUOUS"]
    assert np.array_equal(out, ref.swapaxes(1, 2)) and np.array_equal(lse, ref_lse)

    dout = make(np.random.default_rng(5), out.shape, dtype)
    grads = flashdl.attention_backward(dout, q, k, v, out, lse, layout="bhsd", **opts)
    ref_grads = flashdl.attention_backward(*to_bshd(dout, q, k, v), ref, ref_lse, **opts)
    for g, r, x in zip(grads, ref_grads, (q, k, v)):
        assert g.shape == x.shape and g.flags["C_CONTIGUOUS"]
        assert np.array_equal(g, r.swapaxes(1, 2))
    assert all(np.array_equal(a, b) for a, b in zip((q, k, v), before))


def test_bhsd_with_torch_and_jax():
    q, k, v = bhsd_inputs()
    ref = flashdl.attention(q, k, v, layout="bhsd", causal=True)
    torch = pytest.importorskip("torch")
    got = flashdl.attention(*(torch.from_numpy(x) for x in (q, k, v)), layout="bhsd", causal=True)
    assert isinstance(got, torch.Tensor) and torch.equal(got, torch.from_numpy(ref))
    jnp = pytest.importorskip("jax.numpy")
    got = flashdl.attention(*(jnp.asarray(x) for x in (q, k, v)), layout="bhsd", causal=True)
    assert np.array_equal(np.asarray(got), ref)


def test_bad_layout_and_rank_name_the_argument():
    q, k, v = bhsd_inputs()
    with pytest.raises(ValueError, match="layout: expected 'bshd'.*got 'bsdh'"):
        flashdl.attention(q, k, v, layout="bsdh")
    with pytest.raises(ValueError, match=r"q: with layout='bhsd' expected a rank-4"):
        flashdl.attention(q[0], k, v, layout="bhsd")
    # The core's own messages say which order their shapes are in.
    with pytest.raises(ValueError, match=r"k: headdim 8 .*layout='bhsd'"):
        flashdl.attention(q, k[..., :8], v, layout="bhsd")
    out, lse = flashdl.attention(q, k, v, layout="bhsd", return_lse=True)
    with pytest.raises(ValueError, match="layout"):
        flashdl.attention_backward(out, q, k, v, out, lse, layout="BHSD")


def packed_inputs(seed=1, total=29, h=4, hk=2, d=16):
    rng = np.random.default_rng(seed)
    cu = np.array([0, 5, 5, 17, total])  # int64, as NumPy makes it: narrowed to int32
    return (make(rng, (total, h, d), "float32"), make(rng, (total, hk, d), "float32"),
            make(rng, (total, hk, d), "float32"), cu)


def test_htd_equals_thd_varlen_forward_and_backward():
    q, k, v, cu = packed_inputs()
    qh, kh, vh = (x.swapaxes(0, 1).copy() for x in (q, k, v))
    opts = dict(causal=True, return_lse=True)
    out, lse = flashdl.attention_varlen(qh, kh, vh, cu, cu, 12, 12, layout="htd", **opts)
    ref, ref_lse = flashdl.attention_varlen(q, k, v, cu, cu, 12, 12, **opts)
    assert out.shape == qh.shape and out.flags["C_CONTIGUOUS"]
    assert np.array_equal(out, ref.swapaxes(0, 1)) and np.array_equal(lse, ref_lse)
    dout = make(np.random.default_rng(2), out.shape, "float32")
    grads = flashdl.attention_varlen_backward(dout, qh, kh, vh, out, lse, cu, cu, 12, 12,
                                              causal=True, layout="htd")
    ref_grads = flashdl.attention_varlen_backward(dout.swapaxes(0, 1), q, k, v, ref, ref_lse,
                                                  cu, cu, 12, 12, causal=True)
    for g, r in zip(grads, ref_grads):
        assert np.array_equal(g, r.swapaxes(0, 1))
    with pytest.raises(ValueError, match="layout: expected 'thd'.*got 'bhsd'"):
        flashdl.attention_varlen(q, k, v, cu, cu, 12, 12, layout="bhsd")


def test_int64_index_arrays_equal_int32():
    q, k, v, cu = packed_inputs()
    assert cu.dtype == np.int64
    got = flashdl.attention_varlen(q, k, v, cu, cu, 12, 12)
    assert np.array_equal(got, flashdl.attention_varlen(q, k, v, cu.astype(np.int32),
                                                        cu.astype(np.int32), 12, 12))
    with pytest.raises(ValueError, match=r"cu_seqlens_k: expected int32 values, got 4294967325"):
        flashdl.attention_varlen(q, k, v, cu, cu + 2**32, 12, 12)


@pytest.mark.parametrize("paged", [False, True])
def test_bhsd_kvcache_equals_bshd(paged):
    rng = np.random.default_rng(3)
    b, h, hk, d, s_cache, page = 2, 4, 2, 16, 24, 8
    lens = np.array([7, 13])  # int64
    q = make(rng, (b, h, 2, d), "float32")
    k_new, v_new = (make(rng, (b, hk, 2, d), "float32") for _ in range(2))
    if paged:
        table = np.array([[2, 0, 5], [1, 4, 3]])
        k_cache, v_cache = (make(rng, (6, hk, page, d), "float32") for _ in range(2))
    else:
        table = None
        k_cache, v_cache = (make(rng, (b, hk, s_cache, d), "float32") for _ in range(2))
    own = [x.swapaxes(1, 2).copy() for x in (q, k_cache, v_cache, k_new, v_new)]
    out = flashdl.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, k=k_new,
                                         v=v_new, block_table=table, causal=True, layout="bhsd")
    ref = flashdl.attention_with_kvcache(own[0], own[1], own[2], cache_seqlens=lens, k=own[3],
                                         v=own[4], block_table=table, causal=True)
    assert out.shape == q.shape and np.array_equal(out, ref.swapaxes(1, 2))
    # The caches were appended through the transposed views, as in flashdl's own layout.
    assert np.array_equal(k_cache, own[1].swapaxes(1, 2))
    assert np.array_equal(v_cache, own[2].swapaxes(1, 2))


def test_shapes_that_fit_the_other_layout_name_it():
    q, k, v = bhsd_inputs()  # (batch, nheads, seqlen, headdim) with seqlen_q != seqlen_k
    with pytest.raises(ValueError, match=r"do not fit layout='bshd'.*pass layout='bhsd'"):
        flashdl.attention(q, k, v)
    with pytest.raises(ValueError, match=r"do not fit layout='bhsd'.*pass layout='bshd'"):
        flashdl.attention(*to_bshd(q, k, v), layout="bhsd")
    qp, kp, vp, cu = packed_inputs()
    kp, vp = (np.concatenate([x, x[:2]]) for x in (kp, vp))  # total_k 31
    cu_k = np.array([0, 5, 5, 17, 31])
    with pytest.raises(ValueError, match=r"pass layout='htd'"):
        flashdl.attention_varlen(*(x.swapaxes(0, 1) for x in (qp, kp, vp)), cu, cu_k, 12, 14)
    with pytest.raises(ValueError, match=r"k_cache, v_cache of shapes.*pass layout='bhsd'"):
        flashdl.attention_with_kvcache(q[:, :, :1], k, v, cache_seqlens=np.array([3, 4]))
    # Shapes that fit neither layout get the core's message alone.
    with pytest.raises(ValueError) as err:
        flashdl.attention(q, k[..., :8], v[..., :8])
    assert "layout" not in str(err.value)


def test_layout_in_torch_and_jax_front_ends():
    q, k, v = bhsd_inputs()
    ref = flashdl.attention(q, k, v, layout="bhsd", causal=True)
    torch = pytest.importorskip("torch")
    import flashdl.torch as ft
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    got = ft.attention(tq, tk, tv, layout="bhsd", causal=True)
    assert got.shape == tq.shape and torch.equal(got.detach(), torch.from_numpy(ref))
    got.sum().backward()
    _, lse = flashdl.attention(q, k, v, layout="bhsd", causal=True, return_lse=True)
    ref_dq, _, _ = flashdl.attention_backward(np.ones_like(ref), q, k, v, ref, lse, causal=True,
                                              layout="bhsd")
    assert torch.equal(tq.grad, torch.from_numpy(ref_dq))
    with pytest.raises(ValueError, match=r"pass layout='bhsd'"):
        ft.attention(*(x.detach() for x in (tq, tk, tv)))
    with pytest.raises(ValueError, match=r"pass layout='bshd'"):
        ft.attention(*(x.detach().transpose(1, 2) for x in (tq, tk, tv)), layout="bhsd")
    qp, kp, vp, cu = packed_inputs()
    got = ft.attention_varlen(*(torch.from_numpy(x.swapaxes(0, 1)) for x in (qp, kp, vp)),
                              torch.from_numpy(cu), torch.from_numpy(cu), 12, 12, layout="htd")
    assert np.array_equal(got.numpy(),
                          flashdl.attention_varlen(qp, kp, vp, cu, cu, 12, 12).swapaxes(0, 1))
    jax = pytest.importorskip("jax")
    import flashdl.jax as fj
    got = jax.jit(lambda q, k, v: fj.attention(q, k, v, layout="bhsd", causal=True))(q, k, v)
    assert np.array_equal(np.asarray(got), ref)
    with pytest.raises(ValueError, match=r"pass layout='bhsd'"):
        jax.jit(fj.attention)(q, k, v)
    got = fj.attention_varlen(*(x.swapaxes(0, 1) for x in (qp, kp, vp)), cu, cu, 12, 12,
                              layout="htd")
    assert np.array_equal(np.asarray(got),
                          flashdl.attention_varlen(qp, kp, vp, cu, cu, 12, 12).swapaxes(0, 1))



def test_bhsd_merge_states_equals_bshd():
    q, k, v = bhsd_inputs()
    parts = [flashdl.attention(q, k[:, :, i:i + 20], v[:, :, i:i + 20], return_lse=True,
                               layout="bhsd") for i in (0, 20)]
    out, lse = flashdl.merge_states(*parts[0], *parts[1], layout="bhsd")
    own = [(o.swapaxes(1, 2), l) for o, l in parts]
    ref, ref_lse = flashdl.merge_states_list([o for o, _ in own], [l for _, l in own])
    assert out.shape == q.shape and np.array_equal(out, ref.swapaxes(1, 2))
    assert np.array_equal(lse, ref_lse)
