"""CPU training at small shapes: flashdl.torch against torch SDPA as a training loop calls them.

Run:  python benchmarks/bench_training.py [--out benchmarks/results/training.md] [--reps 300]

Three tables, every number from one process, flashdl and torch timed call after call:

1. The torch path's own cost at (1, s_q, 8, 64) float32: flashdl.torch.attention forward + backward
   (torch.autograd.grad) minus NumPy flashdl.attention + attention_backward on the same data, the
   same minus the extension's two calls alone, and the floor any Python autograd.Function pays for
   the same call (an empty Function with the same inputs and outputs through the same
   torch.autograd.grad).
2. The interleaved harness: for each cell of a small grid, flashdl.torch then SDPA (on (b, h, s, d)
   views), call after call with no gap and no settling (the order a training step runs them in:
   neither library's idle threads get time to go quiet), forward alone (no grad) and forward +
   backward through autograd. Per callable the minimum over --reps calls; per cell the median of
   the paired ratios SDPA time / flashdl time of consecutive calls (above 1: flashdl faster).
   bench_shapes.py --grid issue31 times the same cells after 50 ms of settling instead.
3. A training step of a small transformer (2 pre-norm layers, d_model 256, 4 heads of 64, MLP 4x,
   causal, seqlen 128, batch 8, AdamW), the same weights with attention by flashdl.torch
   (layout "bhsd") or by SDPA, steps alternating.

`--interplay` adds what a torch matmul costs right after a flashdl call, right after an SDPA call
and after a 20 ms pause (the pools' idle threads on the same cores).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import numpy as np

import flashdl
from tables import cpu_model, emit


def paired(fa, fb, reps, warm=20):
    """fa then fb, call after call: (min a, min b, median of b/a over the pairs), seconds."""
    for _ in range(warm):
        fa()
        fb()
    ta, tb = [], []
    clock = time.perf_counter
    for _ in range(reps):
        t0 = clock()
        fa()
        t1 = clock()
        fb()
        t2 = clock()
        ta.append(t1 - t0)
        tb.append(t2 - t1)
    return min(ta), min(tb), statistics.median(b / a for a, b in zip(ta, tb))


def interleaved_min(fns, reps, warm=20):
    """Each fn in turn, round after round: the minimum per fn, seconds."""
    for _ in range(warm):
        for f in fns:
            f()
    best = [float("inf")] * len(fns)
    clock = time.perf_counter
    for _ in range(reps):
        for i, f in enumerate(fns):
            t = clock()
            f()
            best[i] = min(best[i], clock() - t)
    return best


def own_cost_rows(torch, reps):
    import flashdl.torch as fdt

    class Floor(torch.autograd.Function):
        """q, k, v in, out and lse (non-differentiable) out, five tensors saved, three gradients
        made: a plain autograd.Function for the same call, with no work."""

        @staticmethod
        def forward(ctx, q, k, v):
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[0], q.shape[2], q.shape[1])
            ctx.save_for_backward(q.detach(), k.detach(), v.detach(), out.detach(), lse)
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, _dlse):
            q, k, v, _out, _lse = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    rows = []
    for sq, sk in ((16, 16), (16, 128), (128, 128)):
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, sq, 8, 64, generator=gen)
        k, v = (torch.randn(1, sk, 8, 64, generator=gen) for _ in range(2))
        dout = torch.randn(1, sq, 8, 64, generator=gen)
        qn, kn, vn, dn = (x.numpy() for x in (q, k, v, dout))
        out, lse = flashdl.attention(qn, kn, vn, return_lse=True)
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        # the extension's two calls alone, into arrays made beforehand
        on, ln = np.empty_like(qn), np.empty_like(lse)
        dqn, dkn, dvn = np.empty_like(qn), np.empty_like(kn), np.empty_like(vn)

        def ext_step():
            flashdl._ext.forward_default(qn, kn, vn, on, ln, False)
            flashdl._ext.backward(dn, qn, kn, vn, on, ln, dqn, dkn, dvn)

        def torch_step():
            torch.autograd.grad(fdt.attention(qg, kg, vg), (qg, kg, vg), dout)

        def floor_step():
            torch.autograd.grad(Floor.apply(qg, kg, vg)[0], (qg, kg, vg), dout)

        nf, nb, tt, fl = interleaved_min([
            lambda: flashdl.attention(qn, kn, vn, return_lse=True),
            lambda: flashdl.attention_backward(dn, qn, kn, vn, out, lse),
            torch_step, floor_step], reps)
        # A rotation of its own: a callable added to the first moves its minima by 1-2 us (what
        # runs before a call warms or evicts what it uses).
        tt2, ex = interleaved_min([torch_step, ext_step], reps)
        rows.append((sq, sk, nf, nb, tt, fl, ex, tt2 - ex))
        print(f"  own cost {sq} x {sk}: numpy {nf*1e6:.1f} + {nb*1e6:.1f} us, extension "
              f"{ex*1e6:.1f} us, torch {tt*1e6:.1f} us, floor {fl*1e6:.1f} us", flush=True)
    return rows


def grid_rows(torch, sides, dtype_name, reps):
    import torch.nn.functional as F

    import flashdl.torch as fdt

    dt = getattr(torch, dtype_name)
    rows = []
    for causal in (False, True):
        for sq in sides:
            for sk in sides:
                gen = torch.Generator().manual_seed(0)
                q = torch.randn(1, 8, sq, 64, generator=gen).to(dt)
                k, v = (torch.randn(1, 8, sk, 64, generator=gen).to(dt) for _ in range(2))
                dout = torch.randn(1, 8, sq, 64, generator=gen).to(dt)
                qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
                # flashdl's causal is bottom-right aligned; SDPA's is_causal top-left: the same
                # mask only for sq == sk, else torch's lower-right causal bias.
                mask = {}
                if causal and sq != sk:
                    from torch.nn.attention.bias import causal_lower_right
                    mask = {"attn_mask": causal_lower_right(sq, sk)}
                elif causal:
                    mask = {"is_causal": True}

                def fd_fwd():
                    with torch.no_grad():
                        fdt.attention(q, k, v, causal=causal, layout="bhsd")

                def th_fwd():
                    with torch.no_grad():
                        F.scaled_dot_product_attention(q, k, v, **mask)

                def fd_all():
                    out = fdt.attention(qg, kg, vg, causal=causal, layout="bhsd")
                    torch.autograd.grad(out, (qg, kg, vg), dout)

                def th_all():
                    out = F.scaled_dot_product_attention(qg, kg, vg, **mask)
                    torch.autograd.grad(out, (qg, kg, vg), dout)

                n = reps if sq * sk <= 128 * 128 else max(20, reps // 10)
                fwd = paired(fd_fwd, th_fwd, n)
                both = paired(fd_all, th_all, n)
                rows.append((causal, sq, sk, fwd, both))
                print(f"  {'causal' if causal else 'plain'} {sq} x {sk}: fwd {fwd[0]*1e6:.0f} / "
                      f"{fwd[1]*1e6:.0f} us (paired {fwd[2]:.2f}), fwd+bwd {both[0]*1e6:.0f} / "
                      f"{both[1]*1e6:.0f} us (paired {both[2]:.2f})", flush=True)
    return rows


def training_rows(torch, steps):
    import torch.nn as nn
    import torch.nn.functional as F

    import flashdl.torch as fdt

    d_model, heads, seq, batch = 256, 4, 128, 8

    class Layer(nn.Module):
        def __init__(self, attn):
            super().__init__()
            self.attn = attn
            self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
            self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
            self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                     nn.Linear(4 * d_model, d_model))

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, heads, -1).transpose(1, 3).unbind(2)
            a = self.attn(q, k, v)  # (b, h, s, d)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, d_model))
            return x + self.mlp(self.ln2(x))

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def ours(q, k, v):
        return fdt.attention(q, k, v, causal=True, layout="bhsd")

    torch.manual_seed(0)
    models = {}
    for name, attn in (("flashdl", ours), ("sdpa", sdpa)):
        torch.manual_seed(0)
        models[name] = nn.Sequential(Layer(attn), Layer(attn))
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-4) for n, m in models.items()}
    x = torch.randn(batch, seq, d_model, generator=torch.Generator().manual_seed(1))
    target = torch.randn(batch, seq, d_model, generator=torch.Generator().manual_seed(2))

    def step(name):
        def run():
            opts[name].zero_grad(set_to_none=True)
            loss = F.mse_loss(models[name](x), target)
            loss.backward()
            opts[name].step()
        return run

    fa, fb, ratio = paired(step("flashdl"), step("sdpa"), steps, warm=5)
    print(f"  training step: flashdl {fa*1e3:.2f} ms, SDPA {fb*1e3:.2f} ms (paired {ratio:.2f})",
          flush=True)
    return fa, fb, ratio


def interplay_rows(torch, reps):
    """A (512 x 256) @ (256 x 1024) matmul right after a flashdl call, right after an SDPA call,
    and after a 20 ms pause; minimum and median per case (seconds)."""
    import torch.nn.functional as F

    import flashdl.torch as fdt

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(512, 256, generator=gen), torch.randn(256, 1024, generator=gen)
    q = torch.randn(8, 4, 128, 64, generator=gen)

    def fd():
        fdt.attention(q, q, q, causal=True, layout="bhsd")

    def th():
        F.scaled_dot_product_attention(q, q, q, is_causal=True)

    def pause():
        time.sleep(0.02)

    out = {}
    for name, before in (("after flashdl", fd), ("after SDPA", th), ("after 20 ms idle", pause)):
        times = []
        for _ in range(reps):
            before()
            t = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t)
        out[name] = (min(times), statistics.median(times))
    # and the other way round: flashdl's call right after a torch matmul, or after a pause
    for name, before in (("flashdl after a matmul", lambda: a @ b),
                         ("flashdl after 20 ms idle", pause)):
        times = []
        for _ in range(reps):
            before()
            t = time.perf_counter()
            fd()
            times.append(time.perf_counter() - t)
        out[name] = (min(times), statistics.median(times))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="markdown file for the tables")
    ap.add_argument("--reps", type=int, default=300, help="calls per cell (small cells)")
    ap.add_argument("--sides", default="16,128,512", help="the grid's seqlens")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=30, help="training steps of each model")
    ap.add_argument("--interplay", action="store_true")
    ap.add_argument("--threads", type=int, default=0,
                    help="threads of both libraries (0: flashdl's default)")
    ap.add_argument("--note", default="", help="a line about the machine's state")
    args = ap.parse_args()
    import torch

    if args.threads > 0:
        flashdl.set_num_threads(args.threads)
    threads = flashdl.info()["num_threads"]
    torch.set_num_threads(threads)
    sides = [int(s) for s in args.sides.split(",")]
    own = own_cost_rows(torch, args.reps * 5)
    grid = grid_rows(torch, sides, args.dtype, args.reps)
    train = training_rows(torch, args.steps)
    inter = interplay_rows(torch, args.reps // 3) if args.interplay else None
    with open("/proc/loadavg") as fh:
        load = " ".join(fh.read().split()[:3])
    info = flashdl.info()
    lines = [
        f"# CPU training at small shapes: flashdl.torch vs torch SDPA ({datetime.date.today()})",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} logical CPUs; load average at the end {load}"
        + (f"; {args.note}" if args.note else ""),
        f"- flashdl {info['version']}, CPU kernels `{info['cpu_isa']}`, {threads} "
        f"thread{'s' * (threads > 1)}; torch {torch.__version__}, {torch.get_num_threads()} "
        f"thread{'s' * (torch.get_num_threads() > 1)}",
        "- command: `python benchmarks/bench_training.py"
        + (f" --reps {args.reps}" if args.reps != 300 else "")
        + (f" --sides {args.sides}" if args.sides != "16,128,512" else "")
        + (f" --dtype {args.dtype}" if args.dtype != "float32" else "")
        + (f" --steps {args.steps}" if args.steps != 30 else "")
        + (f" --threads {args.threads}" if args.threads else "")
        + (" --interplay" if args.interplay else "")
        + (f" --note \"{args.note}\"" if args.note else "") + "`",
        "",
        "## The torch path's own cost (float32, batch 1, 8 heads, head dim 64)",
        "",
        "Minimum over interleaved rounds of "
        f"{args.reps * 5} calls each. Own cost: flashdl.torch forward + backward "
        "(torch.autograd.grad) minus NumPy `attention` + `attention_backward` on the same data "
        "(the issue's measure; NumPy's calls carry Python of their own, ~15 us in the backward); "
        "over the extension: minus the extension's `forward_default` + `backward` alone, into "
        "arrays made beforehand (everything the torch path adds: its Python, its allocations, "
        "autograd), the two timed in a rotation of their own. Floor: an empty autograd.Function with the same tensors in and out (out and "
        "lse, five saved) through the same torch.autograd.grad: what any Python "
        "autograd.Function pays here, part of the own cost over the extension.",
        "",
        "| q x k | NumPy fwd | NumPy bwd | extension fwd+bwd | flashdl.torch fwd+bwd | own cost | "
        "own cost over the extension | floor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for sq, sk, nf, nb, tt, fl, ex, over_ex in own:
        lines.append(f"| {sq} x {sk} | {nf*1e6:.1f} us | {nb*1e6:.1f} us | {ex*1e6:.1f} us | "
                     f"{tt*1e6:.1f} us | {(tt - nf - nb)*1e6:.1f} us | {over_ex*1e6:.1f} us | "
                     f"{fl*1e6:.1f} us |")
    lines += [
        "",
        f"## Interleaved harness ({args.dtype}, batch 1, 8 heads, head dim 64)",
        "",
        "flashdl.torch (layout \"bhsd\") then SDPA, call after call, no gap; minimum of each over "
        f"{args.reps} calls ({max(20, args.reps // 10)} where q x k > 128 x 128); ratio: SDPA "
        "time / flashdl time, of the minima and the median of the paired ratios (above 1: "
        "flashdl faster).",
        "",
        "| mask | q x k | fwd flashdl | fwd SDPA | fwd ratio (min / paired) | fwd+bwd flashdl | "
        "fwd+bwd SDPA | fwd+bwd ratio (min / paired) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for causal, sq, sk, (ff, ft, fr), (bf, bt, br) in grid:
        lines.append(f"| {'causal' if causal else 'none'} | {sq} x {sk} | {ff*1e6:.0f} us | "
                     f"{ft*1e6:.0f} us | {ft/ff:.2f} / {fr:.2f} | {bf*1e6:.0f} us | "
                     f"{bt*1e6:.0f} us | {bt/bf:.2f} / {br:.2f} |")
    fa, fb, ratio = train
    lines += [
        "",
        "## A small transformer's training step",
        "",
        "2 pre-norm layers, d_model 256, 4 heads of 64, MLP 4x, causal, seqlen 128, batch 8, "
        f"float32, AdamW; steps of the two models alternating, {args.steps} each.",
        "",
        "| attention | step (min) | ratio (min / paired) |",
        "|---|---|---|",
        f"| flashdl.torch | {fa*1e3:.2f} ms | {fb/fa:.2f} / {ratio:.2f} |",
        f"| torch SDPA | {fb*1e3:.2f} ms | 1 |",
    ]
    if inter:
        lines += [
            "",
            "## Thread-pool interplay",
            "",
            "A (512 x 256) @ (256 x 1024) float32 matmul timed right after another call, and "
            "flashdl's (8, 4, 128, 64) causal forward right after a matmul; minimum / median of "
            f"{args.reps // 3}.",
            "",
            "| case | min | median |",
            "|---|---|---|",
        ]
        for name, (lo, med) in inter.items():
            lines.append(f"| {name} | {lo*1e6:.0f} us | {med*1e6:.0f} us |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
