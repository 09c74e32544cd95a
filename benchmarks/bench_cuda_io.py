"""HBM traffic of the CUDA forward kernels, measured with Nsight Compute, against the FlashAttention
paper's IO model and against standard attention.

Run (a machine with an NVIDIA GPU, torch with CUDA, and Nsight Compute's `ncu` on PATH):
    python benchmarks/bench_cuda_io.py [--out benchmarks/results/h100_io.md]
        [--seqlens 4096,8192,16384] [--headdims 64,128] [--schedules fa1,fa2,standard]
        [--fa1-max-seqlen 8192] [--standard-max-seqlen 8192] [--ncu ncu]
    python benchmarks/bench_cuda_io.py --check
        (no GPU needed: parses a sample of ncu's CSV and prints the model's columns)

Shapes: bench_cuda.py's (16k tokens per batch: batch = 16384 // seqlen, nheads = 2048 // headdim),
float16, not causal, seqlen_q = seqlen_k = N. Each (schedule, N, d) is one child process under
`ncu --nvtx --nvtx-include flashdl_io/ --metrics dram__bytes_read.sum,dram__bytes_write.sum`: the
child makes the tensors, runs the call once untimed, then once inside the NVTX range
`flashdl_io`, and ncu sums every kernel launched in that range (a forward may launch more than
one: fa1's workspace fill, standard attention's three). standard: torch's matmul, softmax, matmul
on (batch, nheads, N, d) tensors (the paper's Algorithm 0).

Columns: bytes read and written from DRAM (HBM), and the two models of the paper (section 3.2,
Theorem 2), per (batch, head) times batch * nheads, in bytes of float16:
- FlashAttention (Algorithm 1): Theta(N^2 d^2 / M) accesses, M the on-chip memory in elements
  (here the device's shared memory per block, 227 KiB on an H100). The "measured / model" column
  divides by N^2 d^2 / M with a constant of 1: the model holds where that ratio stays the same
  across N and d. flashdl's fa1 keeps O and the row statistics in float32 in global memory, and
  fa2 re-reads K and V once per 128-row query block (not a function of M), so neither need match
  the constant.
- Standard attention: Theta(N d + N^2); counted as Algorithm 0 moves it, 4 N d + 4 N^2 elements
  (Q, K read, S written and read, P written and read, V read, O written).
The H100's 50 MB L2 serves re-reads that stay in it (K and V of a head read by its query blocks
running at the same time), so DRAM bytes can fall below any count of accesses.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import io
import math
import os
import subprocess
import sys

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
NVTX_RANGE = "flashdl_io"
TOKENS = 16384
ELEM = 2  # float16


def shape(n, d):
    """(batch, nheads) of bench_cuda.py's shapes: 16k tokens per batch, 2048 // d heads."""
    return max(1, TOKENS // n), max(1, 2048 // d)


def flash_model_bytes(n, d, batch, heads, smem_bytes):
    """N^2 d^2 / M elements per head (M in elements), times batch * heads, in bytes."""
    m = smem_bytes / ELEM
    return batch * heads * n * n * d * d / m * ELEM


def standard_model_bytes(n, d, batch, heads):
    """Algorithm 0: 4 N d + 4 N^2 elements per head, in bytes."""
    return batch * heads * (4 * n * d + 4 * n * n) * ELEM


def parse_ncu_csv(text):
    """{metric: summed value} and the kernel count from `ncu --csv --print-units base` output:
    one row per (kernel, metric); other lines (ncu's own ==PROF== notes, the program's output)
    are skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu CSV table in the output (no kernel was profiled?)")
    rows = csv.DictReader(io.StringIO("\n".join(l for l in lines[start:] if l.startswith('"'))))
    sums, kernels = {}, set()
    for row in rows:
        name = row.get("Metric Name")
        if name not in METRICS:
            continue
        kernels.add(row.get("ID"))
        value = float(row["Metric Value"].replace(",", ""))
        sums[name] = sums.get(name, 0.0) + value
    return sums, len(kernels)


SAMPLE = '''==PROF== Connected to process 1234
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1234","python3","127.0.0.1","fa2_forward","1","7","(128, 1, 1)","(32, 16, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","1,048,576"
"0","1234","python3","127.0.0.1","fa2_forward","1","7","(128, 1, 1)","(32, 16, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","524,288"
"1","1234","python3","127.0.0.1","fill","1","7","(256, 1, 1)","(8, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","0"
"1","1234","python3","127.0.0.1","fill","1","7","(256, 1, 1)","(8, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","4,096"
==PROF== Disconnected from process 1234
'''


def check():
    """The parts that need no GPU: the CSV parser on a sample, and the model columns."""
    sums, kernels = parse_ncu_csv(SAMPLE)
    assert kernels == 2, kernels
    assert sums == {METRICS[0]: 1048576.0, METRICS[1]: 528384.0}, sums
    smem = 227 * 1024
    print("| N | d | batch x heads | N^2 d^2 / M (MB) | standard, 4Nd + 4N^2 (MB) |")
    print("|---|---|---|---|---|")
    for n in (4096, 8192, 16384):
        for d in (64, 128):
            b, h = shape(n, d)
            print(f"| {n} | {d} | {b} x {h} | {flash_model_bytes(n, d, b, h, smem) / 1e6:.1f} | "
                  f"{standard_model_bytes(n, d, b, h) / 1e6:.1f} |")
    print("check: ok")


def run_one(schedule, n, d):
    """The child: one untimed call, then one inside the NVTX range ncu profiles."""
    import torch

    import flashdl.torch as fdt

    b, h = shape(n, d)
    gen = torch.Generator(device="cuda").manual_seed(0)
    if schedule == "standard":  # (batch, heads, N, d), contiguous: no copy inside the range
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16, generator=gen)
                   for _ in range(3))
        q = q * (1.0 / math.sqrt(d))  # the scale outside the range: S and P are the N^2 tensors

        def call():
            p = torch.softmax(torch.matmul(q, k.transpose(-1, -2)), dim=-1)
            return torch.matmul(p, v)
    else:
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.float16, generator=gen)
                   for _ in range(3))

        def call():
            return fdt.attention(q, k, v, schedule=schedule)
    with torch.no_grad():
        call()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(NVTX_RANGE)
        call()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


def profile(ncu, schedule, n, d):
    """(read bytes, write bytes, kernels) of one configuration, or an error string."""
    cmd = [ncu, "--nvtx", "--nvtx-include", f"{NVTX_RANGE}/", "--metrics", ",".join(METRICS),
           "--csv", "--print-units", "base", sys.executable, os.path.abspath(__file__),
           "--run-one", schedule, str(n), str(d)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"
    try:
        sums, kernels = parse_ncu_csv(res.stdout)
    except ValueError as e:
        tail = (res.stderr.strip().splitlines() or res.stdout.strip().splitlines() or [""])[-1]
        return f"{e} (ncu exit {res.returncode}: {tail[:200]})"
    return sums.get(METRICS[0], 0.0), sums.get(METRICS[1], 0.0), kernels


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--seqlens", default="4096,8192,16384")
    ap.add_argument("--headdims", default="64,128")
    ap.add_argument("--schedules", default="fa1,fa2,standard")
    ap.add_argument("--fa1-max-seqlen", type=int, default=8192,
                    help="fa1 re-reads O for every key block: slow at 16k, and ncu serialises")
    ap.add_argument("--standard-max-seqlen", type=int, default=8192,
                    help="standard attention holds batch * heads * N^2 scores twice")
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--run-one", nargs=3, metavar=("SCHEDULE", "N", "D"))
    args = ap.parse_args()
    if args.check:
        return check()
    if args.run_one:
        s, n, d = args.run_one
        return run_one(s, int(n), int(d))

    import torch

    from tables import emit, gpu_model, nvidia_driver

    if not torch.cuda.is_available():
        sys.exit("bench_cuda_io.py: torch sees no CUDA device")
    props = torch.cuda.get_device_properties(0)
    smem = getattr(props, "shared_memory_per_block_optin", 227 * 1024)
    lines = [f"# CUDA: HBM traffic of the forward, measured against the IO model "
             f"({datetime.date.today()})", "",
             f"- device: {gpu_model(torch)}, driver {nvidia_driver()}, torch {torch.__version__}, "
             f"CUDA {torch.version.cuda}",
             f"- command: `python benchmarks/bench_cuda_io.py --seqlens {args.seqlens} "
             f"--headdims {args.headdims} --schedules {args.schedules}`; "
             f"ncu metrics {', '.join(METRICS)} over the kernels of one call",
             f"- float16, not causal, 16k tokens per batch, 2048 // d heads; M = "
             f"{smem} bytes of shared memory per block = {smem // ELEM} float16 elements", "",
             "| schedule | N | d | batch x heads | kernels | DRAM read (MB) | DRAM write (MB) | "
             "total (MB) | N^2 d^2 / M (MB) | measured / N^2 d^2 / M | standard model (MB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    failed = False
    for sched in args.schedules.split(","):
        for d in (int(x) for x in args.headdims.split(",")):
            for n in (int(x) for x in args.seqlens.split(",")):
                if (sched == "fa1" and n > args.fa1_max_seqlen) or \
                        (sched == "standard" and n > args.standard_max_seqlen):
                    continue
                b, h = shape(n, d)
                model = flash_model_bytes(n, d, b, h, smem)
                std = standard_model_bytes(n, d, b, h)
                got = profile(args.ncu, sched, n, d)
                if isinstance(got, str):
                    failed = True
                    lines.append(f"| {sched} | {n} | {d} | {b} x {h} | error: {got} | | | | "
                                 f"{model / 1e6:.1f} | | {std / 1e6:.1f} |")
                else:
                    rd, wr, kernels = got
                    lines.append(f"| {sched} | {n} | {d} | {b} x {h} | {kernels} | {rd / 1e6:.1f} | "
                                 f"{wr / 1e6:.1f} | {(rd + wr) / 1e6:.1f} | {model / 1e6:.1f} | "
                                 f"{(rd + wr) / model:.3f} | {std / 1e6:.1f} |")
                print(lines[-1], flush=True)
    emit(lines, args.out)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
