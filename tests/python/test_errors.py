"""Bad input raises ValueError/TypeError naming the argument, never writes into an input; empty
problems are valid."""

import re

import numpy as np
import pytest

import flashdl
from attn_oracle import make, make_qkv

RNG = np.random.default_rng(21)
Q, K, V = make_qkv(RNG, 2, 5, 7, 4, 2, 8)
DOUT = make(RNG, Q.shape)
OUT, LSE = flashdl.attention(Q, K, V, return_lse=True)


def strided_last(x):
    """x with the same shape but a last-dimension stride of 2."""
    big = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
    big[..., ::2] = x
    return big[..., ::2]


def expect(exc, arg, fn, *args, **kw):
    """fn(*args, **kw) raises exc whose message names arg; no array argument changes."""
    before = [np.array(a, copy=True) if isinstance(a, np.ndarray) else None for a in args]
    with pytest.raises(exc) as info:
        fn(*args, **kw)
    assert re.search(rf"\b{arg}\b", str(info.value)), f"message does not name {arg}: {info.value}"
    for a, b in zip(args, before):
        if b is not None:
            np.testing.assert_array_equal(a, b)
    return info.value


FORWARD_CASES = {
    "q rank 3": (ValueError, "q", (Q[0], K, V), {}),
    "q rank 5": (ValueError, "q", (Q[None], K, V), {}),
    "k rank 3": (ValueError, "k", (Q, K[0], V), {}),
    "v shape": (ValueError, "v", (Q, K, V[:, :6]), {}),
    "k batch": (ValueError, "k", (Q, K[:1], V[:1]), {}),
    "k headdim": (ValueError, "k", (Q, K[..., :4], V), {}),
    "v headdim": (ValueError, "v", (Q, K, V[..., :4]), {}),
    "k dtype": (TypeError, "k", (Q, K.astype(np.float64), V), {}),
    "v dtype": (TypeError, "v", (Q, K, V.astype(np.float16)), {}),
    "q int32": (TypeError, "q", (Q.astype(np.int32), K.astype(np.int32), V.astype(np.int32)), {}),
    "q int64": (TypeError, "q", (Q.astype(np.int64), K, V), {}),
    "k uint16": (TypeError, "k", (Q, K.view(np.uint16), V), {}),
    "q complex": (TypeError, "q", (Q.astype(np.complex64), K, V), {}),
    "q last dim strided": (ValueError, "q", (strided_last(Q), K, V), {}),
    "v last dim strided": (ValueError, "v", (Q, K, strided_last(V)), {}),
    "headdim 0": (ValueError, "q", (Q[..., :0], K[..., :0], V[..., :0]), {}),
    "headdim 257": (ValueError, "q", tuple(make(RNG, x.shape[:3] + (257,)) for x in (Q, K, V)), {}),
    "nheads % nheads_kv": (ValueError, "k", (Q[:, :, :3], K, V), {}),
    "schedule name": (ValueError, "schedule", (Q, K, V), {"schedule": "fa3"}),
    "schedule type": (TypeError, "schedule", (Q, K, V), {"schedule": 2}),
    "window type": (TypeError, "window_size", (Q, K, V), {"window_size": 3}),
    "window value": (ValueError, "window_size", (Q, K, V), {"window_size": (-2, 0)}),
    "softmax_scale inf": (ValueError, "softmax_scale", (Q, K, V), {"softmax_scale": np.inf}),
    "softmax_scale nan": (ValueError, "softmax_scale", (Q, K, V), {"softmax_scale": np.nan}),
    "softmax_scale str": (TypeError, "softmax_scale", (Q, K, V), {"softmax_scale": "x"}),
    "q list": (TypeError, "q", (Q.tolist(), K, V), {}),
    "k None": (TypeError, "k", (Q, None, V), {}),
    "v scalar": (TypeError, "v", (Q, K, 1.0), {}),
}


