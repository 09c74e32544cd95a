"""Context parallelism on the CPU (gloo): the bytes each rank sends against each scheme's model,
over sequence lengths and world sizes, and the ring's time with a causal window of 1/8 of the
sequence against full causal attention at the same length.

Run:  python benchmarks/bench_context_parallel.py [--worlds 2,4] [--seqlens 2048,4096,8192]
          [--time-seqlens 8192] [--rounds 3] [--out benchmarks/results/context_parallel_cpu.md]

Models, per rank, for b batch, s_local rows per rank, h heads, hk kv heads, d headdim, dtype
bytes e (float32 here, e = 4; hk = h):
- ring forward: K and V once per hop, W - 1 hops: 2 (W - 1) b s_local hk d e;
  backward: K, V for W - 1 hops and float32 dK, dV accumulators for W hops:
  (2 (W - 1) e + 2 W 4) b s_local hk d.
- Ulysses forward: (W - 1) / W of each of q, k, v and out: 4 (W - 1) / W b s_local h d e;
  backward: the same of dout, dq, dk and dv.
Times are the slowest rank's, medians over rounds after one warm-up round; each process has one
thread, so W = 2 uses the machine's 2 cores.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashdl
import flashdl.torch as ft
from flashdl import _torch_ring as _ring
from flashdl import _torch_ulysses as _ulysses

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tables import cpu_model, emit  # noqa: E402

B, H, HK, D = 1, 8, 8, 64


def make(s, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, s, n, D, generator=g) for n in (H, HK, HK, H)]


def run(kind, rank, world, s, causal, window, layout):
    """One forward and backward on this rank's shards; returns a closure pair (fwd, bwd)."""
    q, k, v, w = make(s, s)
    shard = lambda x: ft.ring_shard(x, rank, world, layout)  # noqa: E731
    local = [shard(x).requires_grad_() for x in (q, k, v)]
    wl, state = shard(w), {}

    def fwd():
        for x in local:
            x.grad = None
        if kind == "ring":
            state["o"] = ft.ring_attention(*local, causal=causal, window_size=window,
                                           layout=layout)
        else:
            state["o"] = ft.ulysses_attention(*local, causal=causal, window_size=window)

    def bwd():
        (state["o"] * wl).sum().backward()

    return fwd, bwd


