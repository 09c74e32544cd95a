"""Walk one path through a function's SASS control-flow graph and count it by instruction class.

A hot path is one loop iteration as the common case executes it. It is given in one of three
ways, all of which work with addresses alone (so they keep working however the source changes):

  --range LO:HI [--range ...]      address ranges (inclusive, hex), concatenated in order
  --blocks A,B,C                   basic blocks by start address, in execution order
  --walk START:STOP [--take SEL]   follow the CFG from START until the instruction at STOP:
                                   unconditional branches are followed, conditional ones fall
                                   through unless a --take selects them, BRA.DIV (the diverged-
                                   warp fallback) is never taken, CALLs are counted but not
                                   entered, an unpredicated EXIT ends the walk.

--take SEL[=N] takes the selected conditional branch(es) N times and then falls through (no N,
or N = -1: always taken). SEL is
  0x2e360             an address (hex)
  FILE:LINE           every conditional branch of the function attributed to that source
                      line (needs nvdisasm -g output; FILE is matched by basename); only
                      the ones the walk meets matter
  NAME                a marker: --source FILE --marker NAME='text' names the line(s) of FILE
                      containing the text, so a rule survives edits that move lines
followed optionally by :back or :fwd (only backward / forward branches) and @PRED (only branches
with that predicate, e.g. @P1; '@!' matches any negated predicate). --loop SEL[:largest|:smallest]
sets START:STOP to the loop whose back edge is attributed to SEL (the largest, or the smallest,
of those containing HMMA). --avoid-calls takes, among the undecided conditional branches, those
whose fall-through code runs into a CALL before the next branch while the taken side does not
(e.g. the 32-bit fast path of a 64-bit division).

--then starts another iteration pattern (e.g. the same loop with a rarely taken rescale skipped);
a pattern that names no path of its own reuses the previous pattern's walk and adds its --take
decisions to it. Counts are given per pattern and as a weighted mean (--weights).

Discovery: --loops lists every loop (back edge: head, size, HMMA count, source line); --bb LO:HI
lists the basic blocks of a range with their main counts, source lines and closing branch. The
walk prints the decisions it used as --take arguments, so a walk chosen by line or marker can be
frozen into addresses.
Python 3 standard library only.
"""
import argparse
import collections
import json
import os
import re
import sys

sys.dont_write_bytecode = True  # keep the tool directory clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sass_parse  # noqa: E402
from sass_parse import CLASS_NAMES, histogram, classify  # noqa: E402

Walk = collections.namedtuple('Walk', 'path decisions reached end')
Loop = collections.namedtuple('Loop', 'head back size hmma src')


def hexaddr(s):
    t = s.strip().lower()
    try:
        return int(t[2:] if t.startswith('0x') else t, 16)
    except ValueError:
        raise SystemExit(f'not a hex address: {s!r}') from None


def _index(ins):
    return {i.addr: k for k, i in enumerate(ins)}


def _is_branch(i):
    """A branch the walk may take: BRA, but not BRA.DIV."""
    return i.op == 'BRA' and '.DIV' not in i.full


def _run_has_call(ins, k):
    """Does the straight-line code from index k reach a CALL before another control transfer?"""
    for x in ins[k:k + 64]:
        if x.op == 'CALL':
            return True
        if x.op in ('BRA', 'EXIT', 'RET', 'BRX', 'JMP', 'JMX'):
            return False
    return False


def _next(ins, idx, k):
    """Where control goes after the instruction at index k, for the look-ahead of a branch
    decision: (next index or None at an exit, index of a forward branch's taken side or None).
    Unconditional branches are followed; conditional backward ones (loops' back edges) fall
    through."""
    i = ins[k]
    if i.op in ('EXIT', 'RET') and not i.conditional:
        return None, None
    if _is_branch(i) and i.pred != '@!PT':
        if i.target not in idx:
            return (k + 1 if i.conditional else None), None
        if not i.conditional:
            return idx[i.target], None
        if i.target > i.addr:
            return k + 1, idx[i.target]
    return k + 1, None


def _reach(ins, idx, k, n):
    """{index: distance} of the instructions reachable from index k within n, over both sides of
    every forward branch."""
    dist = {}
    frontier = [(k, 0)]
    while frontier:
        k, d = frontier.pop()
        while k is not None and 0 <= k < len(ins) and d < n and (k not in dist or dist[k] > d):
            dist[k] = d
            d += 1
            k, taken = _next(ins, idx, k)
            if taken is not None:
                frontier.append((taken, d))
    return dist


