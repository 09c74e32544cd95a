"""python -m flashdl bench: attention speed against sequence length, as the FlashAttention papers
plot it: flashdl's FA-2 and FA-1 schedules beside the baselines present (torch SDPA when torch
imports; naive attention, which materialises the N x N scores), forward and forward+backward.

One progress line per measured point goes to stderr; a markdown table goes to stdout (and to
--table); with matplotlib, a figure with one panel per pass goes to --out (a PNG), without it
the table only. Speed uses flash-attn's FLOP count: the forward is 4*b*h*s*s*d (two matrix
products), halved when causal; the backward 2.5x and forward+backward 3.5x the forward. At each
sequence length the methods run interleaved, round after round, and each point is the median.

The naive baseline is NumPy float32 on the CPU (forward only) and eager PyTorch on CUDA
(q k^T, softmax, then p v, with autograd for the backward); it is skipped at sequence lengths
whose N x N float32 scores would exceed --naive-max-gib.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

import numpy as np

import flashdl

# flash-attn's benchmark count: the backward is 2.5x the forward's FLOPs, forward+backward 3.5x.
PASS_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
PASS_TITLE = {"fwd": "forward", "bwd": "backward", "fwd+bwd": "forward + backward"}
METHODS = ("fa2", "fa1", "sdpa", "naive")
DTYPES = ("float32", "bfloat16", "float16")
COLORS = {"fa2": "tab:red", "fa1": "tab:orange", "sdpa": "tab:blue", "naive": "tab:gray"}


def attention_flops(b, h, sq, sk, d, causal, pass_="fwd"):
    """FLOPs of one pass as flash-attn's benchmarks count them: the forward is 4*b*h*sq*sk*d (two
    matrix products), halved when causal; the backward 2.5x that, forward+backward 3.5x."""
    f = 4.0 * b * h * sq * sk * d
    return (f / 2 if causal else f) * PASS_FACTOR[pass_]


def cpu_model() -> str:
    """The CPU's model name from lscpu (the processor string where lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return platform.processor() or "unknown CPU"


def _import_torch():
    """torch, or None where it does not import."""
    try:
        import torch
    except Exception:  # ImportError, or a broken installation
        return None
    return torch


