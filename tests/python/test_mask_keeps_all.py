"""A boolean mask that hides nothing is no mask: with an all-True `mask` (any broadcast shape,
a stride-0 view, the torch and varlen entry points, the KV cache) every CPU schedule and dtype
gives plain attention bit for bit -- out, lse and the gradients -- over whole key tiles and the
decode shapes the KV-cache kernel takes; with a bias as well, the bias alone. A tile whose mask
keeps every score is a plain tile."""

import numpy as np
import pytest

import flashdl
from attn_oracle import make, make_qkv

SCHEDULES = ["auto", "fa1", "fa2", "reference"]


def same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and np.array_equal(a.astype(np.float64), b.astype(np.float64))


def forward_backward(q, k, v, dout, **kw):
    out, lse = flashdl.attention(q, k, v, return_lse=True, **kw)
    grads = flashdl.attention_backward(dout, q, k, v, out, lse, **kw)
    return (out, lse) + tuple(grads[:3])


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
@pytest.mark.parametrize("shape", [(2, 97, 256, 4, 2, 64), (1, 64, 192, 2, 2, 32),
                                   (1, 1, 600, 4, 2, 64)],
                         ids=["whole-tiles", "square", "decode"])
def test_all_true_mask_is_plain_attention_bitwise(schedule, dtype, shape):
    b, sq, sk, h, hk, d = shape
    rng = np.random.default_rng(52)
    q, k, v = make_qkv(rng, b, sq, sk, h, hk, d, dtype)
    dout = make(rng, q.shape, dtype)
    plain = forward_backward(q, k, v, dout, schedule=schedule, causal=sq > 1)
    for mask in (np.ones((b, h, sq, sk), bool), np.ones((1, 1, 1, sk), bool),
                 np.broadcast_to(np.ones(sk, bool), (b, h, sq, sk))):
        got = forward_backward(q, k, v, dout, schedule=schedule, causal=sq > 1, mask=mask)
        for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), got, plain):
            assert same(x, y), (name, mask.shape, np.abs(np.float64(x) - np.float64(y)).max())


def test_all_true_mask_with_a_bias_is_the_bias_alone_bitwise():
    rng = np.random.default_rng(5)
    q, k, v = make_qkv(rng, 1, 80, 256, 4, 2, 32)
    dout = make(rng, q.shape)
    bias = rng.standard_normal((1, 4, 80, 256)).astype(np.float32)
    alone = forward_backward(q, k, v, dout, bias=bias)
    got = forward_backward(q, k, v, dout, bias=bias, mask=np.ones((1, 1, 80, 256), bool))
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), got, alone):
        assert same(x, y), name


def test_all_true_mask_varlen_kvcache_and_torch():
    """The other entry points reach the same kernels with the same rule."""
    rng = np.random.default_rng(6)
    q, k, v = make_qkv(rng, 1, 40, 300, 4, 2, 64)
    cu_q, cu_k = np.array([0, 15, 40], np.int32), np.array([0, 140, 300], np.int32)
    qp, kp, vp = q[0], k[0], v[0]
    plain = flashdl.attention_varlen(qp, kp, vp, cu_q, cu_k, 25, 160, causal=True,
                                     return_lse=True)
    got = flashdl.attention_varlen(qp, kp, vp, cu_q, cu_k, 25, 160, causal=True, return_lse=True,
                                   mask=np.ones((4, 40, 160), bool))
    assert all(same(x, y) for x, y in zip(got, plain))

    k_cache, v_cache = k.reshape(2, 150, 2, 64), v.reshape(2, 150, 2, 64)
    lens = np.array([120, 149], np.int32)
    qd = q[:, :2].reshape(2, 1, 4, 64)
    plain = flashdl.attention_with_kvcache(qd, k_cache, v_cache, cache_seqlens=lens,
                                           return_lse=True)
    got = flashdl.attention_with_kvcache(qd, k_cache, v_cache, cache_seqlens=lens,
                                         return_lse=True, mask=np.ones((2, 4, 1, 150), bool))
    assert all(same(x, y) for x, y in zip(got, plain))

    torch = pytest.importorskip("torch")
    import flashdl.torch as ft

    leaves = [torch.from_numpy(x).requires_grad_() for x in (q, k, v)]
    ref = ft.attention(*leaves, causal=True)
    ref.sum().backward()
    want = [ref.detach()] + [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    out = ft.attention(*leaves, causal=True, mask=torch.ones(1, 1, 40, 300, dtype=torch.bool))
    out.sum().backward()
    got = [out.detach()] + [x.grad for x in leaves]
    assert all(torch.equal(x, y) for x, y in zip(got, want))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_mask_that_hides_something_still_hides_it(dtype):
    """The shortcut is taken only when nothing is hidden: one False element (the last of the
    array, read last) hides that key from that row. The fa2 forward's tiles where the mask keeps
    every score are plain tiles: head 0, whose mask keeps everything, is bitwise plain."""
    rng = np.random.default_rng(7)
    q, k, v = make_qkv(rng, 1, 33, 257, 2, 2, 16, dtype)
    mask = np.ones((1, 2, 33, 257), bool)
    mask[0, 1, 32, 256] = False
    out, lse = flashdl.attention(q, k, v, mask=mask, return_lse=True, schedule="fa2")
    row, row_lse = flashdl.attention(q[:, 32:], k[:, :256], v[:, :256], return_lse=True)
    tol = 1e-6 if dtype == "float32" else 1e-2
    assert np.allclose(np.float64(out[0, 32, 1]), np.float64(row[0, 0, 1]), atol=tol)
    assert np.allclose(lse[0, 1, 32], row_lse[0, 1, 0], atol=1e-5)
    plain, plain_lse = flashdl.attention(q, k, v, return_lse=True, schedule="fa2")
    assert same(out[0, :, 0], plain[0, :, 0]) and same(lse[0, 0], plain_lse[0, 0])
