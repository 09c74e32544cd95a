"""Extra memory of attention with a bias (issue 28: O(N) beyond the bias and its gradient), on
the CPU: each configuration runs in a child process that allocates its inputs, resets the peak
resident set (``/proc/self/clear_refs``), runs the forward and the backward with dBias, and reports
the peak resident memory above the starting point minus the bytes of the results it returned (out,
lse, dq, dk, dv, dbias). What is left is the call's working memory: tiles, per-thread partials,
the bindings' temporaries. Linux only.

Run:  python benchmarks/bench_bias_memory.py [--seqlens 1024,2048,4096] [--threads 2]
"""
import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, numpy as np, flashdl
n, h, d, bias_shape, threads = json.loads(sys.argv[1])
rng = np.random.default_rng(0)
q, k, v, dout = (rng.standard_normal((1, n, h, d)).astype(np.float32) for _ in range(4))
bias = None if bias_shape is None else rng.standard_normal(
    [x if x > 0 else n for x in bias_shape]).astype(np.float32)

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)

extra = {} if bias is None else {"bias": bias}
out, lse = flashdl.attention(q, k, v, return_lse=True, **extra)  # warm: pool, pages, code
grads = flashdl.attention_backward(dout, q, k, v, out, lse, **extra)
del out, lse, grads
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current resident set
start = rss("VmRSS")
out, lse = flashdl.attention(q, k, v, return_lse=True, **extra)
grads = flashdl.attention_backward(dout, q, k, v, out, lse, **extra)
peak = rss("VmHWM")
results = sum(x.nbytes for x in (out, lse, *grads))
print(json.dumps({"peak_above_start": peak - start, "results": results,
                  "working": peak - start - results}))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="1024,2048,4096")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    shapes = {"none": None, "(1,h,N,N)": [1, a.heads, 0, 0], "(1,1,N,N)": [1, 1, 0, 0],
              "(1,h,1,N)": [1, a.heads, 1, 0]}
    print(f"float32, batch 1, {a.heads} heads, head dim {a.headdim}, {a.threads} threads; MiB")
    print("| seqlen | bias | bias MiB | results MiB (incl. dbias) | working memory MiB |")
    print("|---|---|---|---|---|")
    for n in (int(s) for s in a.seqlens.split(",")):
        for name, shape in shapes.items():
            arg = json.dumps([n, a.heads, a.headdim, shape, a.threads])
            env = dict(os.environ, OMP_NUM_THREADS=str(a.threads),
                       FLASHDL_NUM_THREADS=str(a.threads))
            r = json.loads(subprocess.run([sys.executable, "-c", CHILD, arg], env=env, check=True,
                                          capture_output=True, text=True).stdout)
            bias_bytes = 0 if shape is None else 4 * eval_size(shape, n)
            print(f"| {n} | {name} | {bias_bytes / 2**20:.1f} | {r['results'] / 2**20:.1f} | "
                  f"{r['working'] / 2**20:.1f} |")


def eval_size(shape, n):
    size = 1
    for x in shape:
        size *= x if x > 0 else n
    return size


if __name__ == "__main__":
    main()
