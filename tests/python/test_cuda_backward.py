"""The CUDA backward kernels (fa1, fa2) through flashdl.attention_backward and flashdl.torch with
torch and cupy arrays: every head dim, both dtypes, causal and windows, GQA/MQA, seqlen_q !=
seqlen_k, odd lengths, transposed and misaligned views; against the float64 oracle with
flash-attn's rule for gradients (max|gpu - oracle| <= 3 max|naive_lowp - oracle| + eps); exact zero
gradients where the mask leaves nothing; deterministic=True bitwise; the caller's stream; the
small-tile fallbacks (FLASHDL_CUDA_SMEM_LIMIT); dropout with the CPU's mask; a CPU block mask with
CUDA arrays refused (test_cuda_features.py covers dropout and block masks in depth). Skipped
entirely unless flashdl sees a CUDA device and torch.cuda or cupy is usable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

import flashdl
import masked_oracle as mo
from attn_oracle import (assert_dropout_rule, assert_rule, backward, f64, forward,
                         grad_magnitude, make, make_qkv, max_err)
from cuda_arrays import gpu_frameworks, host, torch_array

torch, cupy = gpu_frameworks()

needs_torch = pytest.mark.skipif(torch is None, reason="torch.cuda is not usable")
needs_cupy = pytest.mark.skipif(cupy is None, reason="cupy is not usable")

HEAD_DIMS = [32, 64, 96, 128, 192, 256]
SCHEDULES = ["fa1", "fa2"]

# (b, sq, sk, h, hk, causal, window, layout of q, k, v and dout)
CASES = [
    (2, 17, 17, 4, 4, False, (-1, -1), "contiguous"),
    (2, 17, 17, 4, 2, True, (-1, -1), "transposed"),     # GQA
    (1, 1, 257, 4, 1, False, (-1, -1), "padded"),        # MQA, one query row
    (1, 257, 1000, 2, 1, True, (-1, -1), "transposed"),  # seqlen_q < seqlen_k
    (1, 1000, 257, 2, 2, True, (-1, -1), "odd"),         # 743 rows see no key; no 16-byte rows
    (1, 257, 257, 2, 1, False, (32, 8), "contiguous"),   # sliding window
    (1, 130, 100, 2, 2, True, (20, -1), "padded"),
]


def case_id(c):
    return "b{}-sq{}-sk{}-h{}/{}-{}-w{}_{}-{}".format(
        c[0], c[1], c[2], c[3], c[4], "causal" if c[5] else "full", *c[6], c[7])


# ---- the problem and the check ---------------------------------------------------------------------
def problem(seed, b, sq, sk, h, hk, d, dtype):
    """q, k, v, dout as host arrays exact in dtype (float16, or ml_dtypes bfloat16)."""
    rng = np.random.default_rng(seed)
    q, k, v = make_qkv(rng, b, sq, sk, h, hk, d, dtype)
    return q, k, v, make(rng, q.shape, dtype)


def on_gpu(arrays, dtype, layout="contiguous"):
    return [torch_array(f64(x).astype(np.float32), dtype, layout) for x in arrays]


def check_grads(got, q, k, v, dout, dtype, causal=False, window=(-1, -1), softmax_scale=None):
    """flash-attn's rule for gradients against the float64 oracle; no NaN or inf anywhere. One
    magnitude for dq, dk, dv (grad_magnitude: dq can be ~0 while the cancellation that produces
    it works on values the size of dv)."""
    opts = dict(causal=causal, window=window, softmax_scale=softmax_scale)
    exact = backward(dout, q, k, v, **opts)
    low = backward(dout, q, k, v, dtype=dtype, exact=False, **opts)
    magnitude = grad_magnitude(exact)
    for name, g, e, lo in zip(("dq", "dk", "dv"), got, exact, low):
        assert np.isfinite(g).all(), f"{name}: NaN or inf in the result"
        assert_rule(g, e, lo, dtype, factor=3.0, what=name, grad=True, magnitude=magnitude)


def torch_grads(q, k, v, dout, schedule, causal=False, window=(-1, -1), **kw):
    """Forward then backward on the current stream, as autograd would: (dq, dk, dv) tensors."""
    out, lse = flashdl.attention(q, k, v, causal=causal, window_size=window, schedule=schedule,
                                 return_lse=True, **kw)
    grads = flashdl.attention_backward(dout, q, k, v, out, lse, causal=causal, window_size=window,
                                       schedule=schedule, **kw)
    for g, like in zip(grads, (q, k, v)):
        assert g.device == like.device and g.dtype == like.dtype
        assert tuple(g.shape) == tuple(like.shape)
    return grads


def poison_allocator(*like):
    """Fills and frees blocks of the outputs' sizes, so that the outputs torch.empty hands out next
    hold NaN rather than zeros: a gradient the kernels never write shows."""
    for t in like:
        torch.full_like(t, float("nan"))


# ---- torch -----------------------------------------------------------------------------------------
@needs_torch
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_torch_backward(case, dtype, d, schedule):
    b, sq, sk, h, hk, causal, window, layout = case
    hq, hk_, hv, hdout = problem(zlib.crc32(repr((case, dtype, d)).encode()), b, sq, sk, h, hk, d,
                                 dtype)
    q, k, v, dout = on_gpu((hq, hk_, hv, hdout), dtype, layout)
    poison_allocator(q, k, v)
    grads = torch_grads(q, k, v, dout, schedule, causal, window)
    torch.cuda.current_stream().synchronize()
    check_grads([host(g) for g in grads], hq, hk_, hv, hdout, dtype, causal, window)


@needs_torch
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_backward_softmax_scale_and_large_scores(dtype, schedule):
    """A given softmax_scale, and scores in the tens (q and k scaled by 4): the softmax is nearly
    one-hot, exp must not overflow, and no NaN or inf may appear."""
    hq, hk, hv, hdout = problem(21, 2, 200, 333, 4, 2, 96, dtype)
    hq, hk = (np.asarray(x * 4) for x in (hq, hk))  # powers of two: still exact in dtype
    q, k, v, dout = on_gpu((hq, hk, hv, hdout), dtype)
    grads = torch_grads(q, k, v, dout, schedule, causal=True, softmax_scale=0.3)
    torch.cuda.current_stream().synchronize()
    check_grads([host(g) for g in grads], hq, hk, hv, hdout, dtype, causal=True, softmax_scale=0.3)


@needs_torch
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("shape,causal,window,zero_q,zero_kv", [
    # b, sq, sk, h, hk, d          rows of dq that must be 0, rows (keys) of dk, dv that must be 0
    ((1, 40, 5, 2, 1, 64), True, (-1, -1), slice(0, 35), slice(0, 0)),   # causal, sq > sk
    ((1, 5, 40, 2, 2, 128), False, (0, 0), slice(0, 0), slice(0, 35)),   # keys no query sees
    ((2, 7, 0, 2, 1, 64), False, (-1, -1), slice(0, 7), slice(0, 0)),    # no keys at all
    ((2, 0, 9, 4, 2, 256), False, (-1, -1), slice(0, 0), slice(0, 9)),   # no queries at all
], ids=["causal-empty-rows", "unseen-keys", "no-keys", "no-queries"])
def test_torch_masked_rows_and_keys_get_exact_zero_gradients(schedule, shape, causal, window,
                                                             zero_q, zero_kv):
    hq, hk, hv, hdout = problem(22, *shape, "float16")
    q, k, v, dout = on_gpu((hq, hk, hv, hdout), "float16")
    poison_allocator(q, k, v)
    dq, dk, dv = torch_grads(q, k, v, dout, schedule, causal, window)
    torch.cuda.current_stream().synchronize()
    assert torch.all(dq[:, zero_q] == 0), "dq of rows that see no key"
    assert torch.all(dk[:, zero_kv] == 0) and torch.all(dv[:, zero_kv] == 0), \
        "dk, dv of keys no query sees"
    check_grads([host(g) for g in (dq, dk, dv)], hq, hk, hv, hdout, "float16", causal, window)


@needs_torch
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_torch_deterministic_is_bitwise(schedule):
    """deterministic=True: dq, dk and dv bitwise equal over 50 calls (fa2's default float atomics
    for dq are replaced; fa1 never needs them)."""
    hq, hk, hv, hdout = problem(23, 2, 1000, 1000, 4, 2, 128, "float16")
    q, k, v, dout = on_gpu((hq, hk, hv, hdout), "float16")
    out, lse = flashdl.attention(q, k, v, causal=True, schedule=schedule, return_lse=True)
    first = flashdl.attention_backward(dout, q, k, v, out, lse, causal=True, schedule=schedule,
                                       deterministic=True)
    for _ in range(50):
        again = flashdl.attention_backward(dout, q, k, v, out, lse, causal=True,
                                           schedule=schedule, deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(again, first))
    check_grads([host(g) for g in first], hq, hk, hv, hdout, "float16", causal=True)


@needs_torch
def test_torch_default_fa2_dk_dv_reproducible_dq_close():
    """Without deterministic, fa2's dq may change in its last bits (atomics), dk and dv may not."""
    hq, hk, hv, hdout = problem(24, 2, 1000, 1000, 4, 2, 64, "bfloat16")
    q, k, v, dout = on_gpu((hq, hk, hv, hdout), "bfloat16")
    out, lse = flashdl.attention(q, k, v, schedule="fa2", return_lse=True)
    dq0, dk0, dv0 = flashdl.attention_backward(dout, q, k, v, out, lse, schedule="fa2")
    ulp = 2.0**-7 * max(1.0, float(dq0.abs().max()))
    for _ in range(50):
        dq, dk, dv = flashdl.attention_backward(dout, q, k, v, out, lse, schedule="fa2")
        assert torch.equal(dk, dk0) and torch.equal(dv, dv0)
        assert float((dq.float() - dq0.float()).abs().max()) <= 2 * ulp