def _best_worth(ins, idx, k, prefer, avoid, join, n=256, memo=None):
    """The most any path from index k to the join index can be worth: instructions of preferred
    source lines less those of avoided ones, the best side taken at every forward branch."""
    memo = {} if memo is None else memo
    if k in memo:
        return memo[k]
    worth = 0
    start = k
    while k is not None and 0 <= k < len(ins) and k != join and n > 0:
        i = ins[k]
        worth += (i.src in prefer) - (i.src in avoid)
        n -= 1
        k, taken = _next(ins, idx, k)
        if taken is not None:
            worth += max(_best_worth(ins, idx, k, prefer, avoid, join, n, memo),
                         _best_worth(ins, idx, taken, prefer, avoid, join, n, memo))
            break
    memo[start] = worth
    return worth


def _side_worths(ins, idx, k, prefer, avoid, n=256):
    """(fall-through, taken) worth of the conditional forward branch at index k: each side's best
    path up to the point where the two sides meet again (the nearest instruction both reach)."""
    t = idx[ins[k].target]
    a, b = _reach(ins, idx, k + 1, n), _reach(ins, idx, t, n)
    common = [j for j in a if j in b]
    join = min(common, key=lambda j: (max(a[j], b[j]), j)) if common else None
    return tuple(_best_worth(ins, idx, at, prefer, avoid, join, n, {}) for at in (k + 1, t))


def walk(ins, start, stop, take=None, avoid_calls=False, avoid=None, prefer=None,
         max_steps=200000):
    """Follow one path from address `start` to the instruction at `stop` (inclusive).
    take: address -> N (taken N times, then falls through; -1 always). avoid: source lines
    ((file basename, line) pairs) of rare work: an undecided conditional branch goes to the side
    that does not run into them when the other does; prefer: lines of common work, the side that
    runs into them. A side's worth is that of its best path to where the two sides meet again:
    the instructions of preferred lines it runs into less those of avoided ones; the branch goes
    to the side worth clearly more (by 2 or more). Returns a Walk with the instructions in order
    and, per conditional branch met, [times taken, times fallen through]."""
    idx = _index(ins)
    if start not in idx:
        raise SystemExit(f'start address 0x{start:x} is not an instruction of this function')
    if stop not in idx:
        raise SystemExit(f'stop address 0x{stop:x} is not an instruction of this function')
    left = dict(take or {})
    decisions = collections.OrderedDict()
    k = idx[start]
    path = []
    end = 'max-steps'
    while len(path) < max_steps:
        i = ins[k]
        path.append(i)
        if i.addr == stop:
            end = 'stop'
            break
        if _is_branch(i) and i.pred != '@!PT':
            go = True
            if i.conditional:
                if i.addr in left:
                    n = left[i.addr]
                    go = n != 0
                    if n > 0:
                        left[i.addr] = n - 1
                else:
                    go = bool(avoid_calls and _run_has_call(ins, k + 1)
                              and i.target in idx and not _run_has_call(ins, idx[i.target]))
                    # loops' back edges are not decided here: their trips are --take's to give
                    if (prefer or avoid) and i.target in idx and i.target > i.addr:
                        fall, taken = _side_worths(ins, idx, k, prefer or set(), avoid or set())
                        if abs(taken - fall) >= 2:
                            go = taken > fall
                d = decisions.setdefault(i.addr, [0, 0])
                d[0 if go else 1] += 1
            if go:
                if i.target not in idx:
                    end = f'branch at 0x{i.addr:x} leaves the function'
                    break
                k = idx[i.target]
                continue
        if i.op in ('EXIT', 'RET') and not i.conditional:
            end = f'{i.op} at 0x{i.addr:x}'
            break
        if i.op in ('BRX', 'JMX') and not i.conditional:
            end = f'indirect branch at 0x{i.addr:x}'
            break
        k += 1
        if k >= len(ins):
            end = 'end of function'
            break
    return Walk(path, decisions, end == 'stop', end)


