"""`Ranks`: the context-parallel group as a step's code calls it.

Every collective a step runs under context parallelism (the rounds'
gathers, the log-sum-exp merges, the sums of the ranks' gradient parts)
goes through a `Ranks`, never through `torch.distributed` directly, so
that the memory planner can run one rank's steps alone on fake tensors
with `SimulatedRanks`: the same code, the same tensors allocated, and no
other process. What a step reads back as Python values (key intervals,
flags) comes through the methods that return Python values, which the
simulation answers from this rank's own.

A failure inside one rank's step (an exception its own share or its own
branch raises: a bad token id in the row it replays, out of memory)
would leave the others waiting in the step's next collective until the
group's timeout. The failing rank posts its error to the group's store
(`post_failure`, called at the runtime's boundary) and raises it; a rank
waiting in a collective on the CPU (gloo) looks for a posted error while
it waits and raises the same error (`_wait`), and every rank looks for
one before a call's first collective (`raise_posted`). The group's
collectives are out of step after such a failure, so every later call on
it raises the posted error too: make a new process group. On CUDA (NCCL)
the collectives do not block the CPU, so the other ranks wait for NCCL's
own timeout instead (the next call on the group still raises the posted
error).
"""

from __future__ import annotations

import contextlib
import pickle
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

FAILURE_KEY = "longstraw/failure"
"""The key of a posted failure in the group's store (under the group's prefix)."""

_POLL_SECONDS = 1e-3  # longest sleep between two looks at a collective and the store


class Ranks:
    """The collectives of `group` (a `torch.distributed` process group; None: the default one)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def all_gather(self, outputs: list[torch.Tensor], t: torch.Tensor) -> None:
        self._wait(dist.all_gather(outputs, t, group=self.group, async_op=True), t)

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        self._wait(dist.all_reduce(t, op=op, group=self.group, async_op=True), t)

    def reduce_scatter(self, output: torch.Tensor, stacked: torch.Tensor) -> None:
        """Sum `stacked` [W, ...] over the ranks; rank r receives row r in
        `output` [1, ...]. `reduce_scatter_single` where this PyTorch has it
        (2.13 deprecates `reduce_scatter_tensor`, warning on every call). On
        the CPU an all-reduce of a copy: gloo's reduce-scatter runs only in
        `wait()`, where no posted failure can be looked for."""
        if stacked.device.type == "cpu":
            summed = stacked.clone()
            self.all_reduce(summed)
            output.copy_(summed[self.rank:self.rank + 1])
            return
        scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        scatter(output, stacked, group=self.group)

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        self._wait(dist.broadcast(t, group_src=src, group=self.group, async_op=True), t)

    def all_to_all(self, output: torch.Tensor, t: torch.Tensor) -> None:
        self._wait(dist.all_to_all_single(output, t, group=self.group, async_op=True), t)

    def ints(self, values: Sequence[int], device: torch.device) -> list[list[int]]:
        """Every rank's `values` (as many on every rank), in rank order."""
        mine = torch.tensor(list(values), dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(self.size)]
        self.all_gather(gathered, mine)
        return torch.stack(gathered).tolist()

    def _wait(self, work: dist.Work, t: torch.Tensor) -> None:
        """Wait for a collective. On the CPU, look for a failure another rank
        posted while waiting, rather than block until the group's timeout."""
        if t.device.type != "cpu":
            work.wait()
            return
        pause = 1e-5
        while not work.is_completed():
            try:
                self.raise_posted()
            except dist.DistNetworkError:  # the store's rank finished its part and left: the collective tells
                break
            time.sleep(pause)
            pause = min(2 * pause, _POLL_SECONDS)
        work.wait()

    @property
    def _store(self) -> dist.Store:
        return dist.distributed_c10d._get_process_group_store(self.group or dist.group.WORLD)

    def post_failure(self, error: BaseException) -> None:
        """Tell the other ranks that `error` stopped this rank's step (the first post stands)."""
        try:
            payload = pickle.dumps((self.rank, error))
        except Exception:  # noqa: BLE001 - an error that does not pickle travels as its text
            payload = pickle.dumps((self.rank, RuntimeError(f"{type(error).__name__}: {error}")))
        self._store.compare_set(FAILURE_KEY, "", payload)

    def raise_posted(self) -> None:
        """Raise the error a rank of the group posted, if one did."""
        store = self._store
        if not store.check([FAILURE_KEY]):
            return
        source, error = pickle.loads(store.get(FAILURE_KEY))
        if source != self.rank:
            error.add_note(f"longstraw: raised on rank {source} of the context-parallel group inside its step, and "
                           f"so on rank {self.rank}; the group's collectives are out of step now: make a new process "
                           "group before calling the loss again")
        raise raised_on_every_rank(error)

    def object_from(self, obj: Any, src: int, device: torch.device) -> Any:
        """Rank `src`'s `obj` (picklable), on every rank."""
        sent = [obj]
        dist.broadcast_object_list(sent, group_src=src, group=self.group, device=device)
        return sent[0]


def raised_on_every_rank(error: BaseException) -> BaseException:
    """Mark `error` as one every rank raises at the same point (a check they
    agreed on, another rank's posted error): not a failure to post."""
    error.longstraw_shared = True
    return error


@contextlib.contextmanager
def posting_failures(ranks: Ranks | None) -> Iterator[None]:
    """Post an error raised inside this block to the other ranks, unless
    every rank raises it anyway (`raised_on_every_rank`)."""
    try:
        yield
    except Exception as error:
        if ranks is not None and not getattr(error, "longstraw_shared", False):
            ranks.post_failure(error)
        raise


class SimulatedRanks(Ranks):
    """Rank `rank` of `size` ranks with no others, for the memory planner's
    run of one rank's steps on fake tensors (`longstraw.planning.simulation`). A
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

    def post_failure(self, error: BaseException) -> None:
        pass

    def raise_posted(self) -> None:
        pass

    def object_from(self, obj: Any, src: int, device: torch.device) -> Any:
        return obj