@pytest.mark.parametrize("case", FORWARD_CASES)
def test_forward_errors(case):
    exc, arg, args, kw = FORWARD_CASES[case]
    expect(exc, arg, flashdl.attention, *args, **kw)


BACKWARD_CASES = {
    "lse shape": (ValueError, "lse", (DOUT, Q, K, V, OUT, LSE[:, :, :4]), {}),
    "lse rank": (ValueError, "lse", (DOUT, Q, K, V, OUT, LSE[0]), {}),
    "lse dtype": (TypeError, "lse", (DOUT, Q, K, V, OUT, LSE.astype(np.float64)), {}),
    "dout shape": (ValueError, "dout", (DOUT[:, :4], Q, K, V, OUT, LSE), {}),
    "dout dtype": (TypeError, "dout", (DOUT.astype(np.float64), Q, K, V, OUT, LSE), {}),
    "dout last dim strided": (ValueError, "dout", (strided_last(DOUT), Q, K, V, OUT, LSE), {}),
    "out shape": (ValueError, "out", (DOUT, Q, K, V, OUT[:, :, :2], LSE), {}),
    "k rank": (ValueError, "k", (DOUT, Q, K[0], V, OUT, LSE), {}),
    "schedule name": (ValueError, "schedule", (DOUT, Q, K, V, OUT, LSE), {"schedule": "x"}),
    "dout list": (TypeError, "dout", (DOUT.tolist(), Q, K, V, OUT, LSE), {}),
    "lse None": (TypeError, "lse", (DOUT, Q, K, V, OUT, None), {}),
}


@pytest.mark.parametrize("case", BACKWARD_CASES)
def test_backward_errors(case):
    exc, arg, args, kw = BACKWARD_CASES[case]
    expect(exc, arg, flashdl.attention_backward, *args, **kw)


def test_read_only_inputs_are_accepted_and_untouched():
    q, k, v = (x.copy() for x in (Q, K, V))
    for x in (q, k, v):
        x.setflags(write=False)
    out, lse = flashdl.attention(q, k, v, return_lse=True)
    np.testing.assert_array_equal(out, OUT)
    out.setflags(write=False)
    lse.setflags(write=False)
    dq, dk, dv = flashdl.attention_backward(DOUT, q, k, v, out, lse)
    for x, y in zip((q, k, v), (Q, K, V)):
        np.testing.assert_array_equal(x, y)


def test_inputs_unchanged_after_successful_calls():
    args = [x.copy() for x in (DOUT, Q, K, V)]
    out, lse = flashdl.attention(*args[1:], causal=True, return_lse=True)
    saved = [x.copy() for x in (*args, out, lse)]
    flashdl.attention_backward(*args, out, lse, causal=True)
    for x, y in zip((*args, out, lse), saved):
        np.testing.assert_array_equal(x, y)


def test_mixed_frameworks():
    torch = pytest.importorskip("torch")
    expect(ValueError, "k", flashdl.attention, Q, torch.from_numpy(K), V)
    expect(ValueError, "v", flashdl.attention, torch.from_numpy(Q), torch.from_numpy(K), V)
    expect(ValueError, "lse", flashdl.attention_backward, *(torch.from_numpy(x) for x in (
        DOUT, Q, K, V, OUT)), LSE)


def test_tensors_requiring_grad():
    """The NumPy-level API would silently cut the graph: refused, pointing to flashdl.torch; under
    torch.no_grad (as inside flashdl.torch's own autograd Function) the same call runs."""
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(x) for x in (Q, K, V))
    err = expect(ValueError, "k", flashdl.attention, q, k.requires_grad_(), v)
    assert str(err).startswith("k: ") and "flashdl.torch.attention" in str(err)
    with torch.no_grad():
        flashdl.attention(q, k, v)
    cu_q, cu_k = (torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32))
    err = expect(ValueError, "q", flashdl.attention_varlen, q[0].requires_grad_(), k[0], v[0],
                 cu_q, cu_k, 5, 7)
    assert "flashdl.torch.attention_varlen" in str(err)


