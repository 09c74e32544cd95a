"""Reads the per-instruction CSV that gpu_check.sh's `profile_source` step writes (Nsight Compute's
source page, SASS, with warp stall sampling) and says where a kernel's warps wait:

    python tools/explain_source.py OUTDIR/source_backward.csv [--top 25] [--context 3]

Prints the samples by stall reason, by opcode (with how many times each ran), and the hottest
instructions, each with the reasons it was sampled at and the instructions before it (the one a
stalled warp waits at is usually held up by a result or a barrier the ones before it produce).
"""
from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import Counter


def read(path):
    """(kernel name, rows): each row a dict of the CSV's columns, in address order."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    name = ""
    start = 0
    for i, line in enumerate(lines):
        if line.startswith('"Kernel Name"'):
            name = next(csv.reader([line]))[1]
        if line.startswith('"Address"'):
            start = i
            break
    else:
        raise SystemExit(f"{path}: no 'Address' header: not an ncu source page CSV")
    rows = list(csv.DictReader(lines[start:]))
    return name, rows


def num(x):
    try:
        return int(float(x))
    except (TypeError, ValueError):
        return 0


def opcode(src):
    """The instruction's opcode without predicate, e.g. 'HMMA.16816.F32' -> 'HMMA'."""
    s = src.strip()
    s = re.sub(r"^@!?U?P\w+\s+", "", s)
    return s.split(" ", 1)[0].split(".", 1)[0] if s else "?"


def reasons(row, not_issued=False):
    out = {}
    for k, v in row.items():
        if k and k.startswith("stall_") and (k.endswith("(Not Issued)") == not_issued):
            n = num(v)
            if n:
                out[k.replace(" (Not Issued)", "")[len("stall_"):]] = n
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25, help="hottest instructions to list")
    ap.add_argument("--context", type=int, default=3, help="instructions shown before each")
    args = ap.parse_args(argv)
    name, rows = read(args.csv)
    samples = [num(r.get("Warp Stall Sampling (All Samples)")) for r in rows]
    total = sum(samples) or 1
    print(f"kernel: {name[:160]}")
    print(f"instructions: {len(rows)}; samples: {total}")

    by_reason = Counter()
    for r in rows:
        by_reason.update(reasons(r))
    print("\nsamples by stall reason:")
    for k, v in by_reason.most_common():
        print(f"  {k:18s} {v:8d}  {100 * v / total:5.1f}%")

    by_op, runs = Counter(), Counter()
    for r, s in zip(rows, samples):
        op = opcode(r.get("Source", ""))
        by_op[op] += s
        runs[op] += num(r.get("Instructions Executed"))
    print("\nsamples by opcode (warp-level instructions executed beside):")
    for k, v in by_op.most_common(20):
        print(f"  {k:10s} {v:8d}  {100 * v / total:5.1f}%   executed {runs[k]:>14,d}")

    print(f"\nhottest {args.top} instructions:")
    order = sorted(range(len(rows)), key=lambda i: -samples[i])[:args.top]
    for i in sorted(order):
        rs = ", ".join(f"{k} {v}" for k, v in sorted(reasons(rows[i]).items(),
                                                    key=lambda kv: -kv[1])[:3])
        for j in range(max(0, i - args.context), i):
            print(f"      {rows[j]['Address'][-5:]}  {rows[j]['Source'].strip()[:90]}")
        print(f"  >>> {rows[i]['Address'][-5:]}  {rows[i]['Source'].strip()[:90]}"
              f"   [{samples[i]} = {100 * samples[i] / total:.1f}%: {rs}]")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
