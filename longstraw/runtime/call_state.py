"""What one call of a plan decides and leaves for its backward: the batch's groups,
each group's state and kept graphs, the generators' state before each step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from longstraw.runtime.mask_block import HOST_COPY
from longstraw.runtime.prompt_state import PromptState

if TYPE_CHECKING:
    from longstraw.runtime.branch_turns import ReadLengths


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
