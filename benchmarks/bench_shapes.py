"""flashdl on the CPU against torch SDPA over a grid of seqlen_q x seqlen_k, lopsided shapes included.

Run:  python benchmarks/bench_shapes.py [--out benchmarks/results/shapes.md] [--dtype float32]

Every (seqlen_q, seqlen_k) from {16, 256, 4096, 100000}^2 whose forward costs at most that of
4096 x 4096 (the 100,000 x 4096 corners and 100,000 x 100,000 would take minutes per round here);
batch 1, 8 heads, headdim 64, no mask. Forward and forward+backward; each measurement alternates
flashdl and torch in one process and takes the median (bench_cpu.alternate), so both see the same
machine state. The ratio is torch's time over flashdl's: above 1, flashdl is faster.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform

import flashdl
from bench_cpu import alternate
from tables import cpu_model, emit

SIDES = (16, 256, 4096, 100_000)
MAX_PAIRS = 4096 * 4096 * 1.6  # up to 256 x 100,000 and 100,000 x 256


def grid():
    return [(sq, sk) for sq in SIDES for sk in SIDES if sq * sk <= MAX_PAIRS]


def measure(torch, sq, sk, dtype_name, reps, h=8, d=64):
    import torch.nn.functional as F

    dt = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, sq, h, d, generator=gen).to(dt)
    k, v = (torch.randn(1, sk, h, d, generator=gen).to(dt) for _ in range(2))
    dout = torch.randn(1, sq, h, d, generator=gen).to(dt)
    qt, kt, vt, doutt = (x.transpose(1, 2).contiguous() for x in (q, k, v, dout))
    qg, kg, vg = (x.clone().requires_grad_() for x in (qt, kt, vt))

    def fd_fwd():
        flashdl.attention(q, k, v)

    def th_fwd():
        F.scaled_dot_product_attention(qt, kt, vt)

    def fd_all():
        out, lse = flashdl.attention(q, k, v, return_lse=True)
        flashdl.attention_backward(dout, q, k, v, out, lse)

    def th_all():
        F.scaled_dot_product_attention(qg, kg, vg).backward(doutt)

    fwd = alternate([fd_fwd, th_fwd], reps)
    both = alternate([fd_all, th_all], reps)
    return fwd, both


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="markdown file for the table")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    import torch

    threads = flashdl.info()["num_threads"]
    torch.set_num_threads(threads)
    rows = []
    for sq, sk in grid():
        (f_fd, f_th), (b_fd, b_th) = measure(torch, sq, sk, args.dtype, args.reps)
        rows.append((sq, sk, f_fd, f_th, b_fd, b_th))
        print(f"  {sq:>6} x {sk:<6} fwd {f_fd*1e3:9.2f} / {f_th*1e3:9.2f} ms  "
              f"fwd+bwd {b_fd*1e3:9.2f} / {b_th*1e3:9.2f} ms", flush=True)
    info = flashdl.info()
    lines = [
        f"# CPU: flashdl vs torch SDPA over seqlen_q x seqlen_k ({datetime.date.today()})",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} logical CPUs, {platform.system()} "
        f"{platform.machine()}",
        f"- flashdl {info['version']}, CPU kernels `{info['cpu_isa']}`, "
        f"{threads} threads; torch {torch.__version__}, {torch.get_num_threads()} threads",
        f"- {args.dtype}, batch 1, 8 heads, headdim 64, no mask, schedule auto; medians of "
        f"{args.reps} alternating rounds",
        "- command: `python benchmarks/bench_shapes.py"
        + (f" --dtype {args.dtype}" if args.dtype != "float32" else "") + "`",
        "",
        "| seqlen_q x seqlen_k | fwd flashdl | fwd torch | fwd ratio | fwd+bwd flashdl "
        "| fwd+bwd torch | fwd+bwd ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for sq, sk, f_fd, f_th, b_fd, b_th in rows:
        lines.append(f"| {sq:,} x {sk:,} | {f_fd*1e3:.2f} ms | {f_th*1e3:.2f} ms | "
                     f"{f_th/f_fd:.2f} | {b_fd*1e3:.2f} ms | {b_th*1e3:.2f} ms | {b_th/b_fd:.2f} |")
    lines += ["", "Ratio: torch time / flashdl time (above 1: flashdl faster)."]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
