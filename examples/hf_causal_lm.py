"""A Hugging Face transformers causal LM running its attention on flashdl.

Run:  python examples/hf_causal_lm.py [--tokens 12] [--seed 0]

(PyTorch, transformers >= 5 and an installed flashdl; no downloads. A few seconds on 2 cores.)

flashdl.transformers.register() adds flashdl to transformers' AttentionInterface and returns
the name to pass as attn_implementation ("fdl": transformers keeps names with "flash" for its
own kernels). The example builds a small Llama-style model with random weights from a config --
2 layers, hidden size 64, 4 query heads sharing 2 key/value heads (GQA), vocabulary 128 -- and
a copy of it running transformers' "sdpa", then:

- runs a forward and a backward on a right-padded batch (the padded rows go through flashdl's
  varlen path, as transformers' flash-attention integration does) and compares the logits of
  the real tokens and the gradients of every weight with "sdpa";
- decodes a left-padded batch of prompts greedily with each model (KV cache, one token a step)
  and compares the tokens.

Prints the largest differences, and "OK", or "MISMATCH" and exits with status 1.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
import transformers

import flashdl
import flashdl.transformers

VOCAB, BATCH, SEQ = 128, 3, 24


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=12, help="new tokens per prompt")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    name = flashdl.transformers.register()
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   initializer_range=0.1, pad_token_id=0, bos_token_id=1,
                                   eos_token_id=2)
    torch.manual_seed(args.seed)
    # from_config sets the attention implementation on the config it is given: one copy each.
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                          attn_implementation=name).eval()
    sdpa = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                         attn_implementation="sdpa").eval()
    sdpa.load_state_dict(model.state_dict())
    print(f"flashdl {flashdl.__version__}, transformers {transformers.__version__}: Llama-style "
          f"model, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads / "
          f"{cfg.num_key_value_heads} kv heads, attn_implementation={name!r} vs 'sdpa'")

    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 17:] = 0  # right padding
    mask[2, 9:] = 0
    ids = ids.masked_fill(mask == 0, cfg.pad_token_id)
    labels = ids.masked_fill(mask == 0, -100)

    t0 = time.perf_counter()
    results = {}
    for label, m in (("flashdl", model), ("sdpa", sdpa)):
        m.zero_grad()
        out = m(ids, attention_mask=mask, labels=labels, use_cache=False)
        out.loss.backward()
        results[label] = (out.logits.detach(), {n: p.grad for n, p in m.named_parameters()})
    t1 = time.perf_counter()
    valid = mask.bool()
    logits_diff = float((results["flashdl"][0] - results["sdpa"][0])[valid].abs().max())
    grad_diff = max(float((results["flashdl"][1][n] - g_sdpa).abs().max())
                    for n, g_sdpa in results["sdpa"][1].items())
    logits_scale = float(results["sdpa"][0][valid].abs().max())
    grad_scale = max(float(g_sdpa.abs().max()) for g_sdpa in results["sdpa"][1].values())
    print(f"\nforward + backward, right-padded batch {tuple(ids.shape)} ({t1 - t0:.2f} s):")
    print(f"  max |logits difference| {logits_diff:.2e} (logits up to {logits_scale:.2f})")
    print(f"  max |gradient difference| {grad_diff:.2e} (gradients up to {grad_scale:.2f})")

    prompts = torch.randint(3, VOCAB, (BATCH, 10), generator=g)
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[0, :4] = 0  # left padding, as for generation
    prompt_mask[2, :7] = 0
    prompts = prompts.masked_fill(prompt_mask == 0, cfg.pad_token_id)
    t2 = time.perf_counter()
    tokens = {}
    with torch.no_grad():
        for label, m in (("flashdl", model), ("sdpa", sdpa)):
            tokens[label] = m.generate(prompts, attention_mask=prompt_mask,
                                       max_new_tokens=args.tokens, do_sample=False,
                                       pad_token_id=cfg.pad_token_id)[:, prompts.shape[1]:]
    t3 = time.perf_counter()
    print(f"\ngreedy generate, {args.tokens} new tokens for {BATCH} left-padded prompts "
          f"({t3 - t2:.2f} s):")
    for b in range(BATCH):
        print(f"  prompt {b}: flashdl {' '.join(map(str, tokens['flashdl'][b].tolist()))}")
        print(f"            sdpa    {' '.join(map(str, tokens['sdpa'][b].tolist()))}")

    ok = (logits_diff <= 1e-5 * max(1.0, logits_scale) and grad_diff <= 1e-5 * max(1.0, grad_scale)
          and torch.equal(tokens["flashdl"], tokens["sdpa"]))
    if not ok:
        print("MISMATCH")
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()
