"""flashdl.jax.dot_product_attention against jax.nn.dot_product_attention(implementation="xla")
and against a float64 oracle of JAX's semantics (JAX's own implementation runs its softmax in
float32 even for float64 inputs, so it agrees to float32 precision; the oracle is the same
semantics with a float64 softmax and agrees to float64 precision). Outputs, the residual and the
gradients of query, key, value and bias, under jax.jit, jax.grad and jax.vmap, over every
argument; refusals at trace time."""

import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import flashdl.jax as fj  # noqa: E402

LARGE_NEG = -0.7 * float(np.finfo(np.float32).max)
# jax 0.10.0's XLA implementation masks float64 logits with -0.7 x the float64 maximum, which
# overflows to -inf in its float32 softmax: NaN in every row that sees no key. 0.10.1 caps the
# value at the float32 range (the semantics followed here); before it, such rows of the
# reference are not compared.
XLA_F64_EMPTY_ROWS_NAN = tuple(int(x) for x in jax.__version__.split(".")[:3]) < (0, 10, 1)


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def oracle(q, k, v, bias=None, mask=None, *, scale=None, is_causal=False,
           query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
           return_residual=False):
    """JAX's documented semantics written out in float64 (4-D arrays): scaled logits plus bias,
    every hidden logit replaced by JAX's large negative, softmax, rows past the query length 0."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    kk, vv = (jnp.repeat(x, N // K, axis=2) for x in (k, v))
    s = jnp.einsum("btnh,bsnh->bnts", q, kk,
                   precision=jax.lax.Precision.HIGHEST) * float(scale or 1 / np.sqrt(H))
    if bias is not None:
        s = s + bias
    i, j = np.arange(T)[:, None], np.arange(S)[None, :]
    keep = np.ones((T, S), bool)
    if is_causal:
        keep &= j <= i
    if local_window_size is not None:
        lw = local_window_size
        left, right = (lw, lw) if isinstance(lw, int) else lw
        keep &= (i - left <= j) & (j <= i + right)
    keep = jnp.broadcast_to(keep, (B, N, T, S))
    if mask is not None:
        keep = keep & mask
    if key_value_seq_lengths is not None:
        keep = keep & (j < key_value_seq_lengths[:, None, None, None])
    if query_seq_lengths is not None:
        keep = keep & (i < query_seq_lengths[:, None, None, None])
    s = jnp.where(keep, s, LARGE_NEG)
    out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), vv,
                     precision=jax.lax.Precision.HIGHEST)
    if query_seq_lengths is not None:
        out = out * (np.arange(T)[None, :] < query_seq_lengths[:, None])[:, :, None, None]
    if return_residual:
        lse = jnp.swapaxes(jax.scipy.special.logsumexp(s, axis=-1), 1, 2)
        return out, jax.lax.stop_gradient(lse)
    return out


def arrays(shapes, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]


def lengths(values):
    return jnp.asarray(values, jnp.int32)


# (B, T, S, N, K), bias shape, mask shape, keywords
CASES = {
    "plain": ((2, 7, 7, 4, 4), None, None, {}),
    "gqa_t_lt_s": ((2, 5, 11, 4, 2), None, None, {}),
    "mqa_t_gt_s": ((2, 11, 5, 4, 1), None, None, {}),
    "causal_square": ((2, 9, 9, 2, 2), None, None, dict(is_causal=True)),
    "causal_t_lt_s": ((2, 5, 12, 4, 2), None, None, dict(is_causal=True)),
    "causal_t_gt_s": ((2, 12, 5, 2, 1), None, None, dict(is_causal=True)),
    "window_int": ((1, 10, 10, 2, 2), None, None, dict(local_window_size=2)),
    "window_pair_t_gt_s": ((2, 13, 6, 2, 2), None, None, dict(local_window_size=(2, 1))),
    "window_pair_t_lt_s": ((2, 6, 13, 2, 2), None, None, dict(local_window_size=(1, 3))),
    "window_negative_side": ((1, 8, 8, 2, 2), None, None, dict(local_window_size=(3, -1))),
    "window_causal": ((2, 9, 14, 4, 2), None, None, dict(local_window_size=(3, 5),
                                                            is_causal=True)),
    "window_causal_t_gt_s": ((2, 14, 4, 2, 2), None, None, dict(local_window_size=(2, 0),
                                                                   is_causal=True)),
    "bias_full": ((2, 6, 9, 4, 2), (2, 4, 6, 9), None, {}),
    "bias_heads_rows": ((2, 6, 9, 4, 2), (4, 6, 9), None, {}),
    "bias_keys_only": ((2, 6, 9, 4, 2), (2, 1, 1, 9), None, {}),
    "bias_key_axis_1": ((2, 6, 9, 4, 2), (2, 4, 6, 1), None, dict(is_causal=True)),
    "bias_2d": ((2, 6, 9, 4, 2), (6, 9), None, {}),
    "mask_full": ((2, 6, 9, 4, 2), None, (2, 4, 6, 9), {}),
    "mask_broadcast": ((2, 6, 9, 4, 2), None, (1, 1, 6, 9), dict(is_causal=True)),
    "mask_rows_1": ((2, 6, 9, 4, 2), None, (2, 4, 1, 9), {}),
    "q_lengths": ((3, 8, 8, 2, 2), None, None, dict(query_seq_lengths=[8, 3, 0])),
    "kv_lengths": ((3, 8, 10, 2, 2), None, None, dict(key_value_seq_lengths=[10, 4, 0])),
    "both_lengths_causal": ((3, 9, 9, 4, 2), None, None, dict(
        query_seq_lengths=[9, 5, 2], key_value_seq_lengths=[7, 9, 1], is_causal=True)),
    "everything": ((2, 10, 13, 4, 2), (1, 4, 10, 13), (2, 1, 10, 13), dict(
        query_seq_lengths=[10, 6], key_value_seq_lengths=[11, 5], is_causal=True,
        local_window_size=(4, 2), scale=0.3)),
    "everything_t_gt_s": ((2, 13, 7, 2, 1), (2, 2, 13, 7), (1, 2, 13, 7), dict(
        query_seq_lengths=[12, 13], key_value_seq_lengths=[7, 3], local_window_size=(3, 2))),
    "no_row_sees_a_key": ((2, 6, 6, 2, 2), (2, 2, 6, 6), None, dict(local_window_size=(1, -2))),
    "rows_past_the_keys": ((1, 9, 3, 2, 2), None, None, dict(local_window_size=(1, 1))),
}


def make(case, dtype=np.float64, seed=0):
    (B, T, S, N, K), bias_shape, mask_shape, kw = CASES[case]
    q, k, v, dout = arrays([(B, T, N, 8), (B, S, K, 8), (B, S, K, 8), (B, T, N, 8)], dtype, seed)
    rng = np.random.default_rng(seed + 1)
    bias = None if bias_shape is None else jnp.asarray(rng.standard_normal(bias_shape), dtype)
    mask = None if mask_shape is None else jnp.asarray(rng.random(mask_shape) > 0.3)
    kw = dict(kw)
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        if name in kw:
            kw[name] = lengths(kw[name])
    return (q, k, v, bias, mask), dout, kw


def run(fn, args, dout, kw):
    """out, residual and the gradients of q, k, v (and bias), in one jax.jit program."""
    q, k, v, bias, mask = args

    @jax.jit
    def both(q, k, v, bias):
        (out, res), vjp = jax.vjp(
            lambda q, k, v, bias: fn(q, k, v, bias, mask, return_residual=True, **kw),
            q, k, v, bias)
        return out, res, vjp((dout, jnp.zeros_like(res)))
    out, res, grads = both(q, k, v, bias)
    return [out, res, *(g for g in grads if g is not None)]


def xla(*args, **kw):
    return jax.nn.dot_product_attention(*args, implementation="xla", **kw)


def oracle_4d(q, k, v, bias=None, mask=None, **kw):
    if bias is not None:
        bias = bias[(None,) * (4 - bias.ndim)]
    if mask is not None:
        mask = mask[(None,) * (4 - mask.ndim)]
    return oracle(q, k, v, bias, mask, **kw)


def assert_close(got, want, tol, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    err = np.abs(got - want).max() if got.size else 0.0
    assert err <= tol * max(1.0, np.abs(want).max() if want.size else 0.0), (what, err)


NAMES = ("out", "residual", "dq", "dk", "dv", "dbias")


# A case of each argument in the quick run; every case with the "thorough" profile (run_long.sh).
QUICK = ["everything", "everything_t_gt_s", "causal_t_lt_s", "window_pair_t_gt_s", "mqa_t_gt_s",
         "bias_key_axis_1", "mask_rows_1", "both_lengths_causal", "no_row_sees_a_key"]
THOROUGH = os.environ.get("FLASHDL_HYPOTHESIS_PROFILE") == "thorough"


@pytest.mark.parametrize("case", sorted(CASES) if THOROUGH else QUICK)
def test_float64_matches_oracle_and_xla(case):
    args, dout, kw = make(case)
    got = run(fj.dot_product_attention, args, dout, kw)
    want = run(oracle_4d, args, dout, kw)
    ref = run(xla, args, dout, kw)
    for name, g, w, r in zip(NAMES, got, want, ref):
        assert g.dtype == r.dtype and g.shape == r.shape, name
        if XLA_F64_EMPTY_ROWS_NAN:
            g, w, r = (np.asarray(x)[np.isfinite(np.asarray(r))] for x in (g, w, r))
        if name == "residual":  # float32 in the core and in JAX alike
            assert_close(g, r, 2e-6, (case, name))
            continue
        # The core keeps lse in float32 (its contract), and the backward recomputes the
        # probabilities from it: float64 gradients are float32-accurate, the output is not.
        assert_close(g, w, 1e-12 if name == "out" else 2e-6, (case, name))
        assert_close(g, r, 2e-5, (case, name))  # JAX's float32 softmax


@pytest.mark.skipif(XLA_F64_EMPTY_ROWS_NAN, reason="jax < 0.10.1: NaN in its float64 reference")
def test_residual_of_hidden_rows_is_jaxs_large_negative():
    args, dout, kw = make("both_lengths_causal")
    res, want = (jax.jit(lambda *a: fn(*a, return_residual=True, **kw)[1])(*args)
                 for fn in (fj.dot_product_attention, xla))
    hidden = np.asarray(want) < -1e30
    assert hidden.any()
    np.testing.assert_array_equal(np.asarray(res)[hidden], np.asarray(want)[hidden])


def test_three_axes_layout():
    (q, k, v, bias, _), dout, _ = make("bias_full")
    args, dout, kw = (q[0], k[0], v[0], bias[0], None), dout[0], dict(is_causal=True)

    def oracle_3d(q, k, v, bias, mask, **kw):
        out, res = oracle_4d(q[None], k[None], v[None], bias, mask, **kw)
        return out[0], res[0]
    got = run(fj.dot_product_attention, args, dout, kw)
    want, ref = run(oracle_3d, args, dout, kw), run(xla, args, dout, kw)
    for name, g, w, r in zip(NAMES, got, want, ref):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert_close(g, r, 2e-5, name)
        if name != "residual":
            assert_close(g, w, 1e-12 if name == "out" else 2e-6, name)


# float16: jax.nn's XLA implementation refuses it on the CPU (F16_F16_F32 dot precision).
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["everything", "causal_t_lt_s", "bias_keys_only"] if THOROUGH
                         else ["everything"])
def test_low_precision_within_twice_xlas_error(dtype, case):
    """flash-attn's rule, |flashdl - oracle| <= 2 |naive_lowp - oracle| + eps(dtype), with two
    naive implementations in the input precision: jax.nn's XLA implementation and the oracle's
    algorithm run in that dtype; the larger of their errors (XLA's own error moves between jax
    releases: 0.10.0's float32 dK is more accurate than 0.10.2's)."""
    args64, dout64, kw = make(case)
    lowp = jax.tree.map(lambda x: x if x is None or x.dtype == bool else x.astype(dtype),
                        (args64, dout64), is_leaf=lambda x: x is None)
    (args, dout) = lowp
    got = run(fj.dot_product_attention, args, dout, kw)
    ref = run(xla, args, dout, kw)
    naive = run(oracle_4d, args, dout, kw)
    up = jax.tree.map(lambda x: x if x is None or x.dtype == bool else x.astype(np.float64),
                      (args, dout), is_leaf=lambda x: x is None)
    want = run(oracle_4d, *up, kw)
    eps = float(jnp.finfo(dtype).eps)
    for name, g, r, n, w in zip(NAMES, got, ref, naive, want):
        assert g.dtype == r.dtype, name
        if name == "residual":
            continue
        g, r, n, w = (np.asarray(x, np.float64) for x in (g, r, n, w))
        lowp_err = max(np.abs(r - w).max(), np.abs(n - w).max())
        assert np.abs(g - w).max() <= 2 * lowp_err + eps * max(1, np.abs(w).max()), \
            (case, dtype, name)


@pytest.mark.parametrize("case", ["everything", "causal_t_lt_s"])
def test_float16_against_the_oracle(case):
    """float16, which jax.nn's XLA implementation refuses on the CPU: within 2 float16 epsilons
    (relative to the largest value) of the oracle on the same float16 inputs; the residual of a
    hidden row is JAX's large negative in float16 (-inf)."""
    args64, dout64, kw = make(case)
    half = jax.tree.map(lambda x: x if x is None or x.dtype == bool else x.astype(jnp.float16),
                        (args64, dout64), is_leaf=lambda x: x is None)
    got = run(fj.dot_product_attention, *half, kw)
    up = jax.tree.map(lambda x: x if x is None or x.dtype == bool else x.astype(np.float64),
                      half, is_leaf=lambda x: x is None)
    want = run(oracle_4d, *up, kw)
    eps = float(jnp.finfo(jnp.float16).eps)
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == jnp.float16, name
        g, w = np.asarray(g, np.float64), np.asarray(w)
        if name == "residual":
            hidden = w < -1e30
            assert np.all(g[hidden] == -np.inf), name
            g, w = g[~hidden], w[~hidden]
        assert np.abs(g - w).max() <= 2 * eps * max(1.0, np.abs(w).max()), (case, name)


