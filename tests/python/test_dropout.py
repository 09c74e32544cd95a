"""Dropout: the keep-mask (flashdl.dropout_mask, the core's own Philox generator) is what fa1, fa2
and the reference apply, forward and backward, for a given (dropout_p, seed, offset); kept values
are scaled by 1 / (1 - p); lse is of the undropped scores; p = 0 is no dropout, bit for bit."""

import re

import numpy as np
import pytest

import flashdl
import masked_oracle as mo
from attn_oracle import assert_lse, make, make_qkv

SCHEDULES = ["fa1", "fa2", "reference"]
# float64 results of fa1/fa2 are float32-accurate in the softmax (see attn_oracle.EPS). The
# float64 cases pass a softmax_scale exact in float32 so that the oracle's scale is the core's.
SCALE = 0.1875
F64_TOL = {"fa1": 2e-6, "fa2": 2e-6, "reference": 1e-10}


def run(q, k, v, schedule, dout=None, **kw):
    out, lse = flashdl.attention(q, k, v, schedule=schedule, return_lse=True, **kw)
    if dout is None:
        return out, lse
    return (out, lse) + flashdl.attention_backward(dout, q, k, v, out, lse, schedule=schedule,
                                                   **kw)


def keep_of(q, k, p, seed, offset=0):
    b, sq, h, _ = q.shape
    return flashdl.dropout_mask(b, h, sq, k.shape[1], p, seed, offset)


def close(got, want, tol, what):
    got = np.asarray(got, dtype=np.float64)
    assert not np.isnan(got).any(), f"{what}: NaN"
    mag = max(1.0, float(np.max(np.abs(want), initial=0.0)))
    err = float(np.max(np.abs(got - want), initial=0.0))
    assert err <= tol * mag, f"{what}: max error {err:.3e} > {tol:.1e} * {mag:.3g}"


# --- the mask itself ---------------------------------------------------------------------------

@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction(p):
    keep = flashdl.dropout_mask(2, 4, 512, 512, p, seed=1234)
    assert keep.shape == (2, 4, 512, 512) and keep.dtype == np.bool_
    assert abs(keep.mean() - (1 - p)) <= 0.01
    # and no (batch, head) slice is a copy of another: the head index enters the counter
    flat = keep.reshape(8, -1)
    assert all(not np.array_equal(flat[0], flat[i]) for i in range(1, 8))


def test_seed_and_offset_select_the_mask():
    m = flashdl.dropout_mask(2, 3, 33, 65, 0.5, seed=7)
    assert np.array_equal(m, flashdl.dropout_mask(2, 3, 33, 65, 0.5, seed=7))
    assert np.array_equal(m, flashdl.dropout_mask(2, 3, 33, 65, 0.5, seed=7, offset=0))
    for other in (flashdl.dropout_mask(2, 3, 33, 65, 0.5, seed=8),
                  flashdl.dropout_mask(2, 3, 33, 65, 0.5, seed=7 + 2**32),  # high seed bits count
                  flashdl.dropout_mask(2, 3, 33, 65, 0.5, seed=7, offset=1),
                  flashdl.dropout_mask(2, 3, 33, 65, 0.5, seed=7, offset=2**31)):
        assert 0.3 < np.mean(m != other) < 0.7  # independent-looking, not a shift of m


