"""flashdl.jax.flax_attention as Flax's attention_fn (linen MultiHeadDotProductAttention, nnx
MultiHeadAttention): the module switches by that one argument and gives Flax's own outputs and
parameter gradients; dropout through flashdl's Philox seeded from the rng Flax passes. Skipped
without flax."""

import os
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
import jax.numpy as jnp  # noqa: E402
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import flashdl.jax as fj  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rand(shape, seed=0, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def assert_trees_close(a, b, tol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert np.abs(x - y).max() <= tol * max(1.0, np.abs(y).max()), np.abs(x - y).max()


def test_linen_switches_by_attention_fn_alone():
    x = rand((2, 12, 32))
    lengths = jnp.array([12, 7])
    valid = jnp.arange(12)[None] < lengths[:, None]
    mask = nn.combine_masks(nn.make_causal_mask(jnp.ones((2, 12))),
                            nn.make_attention_mask(valid, valid))  # the padded rows see nothing
    bias = rand((1, 4, 12, 12), 1)

    def model(fn):
        return nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=32, attention_fn=fn)
    params = model(nn.dot_product_attention).init(jax.random.key(0), x)

    def loss(params, fn):
        def attn(*a, **kw):  # the same bias handed to either attention_fn
            return fn(*a, bias=bias, **kw)
        return (model(attn).apply(params, x, mask=mask) ** 2).sum()
    want = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, nn.dot_product_attention)
    got = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, fj.flax_attention)
    assert_trees_close(got, want, 2e-5)


def test_nnx_gqa_causal_matches_flax_and_grads():
    x = rand((2, 16, 32))

    def make(**kw):
        return nnx.MultiHeadAttention(num_heads=4, in_features=32, num_kv_heads=2, decode=False,
                                      rngs=nnx.Rngs(0), **kw)
    ours, theirs = make(attention_fn=fj.flax_attention), make()

    def loss(m):
        return (m(x, is_causal=True) ** 2).sum()
    got, want = nnx.value_and_grad(loss)(ours), nnx.value_and_grad(loss)(theirs)
    assert_trees_close(nnx.state(got[1]), nnx.state(want[1]), 2e-5)
    assert abs(float(got[0]) - float(want[0])) <= 2e-5 * abs(float(want[0]))


def test_several_batch_axes_and_a_float_mask():
    q, k, v = (rand((2, 3, 9, 4, 8), s) for s in range(3))
    mask = (rand((3, 1, 9, 9), 5) > 0).astype(jnp.float32)  # broadcast over the first batch axis
    got = fj.flax_attention(q, k, v, mask=mask)
    want = nn.dot_product_attention(q, k, v, mask=mask)
    assert got.shape == want.shape
    assert_trees_close(got, want, 2e-6)


def test_dropout_is_flashdls_philox_seeded_from_the_rng():
    q, k, v = (rand((2, 10, 4, 8), s) for s in range(3))
    key = jax.random.key(7)
    f = jax.jit(lambda q, r: fj.flax_attention(q, k, v, dropout_rng=r, dropout_rate=0.3,
                                               is_causal=True))
    got = f(q, key)
    want = fj.attention(q, k, v, causal=True, dropout_p=0.3,
                        seed=jax.random.bits(key, (2,), jnp.uint32))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.array_equal(np.asarray(f(q, jax.random.key(8))), np.asarray(got))
    plain = fj.flax_attention(q, k, v, dropout_rng=key, dropout_rate=0.3, deterministic=True,
                              is_causal=True)
    np.testing.assert_array_equal(np.asarray(plain),
                                  np.asarray(fj.attention(q, k, v, causal=True)))
    with pytest.raises(ValueError, match="dropout_rng"):
        fj.flax_attention(q, k, v, dropout_rate=0.3)


def test_nnx_module_with_dropout_trains_on_its_rngs():
    x = rand((2, 8, 16))
    m = nnx.MultiHeadAttention(num_heads=2, in_features=16, dropout_rate=0.5, decode=False,
                               attention_fn=fj.flax_attention, rngs=nnx.Rngs(0, dropout=1))
    a, b = m(x, deterministic=False), m(x, deterministic=False)  # the rng stream moves on
    assert not np.array_equal(np.asarray(a), np.asarray(b))
    det = m(x, deterministic=True)
    ref = nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False, rngs=nnx.Rngs(0))
    assert_trees_close(det, ref(x), 2e-5)


def test_sowing_weights_is_refused():
    x = rand((1, 4, 8))
    m = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=fj.flax_attention)
    params = m.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="module"):
        m.apply(params, x, sow_weights=True, mutable=["intermediates"])


def test_nnx_transformer_example_matches_xla_losses():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "flax_nnx_transformer.py"),
                          "--steps", "4"], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "losses match" in run.stdout
