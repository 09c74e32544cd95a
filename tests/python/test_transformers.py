"""flashdl.transformers: flashdl as an attention implementation of Hugging Face transformers.

Small random models built from configs (GPT-2; Llama with GQA; Mistral with a sliding window
shorter than the sequence; Gemma 2 with softcapping and alternating windows; no downloads) run
with the name register() returns. Their logits and gradients obey flash-attn's rule against a
float64 copy of the model, with transformers' float32 "sdpa" and "eager" as the low-precision
references, with and without padding; greedy generation picks the tokens "sdpa" picks.
"""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", minversion="5.0")

import torch.nn.functional as F  # noqa: E402
from transformers import masking_utils  # noqa: E402

import flashdl.transformers as fdl_hf  # noqa: E402
from attn_oracle import assert_rule  # noqa: E402

NAME = fdl_hf.register()
VOCAB, BATCH, SEQ = 96, 3, 32
# Slack for float32 logits and gradients: a few layers of float32 arithmetic around attention,
# in another order than "sdpa"'s; a few ulps of the result's magnitude.
ULPS = 4

COMMON = dict(vocab_size=VOCAB, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)


def config(kind, **changes):
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                      attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, **COMMON)
    elif kind == "llama-gqa":
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=64, **COMMON)
    elif kind == "mistral-window":
        cfg = transformers.MistralConfig(hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=1, sliding_window=7,
                                         max_position_embeddings=64, **COMMON)
    else:
        assert kind == "gemma2-softcap"
        cfg = transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        sliding_window=6, attn_logit_softcapping=5.0,
                                        final_logit_softcapping=30.0, query_pre_attn_scalar=24,
                                        max_position_embeddings=64, **COMMON)
    for key, value in changes.items():
        setattr(cfg, key, value)
    return cfg


def build(cfg, impl, state=None, dtype=torch.float32):
    """A model of cfg running impl; from_config sets the attention on the config it gets, so each
    model gets its own copy."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                          attn_implementation=impl, dtype=dtype)
    if state is not None:
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    return model.eval()


_MODELS = {}


def models(kind):
    """float32 models running flashdl, "sdpa" and "eager", and the float64 reference ("sdpa";
    for Gemma 2, which "sdpa" does not run (softcap), "eager"), all with the same weights."""
    if kind not in _MODELS:
        cfg = config(kind)
        base = build(cfg, NAME)
        state = base.state_dict()
        ref_impl = "eager" if kind == "gemma2-softcap" else "sdpa"
        _MODELS[kind] = dict(fdl=base, eager=build(cfg, "eager", state),
                             ref=build(cfg, ref_impl, state, torch.float64))
        if kind != "gemma2-softcap":
            _MODELS[kind]["sdpa"] = build(cfg, "sdpa", state)
    return _MODELS[kind]


def inputs(padding, batch=BATCH, seq=SEQ, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if padding == "right":
        mask[0, seq * 7 // 10:] = 0
        mask[2, seq * 3 // 10:] = 0
    elif padding == "left":
        mask[0, :seq * 3 // 20] = 0
        mask[2, :seq * 6 // 10] = 0
    else:
        assert padding is None
    return ids.masked_fill(mask == 0, 0), (None if padding is None else mask)


def np64(x):
    return x.detach().double().numpy()


def logits_of(model, ids, mask, **kw):
    with torch.no_grad():
        return model(ids, attention_mask=mask, use_cache=False, **kw).logits


LOWP = {"gpt2": ("sdpa", "eager"), "llama-gqa": ("sdpa", "eager"),
        "mistral-window": ("sdpa", "eager"), "gemma2-softcap": ("eager",)}


def bias_mask(batch, seq):
    """A causal additive mask with a bias on key 3 (a 4-D float mask that is not a set of
    sequences: flashdl runs it as an additive bias)."""
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    bias = torch.zeros(batch, 1, seq, seq).masked_fill(~causal, float("-inf"))
    bias[:, :, 3:, 3] = -1.0
    return bias


def runs_flashdl(model):
    """Whether model's attention calls flashdl (a spy on flashdl.torch.attention)."""
    ids, _ = inputs(None, batch=2, seq=8)
    calls = []
    real = fdl_hf._fdl.attention

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    fdl_hf._fdl.attention = spy
    try:
        logits_of(model, ids, None)
    finally:
        fdl_hf._fdl.attention = real
    return bool(calls)


