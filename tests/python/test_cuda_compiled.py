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


def _torch_view(x):
    """A JAX GPU array as a torch CUDA tensor over the same memory (DLPack): the eager calls that
    the jit results are checked against take it, since flashdl's eager calls take JAX arrays on
    the CPU only. Same kernels, same device: bitwise the same results."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch.cuda is not usable")
    return torch.from_dlpack(x.block_until_ready())


def _host(x):
    """A JAX array or a torch tensor as float32 NumPy (exact for float16 and bfloat16)."""
    if hasattr(x, "detach"):
        return x.detach().float().cpu().numpy()
    return np.asarray(x, np.float32)


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


def test_jax_eager_calls_on_gpu():
    """flashdl.jax outside jax.jit on GPU arrays: JAX dispatches the same custom call eagerly,
    compiled once per configuration and cached, bitwise the jitted call's results (forward,
    gradients, dot_product_attention), on the arrays' GPU."""
    jax, gpu = _jax_gpu()
    import jax.numpy as jnp

    import flashdl.jax as fj

    host = _inputs([(2, 70, 4, 64), (2, 90, 2, 64), (2, 90, 2, 64), (2, 70, 4, 64)], "float16", 7)
    q, k, v, w = (jax.device_put(jnp.asarray(x, jnp.float16), gpu) for x in host)
    compiles = []

    def listen(key, _duration, **_kw):
        if key.endswith("backend_compile_duration"):
            compiles.append(key)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        counts, outs = [], []
        for _ in range(3):
            del compiles[:]
            outs.append(jax.block_until_ready(fj.attention(q, k, v, causal=True,
                                                           softmax_scale=0.123)))
            counts.append(len(compiles))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert counts[0] > 0 and counts[1:] == [0, 0], counts
    jitted = jax.jit(lambda q, k, v: fj.attention(q, k, v, causal=True, softmax_scale=0.123))
    for out in outs:
        assert out.devices() == {gpu}
        np.testing.assert_array_equal(np.asarray(out), np.asarray(jitted(q, k, v)))

    def loss(q, k, v):
        return (fj.attention(q, k, v, causal=True).astype(jnp.float32) * w).sum()
    eager = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(eager, compiled):
        assert a.devices() == {gpu}
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # (2, 4, 70, 90): a bias per (batch, head, query), broadcast over the keys
    bias = jax.device_put(jnp.asarray(host[3][..., :1].transpose(0, 2, 1, 3).repeat(90, -1),
                                      jnp.float16), gpu)
    dpa = fj.dot_product_attention(q, k, v, bias, is_causal=True)
    dpa_jit = jax.jit(lambda q, k, v, b: fj.dot_product_attention(q, k, v, b, is_causal=True))
    assert dpa.devices() == {gpu}
    np.testing.assert_array_equal(np.asarray(dpa), np.asarray(dpa_jit(q, k, v, bias)))


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


def test_jax_dropout_traced_seed_on_gpu():
    """The handler copies the traced seed to the host on XLA's stream: the jit call's output and
    gradients are bitwise those of the eager call (same kernels) with the same int seed."""
    jax, gpu = _jax_gpu()
    import jax.numpy as jnp

    import flashdl.jax as fj

    q, k, v, dout = (jax.device_put(jnp.asarray(x, jnp.bfloat16), gpu)
                     for x in _inputs([(2, 33, 4, 64), (2, 47, 2, 64), (2, 47, 2, 64),
                                       (2, 33, 4, 64)], "bfloat16", 5))
    seed = 0x1234_5678_9ABC
    words = jax.device_put(jnp.array([seed & 0xFFFFFFFF, seed >> 32], jnp.uint32), gpu)
    opts = dict(causal=True, dropout_p=0.2, offset=3)
    out, lse = jax.jit(lambda q, k, v, s: fj.attention(q, k, v, seed=s, return_lse=True,
                                                        **opts))(q, k, v, words)
    tq, tk, tv, tdout = (_torch_view(x) for x in (q, k, v, dout))
    e_out, e_lse = flashdl.attention(tq, tk, tv, seed=seed, return_lse=True, **opts)
    np.testing.assert_array_equal(_host(out), _host(e_out))
    np.testing.assert_array_equal(_host(lse), _host(e_lse))
    other = jax.jit(lambda q, k, v, s: fj.attention(q, k, v, seed=s, **opts))(q, k, v,
                                                                              words + 1)
    assert not np.array_equal(_host(other), _host(e_out))

    def loss(q, k, v, s):
        return (fj.attention(q, k, v, seed=s, **opts).astype(jnp.float32) *
                dout.astype(jnp.float32)).sum()
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, words)
    expect = flashdl.attention_backward(tdout, tq, tk, tv, e_out, e_lse, seed=seed, **opts)
    for g, e in zip(grads, expect):
        np.testing.assert_array_equal(_host(g), _host(e))


