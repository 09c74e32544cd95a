"""flashdl.torch.ulysses_attention (all-to-all over the heads) with 2, 3 and 4 gloo processes,
and context_parallel_attention (Ulysses inside, ring across) on a 2 x 2 grid: the gathered
output, lse and gradients against single-process attention on the whole sequence by
flash-attn's rule (float64 oracle, flashdl in float32 as the low-precision baseline), with
causal masks, windows, GQA (kv heads split, or fewer than the ranks and repeated), packed
(varlen) sequences, ALiBi, softcap, block masks, seqlen_q != seqlen_k, and dropout whose mask
must equal the single-process one; the bytes each rank sent against the model; bad input
rejected with the same error on every rank. One spawned world per size, bounded in time."""

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
from flashdl import _torch_ulysses as _ulysses  # noqa: E402
from test_ring import assert_close  # noqa: E402

# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim), options, extras
U_CASES = [
    ((1, 24, 24, 12, 12, 8), dict(causal=True), {}),
    ((2, 24, 24, 12, 1, 8), dict(window_size=(5, 2), softcap=5.0), dict(alibi=(12,))),
    ((1, 24, 24, 12, 2, 8), dict(causal=True, window_size=(6, 0)), {}),
    ((1, 24, 24, 12, 12, 8), dict(causal=True, dropout_p=0.2, seed=7, offset=3), {}),
    ((2, 24, 24, 12, 12, 8), dict(dropout_p=0.15, seed=5, block_size=8),
     dict(alibi=(2, 12), block_mask=(2, 12, 3, 3))),
    ((1, 12, 24, 12, 12, 8), dict(causal=True), {}),
    ((1, 24, 24, 12, 12, 8), dict(causal=True, dropout_p=0.1, seed=11),
     dict(alibi=(3, 12), cu=[0, 5, 17, 24])),
]

# (batch, seqlen, nheads, nheads_kv, headdim, causal, layout, window_size) on 2 rings x 2 Ulysses
H_CASES = [
    (1, 32, 4, 1, 8, True, "zigzag", (-1, -1)),
    (2, 32, 4, 2, 8, True, "contiguous", (5, 0)),
    (1, 32, 4, 4, 8, False, "zigzag", (3, 6)),
]


def u_valid(case, world):
    h, hk = case[0][3], case[0][4]
    return h % world == 0 and (hk % world == 0 or world % hk == 0)


def u_inputs(i, dtype):
    """q, k, v, the loss weights, and the per-case options (ALiBi slopes, block mask,
    cu_seqlens) of case i, full size."""
    (b, sq, sk, h, hk, d), opts, extra = U_CASES[i]
    g = torch.Generator().manual_seed(100 + i)
    make = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    x = [make(b, sq, h, d), make(b, sk, hk, d), make(b, sk, hk, d), make(b, sq, h, d)]
    opts = dict(opts)
    if "alibi" in extra:
        opts["alibi_slopes"] = torch.rand(*extra["alibi"], generator=g) * 0.5
    if "block_mask" in extra:
        opts["block_mask"] = torch.rand(*extra["block_mask"], generator=g) < 0.7
    if "cu" in extra:
        x = [t.reshape(-1, *t.shape[2:]) for t in x]
        cu = torch.tensor(extra["cu"], dtype=torch.int32)
        opts.update(cu_seqlens_q=cu, cu_seqlens_k=cu)
    return x, opts


def _catch(fn):
    try:
        fn()
        return "no error"
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"


