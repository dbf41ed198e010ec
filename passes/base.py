"""The extension point: what an architecture pass may override."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch
import torch.fx as fx


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
        and all visible columns, as a `longstraw.mask.MaskBlock` that
        computes tiles of it on demand (the whole block can be gigabytes)."""

    def carry_output(self, slot: int, node: fx.Node) -> None:
        """Declare the step-graph node holding a carry slot's state after the step."""


class ArchitecturePass:
    """Base class of architecture passes.

    Required: `claims`, `position_dims`, `state_inputs`, `emit_step`.
    Optional: `unsupported_reason` (default: everything claimed is supported),
    `candidates` (default: capture the claimed input itself),
    `positional_inputs` (default: none), `carries` (default: none),
    `dim_rule` (default: the built-in rules of `longstraw.dims`).
    """

    name = "pass"

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
        `StepContext.carry_in` / `carry_out` (see `longstraw.carry.CarryStep`)."""
        return []

    def dim_rule(self, dims: Any, node: fx.Node) -> Any:
        """Dimensions of a claimed operator's output for `longstraw.dims`
        (a list per output tensor), or None to use the built-in rules."""
        return None

    def unsupported_reason(self, node: fx.Node) -> str | None:
        """Why this claimed node cannot be run incrementally, or None."""
        return None

    def positional_inputs(self, node: fx.Node) -> list[fx.Node]:
        """Inputs computed from positions only (masks), which the step rebuilds
        for its own rows and columns instead of slicing."""
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
