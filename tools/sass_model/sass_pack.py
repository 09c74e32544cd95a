"""Cut one function out of nvdisasm or cuobjdump -sass text and store it compactly (.xz).

Keeps the function's instructions, encodings, labels and source annotations; drops the other
functions and sections, squeezes the column padding, and rewrites source paths with
--strip-prefix (so no build-machine path is stored). The result reads with every tool of this
directory like the original. Python 3 standard library only.

  python3 sass_pack.py <unit>.sass -f <name part> -o <kernel>.sass.xz --strip-prefix <checkout>/ \\
      --strip-prefix '<cuda-root>/targets/x86_64-linux/=<cuda>/' --note 'flashdl <commit> ...'
"""
import argparse
import lzma
import os
import re
import sys

sys.dont_write_bytecode = True  # keep the tool directory clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sass_parse  # noqa: E402


def cut_nvdisasm(lines, name):
    out = []
    keep = False
    for raw in lines:
        s = raw.strip()
        if s.startswith('//-'):
            m = sass_parse._FUNC.match(s)
            keep = bool(m and m.group(1) == name)
        if keep:
            out.append(raw.rstrip('\n'))
    return out


def cut_cuobjdump(lines, name):
    out = []
    keep = False
    for raw in lines:
        m = re.match(r'^\s*Function : (\S+)', raw)
        if m:
            keep = m.group(1) == name
        if keep:
            out.append(raw.rstrip('\n'))
            if re.match(r'^\s*\.{6,}\s*$', raw):
                keep = False
    return out


def rewrite(line, prefixes, squeeze):
    if squeeze:
        line = re.sub(r'[ \t]+', ' ', line.rstrip())
    if '//## File "' in line:
        for old, new in prefixes:
            line = line.replace(f'"{old}', f'"{new}')
    return line


def main(argv=None):
    head, _, example = __doc__.split('\n\n', 2)
    ap = argparse.ArgumentParser(description=head, epilog=example,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('sass', help='nvdisasm or cuobjdump -sass text (.xz/.gz read transparently)')
    ap.add_argument('-f', '--function', help='substring of the (mangled) function name')
    ap.add_argument('-o', '--output', required=True, help='output file (.xz: compressed)')
    ap.add_argument('--strip-prefix', action='append', default=[], metavar='PREFIX[=REPLACEMENT]',
                    help='rewrite source paths starting with PREFIX')
    ap.add_argument('--no-squeeze', action='store_true', help='keep the column padding')
    ap.add_argument('--note', action='append', default=[], help='a comment line to put first')
    a = ap.parse_args(argv)
    fmt = sass_parse.detect_format(a.sass)
    name, ins = sass_parse.pick_function(sass_parse.load(a.sass), a.function)
    with sass_parse.open_text(a.sass) as f:
        body = (cut_nvdisasm if fmt == 'nvdisasm' else cut_cuobjdump)(f, name)
    prefixes = [tuple(p.split('=', 1)) if '=' in p else (p, '') for p in a.strip_prefix]
    text = '\n'.join([f'// {n}' for n in a.note] +
                     [rewrite(x, prefixes, not a.no_squeeze) for x in body]) + '\n'
    data = text.encode()
    if a.output.endswith('.xz'):
        data = lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)
    with open(a.output, 'wb') as f:
        f.write(data)
    back = sass_parse.pick_function(sass_parse.load(a.output), None)[1]
    key = [(i.addr, i.text, i.hi, i.line) for i in ins]
    same = key == [(i.addr, i.text, i.hi, i.line) for i in back]
    print(f'{a.output}: {name}, {len(ins)} instructions, {len(data)} bytes'
          + ('' if same else '  WARNING: does not read back identically'))
    return 0 if same else 1


if __name__ == '__main__':
    sass_parse.run_cli(lambda: sys.exit(main()))
