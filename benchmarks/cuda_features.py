"""The --features mode of bench_cuda.py: block-sparse attention, dropout and varlen on CUDA.

Run:  python benchmarks/bench_cuda.py --features [--quick] [--dtypes fp16] [--headdims 64,128]
      [--seqlens 8192] [--schedules fa2] [--warmup 5] [--reps 20]
      [--out benchmarks/results/cuda_features.md]
      python benchmarks/bench_cuda.py --features --cpu-dry-run   (no GPU needed; see below)

- Block-sparse: random block masks of density 1, 1/2, 1/4, 1/8 and 1/16 over blocks of 128 (one
  (nblocks, nblocks) plane for every batch and head, exactly round(density * nblocks^2) blocks
  set), not causal, forward and forward+backward; each time is also given as a fraction of the
  all-true mask's (same schedule and shape), which the IO analysis predicts to be the density.
  "no mask" is dense attention: the price of the mask itself.
- Dropout (fa2): p = 0.1 against p = 0, forward and forward+backward, causal and not: the Philox
  draws, once per element in the forward and again in the backward.
- Variable length (fa2): 16 sequences of random lengths 128..4096 packed (attention_varlen, one
  launch, offsets on the device) against the same batch padded to its longest sequence and run
  dense, which is what a padded batch pays; not causal.

Shapes as in the main mode: 16k tokens per batch (batch = 16384 // seqlen), nheads = 2048 //
headdim; timing by bench_cuda's CUDA events (median, warm-up first), the backward through
autograd. --cpu-dry-run runs the same code on the CPU backend with tiny shapes and one call per
cell (wall-clock timer): it checks the script without a GPU and measures nothing worth keeping.
"""
from __future__ import annotations

import datetime
import statistics
import sys
import time

import numpy as np

import flashdl
from tables import (PASS_FACTOR, attention_flops, cpu_model, emit, gpu_model,
                    nvidia_driver)

DENSITIES = (1.0, 0.5, 0.25, 0.125, 0.0625)
BLOCK = 128
DROPOUT_P = 0.1
TOKENS = 16384
DEFAULTS = dict(dtypes="fp16", headdims="64,128", seqlens="8192", schedules="fa2")
QUICK = dict(seqlens="2048", warmup=2, reps=5)
DRY_RUN = dict(dtypes="fp16", headdims="64", seqlens="512", schedules="fa2,fa1", warmup=0, reps=1)
DRY_RUN_TOKENS = 512  # batch 1: small enough for two CPU cores in seconds
VARLEN_SEQS, VARLEN_LENS, DRY_RUN_VARLEN_LENS = 16, (128, 4096), (16, 128)
DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


