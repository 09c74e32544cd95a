"""flashdl.flash_attn, the flash-attn 2.x drop-in: flash-attn's signatures; every function against
the float64 oracle (forward, lse, autograd gradients, float32 and bfloat16); packed layouts equal
the unpacked call; varlen equals each sequence alone; return_attn_probs (shapes, dtypes, lse, the
dropout keep-mask recovered from S_dmask equals flashdl.dropout_mask, S_dmask in the per-key-block
scaling of flash-attn's kernel, which flash-attn's normalisation turns into the probabilities,
against float64 written from that definition); windows below -1;
strided last dimensions; softcap and alibi_slopes against flash-attn's reference formulas;
block_table and seqused_k (paged varlen, forward only); unpad_input/pad_input (flash_attn.bert_padding)."""

import inspect
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashdl  # noqa: E402
import flashdl.torch  # noqa: E402
import flashdl.flash_attn as flash_attn  # noqa: E402
import masked_oracle  # noqa: E402
from attn_oracle import (assert_lse, assert_rule, backward, forward, fwd_ulps,  # noqa: E402
                         grad_magnitude, grad_ulps, visible)

COMMON = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
          ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
          ("deterministic", False), ("return_attn_probs", False)]
# flash-attn 2.x's flash_attn_interface.py: (positional arguments, defaulted arguments).
SIGNATURES = {
    "flash_attn_func": (["q", "k", "v"], COMMON),
    "flash_attn_qkvpacked_func": (["qkv"], COMMON),
    "flash_attn_kvpacked_func": (["q", "kv"], COMMON),
    "flash_attn_varlen_func": (["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                "max_seqlen_k"], COMMON + [("block_table", None),
                                                           # flash-attn 3's keyword, after
                                                           # flash-attn 2's parameters
                                                           ("seqused_k", None)]),
    "flash_attn_varlen_qkvpacked_func": (["qkv", "cu_seqlens", "max_seqlen"], COMMON),
    "flash_attn_varlen_kvpacked_func": (["q", "kv", "cu_seqlens_q", "cu_seqlens_k",
                                         "max_seqlen_q", "max_seqlen_k"], COMMON),
    "flash_attn_with_kvcache": (["q", "k_cache", "v_cache"], [
        ("k", None), ("v", None), ("rotary_cos", None), ("rotary_sin", None),
        ("cache_seqlens", None), ("cache_batch_idx", None), ("cache_leftpad", None),
        ("block_table", None), ("softmax_scale", None), ("causal", False),
        ("window_size", (-1, -1)), ("softcap", 0.0), ("rotary_interleaved", True),
        ("alibi_slopes", None), ("num_splits", 0), ("return_softmax_lse", False)]),
}


def randn(*shape, dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    return x.requires_grad_(grad)


def qkv_of(b, sq, sk, h, hk, d, dtype=torch.float32, grad=False):
    return (randn(b, sq, h, d, dtype=dtype, seed=1, grad=grad),
            randn(b, sk, hk, d, dtype=dtype, seed=2, grad=grad),
            randn(b, sk, hk, d, dtype=dtype, seed=3, grad=grad))


def np64(*xs):
    return [x.detach().double().numpy() for x in xs]


def grads(fn, leaves, w):
    for x in leaves:
        x.grad = None
    (fn() * w).sum().backward()
    return [x.grad.clone() for x in leaves]


def test_signatures_match_flash_attn():
    for name, (positional, defaulted) in SIGNATURES.items():
        params = list(inspect.signature(getattr(flash_attn, name)).parameters.values())
        assert [p.name for p in params] == positional + [n for n, _ in defaulted], name
        assert all(p.default is inspect.Parameter.empty for p in params[:len(positional)])
        assert [p.default for p in params[len(positional):]] == [v for _, v in defaulted], name


def test_import_flashdl_does_not_import_torch_or_the_dropin():
    code = "import sys, flashdl; print('torch' in sys.modules, 'flashdl.flash_attn' in sys.modules)"
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert got.stdout.split() == ["False", "False"]


SHAPES = [(2, 13, 21, 4, 4, 32), (1, 17, 9, 6, 2, 16), (2, 19, 19, 4, 1, 64)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (5, 2))])
def test_func_matches_oracle(shape, causal, window):
    b, sq, sk, h, hk, d = shape
    leaves = qkv_of(b, sq, sk, h, hk, d, grad=True)
    w = randn(b, sq, h, d, seed=9)
    out, lse, s_dmask = flash_attn.flash_attn_func(*leaves, causal=causal, window_size=window,
                                                   return_attn_probs=True)
    assert out.dtype == torch.float32 and out.shape == (b, sq, h, d)
    assert lse.dtype == torch.float32 and lse.shape == (b, h, sq)
    assert s_dmask.numel() == 0  # flash-attn returns an empty S_dmask without dropout
    q, k, v = np64(*leaves)
    o_ref, lse_ref = forward(q, k, v, causal=causal, window=window)
    o_low, _ = forward(q, k, v, causal=causal, window=window, dtype="float32", exact=False)
    assert_rule(out.detach().numpy(), o_ref, o_low, "float32", ulps=fwd_ulps("float32", q, k))
    assert_lse(lse.numpy(), lse_ref)

    got = grads(lambda: flash_attn.flash_attn_func(*leaves, causal=causal, window_size=window),
                leaves, w)
    dout = w.double().numpy()
    exact = backward(dout, q, k, v, causal=causal, window=window)
    naive = backward(dout, q, k, v, causal=causal, window=window, dtype="float32", exact=False)
    mag = grad_magnitude(exact)
    for g, e, n, u, name in zip(got, exact, naive, grad_ulps("float32", q, k), "qkv"):
        assert_rule(g.numpy(), e, n, "float32", what=f"d{name}", ulps=u, magnitude=mag, grad=True)


