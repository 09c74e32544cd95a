"""What the score modifiers (ALiBi slopes, softcap) cost on the CPU, side by side with plain attention.

Run:  python benchmarks/bench_score_mods.py [--out benchmarks/results/score_mods_cpu.md] [--rounds 7]

The target (issue text): at (batch 1, 8 heads, seqlen 2048, headdim 64), fa2 forward with ALiBi at
most 10% and with softcap at most 25% slower than plain fa2 forward, measured in the same run.
Both modifiers are applied in the CPU kernels' score pass (src/cpu/simd.inl,
row_modified_range_max): ALiBi adds a subtract, an absolute value and a multiply-add per score;
softcap a 13/6 rational tanh (about 12 multiply-adds and a division per score), and in the
backward the stored 1 - tanh^2 and one more multiply of dS. Each score also costs the 2 x 64
multiply-adds of QK^T and PV each, so the elementwise work is a small part of the whole.
Every round runs every configuration once, in one process; medians over rounds.
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

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None


def alibi_slopes(nheads):
    """The ALiBi paper's slopes for a power-of-two head count: 2^(-8 h / nheads), h = 1..nheads."""
    return np.array([2.0 ** (-8.0 * (h + 1) / nheads) for h in range(nheads)], np.float32)


MODS = {
    "plain": {},
    "alibi": {"alibi_slopes": None},  # filled per head count
    "softcap 30": {"softcap": 30.0},
    "alibi + softcap": {"alibi_slopes": None, "softcap": 30.0},
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the markdown table here")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seqlen", type=int, default=2048)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    b, h, s, d = 1, 8, args.seqlen, 64
    slopes = alibi_slopes(h)

    dtypes = ["float32"] + (["bfloat16"] if ml_dtypes is not None else [])
    inputs = {}
    for dt in dtypes:
        arrs = [rng.standard_normal((b, s, h, d)).astype(np.float32) for _ in range(4)]
        if dt == "bfloat16":
            arrs = [a.astype(ml_dtypes.bfloat16) for a in arrs]
        inputs[dt] = arrs

    def opts_of(mod):
        o = dict(MODS[mod])
        if "alibi_slopes" in o:
            o["alibi_slopes"] = slopes
        return o

    # (dtype, schedule, causal, pass, modifier) -> callable
    runs = {}
    for dt in dtypes:
        q, k, v, dout = inputs[dt]
        for sched in ("fa2", "fa1"):
            for causal in (False, True):
                if sched == "fa1" and (causal or dt != "float32"):
                    continue  # fa1: one configuration is enough to show the same kernels' cost
                for mod in MODS:
                    o = dict(opts_of(mod), causal=causal, schedule=sched)

                    def fwd(o=o, q=q, k=k, v=v):
                        return flashdl.attention(q, k, v, return_lse=True, **o)

                    out, lse = fwd()

                    def bwd(o=o, q=q, k=k, v=v, out=out, lse=lse, dout=dout):
                        flashdl.attention_backward(dout, q, k, v, out, lse, **o)

                    runs[(dt, sched, causal, "fwd", mod)] = fwd
                    runs[(dt, sched, causal, "bwd", mod)] = bwd

    times = {key: [] for key in runs}
    for fn in runs.values():  # warm-up
        fn()
    for _ in range(args.rounds):
        for key, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    med = {key: statistics.median(t) for key, t in times.items()}

    info = flashdl.info()
    lines = [
        f"# CPU: what ALiBi and softcap cost ({datetime.date.today()})",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} logical CPUs, {platform.system()} "
        f"{platform.machine()}",
        f"- flashdl {info['version']}, CPU kernels `{info['cpu_isa']}`, "
        f"{info['num_threads']} threads; batch {b}, {h} heads, seqlen {s}, headdim {d}; ALiBi "
        "slopes 2^(-8h/8), softcap 30",
        f"- command: `python benchmarks/bench_score_mods.py --rounds {args.rounds}`; medians of "
        f"{args.rounds} rounds, all configurations interleaved in one process",
        "- targets: fa2 forward with ALiBi <= 1.10x, with softcap <= 1.25x plain (float32, "
        "not causal, the first rows)",
        "",
        "| dtype | schedule | causal | pass | plain ms | alibi | softcap 30 | alibi + softcap |",
        "|---|---|---|---|---|---|---|---|",
    ]
    seen = []
    for (dt, sched, causal, pass_, _mod) in runs:
        row = (dt, sched, causal, pass_)
        if row in seen:
            continue
        seen.append(row)
        base = med[row + ("plain",)]
        cells = [f"{med[row + (m,)] * 1e3:.1f} ms ({med[row + (m,)] / base:.3f}x)"
                 for m in MODS if m != "plain"]
        lines.append(f"| {dt} | {sched} | {'yes' if causal else 'no'} | {pass_} | "
                     f"{base * 1e3:.1f} | " + " | ".join(cells) + " |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
