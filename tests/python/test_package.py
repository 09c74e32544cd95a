"""The package: import cost, info(), threads, the CPU kernels by name, `python -m flashdl`."""

import os
import subprocess
import sys

import numpy as np
import pytest

import flashdl


def run_python(code, *args, timeout=120):
    return subprocess.run([sys.executable, *args] + ([] if code is None else ["-c", code]),
                          capture_output=True, text=True, timeout=timeout)


def test_import_does_not_import_frameworks():
    r = run_python("import sys, flashdl; flashdl.info(); "
                   "print(sorted(m for m in ('torch', 'jax', 'cupy') if m in sys.modules))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_framework_modules_load_by_attribute():
    # flashdl.<framework> without an explicit import loads that very module.
    r = run_python("import flashdl; print(flashdl.jax.__name__, flashdl.torch.__name__)")
    if r.returncode != 0 and "No module named" in r.stderr:
        pytest.skip("torch or jax is not installed")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["flashdl.jax", "flashdl.torch"]


def test_info():
    info = flashdl.info()
    assert info["version"] == flashdl.__version__
    assert "cpu" in info["backends"]
    assert isinstance(info["cpu_isa"], str) and info["cpu_isa"]
    assert info["num_threads"] >= 1 and info["fa1_sram_bytes"] > 0
    assert isinstance(info["cuda_device_count"], int) and isinstance(info["cuda_status"], str)
    assert isinstance(info["cuda_architectures"], list)
    if "cuda" not in info["backends"]:
        assert info["cuda_device_count"] == 0
        # The build says why it has no CUDA backend (FLASHDL_CUDA and what it found).
        assert info["cuda_status"].startswith("flashdl was built without the CUDA backend (FLASHDL_CUDA=")


def test_set_num_threads():
    default = flashdl.info()["num_threads"]
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 33, 4, 16)).astype(np.float32)
    expect = flashdl.attention(q, q, q)
    try:
        flashdl.set_num_threads(1)
        assert flashdl.info()["num_threads"] == 1
        np.testing.assert_allclose(flashdl.attention(q, q, q), expect, rtol=0, atol=1e-6)
        with pytest.raises(ValueError, match=r"\bn\b"):
            flashdl.set_num_threads(-1)
        with pytest.raises(TypeError, match=r"\bn\b"):
            flashdl.set_num_threads(1.5)
    finally:
        flashdl.set_num_threads(0)
    assert flashdl.info()["num_threads"] == default


def test_torch_submodule_is_lazy():
    r = run_python("import sys, flashdl; assert 'torch' not in sys.modules; "
                   "import importlib.util as u; print(u.find_spec('torch') is not None)")
    assert r.returncode == 0, r.stderr
    if r.stdout.strip() == "True":
        r = run_python("import flashdl; print(flashdl.torch.attention.__name__)")
        assert r.returncode == 0 and r.stdout.strip() == "attention", r.stderr


@pytest.mark.parametrize("args", [
    ["--seqlen", "256", "--heads", "2", "--headdim", "32"],
    ["--seqlen", "200", "--seqlen-k", "300", "--heads", "4", "--heads-kv", "2", "--causal",
     "--dtype", "bfloat16", "--schedule", "fa1"],
])
def test_main(args):
    pytest.importorskip("ml_dtypes")
    r = run_python(None, "-m", "flashdl", "--device", "cpu", *args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "max |flashdl - reference|" in r.stdout and "OK" in r.stdout
    assert "naive NumPy" in r.stdout


def test_cpu_isa_can_be_forced_by_name():
    """FLASHDL_CPU_ISA picks a compiled copy of the kernels by name (generic runs on any CPU);
    an unknown name is reported by info() and refused, naming the variable, by every call."""
    code = ("import os, numpy as np, flashdl; q = np.ones((1, 4, 1, 8), np.float32)\n"
            "print(flashdl.info()['cpu_isa'])\n"
            "try:\n    flashdl.attention(q, q, q); print('ran')\n"
            "except ValueError as e:\n    print(e)\n")
    env = dict(os.environ, FLASHDL_CPU_ISA="generic")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["generic", "ran"]
    env["FLASHDL_CPU_ISA"] = "sse9"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.strip().splitlines()
    assert first.startswith("none (") and "FLASHDL_CPU_ISA" in first
    assert second.startswith("FLASHDL_CPU_ISA: expected one of") and "'sse9'" in second
