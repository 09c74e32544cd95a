"""Test helpers: the float64 NumPy oracle, the same naive algorithm in the input precision (bf16 and
fp16 emulated by rounding each intermediate), inputs, and flash-attn's acceptance rule."""

from __future__ import annotations

import numpy as np

try:
    import ml_dtypes
except ImportError:  # bfloat16 tests skip
    ml_dtypes = None

DTYPES = ["float64", "float32", "float16", "bfloat16"]
SCHEDULES = ["fa1", "fa2", "reference"]

# eps(dtype) of the acceptance rule, relative to the output's magnitude (max(1, max|oracle|)).
# float64 outputs are computed in float64 throughout (the scale is a double in Params), but lse is
# float32 by contract: it is compared at float32 precision, and the backward, which re-reads it,
# is float32-accurate (test_backward.py holds fa1/fa2 float64 gradients to 1e-6).
EPS = {"float64": 1e-12, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}
# fa1/fa2 gradients rebuild P from the float32 lse: float64 gradients are float32-accurate.
EPS_GRAD = dict(EPS, float64=1e-6)


def np_dtype(name):
    if name == "bfloat16":
        if ml_dtypes is None:
            import pytest

            pytest.skip("ml_dtypes is not installed")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def make(rng, shape, dtype="float32", scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np_dtype(dtype))


def make_qkv(rng, b, sq, sk, h, hk, d, dtype="float32"):
    return (make(rng, (b, sq, h, d), dtype), make(rng, (b, sk, hk, d), dtype),
            make(rng, (b, sk, hk, d), dtype))


def f64(x):
    return np.asarray(x, dtype=np.float64)


