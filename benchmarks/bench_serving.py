"""Serving on the CPU (issue 33): decoding with rotary fused into the cache call, and chunked
prefill over a paged cache against torch SDPA.

Run:  python benchmarks/bench_serving.py [--out benchmarks/results/serving_cpu.md] [--rounds 7]
      python benchmarks/bench_serving.py --quick     (small shapes, to check that it runs)

Heads 32 query / 8 key-value (GQA 4), head dim 128, in one process, variants timed side by side
in interleaved rounds (bench_decode.interleaved: a pause, untimed warm calls, a timed burst per
turn; medians over rounds), float32 and bfloat16.

- decode: batch 8, 4k keys (cache_seqlens 4095, one new key and value appended, causal),
  contiguous cache; flashdl.attention_with_kvcache without rotary against the same call with
  rotary_cos/rotary_sin (rotary_dim 128, GPT-NeoX pairs: q and the new key rotated inside the
  call). Target: fused / plain <= 1.1.
- chunked prefill: one sequence whose 16k keys sit in a paged cache (pages of 16 rows, a random
  permutation of the pool); the chunk of 256 new query rows at the end (keys 16,128..16,383, so
  it sees all 16k keys, causal bottom-right), and the chunk in the middle (8k keys), through
  flashdl.attention_varlen(block_table=...) (which gathers the pages, then runs the contiguous
  kernel: the gather is inside the time). Against torch.nn.functional.scaled_dot_product_attention
  on the same values already gathered, q (1, 32, 256, 128), k, v (1, 8, keys, 128), enable_gqa,
  and a bottom-right causal boolean mask (256, keys) made before timing (SDPA's is_causal is
  top-left aligned). Target: SDPA time / flashdl time >= 1.0. A third column times flashdl on
  the gathered contiguous keys (what the paged call costs beyond them: its gather).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform

import numpy as np

import flashdl
from bench_decode import fill, interleaved, np_dtype, to_torch
from tables import cpu_model, emit

H, HK, D, PAGE = 32, 8, 128, 16


def decode_times(dtype, batch, L, rounds, rng):
    dt = np_dtype(dtype)
    kc, vc = np.empty((batch, L, HK, D), dt), np.empty((batch, L, HK, D), dt)
    fill(kc, rng)
    fill(vc, rng)
    q = rng.standard_normal((batch, 1, H, D)).astype(dt)
    lens = np.full(batch, L - 1, np.int32)
    kn, vn = kc[:, L - 1:L].copy(), vc[:, L - 1:L].copy()
    ang = rng.random((L, D // 2)) * 2 * np.pi
    cos, sin = np.cos(ang).astype(dt), np.sin(ang).astype(dt)

    def call(**kw):
        return lambda: flashdl.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k=kn, v=vn,
                                                      causal=True, **kw)

    return interleaved({"plain": call(), "rotary": call(rotary_cos=cos, rotary_sin=sin)},
                       rounds)


def prefill_times(dtype, keys, chunk, rounds, rng, torch):
    import torch.nn.functional as F

    dt = np_dtype(dtype)
    pages = keys // PAGE
    kp, vp = np.empty((pages, PAGE, HK, D), dt), np.empty((pages, PAGE, HK, D), dt)
    fill(kp, rng)
    fill(vp, rng)
    table = rng.permutation(pages).astype(np.int32)[None]
    q = rng.standard_normal((chunk, H, D)).astype(dt)
    cu_q = np.array([0, chunk], np.int32)
    cu_k = np.array([0, keys], np.int32)
    # SDPA's inputs: the same values gathered, heads-major.
    kg, vg = kp[table[0]].reshape(keys, HK, D), vp[table[0]].reshape(keys, HK, D)
    tq = to_torch(torch, np.ascontiguousarray(q.transpose(1, 0, 2)))[None]
    tk = to_torch(torch, np.ascontiguousarray(kg.transpose(1, 0, 2)))[None]
    tv = to_torch(torch, np.ascontiguousarray(vg.transpose(1, 0, 2)))[None]
    i = torch.arange(chunk)[:, None] + (keys - chunk)
    mask = torch.arange(keys)[None, :] <= i

    def ours():
        flashdl.attention_varlen(q, kp, vp, cu_q, cu_k, chunk, keys, causal=True,
                                 block_table=table)

    def contiguous():  # the same call on the gathered keys: the gather's share of the time
        flashdl.attention_varlen(q, kg, vg, cu_q, cu_k, chunk, keys, causal=True)

    def sdpa():
        with torch.no_grad():
            F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, enable_gqa=True)

    # Same numbers first (float32: within rounding).
    if dtype == "float32":
        a = flashdl.attention_varlen(q, kp, vp, cu_q, cu_k, chunk, keys, causal=True,
                                     block_table=table)
        b = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, enable_gqa=True)
        err = float(np.abs(a - b[0].transpose(0, 1).numpy()).max())
        assert err < 1e-4, f"flashdl and SDPA disagree by {err}"
    return interleaved({"flashdl": ours, "contiguous": contiguous, "sdpa": sdpa}, rounds,
                       burst_s=0.0, warm_s=0.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    import torch

    rng = np.random.default_rng(0)
    batch, L = (2, 512) if args.quick else (8, 4096)
    chunk, key_counts = (64, [1024]) if args.quick else (256, [8192, 16384])
    rounds = 2 if args.quick else args.rounds
    lines = [f"# Serving on the CPU: fused rotary decode, paged chunked prefill vs SDPA",
             "",
             f"{cpu_model()}, {os.cpu_count()} cores, flashdl {flashdl.__version__} "
             f"({flashdl.info()['cpu_isa']}, {flashdl.info()['num_threads']} threads), torch "
             f"{torch.__version__} ({torch.get_num_threads()} threads), Python "
             f"{platform.python_version()}; {datetime.date.today()}. The machine was shared "
             "with other jobs: ratios of variants timed side by side in one process are what "
             "to read, not absolute times. `python benchmarks/bench_serving.py"
             f"{' --quick' if args.quick else ''} --rounds {rounds}`; medians of {rounds} "
             "interleaved rounds.", "",
             f"## Decode: batch {batch}, {L} keys, {H}/{HK} heads, d {D}, one key appended", "",
             "| dtype | plain ms | fused rotary ms | rotary / plain (target <= 1.1) |",
             "|---|---:|---:|---:|"]
    for dtype in ("float32", "bfloat16"):
        t = decode_times(dtype, batch, L, rounds, rng)
        lines.append(f"| {dtype} | {t['plain'] * 1e3:.2f} | {t['rotary'] * 1e3:.2f} | "
                     f"{t['rotary'] / t['plain']:.3f} |")
        print(lines[-1], flush=True)
    lines += ["", f"## Chunked prefill: {chunk} query rows at the end of a paged cache "
              f"(pages of {PAGE}), {H}/{HK} heads, d {D}, causal", "",
              "| dtype | keys | flashdl paged ms | flashdl contiguous ms | SDPA (gathered) ms "
              "| SDPA / flashdl paged (target >= 1.0) |", "|---|---:|---:|---:|---:|---:|"]
    for dtype in ("float32", "bfloat16"):
        for keys in key_counts:
            t = prefill_times(dtype, keys, chunk, rounds, rng, torch)
            lines.append(f"| {dtype} | {keys} | {t['flashdl'] * 1e3:.1f} | "
                         f"{t['contiguous'] * 1e3:.1f} | {t['sdpa'] * 1e3:.1f} | "
                         f"{t['sdpa'] / t['flashdl']:.2f} |")
            print(lines[-1], flush=True)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
