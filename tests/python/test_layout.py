"""layout='bhsd' on flashdl.attention and attention_backward: (batch, nheads, seqlen, headdim)
arrays give exactly the results of the same data passed as (batch, seqlen, nheads, headdim),
returned in the caller's layout (contiguous), for NumPy, bfloat16 NumPy, PyTorch and JAX; bad
layouts and ranks name the argument; the caller's arrays are not written."""

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