def visible(sq, sk, causal=False, window=(-1, -1)):
    """(sq, sk) bool: key j visible to query i (bottom-right aligned)."""
    left, right = window
    if causal:
        right = 0
    i = np.arange(sq)[:, None] + (sk - sq)
    j = np.arange(sk)[None, :]
    ok = np.ones((sq, sk), dtype=bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


class _Round:
    """Rounds intermediates to the storage dtype (identity for the float64 oracle)."""

    def __init__(self, dtype, exact):
        self.comp = np.float64 if exact or dtype == "float64" else np.float32
        self.store = None if exact or dtype in ("float32", "float64") else np_dtype(dtype)

    def __call__(self, x):
        x = np.asarray(x, dtype=self.comp)
        return x if self.store is None else x.astype(self.store).astype(self.comp)


def softmax_scale_of(d, softmax_scale=None):
    """The scale the core applies: softmax_scale, or 1/sqrt(d) computed in double."""
    return float(1 / np.sqrt(d) if softmax_scale is None else softmax_scale)


def _heads(x, group=1):
    """(b, s, h, d) -> (b, h*group, s, d) in float64 or the compute type."""
    x = np.swapaxes(np.asarray(x), 1, 2)
    return np.repeat(x, group, axis=1) if group > 1 else x


def alibi_bias(slopes, b, h, sq, sk):
    """(b, h, sq, sk) float64 ALiBi bias -slope[b, h] * |i + sk - sq - j| (bottom-right aligned,
    i and j counted within the sequence); slopes (h,) or (b, h), read exactly as given (float32
    in the API)."""
    sl = f64(slopes)
    sl = np.broadcast_to(sl, (b, h)) if sl.ndim == 1 else sl
    i = np.arange(sq)[:, None] + (sk - sq)
    j = np.arange(sk)[None, :]
    return -sl[:, :, None, None] * np.abs(i - j).astype(np.float64)


def score_bias(b, h, sq, sk, alibi_slopes=None, bias=None):
    """The additive score bias of a call: ALiBi's (alibi_slopes) plus an explicit float64 `bias`
    broadcastable to (b, h, sq, sk); None when neither is given."""
    total = None if alibi_slopes is None else alibi_bias(alibi_slopes, b, h, sq, sk)
    if bias is not None:
        total = f64(bias) if total is None else total + f64(bias)
    return total


def modify_scores(s, softcap=0.0, bias=None, rnd=None):
    """The score modifiers on the scaled scores s, in flash-attn's order: softcap > 0 gives
    softcap * tanh(s / softcap), then the additive bias. Returns (s', d s' / d s): the derivative
    is 1 - tanh^2 with a cap, None without. In the input precision (rnd rounding to the dtype;
    flash-attn's attention_ref with upcast=False) the cap's division, tanh and product are each
    rounded to the dtype, and the bias (float32 in flash-attn's reference) is added in the
    compute type without rounding."""
    rnd = rnd or (lambda x: x)
    g = None
    if softcap > 0:
        th = rnd(np.tanh(rnd(s / softcap)))
        s = rnd(th * softcap)
        g = rnd(1 - th * th)
    if bias is not None:
        s = s + np.asarray(bias, dtype=s.dtype)
    return s, g


def _probs(q, k, mask, scale, rnd, softcap=0.0, bias=None, with_grad=False):
    """(P, lse) of the masked, modified scores; with_grad: also d s / d (scale q.k) (None
    without a cap)."""
    s = rnd(np.matmul(rnd(q), np.swapaxes(rnd(k), -1, -2)) * scale)
    s, g = modify_scores(s, softcap, bias, rnd)
    s = np.where(mask, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    m_safe = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m_safe)
    l = e.sum(axis=-1, keepdims=True)
    p = rnd(e / np.where(l > 0, l, 1))
    with np.errstate(divide="ignore"):
        lse = np.where(l > 0, m_safe + np.log(np.where(l > 0, l, 1)), -np.inf)
    return (p, lse[..., 0], g) if with_grad else (p, lse[..., 0])


def _visible(sq, sk, causal, window, mask):
    """The window's predicate, ANDed with an element mask (broadcastable to (b, h, sq, sk))."""
    vis = visible(sq, sk, causal, window)
    return vis if mask is None else vis & mask


def forward(q, k, v, causal=False, softmax_scale=None, window=(-1, -1), dtype="float64",
            exact=True, mask=None, softcap=0.0, alibi_slopes=None, bias=None):
    """(out (b, sq, h, d), lse (b, h, sq)) of naive attention; exact=True is the float64 oracle,
    exact=False the same algorithm in the input precision. mask: an extra bool element mask,
    broadcastable to (b, h, sq, sk) (e.g. an expanded block-sparse mask). Score modifiers
    (modify_scores, flash-attn's order): softcap (0: off), alibi_slopes ((h,) or (b, h)), and an
    explicit additive `bias` broadcastable to (b, h, sq, sk); lse is of the modified scores."""
    rnd = _Round(dtype, exact)
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = softmax_scale_of(d, softmax_scale)
    g = h // hk if hk else 1
    p, lse = _probs(_heads(f64(q)), _heads(f64(k), g), _visible(sq, sk, causal, window, mask),
                    scale, rnd, softcap, score_bias(b, h, sq, sk, alibi_slopes, bias))
    o = rnd(np.matmul(p, rnd(_heads(f64(v), g))))
    return np.swapaxes(o, 1, 2).astype(np.float64), lse.astype(np.float64)


def backward(dout, q, k, v, causal=False, softmax_scale=None, window=(-1, -1), dtype="float64",
             exact=True, mask=None, softcap=0.0, alibi_slopes=None, bias=None):
    """(dq, dk, dv) of naive attention (dk, dv summed over each GQA group); score modifiers as in
    forward (the cap's 1 - tanh^2 multiplies dS; the bias gets no gradient)."""
    rnd = _Round(dtype, exact)
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = softmax_scale_of(d, softmax_scale)
    g = h // hk
    qh, kh, vh, doh = (rnd(_heads(f64(q))), rnd(_heads(f64(k), g)), rnd(_heads(f64(v), g)),
                       rnd(_heads(f64(dout))))
    p, _, gcap = _probs(qh, kh, _visible(sq, sk, causal, window, mask), scale, rnd, softcap,
                        score_bias(b, h, sq, sk, alibi_slopes, bias), with_grad=True)
    o = rnd(np.matmul(p, vh))
    dv = np.matmul(np.swapaxes(p, -1, -2), doh)
    dp = rnd(np.matmul(doh, np.swapaxes(vh, -1, -2)))
    delta = np.sum(doh * o, axis=-1, keepdims=True)
    ds = rnd(p * (dp - delta))
    if gcap is not None:
        ds = rnd(ds * gcap)
    dq = rnd(np.matmul(ds, kh) * scale)
    dk = np.matmul(np.swapaxes(ds, -1, -2), qh) * scale

    def group_sum(x):  # (b, h, sk, d) -> (b, sk, hk, d)
        return np.swapaxes(rnd(x.reshape(b, hk, g, sk, d).sum(axis=2)), 1, 2)

    return np.swapaxes(dq, 1, 2), group_sum(dk), group_sum(dv)


def max_err(a, b):
    a, b = f64(a), f64(b)
    return float(np.max(np.abs(a - b), initial=0.0))


def assert_rule(got, oracle, naive, dtype, factor=2.0, what="out", ulps=1.0, magnitude=None,
                grad=False):
    """flash-attn's rule: max|got - oracle| <= factor * max|naive_lowp - oracle| + eps(dtype),
    eps scaled by the result's magnitude (or `magnitude`) and by `ulps` where a float32 sum
    order matters."""
    got = f64(got)
    assert not np.isnan(got).any(), f"{what}: NaN in the result"
    err, nerr = max_err(got, oracle), max_err(naive, oracle)
    if magnitude is None:
        magnitude = float(np.max(np.abs(oracle), initial=0.0))
    eps = (EPS_GRAD if grad else EPS)[dtype] * ulps * max(1.0, magnitude)
    bound = factor * nerr + eps
    assert err <= bound, f"{what}: max error {err:.3e} > {factor}*{nerr:.3e} + {eps:.1e} ({dtype})"


def fwd_ulps(dtype, q, k):
    """Slack for float32 outputs: the naive float32 algorithm (NumPy/BLAS, blocked sums) is itself
    accurate to an ulp or two, and a kernel that sums seqlen_k terms in another order (and uses
    exp2) lands a few ulps further, ~sqrt(seqlen_k + headdim); with a bare eps about one float32
    case in ten would fail. The half precisions are dominated by rounding: the plain rule."""
    return 2 * np.sqrt(k.shape[1] + q.shape[3]) if dtype == "float32" else 1.0


def grad_ulps(dtype, q, k):
    """Slack for float32 gradients, (dq, dk, dv): a kernel sums in another order than NumPy's
    pairwise sums, over seqlen_k (dq) or seqlen_q x group (dk, dv), and dS = P (dP - D)
    cancels two headdim-long sums; ~sqrt(n) ulps of the gradients' common magnitude (see
    grad_magnitude). The half precisions are dominated by rounding to the dtype: the plain rule."""
    if dtype != "float32":
        return 1.0, 1.0, 1.0
    d = q.shape[3]
    n_q = k.shape[1] + d + 1
    n_kv = q.shape[1] * (q.shape[2] // max(k.shape[2], 1)) + d + 1
    return 4 * np.sqrt(n_q), 4 * np.sqrt(n_kv), 4 * np.sqrt(n_kv)


def grad_magnitude(exact):
    """One magnitude for dq, dk and dv: dq can be ~0 (one visible key) while the cancellation
    that produces it works on values the size of dv."""
    return max(float(np.max(np.abs(g), initial=0.0)) for g in exact)


def assert_lse(got, oracle, rtol=2e-5, atol=2e-5):
    got = f64(got)
    assert not np.isnan(got).any(), "lse: NaN in the result"
    inf = np.isneginf(oracle)
    assert np.array_equal(np.isneginf(got), inf), "lse: -inf exactly where a row sees no key"
    np.testing.assert_allclose(got[~inf], oracle[~inf], rtol=rtol, atol=atol)


def assert_dropout_rule(got, oracle, naive_err, dtype, p, factor=2.0, what="out",
                        magnitude=None, grad=False):
    """flash-attn's rule under dropout: the naive algorithm in the input precision has no
    dropout, so its error `naive_err` is measured on the same inputs without dropout and scaled
    by 1 / (1 - p) (the kept probabilities, and their rounding errors, grow by that factor):
    max|got - oracle| <= factor * naive_err / (1 - p) + eps(dtype), oracle with dropout."""
    got = f64(got)
    assert not np.isnan(got).any(), f"{what}: NaN in the result"
    err = max_err(got, oracle)
    if magnitude is None:
        magnitude = float(np.max(np.abs(oracle), initial=0.0))
    eps = (EPS_GRAD if grad else EPS)[dtype] * max(1.0, magnitude)
    bound = factor * naive_err / (1.0 - float(np.float32(p))) + eps
    assert err <= bound, (f"{what}: max error {err:.3e} > {factor}*{naive_err:.3e}/(1-{p}) + "
                          f"{eps:.1e} ({dtype}, dropout)")
