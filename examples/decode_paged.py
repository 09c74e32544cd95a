"""Greedy decoding with a paged KV cache: flashdl.attention_with_kvcache in a tiny transformer.

Run:  python examples/decode_paged.py [--dtype float32|bfloat16] [--tokens 32] [--seed 0]

(NumPy and an installed flashdl; bfloat16 also needs ml_dtypes. A few seconds on 2 cores.)

A decoder-only transformer with random weights -- 2 layers, d_model 128, 8 query heads sharing
2 key/value heads (GQA), head dim 16, rotary positions, RMSNorm, a SiLU MLP, vocabulary 100 --
decodes a batch of 3 prompts of different lengths greedily:

- The KV cache is paged (vLLM's layout): one pool per layer of shape (num_pages, page_size 8,
  nheads_kv, head_dim), pages handed out from a shuffled free list as sequences grow, and a
  block_table row per sequence naming its pages in order. Each prompt is prefilled on its own
  (seqlen_q = its length, causal); then every step runs the whole batch with seqlen_q 1, and
  attention_with_kvcache appends the step's k and v to the pages before attending over them.
- One sequence stops early and gives its pages back; the pool is too small for the others to
  finish without reusing them (their stale contents are never read: only the first
  cache_seqlens[b] + seqlen_new keys of a sequence are).
- The check: the same model decoded without any cache, recomputing full causal attention
  (flashdl.attention) over each whole sequence at every step, must produce the same tokens.
  Prints both and "OK", or exits with status 1.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import flashdl

VOCAB, D_MODEL, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 100, 128, 2, 8, 2, 16, 256
PAGE_SIZE = 8
PROMPT_LENS = (5, 11, 17)


def attn_dtype(name):
    if name == "bfloat16":
        import ml_dtypes  # NumPy's bfloat16

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class Model:
    """Random weights; everything in float32 except attention's q, k, v, output and cache, which
    are in `dtype` (float32 or bfloat16)."""

    def __init__(self, seed, dtype):
        rng = np.random.default_rng(seed)

        def w(*shape):
            return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

        self.dtype = dtype
        self.emb = rng.standard_normal((VOCAB, D_MODEL)).astype(np.float32)
        self.layers = [dict(wq=w(D_MODEL, HEADS * HEAD_DIM), wk=w(D_MODEL, KV_HEADS * HEAD_DIM),
                            wv=w(D_MODEL, KV_HEADS * HEAD_DIM), wo=w(HEADS * HEAD_DIM, D_MODEL),
                            w1=w(D_MODEL, FFN), w2=w(FFN, D_MODEL)) for _ in range(LAYERS)]
        self.out = w(D_MODEL, VOCAB) * 4  # sharper logits: clear greedy choices
        half = HEAD_DIM // 2
        self.inv_freq = 1.0 / (10000.0 ** (np.arange(half) / half))

    @staticmethod
    def norm(x):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)

    def rope(self, x, pos):
        """Rotary positions on (batch, seqlen, heads, HEAD_DIM), positions (batch, seqlen)."""
        ang = pos[..., None].astype(np.float64) * self.inv_freq  # (batch, seqlen, half)
        cos = np.cos(ang)[:, :, None, :].astype(np.float32)
        sin = np.sin(ang)[:, :, None, :].astype(np.float32)
        a, b = x[..., :HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    def forward(self, tokens, pos, attend):
        """Logits (batch, seqlen, VOCAB) of tokens (batch, seqlen) at positions pos; attend(layer,
        q, k, v) -> (batch, seqlen, HEADS, HEAD_DIM), q, k, v already in the attention dtype."""
        bsz, n = tokens.shape
        x = self.emb[tokens]
        for i, lw in enumerate(self.layers):
            h = self.norm(x)
            q = self.rope((h @ lw["wq"]).reshape(bsz, n, HEADS, HEAD_DIM), pos)
            k = self.rope((h @ lw["wk"]).reshape(bsz, n, KV_HEADS, HEAD_DIM), pos)
            v = (h @ lw["wv"]).reshape(bsz, n, KV_HEADS, HEAD_DIM)
            o = attend(i, q.astype(self.dtype), k.astype(self.dtype), v.astype(self.dtype))
            x = x + np.asarray(o, np.float32).reshape(bsz, n, HEADS * HEAD_DIM) @ lw["wo"]
            h = self.norm(x)
            u = h @ lw["w1"]
            x = x + (u / (1 + np.exp(-u))) @ lw["w2"]
        return self.norm(x) @ self.out


class PagedCache:
    """Per-layer page pools, a free list and each sequence's pages."""

    def __init__(self, num_pages, dtype, rng):
        shape = (num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM)
        self.k = [np.zeros(shape, dtype) for _ in range(LAYERS)]
        self.v = [np.zeros(shape, dtype) for _ in range(LAYERS)]
        self.free = [int(p) for p in rng.permutation(num_pages)]  # shuffled: pages interleave
        self.pages = {}  # sequence id -> its pages, in order
        self.lens = {}   # sequence id -> tokens in its cache
        self.peak = 0

    def reserve(self, seq, total):
        """Pages for `total` tokens of sequence seq, from the free list."""
        pages = self.pages.setdefault(seq, [])
        while len(pages) * PAGE_SIZE < total:
            if not self.free:
                raise RuntimeError("out of KV cache pages")
            pages.append(self.free.pop())
        self.peak = max(self.peak, sum(len(p) for p in self.pages.values()))

    def release(self, seq):
        self.free.extend(reversed(self.pages.pop(seq)))
        del self.lens[seq]

    def block_table(self, seqs):
        width = max(len(self.pages[s]) for s in seqs)
        table = np.full((len(seqs), width), -1, np.int32)  # -1: never read
        for row, s in enumerate(seqs):
            table[row, :len(self.pages[s])] = self.pages[s]
        return table


