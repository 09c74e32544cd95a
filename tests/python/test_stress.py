"""Stress: many Python threads at once, fork after the thread pool has started, memory over many
small calls, and (FLASHDL_STRESS_HUGE=1: about 9 GB and a few minutes) an input of more than
2**31 elements."""

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import flashdl

HERE = os.path.dirname(os.path.abspath(__file__))


def _problem(i):
    rng = np.random.default_rng(100 + i)
    b, sq, sk, h = 1 + i % 2, 3 + 7 * (i % 5), 5 + 11 * (i % 4), 2 * (1 + i % 2)
    d = (8, 16, 24, 64)[i % 4]
    q = rng.standard_normal((b, sq, h, d)).astype(np.float32)
    k = rng.standard_normal((b, sk, h // 2, d)).astype(np.float32)
    v = rng.standard_normal((b, sk, h // 2, d)).astype(np.float32)
    opts = dict(causal=i % 3 == 0, schedule=("fa2", "fa1", "auto")[i % 3],
                window_size=(-1, -1) if i % 4 else (4, 2))
    return q, k, v, opts


def _call(q, k, v, opts):
    out, lse = flashdl.attention(q, k, v, return_lse=True, **opts)
    grads = flashdl.attention_backward(np.ones_like(out), q, k, v, out, lse, **opts)
    return (out, lse) + tuple(grads)


def test_threads_match_serial():
    """16 Python threads with different shapes, schedules and masks, while the thread count is
    changed under them, give the serial results (forward and backward); results do not depend on
    the thread count except for the backward's float summation order, so the serial results are
    taken at each count the threads may see."""
    problems = [_problem(i) for i in range(16)]
    serial = {}
    for n in (1, 2):
        flashdl.set_num_threads(n)
        serial[n] = [_call(*p) for p in problems]
    results, errors = [None] * 16, []
    start = threading.Barrier(17)

    def work(i):
        try:
            start.wait()
            for _ in range(8):
                results[i] = _call(*problems[i])
                for n in (1, 2):
                    if all(np.array_equal(a, b) for a, b in zip(results[i], serial[n][i])):
                        break
                else:
                    errors.append(f"thread {i}: result differs from the serial ones")
                    return
        except Exception as e:  # noqa: BLE001
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    start.wait()
    for n in (1, 2, 1, 2, 0):
        flashdl.set_num_threads(n)
    for t in threads:
        t.join(timeout=120)
    flashdl.set_num_threads(0)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors


FORK_SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    import flashdl
    flashdl.set_num_threads(2)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 64, 4, 32)).astype(np.float32) for _ in range(3))
    want = flashdl.attention(q, k, v, causal=True)   # starts the thread pool
    pids = []
    for _ in range(3):
        pid = os.fork()
        if pid == 0:
            ok = np.array_equal(flashdl.attention(q, k, v, causal=True), want)
            flashdl.set_num_threads(2)
            ok = ok and np.array_equal(flashdl.attention(q, k, v, causal=True), want)
            os._exit(0 if ok else 3)
        pids.append(pid)
        want2 = flashdl.attention(q, k, v, causal=True)   # the parent keeps working meanwhile
        assert np.array_equal(want2, want)
    codes = [os.waitpid(p, 0)[1] for p in pids]
    print(codes)
    sys.exit(0 if all(c == 0 for c in codes) else 1)
""")


def test_fork_after_pool_started():
    """A child forked after the thread pool has started (DataLoader workers do this) computes the
    same results; neither side hangs."""
    proc = subprocess.run([sys.executable, "-c", FORK_SCRIPT], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


LEAK_SCRIPT = textwrap.dedent("""
    import resource, sys
    import numpy as np
    import flashdl

    def rss_kb():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 2, 8)).astype(np.float32) for _ in range(3))
    bad = np.zeros((1, 4, 2, 8), np.int32)
    calls = int(sys.argv[1])
    def one(i):
        if i % 10 == 9:   # refusals too: an exception path must not leak either
            try:
                flashdl.attention(q, k, bad)
            except TypeError:
                pass
        else:
            flashdl.attention(q, k, v, causal=bool(i & 1), return_lse=True)
    for i in range(calls // 10):
        one(i)
    before = rss_kb()
    for i in range(calls):
        one(i)
    after = rss_kb()
    print(before, after)
""")


def test_memory_flat_over_small_calls():
    """Resident memory stays flat over 100,000 small calls (forward and refusals): no leak in
    the bindings or the Python layer. A leak of 64 bytes a call would add 6 MB."""
    calls = int(os.environ.get("FLASHDL_STRESS_CALLS", "100000"))
    proc = subprocess.run([sys.executable, "-c", LEAK_SCRIPT, str(calls)], capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, FLASHDL_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    before, after = (int(x) for x in proc.stdout.split())
    assert after - before < 4096, f"resident memory grew by {after - before} kB over {calls} calls"


@pytest.mark.skipif(os.environ.get("FLASHDL_STRESS_HUGE") != "1",
                    reason="needs about 9 GB and minutes: FLASHDL_STRESS_HUGE=1")
@pytest.mark.parametrize("schedule", ["fa2", "fa1"])
def test_more_than_2_31_elements(schedule):
    """q and out of 2**31 + 4096 * 256 elements (batch x seqlen x heads x dim), float16: rows past
    element 2**31 compute what the same rows compute alone (64-bit offsets everywhere)."""
    d, h = 256, 1
    sq = 2**31 // (h * d) + 4096
    sk = 16
    rng = np.random.default_rng(0)
    q = np.empty((1, sq, h, d), np.float16)
    block = rng.standard_normal((4096, h, d)).astype(np.float16)
    for s in range(0, sq, 4096):
        q[0, s:s + 4096] = block[: min(4096, sq - s)]
    q[0, -3:] = rng.standard_normal((3, h, d)).astype(np.float16)  # the last rows differ
    k = rng.standard_normal((1, sk, h, d)).astype(np.float16)
    v = rng.standard_normal((1, sk, h, d)).astype(np.float16)
    assert q.size > 2**31
    out, lse = flashdl.attention(q, k, v, schedule=schedule, return_lse=True)
    tail = flashdl.attention(np.ascontiguousarray(q[:, -4096:]), k, v, schedule=schedule)
    np.testing.assert_array_equal(out[:, -4096:], tail)
    head = flashdl.attention(np.ascontiguousarray(q[:, :4096]), k, v, schedule=schedule)
    np.testing.assert_array_equal(out[:, :4096], head)
    assert np.isfinite(lse).all()
