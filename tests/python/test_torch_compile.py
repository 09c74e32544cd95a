"""flashdl.torch under torch.compile and torch.export: the custom ops flashdl::attention_forward,
attention_backward, attention_varlen_forward and attention_varlen_backward pass
torch.library.opcheck, compiled blocks (fullgraph=True) match eager forward and backward, dropout
seeds drawn in the graph follow torch.manual_seed, and exported programs keep the op.

Most compiles use the aot_eager backend (AOT autograd's graphs run eagerly: the same ops as
eager, so results agree bitwise); one test runs inductor, whose C++ compiles are slow on 2 cores.
"""

import io
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from functorch.compile import make_boxed_func  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402

import flashdl  # noqa: E402
import flashdl.torch as ft  # noqa: E402

OPS = torch.ops.flashdl
FWD, BWD = OPS.attention_forward.default, OPS.attention_backward.default
VFWD, VBWD = OPS.attention_varlen_forward.default, OPS.attention_varlen_backward.default


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def randn(*shape, dtype=torch.float32, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad)


def seed_tensor(seed):
    """A 64-bit seed as the ops take it: a 0-dim int64 tensor, two's complement."""
    return torch.tensor(seed - 2**64 if seed >= 2**63 else seed, dtype=torch.int64)


def options(causal=False, softmax_scale=None, schedule="auto", window_size=(-1, -1),
            dropout_p=0.0, seed=None, offset=0, block_mask=None, block_size=128,
            alibi_slopes=None, softcap=0.0, deterministic=False, bias=None, mask=None,
            sinks=None):
    """The ops' option arguments (after q, k, v and the varlen arguments), in schema order."""
    bs = [block_size] * 2 if isinstance(block_size, int) else list(block_size)
    return (causal, softmax_scale, schedule, list(window_size), dropout_p,
            None if seed is None else seed_tensor(seed), offset, block_mask, bs, alibi_slopes,
            softcap, deterministic, bias, mask, sinks)


# --- opcheck -------------------------------------------------------------------------------------

DENSE = {
    "float32": ((2, 9, 11, 4, 4, 16), torch.float32, dict()),
    "bfloat16 causal window": ((1, 12, 12, 2, 2, 32), torch.bfloat16,
                               dict(causal=True, window_size=(5, 0))),
    "GQA scale alibi softcap": ((2, 7, 10, 4, 2, 16), torch.float32,
                                dict(softmax_scale=0.3, softcap=2.0,
                                     alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]))),
    "dropout fixed seed, block mask": ((1, 20, 24, 2, 1, 8), torch.float32,
                                       dict(dropout_p=0.3, seed=2**64 - 5, offset=3,
                                            block_mask=torch.tensor([[True, False], [True, True]]),
                                            block_size=(16, 16))),
    "bfloat16 dropout deterministic": ((2, 5, 5, 2, 2, 16), torch.bfloat16,
                                       dict(dropout_p=0.5, seed=7, deterministic=True)),
    "GQA causal sinks": ((2, 6, 9, 4, 2, 16), torch.float32,
                         dict(causal=True, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))),
    "bias per head, mask per batch": ((2, 6, 9, 4, 2, 16), torch.float32,
                                      dict(bias=torch.randn(1, 4, 6, 9),
                                           mask=torch.rand(2, 1, 6, 9) > 0.3)),
}


@pytest.mark.parametrize("case", DENSE.values(), ids=DENSE.keys())
@pytest.mark.parametrize("grad", [True, False])
def test_opcheck_dense(case, grad):
    (b, sq, sk, h, hk, d), dtype, kw = case
    q = randn(b, sq, h, d, dtype=dtype, seed=1, grad=grad)
    k, v = (randn(b, sk, hk, d, dtype=dtype, seed=s, grad=grad) for s in (2, 3))
    opts = options(**kw)
    torch.library.opcheck(FWD, (q, k, v) + opts)
    with torch.no_grad():
        out, lse = FWD(q, k, v, *opts)
    dout = randn(*out.shape, dtype=dtype, seed=4, grad=False)
    torch.library.opcheck(BWD, (dout, q.detach(), k.detach(), v.detach(), out, lse) + opts)


VARLEN = {
    "float32 causal": (torch.float32, dict(causal=True)),
    "bfloat16 GQA window": (torch.bfloat16, dict(window_size=(3, 2))),
    "dropout fixed seed": (torch.float32, dict(dropout_p=0.25, seed=99, offset=1)),
    "sinks": (torch.float32, dict(causal=True, sinks=torch.tensor([1.0, -0.5, 0.25, 3.0]))),
    "bias per packed row, mask": (torch.float32, dict(bias=torch.randn(4, 11, 6),
                                                      mask=torch.rand(1, 11, 6) > 0.2)),
}


