"""Parse nvdisasm output into per-function instruction lists.

Input: the text that `nvdisasm -hex -g -c <cubin>` prints (`-hex` adds the two 64-bit encoding
words the issue model needs; `-g` adds the `//## File "...", line N` source annotations; `-c`
prints code sections only). Plain, `.xz` or `.gz` files are read alike.

Each instruction becomes an `Ins`: address, predicate, opcode (`op`: the mnemonic, `full`: with
its modifiers), operands, branch target (an address), labels, source file and line in effect,
and the two encoding words (`lo`, `hi`). `Ins.ctl` decodes the control word (the high 64 bits
of the 128-bit Volta-and-later encoding):

    bits 41-44  stall    cycles before the warp may issue its next instruction
    bit  45     yield
    bits 46-48  wbar     scoreboard this instruction sets when it writes its result (7: none)
    bits 49-51  rbar     scoreboard released once its operands are read (7: none)
    bits 52-57  wait     mask of scoreboards that must be clear before it issues
    bits 58-61  reuse    operand-reuse cache flags

`load(path)` reads either nvdisasm or cuobjdump -sass text (see cuobj_parse.py), chosen by
content. The command line prints a per-function instruction-class histogram (--summary) or the
decoded instruction list (--list). Python 3 standard library only.
"""
import argparse
import collections
import gzip
import io
import lzma
import os
import re
import sys

sys.dont_write_bytecode = True  # keep the tool directory clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

Control = collections.namedtuple('Control', 'stall yld wbar rbar wait reuse')

# Instructions that transfer control; the ones with a target operand get Ins.target.
TARGET_OPS = {'BRA', 'BRX', 'JMP', 'JMX', 'CALL', 'BSSY', 'SSY', 'PBK', 'PCNT', 'BREAK', 'BPT'}
BLOCK_ENDS = {'BRA', 'BRX', 'JMP', 'JMX', 'CALL', 'RET', 'EXIT', 'KILL'}


def decode_control(hi):
    """Control fields of the high encoding word (None when the text had no -hex encodings)."""
    if hi is None:
        return None
    return Control((hi >> 41) & 0xf, (hi >> 45) & 1, (hi >> 46) & 7, (hi >> 49) & 7,
                   (hi >> 52) & 0x3f, (hi >> 58) & 0xf)


class Ins:
    __slots__ = ('addr', 'pred', 'op', 'full', 'args', 'text', 'target', 'target_label', 'labels',
                 'file', 'line', 'inlined_at', 'lo', 'hi')

    def __init__(self, addr, text, file=None, line=None, inlined_at=None):
        if '  ' in text or '\t' in text:
            text = ' '.join(text.split())
        self.addr = addr
        self.text = text
        m = re.match(r'^(@!?U?P\w+\s+)?(\S+)\s*(.*)$', text)
        self.pred = (m.group(1) or '').strip()
        self.full = m.group(2)
        self.op = self.full.split('.')[0]
        self.args = m.group(3)
        self.target = None
        self.target_label = None
        self.labels = []
        self.file, self.line, self.inlined_at = file, line, inlined_at
        self.lo = self.hi = None

    @property
    def ctl(self):
        return decode_control(self.hi)

    @property
    def src(self):
        """(file basename, line) of the source line in effect, or None."""
        return (os.path.basename(self.file), self.line) if self.file else None

    @property
    def never(self):
        """Predicated on !PT: issued (it takes an issue slot) but never executed."""
        return self.pred == '@!PT'

    @property
    def conditional(self):
        return self.pred not in ('', '@PT')

    def where(self):
        s = self.src
        return f'{s[0]}:{s[1]}' if s else '?'

    def __repr__(self):
        return f'<{self.addr:05x} {self.pred + " " if self.pred else ""}{self.full} {self.args}>'


# ---------------------------------------------------------------------------------------------
# Instruction classes (the histogram of --summary and of hot_path.py)