@pytest.mark.parametrize("paged", [False, True])
def test_jax_kvcache_tables_on_gpu(paged):
    """cache_seqlens, block_table, cache_batch_idx and cache_leftpad are device arrays under jit;
    the handler copies them to the host on XLA's stream. Read-only: bitwise the eager call (host
    tables). Append: the new rows land at cache_seqlens onward, the rest of the cache unchanged."""
    jax, gpu = _jax_gpu()
    import jax.numpy as jnp

    import flashdl.jax as fj

    b, s, hk, h, d, new = 3, 64, 2, 4, 64, 2
    kc, vc = _inputs([(4 if not paged else b, s, hk, d)] * 2, "float16", 6)
    q, kn, vn = _inputs([(b, new, h, d), (b, new, hk, d), (b, new, hk, d)], "float16", 7)
    n = np.array([5, 40, 0], np.int32)
    cos, sin = (x.astype(np.float16) for x in _inputs([(s + new, 16)] * 2, "float16", 8))
    kw = dict(causal=True, cache_leftpad=np.array([2, 0, 0], np.int32))
    kw.update(rotary_cos=cos, rotary_sin=sin)
    table = None
    if paged:  # pages of 16 rows, in reverse order
        pages = b * s // 16
        table = (pages - 1 - np.arange(pages)).reshape(b, s // 16).astype(np.int32)
        kc, vc = (x.reshape(pages, 16, hk, d)[::-1].copy() for x in (kc, vc))
    else:
        kw.update(cache_batch_idx=np.array([3, 0, 1], np.int32))
    dev = lambda x: None if x is None else jax.device_put(  # noqa: E731
        jnp.asarray(x, jnp.float16 if x.dtype.kind == "f" else x.dtype), gpu)
    gq, gkc, gvc, gkn, gvn = (dev(x) for x in (q, kc, vc, kn, vn))
    dkw = {key: (dev(val) if isinstance(val, np.ndarray) else val) for key, val in kw.items()}
    arrays_kw = {key: val for key, val in dkw.items() if not isinstance(val, bool)}
    f = jax.jit(lambda q, kc, vc, n, t, a: fj.attention_with_kvcache(
        q, kc, vc, cache_seqlens=n, block_table=t, causal=True, **a))
    got = f(gq, gkc, gvc, dev(n), dev(table), arrays_kw)
    host_kw = {key: val for key, val in kw.items() if key.startswith("cache_")}
    eager = flashdl.attention_with_kvcache(
        *(_torch_view(x) for x in (gq, gkc, gvc)), cache_seqlens=n, block_table=table,
        causal=True, rotary_cos=_torch_view(dkw["rotary_cos"]),
        rotary_sin=_torch_view(dkw["rotary_sin"]), **host_kw)
    np.testing.assert_array_equal(_host(got), _host(eager))
    # the append (without rotary: the new rows land as given)
    plain = jax.jit(lambda q, kc, vc, n, k, v, t: fj.attention_with_kvcache(
        q, kc, vc, cache_seqlens=n, k=k, v=v, block_table=t, causal=True))
    rows = slice(None) if paged else slice(0, b)  # contiguous: one cache row per sequence
    out, new_k, _ = plain(gq, gkc[rows], gvc[rows], dev(n), gkn, gvn, dev(table))
    new_k = np.asarray(new_k)
    if paged:
        new_k = new_k[::-1].reshape(b, s, hk, d)
    for i in range(b):
        np.testing.assert_array_equal(new_k[i, n[i]:n[i] + new], kn[i].astype(np.float16))
    assert np.isfinite(np.asarray(out, np.float32)).all()
