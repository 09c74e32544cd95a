"""Smoke test of an installed flashdl wheel, run by tools/build_wheels.sh --smoke inside a fresh
virtual environment: the package imports from that environment (not from a source tree), has the
expected version, and its attention forward and backward agree with naive NumPy attention.

    python tools/wheel_smoke.py VERSION
"""
import os
import sys

import numpy as np

import flashdl


def naive(q, k, v, causal):
    s = np.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(q.shape[-1])
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        s = np.where(np.arange(sk)[None, :] <= np.arange(sq)[:, None] + sk - sq, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhij,bjhd->bihd", p / p.sum(-1, keepdims=True), v)


def main():
    where = os.path.dirname(flashdl.__file__)
    assert where.startswith(sys.prefix), f"flashdl imported from {where}, not from {sys.prefix}"
    info = flashdl.info()
    assert info["version"] == sys.argv[1], (info["version"], sys.argv[1])
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 65, 4, 32)) for _ in range(3))
    for causal in (False, True):
        for schedule in ("fa1", "fa2"):
            out, lse = flashdl.attention(q, k, v, causal=causal, schedule=schedule,
                                         return_lse=True)
            err = np.abs(out - naive(q, k, v, causal)).max()
            assert err < 1e-10, (causal, schedule, err)
            grads = flashdl.attention_backward(np.ones_like(out), q, k, v, out, lse,
                                               causal=causal, schedule=schedule)
            assert all(np.isfinite(g).all() for g in grads)
    try:
        flashdl.attention(q, k[..., :16], v)
    except ValueError as e:
        assert "headdim" in str(e), e
    else:
        raise AssertionError("a headdim mismatch was accepted")
    print(f"wheel smoke test passed: flashdl {info['version']} from {where}, "
          f"CPU kernels {info['cpu_isa']}, backends {info['backends']}")


if __name__ == "__main__":
    main()
