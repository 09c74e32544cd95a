"""The fuzzer's worker (test_fuzz.py starts it as a script): reads "seed first count" from stdin,
builds each case from (seed, index) alone, and runs it in a child process of its own (os.fork of
this worker, which has imported the frameworks but computed nothing) with a timeout. Prints one
JSON line per case: its entry point, the argument it changed and how, and the outcome:
  accepted  the call returned, matched the float64 oracle and left every input bitwise unchanged
  refused   ValueError / TypeError / NotImplementedError whose message starts with an argument
            of the entry point, and no input changed
  fail      anything else: a wrong result, a write into an input, an unnamed or other exception,
            an accepted hostile value (silent acceptance)
  crash     the child died (signal or abnormal exit)
  hang      the child outlived the timeout
"""

import inspect
import json
import math
import os
import select
import signal
import sys
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import flashdl  # noqa: E402
from attn_oracle import backward as oracle_backward  # noqa: E402
from attn_oracle import forward as oracle_forward  # noqa: E402

try:
    import torch
    import flashdl.flash_attn as fa
    import flashdl.torch as fdt
except ImportError:  # pragma: no cover - torch is a test dependency
    torch = None
try:
    import jax
    import jax.numpy as jnp
    import flashdl.jax as fjax
    jax.config.update("jax_enable_x64", True)
except ImportError:  # pragma: no cover
    jax = None

TIMEOUT_S = float(os.environ.get("FLASHDL_FUZZ_TIMEOUT", "20"))
REFUSALS = (ValueError, TypeError, NotImplementedError)
VALID = object()  # a mutation marker: the value is valid and must be accepted


# ---- hostile and valid values, by argument kind --------------------------------------------------

def flag_values(v):
    return [("str", "no", False), ("int 1", 1, False), ("int 0", 0, False), ("None", None, False),
            ("float", 1.0, False), ("np.bool_", np.bool_(v), True)]


def scale_values():
    return [("nan", math.nan, False), ("inf", math.inf, False), ("-inf", -math.inf, False),
            ("str", "0.5", False), ("bool", True, False), ("1e300", 1e300, False),
            ("array", np.array([0.5]), False), ("complex", 1 + 1j, False),
            ("np.float32", np.float32(0.5), True), ("int", 2, True), ("1e30 limit", 1e30, True)]


def softcap_values():
    return [("nan", math.nan, False), ("inf", math.inf, False), ("-1", -1.0, False),
            ("1e-300", 1e-300, False), ("str", "1", False), ("None", None, False),
            ("bool", True, False), ("1e31", 1e31, False), ("1e-30 limit", 1e-30, True),
            ("1e30 limit", 1e30, True), ("np.float64", np.float64(2.0), True)]


def window_values():
    return [("float", (1.5, 0), False), ("bool", (True, 0), False), ("huge", (2**70, 0), False),
            ("-2", (-2, 0), False), ("str", "ab", False), ("short", (1,), False),
            ("None", None, False), ("np.int64", (np.int64(2), np.int64(0)), True)]


def float_array_values(x):
    out = [("int32", x.astype(np.int32), False), ("big-endian", x.astype(x.dtype.newbyteorder(">")), False),
           ("object", x.astype(object), False), ("longdouble", x.astype(np.longdouble), False),
           ("rank 3", x[0], False), ("list", x.tolist(), False), ("None", None, False),
           ("rows strided", np.repeat(x, 2, axis=1)[:, ::2], True),
           ("negative strides", np.ascontiguousarray(x[:, ::-1])[:, ::-1], True),
           ("read-only", _readonly(x), True)]
    if np.dtype(np.longdouble).itemsize == 8:
        out = [o for o in out if o[0] != "longdouble"]
    if x.shape[-1] > 1:  # (a last axis of extent 1 may have any stride)
        out.append(("wrong headdim", x[..., :-1].copy(), False))
        out.append(("last dim strided", np.repeat(x, 2, axis=-1)[..., ::2], False))
    return out


