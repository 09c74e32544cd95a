"""A small Flax NNX transformer trained with flashdl attention, beside the same model on XLA's.

Run:  python examples/flax_nnx_transformer.py [--steps 20] [--seed 0]

(JAX, flax >= 0.11 with optax, and an installed flashdl; no downloads. Under a minute on 2 cores.)

The only change that puts a Flax model on flashdl is the ``attention_fn`` argument of
``nnx.MultiHeadAttention``:

    nnx.MultiHeadAttention(..., attention_fn=flashdl.jax.flax_attention)

The example builds a decoder-only language model -- 2 blocks, width 64, 4 query heads sharing 2
key/value heads (GQA), causal self-attention, vocabulary 32 -- twice from the same seed: once with
``flashdl.jax.flax_attention`` and once with Flax's default attention (which, without dropout,
is ``jax.nn.dot_product_attention``, the XLA implementation). It trains both with Adam on the
same synthetic batches (each sequence counts up modulo the vocabulary from a random start, with
some tokens replaced at random), every step under ``jax.jit``, and prints the losses side by
side. It prints "losses match" when every step's losses agree within 1e-4 relative, else
"MISMATCH" and exits with status 1.
"""
from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import flashdl.jax

VOCAB, WIDTH, HEADS, KV_HEADS, LAYERS, SEQ, BATCH = 32, 64, 4, 2, 2, 64, 8


class Block(nnx.Module):
    def __init__(self, attention_fn, rngs):
        self.norm1 = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=WIDTH,
                                           num_kv_heads=KV_HEADS, decode=False,
                                           attention_fn=attention_fn, rngs=rngs)
        self.norm2 = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.up = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
        self.down = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x), is_causal=True)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class LM(nnx.Module):
    def __init__(self, attention_fn, rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (SEQ, WIDTH)))
        self.blocks = nnx.List([Block(attention_fn, rngs) for _ in range(LAYERS)])
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.norm(x))  # tied output embedding


def batches(seed, steps):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        start = rng.integers(0, VOCAB, (BATCH, 1))
        tokens = (start + np.arange(SEQ + 1)) % VOCAB
        noise = rng.random(tokens.shape) < 0.1
        tokens = np.where(noise, rng.integers(0, VOCAB, tokens.shape), tokens)
        yield jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32)


@nnx.jit
def train_step(model, optimizer, inputs, targets):
    def loss_fn(model):
        logits = model(inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    runs = {}
    for name, fn in (("flashdl", flashdl.jax.flax_attention), ("xla", nnx.dot_product_attention)):
        model = LM(fn, nnx.Rngs(a.seed))
        optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
        t0 = time.perf_counter()
        runs[name] = [float(train_step(model, optimizer, x, y))
                      for x, y in batches(a.seed, a.steps)]
        print(f"{name}: {a.steps} steps in {time.perf_counter() - t0:.1f} s (compile included)")
    print(f"{'step':>4}  {'flashdl loss':>12}  {'xla loss':>12}  {'rel. diff':>9}")
    worst = 0.0
    for i, (ours, theirs) in enumerate(zip(runs["flashdl"], runs["xla"])):
        rel = abs(ours - theirs) / abs(theirs)
        worst = max(worst, rel)
        print(f"{i:>4}  {ours:>12.6f}  {theirs:>12.6f}  {rel:>9.2e}")
    if worst <= 1e-4:
        print(f"losses match (largest relative difference {worst:.2e})")
        return 0
    print(f"MISMATCH: largest relative difference {worst:.2e}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
