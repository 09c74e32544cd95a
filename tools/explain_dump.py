"""Explains the failed rows of a CUDA forward case dumped by test_cuda_block_sparse
(FLASHDL_TEST_DUMP=DIR; the format is described above dump_forward in that test).

    python tools/explain_dump.py DIR/0.bin [...] [--rows N] [--group G] [--block-m 128]

For each dump: the float64 reference recomputed from the dumped inputs (a check of this script
against the test's oracle), the failed rows (out off by more than --tol, by default 3e-3 for
float16 and 2.5e-2 for bfloat16, about the test's tolerance; or lse by more than 1e-3)
counted by their 16-row band within a warp of the kernel's tile (--block-m rows per CTA, 32 per
warp), and for the first N failed rows two explanations of the kernel's out:
  - the reference point r of the online softmax that reproduces it: P = exp2(t - r) rounded to the
    dtype, l = sum P in float32, out = P V / l rounded to the dtype, for r = the row's max (what
    the kernel should use) and r = 0 (the value a running max that never started at -inf keeps);
  - least-squares weights of the reference's per-key-group contributions (groups of G keys):
    1 where a group counted, 0 where it was lost.
Needs numpy only.
"""
import argparse
import json

import numpy as np

LOG2E = 1.4426950408889634


def load(path):
    raw = open(path, "rb").read()
    nl = raw.index(b"\n")
    h = json.loads(raw[:nl])
    off = nl + 1

    def take(dtype, n):
        nonlocal off
        a = np.frombuffer(raw, dtype=dtype, count=n, offset=off)
        off += a.nbytes
        return a

    b, sq, sk, nh, hk, d = (h[x] for x in ("b", "sq", "sk", "h", "hk", "d"))
    h["q"] = take(np.float32, b * sq * nh * d).reshape(b, sq, nh, d)
    h["k"] = take(np.float32, b * sk * hk * d).reshape(b, sk, hk, d)
    h["v"] = take(np.float32, b * sk * hk * d).reshape(b, sk, hk, d)
    h["vis"] = take(np.uint8, b * nh * sq * sk).reshape(b, nh, sq, sk)
    h["slope"] = take(np.float32, h["slopes"])
    for who in ("ref", "got"):
        h[who + "_out"] = take(np.float32, b * sq * nh * d).reshape(b, sq, nh, d)
        h[who + "_lse"] = take(np.float32, b * nh * sq).reshape(b, nh, sq)
    if off != len(raw):
        raise SystemExit(f"{path}: {len(raw) - off} bytes left over: not a dump of this format")
    h["dtype"] = np.float16 if " float16 " in h["label"] else None  # bfloat16: rounded by hand
    return h


def round_to(x, h):
    x = np.asarray(x, np.float32)
    if h["dtype"] is np.float16:
        return x.astype(np.float16).astype(np.float32)
    bits = x.view(np.uint32).astype(np.uint64)  # bfloat16: round to nearest even on 16 bits
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def scores(h, bi, hi):
    """Natural-log scores of (batch, head): scale, softcap, ALiBi, -inf where hidden."""
    nh, hk, d, sq, sk = h["h"], h["hk"], h["d"], h["sq"], h["sk"]
    q = h["q"][bi, :, hi].astype(np.float64)
    k = h["k"][bi, :, hi // (nh // hk)].astype(np.float64)
    s = q @ k.T / np.sqrt(d)
    if h["softcap"] > 0:
        s = h["softcap"] * np.tanh(s / h["softcap"])
    if h["slopes"]:
        i = np.arange(sq)[:, None]
        j = np.arange(sk)[None, :]
        s = s - float(h["slope"][bi * nh + hi]) * np.abs(i + sk - sq - j)
    return np.where(h["vis"][bi, hi] != 0, s, -np.inf)


def with_reference(h, s, v, r):
    """out of one row when the online softmax subtracts r (exp2 domain) from every score."""
    t = s * LOG2E
    p = np.where(np.isfinite(t), np.exp2(t - r), 0.0).astype(np.float32)
    l = p.sum(dtype=np.float32)
    if not l > 0:
        return np.zeros(v.shape[1], np.float32)
    return round_to((round_to(p, h) @ v) / l, h)


def explain(path, rows, group, block_m, tol):
    h = load(path)
    tol = tol or (3e-3 if h["dtype"] is np.float16 else 2.5e-2)
    b, sq, sk, nh, hk, d = (h[x] for x in ("b", "sq", "sk", "h", "hk", "d"))
    print(f"== {path}: {h['label']}")
    bands = {}
    shown = 0
    for bi in range(b):
        for hi in range(nh):
            s = scores(h, bi, hi)
            v = h["v"][bi, :, hi // (nh // hk)].astype(np.float32)
            m = np.max(s, axis=1)
            with np.errstate(invalid="ignore"):
                p = np.where(np.isfinite(s), np.exp(s - np.where(np.isfinite(m), m, 0)[:, None]), 0)
            l = p.sum(axis=1)
            out = np.where(l[:, None] > 0, (p @ v) / np.where(l > 0, l, 1)[:, None], 0)
            drift = np.abs(out - h["ref_out"][bi, :, hi]).max()
            if drift > 1e-4:
                print(f"  b={bi} h={hi}: this script's reference is {drift:.1e} from the test's")
            for i in range(sq):
                got = h["got_out"][bi, i, hi]
                err = float(np.abs(got - out[i]).max())
                lse, want = float(h["got_lse"][bi, hi, i]), float(h["ref_lse"][bi, hi, i])
                lse_bad = (lse != want) if np.isinf(want) else not abs(lse - want) <= 1e-3
                if err <= tol and not lse_bad:
                    continue
                local = i % block_m
                key = (local // 32, local % 32 // 16)
                bands[key] = bands.get(key, 0) + 1
                if shown >= rows:
                    continue
                shown += 1
                fits = {name: float(np.abs(with_reference(h, s[i], v, r) - got).max())
                        for name, r in (("row max", np.max(s[i]) * LOG2E), ("0", 0.0))}
                print(f"  b={bi} h={hi} i={i}: out err {err:.2e}, lse {lse:.5g} want {want:.5g}, "
                      f"max score {np.max(s[i]):.3g}; out with r = " +
                      ", ".join(f"{k}: off by {e:.1e}" for k, e in fits.items()))
                used = [g for g in range((sk + group - 1) // group)
                        if np.abs(p[i, g * group:(g + 1) * group]).max() > 0]
                if used and l[i] > 0:
                    c = np.stack([p[i, g * group:(g + 1) * group] @ v[g * group:(g + 1) * group]
                                  for g in used]) / l[i]
                    w, *_ = np.linalg.lstsq(c.T, got, rcond=None)
                    print("      key groups (first key: weight): " +
                          " ".join(f"{g * group}: {x:.3f}" for g, x in zip(used, w)))
    total = sum(bands.values())
    print(f"  {total} failed rows; by (warp, 16-row band) of a {block_m}-row tile: " +
          (", ".join(f"{k}: {n}" for k, n in sorted(bands.items())) or "none"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dumps", nargs="+")
    ap.add_argument("--rows", type=int, default=8, help="failed rows to explain per dump")
    ap.add_argument("--group", type=int, default=16, help="keys per group of the fit")
    ap.add_argument("--block-m", type=int, default=128, help="query rows per CTA of the kernel")
    ap.add_argument("--tol", type=float, default=None, help="out error that fails a row")
    a = ap.parse_args()
    for path in a.dumps:
        explain(path, a.rows, a.group, a.block_m, a.tol)


if __name__ == "__main__":
    main()