def int_array_values(x):
    return [("float", x.astype(np.float64) + 0.5, False), ("float list", [float(v) + 0.5 for v in x], False),
            ("big-endian", x.astype(">i4"), False), ("object", x.astype(object), False),
            ("bool", x.astype(bool), False), ("int64", x.astype(np.int64), True)]


def _readonly(x):
    y = x.copy()
    y.flags.writeable = False
    return y


# ---- one problem ---------------------------------------------------------------------------------

class Problem:
    def __init__(self, rng):
        self.b = int(rng.integers(1, 3))
        self.sq, self.sk = int(rng.integers(0, 10)), int(rng.integers(0, 10))
        self.hk = int(rng.choice([1, 2]))
        self.h = self.hk * int(rng.choice([1, 2]))
        self.d = int(rng.choice([1, 4, 8, 16]))
        self.dtype = np.float32 if rng.random() < 0.8 else np.float64
        self.causal = bool(rng.random() < 0.3)
        self.window = [(-1, -1), (-1, -1), (2, 0), (0, 3), (1, 1)][int(rng.integers(0, 5))]
        self.softcap = [0.0, 0.0, 0.0, 0.5, 30.0][int(rng.integers(0, 5))]
        self.scale = [None, None, 0.3, 2.0][int(rng.integers(0, 4))]
        mk = lambda *s: rng.standard_normal(s).astype(self.dtype)  # noqa: E731
        self.q, self.k, self.v = (mk(self.b, self.sq, self.h, self.d),
                                  mk(self.b, self.sk, self.hk, self.d),
                                  mk(self.b, self.sk, self.hk, self.d))
        self.dout = mk(self.b, self.sq, self.h, self.d)
        self.rng = rng

    def opts(self):
        return dict(causal=self.causal, softmax_scale=self.scale, window_size=self.window,
                    softcap=self.softcap)


def tol(dtype):
    return 2e-4 if dtype == np.float32 else 1e-9


