"""What sliding windows, dropout and variable-length batches cost on the CPU, side by side.

Run:  python benchmarks/bench_features.py [--out benchmarks/results/features_cpu.md] [--rounds 5]

- Sliding windows, causal, window_size=(w, 0) against plain causal attention at seqlen 4096: tiles
  outside the window are skipped, so time should follow the fraction of fa2's 48 x 96 tile pairs
  the window touches (tiles at its edges are computed whole and masked), which is larger than the
  visible fraction of the causal triangle, (w / N) * (2 - w / N).
- Dropout at p = 0.1 against p = 0: the counter-based Philox mask is recomputed per element in the
  forward and again in the backward, so this is its whole price.
- Variable length: 16 sequences of random lengths 64..1024 packed (attention_varlen) against the
  same batch padded to the longest sequence and run dense (what a padded batch pays), and against
  the total work of the sequences alone. Sequences run one after another, each parallel over its
  heads and query blocks.
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


def timed(fn, store):
    t0 = time.perf_counter()
    fn()
    store.append(time.perf_counter() - t0)


def fwd_bwd(q, k, v, dout, **opts):
    out, lse = flashdl.attention(q, k, v, return_lse=True, **opts)
    flashdl.attention_backward(dout, q, k, v, out, lse, **opts)


def varlen_fwd_bwd(q, k, v, dout, cu, max_len, **opts):
    out, lse = flashdl.attention_varlen(q, k, v, cu, cu, max_len, max_len, return_lse=True, **opts)
    flashdl.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, max_len, max_len, **opts)


def tile_pairs(n, window, br=48, bc=96):
    """Tile pairs fa2 computes for causal attention over n rows with window (window, 0)
    (window -1: unbounded): per query tile, the key tiles from its first visible key to its last."""
    pairs = 0
    for i0 in range(0, n, br):
        i1 = min(n, i0 + br)
        lo = 0 if window < 0 else max(0, i0 - window)
        pairs += -(-i1 // bc) - lo // bc
    return pairs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the markdown table here")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    h, d = 8, 64

    # Dense inputs for windows and dropout.
    s = 4096
    q, k, v, dout = (rng.standard_normal((1, s, h, d)).astype(np.float32) for _ in range(4))
    runs = {}  # name -> (forward fn, forward+backward fn, prediction)
    for w in (-1, 2048, 1024, 512, 256):
        opts = dict(causal=True, window_size=(w, 0))
        visible = 1.0 if w < 0 else (w / s) * (2 - w / s)
        runs[f"causal, window ({w}, 0)"] = (
            lambda o=opts: flashdl.attention(q, k, v, **o),
            lambda o=opts: fwd_bwd(q, k, v, dout, **o),
            (visible, tile_pairs(s, w) / tile_pairs(s, -1)))
    for p in (0.0, 0.1):
        opts = dict(dropout_p=p, seed=1)
        runs[f"dropout p={p}"] = (lambda o=opts: flashdl.attention(q, k, v, **o),
                                  lambda o=opts: fwd_bwd(q, k, v, dout, **o), None)

    # A varlen batch, packed and padded.
    lens = rng.integers(64, 1025, size=16)
    total, longest = int(lens.sum()), int(lens.max())
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    pq, pk, pv, pd = (rng.standard_normal((total, h, d)).astype(np.float32) for _ in range(4))
    padded = [np.zeros((len(lens), longest, h, d), np.float32) for _ in range(4)]
    for b, n in enumerate(lens):
        for dst, src in zip(padded, (pq, pk, pv, pd)):
            dst[b, :n] = src[cu[b]:cu[b + 1]]
    useful = float(np.sum(lens.astype(np.float64) ** 2)) / (len(lens) * longest ** 2)
    runs["varlen packed"] = (
        lambda: flashdl.attention_varlen(pq, pk, pv, cu, cu, longest, longest),
        lambda: varlen_fwd_bwd(pq, pk, pv, pd, cu, longest), useful)
    runs["varlen padded to the longest"] = (
        lambda: flashdl.attention(*padded[:3]),
        lambda: fwd_bwd(*padded), 1.0)

    times = {name: ([], []) for name in runs}
    for name, (f, fb, _) in runs.items():  # warm-up
        f()
        fb()
    for _ in range(args.rounds):
        for name, (f, fb, _) in runs.items():
            timed(f, times[name][0])
            timed(fb, times[name][1])
    med = {name: (statistics.median(a), statistics.median(b)) for name, (a, b) in times.items()}

    info = flashdl.info()
    lines = [
        f"# CPU: what windows, dropout and varlen cost ({datetime.date.today()})",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} logical CPUs, {platform.system()} "
        f"{platform.machine()}",
        f"- flashdl {info['version']}, CPU kernels `{info['cpu_isa']}`, "
        f"{info['num_threads']} threads, fa2, float32, {h} heads, headdim {d}",
        f"- command: `python benchmarks/bench_features.py --rounds {args.rounds}`; medians of "
        f"{args.rounds} rounds, all configurations interleaved in one process",
        "",
        f"Sliding windows, seqlen {s}, as a fraction of plain causal attention; predicted: the "
        "fraction of fa2's 48 x 96 tile pairs computed (the visible fraction of the causal "
        "triangle, (w/N)(2 - w/N), for comparison):",
        "",
        "| window | fwd ms | fwd ratio | fwd+bwd ms | fwd+bwd ratio | tile pairs | visible |",
        "|---|---|---|---|---|---|---|",
    ]
    base_f, base_fb = med["causal, window (-1, 0)"]
    for name, (_, _, (visible, pairs)) in ((n, r) for n, r in runs.items()
                                            if n.startswith("causal")):
        f, fb = med[name]
        lines.append(f"| {name} | {f * 1e3:.1f} | {f / base_f:.3f} | {fb * 1e3:.1f} | "
                     f"{fb / base_fb:.3f} | {pairs:.3f} | {visible:.3f} |")
    f0, fb0 = med["dropout p=0.0"]
    f1, fb1 = med["dropout p=0.1"]
    lines += [
        "",
        f"Dropout, seqlen {s}, not causal:",
        "",
        "| dropout_p | fwd ms | fwd+bwd ms |",
        "|---|---|---|",
        f"| 0 | {f0 * 1e3:.1f} | {fb0 * 1e3:.1f} |",
        f"| 0.1 | {f1 * 1e3:.1f} ({f1 / f0:.2f}x) | {fb1 * 1e3:.1f} ({fb1 / fb0:.2f}x) |",
        "",
        f"Variable length: {len(lens)} sequences of lengths 64..1024 (total {total}, longest "
        f"{longest}); the padded batch computes {1 / useful:.2f}x the useful work:",
        "",
        "| batch | fwd ms | fwd+bwd ms | time / padded time | useful work / padded work |",
        "|---|---|---|---|---|",
    ]
    pf, pfb = med["varlen padded to the longest"]
    for name in ("varlen packed", "varlen padded to the longest"):
        f, fb = med[name]
        lines.append(f"| {name[7:]} | {f * 1e3:.1f} | {fb * 1e3:.1f} | {f / pf:.3f} fwd, "
                     f"{fb / pfb:.3f} fwd+bwd | {runs[name][2]:.3f} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