def test_vmap_matches_each_element():
    (q, k, v, bias, mask), _, kw = make("everything")
    stack = lambda x: jnp.stack([x, 2 * x, -x])  # noqa: E731
    qs, ks, vs, bs = (stack(x) for x in (q, k, v, bias))
    f = lambda q, k, v, b: fj.dot_product_attention(q, k, v, b, mask, **kw)  # noqa: E731
    got = jax.jit(jax.vmap(f))(qs, ks, vs, bs)
    for i in range(3):
        assert_close(got[i], oracle_4d(qs[i], ks[i], vs[i], bs[i], mask, **kw), 1e-12, i)
    # mapped lengths too
    ql = jnp.stack([kw["query_seq_lengths"], lengths([3, 10]), lengths([0, 1])])
    g = lambda q, l: fj.dot_product_attention(q, k, v, bias, mask, query_seq_lengths=l)  # noqa
    got = jax.vmap(g)(qs, ql)
    for i in range(3):
        assert_close(got[i], oracle_4d(qs[i], k, v, bias, mask, query_seq_lengths=ql[i]),
                     1e-12, i)


def test_jitted_program_is_flashdls_custom_call():
    (q, k, v, bias, mask), _, kw = make("everything")
    f = lambda q, k, v, b: fj.dot_product_attention(q, k, v, b, mask, **kw)  # noqa: E731
    text = jax.jit(f).lower(q, k, v, bias).as_text()
    assert "flashdl_attention_fwd" in text
    grad_text = jax.jit(jax.grad(lambda q: f(q, k, v, bias).sum())).lower(q).as_text()
    assert "flashdl_attention_bwd" in grad_text


