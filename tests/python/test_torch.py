"""PyTorch: results are torch tensors; flashdl.torch.attention's autograd matches SDPA's."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import flashdl  # noqa: E402
import flashdl.torch  # noqa: E402
from attn_oracle import assert_lse, assert_rule, forward, fwd_ulps  # noqa: E402


def randn(*shape, dtype=torch.float32, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(
        kw.get("requires_grad", False))


def sdpa(q, k, v, causal):
    """SDPA in (b, s, h, d) layout; is_causal is top-left aligned, so only for sq == sk."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_forward_returns_torch_tensors(dtype):
    q, k, v = (randn(2, 9, 4, 16, dtype=dtype, seed=s) for s in range(3))
    before = [x.clone() for x in (q, k, v)]
    out, lse = flashdl.attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.device == q.device
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32 and lse.shape == (2, 4, 9)
    name = str(dtype).split(".")[1]
    as_np = [x.double().numpy() for x in (q, k, v)]
    o_ref, lse_ref = forward(*as_np, causal=True)
    o_low, _ = forward(*as_np, causal=True, dtype=name, exact=False)
    assert_rule(out.double().numpy(), o_ref, o_low, name, ulps=fwd_ulps(name, q, k))
    assert_lse(lse.numpy(), lse_ref)
    for x, y in zip((q, k, v), before):
        assert torch.equal(x, y)


@pytest.mark.parametrize("schedule", ["fa1", "fa2", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal,shape", [
    (False, (2, 13, 21, 4, 4, 32)),
    (False, (1, 17, 9, 6, 2, 16)),    # GQA
    (True, (2, 19, 19, 4, 1, 64)),    # MQA, seqlen_q == seqlen_k (SDPA is top-left aligned)
    (True, (1, 1, 1, 2, 2, 8)),
])
def test_autograd_matches_sdpa(schedule, dtype, causal, shape):
    b, sq, sk, h, hk, d = shape
    leaves = [randn(b, n, hh, d, dtype=dtype, seed=i, requires_grad=True)
              for i, (n, hh) in enumerate(((sq, h), (sk, hk), (sk, hk)))]
    w = randn(b, sq, h, d, dtype=dtype, seed=9)

    out = flashdl.torch.attention(*leaves, causal=causal, schedule=schedule)
    (out * w).sum().backward()
    got = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    ref = sdpa(*leaves, causal)
    (ref * w).sum().backward()

    # float64: the core's softmax scale and lse are float32 (see attn_oracle.EPS)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.detach(), ref.detach(), **tol)
    for name, g, x in zip(("dq", "dk", "dv"), got, leaves):
        torch.testing.assert_close(g, x.grad, **tol, msg=lambda m: f"{name}: {m}")


def test_sum_loss_broadcast_gradient():
    """out.sum() hands backward a gradient with every stride 0."""
    q, k, v = (randn(1, 7, 2, 8, seed=s, requires_grad=True) for s in range(3))
    flashdl.torch.attention(q, k, v).sum().backward()
    got = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    sdpa(q, k, v, False).sum().backward()
    for g, x in zip(got, (q, k, v)):
        torch.testing.assert_close(g, x.grad, rtol=1e-4, atol=1e-5)


def test_strided_views():
    """(b, h, s, d) tensors transposed to (b, s, h, d): no copy, same result; gradients too."""
    q, k, v = (randn(2, 4, 11, 16, seed=s, requires_grad=True) for s in range(3))
    views = [x.transpose(1, 2) for x in (q, k, v)]
    assert not views[0].is_contiguous()
    out = flashdl.torch.attention(*views, causal=True)
    out.square().sum().backward()
    got = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for g, x in zip(got, (q, k, v)):
        torch.testing.assert_close(g, x.grad, rtol=1e-4, atol=1e-5)


def test_plain_api_and_tensors_that_require_grad():
    """flashdl.attention refuses them while grad mode is on (its result would silently cut the
    graph; test_errors checks the message) and takes them under torch.no_grad; the backward, whose
    gradients are explicit results, takes them either way."""
    q, k, v = (randn(1, 5, 2, 8, seed=s, requires_grad=True) for s in range(3))
    with pytest.raises(ValueError, match=r"^q: .*flashdl\.torch\.attention"):
        flashdl.attention(q, k, v)
    with torch.no_grad():
        out, lse = flashdl.attention(q, k, v, return_lse=True)
    assert not out.requires_grad
    dq, dk, dv = flashdl.attention_backward(torch.ones_like(out), q, k, v, out, lse)
    assert dq.shape == q.shape and isinstance(dk, torch.Tensor)


def test_backward_errors_name_the_argument():
    q, k, v = (randn(1, 5, 2, 8, seed=s) for s in range(3))
    out, lse = flashdl.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"\blse\b"):
        flashdl.attention_backward(torch.ones_like(out), q, k, v, out, lse[:, :1])
    with pytest.raises(ValueError, match=r"\bk\b"):
        flashdl.attention(q, np.asarray(k), v)