INT_ADDR = {'IMAD', 'IADD3', 'LEA', 'VIADD', 'LOP3', 'ISETP', 'SHF', 'MOV'}
FP = {'FMUL', 'FFMA', 'FADD', 'FMNMX', 'FSEL', 'FSETP', 'FSET', 'F2FP', 'F2F', 'FCHK', 'FRND',
      'FSWZADD', 'HADD2', 'HMUL2', 'HFMA2', 'HMNMX2', 'HSETP2', 'HSET2', 'DADD', 'DMUL', 'DFMA',
      'DSETP'}
CLASSES = (
    ('HMMA', {'HMMA', 'HGMMA', 'IMMA', 'DMMA'}),
    ('LDSM', {'LDSM'}),
    ('LDS', {'LDS'}),
    ('STS', {'STS', 'STSM'}),
    ('LDGSTS', {'LDGSTS'}),
    ('LDG/STG', {'LDG', 'STG', 'LD', 'ST'}),
    ('RED/ATOM', {'RED', 'REDG', 'REDS', 'ATOM', 'ATOMG', 'ATOMS'}),
    ('LDL/STL', {'LDL', 'STL'}),
    ('BAR', {'BAR'}),
    ('DEPBAR', {'DEPBAR', 'LDGDEPBAR'}),
    ('MUFU', {'MUFU'}),
    ('SHFL', {'SHFL'}),
    ('FP', FP),
    ('INT', INT_ADDR),
    ('BRA', {'BRA', 'BRX', 'JMP', 'JMX', 'CALL', 'RET', 'EXIT'}),
    ('BSSY/BSYNC', {'BSSY', 'BSYNC', 'WARPSYNC', 'BREAK', 'BMOV'}),
)
CLASS_NAMES = tuple(c for c, _ in CLASSES) + ('other',)
CLASS_HELP = {
    'HMMA': 'tensor-core MMA (HMMA.16816.F32 on these kernels)',
    'LDSM': 'ldmatrix',
    'LDS': 'shared loads (with the @!PT placeholders)',
    'STS': 'shared stores',
    'LDGSTS': 'cp.async global->shared',
    'LDG/STG': 'global loads/stores',
    'RED/ATOM': 'atomics',
    'LDL/STL': 'local memory (spills)',
    'BAR': 'CTA barriers',
    'DEPBAR': 'cp.async commit/wait',
    'MUFU': 'special function unit (exp2, rcp)',
    'SHFL': 'warp shuffles',
    'FP': 'FMUL FFMA FADD FMNMX FSEL FSETP F2FP ... ',
    'INT': 'integer/address: IMAD IADD3 LEA VIADD LOP3 ISETP SHF MOV',
    'BRA': 'branches, calls, exits',
    'BSSY/BSYNC': 'convergence barriers',
    'other': 'everything else (uniform datapath, S2R, LDC, SEL, PRMT, PLOP3, VOTE, NOP ...)',
}
_CLASS_OF = {op: c for c, ops in CLASSES for op in ops}


def classify(ins):
    return _CLASS_OF.get(ins.op, 'other')


def histogram(instrs):
    """(class counter, opcode counter, number of @!PT placeholders)."""
    cls = collections.Counter()
    ops = collections.Counter()
    never = 0
    for i in instrs:
        cls[classify(i)] += 1
        ops[i.op] += 1
        never += i.never
    return cls, ops, never


# ---------------------------------------------------------------------------------------------
# Reading

def open_text(path):
    """A text stream for a plain, .xz or .gz file."""
    with open(path, 'rb') as f:
        magic = f.read(6)
    if magic.startswith(b'\xfd7zXZ\x00'):
        return io.TextIOWrapper(lzma.open(path, 'rb'), encoding='utf-8', errors='replace')
    if magic.startswith(b'\x1f\x8b'):
        return io.TextIOWrapper(gzip.open(path, 'rb'), encoding='utf-8', errors='replace')
    return open(path, encoding='utf-8', errors='replace')


