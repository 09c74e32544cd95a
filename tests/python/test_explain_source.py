"""tools/explain_source.py on a source page written here in Nsight Compute's CSV layout (the kernel
name line, then a header and one row per SASS instruction): the samples are summed by stall
reason and by opcode (predicates and modifiers stripped), and the hottest instruction is shown
with the ones before it."""

from __future__ import annotations

import csv
import io
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "explain_source.py"

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)",
          "Warp Stall Sampling (Not-issued Samples)", "Instructions Executed", "stall_wait",
          "stall_long_sb", "stall_barrier", "stall_wait (Not Issued)"]
ROWS = [  # address, source, all samples, not issued, executed, wait, long_sb, barrier
    ("0x7f0000000000", "      LDC R1, c[0x0][0x28]", 2, 2, 10, 2, 0, 0),
    ("0x7f0000000010", "      BAR.SYNC.DEFER_BLOCKING 0x0", 1, 1, 10, 1, 0, 0),
    ("0x7f0000000020", "@P3   BRA 0x7f0000000050", 50, 49, 10, 0, 0, 50),
    ("0x7f0000000030", "@!P4  LDG.E.U16 R8, desc[UR22][R10.64]", 3, 3, 1000, 3, 0, 0),
    ("0x7f0000000040", "      HMMA.16816.F32 R4, R8, R12, R4", 30, 20, 500, 10, 20, 0),
    ("0x7f0000000050", "      HMMA.16816.F32 R0, R8, R14, R0", 14, 10, 500, 4, 10, 0),
]


def _write(path):
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
    w.writerow(["Kernel Name", "void flashdl::cuda::fa2::forward_kernel<...>(flashdl::Params)"])
    w.writerow(HEADER)
    for a, src, n, ni, ex, wait, lsb, bar in ROWS:
        w.writerow([a, src, n, ni, ex, wait, lsb, bar, wait])
    path.write_text(buf.getvalue())


def _run(*args):
    res = subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_sums_by_reason_and_opcode(tmp_path):
    path = tmp_path / "source_forward.csv"
    _write(path)
    out = _run(path, "--top", "1", "--context", "1")
    assert "forward_kernel" in out and "instructions: 6; samples: 100" in out
    reasons = out.split("samples by stall reason:")[1].split("samples by opcode")[0]
    assert reasons.split()[:3] == ["barrier", "50", "50.0%"]
    assert "long_sb" in reasons and "(Not Issued)" not in reasons
    opcodes = out.split("samples by opcode")[1].split("hottest")[0]
    # HMMA: 30 + 14 samples, 1,000 executed; the predicated BRA and LDG count under their opcodes.
    lines = {ln.split()[0]: ln.split() for ln in opcodes.splitlines()[1:] if ln.strip()}
    assert lines["HMMA"][1] == "44" and lines["HMMA"][-1] == "1,000"
    assert lines["BRA"][1] == "50" and lines["LDG"][-1] == "1,000"
    hottest = out.split("hottest 1 instructions:")[1]
    assert ">>> 00020  @P3   BRA" in hottest and "barrier 50" in hottest
    assert "00010  BAR.SYNC" in hottest  # the instruction before it


def test_refuses_a_file_that_is_not_a_source_page(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text('"a","b"\n"1","2"\n')
    res = subprocess.run([sys.executable, str(TOOL), str(path)], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode != 0 and "not an ncu source page CSV" in res.stderr
