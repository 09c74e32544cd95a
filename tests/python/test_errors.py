"""Bad input raises ValueError/TypeError naming the argument, never writes into an input; empty
problems are valid."""

import re

import numpy as np
import pytest

import flashdl
from attn_oracle import make, make_qkv

RNG = np.random.default_rng(21)
Q, K, V = make_qkv(RNG, 2, 5, 7, 4, 2, 8)
DOUT = make(RNG, Q.shape)
OUT, LSE = flashdl.attention(Q, K, V, return_lse=True)


def strided_last(x):
    """x with the same shape but a last-dimension stride of 2."""
    big = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
    big[..., ::2] = x
    return big[..., ::2]


def expect(exc, arg, fn, *args, **kw):
    """fn(*args, **kw) raises exc whose message names arg; no array argument changes."""
    before = [np.array(a, copy=True) if isinstance(a, np.ndarray) else None for a in args]
    with pytest.raises(exc) as info:
        fn(*args, **kw)
    assert re.search(rf"\b{arg}\b", str(info.value)), f"message does not name {arg}: {info.value}"
    for a, b in zip(args, before):
        if b is not None:
            np.testing.assert_array_equal(a, b)
    return info.value


FORWARD_CASES = {
    "q rank 3": (ValueError, "q", (Q[0], K, V), {}),
    "q rank 5": (ValueError, "q", (Q[None], K, V), {}),
    "k rank 3": (ValueError, "k", (Q, K[0], V), {}),
    "v shape": (ValueError, "v", (Q, K, V[:, :6]), {}),
    "k batch": (ValueError, "k", (Q, K[:1], V[:1]), {}),
    "k headdim": (ValueError, "k", (Q, K[..., :4], V), {}),
    "v headdim": (ValueError, "v", (Q, K, V[..., :4]), {}),
    "k dtype": (TypeError, "k", (Q, K.astype(np.float64), V), {}),
    "v dtype": (TypeError, "v", (Q, K, V.astype(np.float16)), {}),
    "q int32": (TypeError, "q", (Q.astype(np.int32), K.astype(np.int32), V.astype(np.int32)), {}),
    "q int64": (TypeError, "q", (Q.astype(np.int64), K, V), {}),
    "k uint16": (TypeError, "k", (Q, K.view(np.uint16), V), {}),
    "q complex": (TypeError, "q", (Q.astype(np.complex64), K, V), {}),
    "q last dim strided": (ValueError, "q", (strided_last(Q), K, V), {}),
    "v last dim strided": (ValueError, "v", (Q, K, strided_last(V)), {}),
    "headdim 0": (ValueError, "q", (Q[..., :0], K[..., :0], V[..., :0]), {}),
    "headdim 257": (ValueError, "q", tuple(make(RNG, x.shape[:3] + (257,)) for x in (Q, K, V)), {}),
    "nheads % nheads_kv": (ValueError, "k", (Q[:, :, :3], K, V), {}),
    "schedule name": (ValueError, "schedule", (Q, K, V), {"schedule": "fa3"}),
    "schedule type": (TypeError, "schedule", (Q, K, V), {"schedule": 2}),
    "window type": (TypeError, "window_size", (Q, K, V), {"window_size": 3}),
    "window value": (ValueError, "window_size", (Q, K, V), {"window_size": (-2, 0)}),
    "softmax_scale inf": (ValueError, "softmax_scale", (Q, K, V), {"softmax_scale": np.inf}),
    "softmax_scale nan": (ValueError, "softmax_scale", (Q, K, V), {"softmax_scale": np.nan}),
    "softmax_scale str": (TypeError, "softmax_scale", (Q, K, V), {"softmax_scale": "x"}),
    "q list": (TypeError, "q", (Q.tolist(), K, V), {}),
    "k None": (TypeError, "k", (Q, None, V), {}),
    "v scalar": (TypeError, "v", (Q, K, 1.0), {}),
}


@pytest.mark.parametrize("case", FORWARD_CASES)
def test_forward_errors(case):
    exc, arg, args, kw = FORWARD_CASES[case]
    expect(exc, arg, flashdl.attention, *args, **kw)