@pytest.mark.parametrize("schedule", ["fa1", "fa2", "reference"])
@pytest.mark.parametrize("b,sq,sk,h,hk", [(0, 5, 7, 4, 2), (2, 0, 7, 4, 2), (2, 5, 0, 4, 2),
                                         (2, 0, 0, 4, 2), (1, 3, 4, 0, 0)])
def test_empty_problems(schedule, b, sq, sk, h, hk):
    rng = np.random.default_rng(22)
    q, k, v = make_qkv(rng, b, sq, sk, h, hk, 8)
    out, lse = flashdl.attention(q, k, v, schedule=schedule, return_lse=True)
    assert out.shape == q.shape and lse.shape == (b, h, sq)
    if sk == 0:  # no key at all: out 0, lse -inf
        assert np.all(out == 0) and np.all(np.isneginf(lse))
    dout = make(rng, q.shape)
    dq, dk, dv = flashdl.attention_backward(dout, q, k, v, out, lse, schedule=schedule)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert np.all(dq == 0) if sk == 0 else True
    assert np.all(dk == 0) and np.all(dv == 0) if sq == 0 else True


# --- score modifiers (softcap, alibi_slopes) ----------------------------------------------------

SLOPES = np.linspace(0.1, 0.4, 4, dtype=np.float32)  # valid (nheads,) slopes for Q
SHAPES_MSG = r"\(4,\) or \(2, 4\)"  # the expected shapes the message names (nheads 4, batch 2)


def _bad_value(shape, at, value):
    x = np.full(shape, 0.25, np.float32)
    x[at] = value
    return x


SCORE_MOD_CASES = {
    "softcap -1": (ValueError, "softcap", dict(softcap=-1.0), r"0 \(off\) or a number in"),
    "softcap 1e-31": (ValueError, "softcap", dict(softcap=1e-31), r"\[1e-30, 1e30\], got 1e-31"),
    "softcap 1e-300": (ValueError, "softcap", dict(softcap=1e-300), "got 1e-300"),
    "softcap -inf": (ValueError, "softcap", dict(softcap=-np.inf), None),
    "softcap nan": (ValueError, "softcap", dict(softcap=np.nan), "nan"),
    "softcap inf": (ValueError, "softcap", dict(softcap=np.inf), "inf"),
    "softcap 1e31": (ValueError, "softcap", dict(softcap=1e31), r"1e30\], got 1e\+31"),
    "softcap str": (TypeError, "softcap", dict(softcap="1.0"), None),
    "softcap None": (TypeError, "softcap", dict(softcap=None), None),
    "softcap complex": (TypeError, "softcap", dict(softcap=1 + 1j), None),
    "softcap array": (TypeError, "softcap", dict(softcap=np.array([1.0, 2.0])), None),
    "slopes (3,)": (ValueError, "alibi_slopes", dict(alibi_slopes=SLOPES[:3]), SHAPES_MSG),
    "slopes (nheads_kv,)": (ValueError, "alibi_slopes",
                            dict(alibi_slopes=np.ones(2, np.float32)), SHAPES_MSG),
    "slopes (1, nheads)": (ValueError, "alibi_slopes",
                           dict(alibi_slopes=SLOPES[None]), SHAPES_MSG),
    "slopes (nheads, batch)": (ValueError, "alibi_slopes",
                               dict(alibi_slopes=np.ones((4, 2), np.float32)), SHAPES_MSG),
    "slopes (3, nheads)": (ValueError, "alibi_slopes",
                           dict(alibi_slopes=np.ones((3, 4), np.float32)), SHAPES_MSG),
    "slopes rank 3": (ValueError, "alibi_slopes",
                      dict(alibi_slopes=np.ones((2, 4, 1), np.float32)), SHAPES_MSG),
    "slopes rank 0": (ValueError, "alibi_slopes", dict(alibi_slopes=np.array(0.5, np.float32)),
                      "rank"),
    "slopes empty": (ValueError, "alibi_slopes", dict(alibi_slopes=np.ones(0, np.float32)),
                     SHAPES_MSG),
    "slopes float64": (TypeError, "alibi_slopes", dict(alibi_slopes=SLOPES.astype(np.float64)),
                       "float32"),
    "slopes float16": (TypeError, "alibi_slopes", dict(alibi_slopes=SLOPES.astype(np.float16)),
                       "float32"),
    "slopes int32": (TypeError, "alibi_slopes", dict(alibi_slopes=np.ones(4, np.int32)),
                     "float32"),
    "slopes list": (TypeError, "alibi_slopes", dict(alibi_slopes=SLOPES.tolist()), None),
    "slopes float": (TypeError, "alibi_slopes", dict(alibi_slopes=0.5), None),
    "slopes numpy scalar": (TypeError, "alibi_slopes", dict(alibi_slopes=np.float32(0.5)), None),
    "slopes nan": (ValueError, "alibi_slopes", dict(alibi_slopes=_bad_value(4, 1, np.nan)),
                   r"nan at \[1\]"),
    "slopes inf (batch, nheads)": (ValueError, "alibi_slopes",
                                   dict(alibi_slopes=_bad_value((2, 4), (1, 2), np.inf)),
                                   r"inf at \[1, 2\]"),
    "slopes -inf": (ValueError, "alibi_slopes", dict(alibi_slopes=_bad_value(4, 3, -np.inf)),
                    None),
    "slopes 1e31": (ValueError, "alibi_slopes", dict(alibi_slopes=_bad_value(4, 2, 1e31)),
                    r"at most 1e30 .*at \[2\]"),
    "slopes last dim strided": (ValueError, "alibi_slopes",
                                dict(alibi_slopes=strided_last(SLOPES)), "contiguous"),
    "slopes transposed (batch, nheads)": (ValueError, "alibi_slopes",
                                          dict(alibi_slopes=np.ones((4, 2), np.float32).T),
                                          "contiguous"),
}

