"""flashdl.torch.ring_attention on the CPU with gloo: 2, 3 and 4 processes (spawned on
localhost), zigzag and contiguous layouts, causal and not, GQA; the gathered output and
gradients against single-process attention on the whole sequence by flash-attn's rules (the
float64 oracle, and flashdl in float32 on the gathered sequence as the low-precision baseline);
uneven shards rejected with a clear error on every rank."""

import os
import socket
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import flashdl.torch as ft  # noqa: E402

CASES = [  # (batch, seqlen, nheads, nheads_kv, headdim, causal, layout)
    (2, 24, 4, 2, 16, True, "zigzag"),
    (1, 24, 2, 2, 32, False, "zigzag"),
    (2, 24, 4, 1, 16, True, "contiguous"),
    (1, 48, 2, 2, 8, False, "contiguous"),
]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inputs(case, dtype):
    b, s, h, hk, d, _, _ = case
    g = torch.Generator().manual_seed(sum(case[:5]))
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)  # noqa
    return make(b, s, h, d), make(b, s, hk, d), make(b, s, hk, d), make(b, s, h, d)


def _worker(rank, world, port, results_dir):
    torch.set_num_threads(1)
    os.environ["FLASHDL_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        out = {}
        for i, case in enumerate(CASES):
            causal, layout = case[5], case[6]
            q, k, v, w = inputs(case, torch.float32)
            local = [ft.ring_shard(x, rank, world, layout).requires_grad_()
                     for x in (q, k, v)]
            o, lse = ft.ring_attention(*local, causal=causal, layout=layout, return_lse=True)
            (o * ft.ring_shard(w, rank, world, layout)).sum().backward()
            full = [ft.ring_unshard(x.detach(), layout=layout) for x in
                    (o, local[0].grad, local[1].grad, local[2].grad)]
            full.append(ft.ring_unshard(lse, layout=layout, dim=2))
            if rank == 0:
                out[i] = [x.numpy() for x in full]
        # Uneven shards: every rank gets the error (no hang).
        try:
            n = 4 if rank == 0 else 6
            x = torch.zeros(1, n, 2, 8)
            ft.ring_attention(x, x, x, layout="contiguous")
            out["uneven"] = "no error"
        except ValueError as e:
            out["uneven"] = str(e)
        if rank == 0:
            np.save(os.path.join(results_dir, "results.npy"), out, allow_pickle=True)
        else:
            np.save(os.path.join(results_dir, f"uneven{rank}.npy"), out["uneven"],
                    allow_pickle=True)
    finally:
        dist.destroy_process_group()


def reference(case, dtype):
    """(out, dq, dk, dv, lse) of single-process flashdl attention on the whole sequence."""
    q, k, v, w = inputs(case, dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = ft.attention(*leaves, causal=case[5], return_lse=True)
    (o * w).sum().backward()
    return [x.detach().double().numpy() for x in (o, leaves[0].grad, leaves[1].grad,
                                                  leaves[2].grad, lse)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_matches_single_process(world):
    mp = pytest.importorskip("torch.multiprocessing")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, _free_port(), d), nprocs=world, join=True)
        got = np.load(os.path.join(d, "results.npy"), allow_pickle=True).item()
        uneven = [got["uneven"]] + [str(np.load(os.path.join(d, f"uneven{r}.npy"),
                                                allow_pickle=True)) for r in range(1, world)]
    for msg in uneven:
        assert "shard lengths differ across ranks" in msg, msg
    for i, case in enumerate(CASES):
        if case[1] % (world if case[6] == "contiguous" else 2 * world):
            continue  # this length does not shard evenly over `world` ranks
        exact = reference(case, torch.float64)
        low = reference(case, torch.float32)
        names = ["out", "dq", "dk", "dv", "lse"]
        for name, g, e, lo in zip(names, got[i], exact, low):
            err, base = np.abs(g - e).max(), np.abs(lo - e).max()
            assert err <= 2 * base + 1e-6 * max(1.0, np.abs(e).max()), (case, world, name, err,
                                                                        base)


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
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(NotImplementedError, match="window_size"):
        ft.ring_attention(q, q, q, window_size=(2, 0))
