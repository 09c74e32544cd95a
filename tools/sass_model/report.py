"""The fa2 kernels' performance report, without a GPU: compile, disassemble, count, model.

For each of the four fa2 kernels the report follows (forward and backward, head dim 64 and 128,
float16, sm_90) it compiles one translation unit with the flags src/cuda/CMakeLists.txt uses,
disassembles it (nvdisasm -hex -g -c), finds one iteration of the main loop as the common case
runs it (the loop and the branches it takes are named by source text, see KERNELS: the names
survive edits that move lines, and a name that is no longer in the source is an error), counts
that path by instruction class and runs the issue model of one SM sub-partition (smsp_model.py)
over it. FlashAttention-2's own sm_90 kernels, stored as fixtures (fixtures/fa2_sm90, README
there), go through the same counting and model. Prints a Markdown report whose last line is
`worst model ratio to FA2: X.XX` (the largest flashdl / FA2 model cycles per HMMA).

    python3 tools/sass_model/report.py [--out FILE] [--work DIR] [--jobs N] [--kernels a,b]
    python3 tools/sass_model/report.py --sass-dir DIR    # reuse DIR/<kernel>.sass (+ .ptxas)

Needs nvcc (13.0 used) and nvdisasm: on PATH, or from the PyPI wheel nvidia-cuda-nvdisasm (found
in site-packages by itself). Python 3 standard library only. About 2-4 minutes on two cores.
"""
import argparse
import concurrent.futures
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hot_path  # noqa: E402
import sass_parse  # noqa: E402
import smsp_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(HERE))
FIXTURES = os.path.join(HERE, 'fixtures', 'fa2_sm90')

_FWD_SOURCES = ['src/cuda/fa2_forward.cuh', 'src/cuda/tile_io.cuh',
                'include/flashdl/detail/block_mask.hpp']
# The forward's two iteration patterns, used in turn: a whole (unmasked) block of a dense call
# without and with the output's rescale (skipped when no row's max moved). Branches are decided
# by the work on either side (hot_path.py --prefer / --avoid), not by their polarity in SASS,
# which changes from one build to the next.
_FWD_COMMON = [
    ('loop', 'main_loop:smallest'), ('avoid_calls',),
    ('prefer', 'next_copy'), ('prefer', 'cp_async'), ('prefer', 'whole_softmax'),
    ('avoid', 'plain_loads'), ('avoid', 'partial_tile'), ('avoid', 'mask_blocks'),
    ('avoid', 'row_window'), ('avoid', 'nonfinite_scan'), ('avoid', 'slow_pv'),
]
_FWD_PATH = _FWD_COMMON + [('avoid', 'rescale'), ('then',)] + _FWD_COMMON + [('prefer', 'rescale')]
_FWD_MARKERS = {
    'main_loop': 'for (int stage = 0; n < n_end; stage ^= 1)',
    'next_copy': ['load_kv(next, stage ^ 1);', 'auto load_kv = [&](int n, int stage) {',
                  'const int rows = int(seqlen_k - n0 < kBlockN ? seqlen_k - n0 : kBlockN);',
                  'load_tile_rows<kBlockN, kD, Tr::kThreads>(dst, kLd, src, stride, rows,',
                  'load(sK + stage * kBlockN * kLd, gK + n0 * p.k_row_stride, p.k_row_stride);',
                  'load(sV + stage * kBlockN * kLd, gV + n0 * p.v_row_stride, p.v_row_stride);',
                  'load(sK + stage * kBlockN * kLd, k, p.k_row_stride);',
                  'load(sV + stage * kBlockN * kLd, v, p.v_row_stride);'],
    'cp_async': ['__pipeline_memcpy_async(dst, src, 16);',
                 '__pipeline_memcpy_async(sp + it * kStepRows * ld_s, gp, 16);',
                 'const T* gp = g + r0 * g_stride + c0;', 'T* sp = s + r0 * ld_s + c0;',
                 'const int64_t g_step = int64_t(kStepRows) * g_stride;'],
    'whole_softmax': 'softmax_regs<Tr, false>(acc_s, sm, scale_log2, none, none, acc_o);',
    'plain_loads': 'for (int e = 0; e < 8; ++e) dst[e] = src[e];',
    # the loader's per-chunk path, for a partial tile (its whole-tile copies have none of it)
    'partial_tile': ['const int r = r0 + it * kQ + cc / kChunks, c = (cc % kChunks) * 8;',
                     'if (r >= rows || !keep(r)) {',
                     '*reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);'],
    'mask_blocks': ['for (int64_t qb = i0 / block_q; qb <= (i1 - 1) / block_q; ++qb)',
                    'for (int64_t kb = j0 / block_k; kb <= (j1 - 1) / block_k; ++kb)',
                    'const bool b = block(qb, kb);', 'if (block(qb, j / block_k)) return true;',
                    'if (block(i / block_q, kb)) return true;'],
    'row_window': 'const int64_t b = mk.col_begin(row) - n0, e = mk.col_end(row) - n0;',
    'nonfinite_scan': ['!full && __syncthreads_or(tile_has_nonfinite<kD, Tr::kThreads>(sVn,',
                       'for (int idx = threadIdx.x; idx < kN; idx += kThreads) {',
                       'const uint4 u = *reinterpret_cast<const uint4*>(s + (idx / kChunks) * ld',
                       'const unsigned x = (w[q] & kExp2) ^ kExp2;'],
    'slow_pv': 'accumulate_pv_visible<Tr>(sS, pa[rf], sVn, acc_o[rf], keys, shown);',
    'rescale': 'acc_o[rf][df].x[i] *= alpha[rf][(i / 2) % 2];',
}
_BWD_SOURCES = ['src/cuda/fa2_backward.cuh', 'src/cuda/bwd_block.cuh', 'src/cuda/tile_io.cuh',
                'include/flashdl/detail/block_mask.hpp', 'include/flashdl/detail/mask.hpp']