_FUNC = re.compile(r'^\s*//-+ \.text\.(\S+) -+')
_SECTION = re.compile(r'^\s*//-+ ')
_LINE = re.compile(r'^\s*//## File "([^"]+)", line (\d+)(?:.*?inlined at "([^"]+)", line (\d+))?')
_LABEL = re.compile(r'^\s*([.$\w][\w.$]*):\s*$')
_INS = re.compile(r'^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*$')
_HEX = re.compile(r'/\* (0x[0-9a-f]{16}) \*/\s*$')
_ONLY_HEX = re.compile(r'^\s*/\* (0x[0-9a-f]{16}) \*/\s*$')
_LABEL_TARGET = re.compile(r'`\(([^)]+)\)')


def parse_nvdisasm(lines):
    """nvdisasm text -> OrderedDict(function name -> [Ins])."""
    funcs = collections.OrderedDict()
    labels = {}
    cur = None
    body = None
    file = line = inl = None
    pending = []
    for raw in lines:
        s = raw.strip()
        if not s:
            continue
        if s.startswith('/*'):
            if body is None:
                continue
            if s.startswith('/* 0x'):  # the second (high) encoding word of the instruction above
                m = _ONLY_HEX.match(s)
                if m and body and body[-1].hi is None:
                    body[-1].hi = int(m.group(1), 16)
                continue
            hx = _HEX.search(s)
            m = _INS.match(s[:hx.start()] if hx else s)
            if not m:
                continue
            text = m.group(2).strip().rstrip(';').strip()
            i = Ins(int(m.group(1), 16), text, file, line, inl)
            if hx:
                i.lo = int(hx.group(1), 16)
            if '`(' in text:
                t = _LABEL_TARGET.search(text)
                if t:
                    i.target_label = t.group(1)
            if pending:
                for lab in pending:
                    labels[cur][lab] = i.addr
                # the function's own symbol labels are not branch-target labels
                i.labels = [x for x in pending if x not in (cur, '.text.' + cur)]
                pending = []
            body.append(i)
            continue
        if s.startswith('//'):
            if s.startswith('//##'):
                m = _LINE.match(s)
                if m:
                    file, line = m.group(1), int(m.group(2))
                    inl = (m.group(3), int(m.group(4))) if m.group(3) else None
                continue
            m = _FUNC.match(s)
            if m:
                cur = m.group(1)
                body = funcs[cur] = []
                labels[cur] = {}
                file = line = inl = None
                pending = []
            elif _SECTION.match(s):
                cur = body = None
            continue
        if body is not None and s.endswith(':'):
            m = _LABEL.match(s)
            if m:
                pending.append(m.group(1))
    for name, ins in funcs.items():
        end = ins[-1].addr + 16 if ins else 0
        for i in ins:
            if i.target_label is not None and i.op in TARGET_OPS | {'WARPSYNC'}:
                i.target = labels[name].get(i.target_label, end)
    return funcs


def detect_format(path):
    """'nvdisasm' or 'cuobjdump', from the first lines that tell."""
    with open_text(path) as f:
        for k, raw in enumerate(f):
            if _FUNC.match(raw):
                return 'nvdisasm'
            if re.search(r'^\s*Function : \S+', raw):
                return 'cuobjdump'
            if k > 200000:
                break
    raise SystemExit(f'{path}: neither nvdisasm nor cuobjdump -sass output (no functions found)')


def load(path):
    """Any supported SASS text -> OrderedDict(function name -> [Ins])."""
    fmt = detect_format(path)
    with open_text(path) as f:
        if fmt == 'nvdisasm':
            return parse_nvdisasm(f)
        import cuobj_parse
        return cuobj_parse.parse_cuobjdump(f)


def parse(path):
    """nvdisasm text file -> OrderedDict(function name -> [Ins])."""
    with open_text(path) as f:
        return parse_nvdisasm(f)


