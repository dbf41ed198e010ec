"""This rank's share of the prompt positions (`PromptShard`), reading a sharded slot, and gathering a round's tensors."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from longstraw.parallel.ranks import Ranks
from longstraw.runtime.prompt_state import ChunkRound, StepContext


def by_rank(per_chunk: Sequence[torch.Tensor], round_: ChunkRound) -> torch.Tensor:
    """A round's per-chunk tensors (position order) stacked in the order of
    their chunks' ranks, for `merge_scattered` and a reduce-scatter."""
    return torch.stack([per_chunk[round_.owners.index(rank)] for rank in range(len(round_.owners))])


@dataclasses.dataclass(frozen=True)
class PromptShard:
    """This rank's share of the prompt positions: whole prompt chunks,
    assigned by `ChunkSchedule.shares` so that every rank holds about as many
    positions and computes about as much attention. The sequence buffers
    hold the share's chunks back to back in position order, so a buffer
    index ("local") grows with the position and the share's positions in
    any interval `[a, b)` are one run of buffer indices."""

    ranks: Ranks
    chunks: tuple[tuple[tuple[int, int], ...], ...]  # per rank: its chunks (offset, length), in position order

    @property
    def rank(self) -> int:
        return self.ranks.rank

    @property
    def size(self) -> int:
        """Positions this rank holds (the sequence buffers' length)."""
        return sum(length for _, length in self.chunks[self.rank])

    def owner(self, position: int) -> int:
        """The rank whose share holds `position` (a prompt position)."""
        return next(r for r, held in enumerate(self.chunks) if any(o <= position < o + n for o, n in held))

    def held_before(self, position: int) -> int:
        """How many of this rank's positions are before `position`: the
        buffer index of its first position at or after `position`."""
        return sum(min(n, max(position - o, 0)) for o, n in self.chunks[self.rank])

    def local_range(self, first: int, last: int) -> tuple[int, int]:
        """The buffer indices `[begin, end)` of this rank's positions in `[first, last)` (empty: begin == end)."""
        begin = self.held_before(first)
        return begin, max(begin, self.held_before(last))

    def to_global(self, local: torch.Tensor) -> torch.Tensor:
        """The prompt positions of buffer indices `local` (an integer tensor)."""
        starts, offsets = self._runs(local.device)
        run = torch.searchsorted(starts, local, right=True) - 1
        return local - starts[run] + offsets[run]

    def to_local(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffer indices of prompt `positions` and whether this rank holds
        them (the index is 0 where it does not)."""
        starts, offsets = self._runs(positions.device)
        lengths = torch.tensor([n for _, n in self.chunks[self.rank]] or [0], device=positions.device)
        run = (torch.searchsorted(offsets, positions, right=True) - 1).clamp(min=0)
        inside = positions - offsets[run]
        held = (inside >= 0) & (inside < lengths[run])
        return torch.where(held, starts[run] + inside, 0), held

    def _runs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per chunk of this rank: its first buffer index and its first position."""
        held = self.chunks[self.rank] or ((0, 0),)
        starts = [sum(n for _, n in held[:i]) for i in range(len(held))]
        return torch.tensor(starts, device=device), torch.tensor([o for o, _ in held], device=device)

    def broadcast_chunk(self, local: torch.Tensor, token_dim: int, offset: int, length: int) -> torch.Tensor:
        """Positions `[offset, offset+length)` (a prompt chunk) of a sharded
        tensor (`local` holds this rank's share), from its owner to every rank."""
        owner = self.owner(offset)
        if owner == self.rank:
            chunk = local.narrow(token_dim, self.held_before(offset), length).contiguous()
        else:
            shape = list(local.shape)
            shape[token_dim] = length
            chunk = torch.empty(shape, dtype=local.dtype, device=local.device)
        self.ranks.broadcast(chunk, owner)
        return chunk


class ShardKeys(Protocol):
    """Where a sharded attention's earlier keys and values live in the state."""

    @property
    def slot(self) -> int:
        """The state slot that names this attention (`attention_outputs_on_host` keeps its outputs under it)."""

    def read(self, step: StepContext, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [1, Hkv, end - begin, D] at buffer indices `[begin, end)` of this rank's share."""

    def accumulate(self, step: StepContext, grad_k: torch.Tensor, grad_v: torch.Tensor, local: int) -> None:
        """Add their gradients, from buffer index `local` on, to d(state)."""


@dataclasses.dataclass(frozen=True)
class SlotKeys:
    """Attention's keys and values: one sequence slot each."""

    k_slot: int
    v_slot: int

    @property
    def slot(self) -> int:
        return self.k_slot

    def read(self, step: StepContext, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(shard_positions(step, slot, begin, end) for slot in (self.k_slot, self.v_slot))

    def accumulate(self, step: StepContext, grad_k: torch.Tensor, grad_v: torch.Tensor, local: int) -> None:
        step.accumulate_shard_grad(self.k_slot, grad_k, local)
        step.accumulate_shard_grad(self.v_slot, grad_v, local)


def shard_positions(step: StepContext, slot: int, begin: int, end: int) -> torch.Tensor:
    """A sequence slot's buffer indices `[begin, end)` of this rank's share."""
    return step.state.buffers[slot].narrow(step.state.slots[slot].token_dim, begin, end - begin)


def padded_to(t: torch.Tensor, dim: int, length: int, fill: float = 0.0) -> torch.Tensor:
    """`t` padded with `fill` along `dim` to `length` (a round's shorter
    chunk for its gathers and merges, a short list of candidates)."""
    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, t.new_full(shape, fill)], dim)


def gather_round(t: torch.Tensor, dim: int, round_: ChunkRound, ranks: Ranks) -> list[torch.Tensor]:
    """Every rank's `t` (its chunk of the round along `dim`), in position order."""
    t = padded_to(t, dim, round_.longest).contiguous()
    gathered = [torch.empty_like(t) for _ in round_.chunks]
    ranks.all_gather(gathered, t)
    return [gathered[rank].narrow(dim, 0, n) for rank, (_, n) in zip(round_.owners, round_.chunks)]


def gathered_rows(
    q: torch.Tensor, grad_out: torch.Tensor, out: torch.Tensor, round_: ChunkRound, ranks: Ranks
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every chunk's queries, output gradients and outputs ([..., n, D],
    positions at -2) of a round, in one all-gather: what a round's backward
    needs where the keys are. Each chunk's are made contiguous as it is
    reached."""
    d, dv = q.shape[-1], out.shape[-1]
    for row in gather_round(torch.cat([q, grad_out.to(q.dtype), out], -1), -2, round_, ranks):
        yield tuple(row[..., a:b].contiguous() for a, b in ((0, d), (d, d + dv), (d + dv, d + 2 * dv)))


def shard_range(step: StepContext, first: int, last: int) -> tuple[int, int]:
    """The buffer indices of this rank's positions before the step and in
    `[first, last)` (empty: begin == end)."""
    return step.state.shard.local_range(first, min(last, step.offset))


def own_parts(step: StepContext, first: int, last: int) -> list[tuple[slice, int, tuple[int, int]]]:
    """The step's rows that see some of its own keys: (rows, the kernels'
    `q_start`, the own keys' local range). The keys `[a, b)` of the step
    (local, from `[first, last)`) are causal for the rows among them
    (`q_start` 0) and all seen by the rows after them (`q_start` b - a);
    rows before them see none."""
    n = step.length
    a, b = min(max(first - step.offset, 0), n), min(max(last - step.offset, 0), n)
    if b <= a:
        return []
    parts = [(slice(a, b), 0, (a, b))]
    if b < n:
        parts.append((slice(b, n), b - a, (a, b)))
    return parts