def decisions_as_args(decisions):
    """The --take arguments that reproduce a walk's branch decisions."""
    out = []
    for a, (t, f) in decisions.items():
        if t and f:
            out.append(f'--take 0x{a:x}={t}')
        elif t:
            out.append(f'--take 0x{a:x}')
    return out


def by_ranges(ins, ranges):
    """Instructions of inclusive address ranges, concatenated in order."""
    out = []
    for lo, hi in ranges:
        part = [i for i in ins if lo <= i.addr <= hi]
        if not part:
            raise SystemExit(f'range 0x{lo:x}:0x{hi:x} holds no instruction')
        out += part
    return out


def by_blocks(ins, starts):
    """Whole basic blocks by start address, in the order given."""
    idx = _index(ins)
    lead = sass_parse.leaders(ins) + [len(ins)]
    out = []
    for a in starts:
        if a not in idx:
            raise SystemExit(f'block address 0x{a:x} is not an instruction of this function')
        k = idx[a]
        if k not in lead:
            print(f'warning: 0x{a:x} is not the start of a basic block; taken from there to the '
                  f'block end', file=sys.stderr)
        end = min(x for x in lead if x > k)
        out += ins[k:end]
    return out


def loops(ins):
    """Every backward branch: Loop(head, back, size, HMMA count, source of the back edge)."""
    idx = _index(ins)
    out = []
    for k, i in enumerate(ins):
        if _is_branch(i) and i.target is not None and i.target <= i.addr and i.target in idx:
            t = idx[i.target]
            body = ins[t:k + 1]
            out.append(Loop(i.target, i.addr, len(body), sum(1 for x in body if x.op == 'HMMA'),
                            i.src))
    return out


# ---------------------------------------------------------------------------------------------
# Selectors (--take, --loop) and markers

Selector = collections.namedtuple('Selector', 'text addr lines direction pred times')


def find_markers(sources, markers):
    """NAME=TEXT markers -> {NAME: set((file basename, line))} over the --source files."""
    out = {}
    for spec in markers or []:
        if '=' not in spec:
            raise SystemExit(f'--marker wants NAME=TEXT, got {spec!r}')
        name, text = spec.split('=', 1)
        hits = out.get(name, set())  # a name given several times: the union of its lines
        for path in sources or []:
            with open(path, encoding='utf-8', errors='replace') as f:
                for n, t in enumerate(f, 1):
                    if text in t:
                        hits.add((os.path.basename(path), n))
        if not hits:
            raise SystemExit(f'marker {name}: {text!r} is in none of the --source files')
        out[name] = hits
    return out


def parse_selector(spec, markers):
    s = spec
    times = -1
    m = re.search(r'=(-?\d+)$', s)
    if m:
        times, s = int(m.group(1)), s[:m.start()]
    pred = None
    m = re.search(r'@(!?[A-Za-z0-9]*)$', s)
    if m:
        pred, s = '@' + m.group(1), s[:m.start()]
    direction = None
    m = re.search(r':(back|fwd)$', s)
    if m:
        direction, s = m.group(1), s[:m.start()]
    if s in markers:
        return Selector(spec, None, markers[s], direction, pred, times)
    m = re.match(r'^(.+):(\d+)$', s)
    if m:
        return Selector(spec, None, {(os.path.basename(m.group(1)), int(m.group(2)))}, direction,
                        pred, times)
    if re.match(r'^(0x)?[0-9a-fA-F]+$', s):
        return Selector(spec, hexaddr(s), None, direction, pred, times)
    raise SystemExit(f'cannot read selector {spec!r} (an address, FILE:LINE or a --marker name)')


def _matches(sel, i):
    if sel.addr is not None:
        return i.addr == sel.addr
    if i.src not in sel.lines:
        return False
    if sel.direction == 'back' and not (i.target is not None and i.target <= i.addr):
        return False
    if sel.direction == 'fwd' and not (i.target is not None and i.target > i.addr):
        return False
    if sel.pred == '@!':
        return i.pred.startswith('@!')
    if sel.pred is not None:
        return i.pred == sel.pred
    return True


_warned = set()


def resolve_takes(ins, selectors):
    """Selectors -> {branch address: times}, over the whole function (only the branches the
    walk meets matter); a selector that matches no conditional branch is reported."""
    take = {}
    for sel in selectors:
        hits = [i for i in ins if _is_branch(i) and i.conditional and _matches(sel, i)]
        if not hits and sel.text not in _warned:
            _warned.add(sel.text)
            print(f'warning: --take {sel.text}: matches no conditional branch', file=sys.stderr)
        for i in hits:
            take[i.addr] = sel.times
    return take


