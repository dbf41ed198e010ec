"""Scoring stages: what a frozen model scores runs first, on its own state.

A loss that scores the batch with a frozen reference model (or with the old
policy under `no_grad`) next to the policy has state slots whose values need
no gradient. Run as one stage, the capture would hold both prompt states at
once. `stages_of` cuts the plan in two: the frozen stage captures those
slots, runs its part of every branch up to the values the rest of the loss
reads from it (the *handed* nodes, such as the reference's per-token
log-probs) and frees its state, all in the forward; the live stage is the
plan without those slots, reading the handed values as inputs, and is what
the backward replays. The frozen stage needs no backward (nothing in it
requires grad), so gradients are the one-stage plan's. The cut is made only
where it is clean: no live capture, live branch computation or live claimed
operator may read a frozen slot (DSA's index keys are captured without
grad but read by the live attention), and every handed value is one the
step computes; otherwise the plan stays one stage.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from longstraw.analysis.partition import Partition
from longstraw.analysis.slots import StateSlot
from longstraw.codegen.graphs import StepGraph, needed_for, step_imports
from longstraw.codegen.stepgraph import build_step
from longstraw.nodes import tensor_of


@dataclasses.dataclass(frozen=True)
class Stage:
    """Slots captured together, the branch step that reads them, and what
    that step returns: branch outputs (`outputs`, positions in
    `Partition.branch_outputs`) and values handed to the next stage."""

    slots: tuple[StateSlot, ...]
    outputs: tuple[int, ...]
    prefix: StepGraph
    branch: StepGraph
    hands: tuple[fx.Node, ...] = ()  # returned by `branch` after the outputs
    handed: frozenset[fx.Node] = frozenset()  # read by `branch` from the stage before

    @property
    def active(self) -> set[int]:
        return {s.index for s in self.slots}


def _needs_grad(node: fx.Node) -> bool:
    value = tensor_of(node)
    return value is None or value.requires_grad


def frozen_cut(part: Partition) -> tuple[list[StateSlot], list[fx.Node]] | None:
    """(frozen slots, handed nodes), or None where there is no clean cut."""
    frozen = [s for s in part.slots if not _needs_grad(s.node)]
    if not frozen or len(frozen) == len(part.slots):
        return None
    slot_of = {s.node: s for s in part.slots}
    reads: dict[fx.Node, frozenset[StateSlot]] = {}
    for node in part.graph.nodes:
        own = {slot_of[node]} if node in slot_of else set()
        reads[node] = frozenset(own.union(*(reads[a] for a in node.all_input_nodes)))
    frozen_set = set(frozen)
    steps = part.sequence | part.branch
    in_frozen = {n for n in steps if reads[n] and reads[n] <= frozen_set and not _needs_grad(n)}
    handed = [n for n in part.graph.nodes
              if n in in_frozen and (n in part.branch_outputs or any(u not in in_frozen for u in n.users))]
    frozen_index = {s.index for s in frozen}
    reads_frozen = (node for node, sites in part.sites.items() if any(site.slot in frozen_index for site in sites))
    if any(node not in in_frozen for node in reads_frozen):
        return None  # a live operator reads frozen state (DSA's index keys, under no_grad, for the attention)
    if any(n in part.positional for n in handed):
        return None  # a handed value must be one the step computes, not a mask rebuilt per block
    live_slots = [s.node for s in part.slots if s not in frozen_set]
    live_outputs = [o for o in part.branch_outputs if o not in in_frozen]
    imports = set(step_imports(part))
    touched = needed_for(live_slots, imports, part.positional)
    touched |= needed_for(live_outputs, imports | set(handed), part.positional)
    if any(s.node in touched for s in frozen):
        return None
    return frozen, handed


def stages_of(part: Partition, head_chunk: int | None = None) -> list[Stage]:
    """The stages in the order they run; the last one is what the backward replays."""
    every = tuple(range(len(part.branch_outputs)))
    cut = frozen_cut(part)
    if cut is None:
        return [Stage(tuple(part.slots), every, build_step(part, "prefix"), build_step(part, "branch", head_chunk))]
    frozen, handed = cut
    live = [s for s in part.slots if s not in frozen]
    outputs = {o: i for i, o in enumerate(part.branch_outputs)}
    first_outputs = tuple(outputs[n] for n in handed if n in outputs)
    hands = tuple(n for n in handed if n not in outputs)
    first_nodes = [part.branch_outputs[i] for i in first_outputs] + list(hands)
    second_outputs = tuple(i for i in every if i not in first_outputs)
    return [
        Stage(tuple(frozen), first_outputs, build_step(part, "prefix", slots=frozen),
              build_step(part, "branch", head_chunk, outputs=first_nodes), hands=hands),
        Stage(tuple(live), second_outputs, build_step(part, "prefix", slots=live),
              build_step(part, "branch", head_chunk, outputs=[part.branch_outputs[i] for i in second_outputs],
                         handed=set(hands)), handed=frozenset(hands)),
    ]
