"""The GPU-free performance report's tools (tools/sass_model) on stored and synthetic SASS.

The report itself compiles the CUDA kernels (a command a person runs after a kernel change);
these tests check what it is built from: the FA2 fixtures' counts and model figures reproduce the
stored ones, the walker's prefer/avoid rules pick the side of a branch by the work behind it, a
marker that left the source is an error naming it, the -ftz variant of FA2's paths drops exactly
exp2f's range fix-ups, and the report's table ends with the worst ratios.
"""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools", "sass_model"))

import hot_path  # noqa: E402
import report  # noqa: E402
import sass_parse  # noqa: E402

with open(os.path.join(report.FIXTURES, "counts.json")) as f:
    FA2 = json.load(f)["kernels"]


@pytest.mark.parametrize("key", ["fwd_h128", "fwd_h64", "bwd_h128", "bwd_h64"])
def test_fa2_fixture_reproduces_its_figures(key):
    r = report.analyse_fa2(key)
    stored = FA2[key]
    assert r["counts"]["instructions"] == stored["per_iteration"]["instructions"]
    assert r["counts"]["hmma"] == stored["per_iteration"]["hmma"]
    assert r["counts"]["classes"]["LDSM"] == stored["per_iteration"]["LDSM"]
    assert r["model"]["cycles_per_hmma"] == pytest.approx(stored["model"]["cycles_per_hmma"],
                                                          abs=1e-3)
    assert r["model"]["issue_use"] == pytest.approx(stored["model"]["issue_use"], abs=1e-3)
    # torch's FA2 build is not -ftz: three fix-up instructions around every exp2 (MUFU.EX2)
    assert r["fixups"] == 3 * r["counts"]["opcodes"]["MUFU"]
    assert r["model_ftz"]["cycles_per_hmma"] <= r["model"]["cycles_per_hmma"] + 0.01


def test_exp2_fixup_is_the_range_fixup_alone():
    fixup = ["FSETP.GEU.AND P3, PT, R8, -126, PT", "@!P1 FMUL R0, R0, 0.5",
             "@!P0 FMUL R221, R221, R221"]
    other = ["FSETP.GEU.AND P3, PT, R8, -12, PT", "FMUL R0, R0, 0.5", "@P0 FMUL R1, R1, R1",
             "@!P0 FMUL R1, R2, R3", "@!P0 FMUL R1, R1, 0.25", "MUFU.EX2 R1, R0",
             "FSETP.GEU.AND P3, PT, R8, -126.5, PT"]
    assert all(report.exp2_fixup(_ins(0, t, 1)) for t in fixup)
    assert not any(report.exp2_fixup(_ins(0, t, 1)) for t in other)


def _ins(addr, text, line, target=None):
    i = sass_parse.Ins(addr, text, "kernel.cuh", line)
    i.target = target
    return i


def _diamond(rare_on_fall):
    """A loop body with one forward branch: one side 8 instructions of line 20 (rare work), the
    other 8 of line 30 (common work), then the back edge."""
    rare = [_ins(0x20 + 0x10 * k, "IMAD R0, R0, R1, RZ", 20) for k in range(8)]
    common = [_ins(0x120 + 0x10 * k, "FMUL R2, R2, R3", 30) for k in range(8)]
    if rare_on_fall:
        first, second = rare, common
    else:
        first, second = common, rare
        for k, i in enumerate(first):
            i.addr = 0x20 + 0x10 * k
        for k, i in enumerate(second):
            i.addr = 0x120 + 0x10 * k
    body = [_ins(0x0, "ISETP.NE.AND P0, PT, R4, RZ, PT", 10),
            _ins(0x10, "@P0 BRA 0x120", 10, target=0x120)]
    body += first + [_ins(0xa0, "BRA 0x1a0", 10, target=0x1a0)]
    body += [_ins(0xb0 + 0x10 * k, "NOP", 11) for k in range(7)]
    body += second + [_ins(0x1a0, "HMMA.16816.F32 R8, R12, R16, R8", 40),
                      _ins(0x1b0, "@P1 BRA 0x0", 41, target=0x0)]
    return body


@pytest.mark.parametrize("rare_on_fall", [True, False])
def test_walk_avoids_rare_work_whatever_the_branch_polarity(rare_on_fall):
    ins = _diamond(rare_on_fall)
    for kw in ({"avoid": {("kernel.cuh", 20)}}, {"prefer": {("kernel.cuh", 30)}}):
        w = hot_path.walk(ins, 0x0, 0x1b0, **kw)
        assert w.reached
        lines = {i.line for i in w.path}
        assert 30 in lines and 20 not in lines, kw
    # undecided, the walk falls through
    w = hot_path.walk(ins, 0x0, 0x1b0)
    assert (20 in {i.line for i in w.path}) == rare_on_fall


def test_missing_marker_is_named(tmp_path):
    src = tmp_path / "kernel.cuh"
    src.write_text("for (int n = 0; n < end; ++n) {\n")
    ins = _diamond(True)
    with pytest.raises(report.ReportError, match="marker rescale"):
        report.analyse(ins, [("loop", "main_loop")], [str(src)],
                       {"main_loop": "for (int n = 0;", "rescale": "acc *= alpha;"})


def test_report_table_ends_with_the_worst_ratio():
    def fig(ipc, cyc):
        c = {"instructions": ipc * 256, "hmma": 256, "instr_per_hmma": ipc,
             "classes": {"HMMA": 256, "INT": 100}}
        m = {"cycles_per_hmma": cyc, "issue_use": 0.4, "tensor_busy": 0.5}
        return {"counts": c, "model": m, "paths": ["--walk 0x0:0x10"], "resources": None}

    results = {"fwd_h128": fig(5.0, 12.0), "bwd_h64": fig(9.0, 30.0)}
    fa2 = {"fwd_h128": fig(4.77, 10.0), "bwd_h64": fig(4.26, 12.0)}
    fa2["fwd_h128"]["model_ftz"] = {"cycles_per_hmma": 8.0}
    fa2["bwd_h64"]["model_ftz"] = {"cycles_per_hmma": 10.0}
    lines, worst, worst_ftz = report.table(results, fa2)
    assert worst == pytest.approx(2.5) and worst_ftz == pytest.approx(3.0)
    assert any("| fwd d128 | 5.00 (4.77) | 12.00 | 10.00 | 1.20 | 8.00 | 1.50 |" in line
               for line in lines)
    text = report.render(results, fa2, "90").rstrip().splitlines()
    assert text[-3] == "worst model ratio to FA2 built with -ftz=true: 3.00"
    assert text[-1] == "worst model ratio to FA2: 2.50"