def _ulysses_checks(rank, world, out):
    for i, case in enumerate(U_CASES):
        if not u_valid(case, world):
            continue
        (q, k, v, w), opts = u_inputs(i, torch.float32)
        seq = 0 if "cu" in case[2] else 1
        shard = lambda t: ft.ring_shard(t, rank, world, "contiguous", dim=seq)  # noqa: E731
        local = [shard(t).requires_grad_() for t in (q, k, v)]
        o, lse = ft.ulysses_attention(*local, **opts, return_lse=True)
        sent = _ulysses.last_bytes_sent["forward"]
        (o * shard(w)).sum().backward()
        full = [ft.ring_unshard(t.detach(), layout="contiguous", dim=seq)
                for t in (o, *(x.grad for x in local))]
        full.append(ft.ring_unshard(lse, layout="contiguous", dim=seq + 1))
        out[i] = [t.numpy() for t in full] + [sent, _ulysses.last_bytes_sent["backward"]]
    z = torch.zeros(1, 4 if rank == 0 else 6, 12, 8)
    out["uneven"] = _catch(lambda: ft.ulysses_attention(z, z, z))
    z = torch.zeros(1, 4, 5, 8)
    out["heads"] = _catch(lambda: ft.ulysses_attention(z, z, z))
    z, z5 = torch.zeros(1, 4, 60, 8), torch.zeros(1, 4, 5, 8)
    out["kv heads"] = _catch(lambda: ft.ulysses_attention(z, z5, z5))
    z = torch.zeros(1, 4, 12, 8)
    bad = z[0] if rank == world - 1 else z  # one rank's mistake
    out["one rank"] = _catch(lambda: ft.ulysses_attention(bad, z, z))
    cu = torch.tensor([0, 3, 4 * world + 1], dtype=torch.int32)
    out["cu"] = _catch(lambda: ft.ulysses_attention(z[0], z[0], z[0], cu_seqlens_q=cu,
                                                    cu_seqlens_k=cu))
    singles = [dist.new_group([r]) for r in range(world)]  # collective: every rank, every group
    out["group"] = _catch(lambda: ft.ulysses_attention(z, z, z,
                                                       group=singles[(rank + 1) % world]))


def _hybrid_checks(rank, out):
    ring, uly = ft.context_parallel_groups(ring_size=2, ulysses_size=2)
    rr, ur = dist.get_rank(ring), dist.get_rank(uly)
    for i, case in enumerate(H_CASES):
        b, s, h, hk, d, causal, layout, window = case
        q, k, v, w = h_inputs(case, torch.float32)
        shard = lambda t: ft.context_parallel_shard(t, rr, 2, ur, 2, layout)  # noqa: E731
        local = [shard(t).requires_grad_() for t in (q, k, v)]
        o, lse = ft.context_parallel_attention(*local, ring_group=ring, ulysses_group=uly,
                                               causal=causal, window_size=window,
                                               layout=layout, return_lse=True)
        (o * shard(w)).sum().backward()
        full = [ft.context_parallel_unshard(t.detach(), ring, uly, layout)
                for t in (o, *(x.grad for x in local))]
        full.append(ft.context_parallel_unshard(lse, ring, uly, layout, dim=2))
        out[("hybrid", i)] = [t.numpy() for t in full]
    z = torch.zeros(1, 8, 4, 8)
    out["same group"] = _catch(lambda: ft.context_parallel_attention(
        z, z, z, ring_group=uly, ulysses_group=uly))
    out["grid"] = _catch(lambda: ft.context_parallel_groups(3, 2))


def _no_all_to_all(*args, **kwargs):
    raise RuntimeError("Backend gloo does not support alltoall")  # torch's gloo before 2.12


def _worker(rank, world, port, results_dir, without_all_to_all=False):
    init(rank, world, port)
    if without_all_to_all:  # the exchanges must fall back to point-to-point sends
        dist.all_to_all = _no_all_to_all
    out = {}
    try:
        _ulysses_checks(rank, world, out)
        if world == 4:
            _hybrid_checks(rank, out)
    except BaseException:
        dist.destroy_process_group()
        raise
    np.save(os.path.join(results_dir, f"rank{rank}.npy"), out, allow_pickle=True)
    finish()


def h_inputs(case, dtype):
    b, s, h, hk, d = case[:5]
    g = torch.Generator().manual_seed(sum(case[:5]))
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)  # noqa
    return make(b, s, h, d), make(b, s, hk, d), make(b, s, hk, d), make(b, s, h, d)