def test_register_returns_a_name_transformers_accepts():
    assert NAME == fdl_hf.DEFAULT_NAME and "flash" not in NAME
    assert fdl_hf.register() == NAME  # again: a no-op
    assert transformers.AttentionInterface()[NAME] is fdl_hf.attention_forward
    assert transformers.AttentionMaskInterface()[NAME] is fdl_hf.attention_mask_interface
    other = fdl_hf.register("fdl_second")
    assert runs_flashdl(build(config("gpt2"), other))


@pytest.mark.parametrize("kind", ["gpt2", "llama-gqa", "mistral-window", "gemma2-softcap"])
def test_the_models_run_flashdl(kind):
    """The comparisons below compare flashdl with transformers' implementations, not one of
    those with itself."""
    m = models(kind)
    assert runs_flashdl(m["fdl"])
    assert not any(runs_flashdl(m[impl]) for impl in ("sdpa", "eager", "ref") if impl in m)


@pytest.mark.parametrize("name", ["flashdl", "my_flash", "sdpa_fdl", "org/repo", "eager",
                                  "paged|fdl", ""])
def test_register_refuses_reserved_names(name):
    with pytest.raises(ValueError, match="name"):
        fdl_hf.register(name)


def test_register_refuses_a_taken_name_and_a_non_str():
    def other(*args, **kwargs):
        raise AssertionError("never called")

    transformers.AttentionInterface.register("fdl_taken", other)
    with pytest.raises(ValueError, match="already registered"):
        fdl_hf.register("fdl_taken")
    with pytest.raises(TypeError, match="name"):
        fdl_hf.register(3)


@pytest.mark.parametrize("padding", [None, "right", "left"])
@pytest.mark.parametrize("kind", ["gpt2", "llama-gqa", "mistral-window", "gemma2-softcap"])
def test_logits_match_sdpa_and_eager(kind, padding):
    if kind == "gemma2-softcap" and padding == "left":
        pytest.skip("left padding shifts positions; the Gemma 2 reference is unpadded rows")
    m = models(kind)
    ids, mask = inputs(padding)
    valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    if kind == "gemma2-softcap" and mask is not None:
        # float64 "eager" Gemma 2 turns rows that padding masks entirely into NaN (their -inf
        # spreads through the next layer's 0 * NaN); a right-padded row's valid logits are those
        # of the row alone.
        ref = np.concatenate([np64(logits_of(m["ref"], ids[b:b + 1, :int(n)], None)[0])
                              for b, n in enumerate(mask.sum(1))])
    else:
        ref = np64(logits_of(m["ref"], ids, mask)[valid])
    got = logits_of(m["fdl"], ids, mask)[valid]
    for low in LOWP[kind]:
        assert_rule(np64(got), ref, np64(logits_of(m[low], ids, mask)[valid]), "float32",
                    what=f"{kind} logits vs {low}", ulps=ULPS)


@pytest.mark.parametrize("padding", [None, "left"])
@pytest.mark.parametrize("kind", ["gpt2", "llama-gqa", "mistral-window"])
def test_bfloat16_logits_match_sdpa_and_eager(kind, padding):
    cfg = config(kind)
    fdl = build(cfg, NAME, dtype=torch.bfloat16)
    state = fdl.state_dict()
    ids, mask = inputs(padding)
    valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    ref = np64(logits_of(build(cfg, "sdpa", state, torch.float64), ids, mask)[valid])
    got = np64(logits_of(fdl, ids, mask)[valid])
    for low in ("sdpa", "eager"):
        lowp = np64(logits_of(build(cfg, low, state, torch.bfloat16), ids, mask)[valid])
        assert_rule(got, ref, lowp, "bfloat16", what=f"{kind} bfloat16 logits vs {low}")


@pytest.mark.parametrize("window", [6, 8])
def test_a_window_off_by_one_fails_the_rule(window):
    """The logits test can tell the window w from w - 1 and w + 1 (Mistral's is 7)."""
    m = models("mistral-window")
    ids, mask = inputs("left")
    valid = mask.bool()
    ref = np64(logits_of(m["ref"], ids, mask)[valid])
    low = np64(logits_of(m["sdpa"], ids, mask)[valid])
    wrong = build(config("mistral-window", sliding_window=window), NAME, m["fdl"].state_dict())
    with pytest.raises(AssertionError, match="max error"):
        assert_rule(np64(logits_of(wrong, ids, mask)[valid]), ref, low, "float32", ulps=ULPS)