def test_bfloat16_matches_oracle():
    leaves = qkv_of(2, 24, 24, 4, 2, 32, dtype=torch.bfloat16, grad=True)
    out = flash_attn.flash_attn_func(*leaves, causal=True)
    assert out.dtype == torch.bfloat16
    q, k, v = np64(*leaves)
    o_ref, _ = forward(q, k, v, causal=True)
    o_low, _ = forward(q, k, v, causal=True, dtype="bfloat16", exact=False)
    assert_rule(out.detach().double().numpy(), o_ref, o_low, "bfloat16")
    w = randn(*out.shape, dtype=torch.bfloat16, seed=9)
    got = grads(lambda: flash_attn.flash_attn_func(*leaves, causal=True), leaves, w)
    dout = w.double().numpy()
    exact = backward(dout, q, k, v, causal=True)
    naive = backward(dout, q, k, v, causal=True, dtype="bfloat16", exact=False)
    mag = grad_magnitude(exact)
    for g, e, n, name in zip(got, exact, naive, "qkv"):
        assert_rule(g.double().numpy(), e, n, "bfloat16", what=f"d{name}", magnitude=mag,
                    grad=True)


def test_empty_rows_get_lse_minus_inf():
    # seqlen_q > seqlen_k with causal: the first rows see no key. flash-attn's kernel gives +inf
    # there; flashdl's contract (and this drop-in) gives -inf, with out 0.
    q, k, v = qkv_of(1, 6, 3, 2, 2, 8)
    out, lse, _ = flash_attn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.isneginf(lse[:, :, :3]).all() and torch.isfinite(lse[:, :, 3:]).all()
    assert (out[:, :3] == 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_packed_equal_unpacked_forward_and_backward(causal):
    b, s, h, d = 2, 11, 4, 16
    qkv = randn(b, s, 3, h, d, seed=4, grad=True)
    kv = randn(b, s, 2, 2, d, seed=5, grad=True)
    q = randn(b, s, h, d, seed=6, grad=True)
    w = randn(b, s, h, d, seed=9)
    ref = flash_attn.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=causal)
    assert torch.equal(flash_attn.flash_attn_qkvpacked_func(qkv, causal=causal), ref)
    (dqkv,) = grads(lambda: flash_attn.flash_attn_qkvpacked_func(qkv, causal=causal), [qkv], w)
    parts = [x.detach().clone().requires_grad_() for x in qkv.unbind(2)]
    sep = grads(lambda: flash_attn.flash_attn_func(*parts, causal=causal), parts, w)
    assert torch.equal(dqkv, torch.stack(sep, dim=2))

    ref = flash_attn.flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], causal=causal)
    assert torch.equal(flash_attn.flash_attn_kvpacked_func(q, kv, causal=causal), ref)
    dq, dkv = grads(lambda: flash_attn.flash_attn_kvpacked_func(q, kv, causal=causal), [q, kv], w)
    parts = [q.detach().clone().requires_grad_()] + [
        x.detach().clone().requires_grad_() for x in kv.unbind(2)]
    sep = grads(lambda: flash_attn.flash_attn_func(*parts, causal=causal), parts, w)
    assert torch.equal(dq, sep[0]) and torch.equal(dkv, torch.stack(sep[1:], dim=2))


LENS = [(5, 5), (9, 13), (1, 1), (17, 6), (0, 4)]


