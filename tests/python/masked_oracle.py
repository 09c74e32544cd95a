"""A float64 oracle for windows and dropout, built from first principles: the visibility predicate
of DESIGN.md evaluated element by element, and an explicit dropout keep-mask (the one
flashdl.dropout_mask returns) applied to the probabilities: out = (P * Z) v, Z = keep / (1 - p),
lse of the undropped scores. Optional score modifiers (softcap, ALiBi slopes) as in
attn_oracle.modify_scores."""

from __future__ import annotations

import functools

import numpy as np

from attn_oracle import f64, modify_scores, score_bias, softmax_scale_of


@functools.lru_cache(maxsize=256)
def brute_visible(sq, sk, left, right, causal=False):
    """(sq, sk) bool by the contract's predicate, one element at a time:
    visible iff i + sk - sq - left <= j <= i + sk - sq + right (-1: unbounded; causal: right 0).
    Cached, so read-only."""
    if causal:
        right = 0
    ok = np.zeros((sq, sk), dtype=bool)
    for i in range(sq):
        c = i + sk - sq
        for j in range(sk):
            ok[i, j] = (left == -1 or c - left <= j) and (right == -1 or j <= c + right)
    ok.flags.writeable = False
    return ok


def close(got, want, tol, what, magnitude=None):
    """max|got - want| <= tol * max(1, magnitude), magnitude defaulting to max|want|; no NaN."""
    got = np.asarray(got, dtype=np.float64)
    assert not np.isnan(got).any(), f"{what}: NaN"
    mag = max(1.0, float(np.max(np.abs(want), initial=0.0)) if magnitude is None else magnitude)
    err = float(np.max(np.abs(got - want), initial=0.0))
    assert err <= tol * mag, f"{what}: max error {err:.3e} > {tol:.1e} * {mag:.3g}"


def keep_scale(p):
    """1 / (1 - p) with p rounded to float32, as the core receives it."""
    return 1.0 / (1.0 - float(np.float32(p)))


def _heads(x, group=1):
    x = np.swapaxes(f64(x), 1, 2)  # (b, s, h, d) -> (b, h, s, d)
    return np.repeat(x, group, axis=1) if group > 1 else x


def _probs(q, k, visible, scale, softcap=0.0, bias=None, with_grad=False):
    """(P, lse) of the visible, modified scores; with_grad: also d s / d (scale q.k) (None
    without a cap)."""
    s, g = modify_scores(np.matmul(q, np.swapaxes(k, -1, -2)) * scale, softcap, bias)
    s = np.where(visible, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    p = e / np.where(l > 0, l, 1.0)
    with np.errstate(divide="ignore"):
        lse = np.where(l > 0, m + np.log(np.where(l > 0, l, 1.0)), -np.inf)[..., 0]
    return (p, lse, g) if with_grad else (p, lse)


def _zmat(keep, p, shape):
    """The dropout multipliers (b, h, sq, sk): 1 without dropout."""
    if keep is None:
        return np.ones(shape)
    return np.where(keep, keep_scale(p), 0.0)


def forward(q, k, v, visible, keep=None, p=0.0, softmax_scale=None, softcap=0.0,
            alibi_slopes=None):
    """(out (b, sq, h, d), lse (b, h, sq)) in float64; visible (sq, sk) bool; keep (b, h, sq, sk)
    bool or None; softcap (0: off) and alibi_slopes ((h,) or (b, h), None: off) modify the
    scores before the mask (lse is of the modified, undropped scores)."""
    b, sq, h = q.shape[:3]
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    scale = softmax_scale_of(q.shape[3], softmax_scale)
    P, lse = _probs(_heads(q), _heads(k, g), visible, scale, softcap,
                    score_bias(b, h, sq, sk, alibi_slopes))
    o = np.matmul(P * _zmat(keep, p, P.shape), _heads(v, g))
    return np.swapaxes(o, 1, 2), lse


def backward(dout, q, k, v, visible, keep=None, p=0.0, softmax_scale=None, softcap=0.0,
             alibi_slopes=None):
    """(dq, dk, dv) in float64, dk and dv summed over each GQA group; modifiers as in forward
    (dS carries the cap's 1 - tanh^2; the slopes get no gradient)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    scale = softmax_scale_of(d, softmax_scale)
    qh, kh, vh, doh = _heads(q), _heads(k, g), _heads(v, g), _heads(dout)
    P, _, G = _probs(qh, kh, visible, scale, softcap, score_bias(b, h, sq, sk, alibi_slopes),
                     with_grad=True)
    Z = _zmat(keep, p, P.shape)
    dv = np.matmul(np.swapaxes(P * Z, -1, -2), doh)
    dP = np.matmul(doh, np.swapaxes(vh, -1, -2)) * Z
    dS = P * (dP - np.sum(P * dP, axis=-1, keepdims=True))
    if G is not None:
        dS = dS * G
    dq = np.matmul(dS, kh) * scale
    dk = np.matmul(np.swapaxes(dS, -1, -2), qh) * scale

    def group_sum(x):  # (b, h, sk, d) -> (b, sk, hk, d)
        return np.swapaxes(x.reshape(b, hk, g, sk, d).sum(axis=2), 1, 2)

    return np.swapaxes(dq, 1, 2), group_sum(dk), group_sum(dv)


def numerical_grads(f, arrays, dout, h=1e-6):
    """Central differences of sum(f(*arrays) * dout) for every element of every float64 array."""
    out = []
    for idx in range(len(arrays)):
        a = [x.copy() for x in arrays]
        g = np.zeros_like(a[idx])
        flat, gflat = a[idx].reshape(-1), g.reshape(-1)
        for n in range(flat.size):
            x0 = flat[n]
            flat[n] = x0 + h
            up = np.sum(f(*a) * dout)
            flat[n] = x0 - h
            down = np.sum(f(*a) * dout)
            flat[n] = x0
            gflat[n] = (up - down) / (2 * h)
        out.append(g)
    return out
