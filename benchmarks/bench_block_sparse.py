"""Block-sparse attention on the CPU: run time against the fraction of non-zero blocks.

Run:  python benchmarks/bench_block_sparse.py [--out benchmarks/results/block_sparse_cpu.md]
      [--seqlen 4096] [--heads 8] [--headdim 64] [--rounds 5]

For each schedule (fa2, fa1) and block size, masks of densities 1, 1/2, 1/4, 1/8, 1/16 (random
blocks, the same plane for every head; and a band of diagonal blocks) are timed forward and
forward+backward. Every round runs every configuration once, in the same process, so all see the
same machine state; the tables give medians over rounds and each time as a ratio of the all-true
mask's time (same schedule and block size). The seeds' IO analysis predicts a ratio equal to the
density (s * N^2 d^2 / M with s the fraction of non-zero blocks); the "no mask" row is plain dense
attention, for the cost of the mask itself.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time

import numpy as np

import flashdl
from tables import cpu_model, emit

DENSITIES = (1.0, 0.5, 0.25, 0.125, 0.0625)


def random_blocks(rng, nbq, nbk, density):
    """Exactly round(density * nbq * nbk) non-zero blocks, chosen uniformly."""
    n = nbq * nbk
    mask = np.zeros(n, dtype=bool)
    mask[rng.choice(n, int(round(density * n)), replace=False)] = True
    return mask.reshape(nbq, nbk)


def band_blocks(nbq, nbk, density):
    """Blocks within a diagonal band, as wide as the density asks (local attention)."""
    width = max(1, int(round(density * nbk)))
    i, j = np.arange(nbq)[:, None], np.arange(nbk)[None, :]
    return (j - i) % nbk < width


class Config:
    def __init__(self, schedule, block, pattern, density, mask):
        self.schedule, self.block, self.pattern, self.density = schedule, block, pattern, density
        self.mask = mask
        self.fwd, self.fb = [], []

    @property
    def actual_density(self):
        return 1.0 if self.mask is None else float(self.mask.mean())


def run_once(cfg, q, k, v, dout):
    opts = dict(schedule=cfg.schedule)
    if cfg.mask is not None:
        opts.update(block_mask=cfg.mask, block_size=cfg.block)
    t0 = time.perf_counter()
    out, lse = flashdl.attention(q, k, v, return_lse=True, **opts)
    t1 = time.perf_counter()
    flashdl.attention_backward(dout, q, k, v, out, lse, **opts)
    t2 = time.perf_counter()
    cfg.fwd.append(t1 - t0)
    cfg.fb.append(t2 - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the markdown table here")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--blocks", type=int, nargs="+", default=[128, 64])
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    b, s, h, d = 1, args.seqlen, args.heads, args.headdim
    q, k, v, dout = (rng.standard_normal((b, s, h, d)).astype(np.float32) for _ in range(4))

    configs = []
    for schedule in ("fa2", "fa1"):
        for block in args.blocks:
            nb = -(-s // block)
            configs.append(Config(schedule, block, "no mask", 1.0, None))
            for density in DENSITIES:
                configs.append(Config(schedule, block, "random", density,
                                      random_blocks(rng, nb, nb, density)))
            for density in DENSITIES[1:]:
                configs.append(Config(schedule, block, "band", density,
                                      band_blocks(nb, nb, density)))

    for cfg in configs:  # warm-up: thread pool, allocations, page cache
        run_once(cfg, q, k, v, dout)
        cfg.fwd.clear()
        cfg.fb.clear()
    for _ in range(args.rounds):
        for cfg in configs:
            run_once(cfg, q, k, v, dout)

    info = flashdl.info()
    lines = [
        f"# CPU: block-sparse attention, time against density ({datetime.date.today()})",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} logical CPUs, {platform.system()} "
        f"{platform.machine()}",
        f"- flashdl {info['version']}, CPU kernels `{info['cpu_isa']}`, "
        f"{info['num_threads']} threads, float32",
        f"- command: `python benchmarks/bench_block_sparse.py --seqlen {s} --heads {h} "
        f"--headdim {d} --rounds {args.rounds} --blocks {' '.join(map(str, args.blocks))}`",
        f"- shape (batch 1, seqlen {s}, heads {h}, headdim {d}); medians of {args.rounds} rounds, "
        "all configurations interleaved in one process",
        "- ratio: time / time of the all-true mask (same schedule, block size); the IO bound "
        "predicts ratio = density",
        "",
        "| schedule | block | mask | density | fwd ms | fwd ratio | fwd+bwd ms | fwd+bwd ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    full = {}
    for cfg in configs:
        if cfg.pattern == "random" and cfg.density == 1.0:
            full[(cfg.schedule, cfg.block)] = (statistics.median(cfg.fwd),
                                               statistics.median(cfg.fb))
    for cfg in configs:
        f, fb = statistics.median(cfg.fwd), statistics.median(cfg.fb)
        ff, ffb = full[(cfg.schedule, cfg.block)]
        lines.append(f"| {cfg.schedule} | {cfg.block} | {cfg.pattern} | "
                     f"{cfg.actual_density:.4f} | {f * 1e3:.1f} | {f / ff:.3f} | "
                     f"{fb * 1e3:.1f} | {fb / ffb:.3f} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
