"""Where the causal ring's time goes (issue 29, item 4): flashdl.jax.ring_attention (zigzag, W host
devices) against one device, and the ring's per-device plan replayed on one device as its kernel
calls and merges, so the excess splits into (a) the plan's kernel work (the same calls, one
device) and (b) what the ring adds on top (ppermutes, the row updates, XLA's dispatch over W
devices on shared cores), with the fixed cost of one tiny custom call for scale.

Run:  python benchmarks/ring_breakdown.py [--seqlen 8192] [--devices 4] [--rounds 5]
(its own process: sets XLA_FLAGS before jax is imported). Medians of rounds of 2 calls; float32,
batch 1, 8 heads, headdim 64. Each run's ratios are from that run only (a shared machine).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import time

ap = argparse.ArgumentParser()
ap.add_argument("--seqlen", type=int, default=8192)
ap.add_argument("--devices", type=int, default=4)
ap.add_argument("--rounds", type=int, default=5)
ARGS = ap.parse_args()
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={ARGS.devices}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import flashdl.jax as fj  # noqa: E402


def timed(f, *a, calls=2):
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(ARGS.rounds):
        t = time.perf_counter()
        for _ in range(calls):
            r = f(*a)
        jax.block_until_ready(r)
        ts.append((time.perf_counter() - t) / calls * 1e3)
    return statistics.median(ts)


def rand(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


S, W, H, D = ARGS.seqlen, ARGS.devices, 8, 64
sl, c = S // W, S // (2 * W)
print(f"load before: {os.getloadavg()}")
q, k, v = (rand((1, S, H, D), i) for i in range(3))
dev0 = jax.devices()[0]
one = jax.jit(lambda q, k, v: fj.attention(q, k, v, causal=True))
t_one = timed(one, *(jax.device_put(x, dev0) for x in (q, k, v)))

mesh = Mesh(np.array(jax.devices()[:W]), ("sp",))
spec = P(None, "sp")
ring = jax.jit(jax.shard_map(
    lambda q, k, v: fj.ring_attention(q, k, v, axis_name="sp", causal=True),
    mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
perm = [jax.device_put(fj.ring_permute(x, W), NamedSharding(mesh, spec)) for x in (q, k, v)]
text = ring.lower(*perm).compile().as_text()
n_attn = len(re.findall(r'custom_call_target="flashdl_attention_fwd"', text))
n_merge = len(re.findall(r'custom_call_target="flashdl_merge_states"', text))
t_ring = timed(ring, *perm)

# The per-device plan on one device: step 0 one causal call over the local 2c rows, steps
# 1..W-1 one unmasked call each, (2c rows x c keys) or (c rows x 2c keys), each merged into the
# (2c or c rows of the) accumulator.
ql, kl, vl = (jax.device_put(x[:, :sl], dev0) for x in (q, k, v))
diag = jax.jit(lambda q, k, v: fj.attention(q, k, v, causal=True, return_lse=True))
full_rows = jax.jit(lambda q, k, v: fj.attention(q, k[:, :c], v[:, :c], return_lse=True))
half_rows = jax.jit(lambda q, k, v: fj.attention(q[:, c:], k, v, return_lse=True))
t_diag, t_b1, t_b2 = timed(diag, ql, kl, vl), timed(full_rows, ql, kl, vl), \
    timed(half_rows, ql, kl, vl)
o2, l2 = diag(ql, kl, vl)
o1, l1 = half_rows(ql, kl, vl)
merge = jax.jit(lambda a, b, la, lb: fj.merge_states([a, b], [la, lb]))
t_m2, t_m1 = timed(merge, o2, o2, l2, l2), timed(merge, o1, o1, l1, l1)
per_dev = t_diag + t_m2 + (W - 1) * ((t_b1 + t_b2) / 2 + (t_m2 + t_m1) / 2)
tiny = jax.jit(lambda q: fj.attention(q, q, q))
t_tiny = timed(tiny, jax.device_put(rand((1, 16, H, D), 9), dev0), calls=20)
print(f"load after: {os.getloadavg()}")
print(f"seqlen {S}, causal, {W} host devices, chunk {c}")
print(f"one device fwd ms {t_one:.1f} | ring fwd ms {t_ring:.1f} | ratio {t_ring / t_one:.2f}")
print(f"ring HLO: {n_attn} flashdl_attention_fwd, {n_merge} flashdl_merge_states custom calls "
      f"(all devices' branches)")
print(f"plan calls on one device, ms: causal {sl}x{sl} {t_diag:.1f}, {sl}x{c} {t_b1:.1f}, "
      f"{c}x{sl} {t_b2:.1f}, merge {sl} rows {t_m2:.2f}, merge {c} rows {t_m1:.2f}")
print(f"plan per device {per_dev:.1f} ms; x{W} devices (they share the cores) {W * per_dev:.1f} "
      f"ms = {W * per_dev / t_one:.2f}x one device; ring / plan sum {t_ring / (W * per_dev):.2f}")
print(f"tiny call (1, 16, {H}, {D}) fixed cost {t_tiny:.3f} ms")
