"""A group's branch steps: which rows each runs (`branch_turns`), where a
step stops because its rows' loss reads nothing after (`ReadLengths`,
`StepCut`, proved by `analysis/read_cut.py`), and whose outputs it
returns (`seated`). The forward and the backward walk the same turns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from longstraw.errors import LongStrawError
from longstraw.parallel.collectives import all_gathered
from longstraw.runtime.call_state import Group
from longstraw.runtime.prompt_state import ChunkRound, PromptState, StepContext, has_values


@dataclasses.dataclass(frozen=True)
class StepCut:
    """A branch step run over the first `length` of its positions
    (`analysis/read_cut.py`): its rows' loss reads only the first `needed`
    of the `reads` read positions, and each output comes back padded with
    zeros to all of them."""

    length: int
    needed: int
    reads: int

    def padded(self, outputs: Sequence[torch.Tensor], where: str) -> list[torch.Tensor]:
        """`outputs` (`[rows, reads, ...]`) padded back to `reads` positions."""
        out = []
        for o in outputs:
            if not self.needed <= o.shape[1] <= self.reads:
                raise LongStrawError(
                    f"{where}, cut to {self.length} positions, returned {o.shape[1]} read positions where its rows' "
                    f"loss reads {self.needed} of {self.reads}: please report this (a branch step the read-cut proof "
                    "accepted moved its positions)")
            tail = list(o.shape)
            tail[1] = self.reads - o.shape[1]
            out.append(torch.cat([o, o.new_zeros(tail)], 1) if tail[1] else o)
        return out


@dataclasses.dataclass(frozen=True)
class BranchTurn:
    """One branch step this rank runs: `row`. Under context parallelism's
    branch rounds (`round`) the ranks run `seats`, one row each, at once;
    a rank with no seat in a last, partial round runs the first seat's row
    again as a shadow (outputs dropped, gradient zero), to meet the others
    in the round's collectives. Elsewhere every rank runs every row, one
    at a time or (`rows`, `Options.branch_rows`) several in one step."""

    row: int
    seats: tuple[int, ...]
    round: ChunkRound | None = None
    rows: tuple[int, ...] = ()  # the rows one batched step runs, `row` first; empty: `row` alone
    cut: StepCut | None = None  # the step stops at its rows' last read position; None: it runs them all
    unread_from: tuple[int, ...] | None = None  # per step row, the position its loss reads nothing from (`read_cut.py`)

    @property
    def step_rows(self) -> tuple[int, ...]:
        """The rows the step holds."""
        return self.rows or (self.row,)

    def context(self, state: PromptState, start: int, positions: int, grad_enabled: bool) -> StepContext:
        """The step's context over the branch's `positions` from `start`, or the first of them its cut keeps."""
        length = positions if self.cut is None else self.cut.length
        return StepContext(state, start, length, grad_enabled=grad_enabled, round=self.round, rows=len(self.step_rows),
                           unread_from=self.unread_from)

    def padded(self, outputs: Sequence[torch.Tensor], where: str) -> Sequence[torch.Tensor]:
        """The step's outputs over every read position (`StepCut.padded` where it is cut)."""
        return outputs if self.cut is None else self.cut.padded(outputs, where)

    @property
    def shadow(self) -> bool:
        return self.round is not None and self.round.index >= len(self.seats)


# What one more branch step costs beside its positions, counted in positions:
# its launches, which pace a step at short prompts. Measured on an H100
# (dense slice, TRL's batch, each group's completions from 512 to 1,024):
# at 4K, steps of 4 rows (two a group, 14,088 positions) ran the exact step
# in 0.411 s, one of 8 (16,400) in 0.554 s, and the 2- and 3-row steps that
# 256 chose (13,318) in 0.481 s (`step_profile_rows4_finite_h100`,
# `step_profile_rows8_finite_h100`, `step_profile_syncs_h100`); at 2K the
# three came within 7% (0.353 to 0.379 s). At 640 the batch runs steps of 4.
STEP_POSITIONS = 640

# A cut step's length is rounded up to one of this many lengths: each new
# shape is a new CUDA graph of a carried operator's span (`carry.SpanGraphs`),
# a new cuDNN layout, a new autotuned kernel; 1/16 of R rounds off about 3%
# of a row's positions.
CUT_LENGTHS = 16


