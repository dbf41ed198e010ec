"""One process per rank for the context-parallel benchmarks: NCCL when every
rank has a GPU of its own, else gloo (over CUDA tensors on a shared GPU, or
on the CPU for smoke runs)."""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# NVLink multicast stays off in every process (the device machines' rule)
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def spawn(worker: Callable, world: int, *args) -> None:
    """`worker(rank, world, port, *args)` in `world` processes; returns when all have."""
    os.environ.update(MULTICAST_OFF)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(world, port, *args), nprocs=world, join=True)


def init_rank(rank: int, world: int, port: int) -> tuple[torch.device, str]:
    """Join the group: this rank's device (GPU `rank mod the GPUs there are`,
    or the CPU with one thread when there is none) and the backend used."""
    gpus = torch.cuda.device_count()
    if gpus:
        device = torch.device("cuda", rank % gpus)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    backend = "nccl" if gpus >= world else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600), device_id=device if backend == "nccl" else None)
    return device, backend


def agreed(decision: bool, device: torch.device) -> bool:
    """Rank 0's `decision`, on every rank: a choice made by the clock must be
    the same everywhere, or one rank would wait in a collective the others
    never call."""
    flag = torch.tensor([int(decision) if dist.get_rank() == 0 else 0], device=device)
    dist.broadcast(flag, group_src=0)
    return bool(flag)
