"""flashdl on the CPU against torch SDPA over a grid of seqlen_q x seqlen_k, lopsided shapes included.

Run:  python benchmarks/bench_shapes.py [--out benchmarks/results/shapes.md] [--dtype float32]

Every (seqlen_q, seqlen_k) from {16, 256, 4096, 100000}^2 whose forward costs at most that of
4096 x 4096 (the 100,000 x 4096 corners and 100,000 x 100,000 would take minutes per round here);
batch 1, 8 heads, headdim 64, no mask. Forward and forward+backward; each measurement alternates
flashdl and torch in one process and takes the median (bench_cpu.alternate), so both see the same
machine state. The ratio is torch's time over flashdl's: above 1, flashdl is faster.

`--grid issue31` runs issue 31's grid instead: seqlen_q x seqlen_k over {16, 128, 512, 2048, 16384}^2
(cells over 10^9 score entries, batch x heads x seqlen_q x seqlen_k, skipped), causal and not, for the
head dims in `--headdims`, and prints a ratio table (rows seqlen_q, columns seqlen_k, each cell
"fwd ratio / fwd+bwd ratio") with the worst cell. `--sides`, `--causal` and `--max-entries` cut it down
(the whole grid takes hours on a loaded 2-core machine); `--with-side N` runs only the cells with a
side of N. `--tiny` times the (1, 16, 2, 16) call: eager `flashdl.attention` on NumPy and
`flashdl.torch.attention` on torch against one SDPA call, each in a process of its own, in a
steady loop (best and median of --reps rounds of 20,000 calls).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform

import flashdl
from bench_cpu import SETTLE_S, alternate
from tables import cpu_model, emit

SIDES = (16, 256, 4096, 100_000)
ISSUE31_SIDES = (16, 128, 512, 2048, 16384)
ISSUE31_MAX_ENTRIES = 1e9  # batch 1 x 8 heads x seqlen_q x seqlen_k
MAX_PAIRS = 4096 * 4096 * 1.6  # up to 256 x 100,000 and 100,000 x 256


def grid():
    return [(sq, sk) for sq in SIDES for sk in SIDES if sq * sk <= MAX_PAIRS]


def measure(torch, sq, sk, dtype_name, reps, h=8, d=64, causal=False):
    import torch.nn.functional as F

    dt = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, sq, h, d, generator=gen).to(dt)
    k, v = (torch.randn(1, sk, h, d, generator=gen).to(dt) for _ in range(2))
    dout = torch.randn(1, sq, h, d, generator=gen).to(dt)
    qt, kt, vt, doutt = (x.transpose(1, 2).contiguous() for x in (q, k, v, dout))
    qg, kg, vg = (x.clone().requires_grad_() for x in (qt, kt, vt))

    def fd_fwd():
        flashdl.attention(q, k, v, causal=causal)

    # flashdl's causal mask is bottom-right aligned; SDPA's is_causal is top-left aligned, which
    # for seqlen_q != seqlen_k is a different mask (and different work): use torch's lower-right
    # causal bias there so both compute the same attention.
    mask = {}
    if causal and sq != sk:
        from torch.nn.attention.bias import causal_lower_right
        mask = {"attn_mask": causal_lower_right(sq, sk)}
    elif causal:
        mask = {"is_causal": True}

    def th_fwd():
        F.scaled_dot_product_attention(qt, kt, vt, **mask)

    def fd_all():
        out, lse = flashdl.attention(q, k, v, causal=causal, return_lse=True)
        flashdl.attention_backward(dout, q, k, v, out, lse, causal=causal)

    def th_all():
        F.scaled_dot_product_attention(qg, kg, vg, **mask).backward(doutt)

    fwd = alternate([fd_fwd, th_fwd], reps)
    both = alternate([fd_all, th_all], reps)
    return fwd, both


# The tiny call, timed in a process of its own per callable, in a steady loop: in one process
# the callables disturb each other's thread pools (after flashdl's calls, or after any pause,
# torch's OpenMP workers made SDPA's tiny call take 8-60 us instead of 6.5 here), and a pause
# before each round, as alternate() takes, measures waking the pools, not the call.
TINY_CALLS = {
    "flashdl.attention (NumPy)": "import flashdl; qn, kn, vn = (x.numpy() for x in (q, k, v)); "
                                 "f = lambda: flashdl.attention(qn, kn, vn)",
    "flashdl.torch.attention": "import flashdl.torch as fdt; f = lambda: fdt.attention(q, k, v)",
    "torch SDPA": "import torch.nn.functional as F; "
                  "qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v)); "
                  "f = lambda: F.scaled_dot_product_attention(qt, kt, vt)",
}
TINY_LOOP = 20_000


def tiny(threads, reps):
    """{name: (best, median)} seconds per (1, 16, 2, 16) float32 call, each callable in its own
    process with `threads` threads: `reps` rounds of TINY_LOOP calls."""
    import json
    import subprocess
    import sys

    out = {}
    for name, setup in TINY_CALLS.items():
        code = (f"import json, timeit, torch; torch.set_num_threads({threads}); "
                "gen = torch.Generator().manual_seed(0); "
                "q, k, v = (torch.randn(1, 16, 2, 16, generator=gen) for _ in range(3)); "
                f"{setup}; f(); "
                f"r = sorted(t / {TINY_LOOP} for t in timeit.repeat(f, number={TINY_LOOP}, "
                f"repeat={reps})); print(json.dumps([r[0], r[len(r) // 2]]))")
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True)
        out[name] = tuple(json.loads(res.stdout.strip().splitlines()[-1]))
    return out


SMALL_CELL, SMALL_CELL_REPS = 65536, 5


def issue31(args, torch):
    sides = [int(x) for x in args.sides.split(",")] if args.sides else ISSUE31_SIDES
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    heads = 8
    lines_head = []
    tables = []
    worst = None
    for d in [int(x) for x in args.headdims.split(",")]:
        for causal in causals:
            cells = {}
            for sq in sides:
                for sk in sides:
                    if heads * sq * sk > args.max_entries:
                        continue
                    if args.with_side is not None and args.with_side not in (sq, sk):
                        cells[sq, sk] = None
                        continue
                    # Calls under a millisecond: a scheduler hiccup is a large part of one,
                    # so more rounds go into their medians.
                    reps = args.reps * (SMALL_CELL_REPS if sq * sk <= SMALL_CELL else 1)
                    (f_fd, f_th), (b_fd, b_th) = measure(torch, sq, sk, args.dtype, reps,
                                                         h=heads, d=d, causal=causal)
                    cells[sq, sk] = (f_th / f_fd, b_th / b_fd)
                    print(f"  d={d} causal={causal} {sq:>6} x {sk:<6} fwd {f_fd*1e3:9.3f} / "
                          f"{f_th*1e3:9.3f} ms  fwd+bwd {b_fd*1e3:9.3f} / {b_th*1e3:9.3f} ms",
                          flush=True)
                    for ratio, what in ((f_th / f_fd, "fwd"), (b_th / b_fd, "fwd+bwd")):
                        if worst is None or ratio < worst[0]:
                            worst = (ratio, what, sq, sk, d, causal)
            t = [f"### headdim {d}, {'causal' if causal else 'no mask'}", "",
                 "| seqlen_q \\ seqlen_k | " + " | ".join(f"{sk:,}" for sk in sides) + " |",
                 "|---|" + "---|" * len(sides)]
            for sq in sides:
                t.append(f"| {sq:,} | " + " | ".join(
                    "-" if (sq, sk) not in cells else "n/r" if cells[sq, sk] is None
                    else f"{cells[sq, sk][0]:.2f} / {cells[sq, sk][1]:.2f}" for sk in sides)
                    + " |")
            tables += t + [""]
    with open("/proc/loadavg") as fh:
        load = " ".join(fh.read().split()[:3])
    info = flashdl.info()
    lines_head = [
        f"# CPU: flashdl vs torch SDPA, issue 31 grid ({datetime.date.today()})", "",
        f"- machine: {cpu_model()}, {os.cpu_count()} logical CPUs; load average at the end {load}",
        f"- flashdl {info['version']}, CPU kernels `{info['cpu_isa']}`, {info['num_threads']} "
        f"threads; torch {torch.__version__}, {torch.get_num_threads()} threads",
        f"- {args.dtype}, batch 1, {heads} heads, schedule auto; medians of {args.reps} "
        f"alternating rounds ({args.reps * SMALL_CELL_REPS} where seqlen_q x seqlen_k <= "
        f"{SMALL_CELL:,}), each timed call after {SETTLE_S * 1e3:.0f} ms of untimed calls of the "
        "same library (bench_cpu.alternate); cells with more than "
        f"{args.max_entries:.3g} score entries skipped (-)"
        + (f"; only cells with a side of {args.with_side:,} run (n/r: not run)"
           if args.with_side is not None else ""),
        "- each cell: fwd ratio / fwd+bwd ratio, torch time / flashdl time (above 1: flashdl faster)",
        "",
    ]
    tail = []
    if worst:
        r, what, sq, sk, d, c = worst
        tail = [f"Worst cell: {what} {r:.2f} at {sq:,} x {sk:,}, headdim {d}, "
                f"{'causal' if c else 'no mask'}.", ""]
    return lines_head + tables + tail


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="markdown file for the table")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--grid", default="legacy", choices=["legacy", "issue31"])
    ap.add_argument("--sides", default=None, help="issue31: comma-separated seqlens")
    ap.add_argument("--headdims", default="64,128", help="issue31: comma-separated head dims")
    ap.add_argument("--causal", default="both", choices=["both", "no", "yes"])
    ap.add_argument("--max-entries", type=float, default=ISSUE31_MAX_ENTRIES)
    ap.add_argument("--with-side", type=int, default=None,
                    help="issue31: only the cells with this seqlen_q or seqlen_k (others: n/r)")
    ap.add_argument("--tiny", action="store_true", help="time the (1, 16, 2, 16) call only")
    args = ap.parse_args()
    import torch

    threads = flashdl.info()["num_threads"]
    torch.set_num_threads(threads)
    if args.tiny:
        res = tiny(threads, args.reps)
        sdpa = res["torch SDPA"][0]
        emit(["(1, 16, 2, 16) float32, per call, best / median of "
              f"{args.reps} rounds of {TINY_LOOP:,} calls, each callable in its own process "
              f"({threads} threads): " +
              "; ".join(f"{n} {b*1e6:.2f} / {m*1e6:.2f} us" for n, (b, m) in res.items()) +
              "; best against SDPA's best: " +
              ", ".join(f"{n} {b / sdpa:.2f}x" for n, (b, _) in res.items()
                        if n != "torch SDPA")], args.out)
        return
    if args.grid == "issue31":
        emit(issue31(args, torch), args.out)
        return
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