def _load():
    """The 1-minute load average, None where the OS keeps none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _say(*parts):
    print(*parts, file=sys.stderr, flush=True)


# ---- arguments ----------------------------------------------------------------------------------
def _positive_int(text):
    try:
        x = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if x < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return x


def _nonnegative_int(text):
    try:
        x = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if x < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return x


def _positive_float(text):
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not x > 0 or not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return x


def _nonnegative_float(text):
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not x >= 0 or not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return x


def _seqlens(text):
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(
            f"expected positive integers separated by commas, got {text!r}"
        )
    out = []
    for t in items:
        try:
            x = int(t)
        except ValueError:
            x = 0
        if x < 1:
            raise argparse.ArgumentTypeError(
                f"expected positive integers separated by commas, got {t!r} in {text!r}"
            )
        out.append(x)
    return sorted(set(out))


def _choices_list(allowed):
    def parse(text):
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated subset of {','.join(allowed)}, got {text!r}"
            )
        return [t for t in allowed if t in items]  # the canonical order, no repeats

    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m flashdl bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--seqlens",
        type=_seqlens,
        default=[256, 512, 1024, 2048, 4096],
        help="comma-separated sequence lengths (default: 256,512,1024,2048,4096)",
    )
    p.add_argument("--batch", type=_positive_int, default=1)
    p.add_argument("--heads", type=_positive_int, default=8)
    p.add_argument("--headdim", type=_positive_int, default=64)
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--causal", action="store_true")
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto: cuda where flashdl and torch see a GPU, else cpu",
    )
    p.add_argument(
        "--passes",
        type=_choices_list(tuple(PASS_FACTOR)),
        default=["fwd", "fwd+bwd"],
        help="comma-separated, of fwd,bwd,fwd+bwd (default: fwd,fwd+bwd)",
    )
    p.add_argument(
        "--methods",
        type=_choices_list(METHODS),
        default=list(METHODS),
        help="comma-separated, of fa2,fa1,sdpa,naive (default: all; sdpa needs torch)",
    )
    p.add_argument(
        "--rounds",
        type=_positive_int,
        default=3,
        help="timed runs of each point, interleaved; the median is reported",
    )
    p.add_argument(
        "--warmup",
        type=_nonnegative_int,
        default=1,
        help="untimed runs of each point first (default 1)",
    )
    p.add_argument(
        "--pause",
        type=_nonnegative_float,
        default=None,
        help="seconds idle before each timed run, so that the thread pools of the "
        "method run before (OpenBLAS, OpenMP) stop spinning and do not slow the next "
        "one down (default: 0.25 on the CPU, 0 on CUDA)",
    )
    p.add_argument(
        "--threads",
        type=_nonnegative_int,
        default=0,
        help="CPU threads for flashdl and torch (0: their defaults)",
    )
    p.add_argument(
        "--out",
        default="flashdl_bench.png",
        help="the figure (PNG; needs matplotlib; default flashdl_bench.png)",
    )
    p.add_argument("--no-plot", action="store_true", help="draw no figure")
    p.add_argument("--table", default=None, help="also write the markdown table to this file")
    p.add_argument(
        "--max-seconds",
        type=_positive_float,
        default=None,
        help="stop before a sequence length that would take the run past this",
    )
    p.add_argument(
        "--naive-max-gib",
        type=_positive_float,
        default=2.0,
        help="skip naive where its N x N float32 scores exceed this (default 2)",
    )
    p.add_argument("--seed", type=_nonnegative_int, default=0)
    a = p.parse_args(argv)
    for name in ("out", "table"):
        path = getattr(a, name)
        if path and (name != "out" or not a.no_plot):
            parent = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(parent):
                p.error(f"argument --{name}: directory {parent} does not exist")
    return a


# ---- the methods --------------------------------------------------------------------------------
def naive_numpy(q, k, v, scale, mask):
    """softmax(q k^T * scale) v for float32 (b, h, s, d) arrays, through one materialised
    (b, h, s, s) float32 score array (worked on in place); mask: True where a key is hidden."""
    s = np.matmul(q, k.transpose(0, 1, 3, 2))
    s *= np.float32(scale)
    if mask is not None:
        s[..., mask] = -np.inf
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return np.matmul(s, v)


def naive_torch(torch, q, k, v, scale, mask):
    """Standard attention in eager PyTorch on (b, h, s, d) tensors: the scores, their softmax (in
    float32) and its product with v, each materialised (the papers' "PyTorch" baseline)."""
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return torch.matmul(p, v)


class Skip(str):
    """Why a point is not measured."""


class Problem:
    """The inputs at one sequence length and a callable per (method, pass)."""

    def __init__(self, a, device, torch, seqlen):
        self.a, self.device, self.torch, self.s = a, device, torch, seqlen
        b, h, d = a.batch, a.heads, a.headdim
        self.scale = 1.0 / math.sqrt(d)
        rng = np.random.default_rng(a.seed)
        # q, k, v, dout, float32 (b, s, h, d), rounded to the dtype so every method sees the same.
        host = [rng.standard_normal((b, seqlen, h, d), dtype=np.float32) for _ in range(4)]
        if device == "cuda":
            dt = getattr(torch, a.dtype)
            self.fd = [torch.from_numpy(x).to("cuda").to(dt) for x in host]  # flashdl: bshd
            self.th = [x.transpose(1, 2).contiguous() for x in self.fd]  # torch: bhsd
        else:
            np_dt = _numpy_dtype(a.dtype)
            self.fd = [np.ascontiguousarray(x.astype(np_dt)) for x in host]
            f32 = [np.asarray(x, np.float32) for x in self.fd]
            self.np32 = [np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in f32]
            if torch is not None:
                dt = getattr(torch, a.dtype)
                self.th = [torch.from_numpy(x).to(dt) for x in self.np32]
        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def naive_bytes(self):
        return 4 * self.a.batch * self.a.heads * self.s * self.s

    def runner(self, method, pass_):
        """A callable running one pass of one method; None where the method has no such pass;
        a Skip saying why where it is not run at this size."""
        a, torch, causal = self.a, self.torch, self.a.causal
        if method in ("fa2", "fa1"):
            q, k, v, dout = self.fd
            opts = dict(causal=causal, softmax_scale=self.scale, schedule=method)
            if pass_ == "fwd":
                return lambda: flashdl.attention(q, k, v, **opts)
            if pass_ == "fwd+bwd":

                def fwd_bwd():
                    out, lse = flashdl.attention(q, k, v, return_lse=True, **opts)
                    return flashdl.attention_backward(dout, q, k, v, out, lse, **opts)

                return fwd_bwd
            out, lse = flashdl.attention(q, k, v, return_lse=True, **opts)
            return lambda: flashdl.attention_backward(dout, q, k, v, out, lse, **opts)
        if method == "sdpa":
            F = torch.nn.functional
            q, k, v, dout = self.th
            if pass_ == "fwd":

                def fwd():
                    with torch.no_grad():
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                return fwd
            return self._autograd(
                lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal), pass_
            )
        # naive
        if self.device != "cuda" and pass_ != "fwd":
            return None  # NumPy has no autograd: the naive CPU baseline is forward only
        if self.naive_bytes() > a.naive_max_gib * 2**30:
            return Skip(
                f"skipped: its N x N float32 scores would take "
                f"{self.naive_bytes() / 2**30:.1f} GiB > --naive-max-gib "
                f"{a.naive_max_gib:g}"
            )
        s = self.s
        if self.device == "cuda":
            mask = torch.triu(torch.ones(s, s, device="cuda"), 1).bool() if causal else None
            q, k, v, dout = self.th
            if pass_ == "fwd":

                def fwd():
                    with torch.no_grad():
                        return naive_torch(torch, q, k, v, self.scale, mask)

                return fwd
            return self._autograd(
                lambda q, k, v: naive_torch(torch, q, k, v, self.scale, mask), pass_
            )
        mask = np.triu(np.ones((s, s), dtype=bool), 1) if causal else None
        q, k, v, _ = self.np32
        return lambda: naive_numpy(q, k, v, self.scale, mask)

    def _autograd(self, f, pass_):
        torch = self.torch
        q, k, v, dout = self.th
        qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
        if pass_ == "fwd+bwd":
            return lambda: torch.autograd.grad(f(qg, kg, vg), (qg, kg, vg), dout)
        out = f(qg, kg, vg)
        return lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True)


