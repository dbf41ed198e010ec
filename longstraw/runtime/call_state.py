"""What one call of a plan decides and leaves for its backward: the batch's groups,
each group's state and kept graphs, the generators' state before each step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from longstraw.errors import LongStrawError
from longstraw.runtime.mask_block import HOST_COPY
from longstraw.runtime.prompt_state import ChunkRound, PromptState, StepContext, has_values


@dataclasses.dataclass
class RngState:
    """The generators' state before a step, so its replay draws the same
    dropout masks (what torch.utils.checkpoint does for a checkpoint)."""

    cpu: torch.Tensor
    device: torch.device
    accelerator: torch.Tensor | None

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        accelerator = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), device, accelerator)

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Run with this state; the generators are left as they were found."""
        devices = [self.device] if self.accelerator is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.accelerator is not None:
                torch.cuda.set_rng_state(self.accelerator, self.device)
            yield


@dataclasses.dataclass(frozen=True)
class Group:
    """Rows of the batch that share one prompt, and the prompt positions
    captured for them as state."""

    rows: tuple[int, ...]
    prefix_len: int


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


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """What one call of a plan decided from its values (kept for summaries
    and the planner; the plan itself never changes between calls)."""

    prefix_len: int  # prompt positions captured as state (the first group's)
    group_sizes: tuple[int, ...]  # rows per group, in the order they ran
    branch_positions: tuple[int, int] = (0, 0)  # positions the branch steps ran, of those of the padded rows


@dataclasses.dataclass
class GroupCall:
    """One group's part of a call: its state, or None where the forward
    freed it after the group's branches (the backward captures it again)."""

    group: Group
    state: PromptState | None
    rng: dict[tuple[str, int], RngState]  # ("chunk", offset) / ("branch", row); empty without random ops
    handed: dict[int, dict[Any, torch.Tensor]]  # per row: what a frozen stage handed the replayed one
    graph: list[KeptChunk] | None = None  # the capture's autograd graph, chunk by chunk (`keep_graphs`)
    branches: dict[int, Sequence[torch.Tensor]] = dataclasses.field(default_factory=dict)  # kept branch outputs, by turn's row
    rows_per_step: int = 1  # branch rows per step, as the forward ran them (the backward replays them alike)
    reads: ReadLengths | None = None  # where the branch steps stop (`read_cut.py`); None: at the end


# What one more branch step costs beside its positions, counted in positions.
# Measured on an H100 (dense slice, TRL's batch, `step_profile_cut_h100`):
# 12 to 14 more steps (sorted steps of 2 or 3 rows against one of 8) cost
# from 28 to 260 positions each in wall time beyond the kernel time they
# saved (each step's mask block was one more device sync then; the key mask
# is now copied to the host once a call); at 256 the peers' batch runs steps
# of 4 rows, 14% fewer positions.
STEP_POSITIONS = 256

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


@dataclasses.dataclass
class GraphSpending:
    """One group's share of the runner's `graph_room`: each kept graph costs
    its bytes, and the first also the group's state (`state`: 0 for the
    last group), which every kept graph reads in the backward."""

    room: int
    spent: int  # bytes kept before this graph (earlier groups' too)
    state: int
    paid: bool = False

    def take(self, cost: int) -> bool:
        extra = cost + (0 if self.paid else self.state)
        if self.spent + extra > self.room:
            return False
        self.spent, self.paid = self.spent + extra, True
        return True


@dataclasses.dataclass
class KeptChunk:
    """A prompt chunk captured under autograd: its outputs (what it wrote to
    the state) still hold their graph, for the backward to differentiate."""

    offset: int
    length: int
    outputs: Sequence[torch.Tensor]


@dataclasses.dataclass
class CallState:
    """Everything one forward leaves for its backward."""

    values: dict[Any, torch.Tensor]
    groups: list[GroupCall]
    end: int
    device: torch.device  # the outer values': where the states are captured
    real: bool  # the outer values have values (not a shape-only run)
    leaves: dict[int, torch.Tensor] | None = None  # inputs' aliases the kept graphs lead to, by position


def branches_named(rows: Sequence[int], group_size: int) -> str:
    """How progress and errors name a branch step: `branch 3 of 8`, `branches 0, 1, 2, 3 of 8`."""
    if len(rows) == 1:
        return f"branch {rows[0]} of {group_size}"
    return f"branches {', '.join(map(str, rows))} of {group_size}"


def rows_of(value: torch.Tensor, dim: int, rows: tuple[int, ...]) -> torch.Tensor:
    """`value`'s `rows` along `dim`: a view where they are consecutive. A
    key mask's host copy (`mask_block.HOST_COPY`) comes along, cut alike."""
    if rows == tuple(range(rows[0], rows[0] + len(rows))):
        out = value.narrow(dim, rows[0], len(rows))
    else:
        out = value.index_select(dim, _row_index(rows, value.device))
    host = getattr(value, HOST_COPY, None)
    if host is not None:
        setattr(out, HOST_COPY, rows_of(host, dim, rows))
    return out


@functools.lru_cache(maxsize=256)
def _row_index(rows: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """`rows` as an index on `device`, made once per rows and device: a step
    of sorted rows (`ReadLengths.steps`) selects them from every input, and
    a copy from pageable host memory would wait for the device each time;
    this one is copied from pinned memory without waiting."""
    index = torch.tensor(rows)
    if device.type != "cuda":
        return index.to(device)
    return index.pin_memory().to(device, non_blocking=True)
