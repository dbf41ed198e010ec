"""`StepProgram`: what one graph and input signature compile to.

The partition and the graphs generated from it (the outer graph, the
scoring stages with their prompt and branch steps, the tail) do not depend
on the options the memory planner chooses (the chunk size, layer-wise
recomputation): the same program runs under any of them. The planner
simulates the program under candidate options, and the runner is built
once, from the program and the options chosen.
"""

from __future__ import annotations

import dataclasses
import functools

from longstraw.analysis.partition import Partition
from longstraw.analysis.read_cut import read_cut
from longstraw.codegen.graphs import StepGraph, build_from_inputs, build_outer, build_tail
from longstraw.codegen.stages import Stage, stages_of
from longstraw.nodes import ancestors, is_random


@dataclasses.dataclass(frozen=True)
class StepProgram:
    partition: Partition
    outer: StepGraph  # the values the steps import, computed once per call from the inputs
    stages: tuple[Stage, ...]  # `stages.py`: a frozen scoring stage first, if any; the last is replayed
    tail: StepGraph  # the loss from the stacked branch outputs
    read_masks: StepGraph | None = None  # the scorer's masks from the inputs, where branch steps may be cut (`read_cut.py`)
    uncut: str = ""  # otherwise why every branch step runs every position

    @property
    def prefix(self) -> StepGraph:
        """The replayed stage's prompt step."""
        return self.stages[-1].prefix

    @property
    def branch(self) -> StepGraph:
        """The replayed stage's branch step."""
        return self.stages[-1].branch

    @functools.cached_property
    def random(self) -> bool:
        """Whether a step draws random numbers (dropout): replays then restore each step's generator state."""
        return any(is_random(n) for stage in self.stages for step in (stage.prefix, stage.branch)
                   for n in step.module.graph.nodes)

    @functools.cached_property
    def runs_rounds(self) -> bool:
        """Whether context parallelism can divide the steps among the ranks in
        rounds: every claimed operator's pass runs them (`runs_rounds`) and
        the loss draws no random numbers (the replays restore each step's
        generator state, recorded where every rank runs every step)."""
        return not self.random and all(p.runs_rounds for p in self.partition.claims.values())

    @functools.cached_property
    def padding_roots(self) -> frozenset:
        """Roots a padding mask is built from (Gated DeltaNet's `hidden *
        attention_mask`): checked, not compared to find the shared prefix
        (rows that differ would shorten it silently)."""
        padding_inputs = ancestors(self.partition.key_padding)
        return frozenset(r for r in self.partition.roots if r.node in padding_inputs)

    @property
    def structural_prefix_len(self) -> int | None:
        """The prompt positions captured where the graph alone fixes them
        (every root proves its shared prefix), else None: then each call's
        values decide (`GroupRunner.prefix_len`)."""
        part = self.partition
        if any(r.structural_prefix is None for r in part.roots):
            return None
        return min([part.first_consumed, *(r.structural_prefix for r in part.roots if r not in self.padding_roots)])

    @property
    def traced_prefix_len(self) -> int:
        """The traced example's captured prompt positions; where they depend
        on values the example does not have (token ids on the meta device),
        every position before the first the loss reads: the shared prompt
        of any real group of these shapes, since the responses' own logits
        start there."""
        structural = self.structural_prefix_len
        return self.partition.first_consumed if structural is None else structural


def compile_program(part: Partition, head_chunk: int | None) -> StepProgram:
    """The step graphs of a partition with state, the branch steps' LM head
    `head_chunk` positions at a time."""
    stages = tuple(stages_of(part, head_chunk))
    cut = read_cut(part) if len(stages) == 1 else "a frozen stage hands the replayed one values at every position"
    masks = None if isinstance(cut, str) else build_from_inputs(part, list(cut.masks), "LongStrawReadMasks")
    return StepProgram(part, build_outer(part), stages, build_tail(part), masks, cut if isinstance(cut, str) else "")
