"""Compiled programs on a GPU: flashdl.jax's CUDA handlers (XLA FFI custom calls on XLA's stream)
under jax.jit, grad and vmap, and flashdl.torch's custom ops under torch.compile on CUDA tensors.
Against the float64 oracle with flash-attn's rule, and against the same call made eagerly.
Skipped unless flashdl sees a CUDA device (and, per test, jax has a GPU backend or torch.cuda is
usable)."""

from __future__ import annotations

import numpy as np
import pytest

import flashdl
from attn_oracle import assert_lse, assert_rule, backward, forward

if flashdl.info()["cuda_device_count"] == 0:
    pytest.skip("no CUDA device: " + flashdl.info()["cuda_status"], allow_module_level=True)


def _jax_gpu():
    jax = pytest.importorskip("jax")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        pytest.skip("jax has no GPU backend")
    return jax, gpus[0]


def _inputs(shapes, dtype, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_jax_jit_forward_and_grad_on_gpu(dtype, causal):
    jax, gpu = _jax_gpu()
    import jax.numpy as jnp

    import flashdl.jax as fj

    host = _inputs([(2, 70, 4, 64), (2, 90, 2, 64), (2, 90, 2, 64), (2, 70, 4, 64)], dtype, 1)
    q, k, v, w = (jax.device_put(jnp.asarray(x, dtype), gpu) for x in host)
    exact = [np.asarray(x, np.float64) for x in (q, k, v, w)]

    out, lse = jax.jit(lambda q, k, v: fj.attention(q, k, v, causal=causal,
                                                     return_lse=True))(q, k, v)
    assert out.devices() == {gpu} and out.dtype == q.dtype
    o_ref, lse_ref = forward(*exact[:3], causal=causal)
    o_low, _ = forward(*exact[:3], causal=causal, dtype=dtype, exact=False)
    assert_rule(np.asarray(out, np.float64), o_ref, o_low, dtype)
    assert_lse(np.asarray(lse), lse_ref, rtol=1e-3, atol=1e-3)

    def loss(q, k, v):
        return (fj.attention(q, k, v, causal=causal).astype(jnp.float32) * w).sum()
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    oracle = backward(exact[3], *exact[:3], causal=causal)
    low = backward(exact[3], *exact[:3], causal=causal, dtype=dtype, exact=False)
    for name, g, o, n in zip(("dq", "dk", "dv"), grads, oracle, low):
        assert_rule(np.asarray(g, np.float64), o, n, dtype, what=name, grad=True)

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
    assert 'custom_call_target="flashdl_attention_bwd"' in text
    assert "callback" not in text.lower()


def test_jax_vmap_and_varlen_on_gpu():
    jax, gpu = _jax_gpu()
    import jax.numpy as jnp

    import flashdl.jax as fj

    q, k, v = (jax.device_put(jnp.asarray(x, jnp.bfloat16), gpu)
               for x in _inputs([(3, 2, 40, 2, 64), (3, 2, 50, 2, 64), (3, 2, 50, 2, 64)],
                                "bfloat16", 2))
    mapped = jax.jit(jax.vmap(lambda q, k, v: fj.attention(q, k, v)))(q, k, v)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(mapped[i]), np.asarray(fj.attention(q[i], k[i],
                                                                                     v[i])))
    lengths = [17, 0, 40]
    cu = jax.device_put(jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32), gpu)
    pq = jnp.concatenate([q[0, 0, :n] for n in lengths])
    out = jax.jit(lambda q, c: fj.attention_varlen(q, q, q, c, c, 40, 40, causal=True))(pq, cu)
    start = 0
    for n in lengths:
        if n:
            alone = fj.attention(pq[None, start:start + n], pq[None, start:start + n],
                                 pq[None, start:start + n], causal=True)[0]
            np.testing.assert_array_equal(np.asarray(out[start:start + n]), np.asarray(alone))
        start += n


def test_torch_compile_on_cuda_tensors():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch.cuda is not usable")
    import flashdl.torch as ft

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 64, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g)
               .requires_grad_() for _ in range(3))

    def f(q, k, v):
        return ft.attention(q, k, v, causal=True, deterministic=True)
    eager = f(q, k, v)
    eager_grads = torch.autograd.grad(eager.float().sum(), (q, k, v))
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    compiled_grads = torch.autograd.grad(compiled.float().sum(), (q, k, v))
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    for a, b in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
