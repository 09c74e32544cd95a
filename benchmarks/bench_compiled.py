"""What a call costs inside compiled programs: flashdl under jax.jit (XLA FFI custom calls) and
under torch.compile (torch.library custom ops), against the same call made eagerly, side by side.

Run:  python benchmarks/bench_compiled.py [--out benchmarks/results/compiled_cpu.md] [--rounds 7]

Each row is one shape and pass; each column one way of making the call, timed per call (the result
waited for: block_until_ready for JAX), median over rounds of `--calls` back-to-back calls. The
tiny shape (1, 16, 2, 16) is almost all overhead, so its times are the per-call cost of each path;
the larger one shows whether that cost still matters once there is work.

JAX columns: `flashdl.attention` on JAX arrays (the eager DLPack entry point), `flashdl.jax` eager
(op by op) and under `jax.jit`, and `jax.nn.dot_product_attention` under `jax.jit` (XLA's own
attention). torch columns: `flashdl.torch.attention` eager and inside
`torch.compile(fullgraph=True)` (compiled once, before timing), and SDPA eager. fwd+bwd is the gradient of a sum through each path.
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

SHAPES = [(1, 16, 2, 16), (1, 1024, 8, 64)]


def per_call(fn, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def jax_methods(shape, pass_):
    import jax
    import jax.numpy as jnp

    import flashdl.jax as fj

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(3))
    ready = jax.block_until_ready
    if pass_ == "fwd":
        jit_fd = jax.jit(lambda q, k, v: fj.attention(q, k, v))
        jit_dpa = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v))
        return {
            "flashdl.attention (eager DLPack)": lambda: ready(flashdl.attention(q, k, v)),
            "flashdl.jax eager": lambda: ready(fj.attention(q, k, v)),
            "flashdl.jax under jit": lambda: ready(jit_fd(q, k, v)),
            "jax dot_product_attention under jit": lambda: ready(jit_dpa(q, k, v)),
        }
    grad_fd = jax.grad(lambda q, k, v: fj.attention(q, k, v).sum(), argnums=(0, 1, 2))
    grad_dpa = jax.grad(lambda q, k, v: jax.nn.dot_product_attention(q, k, v).sum(),
                        argnums=(0, 1, 2))
    jit_fd, jit_dpa = jax.jit(grad_fd), jax.jit(grad_dpa)

    def eager_dlpack():
        out, lse = flashdl.attention(q, k, v, return_lse=True)
        ready(flashdl.attention_backward(jnp.ones_like(out), q, k, v, out, lse))
    return {
        "flashdl.attention (eager DLPack)": eager_dlpack,
        "flashdl.jax eager": lambda: ready(grad_fd(q, k, v)),
        "flashdl.jax under jit": lambda: ready(jit_fd(q, k, v)),
        "jax dot_product_attention under jit": lambda: ready(jit_dpa(q, k, v)),
    }


def torch_methods(shape, pass_):
    import torch

    import flashdl.torch as ft

    g = torch.Generator().manual_seed(0)
    grad = pass_ != "fwd"
    q, k, v = (torch.randn(*shape, generator=g).requires_grad_(grad) for _ in range(3))

    def eager():
        return ft.attention(q, k, v)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    compiled = torch.compile(eager, fullgraph=True)

    def run(f):
        if not grad:
            with torch.no_grad():
                return lambda: f()
        return lambda: torch.autograd.grad(f().sum(), (q, k, v))
    return {"flashdl.torch eager": run(eager), "flashdl.torch under torch.compile": run(compiled),
            "torch SDPA eager": run(sdpa)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the markdown table here")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=50, help="calls per round (tiny shape; /20 for "
                    "the large one)")
    ap.add_argument("--frameworks", default="jax,torch", help="comma-separated: jax, torch")
    args = ap.parse_args()

    lines = [f"# flashdl in compiled programs ({cpu_model()}, {os.cpu_count()} cores)", "",
             f"{datetime.date.today()}, Python {platform.python_version()}, flashdl "
             f"{flashdl.__version__}, CPU, float32; per-call time (ms), median of "
             f"{args.rounds} rounds. `python benchmarks/bench_compiled.py --rounds "
             f"{args.rounds} --calls {args.calls}`", ""]
    for framework, methods_of in (("jax", jax_methods), ("torch", torch_methods)):
        if framework not in args.frameworks.split(","):
            continue
        try:
            mod = __import__(framework)
        except ImportError:
            lines += [f"{framework} is not installed: no table.", ""]
            continue
        header = None
        for shape in SHAPES:
            for pass_ in ("fwd", "fwd+bwd"):
                methods = methods_of(shape, pass_)
                if header is None:
                    header = list(methods)
                    lines += [f"## {framework} {mod.__version__}", "",
                              "| shape (b, s, h, d) | pass | " + " | ".join(header) +
                              " | compiled / eager flashdl |",
                              "|---|---|" + "---|" * (len(header) + 1)]
                calls = args.calls if shape[1] <= 64 else max(2, args.calls // 20)
                for fn in methods.values():  # warm-up (and compilation)
                    for _ in range(3):
                        fn()
                times = {name: [] for name in methods}
                for _ in range(args.rounds):
                    for name, fn in methods.items():
                        times[name].append(per_call(fn, calls))
                med = {name: statistics.median(t) for name, t in times.items()}
                eager = med[header[0]]
                compiled = med[header[2] if framework == "jax" else header[1]]
                lines.append(f"| {shape} | {pass_} | " +
                             " | ".join(f"{med[n] * 1e3:.3f}" for n in header) +
                             f" | {compiled / eager:.2f}x |")
        lines.append("")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
