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
    from flashdl import _fast_path, _torch_attention, _torch_eager

    import flashdl.torch as fdt

    def no_op(*args, **kwargs):
        raise AssertionError("the op ran")

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 9, 2, 16, generator=gen) for _ in range(3))
    for dt in (torch.float32, torch.bfloat16):
        qd, kd, vd = (x.to(dt) for x in (q, k, v))
        for causal in (False, True):
            with monkeypatch.context() as m:
                m.setattr(_torch_attention, "call", no_op)
                fast = fdt.attention(qd, kd, vd, causal=causal, return_lse=True)
            with monkeypatch.context() as m:
                m.setattr(_fast_path, "forward_torch", lambda *a: None)
                full = fdt.attention(qd, kd, vd, causal=causal, return_lse=True)
            for a, b in zip(fast, full):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    with monkeypatch.context() as m:
        m.setattr(_torch_attention, "call", no_op)
        m.setattr(_torch_eager, "EAGER_PATH", False)  # (else the eager path runs what it declines)
        for kwargs in ({"softmax_scale": 0.5}, {"window_size": (2, 0)}, {"schedule": "fa2"},
                       {"dropout_p": 0.1}, {"softcap": 1.0}, {"seed": 3},
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
        with pytest.raises(TypeError, match="window_size"):  # == (-1, -1), but not ints
            fdt.attention(q, k, v, window_size=(-1.0, -1.0))
        with pytest.raises(AssertionError, match="the op ran"):
            torch.func.vmap(lambda x: fdt.attention(x, k, v))(torch.stack([q, q]))
        with torch.no_grad():  # no autograd needed, but the fast path wants no grad flags at all
            with pytest.raises(AssertionError, match="the op ran"):
                fdt.attention(q.clone().requires_grad_(), k, v)
        # What the fast path leaves to the core: a refusal there takes the op (the full path).
        for args in ((q, k.double(), v), (q, k[:, :3], v), (q.int(), k, v)):
            with pytest.raises(AssertionError, match="the op ran"):
                fdt.attention(*args)
    # SDPA's layout takes the fast path too (on transposed views), with the op's results.
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    with monkeypatch.context() as m:
        m.setattr(_torch_attention, "call", no_op)
        m.setattr(_torch_eager, "EAGER_PATH", False)
        fast = fdt.attention(qh, kh, vh, causal=True, layout="bhsd", return_lse=True)
    with monkeypatch.context() as m:
        m.setattr(_fast_path, "forward_torch", lambda *a: None)
        m.setattr(_torch_eager, "EAGER_PATH", False)
        full = fdt.attention(qh, kh, vh, causal=True, layout="bhsd", return_lse=True)
    for a, b in zip(fast, full):
        assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
    with pytest.raises(ValueError, match="layout='bhsd'"):
        fdt.attention(q[0], k[0], v[0], layout="bhsd")  # rank 3: the full path's refusal
    # A strided q: the fast path's output is contiguous, equal to the op's.
    qs = torch.randn(1, 2, 9, 16, generator=gen).transpose(1, 2)
    fast = fdt.attention(qs, k, v)
    with monkeypatch.context() as m:
        m.setattr(_fast_path, "forward_torch", lambda *a: None)
        full = fdt.attention(qs, k, v)
    assert fast.is_contiguous() and torch.equal(fast, full)
    with pytest.raises(TypeError, match=r"^q: expected a torch\.Tensor"):
        fdt.attention(*(q.numpy(),) * 3)  # NumPy: refused, not run by flashdl.attention's path


def test_eager_forward_dispatch_only_when_something_intercepts():
    """flashdl.torch's forward ops run their implementation directly when nothing would see the
    op (a tiny call's dispatch costs more than its work), and go through torch's dispatcher when
    autograd, a dispatch mode, a tensor subclass or a functorch transform would: same results."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from flashdl._torch_ops import dispatch_free as _dispatch_free

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


# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, dtype) and attention's keywords; "bias",
# "sinks" and "alibi" stand for tensors made by _eager_case (bias and sinks with gradients).
EAGER_CASES = {
    "plain": ((1, 16, 16, 8, 8, 64, torch.float32), {}),
    "causal": ((2, 21, 37, 2, 2, 16, torch.float32), dict(causal=True)),
    "dropout fixed seed and offset": ((1, 19, 23, 2, 2, 32, torch.float32),
                                      dict(dropout_p=0.25, seed=2**63 + 5, offset=3)),
    "dropout drawn seed": ((1, 9, 9, 2, 1, 16, torch.float32), dict(dropout_p=0.3)),
    "gqa window scale": ((2, 30, 30, 4, 2, 16, torch.float32),
                         dict(window_size=(5, 2), softmax_scale=0.3, schedule="fa2")),
    "bias mask sinks": ((2, 12, 20, 4, 2, 16, torch.float32),
                        dict(bias="bias", mask="mask", sinks="sinks")),
    "bhsd softcap alibi": ((1, 13, 17, 4, 4, 32, torch.float32),
                           dict(layout="bhsd", softcap=5.0, alibi_slopes="alibi", causal=True)),
    "bhsd defaults causal": ((2, 13, 17, 4, 2, 32, torch.float32),
                             dict(layout="bhsd", causal=True)),
    "bfloat16 causal return_lse": ((1, 40, 40, 2, 2, 64, torch.bfloat16),
                                   dict(causal=True, return_lse=True)),
    "float64 block mask": ((1, 33, 40, 2, 2, 16, torch.float64),
                           dict(block_mask="blocks", block_size=16)),
}


def _eager_case(shape, kwargs):
    """Leaf tensors q, k, v (and bias, sinks) that require grad, and attention's keywords."""
    b, sq, sk, h, hk, d, dt = shape
    bhsd = kwargs.get("layout") == "bhsd"
    q = randn(*((b, h, sq, d) if bhsd else (b, sq, h, d)), dtype=dt, seed=1, requires_grad=True)
    k, v = (randn(*((b, hk, sk, d) if bhsd else (b, sk, hk, d)), dtype=dt, seed=s,
                  requires_grad=True) for s in (2, 3))
    made = {"bias": randn(1, h, sq, sk, seed=4, requires_grad=True),
            "mask": torch.rand(b, 1, sq, sk, generator=torch.Generator().manual_seed(5)) > 0.2,
            "sinks": randn(h, seed=6, requires_grad=True),
            "alibi": torch.linspace(0.1, 1.0, h),
            "blocks": torch.tensor([[True, False, True], [True, True, False], [False, True, True]])}
    kwargs = {n: made[x] if isinstance(x, str) and x in made else x for n, x in kwargs.items()}
    return (q, k, v), kwargs


def _run_attention(leaves, kwargs, path_is_eager, monkeypatch):
    """out, lse (with return_lse) and every leaf's gradient, by the eager path or the ops."""
    import flashdl.torch as fdt
    from flashdl import _torch_attention, _torch_eager

    def no_op(*args, **kw):
        raise AssertionError("the op ran")

    leaves = [x.detach().clone().requires_grad_(x.requires_grad) for x in leaves]
    q, k, v = leaves[:3]
    kw = dict(kwargs)
    for name in ("bias", "sinks"):
        if name in kw:
            kw[name] = leaves[3 + ("bias", "sinks").index(name)]
    with monkeypatch.context() as m:
        if path_is_eager:
            m.setattr(_torch_attention, "call", no_op)
        else:
            m.setattr(_torch_eager, "EAGER_PATH", False)
        torch.manual_seed(123)  # the drawn seed's case
        res = fdt.attention(q, k, v, **kw)
        out, lse = res if kw.get("return_lse") else (res, None)
        dout = randn(*out.shape, dtype=out.dtype, seed=9)
        grads = torch.autograd.grad(out, [x for x in leaves if x.requires_grad], dout)
    return [out, lse] + list(grads)


@pytest.mark.parametrize("case", EAGER_CASES.values(), ids=EAGER_CASES.keys())
def test_eager_path_is_the_ops_bitwise(case, monkeypatch):
    """Outside compilation flashdl.torch.attention is a plain autograd.Function over the
    extension (no op runs), with the same outputs and gradients as the custom ops, bit for bit."""
    (q, k, v), kwargs = _eager_case(*case)
    leaves = [q, k, v] + [kwargs[n] for n in ("bias", "sinks") if n in kwargs]
    eager = _run_attention(leaves, kwargs, True, monkeypatch)
    ops = _run_attention(leaves, kwargs, False, monkeypatch)
    assert len(eager) == len(ops) == 2 + len(leaves)
    for a, b in zip(eager, ops):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            assert torch.equal(a, b)
    assert all(g.abs().sum() > 0 for g in eager[2:])  # (every gradient computed)


def test_eager_path_autograd_rules():
    """The eager path's autograd: no gradient without requires_grad, lse without gradient, an
    in-place change of a saved input caught, double backward refused, errors worded as the ops'
    (the heads-first layout hint included)."""
    q, k, v = (randn(1, 6, 2, 8, seed=s, requires_grad=True) for s in range(3))
    out, lse = flashdl.torch.attention(q, k, v, causal=True, softcap=2.0, return_lse=True)
    assert out.grad_fn is not None and lse.grad_fn is None and not lse.requires_grad
    with torch.no_grad():
        assert flashdl.torch.attention(q, k, v, softcap=2.0).grad_fn is None
    assert flashdl.torch.attention(q.detach(), k.detach(), v.detach(),
                                   softcap=2.0).grad_fn is None
    # only k requires grad: dq and dv are not computed for the caller
    kg = k.detach().clone().requires_grad_()
    (dk,) = torch.autograd.grad(flashdl.torch.attention(q.detach(), kg, v.detach()).sum(), kg)
    assert dk.shape == k.shape
    x = q.detach().clone().requires_grad_()
    y = x * 1
    out = flashdl.torch.attention(y, k, v, softcap=2.0)
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    out = flashdl.torch.attention(q, k, v, softcap=2.0)
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dq.sum().backward()
    with pytest.raises(ValueError, match="layout='bhsd'"):
        flashdl.torch.attention(q, k.transpose(1, 2), v.transpose(1, 2), softcap=2.0)
    with pytest.raises(TypeError, match="negative bit"):
        flashdl.torch.attention(torch._neg_view(q.detach()), k, v, softcap=2.0)


def test_eager_path_undefined_out_gradient(monkeypatch):
    """A gradient of out that autograd leaves undefined (a Function downstream returns None) gives
    zero gradients on the eager path, as the ops' autograd gives them (not None)."""
    from flashdl import _torch_eager

    class Cut(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return None

    for layout in ("bshd", "bhsd"):
        got = []
        for eager in (True, False):
            monkeypatch.setattr(_torch_eager, "EAGER_PATH", eager)
            q, k, v = (randn(1, 6, 2, 8, seed=s, requires_grad=True) for s in range(3))
            out = flashdl.torch.attention(q, k, v, causal=True, layout=layout)
            loss = Cut.apply(out).sum() + q.sum()
            got.append(torch.autograd.grad(loss, (q, k, v), allow_unused=True))
        for a, b in zip(*got):
            assert a is not None and b is not None and torch.equal(a, b)
        assert torch.equal(got[0][1], torch.zeros_like(got[0][1]))


def test_compile_export_and_modes_take_the_ops():
    """torch.compile, torch.export, make_fx and dispatch modes see the custom ops (forward and
    backward), not the eager path's Function."""
    from torch.fx.experimental.proxy_tensor import make_fx

    ops = torch.ops.flashdl
    q, k, v = (randn(1, 8, 2, 16, seed=s, requires_grad=True) for s in range(3))

    def f(q, k, v):
        return flashdl.torch.attention(q, k, v, causal=True)

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        compiled = torch.compile(f, backend=backend, fullgraph=True)
        got = compiled(q, k, v)
    finally:
        torch._dynamo.reset()
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes]
    assert any("flashdl.attention_forward" in t for t in targets), targets
    assert torch.equal(got, f(q, k, v))

    class Block(torch.nn.Module):
        def forward(self, q, k, v):
            return f(q, k, v)

    exported = torch.export.export(Block(), (q.detach(), k.detach(), v.detach()))
    assert any(n.target is ops.attention_forward.default for n in exported.graph.nodes)

    gm = make_fx(lambda q, k, v: torch.autograd.grad(f(q, k, v).sum(), (q, k, v)))(q, k, v)
    targets = [n.target for n in gm.graph.nodes]
    assert ops.attention_forward.default in targets and ops.attention_backward.default in targets