def slowest(values):
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def worker(rank, world, port, seqlens, time_seqlens, rounds, out_dir):
    torch.set_num_threads(1)
    flashdl.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    rows = {"bytes": {}, "time": {}}
    for s in seqlens:  # bytes: one pass of each scheme, causal, full window
        for kind, layout in (("ring", "zigzag"), ("ulysses", "contiguous")):
            fwd, bwd = run(kind, rank, world, s, True, (-1, -1), layout)
            fwd()
            bwd()
            sent = (_ring if kind == "ring" else _ulysses).last_bytes_sent
            rows["bytes"][(kind, s)] = slowest([sent["forward"], sent["backward"]])
    configs = [("ring", "zigzag", False), ("ring", "zigzag", True), ("ring", "contiguous", False),
               ("ring", "contiguous", True), ("ulysses", "contiguous", False),
               ("ulysses", "contiguous", True)]
    for s in time_seqlens:
        for kind, layout, windowed in configs:
            window = (s // 8, 0) if windowed else (-1, -1)
            fwd, bwd = run(kind, rank, world, s, True, window, layout)
            f_times, fb_times = [], []
            for _ in range(rounds + 1):  # the first round warms up
                dist.barrier()
                t0 = time.perf_counter()
                fwd()
                dist.barrier()
                t1 = time.perf_counter()
                bwd()
                dist.barrier()
                t2 = time.perf_counter()
                f_times.append(t1 - t0)
                fb_times.append(t2 - t0)
            sent = (_ring if kind == "ring" else _ulysses).last_bytes_sent["forward"]
            rows["time"][(s, kind, layout, windowed)] = slowest(
                [statistics.median(f_times[1:]), statistics.median(fb_times[1:]), sent])
    if rank == 0:
        np.save(os.path.join(out_dir, f"w{world}.npy"), rows, allow_pickle=True)
    dist.destroy_process_group()
    # End at once, skipping the interpreter's finalisation: with torch 2.13's gloo, a runloop
    # thread may drop its last reference to a finished work while Python finalises and abort the
    # process ("terminate called without an active exception"); the results are on disk.
    os._exit(0)


def ring_model(world, s):
    x = B * (s // world) * HK * D
    return 2 * (world - 1) * x * 4, (2 * (world - 1) * 4 + 2 * world * 4) * x


def ulysses_model(world, s):
    x = B * (s // world) * H * D * 4
    return 4 * (world - 1) * x // world, 4 * (world - 1) * x // world


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--seqlens", default="2048,4096,8192")
    ap.add_argument("--time-seqlens", default="8192", help="timed at the first world size")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    worlds = [int(x) for x in args.worlds.split(",")]
    seqlens = [int(x) for x in args.seqlens.split(",")]
    time_seqlens = [int(x) for x in args.time_seqlens.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for i, w in enumerate(worlds):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            mp.spawn(worker, args=(w, port, seqlens, time_seqlens if i == 0 else [],
                                   args.rounds, d), nprocs=w, join=True)
            results[w] = np.load(os.path.join(d, f"w{w}.npy"), allow_pickle=True).item()

    mib = lambda x: f"{x / 2**20:.2f}"  # noqa: E731
    lines = [
        f"# CPU: context parallelism, bytes sent and windowed ring time ({datetime.date.today()})",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} logical CPUs, {platform.system()} "
        f"{platform.machine()}; torch {torch.__version__}, gloo over TCP loopback",
        f"- flashdl {flashdl.info()['version']}, fa2, float32, batch {B}, {H} heads, {HK} kv "
        f"heads, headdim {D}; W processes x 1 thread",
        f"- command: `python benchmarks/bench_context_parallel.py --worlds {args.worlds} "
        f"--seqlens {args.seqlens} --time-seqlens {args.time_seqlens} --rounds {args.rounds}`",
        "- bytes: the most any rank sent in one causal call (ring zigzag, Ulysses); model: the "
        "formulas above; equal: measured == model to the byte",
        "",
        "| W | seqlen | ring fwd MiB | model | ring bwd MiB | model | Ulysses fwd MiB | model | "
        "Ulysses bwd MiB | model | all equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in worlds:
        for s in seqlens:
            rf, rb = results[w]["bytes"][("ring", s)]
            uf, ub = results[w]["bytes"][("ulysses", s)]
            mr, mu = ring_model(w, s), ulysses_model(w, s)
            equal = (rf, rb, uf, ub) == (*mr, *mu)
            lines.append(f"| {w} | {s} | {mib(rf)} | {mib(mr[0])} | {mib(rb)} | {mib(mr[1])} | "
                         f"{mib(uf)} | {mib(mu[0])} | {mib(ub)} | {mib(mu[1])} | "
                         f"{'yes' if equal else 'NO'} |")
    w0 = worlds[0]
    lines += [
        "",
        f"Time, W = {w0}, causal; window: `window_size=(seqlen / 8, 0)`; ratio: windowed time / "
        "full causal time of the same scheme and layout.",
        "",
        "| seqlen | scheme | layout | window | fwd ms | ratio | fwd+bwd ms | ratio | "
        "sent fwd MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    timed = results[w0]["time"]
    for (s, kind, layout, windowed), (f, fb, sent) in timed.items():
        base = timed[(s, kind, layout, False)]
        lines.append(f"| {s} | {kind} | {layout} | {f's/8 = {s // 8}' if windowed else 'none'} | "
                     f"{f * 1e3:.1f} | {f / base[0]:.2f} | {fb * 1e3:.1f} | {fb / base[1]:.2f} | "
                     f"{mib(sent)} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