def cu(lengths):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 1))])
def test_varlen_equals_each_sequence_alone(causal, window):
    h, hk, d = 4, 2, 16
    sq, sk = [a for a, _ in LENS], [b for _, b in LENS]
    q = randn(sum(sq), h, d, seed=1, grad=True)
    k, v = (randn(sum(sk), hk, d, seed=s, grad=True) for s in (2, 3))
    cq, ck = cu(sq), cu(sk)
    opts = dict(causal=causal, window_size=window)
    out, lse, _ = flash_attn.flash_attn_varlen_func(q, k, v, cq, ck, max(sq), max(sk),
                                                    return_attn_probs=True, **opts)
    assert out.shape == q.shape and lse.shape == (h, sum(sq)) and lse.dtype == torch.float32
    w = randn(*q.shape, seed=9)
    dq, dk, dv = grads(lambda: flash_attn.flash_attn_varlen_func(q, k, v, cq, ck, max(sq),
                                                                 max(sk), **opts), [q, k, v], w)
    for b in range(len(LENS)):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        one = [x.detach()[r][None].clone().requires_grad_() for x, r in ((q, rq), (k, rk),
                                                                          (v, rk))]
        o1, l1, _ = flash_attn.flash_attn_func(*one, return_attn_probs=True, **opts)
        torch.testing.assert_close(out[rq], o1[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse[:, rq], l1[0], rtol=1e-6, atol=1e-6)
        if sq[b]:
            g1 = grads(lambda: flash_attn.flash_attn_func(*one, **opts), one, w[rq][None])
            for g, ref in zip((dq[rq], dk[rk], dv[rk]), g1):
                torch.testing.assert_close(g, ref[0], rtol=1e-5, atol=1e-6)


def test_varlen_packed_equal_unpacked():
    s, h, d = [7, 12, 3], 4, 16
    c, total = cu(s), sum(s)
    qkv = randn(total, 3, h, d, seed=4, grad=True)
    w = randn(total, h, d, seed=9)
    ref = flash_attn.flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], c, c, max(s), max(s),
                                            causal=True)
    got = flash_attn.flash_attn_varlen_qkvpacked_func(qkv, c, max(s), causal=True)
    assert torch.equal(got, ref)
    (dqkv,) = grads(lambda: flash_attn.flash_attn_varlen_qkvpacked_func(qkv, c, max(s),
                                                                        causal=True), [qkv], w)
    parts = [x.detach().clone().requires_grad_() for x in qkv.unbind(1)]
    sep = grads(lambda: flash_attn.flash_attn_varlen_func(*parts, c, c, max(s), max(s),
                                                          causal=True), parts, w)
    assert torch.equal(dqkv, torch.stack(sep, dim=1))

    q, kv = randn(total, h, d, seed=5, grad=True), randn(total, 2, 2, d, seed=6, grad=True)
    ref = flash_attn.flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], c, c, max(s), max(s))
    assert torch.equal(flash_attn.flash_attn_varlen_kvpacked_func(q, kv, c, c, max(s), max(s)),
                       ref)
    dq, dkv = grads(lambda: flash_attn.flash_attn_varlen_kvpacked_func(q, kv, c, c, max(s),
                                                                       max(s)), [q, kv], w)
    parts = [q.detach().clone().requires_grad_()] + [
        x.detach().clone().requires_grad_() for x in kv.unbind(1)]
    sep = grads(lambda: flash_attn.flash_attn_varlen_func(*parts, c, c, max(s), max(s)), parts, w)
    assert torch.equal(dq, sep[0]) and torch.equal(dkv, torch.stack(sep[1:], dim=1))


# flash-attn's sm80 key-block widths with dropout (its flash_attn_interface._get_block_size_n),
# written out here rather than read from the module under test.
def fa_block_width(d):
    return 128 if d <= 32 else 64 if d <= 96 else 32 if d <= 128 else 64


def ref_scores(q, k, causal=False, window=(-1, -1), softcap=0.0, alibi_slopes=None):
    """float64 scores (b, h, sq, sk) as flash-attn's tests' attention_ref builds them (bottom-right
    aligned): q k / sqrt(d), then softcap * tanh(scores / softcap), then the ALiBi bias
    -slope * |i + sk - sq - j|, -inf where the key is invisible."""
    q, k = q.double(), k.double().repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) / q.shape[-1] ** 0.5
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    sq, sk = q.shape[1], k.shape[1]
    if alibi_slopes is not None:
        slopes = alibi_slopes.double().reshape(-1, q.shape[2])[..., None, None]
        dist = (torch.arange(sq)[:, None] + sk - sq - torch.arange(sk)[None, :]).abs()
        s = s - slopes * dist
    return s.masked_fill(~torch.as_tensor(visible(sq, sk, causal, window)), -torch.inf)


def sdmask_oracle(s, width):
    """|S_dmask| from the definition of flash-attn's kernel's scaling: key j in block
    J = j // width gets exp(s_ij - m), m the largest s_i over blocks J..last (its running max,
    walking the blocks from the last), 0 where s_ij = -inf."""
    out = torch.zeros_like(s)
    for j0 in range(0, s.shape[-1], width):
        m = s[..., j0:].amax(-1, keepdim=True)
        out[..., j0:j0 + width] = torch.exp(s[..., j0:j0 + width] - m).nan_to_num(0.0)
    return out