def cpu_time_ms(torch, fn, warmup, reps):
    """Median wall-clock milliseconds of fn() (the dry run's stand-in for CUDA events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def random_blocks(rng, nb, density):
    """An (nb, nb) mask with exactly round(density * nb^2) blocks set, chosen uniformly."""
    mask = np.zeros(nb * nb, dtype=bool)
    mask[rng.choice(nb * nb, int(round(density * nb * nb)), replace=False)] = True
    return mask.reshape(nb, nb)


class Bench:
    """One run's settings: where tensors live, how cells are timed (bench_cuda's measure and
    Cell), and the failures so far."""

    def __init__(self, torch, helpers, timer, device, warmup, reps, tokens):
        self.torch, self.helpers, self.timer, self.device = torch, helpers, timer, device
        self.warmup, self.reps, self.tokens = warmup, reps, tokens
        self.failures = []

    def not_run(self):
        return self.helpers.Cell(status="not run")

    def inputs(self, dtype, d, seqlen):
        """(b, h, q, k, v, dout, leaves): (b, seqlen, h, d) tensors and q, k, v for autograd."""
        torch = self.torch
        b, h = max(1, self.tokens // seqlen), max(1, 2048 // d)
        gen = torch.Generator(device=self.device).manual_seed(0)
        q, k, v, dout = (torch.randn(b, seqlen, h, d, device=self.device,
                                     dtype=getattr(torch, dtype), generator=gen)
                         for _ in range(4))
        return b, h, q, k, v, dout, [x.detach().requires_grad_() for x in (q, k, v)]

    def time_pair(self, what, flops, fwd, fwd_bwd):
        """Cells (fwd, fwd+bwd) of one configuration; failures are recorded under `what`."""
        cells = [self.helpers.measure(self.torch, fn, flops * PASS_FACTOR[ps], self.warmup,
                                      self.reps, "error", timer=self.timer)
                 for fn, ps in ((fwd, "fwd"), (fwd_bwd, "fwd+bwd"))]
        self.failures += [f"{what} {ps}: {c.why}" for ps, c in zip(("fwd", "fwd+bwd"), cells)
                          if c.status == "error"]
        return cells


def dense_calls(torch, q, k, v, dout, leaves, **opts):
    """(forward, forward+backward through autograd) of flashdl.attention with `opts`."""
    import flashdl.torch as fdt

    def fwd_bwd():
        torch.autograd.grad(fdt.attention(*leaves, **opts), leaves, dout)

    return (lambda: flashdl.attention(q, k, v, **opts)), fwd_bwd


def ms(cell):
    return f"{cell.ms:.3f}" if cell.status == "ok" else cell.status


def ratio(cell, ref):
    return f"{cell.ms / ref.ms:.3f}" if cell.status == ref.status == "ok" else "–"


def block_sparse_lines(bench, dtype, d, seqlen, schedules, fa1_max_seqlen):
    b, h, q, k, v, dout, leaves = bench.inputs(dtype, d, seqlen)
    nb = -(-seqlen // BLOCK)
    rng = np.random.default_rng(0)
    masks = [("no mask", None)] + [("random", random_blocks(rng, nb, x)) for x in DENSITIES]
    lines = []
    for sched in schedules:
        rows = []  # (mask name, density, [fwd cell, fwd+bwd cell])
        for name, mask in masks:
            density = 1.0 if mask is None else float(mask.mean())
            if sched == "fa1" and seqlen > fa1_max_seqlen:
                rows.append((name, density, [bench.not_run()] * 2))
                continue
            opts = dict(schedule=sched)
            if mask is not None:
                opts.update(block_mask=bench.torch.from_numpy(mask).to(bench.device),
                            block_size=BLOCK)
            # FLOPs of the visible blocks only, so TFLOP/s stay comparable across densities.
            flops = attention_flops(b, h, seqlen, seqlen, d, False) * density
            rows.append((name, density, bench.time_pair(
                f"block-sparse {dtype} d={d} s={seqlen} {sched} {name} {density:.4f}", flops,
                *dense_calls(bench.torch, q, k, v, dout, leaves, **opts))))
        full = rows[1][2]  # the all-true random mask
        for name, density, (f, fb) in rows:
            lines.append(f"| {dtype} | {d} | {seqlen} | {b} x {h} | {sched} | {name} | "
                         f"{density:.4f} | {ms(f)} | {ratio(f, full[0])} | {ms(fb)} | "
                         f"{ratio(fb, full[1])} |")
    return lines


def dropout_lines(bench, dtype, d, seqlen):
    b, h, q, k, v, dout, leaves = bench.inputs(dtype, d, seqlen)
    lines = []
    for causal in (False, True):
        flops = attention_flops(b, h, seqlen, seqlen, d, causal)
        base, drop = (bench.time_pair(f"dropout {dtype} d={d} s={seqlen} causal={causal} p={p}",
                                      flops, *dense_calls(bench.torch, q, k, v, dout, leaves,
                                                          schedule="fa2", causal=causal,
                                                          dropout_p=p, seed=1234))
                      for p in (0.0, DROPOUT_P))
        lines.append(f"| {dtype} | {causal} | {d} | {seqlen} | {b} x {h} | {ms(base[0])} | "
                     f"{ms(drop[0])} | {ratio(drop[0], base[0])} | {ms(base[1])} | "
                     f"{ms(drop[1])} | {ratio(drop[1], base[1])} |")
    return lines


def varlen_lines(bench, dtype, d, lens):
    """Packed against padded: forward and forward+backward, fa2, not causal."""
    import flashdl.torch as fdt

    torch, dev = bench.torch, bench.device
    h, longest, total = max(1, 2048 // d), int(lens.max()), int(lens.sum())
    offsets = np.concatenate([[0], np.cumsum(lens)])
    cu = torch.tensor(offsets, dtype=torch.int32, device=dev)  # read by the kernels on the device
    gen = torch.Generator(device=dev).manual_seed(0)
    packed = [torch.randn(total, h, d, device=dev, dtype=getattr(torch, dtype), generator=gen)
              for _ in range(4)]
    padded = [torch.zeros(len(lens), longest, h, d, device=dev, dtype=x.dtype) for x in packed]
    for b in range(len(lens)):
        for dst, src in zip(padded, packed):
            dst[b, :lens[b]] = src[offsets[b]:offsets[b + 1]]
    leaves = [x.detach().requires_grad_() for x in packed[:3]]
    varlen = (cu, cu, longest, longest)

    def fwd_bwd():
        out = fdt.attention_varlen(*leaves, *varlen, schedule="fa2")
        torch.autograd.grad(out, leaves, packed[3])

    useful = sum(attention_flops(1, h, int(n), int(n), d, False) for n in lens)
    cells = [bench.time_pair(f"varlen {dtype} d={d} packed", useful,
                             lambda: flashdl.attention_varlen(*packed[:3], *varlen, schedule="fa2"),
                             fwd_bwd),
             bench.time_pair(f"varlen {dtype} d={d} padded", useful, *dense_calls(
                 torch, *padded, [x.detach().requires_grad_() for x in padded[:3]],
                 schedule="fa2"))]
    (pf, pfb), (df, dfb) = cells
    work = useful / attention_flops(len(lens), h, longest, longest, d, False)
    return [f"| {dtype} | {d} | {len(lens)} | {lens.min()}..{lens.max()} | {total} | {h} | "
            f"{ms(pf)} | {ms(df)} | {ratio(pf, df)} | {ms(pfb)} | {ms(dfb)} | {ratio(pfb, dfb)} | "
            f"{work:.3f} |"]


def run_features(ap, args, helpers):
    """The --features mode; `helpers` is bench_cuda (cuda_available, measure, Cell). Returns the
    exit status: 1 when a flashdl call failed."""
    for key, value in DEFAULTS.items():  # this mode's own defaults, unless given
        if getattr(args, key) == ap.get_default(key):
            setattr(args, key, value)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.cpu_dry_run:
        import torch

        for key, value in DRY_RUN.items():
            setattr(args, key, value)
        device, timer, machine = "cpu", cpu_time_ms, f"{cpu_model()} (CPU dry run)"
        tokens, lens = DRY_RUN_TOKENS, DRY_RUN_VARLEN_LENS
    else:
        torch, why = helpers.cuda_available()
        if torch is None:
            sys.exit(f"bench_cuda.py --features: no CUDA device to benchmark on: {why}")
        device, timer, machine, tokens, lens = "cuda", None, gpu_model(torch), TOKENS, VARLEN_LENS
    bench = Bench(torch, helpers, timer, device, args.warmup, args.reps, tokens)
    dtypes = [DTYPES[x] for x in args.dtypes.split(",") if x]
    headdims = [int(x) for x in args.headdims.split(",") if x]
    seqlens = [int(x) for x in args.seqlens.split(",") if x]
    schedules = [x for x in args.schedules.split(",") if x]
    info = flashdl.info()
    print(f"flashdl {info['version']}, torch {torch.__version__}, {machine}", flush=True)

    lens = np.random.default_rng(0).integers(lens[0], lens[1] + 1, size=VARLEN_SEQS)
    sparse, dropout, varlen = [], [], []
    for dtype in dtypes:
        for d in headdims:
            for seqlen in seqlens:
                print(f"  {dtype} d={d} s={seqlen} ...", flush=True)
                sparse += block_sparse_lines(bench, dtype, d, seqlen, schedules,
                                             args.fa1_max_seqlen)
                dropout += dropout_lines(bench, dtype, d, seqlen)
            print(f"  {dtype} d={d} varlen ...", flush=True)
            varlen += varlen_lines(bench, dtype, d, lens)
    timing = ("wall clock, one call per cell: a check of the script, not a measurement"
              if args.cpu_dry_run else
              f"CUDA events on the current stream, {args.warmup} warm-up calls, median of "
              f"{args.reps} (fewer for slow calls)")
    lines = [
        f"# CUDA: block-sparse attention, dropout, varlen ({datetime.date.today().isoformat()})",
        "",
        f"- device: {machine}" + ("" if args.cpu_dry_run else
                                  f", NVIDIA driver {nvidia_driver()}"),
        f"- flashdl {info['version']} (backends {', '.join(info['backends'])}), "
        f"torch {torch.__version__}",
        f"- command: `python benchmarks/bench_cuda.py {' '.join(sys.argv[1:])}`",
        f"- shapes: {tokens} tokens per batch (batch = {tokens} / seqlen), nheads = 2048 / "
        f"headdim; timing: {timing}; forward+backward through autograd (flashdl.torch.attention)",
        f"- block-sparse: blocks of {BLOCK}, not causal, random masks (one plane for every batch "
        "and head); ratio = time / the all-true mask's time (same schedule and shape), which the "
        "IO analysis predicts to be the density; not run: fa1 beyond --fa1-max-seqlen "
        f"{args.fa1_max_seqlen}",
        f"- dropout: fa2, p = {DROPOUT_P} against p = 0; ratio = time with dropout / without",
        "- varlen: fa2, not causal, packed (attention_varlen, offsets on the device) against the "
        "same batch padded to its longest sequence and run dense; ratio = packed time / padded "
        "time; work = the packed batch's FLOPs / the padded batch's",
        "",
        "| dtype | headdim | seqlen | batch x heads | schedule | mask | density | fwd ms | "
        "fwd ratio | fwd+bwd ms | fwd+bwd ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *sparse,
        "",
        f"| dtype | causal | headdim | seqlen | batch x heads | fwd ms p=0 | fwd ms "
        f"p={DROPOUT_P} | fwd ratio | fwd+bwd ms p=0 | fwd+bwd ms p={DROPOUT_P} | fwd+bwd ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *dropout,
        "",
        "| dtype | headdim | sequences | lengths | tokens | heads | packed fwd ms | padded fwd ms "
        "| fwd ratio | packed fwd+bwd ms | padded fwd+bwd ms | fwd+bwd ratio | work |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *varlen,
    ]
    if bench.failures:
        lines += ["", "flashdl failures:", ""] + [f"- {x}" for x in bench.failures]
    emit(lines, args.out)
    return 1 if bench.failures else 0
