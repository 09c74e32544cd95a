"""Control-bit issue model of one Hopper SM sub-partition (SMSP), GPU-free.

W warps each execute the same loop body (the hot path: one iteration's SASS, or several
iteration patterns used in turn) over and over. Each cycle the SMSP issues at most one
instruction, from the first eligible warp in round-robin order. A warp is eligible when

  * the stall count of its previous instruction has elapsed: ptxas writes, into every
    instruction's control word, how many cycles must pass before the warp's next instruction,
    which covers every fixed-latency dependency (ALU, FMA, HMMA pacing inside one warp);
  * the scoreboards in the instruction's wait mask are clear: variable-latency results (LDSM,
    LDS, SHFL, MUFU, S2R, LDC, local/global loads) release their write scoreboard an assumed
    latency after issue (LATENCY below), stores/LDGSTS/HMMA release their read scoreboard
    READ_RELEASE cycles after issue;
  * the shared unit it needs is free: the tensor pipe (one HMMA.16816.F32 per HMMA_CYCLES), the
    MUFU (MUFU_CYCLES per warp instruction), the shared-memory/MIO path (a quarter of the SM's
    128 B/clk: LDSM, LDS, STS, LDGSTS, SHFL) and the LSU path (RED, STG, LDL, STL, LDG);
  * it is not held at a barrier: BAR.SYNC is a fixed BAR_CYCLES delay (warps of different CTAs
    share the SMSP), or, with --same-cta, every warp on the SMSP waits for the others there and
    leaves BAR_CYCLES after the last one arrives (one CTA per SM spread over the 4 SMSPs).

`@!PT` placeholders take an issue slot and nothing else. Not modelled: barrier skew between
SMSPs, queueing of atomics and other memory traffic, caches and DRAM (cp.async data is assumed
to have landed), bank conflicts, instruction cache, the other SMSPs' timing.

Outputs: cycles per iteration per warp (steady state), cycles per HMMA per SMSP (cycles per
iteration / (warps x HMMA per iteration)), issue-slot use (instructions issued per cycle) and the
busy fraction of the tensor pipe, MIO, MUFU and LSU. The hot path is given as in hot_path.py
(--range, --blocks, --walk/--loop with --take, --then). Python 3 standard library only.
"""
import argparse
import collections
import json
import os
import sys

sys.dont_write_bytecode = True  # keep the tool directory clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sass_parse  # noqa: E402
import hot_path  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Parameters. Calibrated only as a set: README's validation table (six kernels within -7..+3%
# except the flashdl backward) is the evidence they are adequate; README gives the sensitivity.

# Tensor pipe, cycles per HMMA.16816.F32 per SMSP. ptxas spaces a warp's independent
# HMMA.16816.F32 6 cycles apart on sm_90 (stall count 6 between back-to-back HMMAs in the
# control words), the rate it schedules for the pipe (4096 FLOP per 6 cycles per SMSP would be
# ~630 TFLOP/s on 132 SMs at 1.755 GHz).
HMMA_CYCLES = 6
# MUFU, cycles per 32-lane instruction per SMSP: sm_90 computes 16 special-function results
# per clock per SM (CUDA C++ Programming Guide, arithmetic instruction throughput table), 4 per
# SMSP.
MUFU_CYCLES = 8
# Shared memory, cycles per 128 bytes per SMSP: the SM moves 128 B per clock (32 banks x 4 B);
# the four SMSPs run the same code, so each gets a quarter. LDSM.x4 (512 B) holds the MIO path
# 16 cycles, LDS.32/STS.32 4, LDS.128/LDGSTS (16 B a lane) 16.
SMEM_CYCLES_PER_128B = 4
# SHFL, cycles of the same MIO path per warp instruction (assumed: one 128-byte crossbar pass).
SHFL_CYCLES = 4
# LSU path, cycles per RED/REDG/STG/STL/LDL/LDG warp instruction (assumed; atomics are not
# queued, which is one reason the flashdl backward is under-predicted).
LSU_CYCLES = 2
# Barrier: cycles from a BAR.SYNC (or the last warp's arrival, with --same-cta) to the warp's
# next issue (assumed).
BAR_CYCLES = 20
# Read scoreboards (operands of stores, LDGSTS, HMMA) are released this many cycles after issue.
READ_RELEASE = 6
# Scoreboard (write) release after issue, in cycles, for the variable-latency instructions.
# Assumed values of the order public Ampere/Hopper microbenchmark studies report (shared-memory
# load ~30 cycles, ldmatrix a few more, shuffle mid-20s, MUFU ~20, constant-cache hit ~12,
# local/global loads: L1 hit / DRAM-ish); not measured on the validation GPU. Other
# instructions that set a scoreboard release it after 2 cycles.
LATENCY = dict(
    LDSM=33, LDS=30, SHFL=26, MUFU=20,
    S2R=20, S2UR=20, LDC=12, LDL=35,
    LDG=400, LD=400, ATOM=400, ATOMG=400,
    BAR=20, VOTE=6, R2UR=6,
    I2F=12, F2I=12, F2F=12, DMUL=12, POPC=12, FLO=12, BREV=12,
)
LDS128_EXTRA = 4      # LDS.128 result: 4 cycles after an LDS.32's
MIN_RELEASE = 2       # a scoreboard set by any other instruction

