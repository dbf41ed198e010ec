"""`ChunkSchedule`: the prompt chunks of one group's capture and reverse pass.

Every question about those chunks is answered here, once: which chunks a
prompt of `prefix_len` positions is cut into (`chunks`), how context
parallelism deals them to `world` ranks (`shares`, `held`) and runs them
in rounds of one chunk per rank (`rounds`), and which of them the
planner's simulation runs (`sampled`). The runtime walks them, the
planner counts them and the positions a rank holds, the simulation runs
a sample of them, and `PromptShard` is dealt from them: all from the same
object, so they cannot disagree.
"""

from __future__ import annotations

import dataclasses
import functools

Chunk = tuple[int, int]
"""(offset, length) of a run of prompt positions."""


@dataclasses.dataclass(frozen=True)
class ChunkSchedule:
    """The chunks of `size` positions (the last may be shorter) of a
    `prefix_len`-position prompt, dealt to `world` ranks."""

    prefix_len: int
    size: int
    world: int = 1

    @functools.cached_property
    def chunks(self) -> tuple[Chunk, ...]:
        return tuple((o, min(self.size, self.prefix_len - o)) for o in range(0, self.prefix_len, self.size))

    @property
    def count(self) -> int:
        """`len(chunks)`, without building them (the planner asks for prompts of any length)."""
        return -(-self.prefix_len // self.size)

    @functools.cached_property
    def shares(self) -> tuple[tuple[Chunk, ...], ...]:
        """Each rank's chunks, in position order: dealt out in rounds of
        `world`, every other round in reverse rank order (0, 1, ..., W-1,
        W-1, ..., 1, 0, ...).

        A rank's attention work over earlier keys is, per position it holds,
        the number of queries after it: with contiguous shares rank 0 would
        do 3/4 of it at W = 2. Dealt this way, every pair of rounds gives
        each rank one chunk of the pair's earlier round and its mirror in
        the later, so with equal chunks the positions held and the work both
        differ by at most one round's worth (equal when the chunks are a
        multiple of 2W). A chunk is never split: a step's own positions live
        on one rank."""
        held: list[list[Chunk]] = [[] for _ in range(self.world)]
        for i, chunk in enumerate(self.chunks):
            round_, seat = divmod(i, self.world)
            held[seat if round_ % 2 == 0 else self.world - 1 - seat].append(chunk)
        return tuple(tuple(h) for h in held)

    @property
    def held(self) -> list[int]:
        """How many prompt positions each rank holds."""
        return [sum(n for _, n in share) for share in self.shares]

    @property
    def largest_share(self) -> int:
        """The most prompt positions one rank holds."""
        return max(self.held)

    @property
    def largest_rank(self) -> int:
        """The (first) rank holding `largest_share`: the one the planner's per-rank peak is for."""
        held = self.held
        return held.index(max(held))

    def owner(self, chunk: Chunk) -> int:
        return next(rank for rank, share in enumerate(self.shares) if chunk in share)

    def rounds(self, chunks: tuple[Chunk, ...] | None = None) -> tuple[list[tuple[Chunk, ...]], list[Chunk]]:
        """Context parallelism's rounds of `chunks` (default: all), and the
        chunks after them. A round is `world` consecutive chunks, one per
        rank as `shares` deals them, run at once by the capture and the
        reverse pass; the chunks after the last whole round run on every rank."""
        chunks = self.chunks if chunks is None else chunks
        whole = len(chunks) // self.world * self.world
        return [chunks[first:first + self.world] for first in range(0, whole, self.world)], list(chunks[whole:])

    def sampled(self, in_rounds: bool) -> tuple[Chunk, ...]:
        """The chunks the planner's simulation runs, those whose memory can
        differ: the first (no earlier positions, no carry gradient in the
        reverse pass) and the last two, adjacent so that a carry's gradient
        passes between them as in every other pair (the last may be
        shorter; the one before it is then the longest chunk with the most
        earlier positions). `in_rounds` (one rank of `world > 1` running its
        steps in rounds): the chunks of the first round and of the last two
        (whole rounds, so each keeps its chunks' owners), and the chunks
        after the last round, which every rank runs."""
        chunks = self.chunks
        if self.world == 1 or not in_rounds:
            return chunks if len(chunks) <= 3 else (chunks[0], *chunks[-2:])
        whole = len(chunks) // self.world * self.world
        if whole <= 3 * self.world:
            return chunks
        return (*chunks[:self.world], *chunks[whole - 2 * self.world:])