# One (query block, key block) pair of the backward's main loop as a dense, non-causal call runs
# it, for the warps that do not load lse/D (6 of 8): the next pair's Q/dO copy, adjacent-pair
# P/dS stores, the whole-block dQ atomics, the kf loop 4 trips; not the first pair's non-finite
# scan of K, the slow dQ of a masked pair with a non-finite K, window or block-mask arithmetic,
# 64-bit division calls (their 32-bit fast path).
_BWD_PATH = [
    ('loop', 'main_loop'), ('avoid_calls',), ('take', 'kf_loop=3'),
    ('take', 'k_nonfinite@!'),  # the && that skips the rest of slow_dq's test (K finite)
    ('take', 'copy_chunks:back=3'),  # the run-time copy loop of the kernels without kDense
    ('prefer', 'next_copy'), ('prefer', 'cp_async'), ('prefer', 'paired'), ('prefer', 'dq'),
    ('prefer', 'dq_fast'),
    ('avoid', 'plain_loads'), ('avoid', 'partial_tile'), ('avoid', 'stat_rows'),
    ('avoid', 'nonfinite_scan'),
    ('avoid', 'k_repair'), ('avoid', 'unpaired'), ('avoid', 'dq_bounds'),
    ('avoid', 'mask_blocks'), ('avoid', 'window'),
]
_BWD_MARKERS = {
    'main_loop': 'for (int stage = 0; it < total; first = false) {',
    'kf_loop': 'for (int kf = 0; kf < Tr::kFragsM; ++kf) {',
    'chunk_loop': 'for (int c0 = 0; c0 < kMPerAll; c0 += kChunk) {',
    'k_nonfinite': 'k_nonfinite && !(cover(it).all',
    'copy_chunks': 'for (int idx = threadIdx.x; idx < n; idx += kThreads) {',
    # (not the call's own line: ptxas spreads its address arithmetic over other blocks)
    'next_copy': ['load_tile_rows<kM, kD, Tr::kThreads>(q_stage(L.off_q, stage), kLd, gQ,',
                  'load_tile_rows<kM, kD, Tr::kThreads>(q_stage(L.off_do, stage), kLd, gdO,',
                  'const T* gQ = static_cast<const T*>(p.q_ptr) + batch * p.q_batch_stride +',
                  'const T* gdO = static_cast<const T*>(p.do_ptr) + batch * p.do_batch_stride +',
                  'const int64_t row0 = (batch * p.nheads + h) * p.seqlen_q;'],
    'dq': ['if (ws_dq != nullptr) {', 'const bool slow_dq =', 'add_dq_tiles<Tr>(sdS, sK, map,',
           'load_frag(a, sdS + (rg + i * kRowStep) * kFrag * Tr::kLdP + kf * kFrag, Tr::kLdP);',
           'float* corner = gdq + cg * kCols * kFrag + rg * kFrag * Tr::kHeadDim;'],
    'cp_async': _FWD_MARKERS['cp_async'],
    'paired': ['store_pair(sP + at, p[e], p[e + 1]);', 'store_pair(sdS + at, ds[e], ds[e + 1]);'],
    'dq_fast': 'atomic_add_pair(tile + (acc_row(lane, e) - acc_row(lane, 0)) * Tr::kHeadDim +',
    'partial_tile': _FWD_MARKERS['partial_tile'],
    'plain_loads': _FWD_MARKERS['plain_loads'],
    'stat_rows': ['sL2[r] = in ? gL2[i0 + r] : -INFINITY;', 'sD[r] = in ? gD[i0 + r] : 0.0f;'],
    'nonfinite_scan': ['if (first) k_nonfinite = __syncthreads_or('] +
                      _FWD_MARKERS['nonfinite_scan'][1:],
    'k_repair': ['if (!(fabsf(to_float(x)) <= 3.40282347e38f)) x = from_float<T>(0.0f);',
                 'zero_nonfinite<kD, Tr::kThreads>(sK, kLd, kN);',
                 'load_tile<kD, Tr::kThreads>(sK, kLd,',
                 'kv_head * p.k_head_stride + (seq.k0 + n0) * p.k_row_stride,',
                 'p.k_row_stride, kN, kv_rows, false);',
                 "__syncthreads();  // K whole again for the next pairs' scores",
                 "__syncthreads();  // every warp done with K's scores",
                 '__syncthreads();  // every warp done with the zeroed K'],
    'unpaired': ['sP[at] = from_float<T>(p[e]);', 'sdS[at] = from_float<T>(ds[e]);'],
    'dq_bounds': 'if (r < rows) atomicAdd(col + r * Tr::kHeadDim + map.c[e], acc[i][j].x[e]);',
    'mask_blocks': _FWD_MARKERS['mask_blocks'],
    'window': ['const int64_t b = diag(i) - left;', 'const int64_t e = diag(i) + right + 1;'],
}


