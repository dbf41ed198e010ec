"""`Ranks`: the context-parallel group as a step's code calls it.

Every collective a step runs under context parallelism (the rounds'
gathers, the log-sum-exp merges, the sums of the ranks' gradient parts)
goes through a `Ranks`, never through `torch.distributed` directly, so
that the memory planner can run one rank's steps alone on fake tensors
with `SimulatedRanks`: the same code, the same tensors allocated, and no
other process. What a step reads back as Python values (key intervals,
flags) comes through the methods that return Python values, which the
simulation answers from this rank's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


class Ranks:
    """The collectives of `group` (a `torch.distributed` process group; None: the default one)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def all_gather(self, outputs: list[torch.Tensor], t: torch.Tensor) -> None:
        dist.all_gather(outputs, t, group=self.group)

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        dist.all_reduce(t, op=op, group=self.group)

    def reduce_scatter(self, output: torch.Tensor, stacked: torch.Tensor) -> None:
        """Sum `stacked` [W, ...] over the ranks; rank r receives row r in
        `output` [1, ...]. `reduce_scatter_single` where this PyTorch has it
        (2.13 deprecates `reduce_scatter_tensor`, warning on every call)."""
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(output, stacked, group=self.group)

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        dist.broadcast(t, group_src=src, group=self.group)

    def all_to_all(self, output: torch.Tensor, t: torch.Tensor) -> None:
        dist.all_to_all_single(output, t, group=self.group)

    def ints(self, values: Sequence[int], device: torch.device) -> list[list[int]]:
        """Every rank's `values` (as many on every rank), in rank order."""
        mine = torch.tensor(list(values), dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(gathered, mine, group=self.group)
        return torch.stack(gathered).tolist()

    def object_from(self, obj: Any, src: int, device: torch.device) -> Any:
        """Rank `src`'s `obj` (picklable), on every rank."""
        sent = [obj]
        dist.broadcast_object_list(sent, group_src=src, group=self.group, device=device)
        return sent[0]


class SimulatedRanks(Ranks):
    """Rank `rank` of `size` ranks with no others, for the memory planner's
    run of one rank's steps on fake tensors (`longstraw.simulation`). A
    collective leaves its outputs as allocated (the shapes are what the
    simulation measures); the Python values of the other ranks are taken
    to be this rank's (the same intervals, the same flags), which is
    exact for a prompt without padding."""

    def __init__(self, rank: int, size: int) -> None:
        self.group, self.rank, self.size = None, rank, size

    def all_gather(self, outputs: list[torch.Tensor], t: torch.Tensor) -> None:
        pass

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        pass

    def reduce_scatter(self, output: torch.Tensor, stacked: torch.Tensor) -> None:
        pass

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        pass

    def all_to_all(self, output: torch.Tensor, t: torch.Tensor) -> None:
        pass

    def ints(self, values: Sequence[int], device: torch.device) -> list[list[int]]:
        return [list(values) for _ in range(self.size)]

    def object_from(self, obj: Any, src: int, device: torch.device) -> Any:
        return obj
