"""Dropout and block-sparse masks in the CUDA kernels (fa1, fa2, and fa2 with deterministic=True)
through flashdl.attention, attention_backward and flashdl.torch.attention on torch CUDA tensors.

Dropout: the exact-mask trick (q = k = 0, so each visible probability of row i is 1 / n_i; v the
identity, so out[b, i, h, j] = Z_ij / (n_i (1 - p)); dout the identity, so dv shows the backward's
mask the same way) must reproduce flashdl.dropout_mask (the CPU's Philox) bit for bit; a large
case keeps 1 - p of the elements within 0.01; random inputs meet flash-attn's rule against the
float64 oracle with that mask (the naive low-precision error taken without dropout and scaled by
1 / (1 - p)); fa1 and fa2 agree; autograd carries the seed to the backward.
Block-sparse: against the float64 oracle with the expanded element mask, for per-head, broadcast
(size 1 and stride 0), strided and shared masks over blocks that do not line up with the kernels'
tiles, with causal and GQA; rows and keys that only zero blocks cover get exact zeros, and NaN in
them reaches nothing. deterministic=True is bitwise repeatable with both features.
Score modifiers (softcap, ALiBi with (nheads,) and (batch, nheads) slopes, both): against
schedule="reference" on float64 CPU copies with the same modifiers, under flash-attn's rule with
a naive algorithm in the input precision that applies them too; with causal, windows, GQA/MQA,
empty rows; varlen (sequence b takes slope row b) equal to each sequence alone; zero slopes
bitwise equal to no slopes; torch autograd.
Skipped unless flashdl sees a CUDA device and torch.cuda is usable."""

from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest

import flashdl
import masked_oracle as mo
from attn_oracle import (assert_dropout_rule, assert_lse, assert_rule, backward, f64, forward,
                         grad_magnitude, make, make_qkv, max_err, np_dtype, visible)
from cuda_arrays import gpu_frameworks, host, torch_array

torch, _ = gpu_frameworks(need_torch=True)

DTYPES = ["float16", "bfloat16"]
SCHEDULES = ["fa1", "fa2"]
VARIANTS = {"fa1": ("fa1", False), "fa2": ("fa2", False), "fa2-det": ("fa2", True)}
ULP = {"float16": 2.0**-10, "bfloat16": 2.0**-7}


# ---- problems, runs and checks -------------------------------------------------------------------
def seed_of(*key):
    return zlib.crc32(repr(key).encode())


@functools.lru_cache(maxsize=64)
def problem(key, b, sq, sk, h, hk, d, dtype):
    """q, k, v, dout as float64 host arrays exact in dtype (cached: the variants share them)."""
    rng = np.random.default_rng(seed_of(key, dtype))
    q, k, v = make_qkv(rng, b, sq, sk, h, hk, d, dtype)
    return tuple(f64(x) for x in (q, k, v, make(rng, q.shape, dtype)))


def on_gpu(arrays, dtype):
    return [torch_array(x.astype(np.float32), dtype, "contiguous") for x in arrays]


def run(q, k, v, dout, schedule, deterministic=False, **opts):
    """Forward then backward on the current stream: host float64 (out, lse, dq, dk, dv)."""
    out, lse = flashdl.attention(q, k, v, schedule=schedule, return_lse=True, **opts)
    grads = flashdl.attention_backward(dout, q, k, v, out, lse, schedule=schedule,
                                       deterministic=deterministic, **opts)
    torch.cuda.current_stream().synchronize()
    return [host(x) for x in (out, lse) + tuple(grads)]


def assert_same_run(name, got, want, schedule, deterministic, why):
    """Two runs on equal inputs agree bitwise, except dQ of fa2 without `deterministic`: its float
    atomics sum in a different order every run (the C++ suite's rule: within a float16 rounding of
    the largest entry, and no NaN)."""
    if name == "dq" and schedule == "fa2" and not deterministic:
        assert not np.isnan(got).any(), f"dq: {why}"
        assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max(), f"dq: {why}"
    else:
        assert np.array_equal(got, want), f"{name}: {why}"


def identity_problem(b, sq, sk, h, hk, d, dtype):
    """q = k = 0, v[b, j, :, c] = (j == c) and dout[b, i, :, c] = (i == c), on the GPU."""
    tdt = getattr(torch, dtype)
    q = torch.zeros(b, sq, h, d, device="cuda", dtype=tdt)
    k = torch.zeros(b, sk, hk, d, device="cuda", dtype=tdt)
    v = torch.eye(sk, d, device="cuda", dtype=tdt)[None, :, None].expand(b, sk, hk, d).contiguous()
    dout = torch.eye(sq, d, device="cuda", dtype=tdt)[None, :, None].expand(b, sq, h, d)
    return q, k, v, dout.contiguous()