def find_loop(ins, spec, markers):
    pick = 'largest'
    m = re.search(r':(largest|smallest)$', spec)
    if m:
        pick, spec = m.group(1), spec[:m.start()]
    sel = parse_selector(spec, markers)
    cand = [lp for lp in loops(ins)
            if (lp.back == sel.addr if sel.addr is not None else lp.src in sel.lines)]
    if not cand:
        raise SystemExit(f'--loop {spec}: no backward branch there')
    with_mma = [lp for lp in cand if lp.hmma]
    cand = with_mma or cand
    lp = (max if pick == 'largest' else min)(cand, key=lambda x: x.size)
    return lp.head, lp.back


# ---------------------------------------------------------------------------------------------
# Path arguments shared with smsp_model.py

class _Ordered(argparse.Action):
    """Keeps --range/--blocks/--walk/--loop/--take/--avoid-calls/--then in command-line order."""

    def __call__(self, parser, ns, values, option_string=None):
        items = list(getattr(ns, 'path_items', None) or [])
        items.append((self.dest, values))
        ns.path_items = items


PATH_KINDS = ('range', 'blocks', 'walk', 'loop')


def add_path_args(ap):
    g = ap.add_argument_group('hot path (one loop iteration; see hot_path.py --help)')
    g.add_argument('--range', action=_Ordered, metavar='LO:HI',
                   help='inclusive address range (hex); repeat to concatenate in order')
    g.add_argument('--blocks', action=_Ordered, metavar='A,B,...',
                   help='basic blocks by start address (hex), in execution order')
    g.add_argument('--walk', action=_Ordered, metavar='START:STOP',
                   help='walk the CFG from START to the instruction at STOP')
    g.add_argument('--loop', action=_Ordered, metavar='SEL[:largest|:smallest]',
                   help='walk the loop whose back edge is at SEL (FILE:LINE, marker or address)')
    g.add_argument('--take', action=_Ordered, metavar='SEL[=N]',
                   help='take the selected conditional branch(es) (N times, default always)')
    g.add_argument('--avoid-calls', action=_Ordered, nargs=0,
                   help='take undecided branches that skip a CALL')
    g.add_argument('--avoid', action=_Ordered, metavar='SEL',
                   help='source lines (FILE:LINE or marker) of rare work: undecided branches go '
                        'to the side that does not run into them')
    g.add_argument('--prefer', action=_Ordered, metavar='SEL',
                   help='source lines (FILE:LINE or marker) of common work: undecided branches '
                        'go to the side that runs into them')
    g.add_argument('--then', action=_Ordered, nargs=0,
                   help='start the next iteration pattern (patterns are used in turn)')
    g.add_argument('--source', action='append', default=[], metavar='FILE',
                   help='source file searched by --marker')
    g.add_argument('--marker', action='append', default=[], metavar="NAME='TEXT'",
                   help='name the source line(s) containing TEXT, for --take/--loop')
    ap.set_defaults(path_items=None)


Pattern = collections.namedtuple('Pattern', 'path args decisions reached end')