def fa_normalize(s_dmask, s, width):
    """flash-attn's tests' normalize_flash_attn_S on |S_dmask| (s: the scores): block J times
    exp(m_J - lse), m_J the block maxima of s cumulated from the right, lse its logsumexp (+inf
    where -inf, so that a row that sees no key gives 0, not NaN)."""
    blocks = s.split(width, dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    lse[lse == -torch.inf] = torch.inf
    m = torch.stack([x.amax(-1) for x in blocks], dim=-1).flip(-1).cummax(-1).values.flip(-1)
    return torch.cat([a * torch.exp(mj - lse)[..., None] for a, mj in
                      zip(s_dmask.abs().double().split(width, dim=-1), m.unbind(-1))], dim=-1)


def keep_after(torch_seed, b, h, sq, sk, p):
    """The keep-mask of a call made right after torch.manual_seed(torch_seed): the dropout seed
    comes from torch's generator."""
    torch.manual_seed(torch_seed)
    seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64).item())
    return flashdl.dropout_mask(b, h, sq, sk, p, seed)


def check_s_dmask(s_dmask, s, keep, width, atol):
    """S_dmask against its float64 definition: the sign bit is the dropout, `S_dmask >= 0`
    (flash-attn's tests) recovers the keep-mask wherever the entry is not 0, |S_dmask| is
    flash-attn's scaling, and flash-attn's normalisation gives the softmax of the scores."""
    s = s.detach()
    assert np.array_equal(torch.signbit(s_dmask).numpy(), ~keep)
    nonzero = (s_dmask != 0).numpy()
    assert np.array_equal((s_dmask >= 0).numpy()[nonzero], keep[nonzero])
    torch.testing.assert_close(s_dmask.abs().double(), sdmask_oracle(s, width), rtol=0, atol=atol)
    torch.testing.assert_close(fa_normalize(s_dmask, s, width),
                               torch.softmax(s, dim=-1).nan_to_num(0.0), rtol=0, atol=atol)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (4, -1))])
def test_dropout_mask_recovered_from_s_dmask(causal, window):
    b, sq, sk, h, hk, d, p = 2, 15, 19, 4, 2, 16, 0.3
    leaves = qkv_of(b, sq, sk, h, hk, d, grad=True)
    torch.manual_seed(123)
    out, lse, s_dmask = flash_attn.flash_attn_func(*leaves, dropout_p=p, causal=causal,
                                                   window_size=window, return_attn_probs=True)
    assert s_dmask.shape == (b, h, sq, sk) and s_dmask.dtype == torch.float32
    # The seed came from torch's generator: the same torch seed gives the same dropout.
    keep = keep_after(123, b, h, sq, sk, p)
    check_s_dmask(s_dmask, ref_scores(*leaves[:2], causal, window), keep, fa_block_width(d), 1e-6)
    q, k, v = np64(*leaves)
    vis = visible(sq, sk, causal, window)
    o_ref, lse_ref = masked_oracle.forward(q, k, v, vis, keep, p)
    masked_oracle.close(out.detach().numpy(), o_ref, 1e-5, "out")
    assert_lse(lse.numpy(), lse_ref)

    w = randn(b, sq, h, d, seed=9)
    torch.manual_seed(123)
    got = grads(lambda: flash_attn.flash_attn_func(*leaves, dropout_p=p, causal=causal,
                                                   window_size=window), leaves, w)
    exact = masked_oracle.backward(w.double().numpy(), q, k, v, vis, keep, p)
    mag = grad_magnitude(exact)
    for g, e, name in zip(got, exact, "qkv"):
        masked_oracle.close(g.numpy(), e, 1e-4, f"d{name}", magnitude=mag)


SDMASK_SHAPES = [
    (37, 293, False, (-1, -1)),  # several blocks of every width, the last one partial
    (37, 293, True, (-1, -1)),   # bottom-right causal: the last blocks are invisible to some rows
    (150, 133, True, (-1, -1)),  # the first 17 rows see no key
    (37, 293, False, (70, 20)),  # whole blocks outside the window on both sides
]