def test_fast_path_default_options(monkeypatch):
    """flashdl.torch.attention with default options on plain CPU tensors that need no autograd
    takes flashdl.attention's fast path (no op call): the same results bit for bit as the op,
    and the op wherever an option, autograd, a mode or a transform needs it."""
    from flashdl import _api

    import flashdl.torch as fdt

    def no_op(*args, **kwargs):
        raise AssertionError("the op ran")

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 9, 2, 16, generator=gen) for _ in range(3))
    for dt in (torch.float32, torch.bfloat16):
        qd, kd, vd = (x.to(dt) for x in (q, k, v))
        for causal in (False, True):
            with monkeypatch.context() as m:
                m.setattr(fdt, "_call", no_op)
                fast = fdt.attention(qd, kd, vd, causal=causal, return_lse=True)
            with monkeypatch.context() as m:
                m.setattr(_api, "_fast_forward_torch", lambda *a: None)
                full = fdt.attention(qd, kd, vd, causal=causal, return_lse=True)
            for a, b in zip(fast, full):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    with monkeypatch.context() as m:
        m.setattr(fdt, "_call", no_op)
        for kwargs in ({"softmax_scale": 0.5}, {"window_size": (2, 0)}, {"schedule": "fa2"},
                       {"dropout_p": 0.1}, {"softcap": 1.0}, {"layout": "bhsd"}, {"seed": 3},
                       {"block_size": 64}, {"deterministic": True}):
            with pytest.raises(AssertionError, match="the op ran"):
                fdt.attention(q, k, v, **kwargs)
        with pytest.raises(AssertionError, match="the op ran"):
            fdt.attention(q.clone().requires_grad_(), k, v)  # autograd
        # Defaults spelled out by the caller (other objects than the signature's: the fast path
        # tests those by identity first, then by value) still take the fast path.
        fdt.attention(q, k, v, dropout_p=float("0"), softcap=float("0"), window_size=tuple([-1, -1]),
                      offset=int("0"), block_size=int("128"), schedule="".join(["au", "to"]),
                      layout="".join(["bs", "hd"]), deterministic=False, return_lse=False)
        with pytest.raises(TypeError, match="causal"):  # not a bool: the full path's refusal
            fdt.attention(q, k, v, causal=1)
        with pytest.raises(AssertionError, match="the op ran"):
            torch.func.vmap(lambda x: fdt.attention(x, k, v))(torch.stack([q, q]))
        with torch.no_grad():  # no autograd needed, but the fast path wants no grad flags at all
            with pytest.raises(AssertionError, match="the op ran"):
                fdt.attention(q.clone().requires_grad_(), k, v)
        # What the fast path leaves to the core: a refusal there takes the op (the full path).
        for args in ((q, k.double(), v), (q, k[:, :3], v), (q.int(), k, v)):
            with pytest.raises(AssertionError, match="the op ran"):
                fdt.attention(*args)
    # A strided q: the fast path's output is contiguous, equal to the op's.
    qs = torch.randn(1, 2, 9, 16, generator=gen).transpose(1, 2)
    fast = fdt.attention(qs, k, v)
    with monkeypatch.context() as m:
        m.setattr(_api, "_fast_forward_torch", lambda *a: None)
        full = fdt.attention(qs, k, v)
    assert fast.is_contiguous() and torch.equal(fast, full)
    with pytest.raises(TypeError, match=r"^q: expected a torch\.Tensor"):
        fdt.attention(*(q.numpy(),) * 3)  # NumPy: refused, not run by flashdl.attention's path


def test_eager_forward_dispatch_only_when_something_intercepts():
    """flashdl.torch's forward ops run their implementation directly when nothing would see the
    op (a tiny call's dispatch costs more than its work), and go through torch's dispatcher when
    autograd, a dispatch mode, a tensor subclass or a functorch transform would: same results."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from flashdl.torch import _dispatch_free

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 16, 2, 16, generator=gen) for _ in range(3))
    qg = q.clone().requires_grad_()
    assert _dispatch_free((q, k, v)) and not _dispatch_free((qg, k, v))
    with torch.no_grad():
        assert _dispatch_free((qg, k, v))
    assert not _dispatch_free((torch.nn.Parameter(q, requires_grad=False), k, v))  # a subclass

    plain = flashdl.torch.attention(q, k, v, causal=True)
    with Log() as log:
        assert not _dispatch_free((q, k, v))
        logged = flashdl.torch.attention(q, k, v, causal=True)
    assert any("flashdl.attention_forward" in op for op in log.ops), log.ops
    assert torch.equal(plain, logged)
    out = flashdl.torch.attention(qg, k, v, causal=True)
    assert out.grad_fn is not None and torch.equal(out.detach(), plain)
    with torch.no_grad():
        assert flashdl.torch.attention(qg, k, v, causal=True).grad_fn is None
    # Under vmap the op is dispatched (torch's batching fallback runs it per element).
    q2 = torch.stack([q, q.flip(1)])
    mapped = torch.func.vmap(lambda x: flashdl.torch.attention(x, k, v, causal=True))(q2)
    assert torch.equal(mapped[0], plain)
    assert torch.equal(mapped[1], flashdl.torch.attention(q.flip(1), k, v, causal=True))