def grads(model, ids, mask):
    model.zero_grad()
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
    model(ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("padding", [None, "right", "left"])
@pytest.mark.parametrize("kind", ["gpt2", "llama-gqa", "mistral-window"])
def test_gradients_match_sdpa_and_eager(kind, padding):
    m = models(kind)
    ids, mask = inputs(padding)
    g = {impl: grads(m[impl], ids, mask) for impl in ("fdl", "sdpa", "eager", "ref")}
    magnitude = max(float(x.abs().max()) for x in g["ref"].values())
    for low in ("sdpa", "eager"):
        for name, ref in g["ref"].items():
            assert_rule(np64(g["fdl"][name]), np64(ref), np64(g[low][name]), "float32",
                        what=f"{kind} d{name} vs {low}", ulps=ULPS, magnitude=magnitude,
                        grad=True)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("kind", ["gpt2", "llama-gqa", "mistral-window", "gemma2-softcap"])
def test_greedy_generate_matches_sdpa(kind, cache):
    """Left-padded prompts, 10 new tokens: the prompt plus the new tokens outgrow the windows
    of Mistral and Gemma 2 (whose layers alternate sliding and full attention), the decoding
    steps run with a KV cache (a StaticCache has an unused tail). Gemma 2 is compared with
    "eager", as "sdpa" does not run it."""
    m = models(kind)
    ids, mask = inputs("left", seq=12, seed=2)
    low = LOWP[kind][0]
    out = {}
    for impl in ("fdl", low):
        with torch.no_grad():
            out[impl] = m[impl].generate(ids, attention_mask=mask, max_new_tokens=10,
                                         do_sample=False, cache_implementation=cache,
                                         output_logits=True, return_dict_in_generate=True)
    assert torch.equal(out["fdl"].sequences, out[low].sequences)
    for step, (a, b) in enumerate(zip(out["fdl"].logits, out[low].logits)):
        scale = max(1.0, float(b.abs().max()))
        assert float((a - b).abs().max()) <= 1e-5 * scale, f"step {step}"


@pytest.mark.parametrize("kind", ["gpt2", "llama-gqa", "mistral-window"])
def test_packed_sequences_by_position_ids(kind):
    """position_ids that restart mark packed sequences: transformers builds a block-diagonal
    mask, which flashdl runs as varlen sequences; each sequence sees only itself."""
    m = models(kind)
    ids, _ = inputs(None, batch=2, seq=30)
    pos = torch.stack([torch.cat([torch.arange(11), torch.arange(7), torch.arange(12)]),
                       torch.cat([torch.arange(20), torch.arange(10)])])
    ref = np64(logits_of(m["ref"], ids, None, position_ids=pos))
    got = logits_of(m["fdl"], ids, None, position_ids=pos)
    assert_rule(np64(got), ref, np64(logits_of(m["sdpa"], ids, None, position_ids=pos)),
                "float32", what=f"{kind} packed logits", ulps=ULPS)
    alone = logits_of(m["fdl"], ids[:1, 11:18], None)
    np.testing.assert_allclose(np64(got[0, 11:18]), np64(alone[0]), atol=1e-5)


def test_user_4d_masks_that_are_sequences_match_sdpa():
    m = models("llama-gqa")
    ids, _ = inputs(None, batch=2, seq=16)
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    additive = torch.zeros(2, 1, 16, 16).masked_fill(~causal, torch.finfo(torch.float32).min)
    two = causal.clone()
    two[8:, :8] = False  # two sequences of 8
    for mask in (additive, causal.expand(2, 1, 16, 16), two.expand(2, 4, 16, 16)):
        ref = np64(logits_of(m["ref"], ids, mask.double() if mask.is_floating_point() else mask))
        assert_rule(np64(logits_of(m["fdl"], ids, mask)), ref,
                    np64(logits_of(m["sdpa"], ids, mask)), "float32", ulps=ULPS)


@pytest.mark.parametrize("case", ["additive bias", "per-head bool", "bidirectional",
                                  "per-head float"])
def test_4d_masks_that_are_not_sequences_run_as_mask_or_bias(case):
    """4-D masks the varlen path cannot express run as flashdl's bias (float) or mask (bool),
    the mask alone deciding what each query sees, as "sdpa" does: logits and gradients by the
    rule against a float64 "sdpa" copy, float32 "sdpa" and "eager" the low-precision ones."""
    m = models("llama-gqa")
    ids, _ = inputs(None, batch=2, seq=16)
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    g = torch.Generator().manual_seed(5)
    if case == "additive bias":
        mask = bias_mask(2, 16)
    elif case == "per-head bool":
        mask = causal.repeat(2, 4, 1, 1)
        mask[:, 1, 9, 2] = False
        mask[1, 3, 12, :5] = False
    elif case == "bidirectional":
        mask = torch.ones(2, 1, 16, 16, dtype=torch.bool)
    else:
        mask = torch.randn(2, 4, 16, 16, generator=g).masked_fill(~causal, float("-inf"))
    ref = np64(logits_of(m["ref"], ids, mask.double() if mask.is_floating_point() else mask))
    got = np64(logits_of(m["fdl"], ids, mask))
    for low in ("sdpa", "eager"):
        assert_rule(got, ref, np64(logits_of(m[low], ids, mask)), "float32",
                    what=f"{case} logits vs {low}", ulps=ULPS)
    if case == "per-head float":
        gr = {impl: grads_with_mask(m[impl], ids, mask.double() if impl == "ref" else mask)
              for impl in ("fdl", "sdpa", "ref")}
        magnitude = max(float(x.abs().max()) for x in gr["ref"].values())
        for name, r in gr["ref"].items():
            assert_rule(np64(gr["fdl"][name]), np64(r), np64(gr["sdpa"][name]), "float32",
                        what=f"d{name}", ulps=ULPS, magnitude=magnitude, grad=True)


def grads_with_mask(model, ids, mask):
    model.zero_grad()
    model(ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_4d_masks_of_other_dtypes_are_refused():
    model = models("llama-gqa")["fdl"]
    ids, _ = inputs(None, batch=2, seq=16)
    with pytest.raises(NotImplementedError, match="dtype"):
        logits_of(model, ids, torch.ones(2, 1, 16, 16, dtype=torch.int64))


def sdpa64(q, k, v, mask, scale=None):
    """float64 SDPA in transformers' layout with a bool mask (batch, 1, seq_q, seq_k)."""
    out = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                         scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def qkv(b, h, hk, sq, sk, d, dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, sq, d, generator=g), torch.randn(b, hk, sk, d, generator=g),
            torch.randn(b, hk, sk, dv or d, generator=g))


class Module(torch.nn.Module):
    def __init__(self, is_causal):
        super().__init__()
        self.is_causal = is_causal


def rule(got, q, k, v, mask, rows=None, scale=None):
    """flash-attn's rule for a direct attention_forward call, over the query rows `rows`."""
    ref = sdpa64(q, k, v, mask, scale)
    low = sdpa64(q.float(), k.float(), v.float(), mask, scale).float()
    if rows is not None:
        ref, low, got = ref[rows], low[rows], got[rows]
    assert_rule(np64(got), np64(ref), np64(low), "float32", ulps=ULPS)


def test_bert_bidirectional_padding_computes_every_row():
    """An encoder (is_causal False) with right padding: every row, padding ones too, as "sdpa"
    computes it."""
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=128,
                                  initializer_range=0.1, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    fdl = transformers.AutoModel.from_config(copy.deepcopy(cfg), attn_implementation=NAME).eval()
    state = fdl.state_dict()
    ids, mask = inputs("right")
    out = {}
    for impl, dtype in ((NAME, torch.float32), ("sdpa", torch.float32), ("sdpa", torch.float64)):
        model = transformers.AutoModel.from_config(copy.deepcopy(cfg), attn_implementation=impl,
                                                   dtype=dtype).eval()
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()})
        with torch.no_grad():
            out[impl, dtype] = np64(model(ids, attention_mask=mask).last_hidden_state)
    assert_rule(out[NAME, torch.float32], out["sdpa", torch.float64],
                out["sdpa", torch.float32], "float32", what="bert hidden states", ulps=ULPS)