DEFAULTS = dict(hmma=HMMA_CYCLES, mufu=MUFU_CYCLES, smem=SMEM_CYCLES_PER_128B, shfl=SHFL_CYCLES,
                lsu=LSU_CYCLES, bar=BAR_CYCLES, read_release=READ_RELEASE)

Result = collections.namedtuple('Result', 'cycles_per_iter busy cycles per_warp')


def unit_of(i, P):
    """(shared unit, cycles it is held) for one instruction, or (None, 0)."""
    op, f = i.op, i.full
    if i.never:
        return None, 0
    if op == 'HMMA':
        return 'tensor', P['hmma']
    if op == 'MUFU':
        return 'mufu', P['mufu']
    q = P['smem']
    if op == 'LDSM':
        last = f.split('.')[-1]
        return 'mio', q * (int(last) if last.isdigit() else 4)
    if op in ('LDS', 'STS'):
        return 'mio', q * (4 if '.128' in f else 2 if '.64' in f else 1)
    if op == 'LDGSTS':
        return 'mio', q * 4
    if op == 'SHFL':
        return 'mio', P['shfl']
    if op in ('RED', 'REDG', 'STG', 'STL', 'LDL', 'LDG'):
        return 'lsu', P['lsu']
    return None, 0


def _rows(trace, P, L):
    rows = []
    for i in trace:
        c = i.ctl
        if c is None:
            raise SystemExit(f'instruction at 0x{i.addr:x} has no encoding: disassemble with '
                             'nvdisasm -hex (cuobjdump -sass prints it already)')
        unit, occ = unit_of(i, P)
        lat = L.get(i.op, 0)
        if i.op == 'LDS' and '.128' in i.full:
            lat += LDS128_EXTRA
        rows.append((max(c.stall, 1), c.wbar, c.rbar, c.wait, unit, occ, lat, i.op == 'BAR'))
    return rows


def simulate(traces, warps=2, same_cta=False, params=None, latency=None, iters=30, warmup=8):
    """traces: one or more per-iteration instruction lists, used in turn by every warp.
    Returns Result(cycles per iteration per warp in steady state, busy fractions, ...)."""
    P = dict(DEFAULTS)
    P.update(params or {})
    L = dict(LATENCY)
    L.update(latency or {})
    pre = [_rows(t, P, L) for t in traces]
    unit_free = collections.defaultdict(int)
    sb = [[[] for _ in range(6)] for _ in range(warps)]  # release cycles per scoreboard
    next_ok = [w * 131 for w in range(warps)]             # stagger the warps' start
    pos = [0] * warps
    it = [0] * warps
    starts = [[] for _ in range(warps)]
    at_bar = [False] * warps
    busy = collections.Counter()
    cycle = 0
    rr = 0
    while min(it) < iters:
        if same_cta and any(at_bar) and all(at_bar[w] or it[w] >= iters for w in range(warps)):
            for w in range(warps):
                if at_bar[w]:
                    at_bar[w] = False
                    next_ok[w] = max(next_ok[w], cycle + P['bar'])
        for w in sorted(range(warps), key=lambda x: (x - rr) % warps):
            if it[w] >= iters or at_bar[w] or next_ok[w] > cycle:
                continue
            rows = pre[it[w] % len(pre)]
            stall, wb, rb, wm, unit, occ, lat, isbar = rows[pos[w]]
            if any(wm >> b & 1 and sb[w][b] and max(sb[w][b]) > cycle for b in range(6)):
                continue
            if unit and unit_free[unit] > cycle:
                continue
            for b in range(6):
                if wm >> b & 1:
                    sb[w][b] = []
            if pos[w] == 0:
                starts[w].append(cycle)
            if unit:
                unit_free[unit] = cycle + occ
                busy[unit] += occ
            if wb != 7:
                sb[w][wb].append(cycle + max(lat, MIN_RELEASE))
            if rb != 7:
                sb[w][rb].append(cycle + P['read_release'])
            next_ok[w] = cycle + stall
            if isbar:
                if same_cta:
                    at_bar[w] = True
                else:
                    next_ok[w] = cycle + P['bar']
            busy['issue'] += 1
            pos[w] += 1
            if pos[w] == len(rows):
                pos[w] = 0
                it[w] += 1
            rr = w + 1
            break
        cycle += 1
    per = [(s[-1] - s[warmup]) / (len(s) - 1 - warmup) for s in starts]
    return Result(sum(per) / len(per), {k: v / cycle for k, v in busy.items()}, cycle, per)