def test_mask_is_a_function_of_the_element_only():
    """A sub-problem sees the top-left corner of a bigger one's mask: no dependence on shapes."""
    big = flashdl.dropout_mask(1, 2, 40, 50, 0.3, seed=99)
    small = flashdl.dropout_mask(1, 2, 7, 9, 0.3, seed=99)
    assert np.array_equal(small, big[:, :, :7, :9])
    assert flashdl.dropout_mask(1, 1, 0, 5, 0.3, seed=1).shape == (1, 1, 0, 5)
    assert flashdl.dropout_mask(1, 1, 3, 4, 0.0, seed=1).all()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_kernels_apply_exactly_the_mask(schedule):
    """With v the identity (seqlen_k = headdim), out[i, j] = P_ij Z_ij: zero exactly where the
    mask drops, P_ij / (1 - p) elsewhere."""
    rng = np.random.default_rng(3)
    b, sq, h, sk = 2, 37, 3, 24
    q = make(rng, (b, sq, h, sk))
    k = make(rng, (b, sk, h, sk))
    v = np.ascontiguousarray(np.broadcast_to(np.eye(sk, dtype=np.float32)[None, :, None, :],
                                             (b, sk, h, sk)))
    p, seed = 0.4, 2024
    out = flashdl.attention(q, k, v, schedule=schedule, dropout_p=p, seed=seed)
    keep = keep_of(q, k, p, seed)                       # (b, h, sq, sk)
    got = np.swapaxes(out, 1, 2)                        # (b, h, sq, sk)
    assert np.array_equal(got != 0, keep)
    undropped = np.swapaxes(flashdl.attention(q, k, v, schedule=schedule), 1, 2)
    np.testing.assert_allclose(got[keep], undropped[keep] * mo.keep_scale(p), rtol=1e-5)


# --- forward and backward against the oracle ---------------------------------------------------

CASES = [
    # b, sq, sk, h, hk, d, causal, window
    (1, 1, 1, 1, 1, 8, False, (-1, -1)),
    (2, 19, 19, 2, 2, 16, False, (-1, -1)),
    (1, 29, 13, 4, 2, 32, True, (-1, -1)),     # empty causal rows, GQA
    (1, 13, 70, 3, 1, 16, False, (5, 2)),      # MQA, window
    (2, 65, 47, 2, 1, 64, False, (-1, -1)),
    (1, 300, 40, 4, 2, 32, True, (-1, -1)),    # long queries, few keys: fa2 backward by queries
]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:6])) + f"-{c[6]}-{c[7]}")
def test_float64_matches_oracle(case, schedule):
    b, sq, sk, h, hk, d, causal, window = case
    rng = np.random.default_rng(sq * 1000 + sk)
    q, k, v = make_qkv(rng, b, sq, sk, h, hk, d, dtype="float64")
    dout = make(rng, q.shape, "float64")
    p, seed, offset = 0.3, 5 + sq, 11
    opts = dict(causal=causal, window_size=window, dropout_p=p, seed=seed, offset=offset,
                softmax_scale=SCALE)
    out, lse, dq, dk, dv = run(q, k, v, schedule, dout, **opts)
    visible = mo.brute_visible(sq, sk, *window, causal=causal)
    keep = keep_of(q, k, p, seed, offset)
    want_out, want_lse = mo.forward(q, k, v, visible, keep, p, SCALE)
    tol = F64_TOL[schedule]
    close(out, want_out, tol, "out")
    assert_lse(lse, want_lse)
    # lse is of the undropped scores: the same as without dropout
    assert np.array_equal(lse, run(q, k, v, schedule, causal=causal, window_size=window,
                                   softmax_scale=SCALE)[1])
    want = mo.backward(dout, q, k, v, visible, keep, p, SCALE)
    mag = max(float(np.max(np.abs(g))) for g in want)
    for name, g, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        close(g, w, tol * max(1.0, mag) / max(1.0, float(np.max(np.abs(w), initial=0.0))), name)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fa1_fa2_agree(dtype):
    """Same (seed, offset): the same mask in both schedules, so outputs and gradients agree to the
    precision of the dtype, and both with the float64 oracle."""
    rng = np.random.default_rng(8)
    q, k, v = make_qkv(rng, 2, 70, 90, 4, 2, 32, dtype=dtype)
    dout = make(rng, q.shape, dtype)
    opts = dict(dropout_p=0.2, seed=31337, offset=3)
    r1 = run(q, k, v, "fa1", dout, **opts)
    r2 = run(q, k, v, "fa2", dout, **opts)
    keep = keep_of(q, k, 0.2, 31337, 3)
    visible = np.ones((70, 90), dtype=bool)
    want = mo.forward(q, k, v, visible, keep, 0.2)[:1] + mo.backward(dout, q, k, v, visible,
                                                                     keep, 0.2)
    tol = {"float32": 2e-5, "float16": 4e-3}[dtype]
    for name, a, c, w in zip(("out", "dq", "dk", "dv"), r1[:1] + r1[2:], r2[:1] + r2[2:], want):
        close(a, np.asarray(c, np.float64), tol, f"fa1 vs fa2 {name}")
        close(a, w, tol, f"fa1 {name}")
        close(c, w, tol, f"fa2 {name}")
    np.testing.assert_array_equal(r1[1], r2[1]) if dtype == "float64" else assert_lse(r1[1], r2[1])


