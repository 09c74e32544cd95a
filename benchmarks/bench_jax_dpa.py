"""flashdl.jax.dot_product_attention against jax.nn.dot_product_attention(implementation="xla"),
side by side in one process: forward and forward + backward under jax.jit, and the compiled
programs' temporary memory.

Run:  python benchmarks/bench_jax_dpa.py [--shape 1,8,2048,64] [--rounds 7] [--calls 3]
                                         [--out benchmarks/results/jax_dpa_cpu.md]

Each round times `calls` back-to-back calls of each implementation in turn (flashdl, then XLA),
so both see the same machine load; reported are the medians over rounds and the ratio
XLA / flashdl of the medians (> 1: flashdl faster), with the median of the rounds' own ratios
beside it. Memory: XLA's memory_analysis() of each compiled program (temp_size_in_bytes: the
buffers the program allocates beyond its arguments and outputs).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import flashdl
import flashdl.jax as fj

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tables import cpu_model, emit  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1,8,2048,64", help="batch,heads,seqlen,headdim")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--note", default="", help="a line about the machine (load, sharing)")
    return p.parse_args()


def programs(impl, causal, dout):
    def fwd(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla") \
            if impl == "xla" else fj.dot_product_attention(q, k, v, is_causal=causal)

    def loss(q, k, v):
        return (fwd(q, k, v) * dout).sum()
    return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def temp_mib(fn, *args):
    stats = fn.lower(*args).compile().memory_analysis()
    return stats.temp_size_in_bytes / 2**20 if stats is not None else float("nan")


def race(fns, args, rounds, calls):
    """Per-call ms of each fn, round by round, the fns taking turns within a round."""
    for fn in fns:
        jax.block_until_ready(fn(*args))  # compile and warm up
    times = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
            times[i].append((time.perf_counter() - t0) / calls * 1e3)
    return times


def main():
    a = parse()
    b, h, s, d = (int(x) for x in a.shape.split(","))
    rng = np.random.default_rng(0)
    q, k, v, dout = (jnp.asarray(rng.standard_normal((b, s, h, d)), a.dtype) for _ in range(4))
    rows = []
    for causal in (False, True):
        ours, theirs = programs("flashdl", causal, dout), programs("xla", causal, dout)
        for p, name in ((0, "forward"), (1, "forward + backward")):
            t_ours, t_xla = race([ours[p], theirs[p]], (q, k, v), a.rounds, a.calls)
            m_ours, m_xla = statistics.median(t_ours), statistics.median(t_xla)
            per_round = statistics.median(x / o for o, x in zip(t_ours, t_xla))
            rows.append(f"| {name} | {causal} | {m_ours:.2f} | {m_xla:.2f} | "
                        f"**{m_xla / m_ours:.2f}x** | {per_round:.2f}x | "
                        f"{temp_mib(ours[p], q, k, v):.1f} | {temp_mib(theirs[p], q, k, v):.1f} |")
            print(rows[-1], flush=True)
    cmd = "python " + shlex.join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    emit([
        f"## {datetime.date.today()}: ({b}, {s}, {h}, {d}) {a.dtype} (B, T, N, H), T = S",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} logical CPUs, {platform.system()} "
        f"{platform.machine()}; jax {jax.__version__}; flashdl {flashdl.__version__}",
        *([f"- {a.note}"] if a.note else []),
        f"- command: `{cmd}`; medians of {a.rounds} rounds of {a.calls} calls, the two "
        "implementations taking turns in each round, same process",
        "",
        "| pass | is_causal | flashdl ms | XLA ms | XLA / flashdl (of medians) | "
        "median of round ratios | flashdl temp MiB | XLA temp MiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
        *rows,
    ], a.out)


if __name__ == "__main__":
    main()
