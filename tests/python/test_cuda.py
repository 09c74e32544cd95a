"""CUDA (skipped without a GPU and torch or cupy): results on the caller's device and stream."""

import numpy as np
import pytest

import flashdl
from attn_oracle import assert_rule, backward, forward, grad_magnitude

if flashdl.info()["cuda_device_count"] == 0:
    pytest.skip("no CUDA device: " + flashdl.info()["cuda_status"], allow_module_level=True)


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    return torch


def _cupy():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("cupy sees no GPU")
    except Exception as e:  # cupy's CUDA errors
        pytest.skip(f"cupy unusable: {e}")
    return cupy


def host_inputs(dtype="float16", shape=(2, 64, 64, 4, 2, 64), seed=0):
    b, sq, sk, h, hk, d = shape
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32)
            for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d))]


def check_against_oracle(out_host, host, dtype, causal):
    o_ref, _ = forward(*host, causal=causal)
    o_low, _ = forward(*host, causal=causal, dtype=dtype, exact=False)
    assert_rule(out_host, o_ref, o_low, dtype)  # float16/bfloat16 only: the plain rule


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("schedule", ["auto", "fa1", "fa2"])
def test_torch_cuda_forward(dtype, causal, schedule):
    torch = _torch()
    tdt = getattr(torch, dtype)
    host = host_inputs()
    q, k, v = (torch.from_numpy(x).to("cuda", tdt) for x in host)
    host = [x.double().cpu().numpy() for x in (q, k, v)]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out, lse = flashdl.attention(q, k, v, causal=causal, schedule=schedule, return_lse=True)
    stream.synchronize()
    assert out.device == q.device and lse.device == q.device and out.dtype == tdt
    check_against_oracle(out.double().cpu().numpy(), host, dtype, causal)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_cuda_autograd(dtype):
    """loss.backward() through flashdl.torch.attention on CUDA: gradients on the device, in the
    dtype of the inputs, within flash-attn's rule for gradients (3x the naive low-precision
    backward's error) of the float64 oracle."""
    torch = _torch()
    import flashdl.torch

    tdt = getattr(torch, dtype)
    host = host_inputs(shape=(1, 32, 32, 2, 2, 64), seed=1)
    q, k, v = (torch.from_numpy(x).to("cuda", tdt).requires_grad_() for x in host)
    host = [x.detach().double().cpu().numpy() for x in (q, k, v)]
    out = flashdl.torch.attention(q, k, v, causal=True)
    out.float().sum().backward()
    dout = np.ones(host[0].shape)
    exact = backward(dout, *host, causal=True)
    low = backward(dout, *host, causal=True, dtype=dtype, exact=False)
    for name, x, e, lo in zip(("dq", "dk", "dv"), (q, k, v), exact, low):
        assert x.grad.device == x.device and x.grad.dtype == tdt and x.grad.shape == x.shape
        assert_rule(x.grad.double().cpu().numpy(), e, lo, dtype, factor=3.0, what=name,
                    grad=True, magnitude=grad_magnitude(exact))


@pytest.mark.parametrize("dtype", ["float16"])
def test_cupy_forward(dtype):
    cupy = _cupy()
    host = host_inputs()
    q, k, v = (cupy.asarray(x.astype(dtype)) for x in host)
    out, lse = flashdl.attention(q, k, v, return_lse=True)
    assert isinstance(out, cupy.ndarray) and out.device == q.device
    check_against_oracle(cupy.asnumpy(out).astype(np.float64),
                         [cupy.asnumpy(x).astype(np.float64) for x in (q, k, v)], dtype, False)


def test_device_mismatch_names_the_argument():
    torch = _torch()
    q, k, v = (torch.randn(1, 8, 2, 64, dtype=torch.float16) for _ in range(3))
    with pytest.raises(ValueError, match=r"\bk\b"):
        flashdl.attention(q.cuda(), k, v.cuda())


def test_reference_schedule_is_cpu_only():
    torch = _torch()
    q = torch.randn(1, 8, 2, 64, dtype=torch.float16, device="cuda")
    with pytest.raises(RuntimeError, match="schedule"):
        flashdl.attention(q, q, q, schedule="reference")