def test_implementation_argument():
    args, _, kw = make("causal_t_lt_s")
    for impl in ("xla",):
        got = fj.dot_product_attention(*args, implementation=impl, **kw)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(xla(*args, **kw)))
    with pytest.raises(ValueError, match="implementation"):
        fj.dot_product_attention(*args, implementation="flash", **kw)


def _bad_calls():
    q, k, v = arrays([(2, 6, 4, 8), (2, 9, 2, 8), (2, 9, 2, 8)])
    ok = dict(query=q, key=k, value=v)
    return {
        "query dtype": (ValueError, "query", dict(ok, query=q.astype(jnp.float32)), {}),
        "value shape": (ValueError, "value", dict(ok, value=v[:, :8]), {}),
        "query batch": (ValueError, "query", dict(ok, query=q[:1]), {}),
        "query headdim": (ValueError, "query", dict(ok, query=q[..., :4]), {}),
        "heads": (ValueError, "query", dict(ok, query=q[:, :, :3]), {}),
        "rank 5": (ValueError, "query", dict(ok, query=q[None]), {}),
        "int key": (TypeError, "key", dict(ok, query=q.astype(int), key=k.astype(int),
                                          value=v.astype(int)), {}),
        "mask dtype": (ValueError, "mask", ok, dict(mask=jnp.ones((2, 4, 6, 9), jnp.int32))),
        "mask shape": (ValueError, "mask", ok, dict(mask=jnp.ones((2, 4, 5, 9), bool))),
        "bias shape": (ValueError, "bias", ok, dict(bias=jnp.ones((2, 3, 6, 9)))),
        "bias rank": (ValueError, "bias", ok, dict(bias=jnp.ones((1, 2, 4, 6, 9)))),
        "q lengths dtype": (ValueError, "query_seq_lengths", ok,
                            dict(query_seq_lengths=jnp.ones(2, jnp.int64))),
        "kv lengths shape": (ValueError, "key_value_seq_lengths", ok,
                             dict(key_value_seq_lengths=jnp.ones(3, jnp.int32))),
        "window type": (TypeError, "local_window_size", ok, dict(local_window_size=2.0)),
        "window pair": (TypeError, "local_window_size", ok, dict(local_window_size=(1, 2, 3))),
        "causal type": (TypeError, "is_causal", ok, dict(is_causal="yes")),
        "residual type": (TypeError, "return_residual", ok, dict(return_residual=None)),
        "scale nan": (ValueError, "scale", ok, dict(scale=float("nan"))),
        "implementation": (ValueError, "implementation", ok, dict(implementation="pallas")),
    }


