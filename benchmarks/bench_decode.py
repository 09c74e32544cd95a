"""Decoding on the CPU: flashdl.attention_with_kvcache against the machine's copy bandwidth and
torch SDPA.

Run:  python benchmarks/bench_decode.py [--out benchmarks/results/decode_cpu.md] [--rounds 5]
      python benchmarks/bench_decode.py --quick      (a small subset, to check that it runs)

One decode step: seqlen_q 1, nheads 32, nheads_kv 8 (GQA 4), headdim 128, batch 1, 8, 32, cache
lengths L 1k, 4k, 16k, 64k (combinations whose k and v caches exceed --max-gib, 3 GiB, are
skipped), bfloat16 (ml_dtypes) and float32. Each call appends one new key and value at position
L - 1 (cache_seqlens = L - 1) and attends over all L keys, causal; the row it writes is the same
every call, so the cache does not change between rounds.

- contiguous: caches (batch, L, 8, 128). paged: the same memory seen as pages of 16 rows,
  (batch * L / 16, 16, 8, 128), each sequence's block_table a random permutation of the pages
  (scattered reads). heads-major: a (batch, 8, L, 128) copy passed as its transposed
  (batch, L, 8, 128) view (any strides with a contiguous last dimension are accepted): each kv
  head's keys contiguous, the layout SDPA reads (a diagnostic row: how much of the time is the
  access pattern of the standard layout). This copy doubles the memory a configuration holds.
- KV GB/s: the bytes of k and v the step must read, 2 * batch * L * 8 * 128 * itemsize, over its
  time. Decoding is bound by this read; the reference is the machine's copy bandwidth, measured in
  the same run: np.copyto between two --copy-mib (512 MiB) buffers, best of 5, counting the read
  side only (bytes copied / time, not the 2x that also counts the write). np.copyto is one thread;
  the copy split over flashdl's thread count (NumPy releases the GIL) is shown as well. Target:
  KV GB/s / copy GB/s >= 0.7.
- SDPA: torch.nn.functional.scaled_dot_product_attention on the CPU with q (batch, 32, 1, 128) and
  contiguous k, v (batch, 8, L, 128) (its own copy of the same values), enable_gqa=True (or k, v
  repeated to 32 heads beforehand where this torch lacks enable_gqa: the header says which),
  is_causal=False (one query row sees every key, as the causal flashdl call's does). Target:
  flashdl / SDPA speed >= 2.
- num_splits: at batch 1, num_splits=1 (one task: a task is a (sequence, key split) and reads
  every kv head of its keys, so one thread works) against the automatic choice (0: splits of at
  least 512 keys, two tasks per thread), contiguous cache.
Per configuration the variants are timed in interleaved rounds: each round gives every variant a
turn -- a 50 ms pause (torch's OpenMP threads keep spinning for a while after SDPA returns and,
on a small machine, would slow whatever runs next by ~2x), ~30 ms of untimed calls (at least one:
right after an idle pause the machine runs slow for a while; a float32 step over 4k keys took
3.2-4.2 ms in a 20 ms burst straight after the pause, 2.25 ms in steady state), then a ~20 ms
burst of back-to-back calls (up to 50) whose mean is the round's sample; medians over rounds. Caches of
a few MiB (batch 1, 1k) stay in the last-level cache across a burst, so their "KV GB/s" can exceed
the DRAM copy bandwidth.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import threading
import time

import numpy as np

import flashdl
from tables import cpu_model, emit

H, HK, D, PAGE = 32, 8, 128, 16
KIB = 1024


def np_dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def fill(arr, rng):
    """Random normal values, cheaply: a 1 MiB random block repeated over arr (C-contiguous)."""
    flat = arr.reshape(-1)
    block = rng.standard_normal(min(flat.size, 1 << 18)).astype(np.float32).astype(arr.dtype)
    for i in range(0, flat.size, block.size):
        n = min(block.size, flat.size - i)
        flat[i:i + n] = block[:n]


def copy_bandwidth(mib, threads, tries=5):
    """(one-thread, threaded) bytes read per second of np.copyto between two mib-MiB buffers."""
    n = mib * 2**20 // 8
    src, dst = np.ones(n, np.float64), np.zeros(n, np.float64)

    def once(parts):
        chunks = np.array_split(np.arange(n), parts)
        bounds = [(c[0], c[-1] + 1) for c in chunks if c.size]
        if parts == 1:
            t = time.perf_counter()
            np.copyto(dst, src)
            return time.perf_counter() - t
        workers = [threading.Thread(target=np.copyto, args=(dst[a:z], src[a:z]))
                   for a, z in bounds]
        t = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return time.perf_counter() - t

    one = min(once(1) for _ in range(tries))
    many = min(once(threads) for _ in range(tries)) if threads > 1 else one
    return src.nbytes / one, src.nbytes / many


def torch_sdpa(torch):
    """The SDPA call and how it handles GQA ("enable_gqa=True" or "repeat_interleave")."""
    import torch.nn.functional as F

    q = torch.zeros(1, H, 1, D)
    kv = torch.zeros(1, HK, 4, D)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)), \
            "enable_gqa=True"
    except TypeError:
        return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v)), \
            "k, v repeat_interleave'd to 32 heads before timing (no enable_gqa)"


def to_torch(torch, x):
    if x.dtype == np_dtype("bfloat16"):
        return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def interleaved(fns, rounds, burst_s=0.02, pause_s=0.05, warm_s=0.03):
    """Seconds per call of each fn: median over `rounds` rounds, each running every fn in turn.
    A turn is a pause (the previous fn's runtime -- torch's OpenMP threads spin after a parallel
    region and would otherwise steal the cores from the next fn), untimed calls for about warm_s
    (at least one: the machine is back at speed), then a burst of back-to-back calls lasting
    about burst_s, whose mean is the sample."""
    count = {}
    for name, fn in fns.items():  # warm-up, and the burst length
        fn()
        t = time.perf_counter()
        fn()
        count[name] = max(1, min(50, int(burst_s / max(time.perf_counter() - t, 1e-6))))
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            time.sleep(pause_s)
            t = time.perf_counter()
            fn()
            while time.perf_counter() - t < warm_s:
                fn()
            t = time.perf_counter()
            for _ in range(count[name]):
                fn()
            times[name].append((time.perf_counter() - t) / count[name])
    return {name: statistics.median(ts) for name, ts in times.items()}


def measure(dtype, b, L, rounds, torch, sdpa, gqa_mode, rng, with_torch):
    dt = np_dtype(dtype)
    kc = np.empty((b, L, HK, D), dt)
    vc = np.empty((b, L, HK, D), dt)
    fill(kc, rng)
    fill(vc, rng)
    q = rng.standard_normal((b, 1, H, D)).astype(dt)
    lens = np.full(b, L - 1, np.int32)
    pages_per_seq = L // PAGE
    kp = kc.reshape(b * pages_per_seq, PAGE, HK, D)
    vp = vc.reshape(b * pages_per_seq, PAGE, HK, D)
    table = rng.permutation(b * pages_per_seq).astype(np.int32).reshape(b, pages_per_seq)
    # The appended key and value are the rows already at position L - 1 (of each layout's view of
    # the shared memory): every call rewrites the same values and the cache never changes.
    kn, vn = kc[:, L - 1:L].copy(), vc[:, L - 1:L].copy()
    kn_p = kp[table[:, -1], PAGE - 1][:, None].copy()
    vn_p = vp[table[:, -1], PAGE - 1][:, None].copy()
    # Heads-major copy (batch, 8, L, 128): SDPA's input, and flashdl's through a transposed view.
    kh = np.ascontiguousarray(kc.transpose(0, 2, 1, 3))
    vh = np.ascontiguousarray(vc.transpose(0, 2, 1, 3))
    kh_view, vh_view = kh.transpose(0, 2, 1, 3), vh.transpose(0, 2, 1, 3)

    def fd(**kw):
        return lambda: flashdl.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k=kn, v=vn,
                                                      causal=True, **kw)

    fns = {"contiguous": fd(),
           "paged": lambda: flashdl.attention_with_kvcache(q, kp, vp, cache_seqlens=lens, k=kn_p,
                                                           v=vn_p, block_table=table,
                                                           causal=True),
           "heads-major": lambda: flashdl.attention_with_kvcache(
               q, kh_view, vh_view, cache_seqlens=lens, k=kn, v=vn, causal=True)}
    if b == 1:
        fns["num_splits=1"] = fd(num_splits=1)
    diff = None
    if with_torch:
        tq = to_torch(torch, np.ascontiguousarray(q.transpose(0, 2, 1, 3)))
        tk, tv = to_torch(torch, kh), to_torch(torch, vh)
        if not gqa_mode.startswith("enable"):
            tk, tv = tk.repeat_interleave(H // HK, dim=1), tv.repeat_interleave(H // HK, dim=1)

        def run_sdpa():
            with torch.no_grad():
                sdpa(tq, tk, tv)

        fns["SDPA"] = run_sdpa
        # Both compute the same attention (to bf16 or float32 rounding).
        with torch.no_grad():
            ref = sdpa(tq, tk, tv).float().transpose(1, 2).numpy()
        diff = float(np.max(np.abs(ref - np.asarray(fns["contiguous"](), np.float32))))
    t = interleaved(fns, rounds)
    return t, 2 * kc.nbytes, diff


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the markdown table here")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true",
                    help="batch 1 and 8, cache lengths 1k and 4k, 256 MiB copy (checks it runs)")
    ap.add_argument("--max-gib", type=float, default=3.0,
                    help="skip configurations whose k and v caches exceed this (GiB)")
    ap.add_argument("--copy-mib", type=int, default=512, help="copy-bandwidth buffer (>= 256)")
    args = ap.parse_args()
    if args.quick:
        batches, lengths, args.copy_mib = (1, 8), (1 * KIB, 4 * KIB), 256
    else:
        batches, lengths = (1, 8, 32), (1 * KIB, 4 * KIB, 16 * KIB, 64 * KIB)
    dtypes = ("bfloat16", "float32")
    try:
        import torch
    except ImportError:
        torch = None
    sdpa, gqa_mode = torch_sdpa(torch) if torch is not None else (None, None)
    info = flashdl.info()
    threads = info["num_threads"]
    copy1, copyn = copy_bandwidth(max(256, args.copy_mib), threads)
    print(f"copy bandwidth (read side): np.copyto {copy1 / 1e9:.2f} GB/s, split over {threads} "
          f"threads {copyn / 1e9:.2f} GB/s", flush=True)
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        mem = float("inf")

    rng = np.random.default_rng(0)
    rows, split_rows, skipped = [], [], []
    for dtype in dtypes:
        for b in batches:
            for L in lengths:
                kv = 2 * b * L * HK * D * np_dtype(dtype).itemsize
                if kv > args.max_gib * 2**30:
                    skipped.append(f"{dtype} batch {b} L {L // KIB}k ({kv / 2**30:.0f} GiB)")
                    continue
                # The heads-major copy, and SDPA's 4x repeat without enable_gqa.
                extra = kv * (1 if gqa_mode is None or gqa_mode.startswith("enable") else 5)
                if 2 * kv > 0.8 * mem:
                    skipped.append(f"{dtype} batch {b} L {L // KIB}k (memory)")
                    continue
                with_torch = torch is not None and kv + extra < 0.8 * mem
                t, nbytes, diff = measure(dtype, b, L, args.rounds, torch, sdpa, gqa_mode, rng,
                                          with_torch)
                for layout in ("contiguous", "paged", "heads-major"):
                    bw = nbytes / t[layout]
                    sd = t.get("SDPA") if layout == "contiguous" else None
                    rows.append(dict(dtype=dtype, b=b, L=L, layout=layout, gib=nbytes / 2**30,
                                     ms=t[layout] * 1e3, bw=bw, frac=bw / copy1,
                                     sdpa=None if sd is None else sd * 1e3,
                                     speed=None if sd is None else sd / t[layout], diff=diff))
                r = rows[-3]
                print(f"{dtype:8s} b {b:2d} L {L // KIB:2d}k  contiguous {r['ms']:8.2f} ms "
                      f"{r['bw'] / 1e9:6.2f} GB/s ({r['frac']:.2f} of copy)  paged "
                      f"{rows[-2]['ms']:8.2f} ms  heads-major {rows[-1]['ms']:8.2f} ms"
                      + ("" if r["sdpa"] is None else
                         f"  SDPA {r['sdpa']:8.2f} ms (x{r['speed']:.2f})"), flush=True)
                if "num_splits=1" in t:
                    split_rows.append(dict(dtype=dtype, L=L, auto=t["contiguous"] * 1e3,
                                           one=t["num_splits=1"] * 1e3))

    def fmt(x, f):
        return "-" if x is None else format(x, f)

    lines = [
        f"# CPU: decoding with a KV cache ({datetime.date.today()})",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} logical CPUs, {platform.system()} "
        f"{platform.machine()}",
        f"- flashdl {info['version']}, CPU kernels `{info['cpu_isa']}`, {threads} threads"
        + ("" if torch is None else f"; torch {torch.__version__}, {torch.get_num_threads()} "
           f"threads, SDPA with {gqa_mode}"),
        f"- command: `python benchmarks/bench_decode.py --rounds {args.rounds}"
        + (" --quick" if args.quick else "") + "`; per configuration, medians of "
        f"{args.rounds} interleaved rounds (per round and variant: 50 ms pause, ~30 ms of untimed "
        "calls, the mean of a ~20 ms burst of calls)",
        f"- one decode step: seqlen_q 1, {H} heads, {HK} kv heads, headdim {D}, causal, one key "
        f"appended (cache_seqlens = L - 1); paged: pages of {PAGE} rows in random order; "
        "heads-major: a (batch, 8, L, 128) cache passed as a transposed view",
        "- copy bandwidth, read side (bytes copied / time), best of 5 over "
        f"{max(256, args.copy_mib)} MiB: np.copyto (one thread) **{copy1 / 1e9:.2f} GB/s**; "
        f"split over {threads} threads {copyn / 1e9:.2f} GB/s. The ratio column divides by "
        "np.copyto's",
        "",
        "| dtype | batch | L | cache | KV GiB | flashdl ms | KV GB/s | / copy (>= 0.7) | SDPA ms "
        "| flashdl / SDPA speed (>= 2) | max abs diff vs SDPA |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['b']} | {r['L'] // KIB}k | {r['layout']} | {r['gib']:.3f} | "
            f"{r['ms']:.2f} | {r['bw'] / 1e9:.2f} | {r['frac']:.2f} | {fmt(r['sdpa'], '.2f')} | "
            f"{fmt(r['speed'], '.2f')} | "
            f"{fmt(r['diff'] if r['layout'] == 'contiguous' else None, '.1e')} |")
    if skipped:
        lines += ["", f"Skipped (k and v caches above {args.max_gib:g} GiB): "
                  + ", ".join(skipped) + "."]
    lines += [
        "",
        "num_splits at batch 1 (contiguous cache): one split (one task, one busy thread) against "
        "the automatic choice:",
        "",
        "| dtype | L | auto ms | num_splits=1 ms | num_splits=1 / auto time |",
        "|---|---|---|---|---|",
    ]
    for r in split_rows:
        lines.append(f"| {r['dtype']} | {r['L'] // KIB}k | {r['auto']:.2f} | {r['one']:.2f} | "
                     f"{r['one'] / r['auto']:.2f} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
