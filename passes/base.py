"""The extension point: what an architecture pass may override.

`ArchitecturePass` is the general contract. `CarryPass` is the short form
for an operator whose past is a fixed-size state carried from one position
range to the next (a recurrent matrix, a convolution's last inputs): the
subclass names the operator, the state's shape and a `CarryKernel`, and
the base class does the rest. `DimRules` is what a `dim_rule` may do with
the dimension analysis.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.fx as fx

from longstraw.runtime.carry import CarryKernel, CarryStep
from longstraw.analysis.dim_types import Dim
from longstraw.analysis.dims import DimRules


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A tensor the state of a claimed input could be captured as.

    `node` is the candidate; `transform` is pass-specific data that tells the
    step how to get from the captured tensor back to the claimed input (for
    attention: how many times K/V heads are repeated)."""

    node: fx.Node
    transform: Any


@dataclasses.dataclass(frozen=True)
class SiteState:
    """A claimed input resolved by the core: the captured node `cut` lives in
    state `slot`; `transform` (from the chosen Candidate) leads back to the input."""

    cut: fx.Node
    slot: int
    transform: Any


class StepEmitter(Protocol):
    """What the step builder offers a pass while it emits a claimed node."""

    graph: fx.Graph
    ctx: fx.Node  # the StepContext placeholder

    def mapped(self, a: Any) -> Any:
        """Translate original nodes (in any argument structure) into the step graph."""

    def query_key_block(self, node: fx.Node) -> fx.Node:
        """A `[..., L, L]` positions-only tensor (a mask) for the step's rows
        and all visible columns, as a `longstraw.analysis.mask.MaskBlock` that
        computes tiles of it on demand (the whole block can be gigabytes)."""

    def carry_output(self, slot: int, node: fx.Node) -> None:
        """Declare the step-graph node holding a carry slot's state after the step."""


class ArchitecturePass:
    """Base class of architecture passes.

    Required: `claims`, `position_dims`, `state_inputs`, `emit_step`.
    Optional: `unsupported_reason` (default: everything claimed is supported),
    `candidates` (default: capture the claimed input itself),
    `positional_inputs` (default: none), `per_position_inputs` (default:
    none), `carries` (default: none),
    `dim_rule` (default: the built-in rules of `longstraw.analysis.dims`).
    """

    name = "pass"
    """The pass's name: what `Options.disable_passes` and other passes' `overrides` refer to it by."""
    overrides: tuple[str, ...] = ()
    """Names of passes this one takes precedence over on a node both claim
    (a proved sliding window over plain causal attention). Any other node
    claimed by two passes is an error naming both."""
    runs_rounds = False
    """Whether this pass's steps run context parallelism's rounds
    (`StepContext.round`: the ranks capture, and in the reverse pass
    recompute and differentiate, one chunk each at once, meeting in
    collectives); a plan with any other pass runs every chunk on every
    rank."""
    branch_graphs_kept = False
    """Whether a branch step's autograd graph from the forward may be kept
    for the backward (`Options.keep_graphs`): its backward reads from the
    state only positions before the step (the prompt's), never the
    branch's own, which the next branch overwrites. False (the default)
    replays every branch in the backward."""

    branches_batched = False
    """Whether a branch step may hold several rows of a group at once
    (`Options.branch_rows`): the step's claimed operators then get inputs
    with that many rows and a `StepContext` whose `rows` says so, and read
    the prompt's state (batch 1) for every row. False (the default) runs
    every branch of a plan with this pass one row at a time."""

    def claims(self, node: fx.Node) -> bool:
        """Whether this pass handles `node` (an operator mixing positions)."""
        raise NotImplementedError

    def position_dims(self, node: fx.Node) -> tuple[tuple[fx.Node, int], tuple[fx.Node, int]]:
        """(input, dim) of the sequence axis and of the batch (group) axis."""
        raise NotImplementedError

    def state_inputs(self, node: fx.Node) -> list[fx.Node]:
        """Inputs whose values at earlier positions later positions read."""
        raise NotImplementedError

    def carries(self, node: fx.Node) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Fixed-size states (shape with batch 1, dtype) carried from one
        position range to the next; the step reads and writes them through
        `StepContext.carry_in` / `carry_out` (see `longstraw.runtime.carry.CarryStep`)."""
        return []

    def dim_rule(self, dims: DimRules, node: fx.Node) -> list[Dim] | list[list[Dim]] | None:
        """Dimensions of a claimed operator's output (a list of `Dim` per
        output tensor; one list for a single tensor), or None to use the
        built-in rules. Position-mixing operators declare the axis they mix
        along with `dims.mixes`."""
        return None

    def unsupported_reason(self, node: fx.Node) -> str | None:
        """Why this claimed node cannot be run incrementally, or None."""
        return None

    def positional_inputs(self, node: fx.Node) -> list[fx.Node]:
        """Inputs computed from positions only (masks), which the step rebuilds
        for its own rows and columns instead of slicing."""
        return []

    def per_position_inputs(self, node: fx.Node) -> list[fx.Node]:
        """Per-position tensors the step reads that reach the node only
        through a positional input (a top-k index query inside a selection
        mask): they run in the step like any sequence node instead of being
        left to the mask's rebuild."""
        return []

    def candidates(self, node: fx.Node, state_input: fx.Node) -> list[Candidate]:
        """Tensors the state could be captured as, from `state_input` upwards;
        the core picks the cheapest per position."""
        return [Candidate(state_input, None)]

    def emit_step(self, emitter: StepEmitter, node: fx.Node, sites: list[SiteState]) -> fx.Node:
        """Emit the incremental version of `node` into `emitter.graph`.

        `sites` gives, per `state_inputs` entry, the captured node and slot:
        `emitter.mapped(site.cut)` holds the step's own positions, the slot's
        buffer all earlier ones."""
        raise NotImplementedError