@needs_torch
@pytest.mark.parametrize("schedule", ["fa1", "fa2", "auto"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_torch_backward_uses_the_callers_stream(schedule, deterministic):
    """On a busy side stream: the backward must queue behind the work already there (dout is
    written after a sleep, on that stream) and must not synchronise the device (the stream is still
    busy when flashdl returns)."""
    hq, hk, hv, hdout = problem(25, 2, 300, 300, 4, 2, 64, "float16")
    q, k, v, dout = on_gpu((hq, hk, hv, hdout), "float16")
    out, lse = flashdl.attention(q, k, v, causal=True, schedule=schedule, return_lse=True)
    dout2 = torch.full_like(dout, float("nan"))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time
        dout2.copy_(dout)
        grads = flashdl.attention_backward(dout2, q, k, v, out, lse, causal=True,
                                           schedule=schedule, deterministic=deterministic)
        busy = not side.query()
    side.synchronize()
    assert busy, "flashdl synchronised the device or ran before the stream's queued work"
    check_grads([host(g) for g in grads], hq, hk, hv, hdout, "float16", causal=True)


@needs_torch
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_autograd(dtype, schedule):
    """flashdl.torch.attention on CUDA leaves stored as SDPA's (b, h, s, d), passed as transposed
    views: gradients reach the leaves on their device, in their dtype and layout, within the rule;
    deterministic=True through autograd gives bitwise equal gradients twice."""
    import flashdl.torch

    hq, hk, hv, hdout = problem(26, 2, 97, 130, 4, 2, 64, dtype)
    leaves = [t.transpose(1, 2).contiguous().requires_grad_()
              for t in on_gpu((hq, hk, hv), dtype)]
    dout = on_gpu((hdout,), dtype)[0]

    def run(deterministic):
        for x in leaves:
            x.grad = None
        q, k, v = (x.transpose(1, 2) for x in leaves)
        out = flashdl.torch.attention(q, k, v, causal=True, schedule=schedule,
                                      deterministic=deterministic)
        assert out.device == q.device and out.dtype == q.dtype
        out.backward(dout)
        return [x.grad.clone() for x in leaves]

    grads = run(False)
    for g, x in zip(grads, leaves):
        assert g.device == x.device and g.dtype == x.dtype and g.shape == x.shape
    check_grads([host(g.transpose(1, 2)) for g in grads], hq, hk, hv, hdout, dtype, causal=True)
    first, second = run(True), run(True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@needs_torch
def test_torch_cpu_block_mask_backward_is_refused():
    """The backward's block mask must be on the device of q too: a NumPy mask with CUDA arrays is
    a ValueError naming block_mask and the device (test_cuda_features.py runs CUDA masks)."""
    q = torch.randn(1, 8, 2, 64, device="cuda", dtype=torch.float16)
    out, lse = flashdl.attention(q, q, q, return_lse=True,
                                 block_mask=torch.ones(1, 1, dtype=torch.bool, device=q.device))
    with pytest.raises(ValueError, match=rf"\bblock_mask\b.*\bcuda:{q.device.index}\b"):
        flashdl.attention_backward(torch.ones_like(out), q, q, q, out, lse,
                                   block_mask=np.ones((1, 1), dtype=bool))


@needs_torch
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_torch_dropout_is_the_cpu_mask(schedule, deterministic):
    """Dropout on CUDA arrays applies the mask flashdl.dropout_mask returns (the CPU's), forward
    and backward: against the float64 oracle with that mask, flash-attn's rule with the naive
    low-precision error taken without dropout and scaled by 1 / (1 - p) (test_cuda_features.py
    checks the mask bit for bit)."""
    hq, hk, hv, hdout = problem(29, 2, 70, 90, 4, 2, 64, "float16")
    q, k, v, dout = on_gpu((hq, hk, hv, hdout), "float16")
    opts = dict(dropout_p=0.2, seed=31337, offset=3)
    out, lse = flashdl.attention(q, k, v, schedule=schedule, return_lse=True, **opts)
    grads = flashdl.attention_backward(dout, q, k, v, out, lse, schedule=schedule,
                                       deterministic=deterministic, **opts)
    torch.cuda.current_stream().synchronize()
    hq, hk, hv, hdout = (f64(x) for x in (hq, hk, hv, hdout))
    keep = flashdl.dropout_mask(2, 4, 70, 90, opts["dropout_p"], opts["seed"], opts["offset"])
    visible = np.ones((70, 90), dtype=bool)
    want_out = mo.forward(hq, hk, hv, visible, keep, opts["dropout_p"])[0]
    low_err = max_err(forward(hq, hk, hv, dtype="float16", exact=False)[0],
                      forward(hq, hk, hv)[0])
    assert_dropout_rule(host(out), want_out, low_err, "float16", opts["dropout_p"])
    want = mo.backward(hdout, hq, hk, hv, visible, keep, opts["dropout_p"])
    exact = backward(hdout, hq, hk, hv)
    naive = backward(hdout, hq, hk, hv, dtype="float16", exact=False)
    for name, g, w, e, n in zip(("dq", "dk", "dv"), grads, want, exact, naive):
        assert_dropout_rule(host(g), w, max_err(n, e), "float16", opts["dropout_p"], factor=3.0,
                            what=name, magnitude=grad_magnitude(want), grad=True)


# The child of test_torch_fallback_tiles: fwd + bwd under FLASHDL_CUDA_SMEM_LIMIT, gradients saved.
FALLBACK_CHILD = r"""
import json, sys
import numpy as np, torch, flashdl
from cuda_arrays import torch_array
args = json.loads(sys.argv[1])
data = np.load(args["inputs"])
result = {}
for schedule in ("fa1", "fa2"):
    q, k, v, dout = (torch_array(data[n], args["dtype"], "contiguous") for n in ("q", "k", "v", "dout"))
    out, lse = flashdl.attention(q, k, v, causal=True, schedule=schedule, return_lse=True)
    for name, g in zip(("dq", "dk", "dv"), flashdl.attention_backward(
            dout, q, k, v, out, lse, causal=True, schedule=schedule)):
        result[f"{schedule}_{name}"] = g.double().cpu().numpy()
np.savez(args["out"], **result)
"""


@needs_torch
@pytest.mark.parametrize("d", [128, 192, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_fallback_tiles(tmp_path, dtype, d):
    """With the shared memory the launchers plan against capped at 99 KiB (the smallest sm_80+
    opt-in), they choose the smaller-tile variants an H100 never picks; in a fresh process, since
    the cap is read from the environment."""
    hq, hk, hv, hdout = problem(27, 1, 300, 257, 4, 2, d, dtype)
    np.savez(tmp_path / "inputs.npz", **{n: f64(x).astype(np.float32) for n, x in
                                         zip(("q", "k", "v", "dout"), (hq, hk, hv, hdout))})
    args = dict(inputs=str(tmp_path / "inputs.npz"), out=str(tmp_path / "grads.npz"), dtype=dtype)
    env = dict(os.environ, FLASHDL_CUDA_SMEM_LIMIT="101376",
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__)] + sys.path))
    res = subprocess.run([sys.executable, "-c", FALLBACK_CHILD, json.dumps(args)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    got = np.load(tmp_path / "grads.npz")
    for schedule in ("fa1", "fa2"):
        check_grads([got[f"{schedule}_{n}"] for n in ("dq", "dk", "dv")], hq, hk, hv, hdout, dtype,
                    causal=True)


# ---- cupy (float16: cupy has no bfloat16) -----------------------------------------------------------
@needs_cupy
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("d", [64, 256])
def test_cupy_backward_on_a_non_blocking_stream(schedule, d):
    hq, hk, hv, hdout = problem(28, 2, 97, 130, 4, 1, d, "float16")
    with cupy.cuda.Stream(non_blocking=True) as stream:
        q, k, v, dout = (cupy.asarray(x) for x in (hq, hk, hv, hdout))
        out, lse = flashdl.attention(q, k, v, causal=True, schedule=schedule, return_lse=True)
        grads = flashdl.attention_backward(dout, q, k, v, out, lse, causal=True,
                                           schedule=schedule)
        stream.synchronize()
    for g, like in zip(grads, (q, k, v)):
        assert isinstance(g, cupy.ndarray) and g.device == like.device and g.dtype == like.dtype
    check_grads([cupy.asnumpy(g).astype(np.float64) for g in grads], hq, hk, hv, hdout, "float16",
                causal=True)