@pytest.mark.parametrize("d", [16, 48, 80, 112, 160])  # one in each row of the width table
@pytest.mark.parametrize("sq,sk,causal,window", SDMASK_SHAPES)
def test_s_dmask_has_flash_attns_block_scaling(d, sq, sk, causal, window):
    b, h, hk, p = 2, 4, 2, 0.2
    q, k, v = qkv_of(b, sq, sk, h, hk, d)
    torch.manual_seed(5)
    _, _, s_dmask = flash_attn.flash_attn_func(q, k, v, dropout_p=p, causal=causal,
                                               window_size=window, return_attn_probs=True)
    assert s_dmask.shape == (b, h, sq, sk) and s_dmask.abs().max() <= 1
    check_s_dmask(s_dmask, ref_scores(q, k, causal, window), keep_after(5, b, h, sq, sk, p),
                  fa_block_width(d), 1e-5)


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2**-8), (torch.float16, 2**-11)])
def test_s_dmask_in_q_dtype_with_softcap_and_alibi(dtype, atol):
    b, sq, sk, h, d, p = 2, 21, 150, 2, 112, 0.25
    q, k, v = qkv_of(b, sq, sk, h, h, d, dtype=dtype)
    slopes = torch.tensor([[0.25, 0.0625], [0.5, 0.125]])
    torch.manual_seed(9)
    _, _, s_dmask = flash_attn.flash_attn_func(q, k, v, dropout_p=p, causal=True, softcap=4.0,
                                               alibi_slopes=slopes, return_attn_probs=True)
    assert s_dmask.dtype == dtype
    s = ref_scores(q, k, True, softcap=4.0, alibi_slopes=slopes)
    check_s_dmask(s_dmask, s, keep_after(9, b, h, sq, sk, p), fa_block_width(d), atol)


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (30, 10))])
def test_varlen_dropout_s_dmask(causal, window):
    h, hk, d, p = 4, 2, 48, 0.25
    sq, sk = [40, 9, 1, 70], [150, 3, 70, 65]
    q, k, v = randn(sum(sq), h, d, seed=1), randn(sum(sk), hk, d, seed=2), randn(sum(sk), hk, d,
                                                                                seed=3)
    cq, ck = cu(sq), cu(sk)
    torch.manual_seed(7)
    out, lse, s_dmask = flash_attn.flash_attn_varlen_func(q, k, v, cq, ck, max(sq), max(sk),
                                                          dropout_p=p, causal=causal,
                                                          window_size=window,
                                                          return_attn_probs=True)
    n = len(sq)
    assert s_dmask.shape == (n, h, max(sq), max(sk)) and lse.shape == (h, sum(sq))
    keep = keep_after(7, n, h, max(sq), max(sk), p)
    for b in range(n):
        # Each sequence alone, its key blocks starting at its own first key, as in flash-attn.
        s = ref_scores(q[cq[b]:cq[b + 1]][None], k[ck[b]:ck[b + 1]][None], causal, window)
        check_s_dmask(s_dmask[b:b + 1, :, :sq[b], :sk[b]], s, keep[b:b + 1, :, :sq[b], :sk[b]],
                      fa_block_width(d), 1e-5)
        rest = s_dmask[b].clone()
        rest[:, :sq[b], :sk[b]] = 0
        assert (rest == 0).all()


def test_window_below_minus_one_is_unbounded():
    q, k, v = qkv_of(1, 9, 12, 2, 2, 8)
    for window, same in [((-5, -2), (-1, -1)), ((-3, 2), (-1, 2)), ((3, -100), (3, -1))]:
        assert torch.equal(flash_attn.flash_attn_func(q, k, v, window_size=window),
                           flash_attn.flash_attn_func(q, k, v, window_size=same))


def test_strided_last_dim_is_copied():
    q, k, v = qkv_of(2, 7, 7, 2, 2, 8)
    wide = [torch.stack([x, torch.zeros_like(x)], dim=-1) for x in (q, k, v)]
    strided = [x[..., 0] for x in wide]  # last-dimension stride 2
    assert strided[0].stride(-1) == 2
    assert torch.equal(flash_attn.flash_attn_func(*strided, causal=True),
                       flash_attn.flash_attn_func(q, k, v, causal=True))
    leaves = [x.clone().requires_grad_() for x in strided]
    out = flash_attn.flash_attn_func(*[x[..., None].expand(*x.shape, 2)[..., 0] for x in leaves])
    out.sum().backward()
    assert all(x.grad is not None and x.grad.shape == x.shape for x in leaves)


def ref_attention(q, k, v, causal=False, window=(-1, -1), softcap=0.0, alibi_slopes=None):
    """flash-attn's tests' attention_ref in float64 torch: the softmax of ref_scores times v."""
    p = torch.softmax(ref_scores(q, k, causal, window, softcap, alibi_slopes), dim=-1)
    v = v.double().repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    return torch.einsum("bhij,bjhd->bihd", p.nan_to_num(0.0), v)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (6, 3))])
@pytest.mark.parametrize("mods", [dict(softcap=2.0), dict(alibi_slopes="heads"),
                                  dict(alibi_slopes="batch", softcap=5.0)])
def test_softcap_and_alibi_match_flash_attn_reference(causal, window, mods):
    b, sq, sk, h, hk = 2, 15, 23, 4, 2
    leaves = qkv_of(b, sq, sk, h, hk, 32, grad=True)
    mods = dict(mods)
    if "alibi_slopes" in mods:
        shape = (h,) if mods["alibi_slopes"] == "heads" else (b, h)
        mods["alibi_slopes"] = torch.rand(shape, dtype=torch.float32,
                                          generator=torch.Generator().manual_seed(7))
    w = randn(b, sq, h, 32, seed=9)

    def run():
        return flash_attn.flash_attn_func(*leaves, causal=causal, window_size=window, **mods)

    out = run()
    doubles = [x.detach().double().requires_grad_() for x in leaves]
    ref = ref_attention(*doubles, causal=causal, window=window, **mods).detach()
    assert (out.double() - ref).abs().max() < 2e-5
    got = grads(run, leaves, w)
    (ref_attention(*doubles, causal=causal, window=window, **mods) * w.double()).sum().backward()
    for g, x, name in zip(got, doubles, "qkv"):
        assert (g.double() - x.grad).abs().max() < 1e-4 * max(1.0, x.grad.abs().max()), name
    # The same call through varlen (one sequence per batch entry, slopes row b for sequence b).
    c_q, c_k = cu([sq] * b), cu([sk] * b)
    flat = [x.detach().reshape(-1, *x.shape[2:]) for x in leaves]
    out_v = flash_attn.flash_attn_varlen_func(*flat, c_q, c_k, sq, sk, causal=causal,
                                              window_size=window, **mods)
    assert torch.allclose(out_v.reshape(out.shape), out.detach(), atol=1e-6)


