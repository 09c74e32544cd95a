"""flashdl.jax.dot_product_attention under jax.jit with q, k, v sharded over batch and/or heads on
4 CPU host devices: each device computes its shard (no all-gather, and no collective at all
except the all-reduce that sums dBias over a sharded batch), and the results are the unsharded
call's. Runs this file as a script in a subprocess whose XLA_FLAGS make the 4 devices (the flag
counts only before jax initialises its backends)."""

import os
import re
import subprocess
import sys

import pytest

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def test_sharded_calls_compute_their_shards():
    pytest.importorskip("jax")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        " --xla_force_host_platform_device_count=4").strip()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert proc.stdout.count("ok ") == 3, proc.stdout


def collectives(fn, *args):
    text = fn.lower(*args).compile().as_text()
    return sorted({c for c in COLLECTIVES if re.search(rf"\b{c}(-start)?\(", text)})


def main():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import flashdl.jax as fj

    assert len(jax.devices()) == 4
    rng = np.random.default_rng(0)
    q, dout = (jnp.asarray(rng.standard_normal((4, 12, 8, 16)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((4, 20, 4, 16)), jnp.float32) for _ in range(2))
    bias = jnp.asarray(rng.standard_normal((1, 8, 12, 20)), jnp.float32)
    mask = jnp.asarray(rng.random((4, 1, 12, 20)) < 0.8)
    kw = dict(is_causal=True, local_window_size=(9, 3),
              query_seq_lengths=jnp.array([12, 5, 9, 0], jnp.int32),
              key_value_seq_lengths=jnp.array([20, 7, 0, 13], jnp.int32))

    def out(q, k, v, b):
        return fj.dot_product_attention(q, k, v, b, mask, **kw)

    def loss(q, k, v, b, d):
        return (out(q, k, v, b) * d).sum()
    grad_qkv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    grad_all = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    want = [jax.jit(out)(q, k, v, bias), *grad_all(q, k, v, bias, dout)]
    meshes = {"batch": (((4,), ("data",)), P("data")),
              "heads": (((4,), ("model",)), P(None, None, "model")),
              "batch+heads": (((2, 2), ("data", "model")), P("data", None, "model"))}
    for name, ((shape, axes), spec) in meshes.items():
        mesh = Mesh(np.array(jax.devices()).reshape(shape), axes)
        sh = NamedSharding(mesh, spec)
        qs, ks, vs, ds = (jax.device_put(x, sh) for x in (q, k, v, dout))
        fwd = jax.jit(out)
        assert collectives(fwd, qs, ks, vs, bias) == [], (name, collectives(fwd, qs, ks, vs, bias))
        assert collectives(grad_qkv, qs, ks, vs, bias, ds) == [], name
        assert "all-gather" not in collectives(grad_all, qs, ks, vs, bias, ds), name
        got = fwd(qs, ks, vs, bias)
        assert got.sharding.is_equivalent_to(sh, 4), name
        for g, w in zip([got, *grad_all(qs, ks, vs, bias, ds)], want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
        print("ok", name)


if __name__ == "__main__":
    main()
