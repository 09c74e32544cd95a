"""flashdl.torch.scaled_dot_product_attention, PyTorch's SDPA drop-in: against
torch.nn.functional.scaled_dot_product_attention (the math backend on the CPU), forward and
autograd gradients, on a grid of seq_q == / != seq_k, top-left causal or not, GQA/MQA, scale and
non-contiguous (batch, heads, seq, dim) views; float64 to rounding, float32 by flash-attn's rule
against torch's float64 result; dropout against the keep-mask it uses; errors name the argument."""

import inspect
import math

import pytest

torch = pytest.importorskip("torch")

import flashdl  # noqa: E402
import flashdl.torch as fdt  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sdpa = fdt.scaled_dot_product_attention


def bhsd(b, h, s, d, dtype, seed, view):
    """A (b, h, s, d) tensor; view=True makes it a transposed (b, s, h, d) buffer (strided)."""
    g = torch.Generator().manual_seed(seed)
    if view:
        return torch.randn(b, s, h, d, generator=g, dtype=torch.float64).to(dtype).transpose(1, 2)
    return torch.randn(b, h, s, d, generator=g, dtype=torch.float64).to(dtype)


def run(fn, q, k, v, dout, **kw):
    """fn's output and (dq, dk, dv) for the upstream gradient dout."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves, **kw)
    out.backward(dout)
    return [out.detach()] + [x.grad for x in leaves]


def err(a, b):
    return (a.double() - b.double()).abs().max().item()


# float64 forward agrees to rounding; float64 gradients to about float32 precision, because the
# backward rebuilds P from lse, which flashdl's contract keeps in float32 for every dtype.
TOL64 = {"out": 1e-12, "dq": 2e-6, "dk": 2e-6, "dv": 2e-6}


def close64(got, ref):
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert x.shape == r.shape and x.dtype == r.dtype, name
        assert err(x, r) <= TOL64[name] * max(1.0, r.abs().max().item()), name


GRID = [(13, 13), (7, 19), (19, 7), (1, 9), (9, 1)]


@pytest.mark.parametrize("sq,sk", GRID)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,hk,gqa", [(4, 4, False), (4, 2, True), (4, 1, False), (3, 1, True)])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_matches_torch(sq, sk, causal, h, hk, gqa, scale):
    b, d = 2, 16
    kw = dict(is_causal=causal, scale=scale, enable_gqa=gqa)
    q64, k64, v64 = (bhsd(b, n, s, d, torch.float64, i, view=i != 2)
                     for i, (n, s) in enumerate(((h, sq), (hk, sk), (hk, sk))))
    dout64 = bhsd(b, h, sq, d, torch.float64, 7, view=False)
    ref = run(F.scaled_dot_product_attention, q64, k64, v64, dout64, **kw)

    close64(run(sdpa, q64, k64, v64, dout64, **kw), ref)

    # float32: flashdl's error against torch's float64 result within twice torch's own float32
    # error plus a few ulps of the problem's magnitude (flash-attn's acceptance rule). The ulps
    # are of the largest value, not of each gradient: with seq_k 1, dq is exactly 0 in torch but
    # a rounding residue of dout . out - dout . v in flashdl's backward.
    low = [x.float() for x in (q64, k64, v64, dout64)]
    got32 = run(sdpa, *low, **kw)
    torch32 = run(F.scaled_dot_product_attention, *low, **kw)
    eps = 16 * torch.finfo(torch.float32).eps * max([1.0] + [r.abs().max().item() for r in ref])
    for name, x, t, r in zip(("out", "dq", "dk", "dv"), got32, torch32, ref):
        assert x.dtype == torch.float32, name
        assert err(x, r) <= 2 * err(t, r) + eps, name


def test_output_is_view_of_flashdl_layout():
    q, k, v = (bhsd(1, 2, 5, 8, torch.float32, i, view=True) for i in range(3))
    out = sdpa(q, k, v)
    assert out.shape == (1, 2, 5, 8)
    assert out.transpose(1, 2).is_contiguous()  # (b, s, h, d) underneath, as flashdl writes it


def test_strided_last_dim_and_rank3():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 16, generator=g, dtype=torch.float64)[..., ::2]
               for _ in range(3))
    assert err(sdpa(q, k, v, is_causal=True), F.scaled_dot_product_attention(
        q, k, v, is_causal=True)) < 1e-12
    q3, k3, v3 = (x[:, 0].contiguous() for x in (q, k, v))
    dout = torch.ones(2, 6, 8, dtype=torch.float64)
    close64(run(sdpa, q3, k3, v3, dout, is_causal=True),
            run(F.scaled_dot_product_attention, q3, k3, v3, dout, is_causal=True))
    mask = torch.ones(2, 6, 6, dtype=torch.bool)  # (batch, seq_q, seq_k) for rank 3
    assert torch.equal(sdpa(q3, k3, v3, attn_mask=mask), sdpa(q3, k3, v3))


def test_all_true_mask_is_no_mask():
    q, k, v = (bhsd(2, 2, 5, 8, torch.float64, i, view=False) for i in range(3))
    for mask in (torch.ones(5, 5, dtype=torch.bool), torch.ones(2, 1, 1, 5, dtype=torch.bool)):
        assert torch.equal(sdpa(q, k, v, attn_mask=mask), sdpa(q, k, v))


@pytest.mark.parametrize("sq,sk,causal", [(6, 6, False), (5, 9, True), (9, 5, True)])
def test_dropout_uses_flashdl_mask(sq, sk, causal):
    """The output with dropout_p is softmax(top-left masked scores) * keep / (1 - p) @ v with keep
    flashdl.dropout_mask of the seed drawn from torch's generator; gradients match autograd
    through that formula."""
    b, h, d, p = 2, 3, 8, 0.25  # exact in float32, the precision in which the core keeps p
    q = bhsd(b, h, sq, d, torch.float64, 0, view=True)
    k, v = (bhsd(b, h, sk, d, torch.float64, i, view=True) for i in (1, 2))
    dout = bhsd(b, h, sq, d, torch.float64, 3, view=False)
    torch.manual_seed(5)
    seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64).item())
    keep = torch.from_numpy(flashdl.dropout_mask(b, h, sq, sk, p, seed))
    visible = torch.ones(sq, sk, dtype=torch.bool).tril() if causal else None

    def formula(q, k, v, **_):
        s = q @ k.transpose(-1, -2) / math.sqrt(d)
        if visible is not None:
            s = s.masked_fill(~visible, -math.inf)
        return (torch.softmax(s, -1) * keep / (1 - p)) @ v

    torch.manual_seed(5)
    got = run(sdpa, q, k, v, dout, dropout_p=p, is_causal=causal)
    close64(got, run(formula, q, k, v, dout))
    torch.manual_seed(5)
    assert torch.equal(sdpa(q, k, v, dropout_p=p, is_causal=causal), got[0])


def test_signature_is_torchs():
    ours = inspect.signature(sdpa).parameters
    want = [("query", None), ("key", None), ("value", None), ("attn_mask", None),
            ("dropout_p", 0.0), ("is_causal", False), ("scale", None), ("enable_gqa", False)]
    assert [n for n, _ in want] == list(ours)
    for n, default in want[3:]:
        assert ours[n].default == default
    # torch: "The optional scale argument can only be specified as a keyword argument."
    assert ours["scale"].kind == ours["enable_gqa"].kind == inspect.Parameter.KEYWORD_ONLY


def qkv(h=2, hk=2, s=5, d=8, dtype=torch.float32):
    return (bhsd(1, h, s, d, dtype, 0, False), bhsd(1, hk, s, d, dtype, 1, False),
            bhsd(1, hk, s, d, dtype, 2, False))


@pytest.mark.parametrize("kw,exc,match", [
    (dict(attn_mask=torch.zeros(5, 5, dtype=torch.int32)), TypeError, "^attn_mask: expected "
     "dtype torch.bool, torch.float32 or that of query"),
    (dict(attn_mask=torch.ones(4, 5, dtype=torch.bool)), ValueError, "^attn_mask: shape"),
    (dict(attn_mask=torch.ones(3, 1, 5, 5, dtype=torch.bool)), ValueError, "^attn_mask: shape"),
    (dict(attn_mask=[[True]]), TypeError, "^attn_mask"),
    (dict(is_causal=1), TypeError, "^is_causal"),
    (dict(enable_gqa="yes"), TypeError, "^enable_gqa"),  # torch: "must be bool, not str"
    (dict(dropout_p=1.5), ValueError, r"^dropout_p: .* got 1\.5$"),
    (dict(scale="x"), TypeError, "^scale:"),
    (dict(scale=math.inf), ValueError, "^scale:"),
])
def test_errors_name_the_argument(kw, exc, match):
    with pytest.raises(exc, match=match):
        sdpa(*qkv(), **kw)


def test_layout_errors():
    q, k, v = qkv(h=4, hk=2)
    with pytest.raises(ValueError, match="^key: .*enable_gqa=True"):
        sdpa(q, k, v)
    with pytest.raises(ValueError, match="^key: 3 heads"):
        sdpa(*qkv(h=4, hk=3), enable_gqa=True)
    with pytest.raises(ValueError, match="^query: expected rank 4"):
        sdpa(q[0, 0], k, v)
    with pytest.raises(NotImplementedError, match="^value: "):
        sdpa(q, k, v[..., :4], enable_gqa=True)
    with pytest.raises(TypeError, match="^key: expected dtype float32"):
        sdpa(q, k.double(), v, enable_gqa=True)


MASK_DTYPES = [torch.bool, torch.float32, torch.float16, torch.bfloat16, torch.float64,
               torch.int32]


@pytest.mark.parametrize("qdtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_attn_mask_dtypes_accepted_and_refused_as_torch(qdtype):
    """torch's rule: attn_mask is bool, float32 or the dtype of query ("Expected attn_mask dtype
    to be bool or float or to match query dtype"): a float16 mask with a float32 query is
    refused by both; every mask dtype either both accept or both refuse."""
    q, k, v = qkv(dtype=qdtype)
    for mdtype in MASK_DTYPES:
        mask = (torch.ones(5, 5, dtype=mdtype) if mdtype == torch.bool
                else torch.zeros(5, 5).to(mdtype))
        try:
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            torch_ok = True
        except RuntimeError:
            torch_ok = False
        if torch_ok:
            sdpa(q, k, v, attn_mask=mask)
        else:
            with pytest.raises(TypeError, match="^attn_mask: expected dtype"):
                sdpa(q, k, v, attn_mask=mask)
    if qdtype == torch.float32:  # the case that flashdl accepted before
        with pytest.raises(TypeError, match="^attn_mask: expected dtype"):
            sdpa(q, k, v, attn_mask=torch.zeros(5, 5, dtype=torch.float16))
