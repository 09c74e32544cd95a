"""flashdl on the CPU against torch.nn.functional.scaled_dot_product_attention, side by side.

Run:  python benchmarks/bench_cpu.py [--out benchmarks/results/cpu.md]

Speed: (batch 1, heads 8, seqlen 2048, headdim 64), causal and not; forward float32, forward+backward
bfloat16 and float32. Each measurement alternates flashdl and torch runs in one process and takes the
median, so both see the same machine state; the table reports the ratio flashdl / torch in speed.
FLOPs follow flash-attn's count: forward 4*b*h*sq*sk*d (halved when causal), backward 2.5x that.

Memory: a float32 forward at seqlen 16384, 8 heads, headdim 64 in a fresh subprocess; the peak RSS
added beyond its inputs and outputs (kernel high-water mark, reset through /proc/self/clear_refs).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time

import flashdl
from tables import attention_flops, cpu_model, emit

TARGETS = {  # (dtype, pass) -> minimum speed ratio flashdl / torch (the targets)
    ("float32", "fwd"): 0.8,
    ("bfloat16", "fwd+bwd"): 1.0,
    ("float32", "fwd+bwd"): 0.7,
}


def median_time(fn, reps):
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


SETTLE_S = 0.05


def alternate(fns, reps, settle=True):
    """Runs each fn once to warm up, then reps rounds alternating them; medians in seconds.

    With settle, each timed call follows untimed calls of the same fn for at least SETTLE_S:
    torch's OpenMP workers spin for 10-15 ms after an op here, and a flashdl call timed while they
    spin shares a core with them (measured: 512 x 512 float32 forward, 2 threads, 3.1 ms alone,
    6.3 ms right after SDPA, 3.3 ms with OMP_WAIT_POLICY=PASSIVE; benchmarks/results/
    cpu_tuning.md section 18). flashdl's pool sleeps between calls, so torch timed after flashdl
    saw no such cost: without settle the comparison measured torch's spinning, not flashdl.
    After SDPA's backward the spin outlasts 20 ms when the ops repeat every few tens of ms (a
    16 x 128 float32 forward + backward: 0.36 ms timed after 20 ms of settling, 0.19 ms after 50,
    0.23 ms with OMP_WAIT_POLICY=PASSIVE; cpu_tuning.md section 26): SETTLE_S is 50 ms.
    """
    for fn in fns:
        fn()
    samples = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            if settle:
                start = time.perf_counter()
                fn()
                while time.perf_counter() - start < SETTLE_S:
                    fn()
            t = time.perf_counter()
            fn()
            samples[i].append(time.perf_counter() - t)
    return [statistics.median(s) for s in samples]


def speed_rows(torch, reps):
    import torch.nn.functional as F

    b, h, s, d = 1, 8, 2048, 64
    rows = []
    for dtype_name, passes in (("float32", ("fwd", "fwd+bwd")), ("bfloat16", ("fwd", "fwd+bwd"))):
        dt = getattr(torch, dtype_name)
        gen = torch.Generator().manual_seed(0)
        # Each library gets its native contiguous layout.
        q, k, v = (torch.randn(b, s, h, d, generator=gen).to(dt) for _ in range(3))
        dout = torch.randn(b, s, h, d, generator=gen).to(dt)
        qt, kt, vt, doutt = (x.transpose(1, 2).contiguous() for x in (q, k, v, dout))
        for causal in (False, True):
            for ps in passes:
                total = attention_flops(b, h, s, s, d, causal, ps)
                if ps == "fwd":
                    f_fd = lambda: flashdl.attention(q, k, v, causal=causal)
                    f_th = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                else:
                    def f_fd():
                        out, lse = flashdl.attention(q, k, v, causal=causal, return_lse=True)
                        flashdl.attention_backward(dout, q, k, v, out, lse, causal=causal)

                    qg, kg, vg = (x.clone().requires_grad_() for x in (qt, kt, vt))

                    def f_th():
                        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                        out.backward(doutt)

                t_fd, t_th = alternate([f_fd, f_th], reps)
                rows.append(dict(dtype=dtype_name, causal=causal, pass_=ps,
                                 t_fd=t_fd, t_th=t_th, gf_fd=total / t_fd / 1e9,
                                 gf_th=total / t_th / 1e9, ratio=t_th / t_fd))
                print(f"  {dtype_name:8s} causal={causal!s:5s} {ps:7s} flashdl {t_fd*1e3:8.1f} ms "
                      f"torch {t_th*1e3:8.1f} ms  ratio {t_th/t_fd:5.2f}", flush=True)
    return rows


MEMORY_CHILD = r"""
import sys, numpy as np, flashdl
def hwm_kib():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM:'):
            return int(line.split()[1])