def u_reference(i, dtype):
    (q, k, v, w), opts = u_inputs(i, dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    if "cu_seqlens_q" in opts:
        cu = opts.pop("cu_seqlens_q")
        opts.pop("cu_seqlens_k")
        m = int(torch.diff(cu).max())
        o, lse = ft.attention_varlen(*leaves, cu, cu, m, m, **opts, return_lse=True)
    else:
        o, lse = ft.attention(*leaves, **opts, return_lse=True)
    (o * w).sum().backward()
    return [x.detach().double().numpy() for x in (o, *(t.grad for t in leaves), lse)]


def h_reference(case, dtype):
    q, k, v, w = h_inputs(case, dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = ft.attention(*leaves, causal=case[5], window_size=case[7], return_lse=True)
    (o * w).sum().backward()
    return [x.detach().double().numpy() for x in (o, *(t.grad for t in leaves), lse)]


NAMES = ["out", "dq", "dk", "dv", "lse"]


@pytest.mark.parametrize("world,without_all_to_all", [(2, False), (3, False), (4, False),
                                                       (3, True)])
def test_ulysses_and_hybrid_match_single_process(world, without_all_to_all):
    """Every rank's slice of out, dq, dk, dv and lse against the single-process call, the bytes
    sent against the model, and the errors. (3, True): a backend with no all-to-all (torch's gloo
    before 2.12), whose exchanges go by isend/irecv pairs."""
    with tempfile.TemporaryDirectory() as d:
        run_world(_worker, world, d, without_all_to_all)
        ranks = [np.load(os.path.join(d, f"rank{r}.npy"), allow_pickle=True).item()
                 for r in range(world)]
    for got in ranks:  # every rank raises, naming the argument
        assert "q: the shard length of q differs across ranks" in got["uneven"], got["uneven"]
        assert got["heads"].startswith("ValueError: q: nheads (5) must be a multiple"), got
        assert got["kv heads"].startswith("ValueError: k: nheads_kv (5)"), got["kv heads"]
        assert got["one rank"].startswith("ValueError: q:"), got["one rank"]
        assert got["cu"].startswith("ValueError: cu_seqlens_q:"), got["cu"]
        assert got["group"].startswith("ValueError: group:"), got["group"]
    checked = 0
    for i, case in enumerate(U_CASES):
        if not u_valid(case, world):
            continue
        checked += 1
        assert_close(case, world, NAMES, ranks[0][i][:5], u_reference(i, torch.float64),
                     u_reference(i, torch.float32))
        b, sq, sk, h, hk, d = case[0]
        hk_sent = hk if hk % world == 0 else world  # repeated up to one kv head per rank
        model = (world - 1) * b * (2 * sq * h + 2 * sk * hk_sent) * d * 4 // world ** 2
        assert all(r[i][5] == model and r[i][6] == model for r in ranks), (case, model)
    assert checked >= 5
    if world == 4:
        for got in ranks:
            assert got["same group"].startswith("ValueError: ulysses_group:"), got["same group"]
            assert got["grid"].startswith("ValueError: ring_size:"), got["grid"]
        for i, case in enumerate(H_CASES):
            assert_close(case, "2x2", NAMES, ranks[0][("hybrid", i)],
                         h_reference(case, torch.float64), h_reference(case, torch.float32))


def test_dropout_mask_is_the_single_process_one():
    """Dropout through the virtual batch, one rank at a time with no process group: rank r's
    heads of the whole sequence with the single-process call's mask (bit for bit)."""
    g = torch.Generator().manual_seed(3)
    b, s, h, d, world = 2, 12, 6, 8, 3
    q, k, v = (torch.randn(b, s, h, d, generator=g, dtype=torch.float64) for _ in range(3))
    ref = ft.attention(q, k, v, causal=True, dropout_p=0.4, seed=99, offset=2)
    per = h // world
    for r in range(world):
        heads = slice(r * per, (r + 1) * per)
        cu = _ulysses._virtual_cu(torch.arange(b + 1, dtype=torch.int32) * s, r, world)
        o = ft.attention_varlen(*(x[:, :, heads].reshape(b * s, per, d) for x in (q, k, v)),
                                cu, cu, s, s, causal=True, dropout_p=0.4, seed=99, offset=2)
        assert torch.equal(o.view(b, s, per, d), ref[:, :, heads]), r


def test_shards_and_errors_without_a_group():
    x = torch.arange(16).view(1, 16, 1, 1)
    parts = [ft.context_parallel_shard(x, r, 2, u, 2, "zigzag").flatten().tolist()
             for r in range(2) for u in range(2)]
    assert parts == [[0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11]]
    with pytest.raises(ValueError, match="^x: "):
        ft.context_parallel_shard(torch.zeros(1, 12, 1, 1), 0, 2, 0, 4, "zigzag")
    if not dist.is_initialized():
        q = torch.zeros(1, 4, 2, 8)
        with pytest.raises(RuntimeError, match="init_process_group"):
            ft.ulysses_attention(q, q, q)
        with pytest.raises(RuntimeError, match="init_process_group"):
            ft.context_parallel_attention(q, q, q, ring_group=None, ulysses_group=None)