def test_negative_softcap_is_off_and_s_dmask_uses_the_modifiers():
    q, k, v = qkv_of(1, 9, 12, 2, 2, 8)
    assert torch.equal(flash_attn.flash_attn_func(q, k, v, softcap=-1.0),
                       flash_attn.flash_attn_func(q, k, v))
    slopes = torch.tensor([0.5, 0.125])
    out, lse, s_dmask = flash_attn.flash_attn_func(q, k, v, dropout_p=0.3, softcap=1.5,
                                                   alibi_slopes=slopes, return_attn_probs=True)
    # 12 keys, one key block (width 128): |S_dmask| is exp(s - row max) of the modified scores s,
    # so times exp(row max - lse), with the call's lse, it is their softmax: rows sum to 1.
    s = ref_scores(q, k, softcap=1.5, alibi_slopes=slopes)
    probs = s_dmask.abs().double() * torch.exp(s.amax(-1) - lse.double())[..., None]
    assert torch.allclose(probs.sum(-1), torch.ones(1, 2, 9, dtype=torch.float64), atol=1e-5)
    assert torch.isfinite(lse).all() and out.shape == q.shape


def test_unsupported_arguments_raise_naming_them():
    q, k, v = qkv_of(1, 4, 4, 2, 2, 8)
    c = cu([4])
    # A block_table needs paged k, v (rank 4): refused by value, naming k.
    with pytest.raises(ValueError, match="^k: .*paged"):
        flash_attn.flash_attn_varlen_func(q[0], k[0], v[0], c, c, 4, 4,
                                          block_table=torch.zeros(1, 1, dtype=torch.int32))
    # Everything else is flashdl's own validation, which names the argument.
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn.flash_attn_func(q, k, v, dropout_p=1.5)
    with pytest.raises((ValueError, TypeError), match="k"):
        flash_attn.flash_attn_func(q, k[..., :4], v)
    with pytest.raises(ValueError, match="alibi_slopes"):
        flash_attn.flash_attn_func(q, k, v, alibi_slopes=torch.ones(3))
    with pytest.raises(TypeError, match="alibi_slopes"):
        flash_attn.flash_attn_func(q, k, v, alibi_slopes=torch.ones(2, dtype=torch.float64))


def test_torch_return_lse_carries_no_gradient():
    leaves = qkv_of(1, 5, 6, 2, 1, 8, grad=True)
    out, lse = flashdl.torch.attention(*leaves, return_lse=True)
    assert not lse.requires_grad and torch.equal(out, flashdl.torch.attention(*leaves))
    (out.sum() + lse.sum()).backward()  # lse in the graph adds nothing to the gradients
    with_lse = [x.grad.clone() for x in leaves]
    assert all(torch.equal(g, r) for g, r in
               zip(with_lse, grads(lambda: flashdl.torch.attention(*leaves), leaves, 1.0)))
    c = cu([5])
    out, lse = flashdl.torch.attention_varlen(*(x[0] for x in leaves), c, cu([6]), 5, 6,
                                              return_lse=True, deterministic=True)
    assert lse.shape == (2, 5) and not lse.requires_grad


