"""Runs multidevice_jax.py (sharded jit calls, ring attention) in a subprocess with 4 CPU devices:
XLA_FLAGS must be set before jax initialises its backends, which the rest of this suite has
already done by the time pytest (or a pytest-xdist worker) reaches these tests."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")

HERE = Path(__file__).resolve().parent


def test_multidevice_cases():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        " --xla_force_host_platform_device_count=4").strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-x", str(HERE / "multidevice_jax.py")],
        cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