def decode_cached(model, prompts, budgets, num_pages, seed):
    """Greedy decoding with the paged cache; returns the generated tokens per sequence."""
    cache = PagedCache(num_pages, model.dtype, np.random.default_rng(seed + 1))
    out = {s: [] for s in range(len(prompts))}
    last = {}
    # Prefill each prompt on its own: seqlen_q = its length, appended to its empty pages.
    for s, prompt in enumerate(prompts):
        cache.lens[s] = 0
        cache.reserve(s, len(prompt))
        table = cache.block_table([s])

        def attend(i, q, k, v, table=table):
            return flashdl.attention_with_kvcache(
                q, cache.k[i], cache.v[i], k=k, v=v, block_table=table, causal=True,
                cache_seqlens=np.zeros(1, np.int32))

        logits = model.forward(np.array([prompt]), np.arange(len(prompt))[None], attend)
        cache.lens[s] = len(prompt)
        last[s] = int(np.argmax(logits[0, -1]))
        out[s].append(last[s])
    # Decode the batch of active sequences, one token per step.
    active = [s for s in range(len(prompts)) if budgets[s] > 1]
    while active:
        for s in active:
            cache.reserve(s, cache.lens[s] + 1)
        table = cache.block_table(active)
        lens = np.array([cache.lens[s] for s in active], np.int32)

        def attend(i, q, k, v):
            return flashdl.attention_with_kvcache(q, cache.k[i], cache.v[i], k=k, v=v,
                                                  cache_seqlens=lens, block_table=table,
                                                  causal=True)

        tokens = np.array([[last[s]] for s in active])
        logits = model.forward(tokens, lens[:, None], attend)
        for row, s in enumerate(active):
            cache.lens[s] += 1  # cache_seqlens is the caller's to advance
            last[s] = int(np.argmax(logits[row, 0]))
            out[s].append(last[s])
        for s in [s for s in active if len(out[s]) == budgets[s]]:
            cache.release(s)  # finished: its pages go back to the free list
        active = [s for s in active if len(out[s]) < budgets[s]]
    return out, cache.peak


def decode_full(model, prompts, budgets):
    """The reference: no cache; every step recomputes causal attention over the whole sequence.
    Returns the tokens and the smallest gap between the best and second-best logit."""
    def attend(i, q, k, v):
        return flashdl.attention(q, k, v, causal=True)

    out, margin = {}, np.inf
    for s, prompt in enumerate(prompts):
        seq = list(prompt)
        out[s] = []
        while len(out[s]) < budgets[s]:
            logits = model.forward(np.array([seq]), np.arange(len(seq))[None], attend)[0, -1]
            top2 = np.sort(logits)[-2:]
            margin = min(margin, float(top2[1] - top2[0]))
            out[s].append(int(np.argmax(logits)))
            seq.append(out[s][-1])
    return out, margin


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per sequence")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = Model(args.seed, attn_dtype(args.dtype))
    rng = np.random.default_rng(args.seed + 2)
    prompts = [list(rng.integers(0, VOCAB, size=n)) for n in PROMPT_LENS]
    # Sequence 1 stops at half the tokens; the pool holds what the batch needs at its peak but
    # not every sequence's final length, so the others finish on sequence 1's returned pages.
    budgets = [args.tokens, max(1, args.tokens // 2), args.tokens]
    need = [-(-(len(p) + n) // PAGE_SIZE) for p, n in zip(prompts, budgets)]
    num_pages = max(sum(need) - need[1] + 1, max(need))

    t0 = time.perf_counter()
    cached, peak = decode_cached(model, prompts, budgets, num_pages, args.seed)
    t1 = time.perf_counter()
    full, margin = decode_full(model, prompts, budgets)
    t2 = time.perf_counter()

    print(f"flashdl {flashdl.__version__}, attention dtype {args.dtype}, {LAYERS} layers, "
          f"d_model {D_MODEL}, {HEADS} heads / {KV_HEADS} kv heads x {HEAD_DIM}, vocab {VOCAB}")
    print(f"paged cache: {num_pages} pages of {PAGE_SIZE} tokens per layer (the sequences' final "
          f"lengths need {sum(need)}); at most {peak} in use at once")
    ok = True
    for s, prompt in enumerate(prompts):
        same = cached[s] == full[s]
        ok &= same
        print(f"\nsequence {s}: prompt ({len(prompt)} tokens) {' '.join(map(str, prompt))}")
        print(f"  paged KV cache   : {' '.join(map(str, cached[s]))}")
        print(f"  full recompute   : {' '.join(map(str, full[s]))}")
        if not same:
            at = next(i for i, (a, b) in enumerate(zip(cached[s], full[s])) if a != b)
            print(f"  MISMATCH at generated token {at}")
    print(f"\ndecode with the cache {t1 - t0:.2f} s, full recompute {t2 - t1:.2f} s; smallest "
          f"top-2 logit gap of the reference {margin:.3g}")
    if not ok:
        print("MISMATCH")
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()
