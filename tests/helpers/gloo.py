"""Processes over gloo on the CPU, spawned from a test.

A worker `worker(rank, world, port, out)` calls `init(rank, world, port)`,
saves what it measured with `torch.save` to `out/rank{rank}.pt` and
destroys its process group; `spawn` returns those results in rank order,
so the assertions run in the test's own process. The processes are forked
from multiprocessing's fork server, which imports torch, longstraw and the
helpers once per test process (about 5 s of CPU that every spawned rank
paid before); they get the parent's `sys.path`, so they import the test
module and `helpers` as the parent does, and none inherits the parent's
state (its Dynamo caches, its process groups).
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


PRELOAD = ["torch", "torch.distributed", "transformers", "longstraw", "helpers.tiny_models", "helpers.harness"]
"""What the fork server imports before it forks a rank (a module that fails to import is left to the rank)."""


def spawn(worker, world: int, tmp_path) -> list[dict]:
    """Every rank's results. gloo must be there: a missing backend fails, it is not skipped."""
    assert dist.is_available() and dist.is_gloo_available(), "torch.distributed with gloo is required"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.set_forkserver_preload(PRELOAD)  # read when the server first starts
    mp.start_processes(_in_environment, args=(worker, dict(os.environ), world, port, str(tmp_path)), nprocs=world,
                       join=True, start_method="forkserver")
    return [torch.load(os.path.join(tmp_path, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _in_environment(rank: int, worker, environ: dict[str, str], world: int, port: int, out: str) -> None:
    """`worker` under the test's environment now (a fork server's ranks
    inherit the environment it started with, before a test's `setenv`)."""
    os.environ.clear()
    os.environ.update(environ)
    worker(rank, world, port, out)
