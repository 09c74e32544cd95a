"""Continuous batching over one paged KV pool: chunked prefill, then decoding with fused rotary.

Run:  python examples/continuous_batching.py [--chunk 8] [--seed 0]

(NumPy and an installed flashdl; a few seconds on 2 cores.)

A decoder-only transformer with random weights (2 layers, d_model 128, 8 query heads over 2
key/value heads, head dim 16, GPT-NeoX rotary positions, RMSNorm, SiLU MLP, vocabulary 100)
serves six requests of different prompt lengths and output budgets, which arrive at different
engine steps and leave when done, the way a serving engine runs them:

- One page pool per layer, (num_pages, page_size 4, nheads_kv, head_dim), pages handed out from
  a free list as sequences grow and given back when a request finishes. The pool is smaller than
  what all requests need together: later requests run on pages earlier ones returned.
- Every engine step admits the requests that have arrived, then runs two batches:
  chunked prefill -- each admitted request's next chunk of at most --chunk prompt tokens, all of
  them packed in one flashdl.attention_varlen call per layer that reads the keys through the
  page table (block_table; the chunk's own keys are written into the pages first, rotated in
  NumPy), causal, so a chunk sees its prompt so far;
  decoding -- every request past its prompt, one token each, in one
  flashdl.attention_with_kvcache call per layer with the rotary embedding fused into the call
  (rotary_cos/rotary_sin: the unrotated q and k go in, the call rotates them and appends the
  rotated k to the pages).
- The check: each request decoded alone with no cache, recomputing full causal attention
  (flashdl.attention) over its whole sequence at every step, must give the same tokens. Prints
  both and "OK", or exits with status 1.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import flashdl

VOCAB, D_MODEL, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 100, 128, 2, 8, 2, 16, 256
PAGE_SIZE = 4
MAX_POS = 256
# (arrival step, prompt length, new tokens)
REQUESTS = [(0, 23, 10), (0, 5, 4), (1, 14, 12), (3, 30, 6), (6, 9, 9), (9, 17, 7)]


class Model:
    """Random float32 weights; rotary tables cos, sin (MAX_POS, HEAD_DIM / 2) in float32."""

    def __init__(self, seed):
        rng = np.random.default_rng(seed)

        def w(*shape):
            return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

        self.emb = rng.standard_normal((VOCAB, D_MODEL)).astype(np.float32)
        self.layers = [dict(wq=w(D_MODEL, HEADS * HEAD_DIM), wk=w(D_MODEL, KV_HEADS * HEAD_DIM),
                            wv=w(D_MODEL, KV_HEADS * HEAD_DIM), wo=w(HEADS * HEAD_DIM, D_MODEL),
                            w1=w(D_MODEL, FFN), w2=w(FFN, D_MODEL)) for _ in range(LAYERS)]
        self.out = w(D_MODEL, VOCAB) * 4  # sharper logits: clear greedy choices
        half = HEAD_DIM // 2
        ang = np.arange(MAX_POS)[:, None] * (1.0 / (10000.0 ** (np.arange(half) / half)))
        self.cos, self.sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    @staticmethod
    def norm(x):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)

    def rope(self, x, pos):
        """GPT-NeoX rotary positions on (..., seqlen, heads, HEAD_DIM) at pos (..., seqlen), in
        float32 as flashdl's fused rotary computes them (products, then their sum)."""
        cos, sin = self.cos[pos][..., None, :], self.sin[pos][..., None, :]
        a, b = x[..., :HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    def forward(self, tokens, pos, attend, rotate=True):
        """Logits (batch, seqlen, VOCAB); attend(layer, q, k, v) -> (batch, seqlen, HEADS,
        HEAD_DIM). rotate False: q and k go to attend unrotated (it rotates them)."""
        bsz, n = tokens.shape
        x = self.emb[tokens]
        for i, lw in enumerate(self.layers):
            h = self.norm(x)
            q = (h @ lw["wq"]).reshape(bsz, n, HEADS, HEAD_DIM)
            k = (h @ lw["wk"]).reshape(bsz, n, KV_HEADS, HEAD_DIM)
            v = (h @ lw["wv"]).reshape(bsz, n, KV_HEADS, HEAD_DIM)
            if rotate:
                q, k = self.rope(q, pos), self.rope(k, pos)
            o = attend(i, q, k, v)
            x = x + np.asarray(o, np.float32).reshape(bsz, n, HEADS * HEAD_DIM) @ lw["wo"]
            h = self.norm(x)
            u = h @ lw["w1"]
            x = x + (u / (1 + np.exp(-u))) @ lw["w2"]
        return self.norm(x) @ self.out


class Pool:
    """Per-layer page pools, a free list, each request's pages and cached tokens."""

    def __init__(self, num_pages):
        shape = (num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM)
        self.k = [np.full(shape, np.nan, np.float32) for _ in range(LAYERS)]  # NaN: never read
        self.v = [np.full(shape, np.nan, np.float32) for _ in range(LAYERS)]
        self.free = list(range(num_pages))[::-1]
        self.pages, self.lens = {}, {}
        self.peak = 0

    def can_hold(self, total):
        return len(self.free) * PAGE_SIZE >= total

    def reserve(self, r, total):
        pages = self.pages.setdefault(r, [])
        while len(pages) * PAGE_SIZE < total:
            pages.append(self.free.pop())  # engine admits only what fits: never empty here
        self.peak = max(self.peak, sum(len(p) for p in self.pages.values()))

    def release(self, r):
        self.free.extend(self.pages.pop(r))
        del self.lens[r]

    def table(self, rs):
        width = max(len(self.pages[r]) for r in rs)
        t = np.full((len(rs), width), -1, np.int32)  # -1: past a request's pages, never read
        for row, r in enumerate(rs):
            t[row, :len(self.pages[r])] = self.pages[r]
        return t

    def write(self, layer, r, start, k, v):
        """Rows [start, start + len(k)) of request r's keys and values."""
        for j in range(len(k)):
            page, row = self.pages[r][(start + j) // PAGE_SIZE], (start + j) % PAGE_SIZE
            self.k[layer][page, row], self.v[layer][page, row] = k[j], v[j]


def cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def serve(model, prompts, budgets, arrivals, chunk, num_pages):
    """The engine loop. Returns the tokens generated per request, the steps run and the pool's
    peak use."""
    pool = Pool(num_pages)
    out = {r: [] for r in range(len(prompts))}
    waiting = sorted(range(len(prompts)), key=lambda r: arrivals[r])
    prefill, decode = [], []  # admitted requests in each phase
    step = 0
    while waiting or prefill or decode:
        # Admit what has arrived, while the pool can hold its whole prompt and output.
        while waiting and arrivals[waiting[0]] <= step and \
                pool.can_hold(len(prompts[waiting[0]]) + budgets[waiting[0]]):
            r = waiting.pop(0)
            pool.reserve(r, len(prompts[r]) + budgets[r])
            pool.lens[r] = 0
            prefill.append(r)
        if prefill:  # one chunk of every prefilling request, packed
            rs = list(prefill)
            starts = [pool.lens[r] for r in rs]
            sizes = [min(chunk, len(prompts[r]) - s) for r, s in zip(rs, starts)]
            tokens = np.concatenate([prompts[r][s:s + n] for r, s, n in zip(rs, starts, sizes)])
            pos = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, sizes)])
            table = pool.table(rs)
            ends = [s + n for s, n in zip(starts, sizes)]

            def attend(i, q, k, v):
                at = cu(sizes)
                for row, r in enumerate(rs):  # the chunk's (rotated) keys into the pages
                    pool.write(i, r, starts[row], k[0, at[row]:at[row + 1]],
                               v[0, at[row]:at[row + 1]])
                o = flashdl.attention_varlen(q[0], pool.k[i], pool.v[i], at, cu(ends),
                                             max(sizes), max(ends), causal=True,
                                             block_table=table)
                return o[None]

            logits = model.forward(tokens[None], pos[None], attend)[0]
            at = cu(sizes)
            for row, r in enumerate(rs):
                pool.lens[r] = ends[row]
                if ends[row] == len(prompts[r]):  # prompt done: its first token
                    out[r].append(int(np.argmax(logits[at[row + 1] - 1])))
                    prefill.remove(r)
                    decode.append(r)
        live = [r for r in decode if len(out[r]) < budgets[r]]
        if live:  # one token of every decoding request, rotary fused into the cache call
            lens = np.array([pool.lens[r] for r in live], np.int32)
            table = pool.table(live)

            def attend(i, q, k, v):
                return flashdl.attention_with_kvcache(
                    q, pool.k[i], pool.v[i], k=k, v=v, cache_seqlens=lens, block_table=table,
                    causal=True, rotary_cos=model.cos, rotary_sin=model.sin)

            tokens = np.array([[out[r][-1]] for r in live])
            logits = model.forward(tokens, lens[:, None], attend, rotate=False)
            for row, r in enumerate(live):
                pool.lens[r] += 1
                out[r].append(int(np.argmax(logits[row, 0])))
        for r in [r for r in decode if len(out[r]) == budgets[r]]:
            decode.remove(r)
            pool.release(r)  # done: its pages go back to the free list
        step += 1
    return out, step, pool.peak