@pytest.mark.parametrize("paged", [False, True])
def test_with_kvcache_appends_and_matches_dense(paged):
    b, cap, h, hk, d, sq = 2, 24, 4, 2, 16, 3
    k_cache, v_cache = randn(b, cap, hk, d, seed=11), randn(b, cap, hk, d, seed=12)
    q, k, v = randn(b, sq, h, d, seed=13), randn(b, sq, hk, d, seed=14), randn(b, sq, hk, d, seed=15)
    lens = torch.tensor([5, 17], dtype=torch.int32)
    slopes = torch.tensor([0.25, 0.5, 0.125, 1.0])
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    for i in range(b):
        expect_k[i, lens[i]:lens[i] + sq], expect_v[i, lens[i]:lens[i] + sq] = k[i], v[i]
    kw = dict(causal=True, softcap=4.0, alibi_slopes=slopes, return_softmax_lse=True)
    if paged:  # pages of 8 rows, sequence i's pages in reverse order
        pages_k = k_cache.reshape(b * 3, 8, hk, d).flip(0).contiguous()
        pages_v = v_cache.reshape(b * 3, 8, hk, d).flip(0).contiguous()
        table = torch.tensor([[5, 4, 3], [2, 1, 0]], dtype=torch.int32)
        out, lse = flash_attn.flash_attn_with_kvcache(q, pages_k, pages_v, k, v,
                                                      cache_seqlens=lens, block_table=table, **kw)
        assert torch.equal(pages_k.flip(0).reshape(b, cap, hk, d), expect_k)
        assert torch.equal(pages_v.flip(0).reshape(b, cap, hk, d), expect_v)
    else:
        out, lse = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v,
                                                      cache_seqlens=lens, **kw)
        assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)
    for i in range(b):  # each sequence equals dense attention over its keys
        n = int(lens[i]) + sq
        ref, ref_lse = flashdl.torch.attention(q[i:i + 1], expect_k[i:i + 1, :n],
                                               expect_v[i:i + 1, :n], causal=True, softcap=4.0,
                                               alibi_slopes=slopes, return_lse=True)
        assert torch.allclose(out[i:i + 1], ref, atol=1e-5)
        assert torch.allclose(lse[i:i + 1], ref_lse, atol=1e-5)


def test_with_kvcache_int_and_none_cache_seqlens_and_unsupported():
    q, k_cache, v_cache = randn(2, 1, 2, 8, seed=1), randn(2, 6, 2, 8, seed=2), randn(2, 6, 2, 8, seed=3)
    full = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache)  # None: the caches are full
    assert torch.allclose(full, flashdl.torch.attention(q, k_cache, v_cache), atol=1e-6)
    four = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=4)
    assert torch.allclose(four, flashdl.torch.attention(q, k_cache[:, :4], v_cache[:, :4]),
                          atol=1e-6)
    # Supported since issue 33; malformed ones are refused by value, naming the argument.
    for name, other in (("rotary_cos", "rotary_sin"), ("rotary_sin", "rotary_cos"),
                        ("cache_batch_idx", None), ("cache_leftpad", None)):
        with pytest.raises((ValueError, TypeError), match=f"^{other or name}: "):
            flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, **{name: torch.zeros(1)})


def test_invalid_values_raise_argument_error_both_value_and_runtime_error():
    """flash-attn's checks raise RuntimeError, flashdl's ValueError: ArgumentError is both, with
    flashdl's message naming the argument. Paged bounds as flash-attn's test checks them: the
    call is refused naming block_table, and nothing is written."""
    assert issubclass(flash_attn.ArgumentError, ValueError)
    assert issubclass(flash_attn.ArgumentError, RuntimeError)
    q = randn(1, 4, 2, 8, seed=1)
    with pytest.raises(RuntimeError, match="softmax_scale"):
        flash_attn.flash_attn_func(q, q, q, softmax_scale=float("nan"))
    with pytest.raises(ValueError, match="softmax_scale"):
        flash_attn.flash_attn_func(q, q, q, softmax_scale=float("nan"))
    pages_k, pages_v = randn(4, 4, 2, 8, seed=2), randn(4, 4, 2, 8, seed=3)
    before = pages_k.clone(), pages_v.clone()
    table = torch.tensor([[0, 1]], dtype=torch.int32)  # 2 pages of 4: room for 8 tokens
    k = v = randn(1, 2, 2, 8, seed=4)
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn.flash_attn_with_kvcache(q[:, :1], pages_k, pages_v, k, v, block_table=table,
                                           cache_seqlens=torch.tensor([7], dtype=torch.int32))
    assert torch.equal(pages_k, before[0]) and torch.equal(pages_v, before[1])
    with pytest.raises(TypeError):  # a wrong type stays a TypeError
        flash_attn.flash_attn_func(q, q, q, window_size="wide")


