"""The CPU backward against its own forward: flashdl.attention_backward over flashdl.attention.

Run:  python benchmarks/bench_bwd_fwd.py [--out FILE] [--sides 16,128,512,2048] [--threads N]

Every cell of a seqlen_q x seqlen_k grid, q (1, seqlen_q, 8, 64) against k, v (1, seqlen_k, 8,
64), float32 and bfloat16, causal or not, through the NumPy API (the calls a user makes; the
backward is given the forward's out and lse). Per cell the forward and the backward are called in
turn, round after round (one process, interleaved: what else runs on the machine slows both
alike), for --seconds per cell and at least 5 rounds; the minimum of each, and their ratio. The
backward does 2.5x the forward's matrix products (flash-attn's count) and reads dO and O besides,
so a ratio near 2.5-3 says its fixed costs (packing, working memory, thread hand-offs) are in
proportion.
"""
from __future__ import annotations

import argparse
import datetime
import os
import time

import numpy as np

import flashdl
from tables import cpu_model, emit


def cell(sq, sk, dtype, causal, seconds):
    """(forward seconds, backward seconds): minima of interleaved calls."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, sq, 8, 64)).astype(dtype)
    k, v = (rng.standard_normal((1, sk, 8, 64)).astype(dtype) for _ in range(2))
    dout = rng.standard_normal((1, sq, 8, 64)).astype(dtype)
    out, lse = flashdl.attention(q, k, v, causal=causal, return_lse=True)

    def fwd():
        flashdl.attention(q, k, v, causal=causal, return_lse=True)

    def bwd():
        flashdl.attention_backward(dout, q, k, v, out, lse, causal=causal)

    for f in (fwd, bwd, fwd, bwd):  # warm: the kept working memory, the pool's threads
        f()
    best = [float("inf"), float("inf")]
    clock = time.perf_counter
    start, rounds = clock(), 0
    while rounds < 5 or clock() - start < seconds:
        for i, f in enumerate((fwd, bwd)):
            t = clock()
            f()
            best[i] = min(best[i], clock() - t)
        rounds += 1
    return best[0], best[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="markdown file for the table")
    ap.add_argument("--sides", default="16,128,512,2048", help="the grid's seqlens")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--seconds", type=float, default=0.3, help="time per cell")
    ap.add_argument("--threads", type=int, default=0, help="flashdl's threads (0: its default)")
    ap.add_argument("--note", default="", help="a line about the machine's state")
    args = ap.parse_args()
    if args.threads:
        flashdl.set_num_threads(args.threads)
    sides = [int(s) for s in args.sides.split(",")]
    dtypes = {"float32": np.float32}
    if "bfloat16" in args.dtypes:
        import ml_dtypes

        dtypes["bfloat16"] = ml_dtypes.bfloat16
    lines = [
        "# CPU backward over forward, NumPy API",
        "",
        f"{datetime.date.today()}, {cpu_model()}, {os.cpu_count()} logical CPUs, flashdl "
        f"{flashdl.__version__}, {flashdl.info()['num_threads']} threads; "
        f"`python benchmarks/bench_bwd_fwd.py --sides {args.sides} --dtypes {args.dtypes} "
        f"--seconds {args.seconds}{f' --threads {args.threads}' if args.threads else ''}`."
        + (f" {args.note}" if args.note else ""),
        "",
        "q (1, seqlen_q, 8, 64), k, v (1, seqlen_k, 8, 64); minimum of interleaved calls; ratio "
        "= backward / forward.",
        "",
        "| dtype | causal | seqlen_q x seqlen_k | forward (us) | backward (us) | ratio |",
        "|---|---|---|---:|---:|---:|",
    ]
    worst = 0.0
    for name in args.dtypes.split(","):
        for causal in (False, True):
            for sq in sides:
                for sk in sides:
                    f, b = cell(sq, sk, dtypes[name], causal, args.seconds)
                    worst = max(worst, b / f)
                    row = (f"| {name} | {'yes' if causal else 'no'} | {sq} x {sk} | {f * 1e6:.1f} "
                           f"| {b * 1e6:.1f} | {b / f:.2f} |")
                    lines.append(row)
                    print(row, flush=True)
    lines += ["", f"Largest ratio: {worst:.2f}."]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