def recompute(model, prompt, budget):
    """The reference: no cache, full causal attention over the whole sequence at every step.
    Returns the tokens and the smallest gap between the two best logits."""
    seq, out, margin = list(prompt), [], np.inf
    while len(out) < budget:
        logits = model.forward(np.array([seq]), np.arange(len(seq))[None],
                               lambda i, q, k, v: flashdl.attention(q, k, v, causal=True))[0, -1]
        top2 = np.sort(logits)[-2:]
        margin = min(margin, float(top2[1] - top2[0]))
        out.append(int(np.argmax(logits)))
        seq.append(out[-1])
    return out, margin


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunk", type=int, default=8, help="prompt tokens per prefill chunk")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = Model(args.seed)
    rng = np.random.default_rng(args.seed + 1)
    prompts = [rng.integers(0, VOCAB, size=n) for _, n, _ in REQUESTS]
    budgets = [b for _, _, b in REQUESTS]
    arrivals = [a for a, _, _ in REQUESTS]
    need = [-(-(len(p) + b) // PAGE_SIZE) for p, b in zip(prompts, budgets)]
    num_pages = max(need) + sorted(need)[-2]  # two large requests at once, not all six

    t0 = time.perf_counter()
    served, steps, peak = serve(model, prompts, budgets, arrivals, args.chunk, num_pages)
    t1 = time.perf_counter()
    print(f"flashdl {flashdl.__version__}: {len(REQUESTS)} requests, prefill chunks of "
          f"{args.chunk} tokens, {steps} engine steps in {t1 - t0:.2f} s; pool of {num_pages} "
          f"pages of {PAGE_SIZE} tokens per layer (all requests together need {sum(need)}), at "
          f"most {peak} in use")
    ok, margin = True, np.inf
    for r, (arrive, n, b) in enumerate(REQUESTS):
        ref, m = recompute(model, prompts[r], b)
        margin = min(margin, m)
        same = served[r] == ref
        ok &= same
        print(f"request {r} (arrives at step {arrive}, prompt {n}, {b} new tokens):")
        print(f"  continuous batching: {' '.join(map(str, served[r]))}")
        print(f"  full recompute     : {' '.join(map(str, ref))}" + ("" if same else
                                                                       "   MISMATCH"))
    print(f"smallest top-2 logit gap of the reference {margin:.3g}")
    if not ok:
        print("MISMATCH")
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()
