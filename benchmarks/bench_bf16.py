"""bfloat16 attention on the CPU against the machine's bfloat16 matrix-product speed, side by side.

Run:  python benchmarks/bench_bf16.py [--out benchmarks/results/bf16_cpu.md] [--rounds 9]

In one process, interleaved: torch's bfloat16 and float32 matrix products (2048^3, the speed the
hardware offers, as torch reaches it), and flashdl's fa2 at (1, 8, 2048, 64) and (1, 8, 4096, 128)
in bfloat16 (forward, forward+backward) and float32 (forward), with every CPU kernel copy this
machine runs (FLASHDL_CPU_ISA: avx512bf16 multiplies bfloat16 pairs, avx512 widens to float32).
Each copy runs in its own subprocess (the copy is picked once per process); the matrix products
run in each subprocess too, so every ratio compares numbers taken seconds apart.
FLOPs: flash-attn's count (forward 4*b*h*s^2*d, forward+backward 3.5x that); a product 2*n^3.

Targets: bfloat16 fa2 forward >= 0.85x torch's bfloat16 matmul GFLOP/s and forward+backward
>= 0.45x; float32 forward >= 1.0x torch's float32 matmul GFLOP/s. Each ratio is printed from the
medians of the rounds, from their best (fastest) times, and as the median of the rounds' own
ratios (each run against the matmul of its round, about a second apart): on a shared machine
whose capacity comes and goes, a single matmul round of ~40 ms swings by a third, and the paired
rounds and the best rounds are the steadier comparisons of what the two reach.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

SHAPES = [(1, 2048, 8, 64), (1, 4096, 8, 128)]
TARGETS = {("bfloat16", "fwd"): 0.85, ("bfloat16", "fwd+bwd"): 0.45, ("float32", "fwd"): 1.0}


def base_of(name):
    """The matmul run an attention run is compared with: torch's matmul of its dtype."""
    return "matmul float32" if "float32" in name else "matmul bfloat16"


def measure(rounds):
    """One kernel copy (this process's FLASHDL_CPU_ISA): every timing, medians over rounds."""
    import ml_dtypes
    import numpy as np
    import torch

    import flashdl

    rng = np.random.default_rng(0)
    n = 2048
    mats = {dt: [torch.randn(n, n, dtype=dt) for _ in range(2)] for dt in (torch.bfloat16,
                                                                          torch.float32)}
    runs = {}
    for dt, (a, b) in mats.items():
        runs[f"matmul {str(dt).split('.')[1]}"] = (lambda a=a, b=b: torch.mm(a, b), 2.0 * n ** 3)
    for b, s, h, d in SHAPES:
        flops = 4.0 * b * h * s * s * d
        for name, dtype in (("bfloat16", ml_dtypes.bfloat16), ("float32", np.float32)):
            q, k, v = (rng.standard_normal((b, s, h, d)).astype(dtype) for _ in range(3))
            runs[f"fa2 {name} fwd {s}x{d}"] = (
                lambda q=q, k=k, v=v: flashdl.attention(q, k, v, schedule="fa2"), flops)
            if name == "bfloat16":
                def fwd_bwd(q=q, k=k, v=v):
                    out, lse = flashdl.attention(q, k, v, schedule="fa2", return_lse=True)
                    flashdl.attention_backward(out, q, k, v, out, lse, schedule="fa2")
                runs[f"fa2 {name} fwd+bwd {s}x{d}"] = (fwd_bwd, 3.5 * flops)
    for fn, _ in runs.values():
        fn()
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (fn, _) in runs.items():
            time.sleep(0.2)  # let the other library's spinning threads settle
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    # Round by round, each attention run against its dtype's matmul of the same round (taken
    # about a second apart): the median of those ratios follows the machine's capacity as it
    # comes and goes, where a ratio of medians pairs rounds that ran under different loads.
    paired = {name: statistics.median(
        (runs[name][1] / t) / (runs[base_of(name)][1] / tb)
        for t, tb in zip(times[name], times[base_of(name)]))
        for name in times if not name.startswith("matmul")}
    return {"isa": flashdl.info()["cpu_isa"], "threads": flashdl.info()["num_threads"],
            "gflops": {name: runs[name][1] / statistics.median(t) / 1e9
                       for name, t in times.items()},
            "best": {name: runs[name][1] / min(t) / 1e9 for name, t in times.items()},
            "paired": paired}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the markdown table here")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--isas", default="avx512bf16,avx512", help="kernel copies to run")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.rounds)))
        return

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tables import cpu_model, emit

    results = []
    for isa in args.isas.split(","):
        env = dict(os.environ, FLASHDL_CPU_ISA=isa)
        run = subprocess.run([sys.executable, __file__, "--child", "--rounds", str(args.rounds)],
                             env=env, capture_output=True, text=True)
        if run.returncode != 0:
            print(f"{isa}: skipped ({run.stderr.strip().splitlines()[-1:]})")
            continue
        results.append(json.loads(run.stdout.strip().splitlines()[-1]))
    import torch

    import flashdl

    lines = [f"# bfloat16 attention against the bfloat16 matrix product ({cpu_model()}, "
             f"{os.cpu_count()} cores)", "",
             f"{datetime.date.today()}, flashdl {flashdl.__version__}, torch {torch.__version__}, "
             f"Python {platform.python_version()}; GFLOP/s, median and best of {args.rounds} "
             "rounds; "
             f"`python benchmarks/bench_bf16.py --rounds {args.rounds}`", ""]
    for r in results:
        g, best = r["gflops"], r["best"]
        lines += [f"## FLASHDL_CPU_ISA={r['isa']} ({r['threads']} threads)", "",
                  f"torch matmul 2048^3: bfloat16 {g['matmul bfloat16']:.0f} GFLOP/s (best "
                  f"{best['matmul bfloat16']:.0f}), float32 {g['matmul float32']:.0f} (best "
                  f"{best['matmul float32']:.0f})", "",
                  "| fa2 | GFLOP/s (median) | / torch matmul of its dtype | GFLOP/s (best) "
                  "| / torch matmul (best) | / torch matmul (paired rounds) | target |",
                  "|---|---|---|---|---|---|---|"]
        for name, val in g.items():
            if name.startswith("matmul"):
                continue
            base = base_of(name)
            target = TARGETS[(name.split()[1], name.split()[2])]
            lines.append(f"| {name[4:]} | {val:.0f} | {val / g[base]:.2f}x | {best[name]:.0f} "
                         f"| {best[name] / best[base]:.2f}x | {r['paired'][name]:.2f}x "
                         f"| >= {target}x |")
        lines.append("")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
