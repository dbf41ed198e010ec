"""Processes over gloo on the CPU, spawned from a test.

A worker `worker(rank, world, port, out)` calls `init(rank, world, port)`,
saves what it measured with `torch.save` to `out/rank{rank}.pt` and
destroys its process group; `spawn` returns those results in rank order,
so the assertions run in the test's own process. The spawned processes get
the parent's `sys.path` (multiprocessing's spawn), so they import the test
module and `helpers` as the parent does.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def init(rank: int, world: int, port: int) -> None:
    """One thread per process (the CI machine has two cores) and the gloo group."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )


def spawn(worker, world: int, tmp_path) -> list[dict]:
    """Every rank's results. gloo must be there: a missing backend fails, it is not skipped."""
    assert dist.is_available() and dist.is_gloo_available(), "torch.distributed with gloo is required"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(world, port, str(tmp_path)), nprocs=world, join=True)
    return [torch.load(os.path.join(tmp_path, f"rank{r}.pt"), weights_only=False) for r in range(world)]
