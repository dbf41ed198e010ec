"""Backward of a partitioned loss: branch replays, kept graphs, the prompt's reverse pass."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import fx

from longstraw.analysis.partition import Partition
from longstraw.codegen.graphs import StepGraph
from longstraw.codegen.stages import Stage
from longstraw.errors import LongStrawError
from longstraw.options import Options
from longstraw.parallel.collectives import replicate_from_first, summed_carry_grads, summed_over_ranks
from longstraw.parallel.ranks import Ranks, posting_failures
from longstraw.runtime.branch_turns import branch_turns
from longstraw.runtime.call_state import CallState, Group, GroupCall, KeptChunk, RngState, branches_named, rows_of
from longstraw.runtime.kernels.weight_grads import accumulating_into
from longstraw.runtime.phases import noting
from longstraw.runtime.prompt_state import ChunkRound, PromptState, StepContext
from longstraw.runtime.schedule import Chunk, ChunkSchedule


class BackwardPass(abc.ABC):
    """The backward half of `GroupRunner`: per group, last to first, the
    kept branch graphs differentiated or the branches replayed with autograd,
    then in exact mode the prompt's reverse pass (kept chunk graphs
    differentiated, else each chunk recomputed), seeded with d(state).

    It runs the forward half's own steps again, so what it reads of
    `GroupRunner` is declared here: the attributes below and the abstract
    methods at the end of the class."""

    part: Partition
    options: Options
    stages: list[Stage]
    branch: StepGraph
    prefix: StepGraph
    imports: list[fx.Node]
    outer: StepGraph
    import_ancestors: set[int]
    state_ancestors: set[int]
    ranks: Ranks | None
    runs_rounds: bool

    def backward(
        self, call: CallState, inputs: Sequence[Any], grad_outputs: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        if self.ranks is not None:
            self.ranks.raise_posted()
        with posting_failures(self.ranks):
            return self._backward(call, inputs, grad_outputs)

    def _backward(
        self, call: CallState, inputs: Sequence[Any], grad_outputs: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        wanted = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
        # The steps read detached aliases of the inputs that need gradients,
        # and autograd accumulates into the aliases' .grad: it adds each
        # gradient in place as the engine produces it, so one set is live,
        # where autograd.grad would return a second whole set every branch.
        inputs = list(inputs)
        for i in wanted:
            inputs[i] = call.leaves[i] if call.leaves is not None else inputs[i].detach().requires_grad_(True)
        leaves = [inputs[i] for i in wanted]
        values = call.values
        if any(i in self.import_ancestors for i in wanted):
            # data inputs that need gradients (or values computed from parameters) reach the steps
            # through the outer graph, which the forward ran without autograd: rerun it with it
            with torch.enable_grad():
                values = dict(zip(self.imports, self.outer.module(*inputs)))
        for group_call in reversed(call.groups):
            self._backward_group(call, group_call, inputs, values, leaves, wanted, grad_outputs)
        grads: list[torch.Tensor | None] = [None] * len(inputs)
        for i, leaf in zip(wanted, leaves):
            grads[i], leaf.grad = leaf.grad, None
        if self.options.context_parallel is not None:
            replicate_from_first(grads, self.options.context_parallel)
        return grads

    def _backward_group(
        self, call: CallState, group_call: GroupCall, inputs: list[Any], values: dict,
        leaves: list[torch.Tensor], wanted: list[int], grad_outputs: Sequence[torch.Tensor | None],
    ) -> None:
        """Replay the group's branches, then (exact mode) its prompt chunks in reverse."""
        part, group = self.part, group_call.group
        state = group_call.state
        if state is None:
            with torch.no_grad():
                state = self._capture(inputs, call.values, group, call.end, True, group_call.rng, call.device, call.real,
                                      again=True)
        stage = self.stages[-1]
        prefix_len = group.prefix_len
        # d(state) matters only if some trainable input feeds the captured state
        exact = (
            self.options.prompt_grad == "exact" and prefix_len > 0 and any(i in self.state_ancestors for i in wanted)
        )
        if exact:
            state.allocate_grads()
        branch_len = call.end - prefix_len
        turns = branch_turns(state, group, branch_len, group_call.rows_per_step, group_call.reads, self.runs_rounds)
        parts = RankParts(leaves, None if state.shard is None else state.shard.ranks)
        if turns[0].round is not None:
            parts.divided()
        for turn in turns:
            row, rows = turn.row, turn.step_rows
            slices = [
                None if grad_outputs[i] is None else rows_of(grad_outputs[i], part.batch_dim(part.branch_outputs[i]), rows)
                for i in stage.outputs
            ]
            if turn.shadow:
                slices = [None if s is None else torch.zeros_like(s) for s in slices]
            named = branches_named(rows, part.group_size)
            kept = group_call.branches.pop(row, None)
            if kept is not None:
                with noting(f"differentiating the kept {named}; no .grad was changed"):
                    self._accumulate(leaves, kept, slices)
                continue
            where = f"replaying {named} over [{prefix_len}, {call.end})"
            with self._replaying(group_call, ("branch", row), where):
                ctx = turn.context(state, prefix_len, branch_len, grad_enabled=True)
                step = self.branch if len(rows) == 1 else self.branch_step(len(rows))
                step_inputs = self._step_inputs(
                    step, inputs, values, rows if turn.rows else row, prefix_len, ctx.length, group_call.handed[row])
                outs = self.replay_module("branch", len(rows))(ctx, *step_inputs)
                self._accumulate(leaves, turn.padded(outs, where), slices)
        if exact and turns[0].round is not None:
            summed_carry_grads(state, prefix_len)
        if exact and group_call.graph is not None:
            self._differentiate_kept(state, group_call.graph, leaves)
        elif exact:
            schedule = self.schedule(prefix_len)
            rounds, rest = self._rounds(schedule, self._chunks(schedule))
            if rest:
                parts.replicated()
            for offset, length in self._walk(rest[::-1], "reverse pass"):
                self._reverse_step(state, group_call, inputs, values, leaves, offset, length)
            if rounds:
                parts.divided()
                self._reverse_rounds(state, rounds[::-1], group_call, inputs, values, leaves)
        parts.replicated()
        self._raise(state.failure, call.device)
        state.release()
        group_call.state, group_call.graph, group_call.branches = None, None, {}

    def _differentiate_kept(self, state: PromptState, graph: list[KeptChunk], leaves: list[torch.Tensor]) -> None:
        """The reverse pass over a kept prompt graph: each chunk, last to
        first, differentiated with its d(state), which the branches and the
        later chunks have completed by then; no forward runs again."""
        slots = self.stages[-1].slots
        while graph:
            chunk = graph.pop()
            where = f"differentiating the kept prompt chunk [{chunk.offset}, {chunk.offset + chunk.length}); no .grad was changed"
            with noting(where):
                seeds = [state.seed(slot, chunk.offset, chunk.length) for slot in slots]
                self._accumulate(leaves, chunk.outputs, seeds)

    def _reverse_rounds(
        self, state: PromptState, rounds: Sequence[ChunkRound], group_call: GroupCall, inputs: list[Any],
        values: dict, leaves: list[torch.Tensor],
    ) -> None:
        """Context parallelism's reverse pass by rounds, last to first: each
        rank recomputes and differentiates only its own chunk of a round
        (`StepContext.round`: the attention's and carries' backward meet in
        collectives), seeded by its own d(state). The parameter gradients
        are then each rank's part (`RankParts`)."""
        for round_, (offset, length) in zip(rounds, self._walk([r.chunks[r.index] for r in rounds], "reverse pass")):
            self._reverse_step(state, group_call, inputs, values, leaves, offset, length, round_)

    def _reverse_step(
        self, state: PromptState, group_call: GroupCall, inputs: list[Any], values: dict, leaves: list[torch.Tensor],
        offset: int, length: int, round_: ChunkRound | None = None,
    ) -> None:
        """Recompute prompt chunk `[offset, offset+length)` under autograd and
        differentiate it with its d(state); in a `round_`, this rank's chunk of it."""
        slots = self.stages[-1].slots
        where = f"in the reverse pass over prompt chunk [{offset}, {offset + length})" + (" (a round)" if round_ else "")
        if state.attention_outputs is not None:
            state.attention_outputs.prefetch(offset)
        with self._replaying(group_call, ("chunk", offset), where):
            ctx = StepContext(state, offset, length, grad_enabled=True, round=round_)
            row = group_call.group.rows[0]
            outs = self.replay_module("prefix")(ctx, *self._step_inputs(self.prefix, inputs, values, row, offset, length))
            seeds = ([state.seed(slot, offset, length) for slot in slots] if round_ is None
                     else [state.round_seed(slot, round_) for slot in slots])
            self._accumulate(leaves, outs, seeds)
        if state.attention_outputs is not None:
            state.attention_outputs.drop(offset, length)

    @contextlib.contextmanager
    def _replaying(self, call: GroupCall, key: tuple[str, int], where: str) -> Iterator[None]:
        """Autograd on, the step's RNG state restored, and failures named.
        Gradients reach `.grad` only when the whole backward has finished,
        so a failure leaves every `.grad` as it was."""
        rng = call.rng.get(key)
        with noting(f"{where}; no .grad was changed"), torch.enable_grad():
            with rng.restored() if rng is not None else contextlib.nullcontext():
                yield

    # What the forward half provides (`GroupRunner`), the backward runs again.

    @abc.abstractmethod
    def replay_module(self, which: str, rows: int = 1) -> torch.nn.Module:
        """The "prefix" or "branch" step (of `rows` rows) as it runs under autograd."""

    @abc.abstractmethod
    def branch_step(self, rows: int) -> StepGraph:
        """The branch step over `rows` rows of a group."""

    @abc.abstractmethod
    def schedule(self, prefix_len: int) -> ChunkSchedule:
        """The prompt's chunks."""

    @abc.abstractmethod
    def _chunks(self, schedule: ChunkSchedule) -> tuple[Chunk, ...]:
        """The chunks of `schedule` this runner runs."""

    @abc.abstractmethod
    def _rounds(self, schedule: ChunkSchedule, chunks: tuple[Chunk, ...]) -> tuple[list[ChunkRound], list[Chunk]]:
        """Context parallelism's rounds of `chunks`, and the chunks after them."""

    @abc.abstractmethod
    def _walk(self, chunks: list[tuple[int, int]], what: str) -> Iterator[tuple[int, int]]:
        """`chunks`, with the progress bar `options.progress` asks for."""

    @abc.abstractmethod
    def _step_inputs(
        self, step: StepGraph, inputs: Sequence[Any], values: dict, row: int | tuple[int, ...], offset: int,
        length: int, handed: dict[Any, torch.Tensor] | None = None,
    ) -> list[Any]:
        """The arguments of `step` for `row` (or rows) over positions `[offset, offset + length)`."""

    @abc.abstractmethod
    def _capture(
        self, inputs: Sequence[Any], values: dict, group: Group, end: int, backward: bool,
        rng: dict[tuple[str, int], RngState], device: torch.device, real: bool, stage: Stage | None = None,
        again: bool = False, graph: list[KeptChunk] | None = None,
    ) -> PromptState:
        """The group's prompt state, captured chunk by chunk (`again`: in backward, for a group not kept)."""

    @abc.abstractmethod
    def _raise(self, failure: LongStrawError | None, device: torch.device) -> None:
        """Raise a check's failure (on every rank at once under context parallelism)."""

    @staticmethod
    def _accumulate(leaves: list[torch.Tensor], outputs: Sequence[torch.Tensor], seeds: Sequence[torch.Tensor | None]) -> None:
        pairs = [(o, s) for o, s in zip(outputs, seeds) if s is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        if pairs and leaves:
            with accumulating_into(leaves):
                torch.autograd.backward([o for o, _ in pairs], [s for _, s in pairs], inputs=leaves)


class RankParts:
    """Context parallelism's runs of steps whose parameter gradients each
    rank computes a part of (rounds of branches or of prompt chunks), each
    run summed over the ranks once (`summed_over_ranks`); between runs,
    steps every rank runs alike (the chunks after the last prompt round).
    Consecutive divided steps share one sum. Without a group: nothing."""

    def __init__(self, leaves: list[torch.Tensor], ranks: Ranks | None) -> None:
        self.leaves, self.ranks = leaves, ranks
        self.open: contextlib.AbstractContextManager | None = None

    def divided(self) -> None:
        """The steps from here on give each rank its own part."""
        if self.ranks is not None and self.open is None:
            self.open = summed_over_ranks(self.leaves, self.ranks)
            self.open.__enter__()

    def replicated(self) -> None:
        """The steps from here on run alike on every rank: sum the parts so far."""
        if self.open is not None:
            done, self.open = self.open, None
            done.__exit__(None, None, None)