def test_gradients_match_numerical_oracle_gradients():
    """Central differences of the float64 oracle with the same mask: checks the oracle's
    backward, and through it the core's."""
    rng = np.random.default_rng(17)
    q, k, v = make_qkv(rng, 1, 5, 7, 2, 1, 4, dtype="float64")
    dout = make(rng, q.shape, "float64")
    p, seed = 0.35, 77
    keep = keep_of(q, k, p, seed)
    visible = mo.brute_visible(5, 7, 3, 1)
    num = mo.numerical_grads(lambda a, b_, c: mo.forward(a, b_, c, visible, keep, p)[0],
                             [q, k, v], dout)
    ana = mo.backward(dout, q, k, v, visible, keep, p)
    for name, n_, a in zip(("dq", "dk", "dv"), num, ana):
        np.testing.assert_allclose(a, n_, rtol=1e-6, atol=1e-7, err_msg=name)
    for schedule in SCHEDULES:
        got = run(q, k, v, schedule, dout, window_size=(3, 1), dropout_p=p, seed=seed)[2:]
        for name, g, n_ in zip(("dq", "dk", "dv"), got, num):
            np.testing.assert_allclose(g, n_, rtol=0, atol=2e-6, err_msg=f"{schedule} {name}")


@pytest.mark.parametrize("schedule", ["fa1", "fa2"])
def test_backward_matches_reference_backward(schedule):
    rng = np.random.default_rng(23)
    q, k, v = make_qkv(rng, 2, 33, 50, 4, 1, 16, dtype="float32")
    dout = make(rng, q.shape)
    opts = dict(dropout_p=0.5, seed=2**63 + 5, offset=2**32 - 1, causal=True)
    got = run(q, k, v, schedule, dout, **opts)
    ref = run(q, k, v, "reference", dout, **opts)
    for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        if name == "lse":
            assert_lse(g, r)
        else:
            close(g, np.asarray(r, np.float64), 2e-5, name)


# --- seeds, offsets, p = 0 -----------------------------------------------------------------------

def test_seed_and_offset_in_attention():
    rng = np.random.default_rng(4)
    q, k, v = make_qkv(rng, 1, 16, 16, 2, 2, 8)
    a = flashdl.attention(q, k, v, dropout_p=0.5, seed=1)
    assert np.array_equal(a, flashdl.attention(q, k, v, dropout_p=0.5, seed=1))
    assert not np.array_equal(a, flashdl.attention(q, k, v, dropout_p=0.5, seed=2))
    assert not np.array_equal(a, flashdl.attention(q, k, v, dropout_p=0.5, seed=1, offset=1))
    # seed=None draws a fresh seed, returned on request; it reproduces the call
    out, s1 = flashdl.attention(q, k, v, dropout_p=0.5, return_seed=True)
    out2, lse2, s2 = flashdl.attention(q, k, v, dropout_p=0.5, return_lse=True, return_seed=True)
    assert isinstance(s1, int) and 0 <= s1 < 2**63 and s1 != s2
    assert np.array_equal(out, flashdl.attention(q, k, v, dropout_p=0.5, seed=s1))
    assert np.array_equal(out2, flashdl.attention(q, k, v, dropout_p=0.5, seed=s2))
    assert flashdl.attention(q, k, v, seed=9, return_seed=True)[1] == 9
    assert flashdl.attention(q, k, v, return_seed=True)[1] == 0


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_p_zero_is_no_dropout(schedule):
    rng = np.random.default_rng(6)
    q, k, v = make_qkv(rng, 2, 21, 17, 4, 2, 16)
    dout = make(rng, q.shape)
    plain = run(q, k, v, schedule, dout, causal=True)
    zero = run(q, k, v, schedule, dout, causal=True, dropout_p=0.0, seed=123, offset=4)
    for a, c in zip(plain, zero):
        assert np.array_equal(a, c)


