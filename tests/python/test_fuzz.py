"""The fuzzer: seeded calls of every public entry point (NumPy, PyTorch, flash-attn and JAX front
ends) with valid arguments, valid variants (strides, NumPy scalars, the stated limits) and
hostile values (strings for flags, floats for ints, NaN scales, unconvertible dtypes, written
arrays that overlap), each in a child process with a timeout (fuzz_worker.py). A call must not
crash or hang; a refusal is ValueError/TypeError/NotImplementedError naming an argument and
writes nothing; an acceptance matches the float64 oracle and leaves its inputs bitwise unchanged.

FLASHDL_FUZZ_CALLS sets the number of calls (default 240, about 40 s on two cores),
FLASHDL_FUZZ_SEED the seed (default 34); a night's run: FLASHDL_FUZZ_CALLS=20000.
"""

import collections
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CALLS = int(os.environ.get("FLASHDL_FUZZ_CALLS", "240"))
SEED = int(os.environ.get("FLASHDL_FUZZ_SEED", "34"))


def run_fuzz(seed, first, count):
    env = dict(os.environ, FLASHDL_NUM_THREADS=os.environ.get("FLASHDL_NUM_THREADS", "2"),
               JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "fuzz_worker.py")],
                          input=f"{seed} {first} {count}\n", capture_output=True, text=True,
                          env=env, timeout=60 + 30 * count)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def summary(results):
    by = collections.Counter((r.get("entry", "?"), r["status"]) for r in results)
    entries = sorted({e for e, _ in by})
    lines = [f"{len(results)} calls: " + ", ".join(
        f"{s} {n}" for s, n in sorted(collections.Counter(r['status'] for r in results).items()))]
    for e in entries:
        lines.append(f"  {e}: " + ", ".join(f"{s} {by[(e, s)]}" for s in
                                            ("accepted", "refused", "fail", "crash", "hang")
                                            if by[(e, s)]))
    return "\n".join(lines)


def test_fuzz():
    results = run_fuzz(SEED, 0, CALLS)
    assert len(results) == CALLS
    print(summary(results))
    bad = [r for r in results if r["status"] not in ("accepted", "refused")]
    assert not bad, "\n".join(json.dumps(r) for r in bad[:20]) + "\n" + summary(results)
    statuses = collections.Counter(r["status"] for r in results)
    assert statuses["accepted"] > 0 and statuses["refused"] > 0
