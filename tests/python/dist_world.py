"""Runs a worker function in W spawned processes that form a gloo process group on localhost,
bounded in time: a hang (a collective some rank never reaches) fails the test instead of
blocking the run."""

import datetime
import os
import socket
import time

import pytest

# Long enough for the slowest world on two loaded cores, short enough to fail a hang quickly.
WORLD_TIMEOUT_S = 120


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(rank, world, port):
    """Joins the gloo group of the world (one thread per process, flashdl's and torch's)."""
    import torch
    import torch.distributed as dist

    import flashdl

    torch.set_num_threads(1)
    flashdl.set_num_threads(1)
    os.environ["FLASHDL_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))


def finish():
    """Leaves the group and ends the process at once, skipping the interpreter's finalisation:
    with torch 2.13's gloo, a runloop thread may drop its last reference to a finished work
    (and the tensors it holds) while Python finalises, take the GIL, get exited and abort the
    process ("terminate called without an active exception"), about one run in five; the
    results are on disk by then. A barrier first: rank 0 hosts the group's TCP store, and a rank
    that ended while another was still creating a group through that store (new_group) failed the
    other with "Connection reset by peer" (seen once on two loaded cores)."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def run_world(worker, world, *args, timeout=WORLD_TIMEOUT_S):
    """worker(rank, world, port, *args) in `world` spawned processes; fails the test when a
    process raises or the world outlives `timeout` seconds (its processes are then killed)."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(worker, args=(world, _free_port()) + args, nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"a world of {world} processes did not finish in {timeout} s (a hang?)")
