"""Run flash-attn's own test module (tests/test_flash_attn.py) against flashdl.flash_attn on CPU.

flash-attn's file is not part of this project. This tool takes it from a flash-attn source checkout
or sdist (or downloads the sdist from PyPI), writes an adapted copy into a directory, and runs
pytest on it. The adaptation is a fixed list of textual substitutions, each printed with its count:

  1. torch.cuda.get_device_capability("cuda")               -> (8, 0)
  2. torch.cuda.get_device_properties("cuda").total_memory  -> (80 * 2**30)
  3. "cuda" / 'cuda' (device strings)                       -> "cpu"
  4. from flash_attn import (                               -> from flashdl.flash_attn import (

so the module believes it runs on an sm80-like device with 80 GiB (no case is skipped for lack of
memory or capability), creates every tensor on the CPU, and tests flashdl.flash_attn's functions.
The other imports of the module (flash_attn.bert_padding, flash_attn.flash_attn_interface,
flash_attn.layers.rotary) resolve to a small `flash_attn` shim package written next to the copy
(see SHIM below): pad_input/unpad_input are flashdl.flash_attn's, apply_rotary_emb is a plain
torch reference, _get_block_size_n is flash-attn's sm80 table, USE_TRITON_ROCM is False.

--sdmask-normalised adds one more, opt-in substitution (5): the module's normalize_flash_attn_S,
which undoes the per-key-block scaling of flash-attn's CUDA kernel, is replaced by one that only
zeroes padded query rows, because flashdl's S_dmask is already normalised (flash-attn documents
S_dmask as "the output of softmax (possibly with different scaling)"). Without it, the `attn`
check of every dropout case fails on that scaling alone; with it, the same check compares flashdl's
probabilities with the reference's.

Selection (options of the generated conftest.py, passed through to pytest):
  --flashdl-supported     deselect the cases that need what flashdl lacks (UNSUPPORTED below)
  --flashdl-unsupported   keep only those
  --flashdl-where EXPR    keep the cases whose parameters satisfy EXPR (a Python expression over
                          the test's parameter names; a name the test lacks is None, and a case
                          for which EXPR raises TypeError, such as None > 0, is left out)
  --flashdl-sample N      keep at most N cases per test function (a seeded random sample of what
                          is left, the same every run; --flashdl-seed S changes it);
  --flashdl-sample TEST=N that many of test function TEST (repeatable; 0: all of it)
The expression also sees `test`, the test function's name, and float16, bfloat16 and torch.

    python tools/flash_attn_upstream.py PATH [--out DIR] [--sdmask-normalised] [-- PYTEST ARGS]
    python tools/flash_attn_upstream.py --from-sdist [--version 2.8.3.post2] [-- PYTEST ARGS]

PATH: tests/test_flash_attn.py itself, a flash-attn checkout (its tests/test_flash_attn.py is
used) or an sdist tarball. --no-run writes the copy and stops. docs/flash_attn_tests.md has the
runs and their results.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import xml.etree.ElementTree as ET

# (what, pattern (regex), replacement, why). Applied in this order; each is counted.
SUBSTITUTIONS = [
    ("cuda capability query -> sm80",
     r'torch\.cuda\.get_device_capability\(\s*"cuda"\s*\)', "(8, 0)",
     "the module branches on the GPU generation; sm80 takes the branches that run every case "
     "in full (bfloat16; the backward of head dims above 192 with dropout)"),
    ("cuda memory query -> 80 GiB",
     r'torch\.cuda\.get_device_properties\(\s*"cuda"\s*\)\.total_memory', "(80 * 2**30)",
     "skips seqlen-2048 cases on GPUs with <= 16 GiB (the reference's memory); on the CPU the "
     "selection (--flashdl-where) decides what fits instead"),
    ('device "cuda" -> "cpu"',
     r'''(["'])cuda\1''', '"cpu"',
     "every tensor on the CPU"),
    ("import of the package -> flashdl.flash_attn",
     r"^from flash_attn import \(", "from flashdl.flash_attn import (",
     "the functions under test are flashdl's (the helper submodules come from the shim)"),
]

SDMASK_SUBSTITUTION = (
    "normalize_flash_attn_S -> already normalised (--sdmask-normalised)",
    r"^def normalize_flash_attn_S\(",
    "def normalize_flash_attn_S(attn_unnorm, q, k, v, query_padding_mask=None, *args, "
    "**kwargs):\n"
    "    # flashdl's S_dmask holds normalised probabilities: only zero padded query rows,\n"
    "    # as the original does last.\n"
    "    if query_padding_mask is not None:\n"
    "        attn_unnorm = attn_unnorm.masked_fill(~query_padding_mask[:, None, :, None], 0.0)\n"
    "    return attn_unnorm\n\n\n"
    "def _flash_attn_cuda_normalize_S(",
    "flash-attn's kernel stores exp(s - running max) per key block; flashdl stores exp(s - lse)",
)

# Cases that need what flashdl lacks, for --flashdl-supported: (test function, predicate over its
# parameters or None for every case, reason). Reasons are repeated in docs/flash_attn_tests.md.
UNSUPPORTED = [
    ("test_flash_attn_kvcache", "rotary_fraction > 0",
     "rotary_cos/rotary_sin in flash_attn_with_kvcache: NotImplementedError"),
    ("test_flash_attn_kvcache", "has_leftpad",
     "cache_leftpad in flash_attn_with_kvcache: NotImplementedError"),
    ("test_flash_attn_kvcache", "has_batch_idx",
     "cache_batch_idx in flash_attn_with_kvcache: NotImplementedError"),
    ("test_flash_attn_varlen_causal", "paged_kv_block_size is not None",
     "block_table in flash_attn_varlen_func: NotImplementedError"),
    ("test_flash_attn_varlen_paged_kv_num_splits", None,
     "calls flash-attn's private _flash_attn_varlen_forward (and paged varlen)"),
    ("test_flash_attn_generator_arg_must_be_none", None,
     "calls flash-attn's private CUDA extension flash_attn_gpu"),
]

SHIM = {
    "flash_attn/__init__.py": '''
        """Shim for flash-attn's test module: flashdl.flash_attn under flash-attn's name.
        Generated by tools/flash_attn_upstream.py; not part of flashdl."""
        from flashdl.flash_attn import *  # noqa: F401,F403
        from flashdl.flash_attn import __all__  # noqa: F401
        __version__ = "flashdl-shim"
        ''',
    "flash_attn/bert_padding.py": '''
        from flashdl.flash_attn import pad_input, unpad_input  # noqa: F401
        ''',
    "flash_attn/flash_attn_interface.py": '''
        from flashdl.flash_attn import *  # noqa: F401,F403

        USE_TRITON_ROCM = False


        def _get_block_size_n(device, head_dim, is_dropout, is_causal):
            """The key-block width of flash-attn's sm80 forward kernel, which its tests use to
            undo that kernel's per-block scaling of S_dmask. flashdl's S_dmask is not scaled
            per block (it is normalised), so no width makes that undoing right for it; see
            --sdmask-normalised."""
            assert head_dim <= 256
            if head_dim <= 32:
                return 128
            if head_dim <= 64:
                return 64 if is_dropout else 128
            if head_dim <= 128:
                return 32 if is_dropout else 64
            return 64
        ''',
    "flash_attn/layers/__init__.py": "",
    "flash_attn/layers/rotary.py": '''
        """A torch reference of flash-attn's apply_rotary_emb (x: (batch, seqlen, nheads,
        headdim); cos, sin: (seqlen_ro, rotary_dim / 2); seqlen_offsets: int or (batch,))."""
        import torch


        def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0,
                             cu_seqlens=None, max_seqlen=None):
            if cu_seqlens is not None:
                raise NotImplementedError("shim apply_rotary_emb: cu_seqlens")
            batch, seqlen = x.shape[0], x.shape[1]
            rd = 2 * cos.shape[-1]
            pos = torch.arange(seqlen, device=x.device)[None, :] + torch.as_tensor(
                seqlen_offsets, device=x.device).reshape(-1, 1).long()
            c = cos[pos].float()[:, :, None, :]  # (batch or 1, seqlen, 1, rd / 2)
            s = sin[pos].float()[:, :, None, :]
            xr = x[..., :rd].float()
            if interleaved:
                x1, x2 = xr[..., 0::2], xr[..., 1::2]
                r = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
            else:
                x1, x2 = xr[..., :rd // 2], xr[..., rd // 2:]
                r = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
            out = torch.cat((r.to(x.dtype), x[..., rd:]), dim=-1)
            if inplace:
                x.copy_(out)
                return x
            return out
        ''',
}

CONFTEST = '''
\"\"\"Selection options for the adapted flash-attn test module. Generated by
tools/flash_attn_upstream.py.\"\"\"
import builtins
import random

import pytest

UNSUPPORTED = {unsupported!r}


class _Params(dict):
    \"\"\"A case's parameters as eval locals: a parameter the test lacks is None; builtins
    and the names given at construction stay.\"\"\"

    def __missing__(self, key):
        if hasattr(builtins, key):
            raise KeyError(key)
        return None


def pytest_addoption(parser):
    g = parser.getgroup("flashdl")
    g.addoption("--flashdl-supported", action="store_true",
                help="deselect the cases that need what flashdl lacks")
    g.addoption("--flashdl-unsupported", action="store_true",
                help="keep only the cases that need what flashdl lacks")
    g.addoption("--flashdl-where", default=None,
                help="keep the cases whose parameters satisfy this Python expression")
    g.addoption("--flashdl-sample", action="append", default=[],
                help="N, or TEST=N: keep at most N cases per test function (TEST=N: of that one)")
    g.addoption("--flashdl-seed", type=int, default=0)


def _holds(expr, p):
    try:
        return bool(eval(expr, {{}}, p))
    except TypeError:  # e.g. None > 0: a parameter this test lacks
        return False


def _fn(item):
    return item.originalname or item.name


@pytest.hookimpl(trylast=True)  # after -k and -m
def pytest_collection_modifyitems(config, items):
    import torch
    keep, drop = [], []
    where = config.getoption("--flashdl-where")
    supported = config.getoption("--flashdl-supported")
    unsupported = config.getoption("--flashdl-unsupported")
    env = {{"float16": torch.float16, "bfloat16": torch.bfloat16, "torch": torch}}
    for item in items:
        cs = getattr(item, "callspec", None)
        p = _Params(env, test=_fn(item))
        p.update(cs.params if cs else {{}})
        lacks = any(fn == p["test"] and (pred is None or _holds(pred, p))
                    for fn, pred, _why in UNSUPPORTED)
        ok = not (supported and lacks) and not (unsupported and not lacks)
        if ok and where is not None:
            ok = _holds(where, p)
        (keep if ok else drop).append(item)
    default, per_fn = 0, {{}}
    for spec in config.getoption("--flashdl-sample"):
        name, _, n = spec.rpartition("=")
        if name:
            per_fn[name] = int(n)
        else:
            default = int(n)
    if default or per_fn:
        by_fn = {{}}
        for item in keep:
            by_fn.setdefault(_fn(item), []).append(item)
        chosen = set()
        for fn, group in by_fn.items():
            n = per_fn.get(fn, default)
            rng = random.Random(f"{{config.getoption('--flashdl-seed')}}:{{fn}}")
            if 0 < n < len(group):
                group = rng.sample(group, n)
            chosen.update(id(i) for i in group)
        drop += [i for i in keep if id(i) not in chosen]
        keep = [i for i in keep if id(i) in chosen]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
'''


def read_source(path):
    """The text of flash-attn's tests/test_flash_attn.py from a file, checkout or sdist."""
    if os.path.isdir(path):
        path = os.path.join(path, "tests", "test_flash_attn.py")
    if path.endswith((".tar.gz", ".tgz")):
        with tarfile.open(path) as tar:
            names = [m for m in tar.getmembers()
                     if m.name.endswith("/tests/test_flash_attn.py")]
            if not names:
                sys.exit(f"{path}: no tests/test_flash_attn.py in this archive")
            return tar.extractfile(names[0]).read().decode(), f"{path}:{names[0].name}"
    if not os.path.isfile(path):
        sys.exit(f"{path}: no such file (give tests/test_flash_attn.py, a flash-attn checkout "
                 "or an sdist)")
    with open(path, encoding="utf-8") as f:
        return f.read(), path


