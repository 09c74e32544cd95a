"""flashdl.jax on a mesh of CPU host devices: sharded jit calls and ring attention.

Run:  python benchmarks/bench_jax.py [--devices 4] [--out benchmarks/results/jax_cpu.md]

Sets XLA_FLAGS=--xla_force_host_platform_device_count before importing jax (the flag only counts
then), so it must run as its own process.

1. Sharded jit call: q, k, v (batch, s, h, d) sharded over the devices along batch (or heads),
   one jitted flashdl.jax.attention. Reported: the collectives in the compiled HLO (expected
   none), and its time against (a) one device running one shard's work (the per-device work,
   unsharded) and (b) one device running the whole batch (the same total work, unsharded).
2. Ring attention: flashdl.jax.ring_attention inside shard_map over a sequence-sharded axis
   (zigzag), against flashdl.jax.attention of the whole sequence on one device, forward and
   forward + backward; the bytes each device sends in the forward, read off the compiled HLO's
   collective-permutes (element counts x the program's itemsize), against the model
   2 (W - 1) b s_local h_kv d itemsize.

Host devices share the machine's cores: with fewer cores than devices, the devices' shards run
concurrently on the same cores, so a sharded program cannot be faster than one device doing the
whole work, and comparisons against one shard's work measure the oversubscription as well.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import statistics
import sys
import time


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--seqlens", default="4096,8192", help="ring: total sequence lengths")
    p.add_argument("--out", default=None)
    return p.parse_args()


ARGS = parse()
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={ARGS.devices}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import flashdl  # noqa: E402
import flashdl.jax as fj  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tables import cpu_model, emit  # noqa: E402

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def timed(fn, *args):
    """Median over rounds of the per-call time of `calls` back-to-back calls (ms)."""
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(ARGS.rounds):
        t0 = time.perf_counter()
        for _ in range(ARGS.calls):
            jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) / ARGS.calls * 1e3)
    return statistics.median(times)


def collectives(fn, *args):
    text = fn.lower(*args).compile().as_text()
    return [c for c in COLLECTIVES if re.search(rf"\b{c}(-start)?\(", text)]


def rand(shape, dtype=jnp.float32, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def sharded_rows(W):
    rows = []
    devs = np.array(jax.devices()[:W])
    for what, shape, spec in (("batch", (2 * W, 1024, 8, 64), P("x")),
                              ("heads", (2, 1024, 4 * W, 64), P(None, None, "x"))):
        for causal in (False, True):
            mesh = Mesh(devs, ("x",))
            q, k, v = (rand(shape, seed=i) for i in range(3))
            f = jax.jit(lambda q, k, v: fj.attention(q, k, v, causal=causal))
            sh = NamedSharding(mesh, spec)
            qs, ks, vs = (jax.device_put(x, sh) for x in (q, k, v))
            coll = collectives(f, qs, ks, vs)
            t_sharded = timed(f, qs, ks, vs)
            one = [x[: shape[0] // W] if what == "batch" else x[:, :, : shape[2] // W]
                   for x in (q, k, v)]
            one = [jax.device_put(x, devs[0]) for x in one]
            whole = [jax.device_put(x, devs[0]) for x in (q, k, v)]
            t_one, t_whole = timed(f, *one), timed(f, *whole)
            rows.append(f"| {what} | {shape} | {'yes' if causal else 'no'} | "
                        f"{', '.join(coll) or 'none'} | {t_sharded:.2f} | {t_one:.2f} | "
                        f"{t_sharded / t_one:.2f} | {t_whole:.2f} | {t_sharded / t_whole:.2f} |")
    return rows


def sent_bytes(fn, *args, itemsize):
    text = fn.lower(*args).compile().as_text()
    elems = 0
    for m in re.finditer(r"= \w+\[([\d,]*)\][^=]*? collective-permute(?:-start)?\(", text):
        elems += int(np.prod([int(x) for x in m.group(1).split(",") if x]))
    return elems * itemsize


def ring_rows(W):
    rows = []
    mesh = Mesh(np.array(jax.devices()[:W]), ("sp",))
    spec = P(None, "sp")
    b, h, hk, d = 1, 8, 8, 64
    for s in (int(x) for x in ARGS.seqlens.split(",")):
        for causal in (False, True):
            q, k, v = (rand((b, s, h if i == 0 else hk, d), seed=i) for i in range(3))
            ring = jax.shard_map(
                lambda q, k, v: fj.ring_attention(q, k, v, axis_name="sp", causal=causal),
                mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
            ring_f = jax.jit(ring)
            ring_g = jax.jit(jax.grad(lambda q, k, v: ring(q, k, v).sum(), argnums=(0, 1, 2)))
            one_f = jax.jit(lambda q, k, v: fj.attention(q, k, v, causal=causal))
            one_g = jax.jit(jax.grad(lambda q, k, v: fj.attention(q, k, v, causal=causal).sum(),
                                     argnums=(0, 1, 2)))
            sh = NamedSharding(mesh, spec)
            perm = [jax.device_put(fj.ring_permute(x, W), sh) for x in (q, k, v)]
            single = [jax.device_put(x, jax.devices()[0]) for x in (q, k, v)]
            sent = sent_bytes(ring_f, *perm, itemsize=4)
            model = 2 * (W - 1) * b * (s // W) * hk * d * 4
            tf_r, tf_1 = timed(ring_f, *perm), timed(one_f, *single)
            tg_r, tg_1 = timed(ring_g, *perm), timed(one_g, *single)
            rows.append(f"| {s} | {'yes' if causal else 'no'} | {tf_1:.1f} | {tf_r:.1f} | "
                        f"{tf_r / tf_1:.2f} | {tg_1:.1f} | {tg_r:.1f} | {tg_r / tg_1:.2f} | "
                        f"{sent / 2**20:.3f} | {model / 2**20:.3f} | "
                        f"{'yes' if sent == model else 'NO'} |")
    return rows


def main():
    W = ARGS.devices
    assert len(jax.devices()) >= W, f"only {len(jax.devices())} devices"
    info = flashdl._ext.build_info()
    lines = [
        f"# CPU: flashdl.jax sharded over {W} host devices ({datetime.date.today()})", "",
        f"- machine: {cpu_model()}, {os.cpu_count()} logical CPUs, {platform.system()} "
        f"{platform.machine()}; jax {jax.__version__}; flashdl {info['version']} "
        f"({info['cpu_isa']}, {info['cpu_threads']} threads per call)",
        f"- {W} host devices (`--xla_force_host_platform_device_count={W}`) share those CPUs",
        f"- command: `python benchmarks/bench_jax.py --devices {W} --rounds {ARGS.rounds} "
        f"--calls {ARGS.calls} --seqlens {ARGS.seqlens}`; medians of {ARGS.rounds} rounds of "
        f"{ARGS.calls} calls, float32, all in this one run", "",
        "## Sharded jit call (flashdl.jax.attention, q, k, v sharded alike)", "",
        "one shard: one device, one shard's inputs (the per-device work, unsharded); whole: one "
        "device, all inputs (the same total work, unsharded).", "",
        "| sharded over | global shape | causal | collectives in HLO | sharded ms | one shard ms "
        "| sharded / one shard | whole ms | sharded / whole |",
        "|---|---|---|---|---|---|---|---|---|",
        *sharded_rows(W), "",
        "## Ring attention (zigzag) against one device, same total sequence", "",
        "batch 1, 8 heads, 8 kv heads, headdim 64; sent: bytes one device sends in the forward "
        "(compiled HLO), model: 2 (W - 1) b s_local hk d 4.", "",
        "| seqlen | causal | one device fwd ms | ring fwd ms | ratio | one device fwd+bwd ms "
        "| ring fwd+bwd ms | ratio | sent fwd MiB | model MiB | equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *ring_rows(W),
    ]
    emit(lines, ARGS.out)


if __name__ == "__main__":
    main()