def _numpy_dtype(name):
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise SystemExit(
                "--dtype bfloat16 on the CPU needs ml_dtypes (pip install ml_dtypes)"
            ) from None
        return ml_dtypes.bfloat16
    return np.dtype(name)


# ---- output -------------------------------------------------------------------------------------
def _fmt(x):
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"


def _fmt_ms(seconds):
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def table_lines(ctx, results, notes):
    a, labels, unit = ctx["args"], ctx["labels"], ctx["unit"]
    methods = ctx["methods"]
    lines = [
        f"# flashdl bench: attention speed against sequence length ({ctx['date']})",
        "",
        f"- machine: {ctx['machine']}",
        f"- software: {ctx['software']}",
        f"- load average (1 min) before the run: {ctx['load']}",
        f"- problem: batch {a.batch}, {a.heads} heads, headdim {a.headdim}, {a.dtype}, "
        f"{'causal' if a.causal else 'non-causal'}; median of {a.rounds} interleaved rounds "
        f"after {a.warmup} warm-up, {ctx['pause']:g} s idle before each run",
        f"- command: `{ctx['command']}`",
        f"- cells: {unit} (ms), with flash-attn's FLOP count: forward 4·b·h·s²·d"
        f"{', halved (causal)' if a.causal else ''}; backward 2.5x, forward+backward 3.5x that",
        "",
        "| pass | seqlen | " + " | ".join(labels[m] for m in methods) + " |",
        "|---|---:|" + "---:|" * len(methods),
    ]
    for pass_ in a.passes:
        for s in ctx["seqlens"]:
            cells = []
            for m in methods:
                r = results.get((m, pass_, s))
                if r is None:
                    cells.append("—")
                elif isinstance(r, str):
                    cells.append(r)
                else:
                    cells.append(f"{_fmt(r[1])} ({_fmt_ms(r[0])} ms)")
            lines.append(f"| {pass_} | {s} | " + " | ".join(cells) + " |")
    if notes:
        lines.append("")
        lines += [f"- {n}" for n in notes]
    return lines


