"""flashdl's CUDA kernels (fa2, fa1) against torch SDPA's backends on the same GPU, side by side.

Run:  python benchmarks/bench_cuda.py [--quick] [--out benchmarks/results/cuda.md]
      [--dtypes fp16,bf16] [--headdims 64,128,256] [--seqlens 512,1024,2048,4096,8192,16384]
      [--causal both|yes|no] [--schedules fa2,fa1] [--fa1-max-seqlen 4096] [--warmup 5]
      [--reps 20]
      python benchmarks/bench_cuda.py --features [...]: block-sparse attention against mask
      density, the cost of dropout, varlen packed against padded (benchmarks/cuda_features.py;
      --cpu-dry-run checks that mode on the CPU backend without a GPU)

Shapes are the FlashAttention-2 paper's benchmark: 16k tokens per batch (batch = 16384 // seqlen),
nheads = 2048 // headdim, seqlen_q = seqlen_k, forward and forward+backward, causal and not.
q, k, v are (batch, seqlen, nheads, headdim) tensors; SDPA gets (batch, nheads, seqlen, headdim)
views of the same memory (x.transpose(1, 2)), so both read the same bytes with no copy. SDPA runs
under torch.nn.attention.sdpa_kernel with one backend at a time: FLASH_ATTENTION, CUDNN_ATTENTION
and EFFICIENT_ATTENTION; a backend that refuses a shape (or is missing) shows n/a.

Timing: CUDA events recorded on the current stream around each call, after warm-up calls; the
median of N. A configuration whose calls take long gets fewer of them, so that each measurement
stays near two seconds; fa1 (one CTA per batch and head, O and the row statistics re-read and
rewritten in global memory for every key block: seconds per call at 16k tokens) runs only up to
--fa1-max-seqlen. The backward runs through autograd for both (flashdl.torch.attention,
torch.autograd.grad). TFLOP/s use flash-attn's count: forward 4*b*h*s^2*d, halved when causal;
forward+backward 3.5x the forward (the backward 2.5x).

Each flashdl forward is also compared with the first SDPA backend that ran (max |difference| of the
outputs), so a fast but wrong kernel shows. Last, the seeds' end-to-end row: one GPT-2 medium
attention layer (seqlen 1024, 16 heads, headdim 64, causal, float16) forward+backward, flashdl fa2
against standard attention in torch (matmul, softmax, matmul), which the FlashAttention paper
reports as 7.3 ms against 41.7 ms on an A100 (its Figure 2: batch 64); batch 8 and 64 are timed.

The exit status is 1 when a flashdl call failed (its cell says error), else 0.
"""
from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import warnings

import flashdl
from tables import attention_flops, emit, gpu_model, nvidia_driver

DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
SDPA_BACKENDS = [("FLASH_ATTENTION", "SDPA flash"), ("CUDNN_ATTENTION", "SDPA cuDNN"),
                 ("EFFICIENT_ATTENTION", "SDPA efficient")]
TOKENS = 16384
DEVICE = "cuda"  # where every tensor is made (the current CUDA device)
QUICK = dict(dtypes="fp16", headdims="64,128", seqlens="1024,4096", warmup=2, reps=5)
TARGET_SECONDS = 2.0  # per measurement: what the call count is cut down to for slow calls


def parse_list(text, kind=str):
    return [kind(x) for x in text.split(",") if x]