@dataclasses.dataclass(frozen=True)
class ReadLengths:
    """Per row of the batch, one past the last read position its loss reads
    (the scorer's masks), of `reads` read positions."""

    needed: tuple[int, ...]
    reads: int

    @classmethod
    def of(cls, masks: Sequence[torch.Tensor]) -> ReadLengths | None:
        """From the scorer's masks `[rows, reads]` on a call's inputs (a row
        reads a position any of them marks; one host copy); None without values."""
        read = None
        for mask in masks:
            read = mask != 0 if read is None else read | (mask != 0)
        if not has_values(read):
            return None
        reads = read.shape[1]
        last = (read * torch.arange(1, reads + 1, device=read.device)).amax(1)  # one past each row's last True
        return cls(tuple(last.tolist()), reads)

    def steps(self, rows: Sequence[int], per_step: int) -> list[tuple[int, ...]]:
        """`rows` longest read first, dealt into steps of `per_step`, so a step's rows end near each other."""
        order = sorted(rows, key=lambda r: -self.needed[r])
        return [tuple(order[i:i + per_step]) for i in range(0, len(order), per_step)]

    def rows_per_step(self, rows: Sequence[int], positions: int, most: int) -> int:
        """The rows per step, at most `most` (what memory allows), that run
        the fewest positions, a step counted as `STEP_POSITIONS` more: a
        group's rows in one step run to its longest row, one row per step
        runs each to its own."""
        def cost(k: int) -> int:
            steps = self.steps(rows, k)
            return sum(len(s) * self._length(s, positions) for s in steps) + len(steps) * STEP_POSITIONS
        return min(range(most, 0, -1), key=cost)

    def _length(self, rows: Sequence[int], positions: int) -> int:
        cut = self.cut(rows, positions)
        return positions if cut is None else cut.length

    def unread_from(self, rows: Sequence[int], start: int, positions: int) -> tuple[int, ...] | None:
        """Per row of `rows`, the first position (of a branch run over
        `positions` from `start`) from which its loss reads nothing: the
        read positions lie at the branch's end or before it, so a row's last
        read is at most `reads - needed` positions before that end. None
        where the branch is shorter than its read positions."""
        if positions < self.reads:
            return None
        return tuple(start + positions - self.reads + self.needed[r] for r in rows)

    def cut(self, rows: Sequence[int], positions: int) -> StepCut | None:
        """The cut of a step of `rows` over `positions` (of which the last
        `reads` give read positions), or None where it would save nothing."""
        needed = max(1, max(self.needed[r] for r in rows))
        quantum = max(1, positions // CUT_LENGTHS)
        length = min(positions, -(-(needed + positions - self.reads) // quantum) * quantum)
        return StepCut(length, needed, self.reads) if positions >= self.reads and length < positions else None


def branch_turns(state: PromptState, group: Group, branch_len: int, per_step: int, reads: ReadLengths | None,
                 rounds: bool) -> list[BranchTurn]:
    """The group's branch steps this rank runs, `per_step` rows each
    (the last step takes what is left); with `reads`, the rows longest
    read first, so a step's rows end near each other, and each step cut
    after its rows' last read position. Under context parallelism
    (where rounds apply) the rows are dealt in rounds of W, one per rank,
    each rank running its own (`StepContext.round`, `branches`: its
    queries travel to the ranks holding the prompt's keys and back, as
    in a prompt round, and nothing else is exchanged, since a branch
    reads no other branch), so the branches' per-position work divides;
    elsewhere every rank runs every row. `rounds`: the program runs rounds
    (`StepProgram.runs_rounds`)."""
    shard = state.shard
    if reads is not None:
        return [BranchTurn(rows[0], rows, rows=rows if len(rows) > 1 else (), cut=reads.cut(rows, branch_len),
                           unread_from=reads.unread_from(rows, group.prefix_len, branch_len))
                for rows in reads.steps(group.rows, per_step)]
    if per_step > 1:
        steps = [group.rows[i:i + per_step] for i in range(0, len(group.rows), per_step)]
        return [BranchTurn(rows[0], rows, rows=rows if len(rows) > 1 else ()) for rows in steps]
    if shard is None or not rounds:
        return [BranchTurn(row, (row,)) for row in group.rows]
    world, span = len(shard.chunks), (group.prefix_len, branch_len)
    turns = []
    for first in range(0, len(group.rows), world):
        seats = group.rows[first:first + world]
        round_ = ChunkRound((span,) * world, tuple(range(world)), shard.rank, branches=True)
        turns.append(BranchTurn(seats[shard.rank] if shard.rank < len(seats) else seats[0], seats, round_))
    return turns


def seated(
    turn: BranchTurn, outs: Sequence[torch.Tensor], dims: Sequence[int], state: PromptState
) -> list[tuple[int, Sequence[torch.Tensor]]]:
    """(row, outputs) of the branch step just run (`dims`: each output's
    group dimension): this rank's row, each row of a batched step, or in a
    branch round every seat's, gathered (a shadow's are dropped)."""
    if turn.round is not None:
        return list(zip(turn.seats, all_gathered(outs, state.shard.ranks)))
    if not turn.rows:
        return [(turn.row, outs)]
    return [(row, [o.narrow(d, j, 1) for o, d in zip(outs, dims)]) for j, row in enumerate(turn.rows)]