def _fwd(d):
    return {
        'title': f'fwd d{d}', 'fa2': f'fwd_h{d}', 'ftz': True,
        # a warp's HMMA.16816 per iteration: S = QK^T and O += PV of its 32 rows, 128 keys at
        # d 64 and 64 at d 128 (the register-only tiles), (2 * 32 * keys * d) / (16 * 8 * 16)
        # and its cp.async copies of the next K and V blocks (16 bytes each, 128 threads)
        # and its one barrier
        'expect': {'HMMA': 2 * 32 * (128 if d <= 64 else 64) * d // 2048,
                   'LDGSTS': 2 * (128 if d <= 64 else 64) * d * 2 // 16 // 128, 'BAR': 1},
        'unit': ('#include "fa2_forward.cuh"\nnamespace flashdl::cuda {\n'
                 f'template void launch_fa2_forward<__half, {d}>(const Params&, '
                 'const LaunchContext&);\n}\n'),
        # the kernel a dense call runs: the register-only instantiation where there is one
        # (Fa2Traits' last argument true), else the general one; without score modifiers
        'function': [r'forward_kernelINS0_9Fa2TraitsI6__halfLi%dELi\d+ELi\d+ELb1EEELb0EEEv' % d,
                     r'forward_kernelINS0_9Fa2TraitsI6__halfLi%dELi\d+ELi\d+EEELb0EEEv' % d],
        'sources': _FWD_SOURCES, 'markers': _FWD_MARKERS, 'path': _FWD_PATH, 'same_cta': False,
    }


def _kf_unroll():
    """The unroll factor of the backward's dV/dK loop (its `#pragma unroll N`, 1 without one)."""
    with open(os.path.join(ROOT, 'src', 'cuda', 'fa2_backward.cuh')) as f:
        text = f.read()
    m = re.search(r'#pragma unroll (\d+)\s*\n\s*' + re.escape(_BWD_MARKERS['kf_loop']), text)
    return int(m.group(1)) if m else 1


def _chunk_cap():
    """The most query fragments a warp's S/dP products take at once (kChunk's cap, bwd_block.cuh)."""
    with open(os.path.join(ROOT, 'src', 'cuda', 'bwd_block.cuh')) as f:
        m = re.search(r'constexpr int kChunk = kMPerAll < (\d+) \? kMPerAll : (\d+);', f.read())
    if not m:
        raise ReportError('bwd_block.cuh: kChunk\'s definition not found: update report.py')
    return int(m.group(1))


def _bwd(d):
    # bwd_plan.hpp's fa2_bwd_dense_config: 128 x 128 at d <= 64, 64 x 128 up to d 128, 2 stages,
    # bands of 2 fragments
    bm, bn, st = (128, 128, 2) if d <= 64 else (64, 128, 2)
    # the dV/dK loop's back edge: bm / 16 trips, unrolled as the source's pragma says
    trips = bm // 16 // _kf_unroll()
    path = [('take', f'kf_loop={trips - 1}') if x == ('take', 'kf_loop=3') else x
            for x in _BWD_PATH]
    # the S/dP chunk loop's back edge: kMPerAll query fragments a warp, kChunk at a time
    m_per_all = bm // 16 // 2
    chunks = m_per_all // min(m_per_all, _chunk_cap())
    if chunks > 1:
        path.append(('take', f'chunk_loop={chunks - 1}'))
    return {
        'title': f'bwd d{d}', 'fa2': f'bwd_h{d}', 'ftz': True,
        # S, dP, dV, dK and dQ of a bm x bn pair over 8 warps; the next pair's Q and dO copies;
        # the pair's two barriers; dQ's paired float atomics; no global load (lse/D: 2 warps)
        'expect': {'HMMA': 5 * bm * bn * d // 2048 // 8, 'LDGSTS': 2 * bm * d * 2 // 16 // 256,
                   'BAR': 2, 'REDG': bm * d // 2 // 256, 'LDG': 0},
        'unit': ('#include "fa2_backward.cuh"\nnamespace flashdl::cuda {\n'
                 f'template void launch_fa2_backward<__half, {d}>(const Params&, '
                 'const LaunchContext&);\n}\n'),
        # the dense instantiation (BwdCall::dense, 0) of the dense tiles
        'function': [r'backward_kernelINS0_12Fa2BwdTraitsI6__halfLi%dELi%dELi%dELi%dELi2ELb[01]EEE'
                     r'LNS0_7BwdCallE0EEEv' % (d, bm, bn, st)],
        'sources': _BWD_SOURCES, 'markers': _BWD_MARKERS, 'path': path, 'same_cta': True,
    }


KERNELS = {'fwd_h64': _fwd(64), 'fwd_h128': _fwd(128), 'bwd_h64': _bwd(64),
           'bwd_h128': _bwd(128)}

# Per-HMMA columns of the class table: (label, sass_parse classes summed)
COLUMNS = [('HMMA', ['HMMA']), ('LDSM', ['LDSM']), ('LDS+STS', ['LDS', 'STS']),
           ('LDGSTS', ['LDGSTS']), ('MUFU', ['MUFU']), ('SHFL', ['SHFL']), ('FP', ['FP']),
           ('INT', ['INT']), ('BRA', ['BRA']), ('BSSY', ['BSSY/BSYNC']), ('BAR', ['BAR']),
           ('RED', ['RED/ATOM']), ('LDL/STL', ['LDL/STL']), ('other', ['other', 'LDG/STG',
                                                                        'DEPBAR'])]


class ReportError(RuntimeError):
    pass


def find_tool(name):
    """name on PATH, else in a pip wheel (nvidia-cuda-nvdisasm: site-packages/nvidia/cu*/bin)."""
    p = shutil.which(name)
    if p:
        return p
    for base in {sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib']}:
        for cand in sorted(glob.glob(os.path.join(base, 'nvidia', '*', 'bin', name))):
            if os.access(cand, os.X_OK):
                return cand
    raise ReportError(f'{name} not found: put it on PATH or `pip install nvidia-cuda-{name}`')


# ---------------------------------------------------------------------------------------------
# Compiling

def compile_unit(key, spec, work, arch):
    """One translation unit -> work/key.sass (nvdisasm -hex -g -c) and work/key.ptxas."""
    cu = os.path.join(work, key + '.cu')
    cubin = os.path.join(work, key + '.cubin')
    with open(cu, 'w') as f:
        f.write(spec['unit'])
    cmd = [find_tool('nvcc'), '-O3', '-DNDEBUG', '-std=c++17', '--expt-relaxed-constexpr']
    if spec['ftz']:
        cmd.append('-ftz=true')  # as src/cuda/CMakeLists.txt compiles the fwd and bwd units
    cmd += [f'-arch=sm_{arch}', '-cubin', '-lineinfo', '-Xptxas', '-v',
            '-I' + os.path.join(ROOT, 'include'), '-I' + os.path.join(ROOT, 'src'),
            '-I' + os.path.join(ROOT, 'src', 'cuda'), cu, '-o', cubin]
    r = subprocess.run(cmd, capture_output=True, text=True)
    with open(os.path.join(work, key + '.ptxas'), 'w') as f:
        f.write(r.stderr)
    if r.returncode != 0:
        raise ReportError(f'{key}: nvcc failed:\n{r.stderr[-3000:]}')
    with open(os.path.join(work, key + '.sass'), 'w') as f:
        subprocess.run([find_tool('nvdisasm'), '-hex', '-g', '-c', cubin], stdout=f, check=True)


def ptxas_resources(text, function):
    """(registers, spill store bytes, spill load bytes, stack bytes) of one function, from
    `-Xptxas -v` output."""
    cur = None
    res = {}
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur = m.group(1)
            continue
        m = re.search(r'(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads',
                      line)
        if m and cur:
            res.setdefault(cur, {}).update(stack=int(m.group(1)), spill_st=int(m.group(2)),
                                           spill_ld=int(m.group(3)))
        m = re.search(r'Used (\d+) registers', line)
        if m and cur:
            res.setdefault(cur, {})['regs'] = int(m.group(1))
    return res.get(function)


# ---------------------------------------------------------------------------------------------
# Counting and modelling

class _Args:
    """What hot_path.patterns_from_args reads from a parsed command line."""

    def __init__(self, items, sources, markers):
        self.path_items = items
        self.source = sources
        self.marker = [f'{k}={t}' for k, v in markers.items()
                       for t in ([v] if isinstance(v, str) else v)]


def path_items(path):
    out = []
    for step in path:
        kind = step[0]
        out.append((kind, step[1] if len(step) > 1 else []))
    return out


def pick(funcs, patterns):
    """The function matched by the first of the patterns that matches any (exactly one)."""
    for pattern in patterns:
        hits = [n for n in funcs if re.search(pattern, n)]
        if len(hits) > 1:
            raise ReportError(f'function pattern {pattern!r} matches {len(hits)} functions: '
                              + ', '.join(hits[:4]))
        if hits:
            return hits[0], funcs[hits[0]]
    raise ReportError(f'no function matches {patterns}; the unit has ' + ', '.join(list(funcs)[:6]))


def analyse(ins, items, sources=(), markers=None, same_cta=False, ftz_variant=False):
    """One function's hot path, counted and modelled: a dict of figures. ftz_variant: the model
    also run on the path without exp2f's denormal fix-ups ('model_ftz'), as -ftz=true compiles it."""
    for name, texts in (markers or {}).items():
        for text in [texts] if isinstance(texts, str) else texts:
            if not any(text in line for s in sources for line in open(s, encoding='utf-8')):
                raise ReportError(f'marker {name}: {text!r} is no longer in '
                                  f'{", ".join(os.path.relpath(s, ROOT) for s in sources)}: '
                                  'update KERNELS in tools/sass_model/report.py')
    pats = hot_path.patterns_from_args(_Args(items, list(sources), markers or {}), ins)
    for p in pats:
        if not p.reached:
            raise ReportError(f'the walk did not reach the loop\'s back edge ({p.end}): {p.args}')
    cs = [hot_path.counts(p.path) for p in pats]
    c = hot_path.weighted(cs, [1] * len(cs))
    m = smsp_model.model([p.path for p in pats], 2, same_cta)
    if not c['hmma']:
        raise ReportError('the hot path has no HMMA: the loop markers point at the wrong loop')
    r = {'counts': c, 'model': m, 'paths': [p.args for p in pats]}
    if ftz_variant:
        paths = [[i for i in p.path if not exp2_fixup(i)] for p in pats]
        r['model_ftz'] = smsp_model.model(paths, 2, same_cta)
        r['fixups'] = sum(len(p.path) for p in pats) - sum(len(p) for p in paths)
    return r


def exp2_fixup(i):
    """Whether instruction i is part of exp2f's range fix-up for denormal results, which a build
    without -ftz=true wraps around each MUFU.EX2: FSETP against -126, the input halved and the
    result squared by predicated FMULs."""
    if i.op == 'FSETP' and re.search(r',\s*-126\s*(,|$)', i.args):
        return True
    if i.op != 'FMUL' or not i.pred.startswith('@!P'):
        return False
    a = [x.strip() for x in i.args.split(',')]
    return len(a) == 3 and (a[2] == '0.5' or a[1] == a[2])


def fixture_items(args):
    """A stored address path ('--walk A:B --take C ...') as path items."""
    toks = args.split()
    items = []
    k = 0
    while k < len(toks):
        kind = toks[k].lstrip('-').replace('-', '_')
        if kind in ('then', 'avoid_calls'):
            items.append((kind, []))
            k += 1
        else:
            items.append((kind, toks[k + 1]))
            k += 2
    return items


def analyse_fa2(key):
    import json
    with open(os.path.join(FIXTURES, 'counts.json')) as f:
        meta = json.load(f)['kernels'][key]
    funcs = sass_parse.load(os.path.join(FIXTURES, meta['file']))
    name, ins = sass_parse.pick_function(funcs, None)
    r = analyse(ins, fixture_items(meta['path_args']), same_cta='--same-cta' in meta['model_args'],
                ftz_variant=True)
    r['meta'] = meta
    return r


def analyse_flashdl(key, sass, ptxas_text):
    spec = KERNELS[key]
    funcs = sass_parse.load(sass)
    name, ins = pick(funcs, spec['function'])
    sources = [os.path.join(ROOT, s) for s in spec['sources']]
    r = analyse(ins, path_items(spec['path']), sources, spec['markers'], spec['same_cta'])
    for op, n in spec['expect'].items():
        got = r['counts']['opcodes'].get(op, 0)
        if got != n:
            raise ReportError(f'{key}: the hot path has {got:g} {op}, the tile {n}: the walk '
                              f'skipped or repeated work ({r["paths"]}); check it with '
                              'hot_path.py --list and update KERNELS')
    r['function'] = name
    r['resources'] = ptxas_resources(ptxas_text, name) if ptxas_text else None
    return r


# ---------------------------------------------------------------------------------------------
# The report

def per_hmma(c, classes):
    return sum(c['classes'].get(k, 0) for k in classes) / c['hmma']


def table(results, fa2):
    """Markdown lines of the report's tables; results/fa2: {key: analyse() dict}."""
    out = ['| kernel | instructions / HMMA (FA2) | model cycles / HMMA | FA2 model | ratio to FA2 '
           '| FA2 -ftz model | ratio to FA2 -ftz | hot-loop LDL/STL | registers, spill bytes (ptxas) |',
           '|---|---:|---:|---:|---:|---:|---:|---:|---|']
    worst = worst_ftz = 0.0
    for key, r in results.items():
        f = fa2[key]
        c, m = r['counts'], r['model']
        ratio = m['cycles_per_hmma'] / f['model']['cycles_per_hmma']
        ratio_ftz = m['cycles_per_hmma'] / f['model_ftz']['cycles_per_hmma']
        worst = max(worst, ratio)
        worst_ftz = max(worst_ftz, ratio_ftz)
        spills = c['classes'].get('LDL/STL', 0)
        res = r.get('resources')
        res_s = (f'{res["regs"]}, {res["spill_st"]} / {res["spill_ld"]}' if res else 'n/a')
        out.append(f'| {KERNELS[key]["title"]} | {c["instr_per_hmma"]:.2f} '
                   f'({f["counts"]["instr_per_hmma"]:.2f}) | {m["cycles_per_hmma"]:.2f} | '
                   f'{f["model"]["cycles_per_hmma"]:.2f} | {ratio:.2f} | '
                   f'{f["model_ftz"]["cycles_per_hmma"]:.2f} | {ratio_ftz:.2f} | {spills:g} | '
                   f'{res_s} |')
    out += ['', 'Instructions per HMMA by class, one iteration of the hot loop per warp '
            '(flashdl / FA2):', '',
            '| kernel | ' + ' | '.join(lbl for lbl, _ in COLUMNS) + ' |',
            '|---|' + '---:|' * len(COLUMNS)]
    for key, r in results.items():
        c, fc = r['counts'], fa2[key]['counts']
        cells = [f'{per_hmma(c, cl):.2f} / {per_hmma(fc, cl):.2f}' for _, cl in COLUMNS]
        out.append(f'| {KERNELS[key]["title"]} | ' + ' | '.join(cells) + ' |')
    out += ['', 'Per iteration and warp: HMMA, instructions, the model\'s issue-slot use and '
            'tensor pipe busy (flashdl / FA2):', '',
            '| kernel | HMMA per iteration | instructions | issue-slot use | tensor pipe busy |',
            '|---|---:|---:|---:|---:|']
    for key, r in results.items():
        c, m, f = r['counts'], r['model'], fa2[key]
        out.append(f'| {KERNELS[key]["title"]} | {c["hmma"]:g} / {f["counts"]["hmma"]:g} | '
                   f'{c["instructions"]:.0f} / {f["counts"]["instructions"]:.0f} | '
                   f'{m["issue_use"]:.2f} / {f["model"]["issue_use"]:.2f} | '
                   f'{m["tensor_busy"]:.2f} / {f["model"]["tensor_busy"]:.2f} |')
    return out, worst, worst_ftz


def git_describe():
    try:
        rev = subprocess.run(['git', '-C', ROOT, 'rev-parse', '--short', 'HEAD'],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(['git', '-C', ROOT, 'status', '--porcelain', '--', 'src/cuda',
                                'include'], capture_output=True, text=True).stdout.strip()
        return rev + (' with uncommitted changes in src/cuda or include' if dirty else '')
    except (OSError, subprocess.CalledProcessError):
        return 'unknown'


def tool_version(name):
    try:
        out = subprocess.run([find_tool(name), '--version'], capture_output=True,
                             text=True).stdout.strip().splitlines()
        return out[-1] if out else 'unknown'
    except ReportError:
        return 'not found'


def render(results, fa2, arch):
    lines, worst, worst_ftz = table(results, fa2)
    head = [
        f'# fa2 kernels against FlashAttention-2 on sm_{arch}: SASS counts and the issue model',
        '',
        f'flashdl at {git_describe()}; nvcc: {tool_version("nvcc")}; nvdisasm: '
        f'{tool_version("nvdisasm")}. Regenerate with `python3 tools/sass_model/report.py --out '
        'benchmarks/results/sass_model_sm90.md`. float16, one iteration of each main loop as a '
        'dense non-causal call runs it; model: one SM sub-partition, 2 warps '
        '(tools/sass_model/smsp_model.py, validated against an H100: tools/sass_model/README.md). '
        'FA2: torch 2.14.1+cu130\'s sm_90 build of FlashAttention-2 '
        '(tools/sass_model/fixtures/fa2_sm90), which is not built with -ftz=true: its exp2f keeps '
        'a range fix-up for denormal results (FSETP and two predicated FMUL around each MUFU.EX2) '
        'that flashdl\'s forward and backward, built with -ftz=true, do not have. "FA2 -ftz" is '
        'the model rerun on FA2\'s hot path without those instructions, as flash-attn\'s own '
        'package (--use_fast_math) would compile it: the ratio of the schedules alone.',
        '',
    ]
    paths = ['', 'Hot paths used (addresses of this build, for `smsp_model.py` / `hot_path.py`):',
             '']
    for key, r in results.items():
        for k, p in enumerate(r['paths'], 1):
            paths.append(f'- {KERNELS[key]["title"]}, pattern {k}: `{p}`')
    return '\n'.join(head + lines + paths + [
        '', f'worst model ratio to FA2 built with -ftz=true: {worst_ftz:.2f}', '',
        f'worst model ratio to FA2: {worst:.2f}']) + '\n'


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--out', help='write the report here (default: stdout)')
    ap.add_argument('--work', help='keep the compiled units and SASS in this directory')
    ap.add_argument('--sass-dir', help='reuse KEY.sass and KEY.ptxas from this directory')
    ap.add_argument('--jobs', type=int, default=2, help='parallel nvcc runs (2)')
    ap.add_argument('--arch', default='90', help='sm_ARCH (90; the FA2 fixtures are sm_90)')
    ap.add_argument('--kernels', default=','.join(KERNELS),
                    help='comma-separated subset of ' + ', '.join(KERNELS))
    a = ap.parse_args(argv)
    keys = [k.strip() for k in a.kernels.split(',') if k.strip()]
    for k in keys:
        if k not in KERNELS:
            raise ReportError(f'--kernels: unknown kernel {k!r} (one of {", ".join(KERNELS)})')
    tmp = None
    src_dir = a.sass_dir
    if src_dir is None:
        src_dir = a.work or tempfile.mkdtemp(prefix='sass_model_')
        tmp = None if a.work else src_dir
        os.makedirs(src_dir, exist_ok=True)
        with concurrent.futures.ThreadPoolExecutor(max(1, a.jobs)) as ex:
            futs = [ex.submit(compile_unit, k, KERNELS[k], src_dir, a.arch) for k in keys]
            for f in futs:
                f.result()
    try:
        results, fa2 = {}, {}
        for k in keys:
            pt = os.path.join(src_dir, k + '.ptxas')
            text = open(pt).read() if os.path.exists(pt) else None
            results[k] = analyse_flashdl(k, os.path.join(src_dir, k + '.sass'), text)
            fa2[k] = analyse_fa2(KERNELS[k]['fa2'])
        report = render(results, fa2, a.arch)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    if a.out:
        with open(a.out, 'w') as f:
            f.write(report)
    sys.stdout.write(report)


if __name__ == '__main__':
    try:
        main()
    except ReportError as e:
        sys.exit(f'report.py: {e}')