# --- torch autograd ------------------------------------------------------------------------------

def test_torch_autograd_with_dropout():
    torch = pytest.importorskip("torch")
    import flashdl.torch as ft

    rng = np.random.default_rng(9)
    q, k, v = make_qkv(rng, 2, 23, 31, 4, 2, 16, dtype="float64")
    dout = make(rng, q.shape, "float64")
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    opts = dict(dropout_p=0.25, seed=4242, offset=6, window_size=(7, 3))
    out = ft.attention(tq, tk, tv, schedule="fa2", **opts)
    out.backward(torch.tensor(dout))
    ref = run(q, k, v, "reference", dout, **opts)
    close(out.detach().numpy(), ref[0], 2e-6, "out")
    for name, t, r in zip(("dq", "dk", "dv"), (tq, tk, tv), ref[2:]):
        close(t.grad.numpy(), r, 2e-6, name)

    # seed=None: drawn from torch's generator, so torch.manual_seed repeats it, and the backward
    # reuses it (the gradient of sum(out) through v is the column sums of the dropped P)
    def once():
        xs = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
        o = ft.attention(*xs, dropout_p=0.5)
        o.sum().backward()
        return [o.detach()] + [x.grad for x in xs]

    torch.manual_seed(0)
    a = once()
    torch.manual_seed(0)
    c = once()
    d = once()
    assert all(torch.equal(x, y) for x, y in zip(a, c))
    assert not torch.equal(a[0], d[0])


# --- errors --------------------------------------------------------------------------------------

Q, K, V = make_qkv(np.random.default_rng(1), 1, 4, 5, 2, 2, 8)

ERRORS = {
    "p = 1": (ValueError, "dropout_p", dict(dropout_p=1.0, seed=1)),
    "p < 0": (ValueError, "dropout_p", dict(dropout_p=-0.1, seed=1)),
    "p nan": (ValueError, "dropout_p", dict(dropout_p=float("nan"), seed=1)),
    "p str": (TypeError, "dropout_p", dict(dropout_p="0.1", seed=1)),
    "seed < 0": (ValueError, "seed", dict(dropout_p=0.1, seed=-1)),
    "seed 2**64": (ValueError, "seed", dict(dropout_p=0.1, seed=2**64)),
    "seed float": (TypeError, "seed", dict(dropout_p=0.1, seed=1.5)),
    "seed str": (TypeError, "seed", dict(dropout_p=0.1, seed="1")),
    "offset < 0": (ValueError, "offset", dict(dropout_p=0.1, seed=1, offset=-1)),
    "offset 2**32": (ValueError, "offset", dict(dropout_p=0.1, seed=1, offset=2**32)),
    "offset float": (TypeError, "offset", dict(dropout_p=0.1, seed=1, offset=0.5)),
}


@pytest.mark.parametrize("case", ERRORS.values(), ids=ERRORS.keys())
def test_errors(case):
    exc, arg, kw = case
    pattern = rf"\b{arg}\b"
    with pytest.raises(exc, match=pattern):
        flashdl.attention(Q, K, V, **kw)
    out, lse = flashdl.attention(Q, K, V, return_lse=True)
    with pytest.raises(exc, match=pattern):
        flashdl.attention_backward(Q, Q, K, V, out, lse, **kw)
    with pytest.raises(exc, match=pattern):
        flashdl.dropout_mask(1, 2, 4, 5, kw["dropout_p"], kw["seed"], kw.get("offset", 0))


def test_backward_and_mask_need_a_seed():
    out, lse = flashdl.attention(Q, K, V, return_lse=True)
    with pytest.raises(TypeError, match=r"\bseed\b"):
        flashdl.attention_backward(Q, Q, K, V, out, lse, dropout_p=0.1, seed=None)
    with pytest.raises(TypeError, match=r"\bseed\b"):
        flashdl.dropout_mask(1, 1, 2, 2, 0.1, None)
    with pytest.raises(ValueError, match=r"\bseqlen_k\b"):
        flashdl.dropout_mask(1, 1, 2, -2, 0.1, 1)
    with pytest.raises(TypeError, match=re.escape("nheads")):
        flashdl.dropout_mask(1, 2.0, 2, 2, 0.1, 1)