@pytest.mark.parametrize("case", VARLEN.values(), ids=VARLEN.keys())
def test_opcheck_varlen(case):
    dtype, kw = case
    cu_q = torch.tensor([0, 4, 4, 11], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 9, 15], dtype=torch.int32)
    q = randn(11, 4, 16, dtype=dtype, seed=1)
    k, v = (randn(15, 2, 16, dtype=dtype, seed=s) for s in (2, 3))
    varlen = (cu_q, cu_k, 7, 6)
    opts = options(**kw)
    torch.library.opcheck(VFWD, (q, k, v) + varlen + opts)
    with torch.no_grad():
        out, lse = VFWD(q, k, v, *varlen, *opts)
    assert lse.shape == (4, 11) and lse.dtype == torch.float32
    dout = randn(*out.shape, dtype=dtype, seed=4, grad=False)
    torch.library.opcheck(VBWD, (dout, q.detach(), k.detach(), v.detach(), out, lse) + varlen
                          + opts)


def test_op_rejects_a_bad_seed_tensor():
    q = randn(1, 4, 1, 8, grad=False)
    opts = list(options(dropout_p=0.5))
    opts[5] = torch.tensor(1.0)
    with pytest.raises(ValueError, match=r"^seed: .*int64"):
        FWD(q, q, q, *opts)


# --- eager behaviour of the public functions -----------------------------------------------------

def test_explicit_seeds_are_the_plain_api_bitwise():
    """An int seed (also >= 2**63, which crosses as a negative int64) gives exactly the mask of
    flashdl.attention and attention_backward with that seed."""
    q, k, v = (randn(2, 13, 2, 16, seed=s) for s in range(3))
    dout = randn(2, 13, 2, 16, seed=5, grad=False)
    for seed in (0, 12345, 2**63, 2**64 - 1):
        opts = dict(dropout_p=0.4, seed=seed, offset=9, causal=True)
        out = ft.attention(q, k, v, **opts)
        out.backward(dout)
        with torch.no_grad():
            want, lse = flashdl.attention(q, k, v, return_lse=True, **opts)
        grads = flashdl.attention_backward(dout, q, k, v, want, lse, **opts)
        assert torch.equal(out.detach(), want)
        for x, g in zip((q, k, v), grads):
            assert torch.equal(x.grad, g)
            x.grad = None


def test_drawn_seed_is_torch_randint_of_the_device_generator():
    """seed None: the seed is torch.randint(0, 2**63 - 1) of q's device generator (the CPU one
    here), so torch.manual_seed fixes it, and the generator advances by that one draw."""
    q, k, v = (randn(1, 10, 2, 8, seed=s) for s in range(3))
    torch.manual_seed(21)
    out = ft.attention(q, k, v, dropout_p=0.5)
    after = torch.rand(4)
    torch.manual_seed(21)
    seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))
    assert torch.equal(torch.rand(4), after)
    with torch.no_grad():
        assert torch.equal(out.detach(), flashdl.attention(q, k, v, dropout_p=0.5, seed=seed))
    # no dropout: nothing is drawn
    torch.manual_seed(21)
    ft.attention(q, k, v)
    untouched = torch.rand(4)
    torch.manual_seed(21)
    assert torch.equal(untouched, torch.rand(4))


def test_numpy_arguments_and_read_only_arrays():
    """NumPy block masks, slopes and cu_seqlens still work (as tensors without a copy, or with one
    for read-only arrays, which torch cannot wrap: no warning)."""
    q, k, v = (randn(1, 32, 2, 8, seed=s) for s in range(3))
    mask = np.tril(np.ones((2, 2), bool))
    slopes = np.array([0.5, 0.25], np.float32)
    frozen_mask, frozen_slopes = mask.copy(), slopes.copy()
    frozen_mask.flags.writeable = frozen_slopes.flags.writeable = False
    kw = dict(block_size=16, causal=True)
    want = ft.attention(q, k, v, block_mask=torch.from_numpy(mask),
                        alibi_slopes=torch.from_numpy(slopes), **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for m, s in ((mask, slopes), (frozen_mask, frozen_slopes)):
            assert torch.equal(ft.attention(q, k, v, block_mask=m, alibi_slopes=s, **kw), want)
        cu = np.array([0, 32], np.int32)
        cu.flags.writeable = False
        got = ft.attention_varlen(q[0], k[0], v[0], cu, cu, 32, 32, block_mask=mask,
                                  alibi_slopes=slopes, **kw)
    assert torch.equal(got, want[0])


def test_framework_errors_name_the_argument():
    q = randn(1, 4, 1, 8, grad=False)
    with pytest.raises(ValueError, match=r"^k: expected an array of the same framework as q"):
        ft.attention(q, q.numpy(), q)
    with pytest.raises(TypeError, match=r"^q: expected a torch\.Tensor .*flashdl\.attention\b"):
        ft.attention(*(q.numpy(),) * 3)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"^q: expected a torch\.Tensor .*attention_varlen"):
        ft.attention_varlen(*(q[0].numpy(),) * 3, cu, cu, 4, 4)
    with pytest.raises(TypeError, match=r"^v: expected an array"):
        ft.attention_varlen(q[0], q[0], 3, cu, cu, 4, 4)
    with pytest.raises(ValueError, match=r"^window_size: "):
        ft.attention(q, q, q, window_size=(2**63, 0))
    with pytest.raises(ValueError, match=r"^max_seqlen_k: "):
        ft.attention_varlen(q[0], q[0], q[0], cu, cu, 4, 2**64)


