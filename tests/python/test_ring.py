"""flashdl.torch.ring_attention on the CPU with gloo: 2, 3 and 4 processes (spawned on
localhost, bounded in time), zigzag and contiguous layouts, causal and not, sliding windows
(narrower and wider than a chunk, one- and two-sided), GQA; the gathered output, lse and
gradients against single-process attention on the whole sequence by flash-attn's rule (the
float64 oracle, and flashdl in float32 on the gathered sequence as the low-precision baseline);
the bytes each rank sent against the model; bad input rejected with the same error on every
rank. The chunk-pair geometry is checked against the global mask element by element."""

import os
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import flashdl.torch as ft  # noqa: E402
from dist_world import finish, init, run_world  # noqa: E402
from flashdl import _torch_ring as _ring  # noqa: E402
from flashdl._ring_plan import chunks_of, global_window, last_step, pair_block  # noqa: E402

CASES = [  # (batch, seqlen, nheads, nheads_kv, headdim, causal, layout, window_size)
    (2, 24, 4, 2, 16, True, "zigzag", (-1, -1)),
    (1, 24, 2, 2, 32, False, "zigzag", (-1, -1)),
    (2, 24, 4, 1, 16, True, "contiguous", (-1, -1)),
    (1, 48, 2, 2, 8, False, "contiguous", (-1, -1)),
    (1, 48, 2, 1, 8, True, "contiguous", (5, 0)),    # narrower than a chunk: one hop
    (1, 48, 2, 2, 8, True, "zigzag", (6, -1)),       # 1/8 of the sequence, causal
    (2, 24, 2, 2, 8, False, "zigzag", (3, 2)),       # two-sided
    (1, 48, 4, 2, 8, False, "contiguous", (7, 13)),  # wider than a chunk on the right
    (1, 24, 2, 2, 8, True, "zigzag", (0, 0)),        # the diagonal only
]


def inputs(case, dtype):
    b, s, h, hk, d = case[:5]
    g = torch.Generator().manual_seed(sum(case[:5]))
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)  # noqa
    return make(b, s, h, d), make(b, s, hk, d), make(b, s, hk, d), make(b, s, h, d)


def _catch(fn):
    try:
        fn()
        return "no error"
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"


def _worker(rank, world, port, results_dir):
    init(rank, world, port)
    out = {}
    try:
        for i, case in enumerate(CASES):
            causal, layout, window = case[5:]
            if case[1] % (world if layout == "contiguous" else 2 * world):
                continue  # this length does not shard evenly over `world` ranks
            q, k, v, w = inputs(case, torch.float32)
            local = [ft.ring_shard(x, rank, world, layout).requires_grad_()
                     for x in (q, k, v)]
            o, lse = ft.ring_attention(*local, causal=causal, layout=layout, window_size=window,
                                       return_lse=True)
            sent_fwd = _ring.last_bytes_sent["forward"]
            (o * ft.ring_shard(w, rank, world, layout)).sum().backward()
            full = [ft.ring_unshard(x.detach(), layout=layout) for x in
                    (o, local[0].grad, local[1].grad, local[2].grad)]
            full.append(ft.ring_unshard(lse, layout=layout, dim=2))
            out[i] = [x.numpy() for x in full] + [sent_fwd]
        x = torch.zeros(1, 4 if rank == 0 else 6, 2, 8)
        out["uneven"] = _catch(lambda: ft.ring_attention(x, x, x, layout="contiguous"))
        y = torch.zeros(1, 4, 2, 8)
        bad_q = y[0] if rank == world - 1 else y  # one rank's mistake
        out["one rank"] = _catch(lambda: ft.ring_attention(bad_q, y, y))
        out["window"] = _catch(lambda: ft.ring_attention(y, y, y, window_size=(-2, 0)))
        out["odd"] = _catch(lambda: ft.ring_attention(y[:, :3], y[:, :3], y[:, :3]))
    except BaseException:
        dist.destroy_process_group()
        raise
    np.save(os.path.join(results_dir, f"rank{rank}.npy"), out, allow_pickle=True)
    finish()


