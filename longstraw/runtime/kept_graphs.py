"""What a call keeps for its backward beside the planned peak, and how many
branch rows one step holds (decisions 0016, 0038, 0045).

The planner leaves room beside its predicted peak (`planning.sizing.KeptRoom`).
A call spends it on the forward's autograd graphs (a kept graph saves that
step's second forward) and on branch steps of several rows (fewer, larger
kernels; each row beyond the first holds another branch's activations).
Which programs allow either is decided here from the passes and options;
what a graph costs starts at the planned activations, an upper bound, and
follows what kept graphs were measured to hold where the device tells.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch

from longstraw.codegen.program import StepProgram
from longstraw.options import Options
from longstraw.runtime.call_state import GraphSpending
from longstraw.runtime.device_memory import allocated
from longstraw.runtime.step_seconds import StepSeconds

log = logging.getLogger("longstraw.runtime.kept_graphs")


def graphs_keepable(program: StepProgram, options: Options) -> bool:
    """Whether `options` and `program` let the forward keep its autograd
    graphs (`GroupRunner.keeps_graphs`, before the room for them): none of
    what changes how the backward replays (layer-wise recomputation,
    attention outputs on the host, frozen stages, random operators, context
    parallelism) and `keep_graphs` not False."""
    o = options
    return (o.keep_graphs is not False and o.context_parallel is None and not o.recompute_layers
            and not o.attention_outputs_on_host and len(program.stages) == 1 and not program.random)


def branch_graphs_keepable(program: StepProgram) -> bool:
    """Whether every pass claiming an operator of `program` lets a branch's graph be kept."""
    return all(p.branch_graphs_kept for p in set(program.partition.claims.values()))


def one_row_reason(program: StepProgram, ranks: bool) -> str | None:
    """Why `program`'s branch steps hold one row each, or None where
    several may run as one step (`Options.branch_rows`); `ranks`: under
    context parallelism."""
    refusing = sorted(p.name for p in set(program.partition.claims.values()) if not p.branches_batched)
    if refusing:
        return f"the pass(es) {', '.join(refusing)} read the state for one row per step"
    if len(program.stages) > 1:
        return "a frozen model's scoring stage hands its values to the branch step row by row"
    if ranks:
        return "context parallelism deals the branches to the ranks one row each"
    return None