def test_mask_interface_tells_sliding_windows_from_chunks():
    """transformers passes local_size for both sliding windows and chunked attention: the
    pattern decides. A sliding window needs no mask; chunks come back as a 4-D mask, which the
    attention runs as one sequence per chunk."""
    q, k, v = qkv(2, 4, 2, 12, 12, 16)
    pad = torch.zeros(2, dtype=torch.long)
    sliding = masking_utils.sliding_window_causal_mask_function(4)
    assert fdl_hf.attention_mask_interface(2, 12, 12, mask_function=sliding, local_size=4) is None
    got, _ = fdl_hf.attention_forward(Module(True), q, k, v, None, sliding_window=4)
    dense = masking_utils.sdpa_mask(2, 12, 12, mask_function=sliding, allow_is_causal_skip=False)
    rule(got, q, k, v, dense)
    chunked = masking_utils.chunked_causal_mask_function(4, pad)
    mask = fdl_hf.attention_mask_interface(2, 12, 12, mask_function=chunked, local_size=4)
    assert mask.shape == (2, 1, 12, 12)
    got, _ = fdl_hf.attention_forward(Module(True), q, k, v, mask)
    rule(got, q, k, v, mask)


def test_mask_interface_padding_and_static_cache_tail():
    padding = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    got = fdl_hf.attention_mask_interface(2, 6, 6, attention_mask=padding)
    assert torch.equal(got, padding)
    assert fdl_hf.attention_mask_interface(2, 6, 6, attention_mask=padding[1:].expand(2, 6)) \
        is None
    # Decoding one token at position 5 of a 16-slot static cache: the 6 slots up to it.
    got = fdl_hf.attention_mask_interface(2, 1, 16, q_offset=5, attention_mask=padding)
    assert torch.equal(got, padding)
    # What it returned is what it returns when generate() feeds it back.
    assert torch.equal(fdl_hf.attention_mask_interface(2, 1, 16, q_offset=5, attention_mask=got),
                       got)
    with pytest.raises(ValueError, match="attention_mask"):
        fdl_hf.attention_mask_interface(2, 1, 16, q_offset=9, attention_mask=padding)