def pick_function(funcs, sub=None):
    """The function whose name contains `sub` (or the only one); exits with a list otherwise."""
    names = list(funcs)
    if sub:
        cand = [n for n in names if sub in n]
        if sub in cand:
            cand = [sub]
    else:
        cand = [n for n in names if funcs[n]]
        if len(cand) > 1:
            # entry kernels only: nvdisasm emits one section per kernel
            entry = [n for n in cand if not n.startswith('$')]
            cand = entry if entry else cand
    if len(cand) == 1:
        return cand[0], funcs[cand[0]]
    lines = [f'  {len(funcs[n]):6d} instr {sum(1 for i in funcs[n] if i.op == "HMMA"):5d} HMMA  {n}'
             for n in names]
    what = (f'no function matches {sub!r}' if not cand
            else 'several functions match; pick one with -f SUBSTRING')
    raise SystemExit(what + ':\n' + '\n'.join(lines))


def leaders(ins):
    """Indices that start a basic block: branch/call targets, and the instruction after a
    control transfer."""
    idx = {i.addr: k for k, i in enumerate(ins)}
    out = {0}
    for k, i in enumerate(ins):
        if i.labels:
            out.add(k)
        if i.target is not None and i.target in idx:
            out.add(idx[i.target])
        if i.op in BLOCK_ENDS and k + 1 < len(ins):
            out.add(k + 1)
    return sorted(out)


def blocks(ins):
    """Basic blocks as (start index, end index exclusive)."""
    s = leaders(ins)
    return [(a, s[j + 1] if j + 1 < len(s) else len(ins)) for j, a in enumerate(s)]


# ---------------------------------------------------------------------------------------------
# Command line

def run_cli(main):
    """Run a command-line main(); quiet when the output is piped into head."""
    try:
        main()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


def format_histogram(instrs, indent='  '):
    cls, ops, never = histogram(instrs)
    out = []
    for c in CLASS_NAMES:
        if cls[c]:
            members = [o for o, _ in ops.most_common() if _CLASS_OF.get(o, 'other') == c]
            detail = ' '.join(f'{o}={ops[o]}' for o in members[:8]) if members != [c] else ''
            out.append(f'{indent}{c:11s} {cls[c]:6d}   {detail}')
    out.append(f'{indent}{"@!PT":11s} {never:6d}   (placeholders: issued, never executed)')
    return '\n'.join(out)


def main(argv=None, description=None):
    legend = 'instruction classes:\n' + '\n'.join(f'  {c:11s} {CLASS_HELP[c]}' for c in CLASS_NAMES)
    ap = argparse.ArgumentParser(description=description or __doc__.split('\n\n')[0], epilog=legend,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('sass', help='nvdisasm (or cuobjdump -sass) text; .xz/.gz read transparently')
    ap.add_argument('-f', '--function', help='substring of the (mangled) function name')
    ap.add_argument('--summary', action='store_true',
                    help='per-function instruction-class histogram (the default)')
    ap.add_argument('--list', action='store_true',
                    help='the chosen function instruction by instruction, control word decoded')
    a = ap.parse_args(argv)
    funcs = load(a.sass)
    if a.list:
        name, ins = pick_function(funcs, a.function)
        print(f'# {name}')
        print('# addr  stall yld wbar rbar wait    src                        instruction')
        for i in ins:
            c = i.ctl
            cw = (f'{c.stall:5d} {c.yld:3d} {c.wbar:4d} {c.rbar:4d} {c.wait:06b}' if c
                  else '    -   -    -    -      -')
            lab = (','.join(i.labels) + ': ') if i.labels else ''
            print(f'{i.addr:05x} {cw}  {i.where():26s} {lab}{i.text}')
        return
    for name, ins in funcs.items():
        if a.function and a.function not in name:
            continue
        if not ins:
            continue
        h = sum(1 for i in ins if i.op == 'HMMA')
        print(f'{name}\n  {len(ins)} instructions, {h} HMMA')
        print(format_histogram(ins))


if __name__ == '__main__':
    run_cli(main)