# The packed (varlen) form of Q, K, V: two sequences, so (batch, nheads) is (2, 4) there too.
CU_Q, CU_K = np.array([0, 5, 10], np.int32), np.array([0, 7, 14], np.int32)
QP, KP, VP = Q.reshape(10, 4, 8), K.reshape(14, 2, 8), V.reshape(14, 2, 8)
OUTP, LSEP = flashdl.attention_varlen(QP, KP, VP, CU_Q, CU_K, 5, 7, return_lse=True)
SCORE_MOD_CALLS = {
    "attention": lambda **kw: flashdl.attention(Q, K, V, **kw),
    "attention_backward": lambda **kw: flashdl.attention_backward(DOUT, Q, K, V, OUT, LSE, **kw),
    "attention_varlen": lambda **kw: flashdl.attention_varlen(QP, KP, VP, CU_Q, CU_K, 5, 7, **kw),
    "attention_varlen_backward": lambda **kw: flashdl.attention_varlen_backward(
        QP, QP, KP, VP, OUTP, LSEP, CU_Q, CU_K, 5, 7, **kw),
}


@pytest.mark.parametrize("fn", SCORE_MOD_CALLS)
@pytest.mark.parametrize("case", SCORE_MOD_CASES)
def test_score_mod_errors(case, fn):
    """Every entry point names softcap or alibi_slopes (with the expected shapes, dtype or the
    offending element), and no array, the slopes included, changes."""
    exc, arg, kw, detail = SCORE_MOD_CASES[case]
    arrays = [Q, K, V, DOUT, OUT, LSE, QP, KP, VP, OUTP, LSEP] + [
        x for x in kw.values() if isinstance(x, np.ndarray)]
    before = [x.copy() for x in arrays]
    err = expect(exc, arg, SCORE_MOD_CALLS[fn], **kw)
    assert str(err).startswith(arg + ":"), str(err)
    if detail is not None:
        assert re.search(detail, str(err)), f"message lacks {detail!r}: {err}"
    for x, y in zip(arrays, before):
        np.testing.assert_array_equal(x, y)