def download_sdist(version, into):
    """pip download flash-attn's sdist. Its setup.py runs even for a download (egg_info) and
    needs nvcc unless FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE; it imports torch, hence
    --no-build-isolation."""
    spec = "flash-attn" + (f"=={version}" if version else "")
    env = dict(os.environ, FLASH_ATTENTION_SKIP_CUDA_BUILD="TRUE")
    cmd = [sys.executable, "-m", "pip", "download", spec, "--no-deps", "--no-binary", ":all:",
           "--no-build-isolation", "-d", into]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)
    tars = [f for f in os.listdir(into) if f.endswith(".tar.gz")]
    if len(tars) != 1:
        sys.exit(f"expected one sdist in {into}, found {tars}")
    return os.path.join(into, tars[0])


def adapt(text, sdmask_normalised):
    subs = SUBSTITUTIONS + ([SDMASK_SUBSTITUTION] if sdmask_normalised else [])
    report = []
    for what, pattern, repl, why in subs:
        text, n = re.subn(pattern, lambda _m, r=repl: r, text, flags=re.MULTILINE)
        report.append((what, n, why))
    left = [ln for ln in text.splitlines()
            if "torch.cuda" in ln and not ln.lstrip().startswith("#")]
    return text, report, left


def write_tree(out, text):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "test_flash_attn.py"), "w", encoding="utf-8") as f:
        f.write(text)
    for rel, body in SHIM.items():
        path = os.path.join(out, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(textwrap.dedent(body).lstrip())
    with open(os.path.join(out, "conftest.py"), "w", encoding="utf-8") as f:
        f.write(CONFTEST.format(unsupported=UNSUPPORTED).lstrip())
    with open(os.path.join(out, "pytest.ini"), "w", encoding="utf-8") as f:
        f.write("[pytest]\n")  # this directory is the rootdir, whatever lies above it


def summarize(junit):
    """Per test function: passed, failed (and errors), skipped, seconds, from pytest's JUnit XML;
    printed as a Markdown table."""
    rows = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        fn = case.get("name", "").split("[")[0]
        r = rows.setdefault(fn, [0, 0, 0, 0.0])
        kinds = {child.tag for child in case}
        r[1 if kinds & {"failure", "error"} else 2 if "skipped" in kinds else 0] += 1
        r[3] += float(case.get("time") or 0)
    print("| test function | passed | failed | skipped | seconds |")
    print("|---|---:|---:|---:|---:|")
    tot = [0, 0, 0, 0.0]
    for fn, r in rows.items():
        print(f"| {fn} | {r[0]} | {r[1]} | {r[2]} | {r[3]:.0f} |")
        tot = [a + b for a, b in zip(tot, r)]
    print(f"| total | {tot[0]} | {tot[1]} | {tot[2]} | {tot[3]:.0f} |")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = []
    if "--" in argv:
        i = argv.index("--")
        argv, pytest_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", nargs="?", help="test_flash_attn.py, a flash-attn checkout or sdist")
    ap.add_argument("--from-sdist", action="store_true", help="pip download flash-attn's sdist")
    ap.add_argument("--version", default=None, help="with --from-sdist: flash-attn's version")
    ap.add_argument("--out", default=None, help="directory for the adapted copy (default: temp)")
    ap.add_argument("--sdmask-normalised", action="store_true",
                    help="substitution 5: flashdl's S_dmask is already normalised")
    ap.add_argument("--no-run", action="store_true", help="write the copy, do not run pytest")
    args = ap.parse_args(argv)
    if bool(args.source) == args.from_sdist:
        ap.error("give a source path or --from-sdist (one of them)")

    work = tempfile.mkdtemp(prefix="flashdl-fa-") if args.from_sdist or not args.out else None
    source = download_sdist(args.version, work) if args.from_sdist else args.source
    text, origin = read_source(source)
    text, report, left = adapt(text, args.sdmask_normalised)
    out = os.path.abspath(args.out or os.path.join(work, "adapted"))
    write_tree(out, text)

    print(f"source: {origin}")
    print(f"adapted copy: {os.path.join(out, 'test_flash_attn.py')}")
    for n_, (what, n, why) in enumerate(report, 1):
        print(f"  {n_}. {what}: {n} substitution(s) -- {why}")
    if left:
        print("  lines still naming torch.cuda (not substituted):")
        for ln in left:
            print("    " + ln.strip())
    if any(n == 0 for _w, n, _y in report[:4]):
        print("warning: a substitution matched nothing; the module may have changed upstream")
    if args.no_run:
        return 0
    env = dict(os.environ)
    env["PYTHONPATH"] = out + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    junit = [a for a in pytest_args if a.startswith("--junitxml")]
    if not junit:
        pytest_args.append("--junitxml=" + os.path.join(out, "junit.xml"))
        if os.path.exists(os.path.join(out, "junit.xml")):
            os.remove(os.path.join(out, "junit.xml"))  # no table from an earlier run
    cmd = [sys.executable, "-m", "pytest", "test_flash_attn.py", "-p", "no:cacheprovider",
           *pytest_args]
    print("+ (cd", out, "&&", " ".join(cmd) + ")", flush=True)
    rc = subprocess.run(cmd, cwd=out, env=env).returncode
    if not junit and os.path.exists(os.path.join(out, "junit.xml")):
        summarize(os.path.join(out, "junit.xml"))
    return rc


if __name__ == "__main__":
    sys.exit(main())