def patterns_from_args(ns, ins):
    """The iteration patterns the path arguments describe (each a Pattern)."""
    items = ns.path_items or []
    if not any(k in PATH_KINDS for k, _ in items):
        raise SystemExit('no hot path given: use --range, --blocks, --walk or --loop')
    markers = find_markers(ns.source, ns.marker)
    groups = [[]]
    for k, v in items:
        if k == 'then':
            groups.append([])
        else:
            groups[-1].append((k, v))
    out = []
    prev_walk = []
    for g in groups:
        kinds = {k for k, _ in g}
        if not kinds & set(PATH_KINDS):
            if not prev_walk:
                raise SystemExit('--then: a pattern without a path of its own needs a previous '
                                 '--walk/--loop pattern to extend')
            g = prev_walk + g
            kinds = {k for k, _ in g}
        if kinds & {'range', 'blocks'}:
            if kinds & {'walk', 'loop', 'take', 'avoid_calls', 'avoid', 'prefer'}:
                raise SystemExit('a pattern is either --range/--blocks or --walk/--loop '
                                 '(with --take), not both')
            path = []
            args = []
            for k, v in g:
                if k == 'range':
                    lo, hi = (hexaddr(x) for x in v.split(':'))
                    path += by_ranges(ins, [(lo, hi)])
                    args.append(f'--range 0x{lo:x}:0x{hi:x}')
                else:
                    starts = [hexaddr(x) for x in v.split(',') if x.strip()]
                    path += by_blocks(ins, starts)
                    args.append('--blocks ' + ','.join(f'0x{a:x}' for a in starts))
            out.append(Pattern(path, ' '.join(args), {}, True, 'ranges'))
            prev_walk = []
            continue
        start = stop = None
        sels = []
        avoid = False
        avoid_lines, prefer_lines = set(), set()
        for k, v in g:
            if k == 'walk':
                start, stop = (hexaddr(x) for x in v.split(':'))
            elif k == 'loop':
                start, stop = find_loop(ins, v, markers)
            elif k == 'take':
                sels.append(parse_selector(v, markers))
            elif k == 'avoid_calls':
                avoid = True
            elif k in ('avoid', 'prefer'):
                sel = parse_selector(v, markers)
                if sel.lines is None:
                    raise SystemExit(f'--{k} {v}: a source line or marker, not an address')
                (avoid_lines if k == 'avoid' else prefer_lines).update(sel.lines)
        if start is None:
            raise SystemExit('--take without --walk or --loop')
        take = resolve_takes(ins, sels)
        w = walk(ins, start, stop, take, avoid, avoid_lines, prefer_lines)
        if not w.reached:
            print(f'warning: walk from 0x{start:x} did not reach 0x{stop:x} ({w.end}); '
                  f'{len(w.path)} instructions counted', file=sys.stderr)
        args = ' '.join([f'--walk 0x{start:x}:0x{stop:x}'] + decisions_as_args(w.decisions))
        out.append(Pattern(w.path, args, w.decisions, w.reached, w.end))
        prev_walk = [(k, v) for k, v in g
                     if k in ('walk', 'loop', 'take', 'avoid_calls', 'avoid', 'prefer')]
    return out


# ---------------------------------------------------------------------------------------------
# Counting

def counts(path):
    """Per-class and per-opcode counts of one path (a dict, JSON-ready)."""
    cls, ops, never = histogram(path)
    h = ops['HMMA']
    return {
        'instructions': len(path),
        'hmma': h,
        'instr_per_hmma': round(len(path) / h, 3) if h else None,
        'classes': {c: cls[c] for c in CLASS_NAMES if cls[c]},
        'opcodes': dict(ops.most_common()),
        'never_executed': never,
    }


def weighted(cs, weights):
    """Weighted mean of several counts() dicts."""
    tot = sum(weights)
    w = [x / tot for x in weights]
    out = {'instructions': sum(c['instructions'] * x for c, x in zip(cs, w)),
           'hmma': sum(c['hmma'] * x for c, x in zip(cs, w)),
           'never_executed': sum(c['never_executed'] * x for c, x in zip(cs, w))}
    for key in ('classes', 'opcodes'):
        names = []
        for c in cs:
            names += [n for n in c[key] if n not in names]
        out[key] = {n: sum(c[key].get(n, 0) * x for c, x in zip(cs, w)) for n in names}
    out['instr_per_hmma'] = out['instructions'] / out['hmma'] if out['hmma'] else None
    return out


def _num(x):
    return f'{x:.0f}' if abs(x - round(x)) < 1e-9 else f'{x:.1f}'


def format_counts(c, indent='  '):
    lines = [f'{indent}{_num(c["instructions"])} instructions, {_num(c["hmma"])} HMMA' +
             (f', {c["instr_per_hmma"]:.2f} instructions per HMMA' if c['instr_per_hmma'] else '')]
    ops = c['opcodes']
    for cl in CLASS_NAMES:
        n = c['classes'].get(cl, 0)
        if not n:
            continue
        members = [o for o in ops if sass_parse._CLASS_OF.get(o, 'other') == cl]
        detail = ' '.join(f'{o}={_num(ops[o])}' for o in members[:9]) if members != [cl] else ''
        lines.append(f'{indent}  {cl:11s} {_num(n):>7s}   {detail}')
    lines.append(f'{indent}  {"@!PT":11s} {_num(c["never_executed"]):>7s}   '
                 '(placeholders, in their classes above: issued, never executed)')
    return '\n'.join(lines)


