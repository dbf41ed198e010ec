"""`Ranks`: waiting for a collective on the CPU while looking for a failure another rank posted."""

from __future__ import annotations

import torch
import torch.distributed as dist

from longstraw.parallel.ranks import Ranks


class _Work:
    """A collective that completes at its third look, or when waited for."""

    def __init__(self) -> None:
        self.looks, self.waited = 0, False

    def is_completed(self) -> bool:
        self.looks += 1
        return self.looks > 3

    def wait(self) -> None:
        self.waited = True


class _LeftStore(Ranks):
    """Ranks whose store is gone: the rank hosting it finished its part of the collective and left."""

    def __init__(self) -> None:
        self.group, self.rank, self.size = None, 1, 2
        self.looked = 0

    def raise_posted(self) -> None:
        self.looked += 1
        raise dist.DistNetworkError("Connection reset by peer")


def test_a_store_that_left_hands_the_wait_to_the_collective():
    """A rank that polls the store while its collective finishes can find
    the store's rank gone (it sent its part and returned): the wait then
    lets the collective itself tell, instead of failing the step."""
    ranks, work = _LeftStore(), _Work()
    ranks._wait(work, torch.zeros(1))
    assert work.waited and ranks.looked == 1