def draw(ctx, results, path):
    """One panel per pass: speed against sequence length (log2), a line per method."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, nothing global

    a, labels, unit, methods = ctx["args"], ctx["labels"], ctx["unit"], ctx["methods"]
    seqlens = ctx["seqlens"]
    fig = Figure(figsize=(5.2 * len(a.passes), 4.2))
    axes = fig.subplots(1, len(a.passes), squeeze=False)[0]
    for ax, pass_ in zip(axes, a.passes):
        for m in methods:
            pts = [
                (s, results[(m, pass_, s)][1])
                for s in seqlens
                if isinstance(results.get((m, pass_, s)), tuple)
            ]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", color=COLORS[m], label=labels[m])
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqlens)
        ax.set_xticklabels([str(s) for s in seqlens])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(unit)
        ax.set_title(PASS_TITLE[pass_])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(ctx["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ---- main ---------------------------------------------------------------------------------------
def _resolve_device(a, info):
    """(device, torch or None): device 'cpu' or 'cuda', or None with a message in place of torch
    where CUDA was asked for and is not usable. torch is imported only where it is needed."""
    torch, gpu = None, False
    if a.device != "cpu" and info["cuda_device_count"] > 0:
        torch = _import_torch()
        gpu = torch is not None and torch.cuda.is_available()
    if a.device == "cuda" and not gpu:
        why = (
            f"flashdl sees no CUDA device ({info['cuda_status']})"
            if info["cuda_device_count"] == 0
            else "torch does not import"
            if torch is None
            else "torch sees no CUDA device"
        )
        return None, f"--device cuda: {why}; skipped, nothing measured"
    if gpu:
        return "cuda", torch
    return "cpu", (_import_torch() if "sdpa" in a.methods else None)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    info = flashdl.info()
    device, torch = _resolve_device(a, info)
    if device is None:
        _say(torch)
        return 0
    if device == "cpu":
        _numpy_dtype(a.dtype)  # exits with a message where bfloat16 lacks ml_dtypes
    if a.threads:
        flashdl.set_num_threads(a.threads)
        if torch is not None:
            torch.set_num_threads(a.threads)
        info = flashdl.info()

    pause = a.pause if a.pause is not None else (0.25 if device == "cpu" else 0.0)
    methods = [m for m in a.methods if m != "sdpa" or torch is not None]
    notes = []
    if "sdpa" in a.methods and torch is None:
        notes.append("torch SDPA: torch does not import here, not measured")
        _say("torch does not import: no torch SDPA baseline")
    labels = {
        "fa2": "flashdl fa2",
        "fa1": "flashdl fa1",
        "sdpa": "torch SDPA",
        "naive": "naive torch" if device == "cuda" else "naive NumPy",
    }
    unit, per = ("TFLOP/s", 1e12) if device == "cuda" else ("GFLOP/s", 1e9)
    if device == "cuda":
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        machine = (
            f"{p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
            f"{p.total_memory / 2**30:.1f} GiB); host {cpu_model()}"
        )
        short = p.name
    else:
        machine = (
            f"{cpu_model()}, {os.cpu_count()} logical CPUs, {platform.system()} "
            f"{platform.machine()}"
        )
        short = f"{cpu_model()}, {info['num_threads']} threads"
    software = (
        f"flashdl {info['version']} (CPU kernels `{info['cpu_isa']}`, "
        f"{info['num_threads']} threads), NumPy {np.__version__}"
    )
    if torch is not None:
        software += f", torch {torch.__version__}"
        if device == "cpu":
            software += f" ({torch.get_num_threads()} threads)"
    ctx = dict(
        args=a,
        labels=labels,
        unit=unit,
        methods=methods,
        machine=machine,
        software=software,
        date=time.strftime("%Y-%m-%d"),
        command="python -m flashdl bench " + " ".join(shlex.quote(x) for x in argv),
        seqlens=[],
        pause=pause,
        title=(
            f"flashdl on {short}: {a.dtype}, batch {a.batch}, {a.heads} heads, "
            f"headdim {a.headdim}, {'causal' if a.causal else 'non-causal'}"
        ),
    )
    if "naive" in methods and device == "cpu" and any(p != "fwd" for p in a.passes):
        notes.append("naive NumPy: forward only (NumPy has no autograd)")

    _say(f"flashdl bench on {device}: {machine}")
    _say(f"  {software}")
    load = _load()  # other work on the machine skews CPU timings: the table says how much
    ctx["load"] = "unknown" if load is None else f"{load:.2f}"
    _say(f"  load average (1 min): {ctx['load']}")
    results: dict = {}  # (method, pass, seqlen) -> (seconds, speed), or a string for the table
    t_start = time.perf_counter()
    prev = None  # (seqlen, seconds it took)
    over_cap: dict = {}  # method -> the seqlens skipped for the N x N memory cap
    for s in a.seqlens:
        elapsed = time.perf_counter() - t_start
        if a.max_seconds is not None and prev is not None:
            estimate = prev[1] * (s / prev[0]) ** 2
            if elapsed + estimate > a.max_seconds:
                rest = [x for x in a.seqlens if x >= s]
                msg = (
                    f"stopped before seqlen {s}: about {estimate:.0f} s more would pass "
                    f"--max-seconds {a.max_seconds:g} ({elapsed:.0f} s so far); not measured: "
                    + ", ".join(map(str, rest))
                )
                _say(msg)
                notes.append(msg)
                break
        t_seq = time.perf_counter()
        ctx["seqlens"].append(s)
        prob = Problem(a, device, torch, s)
        points = []
        for m in methods:
            for pass_ in a.passes:
                try:
                    fn = prob.runner(m, pass_)
                except Exception as e:  # e.g. a dtype or shape this method refuses
                    fn = Skip(f"failed: {type(e).__name__}: {e}")
                if fn is None:
                    continue
                if isinstance(fn, Skip):
                    _say(f"  {labels[m]:12s} {pass_:7s} seqlen {s:6d}   {fn}")
                    results[(m, pass_, s)] = "failed" if fn.startswith("failed") else "skipped"
                    if fn.startswith("failed"):
                        notes.append(f"{labels[m]} {pass_} at seqlen {s}: {fn}")
                    else:
                        over_cap.setdefault(m, []).append(s)
                    continue
                points.append(((m, pass_), fn))
        samples: dict = {key: [] for key, _ in points}
        failed = {}
        _say(
            f"seqlen {s}: {len(points)} points, {a.warmup} warm-up and {a.rounds} timed runs "
            "each, interleaved"
        )
        for i in range(a.warmup + a.rounds):
            for key, fn in points:
                if key in failed:
                    continue
                if pause:
                    time.sleep(pause)
                try:
                    prob.sync()
                    t0 = time.perf_counter()
                    fn()
                    prob.sync()
                    dt = time.perf_counter() - t0
                except Exception as e:
                    failed[key] = f"failed: {type(e).__name__}: {e}"
                    continue
                if i >= a.warmup:
                    samples[key].append(dt)
        for key, _ in points:
            m, pass_ = key
            if key in failed:
                _say(f"  {labels[m]:12s} {pass_:7s} seqlen {s:6d}   {failed[key]}")
                results[(m, pass_, s)] = "failed"
                notes.append(f"{labels[m]} {pass_} at seqlen {s}: {failed[key]}")
                continue
            t = statistics.median(samples[key])
            speed = attention_flops(a.batch, a.heads, s, s, a.headdim, a.causal, pass_) / t / per
            results[(m, pass_, s)] = (t, speed)
            _say(
                f"  {labels[m]:12s} {pass_:7s} seqlen {s:6d} {t * 1e3:12.3f} ms "
                f"{speed:10.2f} {unit}"
            )
        del prob, points
        if device == "cuda":
            torch.cuda.empty_cache()
        prev = (s, time.perf_counter() - t_seq)

    for m, lens in over_cap.items():
        notes.append(
            f"{labels[m]}: skipped at seqlen {', '.join(map(str, sorted(set(lens))))}, "
            f"where its N x N float32 scores would exceed --naive-max-gib "
            f"{a.naive_max_gib:g} GiB"
        )
    lines = table_lines(ctx, results, notes)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.table:
        with open(a.table, "w") as fh:
            fh.write(text)
        _say(f"table written to {a.table}")
    if not a.no_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            _say("matplotlib not installed: table only")
        else:
            draw(ctx, results, a.out)
            _say(f"figure written to {a.out}")
    measured = any(isinstance(r, tuple) for r in results.values())
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
