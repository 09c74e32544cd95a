"""tools/explain_dump.py on a dump written here in test_cuda_block_sparse's format: a kernel
whose second 16-row band took its softmax against the reference point 0 (nvcc 13.0's miscompiled
initialisation) is found, band and reference point both."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "explain_dump.py"
LOG2E = 1.4426950408889634


def _softmax_rows(s, v, ref_point):
    """float16 kernel arithmetic: P = exp2(t - r) rounded, l in float32, out rounded."""
    t = s * LOG2E
    r = np.max(t, axis=1, keepdims=True) if ref_point is None else ref_point
    p = np.where(np.isfinite(t), np.exp2(t - r), 0).astype(np.float32)
    out = (p.astype(np.float16).astype(np.float32) @ v) / p.sum(axis=1, dtype=np.float32)[:, None]
    return out.astype(np.float16).astype(np.float32)


def _write_dump(path):
    rng = np.random.default_rng(0)
    b, sq, sk, h, hk, d = 1, 64, 48, 1, 1, 16
    q = rng.uniform(-1, 1, (b, sq, h, d)).astype(np.float16).astype(np.float32)
    k = rng.uniform(-1, 1, (b, sk, hk, d)).astype(np.float16).astype(np.float32)
    v = rng.uniform(-1, 1, (b, sk, hk, d)).astype(np.float16).astype(np.float32)
    slope = np.float32(1.0)
    s = q[0, :, 0].astype(np.float64) @ k[0, :, 0].T.astype(np.float64) / np.sqrt(d)
    dist = np.abs(np.arange(sq)[:, None] + sk - sq - np.arange(sk)[None, :])
    s = s - float(slope) * dist
    # The keys within 20 of each row's diagonal hidden: every visible score is below -20.
    vis = (dist >= 20).astype(np.uint8).reshape(b, h, sq, sk)
    s = np.where(vis[0, 0] != 0, s, -np.inf)
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    ref_out = (p @ v[0, :, 0]) / p.sum(axis=1, keepdims=True)
    ref_lse = (np.log(p.sum(axis=1)) + m[:, 0]).astype(np.float32)
    got = _softmax_rows(s, v[0, :, 0], None)
    band1 = (np.arange(sq) % 32) >= 16
    got[band1] = _softmax_rows(s[band1], v[0, :, 0], 0.0)
    header = {"label": "fwd fa2 float16 d=16 synthetic", "b": b, "sq": sq, "sk": sk, "h": h,
              "hk": hk, "d": d, "left": -1, "right": -1, "softcap": 0.0, "slopes": 1}
    with open(path, "wb") as f:
        f.write((json.dumps(header) + "\n").encode())
        for a in (q, k, v):
            f.write(a.astype(np.float32).tobytes())
        f.write(vis.tobytes())
        f.write(np.array([slope], np.float32).tobytes())
        f.write(ref_out.astype(np.float32).reshape(b, sq, h, d).tobytes())
        f.write(ref_lse.reshape(b, h, sq).tobytes())
        f.write(got.reshape(b, sq, h, d).tobytes())
        f.write(ref_lse.reshape(b, h, sq).tobytes())  # lse right, as on the GPU
    return band1


def test_explain_dump_finds_the_band_and_the_reference_point(tmp_path):
    dump = tmp_path / "0.bin"
    band1 = _write_dump(dump)
    res = subprocess.run([sys.executable, str(TOOL), str(dump), "--rows", "2", "--block-m", "64"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "reference is" not in out  # the script's own reference agrees with the dumped one
    # Only band-1 rows fail, and their out is the softmax against 0, bit for bit.
    failed = out.strip().splitlines()[-1]
    assert "by (warp, 16-row band)" in failed and ", 0): " not in failed, failed
    assert int(failed.split()[0]) <= int(band1.sum())
    explained = [line for line in out.splitlines() if "out with r =" in line]
    assert explained and all("0: off by 0.0e+00" in line for line in explained), out


def test_explain_dump_refuses_another_format(tmp_path):
    bad = tmp_path / "x.bin"
    bad.write_bytes(b'{"label": "x", "b": 1, "sq": 1, "sk": 1, "h": 1, "hk": 1, "d": 1, '
                    b'"left": -1, "right": -1, "softcap": 0, "slopes": 0}\n' + bytes(100))
    res = subprocess.run([sys.executable, str(TOOL), str(bad)], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode != 0 and "not a dump of this format" in res.stderr + res.stdout
