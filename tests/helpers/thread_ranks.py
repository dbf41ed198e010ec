"""Ranks as threads of the test's own process: a `Ranks` whose collectives
meet in shared memory, for the code around context parallelism's
collectives in milliseconds (a gloo process takes seconds to start).

`on_ranks(work)` runs `work(ranks)` on every rank at once and returns what
each returned or raised. Code that builds its own `Ranks(group)` finds the
calling thread's with `this_thread()` (monkeypatch the module's `Ranks`). A
rank left waiting in a collective that another rank never reaches raises
`threading.BrokenBarrierError` after `TIMEOUT` seconds instead of hanging.
"""

from __future__ import annotations

import functools
import pickle
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from longstraw.parallel.ranks import Ranks

T = TypeVar("T")
TIMEOUT = 5.0
_local = threading.local()


class ThreadRanks(Ranks):
    """Rank `rank` of the threads that share `meeting`."""

    def __init__(self, rank: int, meeting: _Meeting) -> None:
        self.group, self.rank, self.size = None, rank, meeting.size
        self.meeting = meeting

    def _exchange(self, value: T) -> list[T]:
        """Every rank's `value`, in rank order."""
        meeting = self.meeting
        meeting.values[self.rank] = value
        meeting.barrier.wait()
        every = list(meeting.values)
        meeting.barrier.wait()
        return every

    def all_gather(self, outputs: list[torch.Tensor], t: torch.Tensor) -> None:
        for output, sent in zip(outputs, self._exchange(t.clone())):
            output.copy_(sent)

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        combine = torch.maximum if op == dist.ReduceOp.MAX else torch.add
        t.copy_(functools.reduce(combine, self._exchange(t.clone())))

    def reduce_scatter(self, output: torch.Tensor, stacked: torch.Tensor) -> None:
        output.copy_(functools.reduce(torch.add, self._exchange(stacked.clone()))[self.rank:self.rank + 1])

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        t.copy_(self._exchange(t.clone())[src])

    def object_from(self, obj: Any, src: int, device: torch.device) -> Any:
        return pickle.loads(self._exchange(pickle.dumps(obj))[src])  # a copy, as over a process group

    def raise_posted(self) -> None:
        pass

    def post_failure(self, error: BaseException) -> None:
        pass


class _Meeting:
    def __init__(self, size: int) -> None:
        self.size = size
        self.values: list[Any] = [None] * size
        self.barrier = threading.Barrier(size, timeout=TIMEOUT)


def this_thread() -> ThreadRanks:
    """The calling rank's `ThreadRanks` (inside `on_ranks`)."""
    return _local.ranks


def on_ranks(work: Callable[[ThreadRanks], T], size: int = 2) -> list[T | BaseException]:
    """`work(ranks)` on `size` ranks at once: what each returned, or the exception it raised, in rank order."""
    meeting = _Meeting(size)

    def run(rank: int) -> T | BaseException:
        _local.ranks = ThreadRanks(rank, meeting)
        try:
            return work(_local.ranks)
        except Exception as error:  # noqa: BLE001 - handed to the test, which asserts on it
            return error

    with ThreadPoolExecutor(size) as pool:
        return list(pool.map(run, range(size)))


def same_on_every_rank(outcomes: Sequence[Any]) -> Any:
    """The one exception every rank raised (type and message alike), asserting that each raised it."""
    first = outcomes[0]
    assert isinstance(first, Exception), first
    for other in outcomes[1:]:
        assert type(other) is type(first) and str(other) == str(first), (first, other)
    return first