def assert_exact_zeros(out, lse, dq, dk, dv, vis, hk):
    """vis (b, h, sq, sk): rows that see no key have out 0, lse -inf and dq 0; keys that no query
    of their kv head's group sees have dk = dv = 0."""
    b, h, sq, sk = vis.shape
    empty = ~vis.any(axis=-1)
    assert np.all(np.swapaxes(out, 1, 2)[empty] == 0), "out of rows that see no key"
    assert np.all(np.isneginf(lse[empty])), "lse of rows that see no key"
    assert np.all(np.swapaxes(dq, 1, 2)[empty] == 0), "dq of rows that see no key"
    unseen = ~vis.reshape(b, hk, h // hk, sq, sk).any(axis=(2, 3))
    assert np.all(np.swapaxes(dk, 1, 2)[unseen] == 0), "dk of keys no query sees"
    assert np.all(np.swapaxes(dv, 1, 2)[unseen] == 0), "dv of keys no query sees"


def check_dropout(got, q, k, v, dout, dtype, p, seed, offset, causal=False, window=(-1, -1),
                  mask=None):
    """got = (out, lse or None, dq, dk, dv) against the float64 oracle with flashdl.dropout_mask,
    under the dropout rule; mask: an extra element mask (b, h, sq, sk) or None."""
    out, lse, *grads = got
    b, sq, h, _ = q.shape
    vis = visible(sq, k.shape[1], causal, window)
    vis = vis if mask is None else vis & mask
    keep = flashdl.dropout_mask(b, h, sq, k.shape[1], p, seed, offset)
    want_out, want_lse = mo.forward(q, k, v, vis, keep, p)
    plain = dict(causal=causal, window=window, mask=mask)
    low = forward(q, k, v, dtype=dtype, exact=False, **plain)[0]
    assert_dropout_rule(out, want_out, max_err(low, forward(q, k, v, **plain)[0]), dtype, p)
    if lse is not None:
        assert_lse(lse, want_lse, rtol=1e-4, atol=1e-3)  # of the undropped scores
    want = mo.backward(dout, q, k, v, vis, keep, p)
    exact = backward(dout, q, k, v, **plain)
    naive = backward(dout, q, k, v, dtype=dtype, exact=False, **plain)
    mag = grad_magnitude(want)
    for name, g, w, e, n in zip(("dq", "dk", "dv"), grads, want, exact, naive):
        assert_dropout_rule(g, w, max_err(n, e), dtype, p, factor=3.0, what=name, magnitude=mag,
                            grad=True)


# ---- dropout -------------------------------------------------------------------------------------
EXACT_CASES = [  # (b, sq, sk, h, hk, d, causal), sq and sk <= d
    (2, 64, 40, 4, 2, 64, False),    # GQA, sq > sk: columns 40..63 of out stay 0
    (1, 100, 64, 2, 1, 128, True),   # MQA, causal: 36 rows see nothing
    (2, 40, 128, 2, 2, 128, True),   # causal, sq < sk
    (1, 1, 256, 4, 4, 256, False),   # one query row
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", EXACT_CASES, ids=lambda c: "b{}-sq{}-sk{}-h{}/{}-d{}-{}".format(
    *c[:6], "causal" if c[6] else "full"))