b, s, h, d = 1, int(sys.argv[1]), 8, 64
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((b, s, h, d), dtype=np.float32) for _ in range(3))
out = np.empty_like(q); lse = np.empty((b, h, s), np.float32)
out.fill(0); lse.fill(0)  # touch the outputs so they count in the baseline
flashdl.attention(q[:, :64], k[:, :64], v[:, :64])  # load the module and its thread pool
open('/proc/self/clear_refs', 'w').write('5')
base = hwm_kib()
flashdl._ext.forward(q, k, v, out, lse, schedule=sys.argv[2])
print(hwm_kib() - base)
"""


def memory_row(seqlen, schedule):
    res = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(seqlen), schedule],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(res.stderr)
    return int(res.stdout.strip().splitlines()[-1]) / 1024.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="markdown file for the table")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    import torch

    info = flashdl.info()
    print(f"flashdl {info['version']} ({info['cpu_isa']}, {info['num_threads']} threads), "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), {cpu_model()}", flush=True)
    rows = speed_rows(torch, args.reps)
    print("  memory: fa2 forward, seqlen 16384 ...", flush=True)
    mem = {sched: memory_row(16384, sched) for sched in ("fa2", "fa1")}
    for sched, mib in mem.items():
        print(f"  memory {sched}: {mib:.1f} MiB above inputs and outputs", flush=True)

    lines = [
        f"# CPU: flashdl vs torch SDPA ({datetime.date.today().isoformat()})",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.machine()}",
        f"- flashdl {info['version']}, CPU kernels `{info['cpu_isa']}`, {info['num_threads']} threads; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads",
        "- command: `python benchmarks/bench_cpu.py`; medians of alternating runs in one process",
        "- shape (batch 1, heads 8, seqlen 2048, headdim 64); GFLOP/s with flash-attn's count "
        "(fwd 4bhs²d, halved causal; fwd+bwd 3.5x)",
        "",
        "| dtype | causal | pass | flashdl fa2 ms | torch ms | flashdl GFLOP/s | torch GFLOP/s | speed ratio | target |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        target = TARGETS.get((r["dtype"], r["pass_"]))
        verdict = "" if target is None else (f">= {target} " + ("met" if r["ratio"] >= target else "MISSED"))
        lines.append(f"| {r['dtype']} | {r['causal']} | {r['pass_']} | {r['t_fd']*1e3:.1f} | "
                     f"{r['t_th']*1e3:.1f} | {r['gf_fd']:.0f} | {r['gf_th']:.0f} | {r['ratio']:.2f} | {verdict} |")
    naive_gib = 8 * 16384 * 16384 * 4 / 2**30
    lines += [
        "",
        "Memory, float32 forward, (batch 1, seqlen 16384, heads 8, headdim 64): peak RSS added beyond "
        f"inputs and outputs (target < 64 MiB; the naive N x N scores alone would take {naive_gib:.0f} GiB)",
        "",
        "| schedule | added peak RSS MiB | target |",
        "|---|---|---|",
    ]
    for sched, mib in mem.items():
        lines.append(f"| {sched} | {mib:.1f} | < 64 " + ("met" if mib < 64 else "MISSED") + " |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
