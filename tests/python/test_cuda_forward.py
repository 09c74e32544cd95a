"""The CUDA forward kernels (fa1, fa2) through flashdl.attention with torch and cupy arrays: every
head dim, both dtypes, causal and windows, GQA/MQA, seqlen_q != seqlen_k, odd lengths, strided and
misaligned views, empty rows; results on the caller's device, work on the caller's stream.
Skipped entirely unless flashdl sees a CUDA device and torch.cuda or cupy is usable."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

import flashdl
from cuda_arrays import gpu_frameworks, host, torch_array

torch, cupy = gpu_frameworks()

needs_torch = pytest.mark.skipif(torch is None, reason="torch.cuda is not usable")
needs_cupy = pytest.mark.skipif(cupy is None, reason="cupy is not usable")

HEAD_DIMS = [32, 64, 96, 128, 192, 256]
EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}

# (b, sq, sk, h, hk, causal, window, layout)
CASES = [
    (2, 17, 17, 4, 4, False, (-1, -1), "contiguous"),
    (2, 17, 17, 4, 4, True, (-1, -1), "transposed"),
    (1, 1, 257, 4, 1, False, (-1, -1), "padded"),
    (1, 257, 1000, 2, 1, True, (-1, -1), "transposed"),
    (1, 1000, 257, 2, 2, True, (-1, -1), "odd"),
    (1, 257, 257, 2, 1, False, (32, 8), "contiguous"),
    (1, 130, 100, 2, 2, True, (20, -1), "padded"),
]


# ---- the oracle (float64) and the naive algorithm in the input precision, on the host ----------
def _round(x, dtype):
    """x rounded to float16/bfloat16, returned as float32."""
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    return t.to(torch.bfloat16).to(torch.float32).numpy()


def _visible(sq, sk, causal, window):
    left, right = window
    right = 0 if causal else right
    i = np.arange(sq)[:, None] + (sk - sq)
    j = np.arange(sk)[None, :]
    ok = np.ones((sq, sk), dtype=bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def naive(q, k, v, causal, window, dtype=None):
    """(out (b, sq, h, d), lse (b, h, sq)); dtype=None is the float64 oracle, else float32 compute
    with P and out rounded to dtype."""
    comp = np.float64 if dtype is None else np.float32
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    qh = np.swapaxes(q, 1, 2).astype(comp)
    kh = np.repeat(np.swapaxes(k, 1, 2), g, axis=1).astype(comp)
    vh = np.repeat(np.swapaxes(v, 1, 2), g, axis=1).astype(comp)
    scale = comp(np.float32(1.0 / math.sqrt(d)))
    s = np.where(_visible(sq, sk, causal, window), qh @ np.swapaxes(kh, -1, -2) * scale, -np.inf)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    m0 = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m0)
    l = e.sum(axis=-1, keepdims=True)
    p = e / np.where(l > 0, l, 1)
    if dtype is not None:
        p = _round(p, dtype)
    o = p @ vh
    if dtype is not None:
        o = _round(o, dtype)
    with np.errstate(divide="ignore"):
        lse = np.where(l > 0, m0 + np.log(np.where(l > 0, l, 1)), -np.inf)[..., 0]
    return np.swapaxes(o, 1, 2).astype(np.float64), lse.astype(np.float64)


def check(out, lse, q, k, v, causal, window, dtype):
    """flash-attn's rule on out; lse -inf exactly for empty rows, else close."""
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "NaN in the result"
    ref, ref_lse = naive(q, k, v, causal, window)
    low, _ = naive(q, k, v, causal, window, dtype)
    err, low_err = np.abs(out - ref).max(initial=0), np.abs(low - ref).max(initial=0)
    bound = 2 * low_err + EPS[dtype] * max(1.0, np.abs(ref).max(initial=0))
    assert err <= bound, f"out: max error {err:.3e} > {bound:.3e}"
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), empty), "lse must be -inf exactly for empty rows"
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=1e-4, atol=1e-3)
    assert np.all(out[np.broadcast_to(empty.transpose(0, 2, 1)[..., None], out.shape)] == 0)


# ---- torch ---------------------------------------------------------------------------------------
def inputs(rng, b, sq, sk, h, hk, d, dtype):
    """Random inputs rounded to dtype, as float32 host arrays."""
    shapes = ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d))
    return [_round(rng.standard_normal(s).astype(np.float32), dtype) for s in shapes]


@needs_torch
@pytest.mark.parametrize("schedule", ["fa1", "fa2"])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-sq{}-sk{}-h{}/{}-{}-w{}-{}".format(
    c[0], c[1], c[2], c[3], c[4], "causal" if c[5] else "full", c[6], c[7]))
def test_torch_forward(case, dtype, d, schedule):
    b, sq, sk, h, hk, causal, window, layout = case
    rng = np.random.default_rng(zlib.crc32(repr((case, dtype, d)).encode()))
    hq, hk_, hv = inputs(rng, b, sq, sk, h, hk, d, dtype)
    q, k, v = (torch_array(x, dtype, layout) for x in (hq, hk_, hv))
    out, lse = flashdl.attention(q, k, v, causal=causal, window_size=window, schedule=schedule,
                                 return_lse=True)
    torch.cuda.current_stream().synchronize()
    assert out.device == q.device and lse.device == q.device
    assert out.dtype == q.dtype and tuple(out.shape) == tuple(q.shape)
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (b, h, sq)
    check(host(out), host(lse), hq, hk_, hv, causal, window, dtype)