BAD = ["query dtype", "value shape", "query batch", "query headdim", "heads", "rank 5", "int key",
       "mask dtype", "mask shape", "bias shape", "bias rank", "q lengths dtype", "kv lengths shape",
       "window type", "window pair", "causal type", "residual type", "scale nan", "implementation"]


@pytest.mark.parametrize("case", BAD)
def test_refusals_at_trace_time_name_the_argument(case):
    err, name, arrays_, kw = _bad_calls()[case]
    with pytest.raises(err, match=name):  # eval_shape only traces: nothing runs
        jax.eval_shape(lambda a: fj.dot_product_attention(**a, **kw), arrays_)


def test_traced_scale_is_refused():
    q, k, v = arrays([(1, 4, 2, 8)] * 3)
    with pytest.raises(TypeError, match="scale"):
        jax.jit(lambda s: fj.dot_product_attention(q, k, v, scale=s))(0.5)


@settings(max_examples=400 if THOROUGH else 80)  # about 0.15 s an example
@given(T=st.integers(1, 12), S=st.integers(1, 12), K=st.sampled_from([1, 2]),
       is_causal=st.booleans(),
       window=st.one_of(st.none(), st.integers(-2, 13),
                        st.tuples(st.integers(-3, 13), st.integers(-3, 13))),
       lengths=st.booleans(), seed=st.integers(0, 2**16))