def test_bidirectional_padding_computes_every_row():
    """is_causal=False with a 2-D mask: every query row, padding ones too, attends to the valid
    keys, as "eager" computes it."""
    q, k, v = qkv(2, 4, 4, 10, 10, 16, seed=3)
    keys = torch.ones(2, 10, dtype=torch.bool)
    keys[0, 7:] = False
    keys[1, :2] = False
    got, _ = fdl_hf.attention_forward(Module(False), q, k, v, keys.long(), scaling=0.3)
    rule(got, q, k, v, keys[:, None, None, :], scale=0.3)


def test_causal_padding_and_gqa_and_decoding_rows():
    """Causal with padding: the valid rows match SDPA with the dense mask; the padding rows are
    zeros. Decoding (seq_q 1 against 9 keys) aligns the query with the last key."""
    q, k, v = qkv(3, 6, 2, 9, 9, 16, seed=4)
    keys = torch.ones(3, 9, dtype=torch.bool)
    keys[0, :3] = False
    keys[1, 5:] = False
    dense = keys[:, None, None, :] & torch.ones(9, 9, dtype=torch.bool).tril()
    got, _ = fdl_hf.attention_forward(Module(True), q, k, v, keys)
    rule(got, q, k, v, dense, rows=keys)
    assert not got[~keys].any()
    keys[1, 5:] = True
    got, _ = fdl_hf.attention_forward(Module(True), q[:, :, -1:], k, v, keys)
    rule(got, q[:, :, -1:], k, v, keys[:, None, None, :])


def test_packed_kwargs_cu_seq_lens():
    q, k, v = qkv(1, 4, 2, 15, 15, 16, seed=5)
    cu = torch.tensor([0, 4, 13, 15], dtype=torch.int32)
    got, _ = fdl_hf.attention_forward(Module(True), q, k, v, None, cu_seq_lens_q=cu,
                                      cu_seq_lens_k=cu, max_length_q=9, max_length_k=9)
    seq = torch.bucketize(torch.arange(15), cu[1:], right=True)
    dense = (seq[:, None] == seq[None, :]) & torch.ones(15, 15, dtype=torch.bool).tril()
    rule(got, q, k, v, dense)


