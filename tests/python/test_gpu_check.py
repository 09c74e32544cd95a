"""The GPU check tools on a machine without a GPU: tools/gpu_check.sh reports every step
SKIPPED (no GPU), builds nothing, finishes in seconds and exits 0; benchmarks/bench_cuda.py (and
its --features mode) exits with a clear message. Where a GPU exists both would really run
(minutes): skipped there. On any machine, bench_cuda.py --features --cpu-dry-run runs that mode's
code on the CPU backend."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.sh"


def _detect():
    """The script's own verdict ("gpu: ..." or "no gpu: why"), so this file never disagrees with it."""
    res = subprocess.run(["bash", str(SCRIPT), "--detect"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


VERDICT = _detect()
needs_no_gpu = pytest.mark.skipif(not VERDICT.startswith("no gpu"),
                                  reason=f"a GPU is present ({VERDICT}): the script would build")


def steps():
    res = subprocess.run(["bash", str(SCRIPT), "--list"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.split()


def test_steps_are_listed():
    """One quick case of every kernel family first, then the sanitizers per family, the benchmark,
    the Python tests and the complete suites; the HBM-bytes measurement last."""
    names = steps()
    assert names[:2] == ["env", "build"] and "pytest_cuda" in names and "pytest_all" in names
    assert names[-1] == "bench_io"
    families = ("forward", "backward", "block_sparse", "kvcache", "varlen", "extras")
    quick = [names.index(f"quick_{f}") for f in families]
    for tool in ("memcheck", "racecheck", "synccheck"):
        assert f"{tool}_forward" in names and f"{tool}_backward" in names
        assert max(quick) < names.index(f"{tool}_forward")
    assert names.index("synccheck_kvcache") < names.index("bench") < names.index("cpp_forward")


@needs_no_gpu
def test_without_a_gpu_every_step_is_skipped_fast(tmp_path):
    out = tmp_path / "gpu_check"
    start = time.monotonic()
    # From another directory: the script finds the repository itself.
    res = subprocess.run(["bash", str(SCRIPT), str(out)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert res.returncode == 0, res.stdout + res.stderr
    assert elapsed < 30, f"took {elapsed:.1f} s: something ran that needs no GPU check"
    summary = (out / "summary.txt").read_text()
    assert "# gpu: none (" in summary
    lines = {line.split()[0]: line for line in summary.splitlines()
             if line and not line.startswith("#")}
    for name in steps():
        assert name in lines, f"{name} missing from summary.txt:\n{summary}"
        assert "SKIPPED (no GPU)" in lines[name], lines[name]
    assert "overall: PASS" in summary
    assert sorted(p.name for p in out.iterdir()) == ["summary.txt"], "a step wrote a log"
    assert "[gpu_check]" not in res.stdout, "a step was started"


def test_usage_errors(tmp_path):
    res = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "usage" in res.stderr
    res = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), "no_such_step"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "no_such_step" in res.stderr
    assert not (tmp_path / "out").exists()


@needs_no_gpu
def test_bench_cuda_without_a_gpu_says_so():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cuda.py"), "--quick"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "no CUDA device" in res.stderr, res.stderr


def test_bench_cuda_io_check():
    """bench_cuda_io.py --check: its ncu CSV parser on a sample and the model columns, anywhere."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cuda_io.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("check: ok")
    assert "| 4096 | 128 | 4 x 16 |" in res.stdout


@needs_no_gpu
def test_bench_cuda_io_without_a_gpu_says_so():
    pytest.importorskip("torch")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cuda_io.py")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "no CUDA device" in res.stderr, res.stderr


@needs_no_gpu
def test_bench_cuda_features_without_a_gpu_says_so():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cuda.py"), "--features",
                          "--quick"], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "no CUDA device" in res.stderr, res.stderr


def test_bench_cuda_features_cpu_dry_run(tmp_path):
    """--features --cpu-dry-run runs that mode's code on the CPU backend (tiny shapes): the
    three tables are written, every density row present, no flashdl call failed."""
    pytest.importorskip("torch")
    out = tmp_path / "features.md"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cuda.py"), "--features",
                          "--cpu-dry-run", "--out", str(out)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    text = out.read_text()
    for density in ("1.0000", "0.5000", "0.2500", "0.1250", "0.0625"):
        assert f"| fa2 | random | {density} |" in text
    assert "| float16 | True | 64 |" in text  # the causal dropout row
    assert "| float16 | 64 | 16 |" in text  # the varlen row: 16 packed sequences
    assert "failures" not in text


def _sanitize_parts_harness(tmp_path, fake_tool_body):
    """gpu_check.sh's sanitize and sanitize_parts, cut out of the script and run with a fake
    compute-sanitizer (fake_tool_body: bash, given the test's arguments) and a fake test."""
    text = SCRIPT.read_text()
    funcs = "".join(text[text.index(f"\n{name}() {{"):].split("\n}\n", 1)[0] + "\n}\n"
                    for name in ("sanitize", "sanitize_parts"))
    tool = tmp_path / "compute-sanitizer"
    tool.write_text("#!/usr/bin/env bash\nshift 4  # --tool T --error-exitcode 1\n" +
                    fake_tool_body)
    tool.chmod(0o755)
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_cuda_block_sparse").write_text("#!/bin/sh\n")
    (tests / "test_cuda_block_sparse").chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    return funcs, {"COMPUTE_SANITIZER": str(tool), "CUDA_TESTS": str(tests), "OUTDIR": str(out),
                   "PATH": "/usr/bin:/bin"}, out


def test_sanitize_parts_runs_every_filter_and_keeps_each_log(tmp_path):
    """racecheck over the block-sparse cases runs as one sanitizer per --filter, at once: each
    part logs to its own file in OUTDIR as it goes, the step prints them all, and fails if one
    part fails."""
    body = ('echo "case $4"; sleep 0.3; [ "$4" != "bwd fa2" ]\n')  # $4: the filter
    funcs, env, out = _sanitize_parts_harness(tmp_path, body)
    start = time.monotonic()
    res = subprocess.run(["bash", "-c", funcs + 'sanitize_parts racecheck test_cuda_block_sparse '
                          '"fwd " "bwd fa1" "bwd fa2"'], env=env, capture_output=True, text=True,
                         timeout=60)
    assert time.monotonic() - start < 0.85  # the three 0.3 s parts ran at once
    assert res.returncode == 1  # "bwd fa2" failed
    for i, f in enumerate(("fwd ", "bwd fa1", "bwd fa2")):
        log = (out / f"racecheck_block_sparse.part{i}.log").read_text()
        assert f"case {f}" in log and f"case {f}" in res.stdout
    ok = subprocess.run(["bash", "-c", funcs + 'sanitize_parts racecheck test_cuda_block_sparse '
                         '"fwd " "bwd fa1"'], env=env, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_sanitize_parts_stops_its_parts_at_the_cap(tmp_path):
    """The step's timeout (SIGTERM to its bash) ends the parts too: none keeps the GPU busy."""
    # A duration no other process on the machine sleeps for, matched whole (pgrep -x): "sleep 30"
    # alone also matched a neighbour's "sleep 300" and failed the test.
    funcs, env, out = _sanitize_parts_harness(tmp_path, 'echo started; exec sleep 29.731\n')
    start = time.monotonic()
    res = subprocess.run(["timeout", "1", "bash", "-c", funcs +
                          'sanitize_parts racecheck test_cuda_block_sparse "a" "b"'],
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 124
    assert time.monotonic() - start < 10
    time.sleep(0.2)
    left = subprocess.run(["pgrep", "-fx", "sleep 29.731"], capture_output=True, text=True)
    assert left.stdout.strip() == "", "a part outlived the step"
    assert "started" in (out / "racecheck_block_sparse.part0.log").read_text()