def test_valid_score_mods_are_accepted():
    """The accepted forms: softcap 0 (off), an int or NumPy float softcap, (nheads,) and
    (batch, nheads) slopes, a stride-0 broadcast view, read-only slopes, negative and zero
    slopes; all give finite results and change nothing."""
    slopes_bh = np.stack([SLOPES, -SLOPES])
    frozen = SLOPES.copy()
    frozen.flags.writeable = False
    before = [x.copy() for x in (SLOPES, slopes_bh)]
    for kw in (dict(softcap=0.0), dict(softcap=3), dict(softcap=np.float32(2.5)),
               dict(alibi_slopes=SLOPES), dict(alibi_slopes=slopes_bh),
               dict(alibi_slopes=np.broadcast_to(SLOPES, (2, 4))), dict(alibi_slopes=frozen),
               dict(alibi_slopes=np.zeros(4, np.float32), softcap=1e-3)):
        for call in SCORE_MOD_CALLS.values():
            res = call(**kw)
            for x in (res if isinstance(res, tuple) else (res,)):
                assert np.isfinite(x).all(), kw
    for x, y in zip((SLOPES, slopes_bh), before):
        np.testing.assert_array_equal(x, y)


def test_score_mod_errors_torch():
    """The torch entry points (slopes as torch tensors) validate the same way."""
    torch = pytest.importorskip("torch")
    import flashdl.torch as ft

    q, k, v = (torch.from_numpy(x).requires_grad_() for x in (Q, K, V))
    good = torch.from_numpy(SLOPES.copy())
    cases = [(ValueError, "softcap", dict(softcap=-0.5)),
             (TypeError, "softcap", dict(softcap="2")),
             (ValueError, "alibi_slopes", dict(alibi_slopes=good[:2])),
             (TypeError, "alibi_slopes", dict(alibi_slopes=good.double())),
             (ValueError, "alibi_slopes", dict(alibi_slopes=torch.tensor([0.1, float("nan"),
                                                                          0.2, 0.3]))),
             (ValueError, "alibi_slopes", dict(alibi_slopes=torch.ones(8)[::2]))]
    for exc, arg, kw in cases:
        expect(exc, arg, ft.attention, q, k, v, **kw)
        expect(exc, arg, ft.attention_varlen, q.reshape(10, 4, 8), k.reshape(14, 2, 8),
               v.reshape(14, 2, 8), torch.from_numpy(CU_Q), torch.from_numpy(CU_K), 5, 7, **kw)
    assert torch.equal(good, torch.from_numpy(SLOPES))
    for x, y in zip((q, k, v), (Q, K, V)):
        assert np.array_equal(x.detach().numpy(), y)


# --- every entry point by attention's rules, in the caller's words (issue 52) --------------------

def test_slope_limit_checked_in_float32():
    """The limit 1e30 is checked in the slopes' float32: float32(1e30) itself is accepted, the next
    float32 refused, and the message's number exceeds the limit it states."""
    at_limit = np.full(4, np.float32(1e30))
    out = flashdl.attention(Q, K, V, alibi_slopes=at_limit)
    assert out.shape == Q.shape
    over = np.full(4, np.nextafter(np.float32(1e30), np.float32(np.inf)))
    err = expect(ValueError, "alibi_slopes", flashdl.attention, Q, K, V, alibi_slopes=over)
    got = float(re.search(r"got (\S+) at", str(err))[1])
    assert got > 1e30, str(err)


@pytest.mark.parametrize("arg", ["softmax_scale", "dropout_p", "softcap"])
def test_ints_beyond_float_range_are_value_errors(arg):
    """10**400 does not fit a float: ValueError naming the argument, not OverflowError."""
    err = expect(ValueError, arg, flashdl.attention, Q, K, V, **{arg: 10**400})
    assert str(err).startswith(arg + ":") and "beyond the range of a float" in str(err)


