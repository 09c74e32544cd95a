"""The installed package type-checks for its users: py.typed ships, and a sample user script
passes `mypy --strict` against it (the overloads give precise return types)."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("mypy")

NUMPY_SAMPLE = '''
from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

import flashdl


def run() -> tuple[Any, Any, Any]:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 16, 2, 8), dtype=np.float32)
    out = flashdl.attention(q, q, q, causal=True, window_size=(4, 0), block_size=(8, 8))
    out, lse = flashdl.attention(q, q, q, return_lse=True, softmax_scale=0.5)
    out, seed = flashdl.attention(q, q, q, dropout_p=0.1, return_seed=True)
    out, lse, seed = flashdl.attention(q, q, q, dropout_p=0.1, return_lse=True,
                                       return_seed=True)
    seed_plus: int = seed + 1
    dq, dk, dv = flashdl.attention_backward(out, q, q, q, out, lse, dropout_p=0.1, seed=seed,
                                            deterministic=True)
    keep: npt.NDArray[np.bool_] = flashdl.dropout_mask(1, 2, 16, 16, 0.1, seed)
    cu = np.array([0, 5, 16], dtype=np.int32)
    p = q[0]
    o = flashdl.attention_varlen(p, p, p, cu, cu, 11, 11, causal=True)
    o, l2 = flashdl.attention_varlen(p, p, p, cu, cu, 11, 11, return_lse=True)
    g = flashdl.attention_varlen_backward(o, p, p, p, o, l2, cu, cu, 11, 11)
    info = flashdl.info()
    version: str = info["version"]
    threads: int = info["num_threads"]
    backends: list[str] = info["backends"]
    flashdl.set_num_threads(0)
    version = flashdl.__version__
    return dq, keep, g
'''

TORCH_SAMPLE = '''
from __future__ import annotations

import torch

import flashdl.torch
from flashdl.flash_attn import flash_attn_func


def run(q: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = flashdl.torch.attention(q, q, q, causal=True)
    out2, lse = flashdl.torch.attention(q, q, q, return_lse=True)
    both: torch.Tensor = lse.sum() + out2.sum()
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    v: torch.Tensor = flashdl.torch.attention_varlen(q[0], q[0], q[0], cu, cu, 11, 11)
    s: torch.Tensor = flashdl.torch.scaled_dot_product_attention(q, q, q, is_causal=True)
    f: torch.Tensor = flash_attn_func(q, q, q, causal=True)
    f3, flse, probs = flash_attn_func(q, q, q, dropout_p=0.1, return_attn_probs=True)
    return out + both + v.sum() + s.sum() + f.sum() + f3.sum()
'''


def _mypy(tmp_path, name, source):
    script = tmp_path / name
    script.write_text(textwrap.dedent(source))
    # Run from tmp_path so that the installed flashdl (with py.typed), not the source tree, is the
    # one mypy finds; no cache next to the repository.
    env = dict(os.environ)
    env.pop("MYPYPATH", None)
    cmd = [sys.executable, "-m", "mypy", "--strict", "--no-incremental",
           "--cache-dir", os.devnull, str(script)]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stdout}\n{res.stderr}"
    assert "Success" in res.stdout


def test_installed_package_is_typed():
    spec = importlib.util.find_spec("flashdl")
    pkg = os.path.dirname(spec.origin)
    assert os.path.isfile(os.path.join(pkg, "py.typed"))
    assert os.path.isfile(os.path.join(pkg, "_ext.pyi"))


def test_mypy_strict_numpy_sample(tmp_path):
    _mypy(tmp_path, "sample_numpy.py", NUMPY_SAMPLE)


def test_mypy_strict_torch_sample(tmp_path):
    pytest.importorskip("torch")
    _mypy(tmp_path, "sample_torch.py", TORCH_SAMPLE)
