"""Execution of a partitioned loss: capture, branches, replay, reverse pass.

Forward (no autograd): the outer graph once; the prompt row in chunks of
`prefix_chunk_size`, filling the state buffers; each branch on its own
positions, reading the state. The stacked branch outputs go to the tail,
which runs under ordinary autograd. A batch of several prompts (rows found
equal over the prompt part, in any order) runs group by group: one group's
state is live at a time, so the others are captured again in backward.

Backward: each branch is replayed with autograd and differentiated with its
slice of the tail's gradient; parameter gradients are summed over branches
and, in exact mode, the gradient of the state is accumulated into d(state).
Exact mode then walks the prompt chunks in reverse, recomputing each with
autograd from the (immutable) state before it and differentiating it with
d(state) of its own positions. Gradients are returned to autograd, which
accumulates them into `.grad` exactly as for any other function.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from longstraw.codegen.graphs import StepGraph, step_imports
from longstraw.codegen.program import StepProgram
from longstraw.codegen.recompute import LayerwiseStep
from longstraw.codegen.stepgraph import build_step
from longstraw.codegen.stages import Stage
from longstraw.errors import LongStrawError, argument_name
from longstraw.nodes import ancestors
from longstraw.options import Options
from longstraw.parallel.agreement import check_replicated, graph_fingerprint
from longstraw.parallel.collectives import raise_together
from longstraw.parallel.ranks import Ranks, posting_failures
from longstraw.parallel.shards import PromptShard
from longstraw.runtime.backward import BackwardPass
from longstraw.runtime.batch_groups import BatchGroups
from longstraw.runtime.branch_turns import ReadLengths, branch_turns, seated
from longstraw.runtime.call_state import (
    CallRecord,
    CallState,
    GraphSpending,
    Group,
    GroupCall,
    KeptChunk,
    RngState,
    branches_named,
    rows_of,
)
from longstraw.runtime.carry import SpanGraphs
from longstraw.runtime.device_memory import room_now
from longstraw.runtime.host_offload import HostAttentionOutputs
from longstraw.runtime.kept_graphs import (
    GraphBytes,
    branch_graphs_keepable,
    graphs_keepable,
    one_row_reason,
    rows_or_graphs,
    rows_per_step,
)
from longstraw.runtime.mask_block import attach_host_copy
from longstraw.runtime.phases import noting, walked
from longstraw.runtime.prompt_state import ChunkRound, FiniteCheck, PromptState, StepContext, has_values, nonfinite
from longstraw.runtime.schedule import Chunk, ChunkSchedule
from longstraw.runtime.step_seconds import StepSeconds

log = logging.getLogger("longstraw.runtime.runner")


class GroupRunner(BackwardPass):
    """Runs one plan's program under its options: the capture, the
    branches, and in backward the replays and the reverse pass. `ranks`:
    the collectives of context parallelism (default: over
    `options.context_parallel`; the planner's simulation gives a
    `SimulatedRanks`); `sampled`: run only the chunks whose memory can
    differ (`ChunkSchedule.sampled`), for the simulation; `state_room`: the
    bytes of earlier groups' prompt states the forward may keep for the
    backward, which then does not capture them again (`keep_group_states`);
    `graph_room`: the bytes of the forward's autograd graphs it may keep
    for the backward (`keep_graphs`), `graph_chunk_bytes` those of one
    prompt chunk's or one branch's (kept states and graphs share one count
    of bytes); `step_bytes`: what the planned step needs beside the weights
    and gradients, which each call keeps free before it spends `graph_room`
    (`device_memory.room_now`); `kept_bytes`: what kept graphs were measured
    to hold per position, shared by the plans of one compiled loss
    (`kept_graphs.GraphBytes`); `step_seconds`: what the steps' forwards
    were measured to take, shared likewise (`step_seconds.StepSeconds`)."""

    def __init__(
        self, program: StepProgram, options: Options, ranks: Ranks | None = None, sampled: bool = False,
        state_room: int = 0, graph_room: int = 0, graph_chunk_bytes: int = 0, step_bytes: int = 0,
        branch_room: int = 0, kept_bytes: dict[str, float] | None = None, step_seconds: StepSeconds | None = None,
    ) -> None:
        part = program.partition
        self.program = program
        self.part = part
        self.options = options
        group = options.context_parallel
        self.ranks = ranks if ranks is not None or group is None else Ranks(group)
        self.sampled = sampled
        self.state_room = state_room
        self.graph_room, self.graph_chunk_bytes, self.step_bytes = graph_room, graph_chunk_bytes, step_bytes
        self.branch_room = branch_room
        self.graph_bytes = GraphBytes(graph_chunk_bytes, kept_bytes)
        self.step_seconds = StepSeconds() if step_seconds is None else step_seconds
        self.outer = program.outer
        self.stages = list(program.stages)
        self.prefix = program.prefix
        self.branch = program.branch
        self.random = program.random
        self.runs_rounds = program.runs_rounds
        self.roots = {r.node: r for r in part.roots}
        self.position = {p: i for i, p in enumerate(part.placeholders)}
        self.param_positions = [self.position[p] for p in part.params]
        self.imports = step_imports(part)
        self.state_ancestors = {
            self.position[n] for n in ancestors(s.node for s in part.slots) if n.op == "placeholder"
        }
        self.import_ancestors = {self.position[n] for n in ancestors(self.imports) if n.op == "placeholder"}
        # data inputs the prompt's step reads directly are shared values too (a per-row
        # offset added to the embeddings); imports never hold parameters
        prefix_values = {n for stage in self.stages for n in stage.prefix.externals}
        shared_values = [
            n for n in self.imports if n in prefix_values and n not in self.roots and n not in part.key_padding
        ]
        self.batch = BatchGroups(part, program.padding_roots, shared_values)
        self.last_call: CallRecord | None = None
        self.replayed: dict[tuple[str, int], torch.nn.Module] = {}
        self.batched: dict[int, StepGraph] = {1: self.branch}
        if (options.branch_rows or 1) > 1 and not self.batches_branches and not sampled:
            log.warning("branch_rows=%d: this plan runs its branches one row at a time (%s)", options.branch_rows,
                        one_row_reason(program, self.ranks is not None))

    def replay_module(self, which: str, rows: int = 1) -> torch.nn.Module:
        """The step run under autograd: the step graph itself (for a branch,
        the one of `rows` rows), or with `recompute_layers` the same graph
        layer by layer (built once)."""
        step = self.branch_step(rows) if which == "branch" else self.prefix
        if not self.options.recompute_layers:
            return step.module
        if (which, rows) not in self.replayed:
            self.replayed[which, rows] = LayerwiseStep(step.module)
        return self.replayed[which, rows]

    def branch_step(self, rows: int) -> StepGraph:
        """The branch step over `rows` rows of a group (built at its first use)."""
        if rows not in self.batched:
            self.batched[rows] = build_step(self.part, "branch", self.options.head_chunk_size, rows=rows)
        return self.batched[rows]

    @functools.cached_property
    def batches_branches(self) -> bool:
        """Whether this runner's branch steps may hold several rows (`Options.branch_rows`)."""
        return one_row_reason(self.program, self.ranks is not None) is None and not self.sampled

    def _rows_per_step(self, group: Group, room: int, row_bytes: int) -> int:
        """Branch rows per step for `group` (`kept_graphs.rows_per_step`), a row beyond the first at `row_bytes`."""
        if not self.batches_branches:
            return 1
        return rows_per_step(self.options.branch_rows, len(group.rows), room, row_bytes)

    @functools.cached_property
    def keeps_graphs(self) -> bool:
        """Whether this plan may keep the forward's autograd graphs
        (`Options.keep_graphs`): none of what changes how the backward
        replays (layer-wise recomputation, attention outputs on the host,
        frozen stages, random operators, context parallelism). Prompt
        graphs need exact mode (a carried operator's backward reads the
        chunk boundary's carry, which exact mode's capture keeps); branch
        graphs, passes that allow them (`branch_graphs_kept`)."""
        return (graphs_keepable(self.program, self.options) and self.graph_room > 0 and self.ranks is None
                and not self.sampled)

    @functools.cached_property
    def keeps_branch_graphs(self) -> bool:
        return self.keeps_graphs and branch_graphs_keepable(self.program)

    @functools.cached_property
    def plans_rows(self) -> bool:
        """Whether each call plans its branch rows from the room beside the
        planned peak (`Options.branch_rows` None, room planned)."""
        return self.batches_branches and self.options.branch_rows is None and self.branch_room > 0

    @functools.cached_property
    def times_steps(self) -> bool:
        """Whether this plan's calls may weigh planned branch rows against
        kept graphs (`kept_graphs.rows_or_graphs`), and so time their steps'
        forwards (`StepSeconds`): nowhere else are the timings read."""
        return self.plans_rows and self.keeps_graphs

    # inputs of the steps ------------------------------------------------

    def _step_inputs(
        self, step: StepGraph, inputs: Sequence[Any], values: dict, row: int | tuple[int, ...], offset: int,
        length: int, handed: dict[Any, torch.Tensor] | None = None,
    ) -> list[Any]:
        rows = (row,) if isinstance(row, int) else row
        out = []
        for node in step.externals:
            if handed is not None and node in handed:
                out.append(handed[node])
            elif node in self.roots:
                root = self.roots[node]
                value = values[node]
                if root.batch_dim is not None:
                    value = rows_of(value, root.batch_dim, rows)
                out.append(value.narrow(root.token_dim, offset, length))
            elif node in values:
                value = values[node]
                batch_dim = self.part.batch_dim(node)
                if batch_dim is not None and isinstance(value, torch.Tensor):
                    value = rows_of(value, batch_dim, rows)
                out.append(value)
            else:
                out.append(inputs[self.position[node]])
        return out

    @functools.cached_property
    def fingerprint(self) -> float:
        """The partitioned graph's (`graph_fingerprint`): what context
        parallelism compares between ranks besides the inputs and options."""
        return graph_fingerprint(self.part.graph)

    @functools.cached_property
    def _replica_inputs(self) -> tuple[list[str], list[bool]]:
        """What `check_replicated` needs of the inputs besides their values,
        fixed for a plan: their names, and which are data (not parameters)."""
        return ([argument_name(p) for p in self.part.placeholders],
                [p not in self.part.params for p in self.part.placeholders])

    def schedule(self, prefix_len: int) -> ChunkSchedule:
        """The prompt's chunks, which the capture and the reverse pass run
        and the shards are dealt from."""
        return ChunkSchedule(prefix_len, self.options.prefix_chunk_size, 1 if self.ranks is None else self.ranks.size)

    def _chunks(self, schedule: ChunkSchedule) -> tuple[Chunk, ...]:
        """The chunks this runner runs: all of them, or for the planner's
        simulation (`sampled`) those whose memory can differ."""
        return schedule.sampled(self.runs_rounds) if self.sampled else schedule.chunks

    def _walk(self, chunks: list[tuple[int, int]], what: str) -> Iterator[tuple[int, int]]:
        """The chunks, with a progress bar where `options.progress` asks for one (`phases.walked`)."""
        return walked(chunks, what, self.options.progress)

    # forward ------------------------------------------------------------

    @torch.no_grad()
    def forward(self, inputs: Sequence[Any], backward: bool = True) -> tuple[list[torch.Tensor], CallState]:
        if self.options.context_parallel is not None:
            generators = []
            if self.random:
                probe = next(v for v in inputs if isinstance(v, torch.Tensor))
                generators.append(torch.get_rng_state())
                if probe.device.type == "cuda":
                    generators.append(torch.cuda.get_rng_state(probe.device))
            check_replicated(inputs, *self._replica_inputs, self.fingerprint, self.options, self.options.context_parallel,
                             generators)
        values = dict(zip(self.imports, self.outer.module(*inputs)))
        groups = self.batch.groups(values)
        self.batch.check_shared_values(values, groups)
        for node in self.part.key_padding:  # one host copy a call, for the padding checks and every mask block
            if has_values(values[node]):
                attach_host_copy(values[node])
        self.batch.check_padding(values, groups)
        leaves = self._graph_leaves(inputs, values) if backward and self.keeps_graphs else None
        room = 0
        if leaves is not None:
            room = self._room_now(inputs, next(iter(leaves.values())).device, self.graph_room)
            inputs = [leaves.get(i, x) for i, x in enumerate(inputs)]
        with posting_failures(self.ranks):
            return self.run(inputs, values, groups, self.part.end, backward, leaves, room, self._read_lengths(inputs))

    def _read_lengths(self, inputs: Sequence[Any]) -> ReadLengths | None:
        """Where each row's loss stops reading (`read_cut.py`), from the
        scorer's masks on this call's inputs; None where the branch steps
        run every position (no proof, no values, context parallelism)."""
        masks = self.program.read_masks
        if masks is None or self.sampled or self.ranks is not None:
            return None
        return ReadLengths.of(masks.module(*inputs))

    def _graph_leaves(self, inputs: Sequence[Any], values: dict) -> dict[int, torch.Tensor] | None:
        """Aliases of the inputs that need gradients, for steps run under
        autograd to lead to and the backward to accumulate into; None where
        nothing needs a gradient or the steps' data comes through the outer
        graph with a gradient (it ran without autograd: the backward runs it again)."""
        wanted = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
        probe = next((v for v in values.values() if isinstance(v, torch.Tensor)), None)
        if probe is None or not has_values(probe) or not wanted:
            return None
        if any(i in self.import_ancestors for i in wanted):
            return None
        return {i: inputs[i].detach().requires_grad_(True) for i in wanted}

    @torch.no_grad()
    def run(
        self, inputs: Sequence[Any], values: dict, groups: Sequence[Group], end: int, backward: bool = True,
        leaves: dict[int, torch.Tensor] | None = None, graph_room: int = 0, reads: ReadLengths | None = None,
    ) -> tuple[list[torch.Tensor], CallState]:
        """Capture and branches from the outer values, group by group; `end`
        is the traced one except when `longstraw.explain` simulates other
        sizes. Every group but the last frees its state after its branches
        (its backward captures it again), so one group's state is live at a
        time, unless `state_room` has room for it: then the backward reads
        it as the forward left it. Without a `backward` to follow, exact
        mode keeps nothing for its reverse pass (chunk-boundary carries,
        attention outputs on the host). With `leaves` (`_graph_leaves`) the
        steps whose graphs `graph_room` has room for (a group's prompt in
        exact mode, then its branches one by one) run under autograd and
        keep their graphs, and the group's state, for the backward
        (`graph_room`: the room this call found, `_room_now`). With `reads`
        each branch step stops after its rows' last read position."""
        part = self.part
        probe = next(v for v in values.values() if isinstance(v, torch.Tensor))
        device, real = probe.device, has_values(probe)
        per_row: dict[int, dict[int, torch.Tensor]] = {}
        calls, kept = [], 0  # bytes of earlier groups' states and of graphs kept for the backward
        ran = padded = 0  # branch positions run, and those of the padded rows
        if self.times_steps:
            self.step_seconds.settle()
        rows_room = self._room_now(inputs, device, self.branch_room) if self.plans_rows else 0
        checks: list[FiniteCheck] = []  # the captures' `check_finite`, read once after the last group's branches
        for i, group in enumerate(groups):
            rng: dict[tuple[str, int], RngState] = {}
            handed: dict[int, dict[Any, torch.Tensor]] = {row: {} for row in group.rows}
            branch_len = end - group.prefix_len
            last = i == len(groups) - 1
            prompt_cost = None
            if leaves is not None and self.options.prompt_grad == "exact" and any(
                    position in self.state_ancestors for position in leaves):
                prompt_cost = self.graph_bytes.prompt(group.prefix_len, self.schedule(group.prefix_len).count)
            row_bytes = self.graph_bytes.row(branch_len)  # one more row of a branch step
            per_step = self._rows_per_step(group, rows_room, row_bytes)
            if leaves is not None and per_step > 1 and self.options.branch_rows is None:
                branch = self.graph_bytes.branch(1, branch_len) if self.keeps_branch_graphs else None
                beside = lambda rows: self._spending(kept, end, last, graph_room - (rows - 1) * row_bytes)  # noqa: E731
                per_step = rows_or_graphs(beside, prompt_cost, branch, per_step, len(group.rows),
                                          (group.prefix_len, branch_len), self.step_seconds)
            if reads is not None and self.options.branch_rows is None:  # fewer rows per step, fewer positions
                per_step = reads.rows_per_step(group.rows, branch_len, per_step)
            # a step of several rows holds their graphs at once: what it takes beyond one is not kept room
            room = graph_room - (per_step - 1) * row_bytes
            spending = self._spending(kept, end, last, room) if leaves is not None else None
            prompt_graph = prompt_cost is not None and spending.take(prompt_cost)
            graph = [] if prompt_graph else None
            branches: dict[int, Sequence[torch.Tensor]] = {}
            for stage in self.stages:
                state = self._capture(inputs, values, group, end, backward, rng, device, real, stage, graph=graph,
                                      checks=checks)
                dims = [part.batch_dim(part.branch_outputs[o]) for o in stage.outputs]
                for turn in branch_turns(state, group, branch_len, per_step, reads, self.runs_rounds):
                    row, rows = turn.row, turn.step_rows
                    ctx = turn.context(state, group.prefix_len, branch_len, grad_enabled=False)
                    step = stage.branch if len(rows) == 1 else self.branch_step(len(rows))
                    if self.random:
                        rng["branch", row] = RngState.capture(device)
                    keep = (spending is not None and self.keeps_branch_graphs and turn.round is None
                            and spending.take(self.graph_bytes.branch(len(rows), branch_len)))
                    where = f"running {branches_named(rows, part.group_size)} over [{group.prefix_len}, {end})"
                    with noting(where), torch.set_grad_enabled(keep), \
                            self.graph_bytes.measuring(keep, "branch", len(rows) * ctx.length, device), \
                            self.step_seconds.timing(("branch", len(rows)), len(rows) * ctx.length, device,
                                                    real and self.times_steps):
                        inputs_of_row = self._step_inputs(
                            step, inputs, values, rows if turn.rows else row, group.prefix_len, ctx.length, handed[row])
                        outs = turn.padded(step.module(ctx, *inputs_of_row), where)
                    ran, padded = ran + len(rows) * ctx.length, padded + len(rows) * branch_len
                    if keep:
                        branches[row] = outs[:len(stage.outputs)]
                        outs = [o.detach() if isinstance(o, torch.Tensor) else o for o in outs]
                    for seat, got in seated(turn, outs[:len(stage.outputs)], dims, state):
                        per_row.setdefault(seat, {}).update(zip(stage.outputs, got))
                    handed[row].update(zip(stage.hands, outs[len(stage.outputs):]))
                replayed = stage is self.stages[-1]
                held = state.device_bytes() if replayed and not last and backward else None
                if spending is not None and spending.paid:
                    kept = spending.spent  # kept graphs read the state in the backward: it stays
                elif held is not None and kept + held <= self.state_room:
                    kept += held
                elif not (replayed and last):
                    state.release()
                    state = None
            calls.append(GroupCall(group, state, rng, handed, graph, branches, per_step, reads))
        self._raise(nonfinite(checks), device)
        rows = sorted(per_row)
        outputs = [
            torch.cat([per_row[row][i] for row in rows], dim=part.batch_dim(node))
            for i, node in enumerate(part.branch_outputs)
        ]
        self.last_call = CallRecord(groups[0].prefix_len, tuple(len(g.rows) for g in groups), (ran, padded))
        log.info(
            "forward: %d rows in %d group(s), %s prompt positions captured, %d positions in all, "
            "%d of the padded rows' %d branch positions run",
            len(rows), len(groups), "/".join(str(g.prefix_len) for g in groups), end, ran, padded,
        )
        return outputs, CallState(values, calls, end, device, real, leaves)

    def _spending(self, kept: int, end: int, last: bool, room: int) -> GraphSpending:
        """A group's `GraphSpending`: but for the last group, a kept graph
        keeps its state too, which the backward would otherwise capture again."""
        state = 0 if last else sum(slot.bytes_per_position() * end + slot.fixed_bytes() for slot in self.part.slots)
        return GraphSpending(room, kept, state)

    def _room_now(self, inputs: Sequence[Any], device: torch.device, planned: int) -> int:
        """`planned` room as this call finds the device (`device_memory.room_now`):
        the gradients not allocated yet are counted as needed."""
        missing = sum(x.numel() * x.element_size() for i in self.param_positions
                      if isinstance(x := inputs[i], torch.Tensor) and x.requires_grad and x.grad is None)
        return room_now(device, planned, self.step_bytes, missing)

    def _capture(
        self, inputs: Sequence[Any], values: dict, group: Group, end: int, backward: bool,
        rng: dict[tuple[str, int], RngState], device: torch.device, real: bool, stage: Stage | None = None,
        again: bool = False, graph: list[KeptChunk] | None = None, checks: list[FiniteCheck] | None = None,
    ) -> PromptState:
        """The group's prompt state for `stage`'s slots (default: the
        replayed stage), captured chunk by chunk from its first row. `again`
        (in backward) restores each chunk's RNG state from `rng` instead of
        recording it, so the state is the forward's. `device` and `real`:
        the outer values', as `run` found them (see `CallState`). `graph`:
        run each chunk under autograd and append it there (`KeptChunk`).
        `checks`: where `check_finite` appends its check, for the forward to
        read once for every group (`prompt_state.nonfinite`); None in the
        backward, whose capture `again` is the state the forward checked."""
        part = self.part
        stage = self.stages[-1] if stage is None else stage
        backward = backward and stage is self.stages[-1]  # a frozen stage has no reverse pass
        verify = self.options.verify_state and real
        graphs = self.options.cuda_graphs and device.type == "cuda" and real
        exact = self.options.prompt_grad == "exact" and backward
        kept = (HostAttentionOutputs(device, self.ranks)
                if exact and real and self.options.attention_outputs_on_host else None)
        schedule = self.schedule(group.prefix_len)
        chunks = self._chunks(schedule)
        shard = None if self.ranks is None else PromptShard(self.ranks, schedule.shares)
        state = PromptState(part.slots, capacity=end, prefix_len=group.prefix_len, device=device, verify=verify,
                            boundaries=exact, span_graphs=SpanGraphs() if graphs else None, attention_outputs=kept,
                            active=stage.active if len(self.stages) > 1 else None,
                            shard=shard)
        what = "capturing prompt chunk" if not again else "capturing again prompt chunk"
        rounds, rest = self._rounds(schedule, chunks)
        for round_, (offset, length) in zip(rounds, self._walk([r.chunks[r.index] for r in rounds], "prompt capture")):
            with noting(f"{what} [{offset}, {offset + length}) (a capture round)"):
                ctx = StepContext(state, offset, length, grad_enabled=False, round=round_)
                stage.prefix.module(ctx, *self._step_inputs(stage.prefix, inputs, values, group.rows[0], offset, length))
        for offset, length in self._walk(rest, "prompt capture"):
            if self.random and not again:
                rng["chunk", offset] = RngState.capture(device)  # the replayed stage's, captured last
            restored = rng["chunk", offset].restored() if self.random and again else contextlib.nullcontext()
            with noting(f"{what} [{offset}, {offset + length})"), restored, torch.set_grad_enabled(graph is not None), \
                    self.graph_bytes.measuring(graph is not None, "prompt", length, device), \
                    self.step_seconds.timing(("prompt", 1), length, device, real and self.times_steps):
                ctx = StepContext(state, offset, length, grad_enabled=False)
                outputs = stage.prefix.module(
                    ctx, *self._step_inputs(stage.prefix, inputs, values, group.rows[0], offset, length))
            if graph is not None:
                graph.append(KeptChunk(offset, length, outputs))
        failure = state.failure
        if failure is None and verify and (slot := state.unwritten()) is not None:
            failure = LongStrawError(f"verify_state: the prompt capture left positions of {slot.label()} unwritten")
        if checks is not None and self.options.check_finite and (check := state.finite_check()) is not None:
            checks.append(check)
        self._raise(failure, device)
        return state

    def _rounds(self, schedule: ChunkSchedule, chunks: tuple[Chunk, ...]) -> tuple[list[ChunkRound], list[Chunk]]:
        """Context parallelism's rounds of `chunks` (`ChunkSchedule.rounds`),
        each rank computing its own chunk of a round (`StepContext.round`),
        so the per-position work divides too; and the chunks after them,
        which every rank runs. Without rounds, every chunk is after them."""
        if self.ranks is None or not self.runs_rounds:
            return [], list(chunks)
        blocks, rest = schedule.rounds(chunks)
        rounds = []
        for block in blocks:
            owners = tuple(schedule.owner(chunk) for chunk in block)
            rounds.append(ChunkRound(block, owners, owners.index(self.ranks.rank)))
        return rounds, rest

    def _raise(self, failure: LongStrawError | None, device: torch.device) -> None:
        """Raise a check's failure; under context parallelism on every rank
        at once, since the checks read the rank's own share."""
        if self.ranks is not None:
            raise_together(failure, self.ranks, device)
        elif failure is not None:
            raise failure