def test_dropout_applies_exactly_the_cpu_mask(case, dtype, variant):
    b, sq, sk, h, hk, d, causal = case
    schedule, det = VARIANTS[variant]
    opts = dict(causal=causal, schedule=schedule, dropout_p=0.3, seed=2**40 + 17, offset=5)
    q, k, v, dout = identity_problem(b, sq, sk, h, hk, d, dtype)
    out, lse = flashdl.attention(q, k, v, return_lse=True, **opts)
    grads = flashdl.attention_backward(dout, q, k, v, out, lse, deterministic=det, **opts)
    torch.cuda.current_stream().synchronize()

    vis = visible(sq, sk, causal)
    n = vis.sum(axis=1)  # visible keys of each row
    keep = flashdl.dropout_mask(b, h, sq, sk, 0.3, opts["seed"], opts["offset"]) & vis
    want = np.where(keep, 1.0 / (np.maximum(n, 1)[:, None] * (1 - np.float32(0.3))), 0.0)
    got = np.swapaxes(host(out), 1, 2)  # (b, h, sq, d)
    assert np.array_equal(got[..., :sk] != 0, keep), "forward: out != 0 is not the keep-mask"
    assert np.all(got[..., sk:] == 0)
    np.testing.assert_allclose(got[..., :sk][keep], want[keep], rtol=2 * ULP[dtype])
    with np.errstate(divide="ignore"):
        assert_lse(host(lse), np.broadcast_to(np.log(n), (b, h, sq)), rtol=1e-4, atol=1e-3)
    # dv[b, j, g, c] = sum over the heads of group g of Z_cj / (n_c (1 - p)): the backward's mask
    want_dv = want.reshape(b, hk, h // hk, sq, sk).sum(axis=2)  # (b, hk, c, j)
    got_dv = np.transpose(host(grads[2]), (0, 2, 3, 1))         # (b, hk, c, j)
    assert np.array_equal(got_dv[:, :, :sq] != 0, want_dv != 0), "backward: not the keep-mask"
    assert np.all(got_dv[:, :, sq:] == 0)
    np.testing.assert_allclose(got_dv[:, :, :sq], want_dv, rtol=4 * ULP[dtype])
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_kept_fraction_of_a_large_case(p):
    """16.8M elements (32 batch-heads, 2048 rows): 1 - p of them kept within 0.01, and the mask
    equal to the CPU's bit for bit."""
    b, sq, sk, h, d = 4, 2048, 256, 8, 256
    q, k, v, _ = identity_problem(b, sq, sk, h, h, d, "float16")
    out = flashdl.attention(q, k, v, schedule="fa2", dropout_p=p, seed=1234, offset=9)
    kept = out[..., :sk] != 0  # (b, sq, h, sk)
    assert abs(kept.float().mean().item() - (1 - p)) <= 0.01
    want = flashdl.dropout_mask(b, h, sq, sk, p, 1234, 9)
    assert np.array_equal(kept.transpose(1, 2).cpu().numpy(), want)


DROPOUT_CASES = [  # (b, sq, sk, h, hk, d, causal, window, p)
    (2, 97, 130, 4, 2, 64, False, (-1, -1), 0.17),  # GQA, sq < sk, ragged tiles
    (1, 200, 150, 4, 1, 128, True, (-1, -1), 0.5),  # MQA, causal: 50 rows see nothing
    (1, 130, 257, 2, 2, 256, False, (32, 8), 0.1),  # sliding window
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DROPOUT_CASES, ids=lambda c: "b{}-sq{}-sk{}-h{}/{}-d{}".format(
    *c[:6]) + ("-causal" if c[6] else "") + "-w{}_{}-p{}".format(*c[7], c[8]))
def test_dropout_matches_the_oracle(case, dtype, variant):
    b, sq, sk, h, hk, d, causal, window, p = case
    schedule, det = VARIANTS[variant]
    q, k, v, dout = problem(case, b, sq, sk, h, hk, d, dtype)
    opts = dict(causal=causal, window_size=window, dropout_p=p, seed=seed_of(case), offset=3)
    got = run(*on_gpu((q, k, v, dout), dtype), schedule, det, **opts)
    check_dropout(got, q, k, v, dout, dtype, p, opts["seed"], 3, causal, window)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_fa1_and_fa2_agree(dtype):
    """The same stream gives both schedules the same mask: they differ by rounding only, within
    the rule's bound around each other."""
    b, sq, sk, h, hk, d, p = 2, 160, 200, 4, 2, 128, 0.25
    q, k, v, dout = problem("agree", b, sq, sk, h, hk, d, dtype)
    opts = dict(causal=True, dropout_p=p, seed=77, offset=2)
    arrays = on_gpu((q, k, v, dout), dtype)
    fa1, fa2 = run(*arrays, "fa1", **opts), run(*arrays, "fa2", **opts)
    low, plain = forward(q, k, v, True, dtype=dtype, exact=False)[0], forward(q, k, v, True)[0]
    assert_dropout_rule(fa1[0], fa2[0], max_err(low, plain), dtype, p, what="out fa1 vs fa2")
    assert_lse(fa1[1], fa2[1], rtol=1e-4, atol=1e-4)
    exact = backward(dout, q, k, v, True)
    naive = backward(dout, q, k, v, True, dtype=dtype, exact=False)
    for name, a, c, e, n in zip(("dq", "dk", "dv"), fa1[2:], fa2[2:], exact, naive):
        assert_dropout_rule(a, c, max_err(n, e), dtype, p, factor=3.0, what=name + " fa1 vs fa2",
                            magnitude=grad_magnitude(fa2[2:]), grad=True)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_autograd_with_dropout(dtype, schedule):
    import flashdl.torch as fdt

    b, sq, sk, h, hk, d = 2, 97, 130, 4, 2, 64
    q, k, v, dout = problem("autograd", b, sq, sk, h, hk, d, dtype)
    leaves = [x.requires_grad_() for x in on_gpu((q, k, v), dtype)]
    opts = dict(causal=True, dropout_p=0.25, seed=4242, offset=6)
    out = fdt.attention(*leaves, schedule=schedule, **opts)
    out.backward(on_gpu((dout,), dtype)[0])
    for x in leaves:
        assert x.grad.device == x.device and x.grad.dtype == x.dtype
    got = [host(out), None] + [host(x.grad) for x in leaves]
    check_dropout(got, q, k, v, dout, dtype, 0.25, 4242, 6, causal=True)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_torch_autograd_carries_the_drawn_seed(schedule):
    """seed=None: drawn from torch's generator (torch.manual_seed repeats it) and reused by the
    backward. On the identity problem out shows the forward's mask and dv the backward's."""
    import flashdl.torch as fdt

    b, s, h, d = 2, 64, 4, 64

    def once():
        q, k, v, dout = identity_problem(b, s, s, h, h, d, "float16")
        for x in (q, k, v):
            x.requires_grad_()
        out = fdt.attention(q, k, v, schedule=schedule, dropout_p=0.4)
        out.backward(dout)
        torch.cuda.current_stream().synchronize()
        return out.detach(), v.grad

    torch.manual_seed(0)
    out, dv = once()
    forward_mask = np.swapaxes(host(out), 1, 2) != 0            # (b, h, i, j)
    backward_mask = np.transpose(host(dv), (0, 2, 3, 1)) != 0   # dv (b, j, h, i) -> (b, h, i, j)
    assert np.array_equal(forward_mask, backward_mask), "the backward used another mask"
    assert 0.5 < forward_mask.mean() < 0.7
    torch.manual_seed(0)
    again = once()
    assert torch.equal(again[0], out) and torch.equal(again[1], dv)
    assert not torch.equal(once()[0], out), "the generator moved on: another seed, another mask"


# ---- block-sparse --------------------------------------------------------------------------------
def nblocks(n, block):
    return -(-n // block)


def pair(block):
    return (block, block) if isinstance(block, int) else block


def expand(mask, b, h, sq, sk, block):
    """The element mask (b, h, sq, sk) of a block mask (rank 2 or 4; size-1 dims broadcast)."""
    bq, bk = pair(block)
    m = np.repeat(np.repeat(mask, bq, axis=-2), bk, axis=-1)[..., :sq, :sk]
    return np.broadcast_to(m, (b, h, sq, sk))


def mask_of(rng, kind, b, h, nbq, nbk, density):
    """(host mask, the CUDA mask flashdl gets). stride0: (b, 1) expanded to (b, h) by torch, a
    head stride of 0; strided: (b, h) planes with padded rows (row stride nbk + 3)."""
    lead = {"shared": (), "full": (b, h), "heads": (1, h), "batch": (b, 1), "stride0": (b, 1),
            "strided": (b, h)}[kind]
    mask = rng.random(lead + (nbq, nbk)) < density
    dev = torch.from_numpy(mask).cuda()
    if kind == "stride0":
        dev = dev.expand(b, h, nbq, nbk)
    elif kind == "strided":
        buf = torch.zeros(b, h, nbq, nbk + 3, dtype=torch.bool, device="cuda")
        buf[..., :nbk] = dev
        dev = buf[..., :nbk]
    return mask, dev


BS_CASES = [  # (b, sq, sk, h, hk, d, block_size, mask kind, density, causal)
    (2, 200, 260, 4, 2, 64, 48, "full", 0.5, False),           # GQA, a plane per (batch, head)
    (1, 300, 300, 4, 1, 128, 100, "heads", 0.5, True),         # MQA, causal, (1, h, ...)
    (2, 257, 190, 2, 2, 64, (64, 96), "batch", 0.6, False),    # (b, 1, ...)
    (1, 130, 400, 4, 2, 128, (32, 80), "shared", 0.5, True),   # rank 2, causal, sq < sk
    (2, 150, 170, 2, 1, 64, 64, "stride0", 0.5, False),        # blocks = the fa2 tile
    (2, 100, 140, 2, 2, 128, (16, 48), "strided", 0.5, True),  # blocks smaller than a tile
]


@functools.lru_cache(maxsize=32)
def masked_oracle(case, dtype):
    """Inputs, masks and the four oracles of a block-sparse case (shared by its variants)."""
    b, sq, sk, h, hk, d, block, kind, density, causal = case
    q, k, v, dout = problem(case, b, sq, sk, h, hk, d, dtype)
    bq, bk = pair(block)
    mask, dev_mask = mask_of(np.random.default_rng(seed_of(case)), kind, b, h, nblocks(sq, bq),
                             nblocks(sk, bk), density)
    em = expand(mask, b, h, sq, sk, block)
    return dict(inputs=(q, k, v, dout), dev_mask=dev_mask, emask=em,
                exact=forward(q, k, v, causal, mask=em),
                low=forward(q, k, v, causal, dtype=dtype, exact=False, mask=em)[0],
                grads=backward(dout, q, k, v, causal, mask=em),
                naive=backward(dout, q, k, v, causal, dtype=dtype, exact=False, mask=em))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", BS_CASES, ids=lambda c: "b{}-sq{}-sk{}-h{}/{}-d{}-blk{}-{}".format(
    *c[:6], str(c[6]).replace(" ", ""), c[7]) + ("-causal" if c[9] else ""))
