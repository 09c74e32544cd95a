"""python -m flashdl: run attention on a realistic problem, check it against the float64 reference
and compare time and peak memory with naive NumPy attention (which materialises N x N scores).

Exit status 1 when flashdl's output differs from the reference by more than the tolerance.

`python -m flashdl bench` plots speed against sequence length instead (flashdl fa1/fa2, torch
SDPA, naive attention; forward and backward): `python -m flashdl bench --help`.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import threading
import time
from typing import Optional

import numpy as np

import flashdl

# Max |flashdl - reference| accepted, by dtype (outputs of attention on N(0, 1) inputs are O(1)).
TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}


# ---- measuring ----------------------------------------------------------------------------------
def _vm_kib(field: str):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Resets the kernel's resident-memory high-water mark (Linux); False where unavailable."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _vm_kib("VmHWM") is not None
    except OSError:
        return False


class Progress:
    """A spinner on stderr while a step runs (a plain line when stderr is not a terminal)."""

    def __init__(self, label: str):
        self.label = label
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self):
        if sys.stderr.isatty():
            self._thread = threading.Thread(target=self._spin, daemon=True)
            self._thread.start()
        else:
            print(f"  ... {self.label}", file=sys.stderr, flush=True)
        return self

    def _spin(self):
        for c in itertools.cycle("|/-\\"):
            if self._done.wait(0.1):
                break
            print(f"\r  {c} {self.label}", end="", file=sys.stderr, flush=True)
        print("\r" + " " * (len(self.label) + 4) + "\r", end="", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        self._done.set()
        if self._thread is not None:
            self._thread.join()


def measure(label, fn, sync=lambda: None):
    """Runs fn() once; returns (result, seconds, extra peak resident MiB or None)."""
    rss0 = _vm_kib("VmRSS")
    can_peak = _reset_peak() and rss0 is not None
    with Progress(label):
        t0 = time.perf_counter()
        result = fn()
        sync()
        seconds = time.perf_counter() - t0
    peak = (_vm_kib("VmHWM") - rss0) / 1024 if can_peak else None
    return result, seconds, peak


# ---- the two implementations --------------------------------------------------------------------
def naive_attention(q, k, v, causal: bool, scale: float):
    """softmax(q k^T * scale) v in float32, materialising the (seqlen_q, seqlen_k) scores."""
    q, k, v = (np.asarray(x, dtype=np.float32) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(0, 2, 1, 3)  # (b, h, sq, d)
    kh = np.repeat(k.transpose(0, 2, 1, 3), group, axis=1)  # (b, h, sk, d)
    vh = np.repeat(v.transpose(0, 2, 1, 3), group, axis=1)
    s = np.matmul(qh, kh.transpose(0, 1, 3, 2)) * np.float32(scale)
    if causal:
        sq, sk = s.shape[-2:]
        visible = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
        s = np.where(visible, s, np.float32(-np.inf))
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, np.float32(0))
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    o = np.matmul(p / np.where(l > 0, l, np.float32(1)), vh)
    return o.transpose(0, 2, 1, 3)


def _numpy_dtype(name: str):
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            sys.exit("--dtype bfloat16 on the CPU needs ml_dtypes (pip install ml_dtypes)")
        return ml_dtypes.bfloat16
    return np.dtype(name)


def gpu_framework():
    """(name, module) of a framework that can hold CUDA arrays, or None."""
    if flashdl.info()["cuda_device_count"] == 0:
        return None
    try:
        import torch

        if torch.cuda.is_available():
            return "torch", torch
    except ImportError:
        pass
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return "cupy", cupy
    except Exception:  # cupy raises its own CUDA errors when no device is usable
        pass
    return None


def to_gpu(fw, arrays, dtype_name):
    name, mod = fw
    if name == "torch":
        dt = getattr(mod, dtype_name)
        return [mod.from_numpy(np.asarray(a, np.float32)).to("cuda").to(dt) for a in arrays]
    if dtype_name == "bfloat16":
        raise RuntimeError("CuPy has no bfloat16 arrays")
    return [mod.asarray(a.astype(dtype_name)) for a in arrays]


def to_host(fw, x):
    name, mod = fw
    if name == "torch":
        return x.float().cpu().numpy()
    return mod.asnumpy(x).astype(np.float32)


# ---- main ---------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m flashdl",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--heads-kv", type=int, default=None, help="GQA/MQA: kv heads (default: heads)")
    p.add_argument("--seqlen", type=int, default=2048, help="seqlen_q")
    p.add_argument("--seqlen-k", type=int, default=None, help="default: seqlen")
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
    p.add_argument("--causal", action="store_true")
    p.add_argument("--schedule", default="auto", choices=["auto", "fa1", "fa2"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-naive", action="store_true", help="skip the naive NumPy comparison")
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        from flashdl import bench

        return bench.main(argv[1:])
    a = parse_args(argv)
    if a.threads:
        flashdl.set_num_threads(a.threads)
    info = flashdl.info()
    hk = a.heads_kv or a.heads
    sk = a.seqlen_k or a.seqlen
    print(
        f"flashdl {info['version']}: backends {', '.join(info['backends'])}; "
        f"CPU {info['cpu_isa']}, {info['num_threads']} threads; CUDA devices {info['cuda_device_count']} "
        f"({info['cuda_status']})"
    )
    print(
        f"problem: batch {a.batch}, heads {a.heads}/{hk}, seqlen {a.seqlen}x{sk}, headdim "
        f"{a.headdim}, {a.dtype}, causal={a.causal}, schedule={a.schedule}"
    )

    rng = np.random.default_rng(a.seed)
    host = [
        rng.standard_normal((a.batch, n, h, a.headdim), dtype=np.float32)
        for n, h in ((a.seqlen, a.heads), (sk, hk), (sk, hk))
    ]
    host = [x.astype(_numpy_dtype(a.dtype)) for x in host]
    scale = 1.0 / math.sqrt(a.headdim)
    opts = dict(causal=a.causal, softmax_scale=scale)

    fw = gpu_framework() if a.device != "cpu" else None
    if a.device == "cuda" and fw is None:
        print("no CUDA device usable from torch or cupy", file=sys.stderr)
        return 2
    out = None
    if fw is not None:
        name, mod = fw
        try:
            q, k, v = to_gpu(fw, host, a.dtype)
            sync = (
                mod.cuda.synchronize
                if name == "torch"
                else lambda: mod.cuda.get_current_stream().synchronize()
            )
            flashdl.attention(q, k, v, schedule=a.schedule, **opts)  # warm-up: context, kernels
            sync()
            out, t_fd, _ = measure(
                f"flashdl ({a.schedule}) on {name} cuda",
                lambda: flashdl.attention(q, k, v, schedule=a.schedule, **opts),
                sync,
            )
            out = to_host(fw, out)
            where = f"cuda ({name})"
        except RuntimeError as e:
            print(f"CUDA run failed: {e}; running on the CPU instead")
            out = None
    if out is None:
        where = "cpu"
        out, t_fd, m_fd = measure(
            f"flashdl ({a.schedule}) on the CPU",
            lambda: flashdl.attention(*host, schedule=a.schedule, **opts),
        )
    else:
        m_fd = None

    ref, t_ref, _ = measure(
        "float64 reference (check)", lambda: flashdl.attention(*host, schedule="reference", **opts)
    )
    ref64 = np.asarray(ref, np.float64)
    err = float(np.max(np.abs(np.asarray(out, np.float64) - ref64), initial=0))
    tol = TOLERANCE[a.dtype]

    def mib(x):
        return "n/a" if x is None else f"{x:8.1f} MiB"

    print(f"\n{'':28s}{'time':>10s}  {'peak extra RSS':>14s}")
    print(f"{'flashdl ' + a.schedule + ' (' + where + ')':28s}{t_fd:9.3f}s  {mib(m_fd):>14s}")
    if not a.no_naive:
        naive, t_nv, m_nv = measure(
            "naive NumPy attention (N x N scores)",
            lambda: naive_attention(host[0], host[1], host[2], a.causal, scale),
        )
        print(f"{'naive NumPy (float32)':28s}{t_nv:9.3f}s  {mib(m_nv):>14s}")
        nerr = float(np.max(np.abs(naive - ref64), initial=0))
    print(f"{'reference (float64, check)':28s}{t_ref:9.3f}s")
    print(f"\nmax |flashdl - reference| = {err:.3e}  (tolerance {tol:.0e})")
    if not a.no_naive:
        print(f"max |naive   - reference| = {nerr:.3e}")
    if not err <= tol:
        print("FAILED: flashdl differs from the reference beyond the tolerance")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
