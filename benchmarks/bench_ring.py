"""Ring attention on the CPU: W processes (gloo, one thread each) against one process with W
threads at the same total sequence length, and the bytes each rank sends against the model.

Run:  python benchmarks/bench_ring.py [--world 2] [--seqlens 4096,8192] [--rounds 3]
                                     [--out benchmarks/results/ring_cpu.md]

What to expect on one machine: the same arithmetic split W ways (zigzag balances causal work),
plus the ring's sends, which here are memory copies through gloo's TCP loopback; per step each
rank sends its K and V block once in the forward (W - 1 hops: 2 (W - 1) b s_local hk d bytes of
the dtype), and K, V and float32 dK, dV accumulators in the backward. Times are the slowest
rank's, medians over rounds.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tables import attention_flops, cpu_model, emit  # noqa: E402

B, H, HK, D = 1, 8, 8, 64


def make(s, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, s, n, D, generator=g) for n in (H, HK, HK, H)]


def timed_passes(fn_fwd, fn_bwd, rounds, barrier=lambda: None):
    fwd, both = [], []
    for _ in range(rounds + 1):  # the first round warms up
        barrier()
        t0 = time.perf_counter()
        fn_fwd()
        barrier()
        t1 = time.perf_counter()
        fn_bwd()
        barrier()
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        both.append(t2 - t0)
    return statistics.median(fwd[1:]), statistics.median(both[1:])


def ring_worker(rank, world, port, seqlens, rounds, out_dir):
    torch.set_num_threads(1)
    flashdl.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    rows = {}
    for s in seqlens:
        for causal in (False, True):
            q, k, v, w = make(s, s)
            local = [ft.ring_shard(x, rank, world, "zigzag").requires_grad_() for x in (q, k, v)]
            wl = ft.ring_shard(w, rank, world, "zigzag")
            state = {}

            def fwd():
                state["o"] = ft.ring_attention(*local, causal=causal)

            def bwd():
                (state["o"] * wl).sum().backward()

            f, fb = timed_passes(fwd, bwd, rounds, dist.barrier)
            t = torch.tensor([f, fb], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank
            sent = torch.tensor([_ring.last_bytes_sent["forward"],
                                 _ring.last_bytes_sent["backward"]], dtype=torch.float64)
            dist.all_reduce(sent, op=dist.ReduceOp.MAX)
            rows[(s, causal)] = (float(t[0]), float(t[1]), float(sent[0]), float(sent[1]))
    if rank == 0:
        np.save(os.path.join(out_dir, "ring.npy"), rows, allow_pickle=True)
    dist.destroy_process_group()


def single(seqlens, threads, rounds):
    torch.set_num_threads(threads)
    flashdl.set_num_threads(threads)
    rows = {}
    for s in seqlens:
        for causal in (False, True):
            q, k, v, w = make(s, s)
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            state = {}

            def fwd():
                state["o"] = ft.attention(*leaves, causal=causal)

            def bwd():
                (state["o"] * w).sum().backward()

            rows[(s, causal)] = timed_passes(fwd, bwd, rounds)
    flashdl.set_num_threads(0)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seqlens", default="4096,8192")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    seqlens = [int(x) for x in args.seqlens.split(",")]
    W = args.world
    one = single(seqlens, W, args.rounds)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(ring_worker, args=(W, port, seqlens, args.rounds, d), nprocs=W, join=True)
        ring = np.load(os.path.join(d, "ring.npy"), allow_pickle=True).item()

    lines = [
        f"# CPU: ring attention over {W} processes against one process ({datetime.date.today()})",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} logical CPUs, {platform.system()} "
        f"{platform.machine()}; torch {torch.__version__}, gloo over TCP loopback",
        f"- flashdl {flashdl.info()['version']}, fa2, float32, batch {B}, {H} heads, {HK} kv "
        f"heads, headdim {D}; ring: {W} processes x 1 thread, zigzag; single: 1 process x {W} "
        "threads",
        f"- command: `python benchmarks/bench_ring.py --world {W} --seqlens {args.seqlens} "
        f"--rounds {args.rounds}`; medians of {args.rounds} rounds, the slowest rank's time",
        "- sent: bytes one rank sent; model (forward): 2 (W - 1) b s_local hk d 4 bytes",
        "",
        "| seqlen | causal | single fwd ms | ring fwd ms | ratio | single fwd+bwd ms | "
        "ring fwd+bwd ms | ratio | ring GFLOP/s fwd+bwd | sent fwd MiB | model MiB | "
        "sent bwd MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (s, causal), (rf, rfb, sf, sb) in ring.items():
        of, ofb = one[(s, causal)]
        model = 2 * (W - 1) * B * (s // W) * HK * D * 4
        gf = attention_flops(B, H, s, s, D, causal, "fwd+bwd") / rfb / 1e9
        lines.append(f"| {s} | {'yes' if causal else 'no'} | {of * 1e3:.1f} | {rf * 1e3:.1f} | "
                     f"{rf / of:.2f} | {ofb * 1e3:.1f} | {rfb * 1e3:.1f} | {rfb / ofb:.2f} | "
                     f"{gf:.1f} | {sf / 2**20:.2f} | {model / 2**20:.2f} | {sb / 2**20:.2f} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