@needs_torch
@pytest.mark.parametrize("schedule", ["fa1", "fa2", "auto"])
def test_torch_uses_the_callers_stream(schedule):
    """On a busy side stream: flashdl must queue behind the work already there (q2 is written after
    a sleep, on that stream) and must not synchronise the device (the stream is still busy when
    flashdl returns)."""
    rng = np.random.default_rng(7)
    hq, hk, hv = inputs(rng, 2, 300, 300, 4, 2, 64, "float16")
    q, k, v = (torch_array(x, "float16", "contiguous") for x in (hq, hk, hv))
    q2 = torch.full_like(q, float("nan"))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time
        q2.copy_(q)
        out, lse = flashdl.attention(q2, k, v, causal=True, schedule=schedule, return_lse=True)
        busy = not side.query()
    side.synchronize()
    assert busy, "flashdl synchronised the device or ran before the stream's queued work"
    check(host(out), host(lse), hq, hk, hv, True, (-1, -1), "float16")


@needs_torch
@pytest.mark.skipif(torch is None or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_torch_second_device_keeps_current_device():
    rng = np.random.default_rng(8)
    hq, hk, hv = inputs(rng, 1, 65, 80, 2, 1, 128, "bfloat16")
    q, k, v = (torch_array(x, "bfloat16", "contiguous", device="cuda:1") for x in (hq, hk, hv))
    torch.cuda.set_device(0)  # flashdl switches to the arrays' device and back
    out, lse = flashdl.attention(q, k, v, return_lse=True)
    assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(1)
    assert out.device == q.device and lse.device == q.device
    check(host(out), host(lse), hq, hk, hv, False, (-1, -1), "bfloat16")


@needs_torch
@pytest.mark.parametrize("schedule", ["fa1", "fa2"])
def test_torch_repeatable_bitwise(schedule):
    rng = np.random.default_rng(9)
    q, k, v = (torch_array(x, "float16", "contiguous")
               for x in inputs(rng, 2, 1000, 1000, 4, 2, 128, "float16"))
    first, first_lse = flashdl.attention(q, k, v, causal=True, schedule=schedule, return_lse=True)
    for _ in range(20):
        out, lse = flashdl.attention(q, k, v, causal=True, schedule=schedule, return_lse=True)
        assert torch.equal(out, first) and torch.equal(lse, first_lse)


@needs_torch
@pytest.mark.parametrize("schedule", ["fa1", "fa2"])
def test_torch_backward_runs(schedule):
    """The CUDA backward runs: gradients on q's device in q's dtype, finite, and close to the CPU
    backend's float32 gradients of the same values (test_cuda_backward.py checks them in depth)."""
    rng = np.random.default_rng(11)
    hq, hk, hv = inputs(rng, 1, 40, 40, 2, 1, 64, "float16")
    hdout = inputs(rng, 1, 40, 40, 2, 1, 64, "float16")[0]
    q, k, v, dout = (torch_array(x, "float16", "contiguous") for x in (hq, hk, hv, hdout))
    out, lse = flashdl.attention(q, k, v, causal=True, schedule=schedule, return_lse=True)
    grads = flashdl.attention_backward(dout, q, k, v, out, lse, causal=True, schedule=schedule)
    torch.cuda.current_stream().synchronize()
    cpu_out, cpu_lse = flashdl.attention(hq, hk, hv, causal=True, return_lse=True)
    cpu = flashdl.attention_backward(hdout, hq, hk, hv, cpu_out, cpu_lse, causal=True)
    for name, g, like, ref in zip(("dq", "dk", "dv"), grads, (q, k, v), cpu):
        assert g.device == like.device and g.dtype == like.dtype and g.shape == like.shape, name
        assert torch.isfinite(g).all(), f"{name}: not finite"
        err = np.abs(host(g) - ref).max()
        assert err <= 1e-2 * max(1.0, np.abs(ref).max()), f"{name}: max error {err:.3e}"


@needs_torch
@pytest.mark.parametrize("where", ["numpy", "torch-cpu"])
def test_torch_cpu_block_mask_is_refused(where):
    """A block mask for CUDA arrays must be on the device of q, dense or varlen: a NumPy or CPU
    torch mask is a ValueError naming block_mask and the device it should be on, never copied
    behind the caller's back (test_cuda_features.py runs CUDA masks)."""
    q = torch.randn(1, 8, 2, 64, device="cuda", dtype=torch.float16)
    mask = np.ones((1, 1), dtype=bool)
    if where == "torch-cpu":
        mask = torch.from_numpy(mask)
    match = rf"\bblock_mask\b.*\bcuda:{q.device.index}\b"
    with pytest.raises(ValueError, match=match):
        flashdl.attention(q, q, q, block_mask=mask)
    cu = np.array([0, 3, 8], dtype=np.int32)
    with pytest.raises(ValueError, match=match):
        flashdl.attention_varlen(q[0], q[0], q[0], cu, cu, 5, 5, block_mask=mask)


# ---- cupy (float16: cupy has no bfloat16) ---------------------------------------------------------
@needs_cupy
@pytest.mark.parametrize("schedule", ["fa1", "fa2"])
@pytest.mark.parametrize("d", [64, 256])
def test_cupy_forward_on_callers_stream(schedule, d):
    rng = np.random.default_rng(10)
    hq, hk, hv = inputs(rng, 2, 97, 130, 4, 1, d, "float16")
    q, k, v = (cupy.asarray(x.astype(np.float16)) for x in (hq, hk, hv))
    with cupy.cuda.Stream(non_blocking=True) as stream:
        out, lse = flashdl.attention(q, k, v, causal=True, schedule=schedule, return_lse=True)
        stream.synchronize()
    assert isinstance(out, cupy.ndarray) and out.device == q.device and lse.device == q.device
    check(cupy.asnumpy(out).astype(np.float64), cupy.asnumpy(lse).astype(np.float64),
          hq, hk, hv, True, (-1, -1), "float16")