def test_unpad_pad_input_roundtrip_and_varlen():
    # flash_attn.bert_padding's unpad_input/pad_input: tokens in batch-major order, cu_seqlens
    # int32, max_seqlen an int, seqused the attention_mask counts; gradients flow through both.
    b, s, h, d = 3, 7, 2, 8
    lengths = torch.tensor([7, 0, 4])
    mask = torch.arange(s)[None, :] < lengths[:, None]
    unused = torch.zeros_like(mask)
    unused[2, 4:6] = True  # allocated but not used: kept by unpad_input, not counted in seqused
    x = randn(b, s, h, d, seed=5, grad=True)
    xu, idx, cus, mx, used = flash_attn.unpad_input(x, mask, unused)
    assert idx.tolist() == [i * s + j for i in range(b) for j in range(s)
                            if mask[i, j] or unused[i, j]]
    assert cus.dtype == torch.int32 and cus.tolist() == [0, 7, 7, 13]
    assert mx == 7 and isinstance(mx, int) and used.dtype == torch.int32
    assert used.tolist() == [7, 0, 4]
    assert torch.equal(xu, x.detach().reshape(b * s, h, d)[idx])
    back = flash_attn.pad_input(xu, idx, b, s)
    keep = (mask | unused)[..., None, None]
    assert torch.equal(back, torch.where(keep, x.detach(), torch.zeros(())))
    w = randn(b, s, h, d, seed=6)
    (back * w).sum().backward()
    assert torch.equal(x.grad, torch.where(keep, w, torch.zeros(())))
    # The varlen call on unpadded tensors equals the dense call on each sequence.
    q, k, v = (randn(b, s, h, d, seed=t) for t in (1, 2, 3))
    qu, iq, cq, mq, _ = flash_attn.unpad_input(q, mask)
    (ku, _, ck, mk, _), (vu, _, _, _, _) = flash_attn.unpad_input(k, mask), \
        flash_attn.unpad_input(v, mask)
    out = flash_attn.pad_input(flash_attn.flash_attn_varlen_func(qu, ku, vu, cq, ck, mq, mk,
                                                                 causal=True), iq, b, s)
    for i, n in enumerate(lengths.tolist()):
        ref = flash_attn.flash_attn_func(q[i:i + 1, :n], k[i:i + 1, :n], v[i:i + 1, :n],
                                         causal=True)
        torch.testing.assert_close(out[i:i + 1, :n], ref, rtol=1e-6, atol=1e-6)
        assert not out[i, n:].any()


def test_window_size_as_a_tensor():
    # flash-attn's tests pass window_size=torch.randint(0, seqlen_k, (2,)); its interface reads
    # the two entries as ints.
    q, k, v = qkv_of(1, 9, 11, 2, 2, 8)
    got = flash_attn.flash_attn_func(q, k, v, window_size=torch.tensor([3, 1]))
    assert torch.equal(got, flash_attn.flash_attn_func(q, k, v, window_size=(3, 1)))


def test_with_kvcache_rotary_needs_new_keys_as_flash_attn():
    """flash-attn refuses rotary_cos/rotary_sin without k and v ("If rotary cos/sin are provided,
    new key / value to be appended to KV cache must also be provided"): so does the drop-in, as
    an ArgumentError naming rotary_cos, and nothing is written; with k and v it runs."""
    q, k_cache, v_cache = randn(2, 1, 2, 8, seed=1), randn(2, 6, 2, 8, seed=2), randn(2, 6, 2, 8, seed=3)
    cos, sin = torch.ones(8, 4), torch.zeros(8, 4)
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises(flash_attn.ArgumentError, match="^rotary_cos: .*k and v"):
        flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, rotary_cos=cos, rotary_sin=sin,
                                           cache_seqlens=2)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    k = v = randn(2, 1, 2, 8, seed=4)
    out = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos,
                                             rotary_sin=sin, cache_seqlens=2)
    assert out.shape == q.shape


def test_with_kvcache_cache_of_more_rows_than_the_batch():
    """No cache_batch_idx: rows 0..batch-1 are the sequences' (flash-attn's rule), as in serving
    code that preallocates caches for the largest batch; the other rows are not touched."""
    q, k, v = randn(2, 1, 4, 8, seed=1), randn(2, 1, 2, 8, seed=2), randn(2, 1, 2, 8, seed=3)
    k_cache, v_cache = randn(5, 6, 2, 8, seed=4), randn(5, 6, 2, 8, seed=5)
    rest = k_cache[2:].clone(), v_cache[2:].clone()
    small = k_cache[:2].clone(), v_cache[:2].clone()
    out = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3,
                                             causal=True)
    want = flash_attn.flash_attn_with_kvcache(q, *small, k, v, cache_seqlens=3, causal=True)
    assert torch.equal(out, want)
    assert torch.equal(k_cache[:2], small[0]) and torch.equal(v_cache[:2], small[1])
    assert torch.equal(k_cache[2:], rest[0]) and torch.equal(v_cache[2:], rest[1])


@pytest.mark.parametrize("fn", ["flash_attn_func", "flash_attn_qkvpacked_func",
                                "flash_attn_kvpacked_func", "flash_attn_varlen_func",
                                "flash_attn_with_kvcache"])
def test_numpy_arrays_are_refused_naming_the_function(fn):
    """flash-attn's functions take torch tensors: a NumPy q is a TypeError that says so and names
    flashdl's own entry point, not "k: expected an array of the same framework as q"."""
    x = np.zeros((1, 4, 2, 8), np.float32)
    c = torch.tensor([0, 4], dtype=torch.int32)
    args = {"flash_attn_func": (x, x, x), "flash_attn_qkvpacked_func": (np.zeros((1, 4, 3, 2, 8)),),
            "flash_attn_kvpacked_func": (x, np.zeros((1, 4, 2, 2, 8))),
            "flash_attn_varlen_func": (x[0], x[0], x[0], c, c, 4, 4),
            "flash_attn_with_kvcache": (x, x, x)}[fn]
    with pytest.raises(TypeError, match=rf"^(q|qkv): {fn} takes torch tensors.*use flashdl\."):
        getattr(flash_attn, fn)(*args)
