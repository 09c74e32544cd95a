"""JAX (CPU): results are jax arrays on the same device and match the oracle."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import flashdl  # noqa: E402
from attn_oracle import assert_lse, assert_rule, backward, forward, fwd_ulps  # noqa: E402


def arrays(shapes, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s), dtype=dtype) for s in shapes]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
def test_forward(dtype, causal):
    q, k, v = arrays([(2, 11, 4, 16), (2, 7, 2, 16), (2, 7, 2, 16)], dtype)
    out, lse = flashdl.attention(q, k, v, causal=causal, return_lse=True)
    assert isinstance(out, jax.Array) and isinstance(lse, jax.Array)
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    assert out.devices() == q.devices()
    as_np = [np.asarray(x, np.float64) for x in (q, k, v)]
    o_ref, lse_ref = forward(*as_np, causal=causal)
    o_low, _ = forward(*as_np, causal=causal, dtype=dtype, exact=False)
    assert_rule(np.asarray(out, np.float64), o_ref, o_low, dtype, ulps=fwd_ulps(dtype, q, k))
    assert_lse(np.asarray(lse), lse_ref)


def test_backward():
    q, k, v, dout = arrays([(1, 6, 2, 8), (1, 9, 1, 8), (1, 9, 1, 8), (1, 6, 2, 8)], "float32")
    out, lse = flashdl.attention(q, k, v, causal=True, return_lse=True)
    grads = flashdl.attention_backward(dout, q, k, v, out, lse, causal=True)
    expect = backward(*(np.asarray(x, np.float64) for x in (dout, q, k, v)), causal=True)
    for g, e in zip(grads, expect):
        assert isinstance(g, jax.Array)
        np.testing.assert_allclose(np.asarray(g), e, rtol=1e-4, atol=1e-5)


def test_jit_and_mixing_are_refused():
    q, k, v = arrays([(1, 4, 1, 8)] * 3, "float32")
    with pytest.raises(TypeError, match=r"\bq\b.*tracer"):
        jax.jit(lambda a: flashdl.attention(a, a, a))(q)
    with pytest.raises(ValueError, match=r"\bv\b"):
        flashdl.attention(q, k, np.asarray(v))