def test_ints_beyond_float_range_torch_and_flash_attn():
    torch = pytest.importorskip("torch")
    import flashdl.flash_attn as fa
    import flashdl.torch as ft

    q, k, v = (torch.from_numpy(x) for x in (Q, K, V))
    for arg in ("softmax_scale", "dropout_p"):
        expect(ValueError, arg, ft.attention, q, k, v, **{arg: 10**400})
        expect(ValueError, arg, fa.flash_attn_func, q, k, v, **{arg: 10**400})


def test_set_num_threads_beyond_int():
    """The core takes a C int: a larger count is a ValueError naming n, not nanobind's
    "incompatible function arguments"; a bool is not a count."""
    err = expect(ValueError, "n", flashdl.set_num_threads, 2**40)
    assert "incompatible" not in str(err)
    expect(TypeError, "n", flashdl.set_num_threads, True)
    assert flashdl.info()["num_threads"] >= 1


MERGE_CASES = {  # (exception, the argument named, arguments)
    "int32 outputs": (TypeError, "out_a", (OUT.astype(np.int32), LSE, OUT.astype(np.int32), LSE)),
    "int32 out_b": (TypeError, "out_b", (OUT, LSE, OUT.astype(np.int32), LSE)),
    "rank-2 lse": (ValueError, "lse_a", (OUT, LSE[0], OUT, LSE[0])),
    "rank-2 lse_b": (ValueError, "lse_b", (OUT, LSE, OUT, LSE[0])),
    "float64 lse": (TypeError, "lse_a", (OUT, LSE.astype(np.float64), OUT, LSE)),
}


@pytest.mark.parametrize("case", MERGE_CASES)
def test_merge_states_names_the_callers_arguments(case):
    """merge_states allocates out and lse from out_a and lse_a: a wrong dtype or rank there is
    the caller's argument, never the outputs' (out, lse)."""
    exc, arg, args = MERGE_CASES[case]
    err = expect(exc, arg, flashdl.merge_states, *args)
    assert str(err).startswith(arg + ":"), str(err)