def stall_sum(trace):
    """Sum of the stall counts along a trace: one warp's schedule if every variable latency
    were zero (a lower bound on its time alone)."""
    return sum(max(i.ctl.stall, 1) for i in trace)


def timeline(trace, params=None, latency=None, reps=3):
    """One warp alone: the issue cycle of each instruction of the last of `reps` iterations.
    Returns ([(Ins, cycle)], cycle after the last instruction)."""
    P = dict(DEFAULTS)
    P.update(params or {})
    L = dict(LATENCY)
    L.update(latency or {})
    rows = _rows(trace, P, L)
    sb = [[] for _ in range(6)]
    unit_free = collections.defaultdict(int)
    t = 0
    out = []
    for rep in range(reps):
        for i, (stall, wb, rb, wm, unit, occ, lat, isbar) in zip(trace, rows):
            ready = t
            for b in range(6):
                if wm >> b & 1 and sb[b]:
                    ready = max(ready, max(sb[b]))
                    sb[b] = []
            if unit:
                ready = max(ready, unit_free[unit])
                unit_free[unit] = ready + occ
            if wb != 7:
                sb[wb].append(ready + max(lat, MIN_RELEASE))
            if rb != 7:
                sb[rb].append(ready + P['read_release'])
            if rep == reps - 1:
                out.append((i, ready))
            t = ready + stall + (P['bar'] if isbar else 0)
    return out, t


def phase_split(trace, phases, params=None, latency=None):
    """Single-warp cycles and instructions per named address-range phase."""
    tl, end = timeline(trace, params, latency)
    cyc = collections.Counter()
    n = collections.Counter()
    for k, (i, c) in enumerate(tl):
        nxt = tl[k + 1][1] if k + 1 < len(tl) else end
        name = next((p for p, lo, hi in phases if lo <= i.addr <= hi), 'other')
        cyc[name] += nxt - c
        n[name] += 1
    return cyc, n, end - tl[0][1]


def model(traces, warps=2, same_cta=False, params=None, latency=None, iters=30, warmup=8):
    """simulate() plus the per-iteration counts: a JSON-ready dict."""
    r = simulate(traces, warps, same_cta, params, latency, iters, warmup)
    n = sum(len(t) for t in traces) / len(traces)
    h = sum(sum(1 for i in t if i.op == 'HMMA') for t in traces) / len(traces)
    return {
        'patterns': len(traces),
        'warps': warps,
        'same_cta': same_cta,
        'instructions_per_iter': n,
        'hmma_per_iter': h,
        'instr_per_hmma': n / h if h else None,
        'stall_sum_per_iter': sum(stall_sum(t) for t in traces) / len(traces),
        'cycles_per_iter': r.cycles_per_iter,
        'cycles_per_hmma': r.cycles_per_iter / (warps * h) if h else None,
        'issue_use': r.busy.get('issue', 0.0),
        'tensor_busy': r.busy.get('tensor', 0.0),
        'mio_busy': r.busy.get('mio', 0.0),
        'mufu_busy': r.busy.get('mufu', 0.0),
        'lsu_busy': r.busy.get('lsu', 0.0),
    }


def _settings(pairs):
    params, latency = {}, {}
    for s in pairs or []:
        k, _, v = s.partition('=')
        if not v:
            raise SystemExit(f'--set wants NAME=VALUE, got {s!r}')
        if k in DEFAULTS:
            params[k] = float(v)
        elif k.upper() == k and k.isalnum():
            latency[k] = float(v)
        else:
            raise SystemExit(f'--set {k}: one of {", ".join(DEFAULTS)} or an opcode latency '
                             f'({", ".join(LATENCY)})')
    return params, latency