# --- torch.compile -----------------------------------------------------------------------------

class Block(torch.nn.Module):
    """q, k, v projections -> flashdl.torch.attention -> output projection (GQA: 4 heads, 2 kv)."""

    def __init__(self, dim=32, heads=4, kv_heads=2, **attn):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.attn = heads, kv_heads, dim // heads, attn
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.head_dim)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.head_dim).unbind(2)
        return self.o(ft.attention(q, k, v, **self.attn).reshape(b, n, -1))


def make_block(**attn):
    torch.manual_seed(0)
    return Block(**attn), torch.randn(2, 12, 32)


def step(model, x, manual_seed=5):
    """Forward and backward of a squared-sum loss: [out, every parameter's grad]."""
    torch.manual_seed(manual_seed)
    for p in model.parameters():
        p.grad = None
    y = model(x)
    y.square().sum().backward()
    return [y.detach()] + [p.grad.clone() for p in model.parameters()]


def recording_backend(graphs):
    """aot_eager that also keeps the forward and backward graphs AOT autograd made."""
    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)
    return aot_autograd(fw_compiler=keep, bw_compiler=keep)


def calls(graphs, op):
    return [n for gm in graphs for n in gm.graph.nodes if n.target is op]


def assert_close(got, want, tol=1e-6):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


ATTN = {
    "causal": dict(causal=True),
    "window deterministic": dict(window_size=(4, 1), deterministic=True),
    "dropout fixed seed": dict(dropout_p=0.3, seed=11, offset=2),
    "dropout drawn seed": dict(dropout_p=0.3),
}


@pytest.mark.parametrize("attn", ATTN.values(), ids=ATTN.keys())
def test_compiled_block_matches_eager(attn):
    model, x = make_block(**attn)
    want = step(model, x)
    after_eager = torch.rand(3)  # the generator's state after the eager step
    graphs = []
    compiled = torch.compile(model, backend=recording_backend(graphs), fullgraph=True)
    got = step(compiled, x)
    after_compiled = torch.rand(3)
    # forward and backward graphs hold one op each (fullgraph: nothing broke the graph)
    (bwd,) = calls(graphs, BWD)
    assert len(calls(graphs, FWD)) == 1
    assert bwd.args[-4] is bool(attn.get("deterministic", False))
    if "dropout_p" in attn and "seed" not in attn:
        # the seed is drawn in the graph, from the CPU generator, as eager draws it
        assert any(n.target is torch.ops.aten.randint.low for gm in graphs
                   for n in gm.graph.nodes)
    assert_close(got, want)
    assert torch.equal(after_compiled, after_eager)
    if "dropout_p" in attn and "seed" not in attn:  # another torch seed, another mask
        assert not torch.equal(step(compiled, x, manual_seed=6)[0], want[0])


def test_compiled_return_lse_and_sum_gradient():
    """(out, lse) under compile: lse without gradient; out.sum() gives a stride-0 gradient."""
    q, k, v = (randn(1, 9, 2, 16, seed=s) for s in range(3))

    def f(q, k, v):
        out, lse = ft.attention(q, k, v, causal=True, return_lse=True)
        return out, lse

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    res = []
    for fn in (f, compiled):
        out, lse = fn(q, k, v)
        assert not lse.requires_grad and out.requires_grad
        out.sum().backward()
        res.append([out.detach(), lse] + [x.grad.clone() for x in (q, k, v)])
        for x in (q, k, v):
            x.grad = None
    assert_close(res[1], res[0])