def rows_per_step(option: int | None, group_size: int, room: int, graph_bytes: int) -> int:
    """Branch rows per step (`Options.branch_rows`) for a group of
    `group_size`: the option's, or planned (None) as many as `room` (beside
    the planned peak, which holds one branch) has room for at `graph_bytes`
    each beyond the first."""
    if option is not None:
        return max(1, min(option, group_size))
    if graph_bytes <= 0:
        return 1
    return max(1, min(group_size, 1 + room // graph_bytes))


def kept_in(spending: GraphSpending, prompt: int | None, branch: int | None, rows: int,
            group_size: int) -> tuple[bool, int]:
    """What a group keeps in `spending` (taken from it), as the runner
    takes it: its prompt's graph first (`prompt` bytes; None: not wanted),
    then its branch steps of `rows` rows in order, `branch` bytes a row
    (None: branch graphs are not kept), while they fit. Returns (prompt
    kept, branch rows kept)."""
    prompt_kept = prompt is not None and spending.take(prompt)
    kept = 0
    while branch is not None and kept < group_size and spending.take(min(rows, group_size - kept) * branch):
        kept += min(rows, group_size - kept)
    return prompt_kept, kept


def rows_or_graphs(spending_beside: Callable[[int], GraphSpending], prompt: int | None, branch: int | None, rows: int,
                   group_size: int, positions: tuple[int, int], seconds: StepSeconds | None = None) -> int:
    """`rows` per branch step, or one where the room those rows take beyond
    one (`spending_beside(rows)`: the spending left beside steps of that
    many rows) would keep graphs over fewer of the `positions` (a prompt's,
    a branch's) than steps of one row keep: a kept graph saves its
    positions' second forward, several rows per step launches (measured on
    the dense slice: half the launches, the same time). Where `seconds`
    measured both kinds of step (and the prompt's forward, where only one
    keeps its graph), the faster of the two by `group_seconds` instead: on
    a step bound by launches, the rows save more than the graphs they
    cost."""
    many = kept_in(spending_beside(rows), prompt, branch, rows, group_size)
    one = kept_in(spending_beside(1), prompt, branch, 1, group_size)

    def saved(kept: tuple[bool, int]) -> int:
        return kept[0] * positions[0] + kept[1] * positions[1]

    if saved(many) >= saved(one):
        return rows
    if seconds is not None:
        wanted = prompt is not None
        times = [group_seconds(seconds, k, kept, wanted, group_size, positions) for k, kept in ((rows, many), (1, one))]
        if None not in times:
            log.info("branch steps of %d rows keep graphs over fewer positions than steps of one; by the measured "
                     "forwards %.4f s against %.4f s: %s", rows, times[0], times[1],
                     f"{rows} rows" if times[0] < times[1] else "one row")
            return rows if times[0] < times[1] else 1
    return 1


def group_seconds(seconds: StepSeconds, rows: int, kept: tuple[bool, int], prompt_wanted: bool, group_size: int,
                  positions: tuple[int, int]) -> float | None:
    """A group's seconds in steps of `rows` rows that keep `kept` (the
    prompt's graph, branch rows), from the forwards `seconds` measured: each
    step's forward and its backward (twice a forward), a second forward for
    each step not kept, and the prompt's where its graph is wanted and not
    kept. None where a forward it needs was not measured."""
    prompt_kept, branch_rows = kept
    step = seconds.branch(rows, positions[1])
    again = seconds.prompt(positions[0]) if prompt_wanted and not prompt_kept else 0.0
    if step is None or again is None:
        return None
    steps, replayed = -(-group_size // rows), -(-(group_size - branch_rows) // rows)
    return (3 * steps + replayed) * step + again


class GraphBytes:
    """What keeping a graph is counted at: per prompt chunk or branch row,
    the planned activations (`planned`, an upper bound: the largest step's,
    with its kernels' workspaces), or, once a kept graph of the kind was
    measured (`measuring`, on CUDA) to hold less, its bytes per position
    (of a branch row, or of the prompt) times the positions (a prompt not
    measured yet: a branch's per position, which runs the same layers and
    its LM head besides). The measurements (`measured`) are per position so
    that the plans of one compiled loss share them (`CompiledGroupLoss`):
    what a kept step holds does not depend on the prompt's length (the
    state is not in its graph), so a new length starts from what earlier
    lengths measured."""

    def __init__(self, planned: int, measured: dict[str, float] | None = None) -> None:
        self.planned = planned
        self.measured: dict[str, float] = {} if measured is None else measured

    def branch(self, rows: int, positions: int) -> int:
        """A step of `rows` branch rows of `positions` positions each."""
        return self._least("branch", rows * positions, rows * self.planned)

    def row(self, positions: int) -> int:
        """What one more row of a branch step (`positions` positions) takes
        beside the planned peak (which holds one step): the planned bytes
        until a kept branch was measured, then twice its measured bytes, the
        second for the step's working memory (its backward's gradients of
        the largest activations, the logits' among them: at the dense
        slice's shapes about 0.4 to 0.6 GB a row beside a kept 1.27 GB), at
        most the planned bytes. The planned bytes are the largest step's, a
        prompt chunk's in exact mode: 7.9 GB at 8K there."""
        return min(self.planned, 2 * self.branch(1, positions))

    def prompt(self, prefix_len: int, chunks: int) -> int:
        planned = chunks * self.planned
        if "prompt" not in self.measured and "branch" in self.measured:
            return min(planned, int(self.measured["branch"] * prefix_len))
        return self._least("prompt", prefix_len, planned)

    def _least(self, kind: str, units: int, planned: int) -> int:
        measured = self.measured.get(kind)
        return planned if measured is None else min(planned, int(measured * units))

    @contextlib.contextmanager
    def measuring(self, keep: bool, kind: str, units: int, device: torch.device) -> Iterator[None]:
        """Around a step that keeps its graph (`keep`): where the device
        tells (`device_memory.allocated`), the bytes the step left
        allocated per unit (position), the largest seen of the kind."""
        before = allocated(device) if keep else None
        yield
        if before is not None:
            held = max(allocated(device) - before, 0) / max(units, 1)
            self.measured[kind] = max(self.measured.get(kind, 0.0), held)