class CarryPass(ArchitecturePass):
    """An operator whose past is a fixed-size state carried between
    position ranges: `op(*args) -> out` (or `(out, final_state)` when
    `returns_state`), causal along its sequence axis. In a capture round
    `CarryStep` runs it over the whole round on every rank.

    Subclasses set `op` (the `OpOverload` claimed) and `sequence` (argument
    index and dimension of the positions; `batch_dim` of the same argument
    holds the group's rows), and implement:

    - `carry(node)`: the carried state's shape with batch 1, and its dtype
      (by default, for an operator that returns its final state, that state's);
    - `step_inputs(node)`: the operator's arguments the step passes on
      (tensors or None, in order) and its constant arguments (keywords);
    - `kernel(inputs, **constants)`: a `CarryKernel` for the step's actual
      inputs (called when the step runs, so it may pick a fused kernel by
      device and dtype).

    The default `dim_rule` suits an operator whose output has the
    dimensions of its sequence argument (a convolution, a moving average);
    override it otherwise."""

    branch_graphs_kept = True
    """A branch's `CarryStep` starts from the prompt's carry, which no branch
    changes, and reads no per-position state."""
    branches_batched = True
    """A step of several branch rows starts each from the prompt's carry
    (`carry._carry_of_rows`) and sums their gradients of it."""

    op: Any = None
    sequence: tuple[int, int] = (0, 1)
    batch_dim: int = 0
    returns_state: bool = False
    runs_rounds = True

    def claims(self, node: fx.Node) -> bool:
        return node.op == "call_function" and node.target is self.op

    def position_dims(self, node: fx.Node) -> tuple[tuple[fx.Node, int], tuple[fx.Node, int]]:
        x = node.args[self.sequence[0]]
        return (x, self.sequence[1]), (x, self.batch_dim)

    def state_inputs(self, node: fx.Node) -> list[fx.Node]:
        return []

    def carries(self, node: fx.Node) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [self.carry(node)]

    def carry(self, node: fx.Node) -> tuple[tuple[int, ...], torch.dtype]:
        """An operator that returns its final state (`returns_state`) carries
        a state of that state's shape and dtype, with batch 1."""
        if not self.returns_state:
            raise NotImplementedError
        state = node.meta["longstraw_value"][1]
        return (1, *state.shape[1:]), state.dtype

    def step_inputs(self, node: fx.Node) -> tuple[Sequence[Any], dict[str, Any]]:
        raise NotImplementedError

    def kernel(self, inputs: Sequence[torch.Tensor | None], **constants: Any) -> CarryKernel:
        raise NotImplementedError

    def dim_rule(self, dims: DimRules, node: fx.Node) -> list[Dim] | list[list[Dim]] | None:
        x = dims.of(node.args[self.sequence[0]])
        dims.mixes(node, x[self.sequence[1]])
        return list(x)

    def emit_step(self, emitter: StepEmitter, node: fx.Node, sites: list[SiteState]) -> fx.Node:
        (site,) = sites
        inputs, constants = self.step_inputs(node)
        step = emitter.graph.call_function(
            self.step_function(), (emitter.ctx, site.slot, *emitter.mapped(tuple(inputs))), dict(constants)
        )
        emitter.carry_output(site.slot, emitter.graph.call_function(operator.getitem, (step, 1)))
        return step if self.returns_state else emitter.graph.call_function(operator.getitem, (step, 0))

    def step_function(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        """The function the step graph calls: `(ctx, slot, *inputs, **constants) -> (out, new_carry)`."""

        def step(ctx, slot: int, *inputs, **constants):
            return CarryStep.apply(ctx, slot, self.kernel(inputs, **constants), *inputs)

        step.__name__ = step.__qualname__ = f"{self.name}_step"
        return step


def each_row_as_one_step(ctx: Any, step: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
                         row_dims: Sequence[int | None], **constants: Any) -> torch.Tensor:
    """A step of several branch rows (`StepContext.rows`) run as one-row
    steps of `step`: row j of each input (narrowed along its `row_dims`
    entry; None: shared by the rows, a weight), the outputs concatenated
    along dim 0. For a claimed operator whose one-row step reads the row's
    own positions from its arguments, never from the state's buffers (which
    hold one row), so the rows share the prompt's state and nothing else."""
    one = dataclasses.replace(ctx, rows=1)
    return torch.cat([
        step(one, *(x if d is None else x.narrow(d, j, 1) for x, d in zip(inputs, row_dims)), **constants)
        for j in range(ctx.rows)
    ])