def test_value_head_dim_smaller_than_query_head_dim():
    q, k, v = qkv(2, 4, 4, 8, 8, 16, dv=8, seed=6)
    got, _ = fdl_hf.attention_forward(Module(True), q, k, v, None)
    assert got.shape == (2, 8, 4, 8)
    rule(got, q, k, v, torch.ones(8, 8, dtype=torch.bool).tril())


def test_dropout_comes_from_the_module_and_torch_seed():
    cfg = config("gpt2", attn_pdrop=0.3)
    model = build(cfg, NAME).train()
    ids, _ = inputs(None, batch=2, seq=16)

    def loss(seed):
        torch.manual_seed(seed)
        return model(ids, labels=ids, use_cache=False).loss

    first = loss(3)
    first.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    with torch.no_grad():
        assert float(first) == float(loss(3))
        assert float(first) != float(loss(4))
        model.eval()
        assert float(first) != float(model(ids, labels=ids, use_cache=False).loss)


def test_refusals_name_what_is_refused():
    q, k, v = qkv(1, 4, 4, 8, 8, 16)
    module = Module(True)
    cases = [(dict(position_bias=q), "position_bias"),
             (dict(cache=object()), "paged"), (dict(block_table=q), "paged")]
    for kwargs, message in cases:
        with pytest.raises(NotImplementedError, match=message):
            fdl_hf.attention_forward(module, q, k, v, None, **kwargs)
    with pytest.raises(NotImplementedError, match="attention_mask"):
        fdl_hf.attention_forward(module, q, k, v, object())
    with pytest.raises(NotImplementedError, match="learnable scaling"):
        fdl_hf.attention_forward(module, q, k, v, None,
                                 scaling=torch.tensor(0.25, requires_grad=True))
    with pytest.raises(NotImplementedError, match="value head dim"):
        fdl_hf.attention_forward(module, q, k, torch.cat([v, v], -1), None)
    with pytest.raises(NotImplementedError, match="bidirectional"):
        fdl_hf.attention_forward(Module(False), q, k, v, None, sliding_window=4)
    # A 4-D mask with a KV cache (seq_q < seq_k) is no varlen sequence set: it runs as
    # flashdl's boolean mask, as "sdpa" computes it.
    cached = torch.ones(1, 1, 2, 8, dtype=torch.bool)
    cached[..., 0, 5:] = False
    got, _ = fdl_hf.attention_forward(module, q[:, :, :2], k, v, cached)
    rule(got, q[:, :, :2], k, v, cached)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window"):
            fdl_hf.attention_forward(module, q, k, v, None, sliding_window=bad)
    with pytest.raises(TypeError, match="scaling"):
        fdl_hf.attention_forward(module, q, k, v, None, scaling="a quarter")
    with pytest.raises(ValueError, match="attention_mask"):
        fdl_hf.attention_forward(module, q, k, v, torch.ones(2, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="key"):
        fdl_hf.attention_forward(module, q, k[0], v, None)
    with pytest.warns(UserWarning, match="output_attentions"):
        out, weights = fdl_hf.attention_forward(module, q, k, v, None, output_attentions=True)
    assert weights is None and out.shape == (1, 8, 4, 16)


def test_sliding_window_with_padding_inside_a_sequence_is_refused():
    """The window would count the padding for "eager" and not after unpadding."""
    model = models("mistral-window")["fdl"]
    ids, mask = inputs(None)
    mask = torch.ones_like(ids)
    mask[1, 10:14] = 0
    with pytest.raises(NotImplementedError, match="sliding window with padding"):
        logits_of(model, ids, mask)
    # Without a window, the same mask is exact: only order matters to causal attention.
    m = models("llama-gqa")
    valid = mask.bool()
    assert_rule(np64(logits_of(m["fdl"], ids, mask)[valid]),
                np64(logits_of(m["ref"], ids, mask)[valid]),
                np64(logits_of(m["sdpa"], ids, mask)[valid]), "float32", ulps=ULPS)


def test_inputs_are_not_modified():
    q, k, v = qkv(2, 4, 2, 8, 8, 16)
    q.requires_grad_(True)
    keys = torch.ones(2, 8, dtype=torch.bool)
    keys[0, :2] = False
    before = [x.detach().clone() for x in (q, k, v, keys)]
    out, _ = fdl_hf.attention_forward(Module(True), q, k, v, keys)
    out.sum().backward()
    for x, y in zip((q, k, v, keys), before):
        assert torch.equal(x.detach(), y)
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_example_runs_and_matches_sdpa():
    """examples/hf_causal_lm.py: forward, backward and greedy generation agree with "sdpa" (the
    example exits 1 otherwise)."""
    import pathlib
    import subprocess
    import sys

    example = pathlib.Path(__file__).resolve().parents[2] / "examples" / "hf_causal_lm.py"
    got = subprocess.run([sys.executable, str(example), "--tokens", "6"], capture_output=True,
                         text=True, timeout=300)
    assert got.returncode == 0, got.stdout + got.stderr
    assert got.stdout.rstrip().endswith("OK")


# --- gpt-oss: learnable attention sinks (s_aux) --------------------------------------------------

def gpt_oss(impl, state=None, dtype=torch.float32):
    """A tiny random gpt-oss (GQA, alternating sliding and full layers, MoE run by the eager
    experts so that float64 works), its sinks drawn away from their zero init."""
    cfg = transformers.GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                                    layer_types=["sliding_attention", "full_attention"],
                                    max_position_embeddings=64, **COMMON)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl,
                                                          dtype=dtype,
                                                          experts_implementation="eager")
    if state is None:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    else:
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    return model.eval()