def parser():
    """The command-line parser."""
    head, rest = __doc__.split('\n\n', 1)
    ap = argparse.ArgumentParser(description=head, epilog=rest,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('sass', help='nvdisasm -hex -g or cuobjdump -sass text (.xz/.gz read '
                                 'transparently)')
    ap.add_argument('-f', '--function', help='substring of the (mangled) function name')
    hot_path.add_path_args(ap)
    ap.add_argument('--warps', type=int, default=2,
                    help='warps per SMSP (default 2: 8 warps per SM)')
    ap.add_argument('--same-cta', action='store_true',
                    help="the SMSP's warps belong to one CTA: they meet at each barrier")
    ap.add_argument('--set', action='append', metavar='NAME=VALUE',
                    help='override a parameter (' +
                         ', '.join(f'{k}={v}' for k, v in DEFAULTS.items()) + ') '
                         'or a latency (e.g. LDSM=40)')
    ap.add_argument('--iters', type=int, default=30, help='iterations simulated per warp (30)')
    ap.add_argument('--warmup', type=int, default=8, help='iterations excluded from the mean (8)')
    ap.add_argument('--phase', action='append', metavar='NAME=LO:HI',
                    help='with one warp alone, report the cycles spent in this address range '
                         '(repeat a NAME to add ranges; the first matching range wins)')
    ap.add_argument('--json', action='store_true', help='machine-readable output')
    return ap


def settings(ns):
    """(params, latency) overrides from parsed --set arguments."""
    return _settings(ns.set)


def main(argv=None):
    a = parser().parse_args(argv)
    if a.iters <= a.warmup + 2:
        raise SystemExit('--iters must exceed --warmup + 2')
    name, ins = sass_parse.pick_function(sass_parse.load(a.sass), a.function)
    pats = hot_path.patterns_from_args(a, ins)
    params, latency = _settings(a.set)
    traces = [p.path for p in pats]
    out = model(traces, a.warps, a.same_cta, params, latency, a.iters, a.warmup)
    out['function'] = name
    out['paths'] = [p.args for p in pats]
    phases = []
    for spec in a.phase or []:
        pname, _, rng = spec.rpartition('=')
        if not pname or rng.count(':') != 1:
            raise SystemExit(f'--phase wants NAME=LO:HI, got {spec!r}')
        lo, hi = (hot_path.hexaddr(x) for x in rng.split(':'))
        phases.append((pname, lo, hi))
    if phases:
        out['single_warp'] = []
        for t in traces:
            cyc, n, tot = phase_split(t, phases, params, latency)
            out['single_warp'].append({'cycles': tot, 'phases': {
                p: {'instructions': n[p], 'cycles': cyc[p]} for p in list(dict.fromkeys(
                    [p for p, _, _ in phases] + ['other'])) if n[p]}})
    if a.json:
        print(json.dumps(out, indent=1))
        return
    print(f'function: {name}')
    for k, p in enumerate(pats, 1):
        print(f'pattern {k}: {p.args}')
    bar = params.get('bar', BAR_CYCLES)
    same = 'all warps meet at each barrier' if a.same_cta else f'barrier = {bar:g}-cycle delay'
    print(f'{a.warps} warps per SMSP, {same}' +
          (f'; patterns used in turn' if len(pats) > 1 else ''))
    print(f'per iteration (per warp): {out["instructions_per_iter"]:.1f} instructions, '
          f'{out["hmma_per_iter"]:.0f} HMMA, {out["instr_per_hmma"]:.2f} instructions per HMMA, '
          f'stall-count sum {out["stall_sum_per_iter"]:.0f} cycles'
          if out['hmma_per_iter'] else
          f'per iteration (per warp): {out["instructions_per_iter"]:.1f} instructions, no HMMA')
    print(f'model: {out["cycles_per_iter"]:.0f} cycles per iteration per warp' +
          (f' = {out["cycles_per_hmma"]:.2f} cycles per HMMA per SMSP'
           if out['hmma_per_iter'] else ''))
    print(f'issue-slot use {out["issue_use"]:.2f}, tensor pipe busy {out["tensor_busy"]:.2f}, '
          f'MIO {out["mio_busy"]:.2f}, MUFU {out["mufu_busy"]:.2f}, LSU {out["lsu_busy"]:.2f}')
    for k, sw in enumerate(out.get('single_warp', []), 1):
        print(f'one warp alone, pattern {k}: {sw["cycles"]} cycles per iteration')
        for p, v in sw['phases'].items():
            print(f'   {p:32s} {v["instructions"]:5d} instructions {v["cycles"]:7d} cycles '
                  f'({v["cycles"] / sw["cycles"]:4.0%})')


if __name__ == '__main__':
    sass_parse.run_cli(main)
