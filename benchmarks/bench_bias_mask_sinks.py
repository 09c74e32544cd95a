"""Attention bias (with dBias), boolean mask and sinks against plain attention and against torch SDPA
given the same float mask, on (1, 8, 2048, 64), float32 and bfloat16, forward and forward+backward
(issue 28's targets: a (1, h, sq, sk) bias <= 1.35x plain forward and <= 1.5x forward+backward;
>= 1.0x torch SDPA with the same mask).

Run:  python benchmarks/bench_bias_mask_sinks.py [rounds]

Each round runs every variant once, alternating, and the table takes medians over rounds, so all
variants see the same machine state.
"""
import sys, time, statistics, torch, torch.nn.functional as F, flashdl.torch as ft
torch.manual_seed(0)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
def med(fns):
    for f in fns.values(): f()
    ts = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            s = time.perf_counter(); f(); ts[n].append(time.perf_counter() - s)
    return {n: statistics.median(v) for n, v in ts.items()}
for dt in (torch.float32, torch.bfloat16):
    q, k, v = (torch.randn(1, 2048, 8, 64).to(dt) for _ in range(3))
    bias = torch.randn(1, 8, 2048, 2048).to(dt)
    tq, tk, tv = (x.transpose(1, 2) for x in (q, k, v))
    with torch.no_grad():
        r = med({"plain": lambda: ft.attention(q, k, v),
                 "bias": lambda: ft.attention(q, k, v, bias=bias),
                 "sinks": lambda: ft.attention(q, k, v, sinks=torch.zeros(8)),
                 "mask": lambda: ft.attention(q, k, v, mask=torch.ones(2048, 2048, dtype=torch.bool)),
                 "torch sdpa + mask": lambda: F.scaled_dot_product_attention(tq, tk, tv, attn_mask=bias)})
    print(f"{dt} forward ms:", {n: round(1e3 * x, 1) for n, x in r.items()},
          f"bias/plain {r['bias']/r['plain']:.2f}x, sdpa/flashdl(bias) {r['torch sdpa + mask']/r['bias']:.2f}x")
    def step(extra=None, sdpa=False):
        x = [z.detach().requires_grad_() for z in (q, k, v)]
        b = bias.detach().requires_grad_()
        if sdpa:
            o = F.scaled_dot_product_attention(*(z.transpose(1, 2) for z in x), attn_mask=b)
        else:
            o = ft.attention(*x, **({extra: b} if extra else {}))
        o.sum().backward()
    r = med({"plain": lambda: step(), "bias+dbias": lambda: step("bias"),
             "torch sdpa + mask": lambda: step(sdpa=True)})
    print(f"{dt} fwd+bwd ms:", {n: round(1e3 * x, 1) for n, x in r.items()},
          f"bias/plain {r['bias+dbias']/r['plain']:.2f}x, sdpa/flashdl(bias) {r['torch sdpa + mask']/r['bias+dbias']:.2f}x")