def test_visibility_of_drawn_shapes_matches_the_oracle(T, S, K, is_causal, window, lengths,
                                                       seed):
    """The top-left causal and window mapped onto the core's bottom-right window (_plan), over
    drawn T, S, windows (negative sides included), key and query lengths: forward and residual
    against the float64 oracle."""
    q, k, v = arrays([(2, T, 2, 4), (2, S, K, 4), (2, S, K, 4)], seed=seed)
    kw = dict(is_causal=is_causal, local_window_size=window)
    if lengths:
        rng = np.random.default_rng(seed)
        kw.update(query_seq_lengths=lengths_of(rng, T), key_value_seq_lengths=lengths_of(rng, S))
    out, res = jax.jit(lambda q, k, v: fj.dot_product_attention(
        q, k, v, return_residual=True, **kw))(q, k, v)
    want, want_res = numpy_oracle(*(np.asarray(x) for x in (q, k, v)), **kw)
    assert_close(out, want, 1e-12, "out")
    assert_close(res, want_res, 1e-6, "residual")


def numpy_oracle(q, k, v, *, is_causal, local_window_size, query_seq_lengths=None,
                 key_value_seq_lengths=None):
    """The oracle's semantics in NumPy (no compilation per drawn shape): out and residual."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    kk, vv = (np.repeat(x, N // K, axis=2) for x in (k, v))
    s = np.einsum("btnh,bsnh->bnts", q, kk) / np.sqrt(H)
    i, j = np.arange(T)[:, None], np.arange(S)[None, :]
    keep = np.ones((B, 1, T, S), bool)
    if is_causal:
        keep &= j <= i
    if local_window_size is not None:
        lw = local_window_size
        left, right = (lw, lw) if isinstance(lw, int) else lw
        keep &= (i - left <= j) & (j <= i + right)
    if key_value_seq_lengths is not None:
        keep &= j < np.asarray(key_value_seq_lengths)[:, None, None, None]
    if query_seq_lengths is not None:
        keep &= i < np.asarray(query_seq_lengths)[:, None, None, None]
    s = np.where(keep, s, LARGE_NEG)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    lse = (m + np.log(p.sum(-1, keepdims=True)))[..., 0]
    out = np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), vv)
    if query_seq_lengths is not None:
        out *= (np.arange(T)[None, :] < np.asarray(query_seq_lengths)[:, None])[:, :, None, None]
    return out, np.swapaxes(lse, 1, 2)


def lengths_of(rng, n):
    return jnp.asarray(rng.integers(0, n + 1, 2), jnp.int32)


def test_eager_calls_compile_once_per_configuration():
    """Outside jax.jit, JAX dispatches each call's programs eagerly and caches them: a repeated
    call with the same shapes and options compiles nothing (the mechanism is JAX's and the same
    on any platform; run here on the CPU)."""
    compiles = []

    def listen(key, _duration, **_kw):
        if key.endswith("backend_compile_duration"):
            compiles.append(key)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        (q, k, v, bias, mask), _, kw = make("everything", seed=3)
        kw["scale"] = 0.29  # a configuration no other test compiled
        calls = []
        for _ in range(3):
            del compiles[:]
            jax.block_until_ready(fj.dot_product_attention(q, k, v, bias, mask, **kw))
            calls.append(len(compiles))
        assert calls[0] > 0 and calls[1:] == [0, 0], calls
        del compiles[:]
        jax.block_until_ready(fj.dot_product_attention(q, k, v, bias, mask, **dict(kw, scale=0.31)))
        assert compiles, "another scale is another configuration"
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
