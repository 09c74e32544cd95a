"""One fa2 forward and one fa2 backward per shape on the GPU, for a profiler to look at.

Run under Nsight Compute (tools/gpu_check.sh's `profile` step does this):
    ncu --kernel-name-base function --kernel-name regex:'forward_kernel|backward_kernel|...' \
        --section SpeedOfLight ... python benchmarks/profile_cuda.py [--headdims 128,64]
        [--seqlens 4096] [--dtype fp16] [--causal]

Shapes are bench_cuda.py's: 16k tokens per batch (batch = 16384 // seqlen), nheads = 2048 //
headdim, (batch, seqlen, nheads, headdim) tensors of random values. Every kernel of the calls
(the forward, the backward's preprocess, main kernel and dQ conversion) runs once per shape: ncu
replays each kernel for its metrics, so no warm-up is needed. Prints each shape.
"""
from __future__ import annotations

import argparse
import sys

import flashdl

TOKENS = 16384
DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--headdims", default="128,64")
    ap.add_argument("--seqlens", default="4096")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--schedule", default="fa2", choices=["fa2", "fa1"])
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        sys.exit("profile_cuda.py: needs torch (the tensors are torch CUDA tensors)")
    info = flashdl.info()
    if not torch.cuda.is_available() or "cuda" not in info["backends"]:
        sys.exit(f"profile_cuda.py: no CUDA device to profile on: {info['cuda_status']}")
    tdt = getattr(torch, DTYPES[args.dtype])
    for d in (int(x) for x in args.headdims.split(",") if x):
        for seqlen in (int(x) for x in args.seqlens.split(",") if x):
            b, h = max(1, TOKENS // seqlen), max(1, 2048 // d)
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, dout = (torch.randn(b, seqlen, h, d, device="cuda", dtype=tdt, generator=gen)
                             for _ in range(4))
            kw = dict(causal=args.causal, schedule=args.schedule)

            out, lse = flashdl.attention(q, k, v, return_lse=True, **kw)
            flashdl.attention_backward(dout, q, k, v, out, lse, **kw)
            torch.cuda.synchronize()
            print(f"{args.dtype} causal={args.causal} d={d} seqlen={seqlen} batch={b} heads={h}",
                  flush=True)


if __name__ == "__main__":
    main()