def close(got, want, what, rtol=2e-4):
    """Within rtol of the oracle relative to 1 + max|oracle| (float32 accumulation; float64 inputs
    compute in float64 and are held to the same bound)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {got.shape}, expected {want.shape}")
    both_nan = np.isnan(got) & np.isnan(want)
    err = np.where(both_nan, 0.0, np.abs(got - want))
    scale = 1.0 + (np.abs(want).max() if want.size else 0.0)
    if not (np.nan_to_num(err / scale, nan=np.inf) <= rtol).all():
        raise AssertionError(f"{what}: max error {np.nanmax(err)} against the float64 oracle")


def oracle_out(q, k, v, kw):
    o = dict(kw)
    window = o.pop("window_size", (-1, -1))
    out, lse = oracle_forward(np.asarray(q, np.float64), np.asarray(k, np.float64),
                              np.asarray(v, np.float64), window=window, **o)
    return out, lse


def as_values(kw):
    """The keywords as the oracle reads them (np.bool_, np.float32 ... as Python values)."""
    out = {}
    for n, x in kw.items():
        if isinstance(x, np.bool_):
            x = bool(x)
        elif isinstance(x, (np.floating, np.integer)):
            x = x.item()
        elif isinstance(x, tuple):
            x = tuple(int(e) for e in x)
        out[n] = x
    return out


# ---- entry points --------------------------------------------------------------------------------
# Each builder returns (fn, args dict in call order, keyword names, check(result, args)), and the
# list of mutable (name, values) pairs. Arrays in args are watched: they must not change (except
# where check() says a write is expected).

def e_attention(p):
    args = dict(q=p.q, k=p.k, v=p.v, **p.opts(), return_lse=True)

    def check(res, a):
        out, lse = res
        ro, rl = oracle_out(a["q"], a["k"], a["v"], _core_kw(a))
        close(out, ro, "out")
        close(np.where(np.isinf(rl), -1e30, rl), np.where(np.isinf(lse), -1e30, lse), "lse")
    muts = [("causal", flag_values(p.causal)), ("return_lse", flag_values(True)[:-1]),
            ("softmax_scale", scale_values()), ("softcap", softcap_values()),
            ("window_size", window_values()), ("q", float_array_values(p.q)),
            ("k", float_array_values(p.k)), ("v", float_array_values(p.v))]
    return flashdl.attention, args, check, muts


def _core_kw(a):
    kw = as_values({n: a[n] for n in ("causal", "softmax_scale", "window_size", "softcap")
                    if n in a})
    if kw.get("causal"):
        kw["window_size"] = (kw.get("window_size", (-1, -1))[0], 0)
        kw["causal"] = False
    return kw


def e_backward(p):
    out, lse = flashdl.attention(p.q, p.k, p.v, return_lse=True, **p.opts())
    args = dict(dout=p.dout, q=p.q, k=p.k, v=p.v, out=out, lse=lse, **p.opts(),
                deterministic=False)

    def check(res, a):
        kw = _core_kw(a)
        window = kw.pop("window_size")
        want = oracle_backward(*(np.asarray(a[n], np.float64) for n in ("dout", "q", "k", "v")),
                               window=window, **kw)
        for g, w, n in zip(res, want, ("dq", "dk", "dv")):
            close(g, w, n, rtol=1e-3)
    muts = [("deterministic", flag_values(False)), ("causal", flag_values(p.causal)),
            ("softcap", softcap_values()), ("dout", float_array_values(p.dout)),
            ("lse", [("float64", lse.astype(np.float64), False), ("rank 2", lse[0], False)])]
    return flashdl.attention_backward, args, check, muts


def e_varlen(p):
    lens_q = p.rng.integers(0, 6, p.b)
    lens_k = p.rng.integers(0, 6, p.b)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    mk = lambda n, h: p.rng.standard_normal((int(n), h, p.d)).astype(p.dtype)  # noqa: E731
    q, k, v = mk(cu_q[-1], p.h), mk(cu_k[-1], p.hk), mk(cu_k[-1], p.hk)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=6,
                max_seqlen_k=6, **p.opts())

    def check(res, a):
        cq, ck = np.asarray(a["cu_seqlens_q"]), np.asarray(a["cu_seqlens_k"])
        for s in range(len(cq) - 1):
            rows = slice(int(cq[s]), int(cq[s + 1]))
            keys = slice(int(ck[s]), int(ck[s + 1]))
            want, _ = oracle_out(a["q"][None, rows], a["k"][None, keys], a["v"][None, keys],
                                 _core_kw(a))
            close(res[rows], want[0], f"out of sequence {s}")
    muts = [("cu_seqlens_q", int_array_values(cu_q)), ("cu_seqlens_k", int_array_values(cu_k)),
            ("max_seqlen_q", [("float", 6.0, False), ("bool", True, False), ("huge", 2**64, False),
                              ("np.int64", np.int64(6), True)]),
            ("causal", flag_values(p.causal)), ("window_size", window_values()),
            ("softmax_scale", scale_values())]
    return flashdl.attention_varlen, args, check, muts


def e_kvcache(p):
    cap = 8
    new = int(p.rng.integers(0, 3))
    k_cache = p.rng.standard_normal((p.b, cap, p.hk, p.d)).astype(p.dtype)
    v_cache = p.rng.standard_normal((p.b, cap, p.hk, p.d)).astype(p.dtype)
    seqlens = p.rng.integers(0, cap - new + 1, p.b).astype(np.int32)
    q = p.q[:, : max(1, min(p.sq, 3))] if p.sq else p.q
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=seqlens)
    if new:
        args.update(k=p.rng.standard_normal((p.b, new, p.hk, p.d)).astype(p.dtype),
                    v=p.rng.standard_normal((p.b, new, p.hk, p.d)).astype(p.dtype))
    args.update(causal=p.causal, softmax_scale=p.scale, window_size=p.window, softcap=p.softcap)

    def check(res, a, before):
        kc, vc = before["k_cache"].copy(), before["v_cache"].copy()
        lens = np.asarray(a["cache_seqlens"]).astype(np.int64)
        for b in range(p.b):
            if new:
                kc[b, lens[b]:lens[b] + new] = a["k"][b]
                vc[b, lens[b]:lens[b] + new] = a["v"][b]
        for n, want in (("k_cache", kc), ("v_cache", vc)):
            if not np.array_equal(np.asarray(a[n]), want, equal_nan=True):
                raise AssertionError(f"{n}: written other than the appended rows")
        for b in range(p.b):
            used = int(lens[b]) + new
            want, _ = oracle_out(a["q"][b:b + 1], kc[b:b + 1, :used], vc[b:b + 1, :used],
                                 _core_kw(a))
            close(res[b:b + 1], want, f"out of batch {b}")
    base = np.zeros((p.b, 1, p.hk, p.d), p.dtype)
    expanded = np.lib.stride_tricks.as_strided(base, (p.b, cap, p.hk, p.d),
                                               (base.strides[0], 0) + base.strides[2:],
                                               writeable=True)
    cache_muts = [("expanded", expanded, not new), ("read-only", _readonly(k_cache), not new)]
    muts = [("cache_seqlens", int_array_values(seqlens) +
             [("negative", -np.ones(p.b, np.int32), False),
              ("over capacity", np.full(p.b, cap + 1, np.int32), False)]),
            ("k_cache", cache_muts), ("causal", flag_values(p.causal)),
            ("softcap", softcap_values()), ("softmax_scale", scale_values())]
    return flashdl.attention_with_kvcache, args, check, muts


def e_merge(p):
    split = p.sk // 2
    kw = p.opts()
    a = flashdl.attention(p.q, p.k[:, :split], p.v[:, :split], return_lse=True, **kw)
    b = flashdl.attention(p.q, p.k[:, split:], p.v[:, split:], return_lse=True, **kw)
    args = dict(out_a=a[0], lse_a=a[1], out_b=b[0], lse_b=b[1])
    whole = kw["window_size"] == (-1, -1) and not kw["causal"]

    def check(res, a_):
        if whole:  # disjoint key sets of plain attention: the merge is the whole
            want, _ = oracle_out(p.q, p.k, p.v, _core_kw(dict(kw, softmax_scale=p.scale)))
            close(res[0], want, "out")
    muts = [("out_a", float_array_values(a[0])), ("lse_b", [("float64", b[1].astype(np.float64), False),
                                                            ("rank 2", b[1][0], False)])]
    return flashdl.merge_states, args, check, muts


def e_dropout_mask(p):
    args = dict(batch=p.b, nheads=p.h, seqlen_q=p.sq, seqlen_k=p.sk, dropout_p=0.3, seed=7)

    def check(res, a):
        want = tuple(int(a[n]) for n in ("batch", "nheads", "seqlen_q", "seqlen_k"))
        if res.shape != want or res.dtype != np.bool_:
            raise AssertionError(f"mask of shape {res.shape} {res.dtype}")
    ints = [("float", 2.5, False), ("bool", True, False), ("huge", 2**70, False),
            ("str", "2", False), ("np.int64", np.int64(2), True)]
    muts = [("batch", ints), ("seqlen_k", ints), ("seed", ints[:4]),
            ("dropout_p", [("nan", math.nan, False), ("1", 1.0, False), ("str", "0.1", False)])]
    return flashdl.dropout_mask, args, check, muts


def _torchify(x):
    if isinstance(x, np.ndarray) and x.dtype.kind in "fiub" and x.dtype.isnative and x.flags.aligned:
        try:
            return torch.from_numpy(x.copy())
        except TypeError:  # a NumPy dtype torch has not: stays a NumPy array (mixed frameworks)
            return x
    return x


def e_torch(p):
    fn, args, check, muts = e_attention(p)
    args = {n: _torchify(x) for n, x in args.items()}

    def tcheck(res, a):
        check(tuple(r.numpy() for r in res), {n: x.numpy() if isinstance(x, torch.Tensor) else x
                                               for n, x in a.items()})
    tmuts = []
    for name, values in muts:
        # (a NumPy layout variant does not survive the copy into a tensor: left out)
        tmuts.append((name, [(lab, _torchify(x), ok) for lab, x, ok in values
                             if not (isinstance(x, np.ndarray) and (ok or "strided" in lab))]))
    tmuts.append(("k", [("expanded", torch.from_numpy(p.k[:, :1].copy()).expand(*p.k.shape)
                         if p.sk else torch.from_numpy(p.k), True)]))
    return fdt.attention, args, tcheck, tmuts


def e_flash_attn(p):
    q, k, v = (torch.from_numpy(x.copy()) for x in (p.q, p.k, p.v))
    args = dict(q=q, k=k, v=v, dropout_p=0.0, softmax_scale=p.scale, causal=p.causal,
                window_size=p.window, softcap=p.softcap)

    def check(res, a):
        kw = _core_kw(dict(a, softcap=max(float(a["softcap"]), 0.0),
                           window_size=tuple(max(int(w), -1) for w in a["window_size"])))
        want, _ = oracle_out(a["q"].numpy(), a["k"].numpy(), a["v"].numpy(), kw)
        close(res.numpy(), want, "out")
    softcaps = [(lab, x, ok or (isinstance(x, float) and x < 0 and not math.isinf(x)))
                for lab, x, ok in softcap_values()]
    windows = [(lab, x, ok or lab == "-2") for lab, x, ok in window_values()]
    muts = [("causal", flag_values(p.causal)), ("softmax_scale", scale_values()),
            ("softcap", softcaps), ("window_size", windows),
            ("dropout_p", [("nan", math.nan, False), ("str", "0", False)])]
    return fa.flash_attn_func, args, check, muts


def e_qkvpacked(p):
    qkv = torch.from_numpy(np.stack([p.q, p.q, p.q], axis=2).copy())
    args = dict(qkv=qkv, causal=p.causal)

    def check(res, a):
        x = a["qkv"].numpy()
        want, _ = oracle_out(x[:, :, 0], x[:, :, 1], x[:, :, 2], _core_kw(a))
        close(res.numpy(), want, "out")
    bad = torch.from_numpy(np.stack([p.q] * 4, axis=2).copy())
    muts = [("qkv", [("packing axis 4", bad, False), ("packing axis 2", bad[:, :, :2], False)]),
            ("causal", flag_values(p.causal))]
    return fa.flash_attn_qkvpacked_func, args, check, muts


def e_jax(p):
    q, k, v = (jnp.asarray(x) for x in (p.q, p.k, p.v))
    args = dict(q=q, k=k, v=v, causal=p.causal, softmax_scale=p.scale, window_size=p.window,
                softcap=p.softcap)

    def check(res, a):
        want, _ = oracle_out(np.asarray(a["q"]), np.asarray(a["k"]), np.asarray(a["v"]),
                             _core_kw(a))
        close(np.asarray(res), want, "out")
    muts = [("causal", flag_values(p.causal)), ("softmax_scale", scale_values()),
            ("softcap", softcap_values()), ("window_size", window_values())]
    return fjax.attention, args, check, muts


ENTRIES = {"attention": e_attention, "attention_backward": e_backward,
           "attention_varlen": e_varlen, "attention_with_kvcache": e_kvcache,
           "merge_states": e_merge, "dropout_mask": e_dropout_mask}
if torch is not None:
    ENTRIES.update({"torch.attention": e_torch, "flash_attn.flash_attn_func": e_flash_attn,
                    "flash_attn.flash_attn_qkvpacked_func": e_qkvpacked})
if jax is not None:
    ENTRIES["jax.attention"] = e_jax
WEIGHTS = {"jax.attention": 0.25}  # each JAX child initialises XLA: fewer of them


def pick_entry(rng):
    names = sorted(ENTRIES)
    w = np.array([WEIGHTS.get(n, 1.0) for n in names])
    return names[int(rng.choice(len(names), p=w / w.sum()))]


# ---- one case, in the child ----------------------------------------------------------------------

def snapshot(x):
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, np.ndarray):
        return x.copy()
    if jax is not None and isinstance(x, jax.Array):
        return np.asarray(x).copy()
    return None


def same(a, b):
    if torch is not None and isinstance(a, torch.Tensor):
        a, b = a.detach().contiguous().numpy(), b.contiguous().numpy()
    a = np.asarray(a)
    return a.dtype == b.dtype and a.tobytes() == np.asarray(b).tobytes()


def run_case(seed, index):
    rng = np.random.default_rng([seed, index])
    entry = pick_entry(rng)
    p = Problem(rng)
    fn, args, check, muts = ENTRIES[entry](p)
    mutated, label, valid = None, "valid", True
    if rng.random() < 0.75:
        name, values = muts[int(rng.integers(0, len(muts)))]
        if name in args and values:
            label, value, valid = values[int(rng.integers(0, len(values)))]
            mutated = name
            args = dict(args, **{name: value})
            if name == "k_cache" and "k" in args:
                args["v_cache"] = args["v_cache"]  # the cache pair: only k_cache changed
    if entry == "attention_backward" and valid and mutated in ("causal", "softcap"):
        # the forward's out and lse for the options the backward is given
        opts = {n: args[n] for n in ("causal", "softmax_scale", "window_size", "softcap")}
        out, lse = flashdl.attention(args["q"], args["k"], args["v"], return_lse=True, **opts)
        args.update(out=out, lse=lse)
    record = dict(entry=entry, arg=mutated, mutation=label, expect="accept" if valid else "refuse")
    names = set(inspect.signature(fn).parameters) | {"outs", "lses", "outs, lses"}
    before = {n: snapshot(x) for n, x in args.items()}
    try:
        result = fn(**args)
    except REFUSALS as err:
        msg = str(err)
        named = msg.split(":", 1)[0] if ":" in msg else ""
        record.update(outcome="refused", message=msg[:300], named=named)
        bad = [n for n, x in args.items() if before[n] is not None and not same(x, before[n])]
        if bad:
            return dict(record, status="fail", why=f"refused but wrote {bad}")
        if named not in names and not named.startswith(("outs[", "lses[")):
            return dict(record, status="fail", why="the refusal names no argument")
        if valid:
            return dict(record, status="fail", why="a valid call was refused")
        return dict(record, status="refused")
    except Exception as err:  # noqa: BLE001 - everything else is a finding
        return dict(record, status="fail", outcome=type(err).__name__,
                    why=f"{type(err).__name__}: {str(err)[:300]}")
    if not valid:
        return dict(record, status="fail", outcome="accepted", why="a hostile value was accepted")
    try:
        written = {"k_cache", "v_cache"} if entry == "attention_with_kvcache" and "k" in args else set()
        for n, x in args.items():
            if n not in written and before[n] is not None and not same(x, before[n]):
                raise AssertionError(f"{n}: an input was written")
        if entry == "attention_with_kvcache":
            check(result, args, before)
        else:
            check(result, args)
    except AssertionError as err:
        return dict(record, status="fail", outcome="accepted", why=str(err)[:300])
    return dict(record, status="accepted", outcome="accepted")


# ---- the worker loop -----------------------------------------------------------------------------

def run_in_child(seed, index):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(r)
        try:
            res = run_case(seed, index)
        except BaseException:  # noqa: BLE001
            res = dict(status="fail", why="harness: " + traceback.format_exc()[-500:])
        os.write(w, json.dumps(res, default=str).encode())
        os.close(w)
        os._exit(0)
    os.close(w)
    chunks, deadline = [], TIMEOUT_S
    import time
    start = time.monotonic()
    while True:
        left = deadline - (time.monotonic() - start)
        if left <= 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return dict(status="hang", why=f"no answer in {TIMEOUT_S} s")
        ready, _, _ = select.select([r], [], [], left)
        if ready:
            data = os.read(r, 1 << 16)
            if not data:
                break
            chunks.append(data)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if not chunks or status != 0:
        how = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
               else f"exit {os.WEXITSTATUS(status)}")
        return dict(status="crash", why=how)
    return json.loads(b"".join(chunks))


def main():
    seed, first, count = (int(x) for x in sys.stdin.readline().split())
    for i in range(first, first + count):
        res = run_in_child(seed, i)
        res["index"] = i
        sys.stdout.write(json.dumps(res, default=str) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
