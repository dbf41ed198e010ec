"""Collectives of context parallelism besides attention: failures raised on every rank at once, gradients summed
over ranks, outputs gathered, replicated values broadcast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from longstraw.parallel.ranks import Ranks, raised_on_every_rank
from longstraw.runtime.prompt_state import PromptState


def raise_together(error: Exception | None, ranks: Ranks, device: torch.device) -> None:
    """Raise the error of the lowest rank that has one, on every rank.

    A check that reads this rank's share (`verify_state`, `check_finite`)
    can fail on one rank alone; raised there alone, it would leave the other
    ranks waiting in the step's next collective until the group's timeout.
    Every rank calls this at the same point of the step: a gather of one
    flag per rank finds the first failing rank, which sends its error to
    the others."""
    failing = [rank for rank, (failed,) in enumerate(ranks.ints([error is not None], device)) if failed]
    if not failing:
        return
    source = failing[0]
    error = ranks.object_from(error, source, device)
    if ranks.rank != source:
        error.add_note(f"longstraw: raised on rank {source} of the context-parallel group, and so on every rank")
    raise raised_on_every_rank(error)


@contextlib.contextmanager
def summed_over_ranks(leaves: Sequence[torch.Tensor], ranks: Ranks) -> Iterator[None]:
    """Gradients that each rank computes a part of inside this block (the
    reverse pass's rounds: each rank differentiates its own chunk) are
    summed over the group at its end; what the leaves' `.grad` held before
    it (the branches, every chunk every rank replays: the same on every
    rank) is counted once, the first rank's. The other ranks drop it on
    entry rather than keep a second copy of every gradient: each parameter
    gradient is reduced exactly once."""
    if not leaves:
        yield
        return
    if ranks.rank != 0:
        for leaf in leaves:
            leaf.grad = None
    yield
    for leaf, grad in zip(leaves, _summed([leaf.grad for leaf in leaves], leaves, ranks)):
        leaf.grad = grad


def summed_carry_grads(state: PromptState, position: int) -> None:
    """The gradients of the carries at `position` (the prompt's end), where
    each rank's branches added their part (branch rounds), summed over the
    ranks; the reverse pass starts from them on every rank."""
    grads = state.carry_grads
    slots = sorted(grads)
    summed = _summed([grads[i].get(position) for i in slots], [state.carry_at(i, position) for i in slots],
                     state.shard.ranks)
    for i, grad in zip(slots, summed):
        if grad is not None:
            grads[i][position] = grad


def _summed(
    tensors: Sequence[torch.Tensor | None], likes: Sequence[torch.Tensor], ranks: Ranks
) -> list[torch.Tensor | None]:
    """Each of `tensors` summed over the ranks (one all-reduce each), zeros
    for a rank that has none (None where no rank has one), so every rank
    calls the same collectives."""
    if not likes:
        return []
    held = [any(column) for column in zip(*ranks.ints([t is not None for t in tensors], likes[0].device))]
    out: list[torch.Tensor | None] = []
    for t, like, some in zip(tensors, likes, held):
        if not some:
            out.append(None)
            continue
        sent = torch.zeros_like(like) if t is None else t if t.is_contiguous() else t.contiguous()
        ranks.all_reduce(sent)
        out.append(sent)
    return out


def all_gathered(tensors: Sequence[torch.Tensor], ranks: Ranks) -> list[list[torch.Tensor]]:
    """Every rank's `tensors` (the same shapes on every rank), per rank in rank order."""
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(ranks.size)]
    for t in tensors:
        gathered = [torch.empty_like(t, memory_format=torch.contiguous_format) for _ in per_rank]
        ranks.all_gather(gathered, t.contiguous())
        for mine, got in zip(per_rank, gathered):
            mine.append(got)
    return per_rank


def replicate_from_first(tensors: Sequence[torch.Tensor | None], group: dist.ProcessGroup | None) -> None:
    """Give every rank the group's first rank's `tensors` (in place).

    Every rank computes the whole gradient, but on a GPU not bit for bit
    the same one: kernels that accumulate with atomics (attention's dQ,
    embedding backward) round in another order on each rank. Weights
    stepped with such gradients drift apart, and the next call would find
    them different (`check_replicated`); so the ranks take the first
    rank's gradient."""
    for t in tensors:
        if t is None:
            continue
        sent = t if t.is_contiguous() else t.contiguous()
        Ranks(group).broadcast(sent, 0)
        if sent is not t:
            t.copy_(sent)