def cuda_available():
    """(torch, None) when torch and flashdl can run on a CUDA device, else (None, why)."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed (the benchmark compares with torch SDPA)"
    if not torch.cuda.is_available():
        return None, "torch sees no CUDA device"
    info = flashdl.info()
    if "cuda" not in info["backends"] or info["cuda_device_count"] == 0:
        return None, f"flashdl cannot run on CUDA: {info['cuda_status']}"
    return torch, None


def cuda_time_ms(torch, fn, warmup, reps):
    """Median milliseconds of fn() between CUDA events on the current stream. One untimed call
    first (lazy initialisation, e.g. cuDNN's plans), then one timed call sizes the rest."""
    fn()
    first = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    first[0].record()
    fn()
    first[1].record()
    torch.cuda.synchronize()
    t_first = first[0].elapsed_time(first[1]) / 1e3
    scale = max(1.0, t_first * (warmup + reps) / TARGET_SECONDS)
    warmup, reps = max(0, int(warmup / scale)), max(3, int(reps / scale))
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


class Cell:
    """One measurement: milliseconds, or n/a (the backend refused) or error (flashdl failed)."""

    def __init__(self, ms=None, flops=0.0, status="ok", why=""):
        self.ms, self.flops, self.status, self.why = ms, flops, status, why

    def text(self):
        if self.status != "ok":
            return self.status
        return f"{self.flops / self.ms / 1e9:.1f} ({self.ms:.3f})"


def measure(torch, fn, flops, warmup, reps, refused, timer=None):
    """A Cell for fn, timed by `timer` (default cuda_time_ms); an exception is `refused` (n/a or
    error). SDPA explains a refusal in warnings before it raises: the first one becomes the
    reason."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return Cell((timer or cuda_time_ms)(torch, fn, warmup, reps), flops)
        except Exception as e:  # a backend that refuses the shape, out of memory, a flashdl failure
            try:  # after a device fault the context is gone: report, never raise again here
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception:
                pass
            why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            if caught:
                why += f" ({str(caught[0].message).splitlines()[0]})"
            return Cell(status=refused, why=why[:240])


def sdpa_call(torch, backend_name):
    """F.scaled_dot_product_attention restricted to one backend, or None when torch lacks it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    backend = getattr(SDPBackend, backend_name, None)
    if backend is None:
        return None

    def call(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return call


def config_rows(torch, dtype, d, seqlen, causal, schedules, warmup, reps, fa1_max_seqlen):
    """The cells of one shape: {pass: {column: Cell}} and the forward output differences."""
    import flashdl.torch as fdt

    b, h = max(1, TOKENS // seqlen), max(1, 2048 // d)
    tdt = getattr(torch, dtype)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v, dout = (torch.randn(b, seqlen, h, d, device=DEVICE, dtype=tdt, generator=gen)
                     for _ in range(4))
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    t = lambda x: x.transpose(1, 2)  # (b, s, h, d) memory seen as (b, h, s, d)
    cells = {"fwd": {}, "fwd+bwd": {}}
    outs, diffs = {}, {}
    for ps in cells:
        flops = attention_flops(b, h, seqlen, seqlen, d, causal, ps)
        for sched in schedules:
            if sched == "fa1" and seqlen > fa1_max_seqlen:
                cells[ps][f"flashdl {sched}"] = Cell(status="not run")
                continue
            if ps == "fwd":
                fn = lambda: flashdl.attention(q, k, v, causal=causal, schedule=sched)
            else:
                def fn():
                    out = fdt.attention(qg, kg, vg, causal=causal, schedule=sched)
                    torch.autograd.grad(out, (qg, kg, vg), dout)
            cells[ps][f"flashdl {sched}"] = measure(torch, fn, flops, warmup, reps, "error")
            if ps == "fwd" and cells[ps][f"flashdl {sched}"].status == "ok":
                outs[sched] = flashdl.attention(q, k, v, causal=causal, schedule=sched)
        for name, label in SDPA_BACKENDS:
            call = sdpa_call(torch, name)
            if call is None:
                cells[ps][label] = Cell(status="n/a", why=f"this torch has no SDPBackend.{name}")
                continue
            if ps == "fwd":
                fn = lambda: call(t(q), t(k), t(v), causal)
            else:
                def fn():
                    out = call(t(qg), t(kg), t(vg), causal)
                    torch.autograd.grad(out, (qg, kg, vg), t(dout))
            cells[ps][label] = measure(torch, fn, flops, warmup, reps, "n/a")
            if ps == "fwd" and cells[ps][label].status == "ok" and not diffs and outs:
                ref = t(call(t(q), t(k), t(v), causal)).float()
                diffs = {s: float((o.float() - ref).abs().max()) for s, o in outs.items()}
                diffs["against"] = label
    return dict(b=b, h=h, cells=cells, diffs=diffs)


def gpt2_row(torch, b, warmup, reps):
    """flashdl fa2 against standard attention (matmul, causal mask, softmax, matmul) in torch:
    one GPT-2 medium attention layer at batch b, forward+backward, float16."""
    import flashdl.torch as fdt

    s, h, d = 1024, 16, 64
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v, dout = (torch.randn(b, s, h, d, device=DEVICE, dtype=torch.float16, generator=gen)
                     for _ in range(4))
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    # Standard attention in its own natural layout, (b, h, s, d) contiguous.
    qs, ks, vs = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    douts = dout.transpose(1, 2).contiguous()
    mask = torch.ones(s, s, device=DEVICE, dtype=torch.bool).triu(1)
    scale = 1.0 / math.sqrt(d)

    def flash():
        out = fdt.attention(qg, kg, vg, causal=True)
        torch.autograd.grad(out, (qg, kg, vg), dout)

    def standard():
        scores = torch.matmul(qs, ks.transpose(-1, -2)) * scale
        p = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        out = torch.matmul(p, vs)
        torch.autograd.grad(out, (qs, ks, vs), douts)

    flops = attention_flops(b, h, s, s, d, True, "fwd+bwd")
    return dict(b=b, flash=measure(torch, flash, flops, warmup, reps, "error"),
                standard=measure(torch, standard, flops, warmup, reps, "n/a"))


def gpt2_rows(torch, warmup, reps):
    """Batch 8, and batch 64 as in the paper's Figure 2."""
    rows = []
    for b in (8, 64):
        rows.append(gpt2_row(torch, b, warmup, reps))
        torch.cuda.empty_cache()  # the standard attention's b x h x s x s buffers
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="a small subset (fp16, headdim 64 and 128, seqlen 1024 and 4096, 5 reps)")
    ap.add_argument("--out", default=None, help="markdown file for the tables")
    ap.add_argument("--dtypes", default="fp16,bf16", help="comma-separated: fp16, bf16")
    ap.add_argument("--headdims", default="64,128,256")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--schedules", default="fa2,fa1")
    ap.add_argument("--fa1-max-seqlen", type=int, default=4096,
                    help="longest sequence fa1 runs at (it is slow by design: the paper's IO)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--features", action="store_true",
                    help="block-sparse attention against density, dropout, varlen")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="with --features: run that mode on the CPU backend, tiny shapes, one "
                         "call per cell (checks the script without a GPU)")
    args = ap.parse_args()
    if args.cpu_dry_run and not args.features:
        ap.error("--cpu-dry-run goes with --features")
    if args.features:
        from cuda_features import run_features  # beside this file, like tables

        return run_features(ap, args, sys.modules[__name__])
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    torch, why = cuda_available()
    if torch is None:
        sys.exit(f"bench_cuda.py: no CUDA device to benchmark on: {why}")
    dtypes = [DTYPES[x] for x in parse_list(args.dtypes)]
    headdims, seqlens = parse_list(args.headdims, int), parse_list(args.seqlens, int)
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    schedules = parse_list(args.schedules)

    info = flashdl.info()
    device = gpu_model(torch)
    print(f"flashdl {info['version']} (CUDA architectures {','.join(info['cuda_architectures'])}), "
          f"torch {torch.__version__} (CUDA {torch.version.cuda}), {device}", flush=True)
    columns = [f"flashdl {s}" for s in schedules] + [label for _, label in SDPA_BACKENDS]
    results, failures = [], []
    for dtype in dtypes:
        for causal in causals:
            for d in headdims:
                for seqlen in seqlens:
                    r = config_rows(torch, dtype, d, seqlen, causal, schedules, args.warmup,
                                    args.reps, args.fa1_max_seqlen)
                    r.update(dtype=dtype, causal=causal, d=d, seqlen=seqlen)
                    results.append(r)
                    for ps, cells in r["cells"].items():
                        print(f"  {dtype} causal={causal!s:5s} d={d:3d} s={seqlen:5d} {ps:7s} " +
                              "  ".join(f"{c}: {cells[c].text()}" for c in columns), flush=True)
                        failures += [f"{dtype} causal={causal} d={d} s={seqlen} {ps} {c}: "
                                     f"{cells[c].why}" for c in columns if cells[c].status == "error"]
    print("  GPT-2 medium attention layer ...", flush=True)
    gpt2 = gpt2_rows(torch, args.warmup, args.reps)
    failures += [f"GPT-2 b={r['b']} flashdl fa2: {r['flash'].why}" for r in gpt2
                 if r["flash"].status == "error"]

    lines = [
        f"# CUDA: flashdl vs torch SDPA ({datetime.date.today().isoformat()})",
        "",
        f"- device: {device}, NVIDIA driver {nvidia_driver()}",
        f"- torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
        f"{torch.backends.cudnn.version()}; flashdl {info['version']}, CUDA architectures "
        f"{','.join(info['cuda_architectures'])}",
        f"- command: `python benchmarks/bench_cuda.py {' '.join(sys.argv[1:])}`",
        "- shapes: 16k tokens per batch (batch = 16384 / seqlen), nheads = 2048 / headdim; flashdl "
        "gets (batch, seqlen, nheads, headdim), SDPA (batch, nheads, seqlen, headdim) views of the "
        "same memory",
        f"- CUDA events on the current stream, {args.warmup} warm-up calls, median of {args.reps} "
        f"(fewer for calls slower than {TARGET_SECONDS:.0f} s / (warm-up + reps)); backward "
        "through autograd",
        "- cells: TFLOP/s (ms), flash-attn's count (fwd 4·b·h·s²·d, halved when causal; fwd+bwd "
        "3.5x); n/a: the backend refused the shape; not run: fa1 beyond --fa1-max-seqlen "
        f"{args.fa1_max_seqlen}; ratio: SDPA flash time / flashdl time (> 1: "
        "flashdl is faster); max |Δout|: flashdl's forward output against the named SDPA backend's",
        "",
        "| dtype | causal | pass | headdim | seqlen | batch x heads | " + " | ".join(columns) +
        " | " + " | ".join(f"{s} speed / SDPA flash" for s in schedules) + " | max \\|Δout\\| |",
        "|" + "---|" * (6 + len(columns) + len(schedules) + 1),
    ]
    for r in results:
        for ps, cells in r["cells"].items():
            ratios = []
            for s in schedules:
                mine, ref = cells[f"flashdl {s}"], cells["SDPA flash"]
                ok = mine.status == "ok" and ref.status == "ok"
                ratios.append(f"{ref.ms / mine.ms:.2f}" if ok else "–")
            diff = "–"
            if ps == "fwd" and r["diffs"]:
                diff = ", ".join(f"{s} {r['diffs'][s]:.1e}" for s in schedules if s in r["diffs"])
                diff += f" ({r['diffs']['against']})"
            lines.append(f"| {r['dtype']} | {r['causal']} | {ps} | {r['d']} | {r['seqlen']} | "
                         f"{r['b']} x {r['h']} | " + " | ".join(cells[c].text() for c in columns) +
                         " | " + " | ".join(ratios) + f" | {diff} |")
    lines += [
        "",
        "GPT-2 medium attention layer (seqlen 1024, 16 heads, headdim 64, causal, float16), "
        "forward+backward. Standard attention: matmul, causal mask, softmax, matmul in torch, on "
        "(batch, heads, seqlen, headdim) tensors. The FlashAttention paper (Figure 2, A100, batch "
        "64, with dropout and masking in the standard one) reports 41.7 ms standard against 7.3 ms.",
        "",
        "| batch | flashdl fa2 ms | standard ms | speedup | flashdl TFLOP/s | standard TFLOP/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in gpt2:
        f, s = r["flash"], r["standard"]
        both = f.status == "ok" and s.status == "ok"
        ms = lambda c: f"{c.ms:.2f}" if c.status == "ok" else c.status
        tf = lambda c: f"{c.flops / c.ms / 1e9:.1f}" if c.status == "ok" else "–"
        speedup = f"{s.ms / f.ms:.2f}" if both else "–"
        lines.append(f"| {r['b']} | {ms(f)} | {ms(s)} | {speedup} | {tf(f)} | {tf(s)} |")
    refused = sorted({f"{c}: {cells[c].why}" for r in results for cells in r["cells"].values()
                      for c in columns if cells[c].status == "n/a"})
    if refused:
        lines += ["", "Refusals (n/a):", ""] + [f"- {x}" for x in refused]
    if failures:
        lines += ["", "flashdl failures:", ""] + [f"- {x}" for x in failures]
    emit(lines, args.out)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
