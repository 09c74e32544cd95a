"""`python -m flashdl bench`: speed against sequence length, a table and (matplotlib) a PNG."""

import importlib.util
import re
import subprocess
import sys

import pytest

import flashdl
from flashdl import bench

TINY = ["--seqlens", "64,128", "--heads", "2", "--headdim", "16", "--rounds", "1",
        "--pause", "0"]
PROGRESS = re.compile(r"^\s+(.+?)\s+(fwd\+bwd|fwd|bwd)\s+seqlen\s+(\d+)\s+([0-9.]+) ms\s+"
                      r"([0-9.]+) GFLOP/s$")
CELL = re.compile(r"^([0-9.]+) \(([0-9.]+) ms\)$")
# Runs the CLI with torch and matplotlib made unimportable (None in sys.modules).
WITHOUT = ("import sys; sys.modules['torch'] = None; sys.modules['matplotlib'] = None\n"
           "from flashdl.__main__ import main\n"
           "code = main(['bench'] + sys.argv[1:])\n"
           "assert not any(sys.modules.get(m) for m in ('torch', 'matplotlib'))\n"
           "sys.exit(code)\n")


def has(module):
    return importlib.util.find_spec(module) is not None


def run(args, cwd, code=None, timeout=120):
    cmd = [sys.executable] + (["-c", code] if code else ["-m", "flashdl", "bench"]) + args
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=timeout)


def progress_points(stderr):
    points = {}
    for line in stderr.splitlines():
        m = PROGRESS.match(line)
        if m:
            label, pass_, seqlen, ms, speed = m.groups()
            assert float(ms) > 0 and float(speed) > 0, line
            assert (label, pass_, int(seqlen)) not in points, line
            points[(label, pass_, int(seqlen))] = float(ms)
    return points


def table(text):
    """(header cells, {(pass, seqlen): cells}) of the markdown table in text."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| ")]
    header, body = rows[0], rows[1:]
    assert header[:2] == ["pass", "seqlen"]
    return header[2:], {(r[0], int(r[1])): r[2:] for r in body}


def expected_points(labels, passes, seqlens):
    return {(label, p, s) for label in labels for p in passes for s in seqlens
            if not (label == "naive NumPy" and p != "fwd")}


def test_bench_every_method_table_and_figure(tmp_path):
    torch = has("torch")
    r = run(TINY + ["--device", "cpu", "--pause", "0.01", "--out", "speed.png",
                    "--table", "speed.md"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    labels = ["flashdl fa2", "flashdl fa1"] + (["torch SDPA"] if torch else []) + ["naive NumPy"]
    points = progress_points(r.stderr)
    assert set(points) == expected_points(labels, ["fwd", "fwd+bwd"], [64, 128]), r.stderr

    header, rows = table(r.stdout)
    assert header == labels
    assert set(rows) == {(p, s) for p in ("fwd", "fwd+bwd") for s in (64, 128)}
    for (pass_, seqlen), cells in rows.items():
        for label, cell in zip(header, cells):
            if label == "naive NumPy" and pass_ != "fwd":
                assert cell == "—"
                continue
            m = CELL.match(cell)
            assert m, (pass_, seqlen, label, cell)
            assert float(m.group(1)) > 0 and float(m.group(2)) > 0
    assert (tmp_path / "speed.md").read_text().strip() == r.stdout.strip()

    png = tmp_path / "speed.png"
    if has("matplotlib"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib not installed: table only" in r.stderr
        assert not png.exists()


def test_bench_without_torch_or_matplotlib(tmp_path):
    """Neither is needed: no SDPA column, a table and no figure, exit status 0."""
    r = run(TINY + ["--device", "cpu", "--causal", "--passes", "fwd,bwd"], tmp_path, code=WITHOUT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "matplotlib not installed: table only" in r.stderr
    assert "torch does not import" in r.stderr
    assert not (tmp_path / "flashdl_bench.png").exists()
    labels = ["flashdl fa2", "flashdl fa1", "naive NumPy"]
    assert set(progress_points(r.stderr)) == expected_points(labels, ["fwd", "bwd"], [64, 128])
    header, rows = table(r.stdout)
    assert header == labels
    assert set(rows) == {(p, s) for p in ("fwd", "bwd") for s in (64, 128)}
    assert "causal" in r.stdout and "halved" in r.stdout


def test_bench_max_seconds_stops_early(tmp_path):
    r = run(TINY + ["--device", "cpu", "--methods", "fa2", "--passes", "fwd", "--no-plot",
                    "--max-seconds", "1e-9"],
            tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert set(progress_points(r.stderr)) == {("flashdl fa2", "fwd", 64)}
    assert "stopped before seqlen 128" in r.stdout and "--max-seconds" in r.stderr
    _, rows = table(r.stdout)
    assert set(rows) == {("fwd", 64)}


@pytest.mark.parametrize("args, name", [
    (["--dtype", "float8"], "--dtype"),
    (["--seqlens", "0"], "--seqlens"),
    (["--seqlens", "64,-128"], "--seqlens"),
    (["--seqlens", "64,abc"], "--seqlens"),
    (["--heads", "0"], "--heads"),
    (["--passes", "fwd,sideways"], "--passes"),
    (["--methods", "fa3"], "--methods"),
    (["--rounds", "0"], "--rounds"),
    (["--pause", "-1"], "--pause"),
    (["--out", "no/such/dir/speed.png"], "--out"),
])
def test_bench_bad_arguments(tmp_path, args, name):
    r = run(args, tmp_path)
    assert r.returncode != 0
    assert f"argument {name}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(flashdl.info()["cuda_device_count"] > 0, reason="a CUDA device is present")
def test_bench_cuda_without_gpu_skips_cleanly(tmp_path):
    r = run(TINY + ["--device", "cuda"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "--device cuda" in r.stderr and "skipped" in r.stderr
    assert "Traceback" not in r.stderr
    assert not list(tmp_path.iterdir())


def test_bench_import_is_light():
    code = ("import sys, flashdl.bench; "
            "print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_flop_count():
    """flash-attn's count: forward 4*b*h*s*s*d, halved when causal; backward 2.5x, both 3.5x."""
    assert bench.attention_flops(2, 8, 1024, 1024, 64, False) == 4 * 2 * 8 * 1024 * 1024 * 64
    assert bench.attention_flops(2, 8, 1024, 1024, 64, True) == 2 * 2 * 8 * 1024 * 1024 * 64
    fwd = bench.attention_flops(1, 4, 256, 512, 32, True)
    assert bench.attention_flops(1, 4, 256, 512, 32, True, "bwd") == 2.5 * fwd
    assert bench.attention_flops(1, 4, 256, 512, 32, True, "fwd+bwd") == 3.5 * fwd