@pytest.mark.parametrize("attn", [dict(causal=True, softcap=3.0),
                                  dict(dropout_p=0.25), dict(dropout_p=0.25, seed=3)],
                         ids=["causal softcap", "dropout drawn seed", "dropout fixed seed"])
def test_compiled_varlen_matches_eager(attn):
    cu_q = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 10, 17], dtype=torch.int32)
    proj = torch.nn.Linear(16, 16)
    q = randn(12, 4, 16, seed=1)
    k, v = (randn(17, 2, 16, seed=s) for s in (2, 3))

    def f(q, k, v):
        return proj(ft.attention_varlen(q, k, v, cu_q, cu_k, 7, 7, **attn)).sum()

    graphs = []
    compiled = torch.compile(f, backend=recording_backend(graphs), fullgraph=True)
    res = []
    for fn in (f, compiled):
        torch.manual_seed(8)
        loss = fn(q, k, v)
        loss.backward()
        res.append([loss.detach()] + [x.grad.clone() for x in (q, k, v, proj.weight)])
        for x in (q, k, v, proj.weight, proj.bias):
            x.grad = None
    assert len(calls(graphs, VFWD)) == 1 and len(calls(graphs, VBWD)) == 1
    assert_close(res[1], res[0])


def test_compiled_numpy_arguments():
    """NumPy block_mask and alibi_slopes trace too (Dynamo turns torch.from_numpy into a tensor)."""
    q, k, v = (randn(1, 32, 2, 8, seed=s) for s in range(3))
    mask = np.tril(np.ones((2, 2), bool))
    slopes = np.array([0.5, 0.25], np.float32)

    def f(q, k, v):
        return ft.attention(q, k, v, block_mask=mask, block_size=16, alibi_slopes=slopes)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v), f(q, k, v))


def test_compiled_drop_ins():
    """The flash-attn and SDPA drop-ins go through the same ops: fullgraph with dropout too."""
    from flashdl.flash_attn import flash_attn_func

    q, k, v = (randn(1, 9, 2, 16, seed=s) for s in range(3))
    fns = [lambda q, k, v: flash_attn_func(q, k, v, dropout_p=0.2, causal=True),
           lambda q, k, v: ft.scaled_dot_product_attention(
               *(x.transpose(1, 2) for x in (q, k, v)), dropout_p=0.2, is_causal=True)]
    for f in fns:
        graphs = []
        compiled = torch.compile(f, backend=recording_backend(graphs), fullgraph=True)
        res = []
        for fn in (f, compiled):
            torch.manual_seed(4)
            out = fn(q, k, v)
            out.sum().backward()
            res.append([out.detach()] + [x.grad.clone() for x in (q, k, v)])
            for x in (q, k, v):
                x.grad = None
        assert calls(graphs, FWD) and calls(graphs, BWD)
        assert_close(res[1], res[0])


# inductor's own code calls the deprecated torch.jit.script_method (torch 2.13)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_inductor_block_with_dropout():
    """Inductor, fullgraph, forward and backward, dropout with seed None. With fallback_random
    the seed comes from torch's generator as in eager, so the results match eager; by default
    inductor draws it with its own generator (seeded from torch's, so torch.manual_seed still
    repeats it) and the masks differ from eager's."""
    import torch._inductor.config as inductor_config

    model, x = make_block(dropout_p=0.3, causal=True)
    want = step(model, x)
    with inductor_config.patch(fallback_random=True):
        got = step(torch.compile(model, fullgraph=True), x)
    assert_close(got, want, 1e-5)

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    first, again, other = step(compiled, x), step(compiled, x), step(compiled, x, manual_seed=6)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0])


# --- torch.export ------------------------------------------------------------------------------

def test_export_keeps_the_op():
    model, x = make_block(causal=True, softcap=5.0)
    model.eval()
    seq = torch.export.Dim("seq", min=2, max=64)
    exported = torch.export.export(model, (x,), dynamic_shapes=({1: seq},))
    nodes = [n for n in exported.graph.nodes if n.target is FWD]
    assert len(nodes) == 1 and nodes[0].args[3] is True  # causal
    for n in (12, 29):
        y = torch.randn(2, n, 32)
        with torch.no_grad():
            assert torch.equal(exported.module()(y), model(y))
    # and through serialisation (loading needs flashdl.torch imported: the op's registration)
    buf = io.BytesIO()
    torch.export.save(exported, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    assert [n for n in loaded.graph.nodes if n.target is FWD]
    with torch.no_grad():
        assert torch.equal(loaded.module()(x), model(x))