BACKWARD_CASES = {
    "lse shape": (ValueError, "lse", (DOUT, Q, K, V, OUT, LSE[:, :, :4]), {}),
    "lse rank": (ValueError, "lse", (DOUT, Q, K, V, OUT, LSE[0]), {}),
    "lse dtype": (TypeError, "lse", (DOUT, Q, K, V, OUT, LSE.astype(np.float64)), {}),
    "dout shape": (ValueError, "dout", (DOUT[:, :4], Q, K, V, OUT, LSE), {}),
    "dout dtype": (TypeError, "dout", (DOUT.astype(np.float64), Q, K, V, OUT, LSE), {}),
    "dout last dim strided": (ValueError, "dout", (strided_last(DOUT), Q, K, V, OUT, LSE), {}),
    "out shape": (ValueError, "out", (DOUT, Q, K, V, OUT[:, :, :2], LSE), {}),
    "k rank": (ValueError, "k", (DOUT, Q, K[0], V, OUT, LSE), {}),
    "schedule name": (ValueError, "schedule", (DOUT, Q, K, V, OUT, LSE), {"schedule": "x"}),
    "dout list": (TypeError, "dout", (DOUT.tolist(), Q, K, V, OUT, LSE), {}),
    "lse None": (TypeError, "lse", (DOUT, Q, K, V, OUT, None), {}),
}


@pytest.mark.parametrize("case", BACKWARD_CASES)
def test_backward_errors(case):
    exc, arg, args, kw = BACKWARD_CASES[case]
    expect(exc, arg, flashdl.attention_backward, *args, **kw)


def test_read_only_inputs_are_accepted_and_untouched():
    q, k, v = (x.copy() for x in (Q, K, V))
    for x in (q, k, v):
        x.setflags(write=False)
    out, lse = flashdl.attention(q, k, v, return_lse=True)
    np.testing.assert_array_equal(out, OUT)
    out.setflags(write=False)
    lse.setflags(write=False)
    dq, dk, dv = flashdl.attention_backward(DOUT, q, k, v, out, lse)
    for x, y in zip((q, k, v), (Q, K, V)):
        np.testing.assert_array_equal(x, y)


def test_inputs_unchanged_after_successful_calls():
    args = [x.copy() for x in (DOUT, Q, K, V)]
    out, lse = flashdl.attention(*args[1:], causal=True, return_lse=True)
    saved = [x.copy() for x in (*args, out, lse)]
    flashdl.attention_backward(*args, out, lse, causal=True)
    for x, y in zip((*args, out, lse), saved):
        np.testing.assert_array_equal(x, y)


def test_mixed_frameworks():
    torch = pytest.importorskip("torch")
    expect(ValueError, "k", flashdl.attention, Q, torch.from_numpy(K), V)
    expect(ValueError, "v", flashdl.attention, torch.from_numpy(Q), torch.from_numpy(K), V)
    expect(ValueError, "lse", flashdl.attention_backward, *(torch.from_numpy(x) for x in (
        DOUT, Q, K, V, OUT)), LSE)


def test_tensors_requiring_grad():
    """The NumPy-level API would silently cut the graph: refused, pointing to flashdl.torch; under
    torch.no_grad (as inside flashdl.torch's own autograd Function) the same call runs."""
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(x) for x in (Q, K, V))
    err = expect(ValueError, "k", flashdl.attention, q, k.requires_grad_(), v)
    assert str(err).startswith("k: ") and "flashdl.torch.attention" in str(err)
    with torch.no_grad():
        flashdl.attention(q, k, v)
    cu_q, cu_k = (torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32))
    err = expect(ValueError, "q", flashdl.attention_varlen, q[0].requires_grad_(), k[0], v[0],
                 cu_q, cu_k, 5, 7)
    assert "flashdl.torch.attention_varlen" in str(err)


@pytest.mark.parametrize("schedule", ["fa1", "fa2", "reference"])
@pytest.mark.parametrize("b,sq,sk,h,hk", [(0, 5, 7, 4, 2), (2, 0, 7, 4, 2), (2, 5, 0, 4, 2),
                                         (2, 0, 0, 4, 2), (1, 3, 4, 0, 0)])
def test_empty_problems(schedule, b, sq, sk, h, hk):
    rng = np.random.default_rng(22)
    q, k, v = make_qkv(rng, b, sq, sk, h, hk, 8)
    out, lse = flashdl.attention(q, k, v, schedule=schedule, return_lse=True)
    assert out.shape == q.shape and lse.shape == (b, h, sq)
    if sk == 0:  # no key at all: out 0, lse -inf
        assert np.all(out == 0) and np.all(np.isneginf(lse))
    dout = make(rng, q.shape)
    dq, dk, dv = flashdl.attention_backward(dout, q, k, v, out, lse, schedule=schedule)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert np.all(dq == 0) if sk == 0 else True
    assert np.all(dk == 0) and np.all(dv == 0) if sq == 0 else True