_GPT_OSS = {}


def gpt_oss_models():
    if not _GPT_OSS:
        fdl = gpt_oss(NAME)
        state = fdl.state_dict()
        _GPT_OSS.update(fdl=fdl, eager=gpt_oss("eager", state),
                        ref=gpt_oss("eager", state, torch.float64))
    return _GPT_OSS


@pytest.mark.parametrize("padding", [None, "right"])
def test_gpt_oss_sinks_logits_match_eager(padding):
    m = gpt_oss_models()
    ids, mask = inputs(padding, seq=16)
    valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    ref = np64(logits_of(m["ref"], ids, mask)[valid])
    assert_rule(np64(logits_of(m["fdl"], ids, mask)[valid]), ref,
                np64(logits_of(m["eager"], ids, mask)[valid]), "float32",
                what="gpt-oss logits vs eager", ulps=ULPS)
    # The sinks matter: the same model without them is far off.
    with torch.no_grad():
        saved = [layer.self_attn.sinks.clone() for layer in m["fdl"].model.layers]
        for layer in m["fdl"].model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        without = np64(logits_of(m["fdl"], ids, mask)[valid])
        for layer, x in zip(m["fdl"].model.layers, saved):
            layer.self_attn.sinks.copy_(x)
    assert np.abs(without - ref).max() > 1e-2


def test_gpt_oss_sinks_gradients_match_eager():
    m = gpt_oss_models()
    ids, mask = inputs("right", seq=16)
    g = {impl: grads(m[impl], ids, mask) for impl in ("fdl", "eager", "ref")}
    assert any("sinks" in name for name in g["ref"])
    magnitude = max(float(x.abs().max()) for x in g["ref"].values())
    for name, ref in g["ref"].items():
        assert_rule(np64(g["fdl"][name]), np64(ref), np64(g["eager"][name]), "float32",
                    what=f"gpt-oss d{name} vs eager", ulps=ULPS, magnitude=magnitude, grad=True)
    for name in (n for n in g["ref"] if "sinks" in n):
        assert float(g["fdl"][name].abs().max()) > 0


def test_gpt_oss_generate_matches_eager():
    m = gpt_oss_models()
    ids, mask = inputs("left", seq=12, seed=2)
    out = {}
    for impl in ("fdl", "eager"):
        with torch.no_grad():
            out[impl] = m[impl].generate(ids, attention_mask=mask, max_new_tokens=8,
                                         do_sample=False, output_logits=True,
                                         return_dict_in_generate=True)
    assert torch.equal(out["fdl"].sequences, out["eager"].sequences)
    for step, (a, b) in enumerate(zip(out["fdl"].logits, out["eager"].logits)):
        assert float((a - b).abs().max()) <= 1e-5 * max(1.0, float(b.abs().max())), f"step {step}"