def test_merge_states_misaligned_names_the_fix():
    """A misaligned input (the first bfloat16 array of a process included) is refused by name,
    saying what to pass instead."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from flashdl import _checks

    _checks._READABLE_NUMPY.discard(np.dtype(ml_dtypes.bfloat16))  # as in a fresh process
    for dtype in (np.float32, ml_dtypes.bfloat16):
        o = OUT.astype(dtype)
        buf = np.zeros(o.nbytes + 8, np.uint8)
        mis = np.ndarray(o.shape, dtype, buffer=buf, offset=1)
        mis[...] = o
        for args, name in (((mis, LSE, o, LSE), "out_a"), ((o, LSE, mis, LSE), "out_b")):
            err = expect(ValueError, name, flashdl.merge_states, *args)
            assert "not aligned" in str(err) and f"{name}.copy()" in str(err), str(err)


def _distributed_entry_points():
    torch = pytest.importorskip("torch")
    import flashdl.torch as ft

    return torch, {
        "ring_attention": ft.ring_attention,
        "ulysses_attention": ft.ulysses_attention,
        "context_parallel_attention": lambda *a, **kw: ft.context_parallel_attention(
            *a, ring_group=None, ulysses_group=None, **kw)}


BAD_SCALARS = {  # (exception, argument, keywords): attention refuses each the same way
    "window float": (TypeError, "window_size", dict(window_size=(1.5, 0))),
    "window -2": (ValueError, "window_size", dict(window_size=(-2, 0))),
    "window int": (TypeError, "window_size", dict(window_size=3)),
    "causal str": (TypeError, "causal", dict(causal="yes")),
    "softmax_scale nan": (ValueError, "softmax_scale", dict(softmax_scale=float("nan"))),
    "softmax_scale 10**400": (ValueError, "softmax_scale", dict(softmax_scale=10**400)),
    "softmax_scale str": (TypeError, "softmax_scale", dict(softmax_scale="1")),
    "return_lse int": (TypeError, "return_lse", dict(return_lse=1)),
}


@pytest.mark.parametrize("fn", ["ring_attention", "ulysses_attention",
                                "context_parallel_attention"])
@pytest.mark.parametrize("case", BAD_SCALARS)
def test_distributed_entry_points_check_arguments_as_attention(case, fn):
    """ring, Ulysses and context-parallel attention refuse what flashdl.torch.attention refuses,
    with its exception and argument, before needing a process group (none is initialised here):
    (1.5, 0) is not run as (1, 0)."""
    torch, fns = _distributed_entry_points()
    import flashdl.torch as ft

    exc, arg, kw = BAD_SCALARS[case]
    q = torch.zeros(1, 4, 2, 8)
    ref = expect(exc, arg, ft.attention, q, q, q, **kw)
    err = expect(exc, arg, fns[fn], q, q, q, **kw)
    assert str(err).split(",")[0] == str(ref).split(",")[0], (str(err), str(ref))


@pytest.mark.parametrize("fn", ["ring_attention", "ulysses_attention",
                                "context_parallel_attention"])
def test_distributed_entry_points_refuse_numpy_by_name(fn):
    """NumPy arrays: a TypeError naming q and what the function takes, not an AttributeError."""
    _, fns = _distributed_entry_points()
    err = expect(TypeError, "q", fns[fn], Q, K, V)
    assert f"{fn} takes torch tensors" in str(err), str(err)


@pytest.mark.parametrize("case", ["window float", "window -2", "window int", "causal str",
                                  "softmax_scale nan", "softmax_scale 10**400",
                                  "softmax_scale 1e31", "softcap -1"])
def test_jax_ring_and_kvcache_check_arguments_as_attention(case):
    """flashdl.jax's ring attention and KV cache refuse what flashdl.jax.attention refuses, with
    its exception and argument, when traced (a value such as window (-2, 0) or softcap -1 too: a
    ValueError, not XLA's INVALID_ARGUMENT when the call runs)."""
    jnp = pytest.importorskip("jax.numpy")
    import flashdl.jax as fj

    kw = dict(BAD_SCALARS, **{"softmax_scale 1e31": (ValueError, "softmax_scale",
                                                     dict(softmax_scale=1e31)),
                              "softcap -1": (ValueError, "softcap", dict(softcap=-1.0))})[case]
    exc, arg, kw = kw
    kw = {k: v for k, v in kw.items() if k != "return_lse"}
    q = jnp.zeros((1, 4, 2, 8), jnp.float32)
    ref = expect(exc, arg, fj.attention, q, q, q, **kw)
    err = expect(exc, arg, fj.ring_attention, q, q, q, axis_name="sp", **kw)
    assert str(err).split(",")[0] == str(ref).split(",")[0], (str(err), str(ref))
    lens = np.array([2], np.int32)
    err = expect(exc, arg, fj.attention_with_kvcache, q, q, q, cache_seqlens=lens, **kw)
    assert str(err).split(",")[0] == str(ref).split(",")[0], (str(err), str(ref))


def test_jax_merge_states_refuses_integer_outputs_when_traced():
    """An int32 output is a TypeError naming outs[0] at trace time, as flashdl.merge_states
    refuses it, not XLA's INVALID_ARGUMENT when the call runs."""
    jnp = pytest.importorskip("jax.numpy")
    import flashdl.jax as fj

    o, lse = jnp.zeros((1, 2, 2, 8), jnp.int32), jnp.zeros((1, 2, 2), jnp.float32)
    err = expect(TypeError, "outs", fj.merge_states, [o, o], [lse, lse])
    assert str(err).startswith("outs[0]: expected dtype"), str(err)