def by_source(path, top):
    c = collections.Counter(i.where() for i in path)
    return c.most_common(top)


def list_blocks(ins, lo, hi):
    keys = ('HMMA', 'LDSM', 'LDS', 'STS', 'LDGSTS', 'BAR', 'MUFU', 'SHFL', 'RED/ATOM', 'LDL/STL')
    for a, b in sass_parse.blocks(ins):
        if not lo <= ins[a].addr <= hi:
            continue
        body = ins[a:b]
        cls, ops, _ = histogram(body)
        srcs = collections.Counter(i.where() for i in body)
        last = body[-1]
        br = ''
        if last.op in sass_parse.BLOCK_ENDS:
            tgt = f'0x{last.target:x}' if last.target is not None else ''
            br = f'{last.pred} {last.full} {tgt}'.strip()
        ks = ' '.join(f'{k}={cls[k]}' for k in keys if cls[k])
        top = ' '.join(s for s, _ in srcs.most_common(3))
        print(f'{ins[a].addr:05x}-{last.addr:05x} n={len(body):4d} {ks:42s} | {top:48s} | {br}')


def parser():
    """The command-line parser."""
    head, rest = __doc__.split('\n\n', 1)
    ap = argparse.ArgumentParser(description=head, epilog=rest,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('sass', help='nvdisasm -hex -g or cuobjdump -sass text (.xz/.gz read '
                                 'transparently)')
    ap.add_argument('-f', '--function', help='substring of the (mangled) function name')
    add_path_args(ap)
    ap.add_argument('--weights', help='comma-separated weights of the patterns (default equal)')
    ap.add_argument('--loops', action='store_true', help='list the loops (back edges) and stop')
    ap.add_argument('--bb', metavar='LO:HI', help='list the basic blocks in LO:HI and stop')
    ap.add_argument('--list', action='store_true', help='print the path instruction by instruction')
    ap.add_argument('--by-source', type=int, metavar='N',
                    help='the N source lines with most instructions')
    ap.add_argument('--json', action='store_true', help='machine-readable output')
    return ap


def main(argv=None):
    a = parser().parse_args(argv)
    name, ins = sass_parse.pick_function(sass_parse.load(a.sass), a.function)
    if a.loops:
        print(f'# {name}\n# head  back-edge  instructions  HMMA   back-edge source')
        for lp in loops(ins):
            src = f'{lp.src[0]}:{lp.src[1]}' if lp.src else '?'
            print(f'{lp.head:05x} {lp.back:05x} {lp.size:8d} {lp.hmma:8d}   {src}')
        return
    if a.bb:
        lo, hi = (hexaddr(x) for x in a.bb.split(':'))
        list_blocks(ins, lo, hi)
        return
    pats = patterns_from_args(a, ins)
    cs = [counts(p.path) for p in pats]
    weights = [float(x) for x in a.weights.split(',')] if a.weights else [1.0] * len(pats)
    if len(weights) != len(pats):
        raise SystemExit(f'--weights: {len(weights)} weights for {len(pats)} patterns')
    mean = weighted(cs, weights) if len(pats) > 1 else None
    if a.json:
        out = {'function': name,
               'patterns': [dict(c, args=p.args, reached=p.reached,
                                 decisions={f'0x{k:x}': v for k, v in p.decisions.items()})
                            for p, c in zip(pats, cs)]}
        if mean:
            out['weights'] = weights
            out['weighted'] = mean
        print(json.dumps(out, indent=1))
        return
    print(f'function: {name}')
    for n, (p, c) in enumerate(zip(pats, cs), 1):
        print(f'pattern {n}: {p.args}')
        if not p.reached:
            print(f'  (did not reach its stop address: {p.end})')
        print(format_counts(c))
        if a.by_source:
            for s, k in by_source(p.path, a.by_source):
                print(f'    {k:5d}  {s}')
        if a.list:
            for i in p.path:
                print(f'    {i.addr:05x}  {classify(i):10s} {i.where():28s} {i.text}')
    if mean:
        print('weighted mean (weights ' + ', '.join(f'{w:g}' for w in weights) + '):')
        print(format_counts(mean))


if __name__ == '__main__':
    sass_parse.run_cli(main)