def test_block_sparse_matches_the_oracle(case, dtype, variant):
    schedule, det = VARIANTS[variant]
    causal, hk = case[9], case[4]
    o = masked_oracle(case, dtype)
    out, lse, dq, dk, dv = run(*on_gpu(o["inputs"], dtype), schedule, det, causal=causal,
                               block_mask=o["dev_mask"], block_size=case[6])
    exact, exact_lse = o["exact"]
    assert_rule(out, exact, o["low"], dtype, what="out")
    assert_lse(lse, exact_lse, rtol=1e-4, atol=1e-3)
    mag = grad_magnitude(o["grads"])
    for name, g, w, n in zip(("dq", "dk", "dv"), (dq, dk, dv), o["grads"], o["naive"]):
        assert_rule(g, w, n, dtype, factor=3.0, what=name, grad=True, magnitude=mag)
    vis = visible(case[1], case[2], causal) & o["emask"]
    assert_exact_zeros(out, lse, dq, dk, dv, vis, hk)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("block", [64, 48, 100, (64, 96)], ids=str)
@pytest.mark.parametrize("poisoned", ["kv", "q"])
def test_zero_blocks_are_never_read(poisoned, block, variant):
    """Whole rows and columns of zero blocks give exact zeros. Then NaN in every k and v (or q)
    row that only zero blocks cover: a kernel that loaded such rows into a tile and masked them
    afterwards would still spread the NaN (0 * NaN is NaN in P V, dS K and dS^T Q), so the results
    must be bitwise those of the clean inputs."""
    schedule, det = VARIANTS[variant]
    b, sq, sk, h, hk, d = 2, 300, 330, 4, 2, 64
    bq, bk = pair(block)
    nbq, nbk = nblocks(sq, bq), nblocks(sk, bk)
    rng = np.random.default_rng(seed_of("zero", block))
    mask = rng.random((b, h, nbq, nbk)) < 0.6
    mask[:, :, 1, :] = False   # query block 1 sees nothing, in every head
    mask[:, :, :, 2] = False   # key block 2 is seen by no query
    mask[:, :, :, -1] = False  # nor is the ragged last key block
    q, k, v, dout = on_gpu(problem("zero", b, sq, sk, h, hk, d, "float16"), "float16")
    opts = dict(block_mask=torch.from_numpy(mask).cuda(), block_size=block)
    clean = run(q, k, v, dout, schedule, det, **opts)
    assert_exact_zeros(*clean, expand(mask, b, h, sq, sk, block), hk)

    dead_q = torch.from_numpy(np.arange(sq) // bq == 1).cuda()
    dead_k = torch.from_numpy(np.isin(np.arange(sk) // bk, (2, nbk - 1))).cuda()
    qp, kp, vp = q.clone(), k.clone(), v.clone()
    if poisoned == "q":
        qp[:, dead_q] = float("nan")
    else:
        kp[:, dead_k] = float("nan")
        vp[:, dead_k] = float("nan")
    dirty = run(qp, kp, vp, dout, schedule, det, **opts)
    for name, a, c in zip(("out", "lse", "dq", "dk", "dv"), dirty, clean):
        assert_same_run(name, a, c, schedule, det, f"a zero block was read (NaN in {poisoned})")


@pytest.mark.parametrize("variant", VARIANTS)
def test_block_sparse_with_dropout(variant):
    schedule, det = VARIANTS[variant]
    b, sq, sk, h, hk, d, block, p = 2, 150, 200, 4, 2, 64, (48, 80), 0.2
    q, k, v, dout = problem("bs-dropout", b, sq, sk, h, hk, d, "float16")
    rng = np.random.default_rng(5)
    mask, dev_mask = mask_of(rng, "full", b, h, nblocks(sq, 48), nblocks(sk, 80), 0.5)
    opts = dict(causal=True, dropout_p=p, seed=606, offset=1, block_mask=dev_mask,
                block_size=block)
    got = run(*on_gpu((q, k, v, dout), "float16"), schedule, det, **opts)
    check_dropout(got, q, k, v, dout, "float16", p, 606, 1, causal=True,
                  mask=expand(mask, b, h, sq, sk, block))


# ---- deterministic=True --------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("feature", ["dropout", "block_mask", "both", "score_mods"])
def test_deterministic_is_bitwise(feature, schedule):
    """out, lse, dq, dk, dv bitwise equal over 20 more calls (fa2: dq by its deterministic pass)."""
    b, sq, sk, h, hk, d = 2, 500, 600, 4, 2, 128
    q, k, v, dout = on_gpu(problem("det", b, sq, sk, h, hk, d, "float16"), "float16")
    opts = dict(causal=True, schedule=schedule)
    if feature in ("dropout", "both"):
        opts.update(dropout_p=0.15, seed=99, offset=1)
    if feature in ("block_mask", "both"):
        rng = np.random.default_rng(6)
        opts.update(block_mask=mask_of(rng, "full", b, h, nblocks(sq, 48), nblocks(sk, 48), 0.5)[1],
                    block_size=48)
    if feature == "score_mods":
        opts.update(alibi_slopes=torch.from_numpy(slopes_of("batch", b, h)).cuda(), softcap=3.0)

    def once():
        out, lse = flashdl.attention(q, k, v, return_lse=True, **opts)
        return (out, lse) + flashdl.attention_backward(dout, q, k, v, out, lse,
                                                       deterministic=True, **opts)

    first = once()
    assert all(torch.isfinite(x).all() for x in first[2:])
    for _ in range(20):
        assert all(torch.equal(a, c) for a, c in zip(once(), first))



# ---- score modifiers (softcap, ALiBi) ------------------------------------------------------------
def slopes_of(kind, b, h):
    """float32 ALiBi slopes: "heads" (h,), "batch" (b, h). Powers of two, one 0 among them (a head
    with no bias); per batch shifted and scaled."""
    base = np.array([0.5, 0.125, 0.0, 0.03125], dtype=np.float32)
    if kind == "heads":
        return base[np.arange(h) % 4]
    return np.stack([base[(np.arange(h) + i) % 4] * (1 + i) for i in range(b)]).astype(np.float32)


def naive_mods(q, k, v, dout, dtype, causal=False, window=(-1, -1), softcap=0.0, slopes=None):
    """(out, dq, dk, dv) of the naive algorithm in the input precision with the modifiers in
    flash-attn's order (scale, softcap, ALiBi, mask): float32 math from the 16-bit values, P and
    dP rounded, dS (times the cap's derivative 1 - tanh^2) rounded before dS K and dS^T Q, results
    rounded to dtype; dk, dv summed over each GQA group."""
    f = np.float32

    def rnd(x):
        return np.asarray(x, f).astype(np_dtype(dtype)).astype(f)

    def heads(x, rep=1):  # (b, s, h, d) -> (b, h * rep, s, d)
        return np.repeat(np.swapaxes(np.asarray(x, f), 1, 2), rep, axis=1)

    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    qh, kh, vh, doh = heads(q), heads(k, g), heads(v, g), heads(dout)
    scale = f(1 / np.sqrt(d))
    s = np.matmul(qh, np.swapaxes(kh, -1, -2)) * scale
    gcap = np.ones_like(s)
    if softcap > 0:
        th = np.tanh(s / f(softcap))
        s, gcap = f(softcap) * th, 1 - th * th
    if slopes is not None:
        dist = np.abs(np.arange(sq)[:, None] + (sk - sq) - np.arange(sk)[None, :]).astype(f)
        s = s - np.broadcast_to(np.asarray(slopes, f), (b, h))[:, :, None, None] * dist
    s = np.where(visible(sq, sk, causal, window), s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    e = np.exp(s - np.where(np.isfinite(m), m, 0))
    l = e.sum(axis=-1, keepdims=True)
    p = rnd(e / np.where(l > 0, l, 1))
    o = rnd(np.matmul(p, vh))
    dv = np.matmul(np.swapaxes(p, -1, -2), doh)
    dp = rnd(np.matmul(doh, np.swapaxes(vh, -1, -2)))
    ds = rnd(p * (dp - np.sum(doh * o, axis=-1, keepdims=True)) * gcap)
    dq = rnd(np.matmul(ds, kh) * scale)
    dk = np.matmul(np.swapaxes(ds, -1, -2), qh) * scale

    def group_sum(x):  # (b, h, sk, d) -> (b, sk, hk, d)
        return np.swapaxes(rnd(x.reshape(b, hk, g, sk, d).sum(axis=2)), 1, 2)

    return np.swapaxes(o, 1, 2), np.swapaxes(dq, 1, 2), group_sum(dk), group_sum(dv)


def reference_mods(q, k, v, dout, slopes, **opts):
    """out, lse, (dq, dk, dv) of the CPU's float64 schedule="reference" with the modifiers."""
    out, lse = flashdl.attention(q, k, v, schedule="reference", return_lse=True,
                                 alibi_slopes=slopes, **opts)
    grads = flashdl.attention_backward(dout, q, k, v, out, lse, schedule="reference",
                                       alibi_slopes=slopes, **opts)
    return out, lse, grads


MOD_CASES = [  # (b, sq, sk, h, hk, d, causal, window, softcap, alibi)
    (2, 97, 130, 4, 2, 64, False, (-1, -1), 2.0, None),      # softcap alone, GQA, no mask
    (2, 130, 97, 4, 4, 128, True, (-1, -1), 0.0, "heads"),   # ALiBi (h,), causal: 33 empty rows
    (2, 200, 257, 4, 1, 64, False, (32, 8), 0.0, "batch"),   # ALiBi (b, h), MQA, sliding window
    (1, 300, 300, 4, 2, 128, True, (-1, -1), 5.0, "heads"),  # both, causal
    (2, 1, 257, 4, 2, 256, False, (-1, -1), 1.0, "batch"),   # both, one query row
    (1, 600, 600, 2, 1, 96, False, (200, 100), 2.0, "batch"),  # both, unmasked blocks in a window
]


@functools.lru_cache(maxsize=16)
def mod_oracle(case, dtype):
    """Inputs, slopes, the reference and the naive results of a modifier case (its variants
    share them)."""
    b, sq, sk, h, hk, d, causal, window, softcap, alibi = case
    q, k, v, dout = problem(case, b, sq, sk, h, hk, d, dtype)
    slopes = None if alibi is None else slopes_of(alibi, b, h)
    opts = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse, grads = reference_mods(q, k, v, dout, slopes, **opts)
    naive = naive_mods(q, k, v, dout, dtype, causal, window, softcap, slopes)
    return dict(inputs=(q, k, v, dout), slopes=slopes, opts=opts, exact=(out, lse), grads=grads,
                naive=naive)


def check_mods(got, o, dtype, case):
    """got = (out, lse or None, dq, dk, dv) against a mod_oracle under the rule; exact zeros where
    a row sees no key or no query sees a key."""
    out, lse, dq, dk, dv = got
    b, sq, sk, h, hk = case[:5]
    exact, exact_lse = o["exact"]
    n_out, *n_grads = o["naive"]
    assert_rule(out, exact, n_out, dtype, what="out")
    if lse is not None:
        assert_lse(lse, exact_lse, rtol=1e-4, atol=1e-3)
    mag = grad_magnitude(o["grads"])
    for name, g, w, n in zip(("dq", "dk", "dv"), (dq, dk, dv), o["grads"], n_grads):
        assert_rule(g, w, n, dtype, factor=3.0, what=name, grad=True, magnitude=mag)
    if lse is not None:
        vis = np.broadcast_to(visible(sq, sk, case[6], case[7]), (b, h, sq, sk))
        assert_exact_zeros(out, lse, dq, dk, dv, vis, hk)


def cuda_slopes(slopes):
    return None if slopes is None else torch.from_numpy(slopes).cuda()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MOD_CASES, ids=lambda c: "b{}-sq{}-sk{}-h{}/{}-d{}".format(
    *c[:6]) + ("-causal" if c[6] else "") + "-w{}_{}".format(*c[7]) + "-cap{}-alibi{}".format(
    c[8], c[9]))
def test_score_mods_match_the_reference(case, dtype, variant):
    schedule, det = VARIANTS[variant]
    o = mod_oracle(case, dtype)
    got = run(*on_gpu(o["inputs"], dtype), schedule, det, alibi_slopes=cuda_slopes(o["slopes"]),
              **o["opts"])
    check_mods(got, o, dtype, case)


@pytest.mark.parametrize("variant", VARIANTS)
def test_zero_slopes_and_no_cap_change_nothing(variant):
    """All-zero slopes (and softcap=0) give bitwise the results of a call without them: every
    kernel keeps its unmodified arithmetic for a head with no modifier."""
    schedule, det = VARIANTS[variant]
    b, sq, sk, h, hk, d = 2, 150, 170, 4, 2, 64
    arrays = on_gpu(problem("zero-slopes", b, sq, sk, h, hk, d, "float16"), "float16")
    opts = dict(causal=True, window_size=(40, -1))
    plain = run(*arrays, schedule, det, **opts)
    zeros = torch.zeros(b, h, device="cuda", dtype=torch.float32)
    for a, c, name in zip(run(*arrays, schedule, det, alibi_slopes=zeros, softcap=0.0, **opts),
                          plain, ("out", "lse", "dq", "dk", "dv")):
        assert_same_run(name, a, c, schedule, det, "zero slopes changed the result")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_score_mods_varlen(schedule):
    """One launch for the packed batch with (sequences, nheads) slopes and a softcap: sequence b
    takes slope row b. Equal to each sequence alone with its row of slopes (bitwise for fa2; fa1
    sizes its tiles from max_seqlen, so within float16 rounding), and the packed results meet the
    rule against the reference."""
    lens = [(5, 5), (0, 4), (70, 130), (3, 0), (129, 64), (1, 1)]
    h, hk, d, softcap = 4, 2, 64, 2.0
    rng = np.random.default_rng(17)
    sq, sk = [a for a, _ in lens], [c for _, c in lens]
    q, dout = (f64(make(rng, (sum(sq), h, d), "float16")) for _ in range(2))
    k, v = (f64(make(rng, (sum(sk), hk, d), "float16")) for _ in range(2))
    cq = np.concatenate([[0], np.cumsum(sq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(sk)]).astype(np.int32)
    mq, mk = max(sq), max(sk)
    slopes = slopes_of("batch", len(lens), h)
    opts = dict(causal=True, window_size=(48, -1), softcap=softcap, schedule=schedule)
    tq, tk, tv, tdo = (torch.tensor(x, device="cuda", dtype=torch.float16) for x in (q, k, v, dout))
    tcq, tck, ts = (torch.from_numpy(x).cuda() for x in (cq, ck, slopes))
    out, lse = flashdl.attention_varlen(tq, tk, tv, tcq, tck, mq, mk, return_lse=True,
                                        alibi_slopes=ts, **opts)
    grads = flashdl.attention_varlen_backward(tdo, tq, tk, tv, out, lse, tcq, tck, mq, mk,
                                              alibi_slopes=ts, deterministic=True, **opts)
    torch.cuda.synchronize()

    def same(a, c, what):
        if schedule == "fa2":
            assert torch.equal(a, c), what
        else:
            torch.testing.assert_close(a.float(), c.float(), atol=4e-3, rtol=2e-3, msg=what)

    for b in range(len(lens)):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        one = (tq[None, rq], tk[None, rk], tv[None, rk], tdo[None, rq])
        o1, l1 = flashdl.attention(*one[:3], return_lse=True, alibi_slopes=ts[b:b + 1], **opts)
        g1 = flashdl.attention_backward(one[3], *one[:3], o1, l1, alibi_slopes=ts[b:b + 1],
                                        deterministic=True, **opts)
        same(out[rq], o1[0], f"out of sequence {b}")
        same(lse[:, rq], l1[0], f"lse of sequence {b}")
        for name, g, w, rows in (("dq", grads[0], g1[0], rq), ("dk", grads[1], g1[1], rk),
                                 ("dv", grads[2], g1[2], rk)):
            same(g[rows], w[0], f"{name} of sequence {b}")
        # sequence b against the float64 reference with slope row b
        if sq[b] == 0 or sk[b] == 0:
            continue
        seq = tuple(x[None] for x in (q[rq], k[rk], v[rk], dout[rq]))
        ref_opts = dict(causal=True, window_size=(48, -1), softcap=softcap)
        r_out, r_lse, r_grads = reference_mods(*seq, slopes[b:b + 1], **ref_opts)
        n_out, *n_grads = naive_mods(*seq, "float16", True, (48, -1), softcap, slopes[b:b + 1])
        assert_rule(host(out[rq])[None], r_out, n_out, "float16", what=f"out of sequence {b}")
        assert_lse(host(lse[:, rq])[None], r_lse, rtol=1e-4, atol=1e-3)
        mag = grad_magnitude(r_grads)
        for name, g, w, n, rows in zip(("dq", "dk", "dv"), grads, r_grads, n_grads, (rq, rk, rk)):
            assert_rule(host(g[rows])[None], w, n, "float16", factor=3.0, grad=True,
                        magnitude=mag, what=f"{name} of sequence {b}")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_autograd_with_score_mods(dtype, schedule):
    """flashdl.torch.attention carries the slopes and the cap to the backward."""
    import flashdl.torch as fdt

    case = (2, 97, 130, 4, 2, 64, True, (-1, -1), 3.0, "batch")
    o = mod_oracle(case, dtype)
    leaves = [x.requires_grad_() for x in on_gpu(o["inputs"][:3], dtype)]
    out = fdt.attention(*leaves, schedule=schedule, alibi_slopes=cuda_slopes(o["slopes"]),
                        **o["opts"])
    out.backward(on_gpu(o["inputs"][3:], dtype)[0])
    for x in leaves:
        assert x.grad.device == x.device and x.grad.dtype == x.dtype
    check_mods([host(out), None] + [host(x.grad) for x in leaves], o, dtype, case)


# ---- bias (dbias), boolean mask, sinks (dsinks): issue 28 ----------------------------------------
# flashdl.torch.attention on CUDA tensors against the same call on CPU float64 copies (the CPU
# schedule="reference"), through autograd: out, dq, dk, dv, dbias and dsinks within a tolerance of a
# few units of the storage type (the emulator tests in tests/cpp/cuda/test_cuda_extras.cpp apply
# flash-attn's rule; this checks the front end's path through the core on a real device).
EXTRA_CASES = [
    # (b, sq, sk, h, hk, d, causal, bias shape, mask shape, sinks)
    (2, 70, 150, 4, 2, 64, False, (2, 4, 70, 150), None, True),
    (2, 70, 150, 4, 2, 64, True, (1, 4, 1, 150), (2, 4, 70, 150), False),
    (1, 129, 257, 4, 4, 128, False, (1, 1, 129, 257), (1, 4, 1, 257), True),
]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", EXTRA_CASES, ids=lambda c: "b{}-sq{}-sk{}-h{}/{}-d{}".format(*c[:6]))
def test_bias_mask_sinks_match_the_cpu_reference(case, dtype, schedule):
    import flashdl.torch as ft
    b, sq, sk, h, hk, d, causal, bias_shape, mask_shape, with_sinks = case
    g = torch.Generator().manual_seed(seed_of("extras", case, dtype))
    tdt = getattr(torch, dtype)
    q, k, v = (torch.randn(shape, generator=g).to(tdt) for shape in
               ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))
    dout = torch.randn((b, sq, h, d), generator=g).to(tdt)
    bias = (torch.randn(bias_shape, generator=g) * 2).to(tdt)
    mask = torch.rand(mask_shape, generator=g) > 0.3 if mask_shape else None
    sinks = torch.randn(h, generator=g) if with_sinks else None

    def run_on(device, dt, sched):
        leaves = [x.to(device=device, dtype=dt).requires_grad_() for x in (q, k, v, bias)]
        s = sinks.to(device).requires_grad_() if sinks is not None else None
        out = ft.attention(*leaves[:3], bias=leaves[3], causal=causal, schedule=sched,
                           mask=mask.to(device) if mask is not None else None, sinks=s)
        grads = torch.autograd.grad(out, leaves + ([s] if s is not None else []),
                                    dout.to(device=device, dtype=dt))
        return [out.detach().double().cpu()] + [x.double().cpu() for x in grads]

    got = run_on("cuda", tdt, schedule)
    want = run_on("cpu", torch.float64, "reference")
    names = ["out", "dq", "dk", "dv", "dbias", "dsinks"]
    for name, a, w in zip(names, got, want):
        scale = max(1.0, float(w.abs().max()))
        tol = 8 * ULP[dtype] * scale * (1 if name == "out" else 4)
        assert torch.isfinite(a).all(), name
        assert float((a - w).abs().max()) <= tol, (name, float((a - w).abs().max()), tol)


@pytest.mark.parametrize("bias_shape", [(1, 4, 1, 150), (1, 1, 70, 150)])
def test_deterministic_broadcast_dbias(bias_shape):
    """deterministic=True with a bias broadcast over the batch and heads or rows: fa2, auto and fa1
    sum dbias in a kernel of its own (fa2_dbias.cuh), bitwise the same on every run and the CPU
    reference's within the rule above."""
    import flashdl.torch as ft
    b, sq, sk, h, hk, d = 2, 70, 150, 4, 2, 64
    g = torch.Generator().manual_seed(seed_of("det-dbias", bias_shape))
    q, k, v = (torch.randn(shape, generator=g).half() for shape in
               ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))
    dout = torch.randn((b, sq, h, d), generator=g).half()
    bias = (torch.randn(bias_shape, generator=g) * 2).half()

    def dbias(device, dt, sched, deterministic):
        leaves = [x.to(device=device, dtype=dt) for x in (q, k, v)]
        bb = bias.to(device=device, dtype=dt).requires_grad_()
        out = ft.attention(*leaves, bias=bb, causal=True, schedule=sched,
                           deterministic=deterministic)
        (grad,) = torch.autograd.grad(out, [bb], dout.to(device=device, dtype=dt))
        return grad.double().cpu()

    want = dbias("cpu", torch.float64, "reference", False)
    tol = 8 * ULP["float16"] * max(1.0, float(want.abs().max())) * 4
    for schedule in ("fa2", "fa1"):
        first = dbias("cuda", torch.float16, schedule, True)
        assert torch.equal(first, dbias("cuda", torch.float16, schedule, True)), schedule
        assert float((first - want).abs().max()) <= tol, schedule
    assert torch.equal(dbias("cuda", torch.float16, "auto", True),
                       dbias("cuda", torch.float16, "fa2", True))
