"""Parse `cuobjdump -sass` output into per-function instruction lists.

The same `Ins` records as sass_parse.py (address, predicate, opcode, operands, branch target
address, decoded control word); cuobjdump prints no source lines, so `file`/`line` stay empty and
hot paths are given by address. This is the format of the FlashAttention-2 reference kernels
(`cuobjdump -arch sm_90 -sass -fun <mangled name> libtorch_cuda.so`), whose encodings cuobjdump
prints as two 64-bit words like nvdisasm -hex does. Plain, .xz or .gz files are read alike.

The command line prints a per-function instruction-class histogram (--summary) or the decoded
instruction list (--list). Python 3 standard library only.
"""
import collections
import os
import re
import sys

sys.dont_write_bytecode = True  # keep the tool directory clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sass_parse  # noqa: E402
from sass_parse import Ins, TARGET_OPS  # noqa: E402

_FUNC = re.compile(r'^\s*Function : (\S+)')
_INS = re.compile(r'^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*(?:/\* (0x[0-9a-f]{16}) \*/)?\s*$')
_ONLY_HEX = re.compile(r'^\s*/\* (0x[0-9a-f]{16}) \*/\s*$')
_END = re.compile(r'^\s*\.{6,}\s*$')
_ADDR_TARGET = re.compile(r'(?:`\()?0x([0-9a-f]+)\)?\s*$')


def parse_cuobjdump(lines):
    """cuobjdump -sass text -> OrderedDict(function name -> [Ins])."""
    funcs = collections.OrderedDict()
    cur = None
    for raw in lines:
        m = _FUNC.match(raw)
        if m:
            cur = m.group(1)
            funcs[cur] = []
            continue
        if cur is None:
            continue
        if _END.match(raw):
            cur = None
            continue
        m = _ONLY_HEX.match(raw)
        if m:
            body = funcs[cur]
            if body and body[-1].hi is None:
                body[-1].hi = int(m.group(1), 16)
            continue
        m = _INS.match(raw)
        if not m:
            continue
        i = Ins(int(m.group(1), 16), m.group(2).strip())
        if m.group(3):
            i.lo = int(m.group(3), 16)
        if i.op in TARGET_OPS:
            t = _ADDR_TARGET.search(i.args)
            if t:
                i.target = int(t.group(1), 16)
                i.target_label = f'0x{i.target:x}'
        funcs[cur].append(i)
    # labels, so that listings show where branches land
    for body in funcs.values():
        targets = {i.target for i in body if i.target is not None}
        for i in body:
            if i.addr in targets:
                i.labels = [f'0x{i.addr:x}']
    return funcs


def parse(path):
    """cuobjdump -sass text file -> OrderedDict(function name -> [Ins])."""
    with sass_parse.open_text(path) as f:
        return parse_cuobjdump(f)


if __name__ == '__main__':
    # same command line as sass_parse.py (load() recognises either format)
    sass_parse.run_cli(lambda: sass_parse.main(description=__doc__.split('\n\n')[0]))