def reference(case, dtype):
    """(out, dq, dk, dv, lse) of single-process flashdl attention on the whole sequence."""
    q, k, v, w = inputs(case, dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = ft.attention(*leaves, causal=case[5], window_size=case[7], return_lse=True)
    (o * w).sum().backward()
    return [x.detach().double().numpy() for x in (o, leaves[0].grad, leaves[1].grad,
                                                  leaves[2].grad, lse)]


def assert_close(case, world, names, got, exact, low):
    """flash-attn's rule: the error against the float64 oracle at most twice that of flashdl in
    float32 on the whole sequence (plus a rounding floor); lse -inf rows must match exactly."""
    for name, g, e, lo in zip(names, got, exact, low):
        assert np.array_equal(np.isneginf(g), np.isneginf(e)), (case, world, name)
        g, e, lo = (np.where(np.isneginf(e), 0.0, x) for x in (g, e, lo))
        err, base = np.abs(g - e).max(), np.abs(lo - e).max()
        assert err <= 2 * base + 1e-6 * max(1.0, np.abs(e).max()), (case, world, name, err, base)


def expected_bytes(case, world):
    """The forward's bytes: K and V once per hop, as many hops as the farthest visible pair."""
    b, s, _, hk, d, causal, layout, window = case
    c = s // (world if layout == "contiguous" else 2 * world)
    return 2 * last_step(world, layout, c, *global_window(causal, window)) * b * (s // world) \
        * hk * d * 4


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_matches_single_process(world):
    with tempfile.TemporaryDirectory() as d:
        run_world(_worker, world, d)
        ranks = [np.load(os.path.join(d, f"rank{r}.npy"), allow_pickle=True).item()
                 for r in range(world)]
    for got in ranks:
        assert "q: the shard length differs across ranks (from 4 to 6)" in got["uneven"]
        assert got["one rank"].startswith("ValueError: q:"), got["one rank"]
        assert got["window"].startswith("ValueError: window_size:"), got["window"]
        assert "must be even" in got["odd"], got["odd"]
    checked = 0
    for i, case in enumerate(CASES):
        if i not in ranks[0]:
            continue
        checked += 1
        exact, low = reference(case, torch.float64), reference(case, torch.float32)
        assert_close(case, world, ["out", "dq", "dk", "dv", "lse"], ranks[0][i][:5], exact, low)
        assert max(r[i][5] for r in ranks) == expected_bytes(case, world), (case, world)
    assert checked >= 5


def test_pair_block_reproduces_the_global_mask():
    """Every chunk pair's sub-block and flashdl window select exactly the global mask's
    elements (flashdl's rule on the sub-block: visible iff
    i + sk - sq - left <= j <= i + sk - sq + right)."""
    windows = [(-1, -1), (0, 0), (1, 0), (2, 3), (0, 5), (7, 1), (3, -1), (-1, 2), (0, -1)]
    for c in (1, 2, 3, 5):
        for a in range(4):
            for b in range(4):
                for causal in (False, True):
                    for window in windows + [(c, 0), (c - 1, 0), (c + 1, 2)]:
                        left, right = global_window(causal, window)
                        want = {(i, j) for i in range(c) for j in range(c)
                                if a * c + i - left <= b * c + j <= a * c + i + right}
                        blk = pair_block(a, b, c, left, right)
                        got = set()
                        if blk is not None:
                            sq, sk = blk.q1 - blk.q0, blk.k1 - blk.k0
                            wl, wr = blk.window or (-1, -1)
                            assert wl >= -1 and wr >= -1
                            got = {(blk.q0 + i, blk.k0 + j) for i in range(sq) for j in range(sk)
                                   if (wl < 0 or j >= i + sk - sq - wl)
                                   and (wr < 0 or j <= i + sk - sq + wr)}
                            assert got, "a computed pair must see something"
                        assert got == want, (a, b, c, causal, window, blk)


def test_hops_follow_the_window():
    big = global_window(True, (-1, -1))
    assert last_step(4, "contiguous", 16, *big) == 3
    assert last_step(4, "contiguous", 16, *global_window(True, (15, 0))) == 1
    assert last_step(4, "contiguous", 16, *global_window(True, (17, 0))) == 2
    assert last_step(4, "contiguous", 16, *global_window(False, (0, 0))) == 0
    assert last_step(4, "zigzag", 16, *global_window(True, (3, 0))) == 3  # chunk 2W-1-r
    assert chunks_of(1, 4, "zigzag") == [1, 6]


def test_shard_unshard_round_trip_and_errors():
    x = torch.arange(2 * 12 * 3).reshape(2, 12, 3)
    for layout, world in (("zigzag", 3), ("contiguous", 4)):
        parts = [ft.ring_shard(x, r, world, layout) for r in range(world)]
        assert sum(p.shape[1] for p in parts) == 12
    zig = [ft.ring_shard(x, r, 3, "zigzag") for r in range(3)]
    assert torch.equal(zig[0][:, :2], x[:, 0:2]) and torch.equal(zig[0][:, 2:], x[:, 10:12])
    with pytest.raises(ValueError, match="multiple of 8"):
        ft.ring_shard(x, 0, 4, "zigzag")
    with pytest.raises(ValueError, match="layout"):
        ft.ring_shard(x, 0, 2, "striped")
    with pytest.raises(ValueError, match="window_size"):
        global_window(False, (-3, 0))
    with pytest.raises(TypeError, match="window_size"):
        global_window(False, 5)
    if not dist.is_initialized():
        q = torch.zeros(1, 4, 2, 8)
        with pytest.raises(RuntimeError, match="init_process_group"):
            ft.ring_attention(q, q, q)
