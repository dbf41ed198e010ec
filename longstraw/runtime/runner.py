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
import dataclasses
import functools
import itertools
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx

from longstraw.errors import (
    InputError,
    LongStrawError,
    UnsupportedGraphError,
    argument_name,
    describe_node,
    module_path,
)
from longstraw.nodes import ancestors
from longstraw.options import Options
from longstraw.runtime.carry import SpanGraphs
from longstraw.runtime.device_memory import room_now
from longstraw.parallel.context_parallel import (
    PromptShard,
    all_gathered,
    check_replicated,
    graph_fingerprint,
    raise_together,
    replicate_from_first,
    summed_carry_grads,
    summed_over_ranks,
)
from longstraw.parallel.ranks import Ranks, posting_failures
from longstraw.codegen.recompute import LayerwiseStep
from longstraw.codegen.stages import Stage
from longstraw.codegen.program import StepProgram
from longstraw.runtime.schedule import Chunk, ChunkSchedule
from longstraw.runtime.state import ChunkRound, HostAttentionOutputs, PromptState, StepContext, has_values
from longstraw.codegen.stepgraph import StepGraph, step_imports

log = logging.getLogger("longstraw.runtime.runner")


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
class BranchTurn:
    """One branch step this rank runs: `row`. Under context parallelism's
    branch rounds (`round`) the ranks run `seats`, one row each, at once;
    a rank with no seat in a last, partial round runs the first seat's row
    again as a shadow (outputs dropped, gradient zero), to meet the others
    in the round's collectives. Elsewhere every rank runs every row."""

    row: int
    seats: tuple[int, ...]
    round: ChunkRound | None = None

    @property
    def shadow(self) -> bool:
        return self.round is not None and self.round.index >= len(self.seats)


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """What one call of a plan decided from its values (kept for summaries
    and the planner; the plan itself never changes between calls)."""

    prefix_len: int  # prompt positions captured as state (the first group's)
    group_sizes: tuple[int, ...]  # rows per group, in the order they ran


@dataclasses.dataclass
class GroupCall:
    """One group's part of a call: its state, or None where the forward
    freed it after the group's branches (the backward captures it again)."""

    group: Group
    state: PromptState | None
    rng: dict[tuple[str, int], RngState]  # ("chunk", offset) / ("branch", row); empty without random ops
    handed: dict[int, dict[Any, torch.Tensor]]  # per row: what a frozen stage handed the replayed one
    graph: list[KeptChunk] | None = None  # the capture's autograd graph, chunk by chunk (`keep_graphs`)
    branches: dict[int, Sequence[torch.Tensor]] = dataclasses.field(default_factory=dict)  # kept branch outputs, by row


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


class GroupRunner:
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
    (`device_memory.room_now`)."""

    def __init__(
        self, program: StepProgram, options: Options, ranks: Ranks | None = None, sampled: bool = False,
        state_room: int = 0, graph_room: int = 0, graph_chunk_bytes: int = 0, step_bytes: int = 0,
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
        self.outer = program.outer
        self.stages = list(program.stages)
        self.prefix = program.prefix
        self.branch = program.branch
        self.random = program.random
        self.runs_rounds = program.runs_rounds
        self.padding_roots = program.padding_roots
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
        self.key_padding = list(part.key_padding)
        self.shared_values = [
            n for n in self.imports if n in prefix_values and n not in self.roots and n not in self.key_padding
        ]
        self.last_call: CallRecord | None = None
        self.replayed: dict[str, torch.nn.Module] = {}

    def replay_module(self, which: str) -> torch.nn.Module:
        """The step run under autograd: the step graph itself, or with
        `recompute_layers` the same graph layer by layer (built once)."""
        step = self.branch if which == "branch" else self.prefix
        if not self.options.recompute_layers:
            return step.module
        if which not in self.replayed:
            self.replayed[which] = LayerwiseStep(step.module)
        return self.replayed[which]

    @functools.cached_property
    def keeps_graphs(self) -> bool:
        """Whether this plan may keep the forward's autograd graphs
        (`Options.keep_graphs`): none of what changes how the backward
        replays (layer-wise recomputation, attention outputs on the host,
        frozen stages, random operators, context parallelism). Prompt
        graphs need exact mode (a carried operator's backward reads the
        chunk boundary's carry, which exact mode's capture keeps); branch
        graphs, passes that allow them (`branch_graphs_kept`)."""
        o = self.options
        return (o.keep_graphs is not False and self.graph_room > 0
                and self.options.context_parallel is None and self.ranks is None and not o.recompute_layers
                and not o.attention_outputs_on_host and len(self.stages) == 1 and not self.random and not self.sampled)

    @functools.cached_property
    def keeps_branch_graphs(self) -> bool:
        return self.keeps_graphs and all(p.branch_graphs_kept for p in set(self.part.claims.values()))

    def check_prompt_gradients(self, requires_grad: Sequence[bool]) -> None:
        """Exact mode cannot give per-row gradients to per-row inputs of the
        prompt's computation: the prompt runs once, from row 0, and the
        gradient of each row's prompt positions is their sum. Eager keeps
        them apart, so such inputs are refused (inputs broadcast from one
        prompt inside the loss, `prompt.expand(G, ...)`, are fine: their
        gradient is that sum)."""
        if self.options.prompt_grad != "exact":
            return
        per_row = [r.node for r in self.part.roots if r.structural_prefix is None and r.node in self.prefix.externals]
        for node in per_row + self.shared_values:
            if self.part.batch_dim(node) is None:
                continue
            for source in ancestors([node]):
                if source.op == "placeholder" and source not in self.part.params and requires_grad[self.position[source]]:
                    raise UnsupportedGraphError(
                        f"`{argument_name(source)}` requires grad and gives each row of the group its own copy of the prompt "
                        f"(through `{node.name}`): exact mode computes the prompt once and cannot tell the rows' "
                        "gradients apart. Pass the prompt once and expand it inside the loss "
                        "(`torch.cat([prompt.expand(G, -1, ...), responses], 1)`), or use prompt_grad='detached'."
                    )

    # inputs of the steps ------------------------------------------------

    def _step_inputs(
        self, step: StepGraph, inputs: Sequence[Any], values: dict, row: int, offset: int, length: int,
        handed: dict[Any, torch.Tensor] | None = None,
    ) -> list[Any]:
        out = []
        for node in step.externals:
            if handed is not None and node in handed:
                out.append(handed[node])
            elif node in self.roots:
                root = self.roots[node]
                value = values[node]
                if root.batch_dim is not None:
                    value = value.narrow(root.batch_dim, row, 1)
                out.append(value.narrow(root.token_dim, offset, length))
            elif node in values:
                value = values[node]
                batch_dim = self.part.batch_dim(node)
                if batch_dim is not None and isinstance(value, torch.Tensor):
                    value = value.narrow(batch_dim, row, 1)
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
        """The chunks, with a tqdm bar in tokens/s when `options.progress` asks for one."""
        show = self.options.progress
        if show is None:
            show = sys.stderr.isatty() and len(chunks) >= 4
        if not show:
            yield from chunks
            return
        from tqdm.auto import tqdm

        total = sum(length for _, length in chunks)
        # one update per chunk: redraw on every one (mininterval=0)
        bar = tqdm(total=total, unit="tok", unit_scale=True, desc=f"longstraw {what}", leave=False, mininterval=0)
        with contextlib.closing(bar):
            for chunk in chunks:
                yield chunk
                bar.update(chunk[1])

    def prefix_len(self, values: dict) -> int:
        """Positions captured as state: before the first position the loss
        reads, and shared by every row (proved by the graph, else checked)."""
        prefix_len = self.part.first_consumed
        for root in self.part.roots:
            if root in self.padding_roots:
                continue
            if root.structural_prefix is not None:
                shared = root.structural_prefix
            else:
                shared = _shared_prefix(values[root.node], root.batch_dim, root.token_dim)
                if shared == 0 and self.part.group_size > 1:
                    raise InputError(
                        f"no shared prefix: the rows of `{root.node.name}` already differ at position 0, "
                        "so the group has no common prompt to capture"
                    )
            prefix_len = min(prefix_len, shared)
        return prefix_len

    def groups(self, values: dict) -> list[Group]:
        """The batch's groups: rows equal in every per-row input over the
        prompt part (the positions before the first one the loss reads),
        padding masks included. One class of rows is one group, whose
        captured prefix is what all rows share (as long as the graph proves
        or the values show); several classes are several groups, each
        capturing the whole prompt part, and then every row must share its
        prompt with another."""
        part = self.part
        every_row = tuple(range(part.group_size))
        keyed = [r for r in part.roots if r.batch_dim is not None]
        shape_only = any(not has_values(values[r.node]) for r in keyed)  # meta or fake: one group, as traced
        if part.group_size == 1 or part.first_consumed == 0 or len(keyed) < len(part.roots) or shape_only:
            return [Group(every_row, self.prefix_len(values))]
        per_row = [(values[r.node], r.batch_dim, r.token_dim) for r in keyed]
        per_row += [(values[k], part.batch_dim(k), part.token_dim(k)) for k in self.key_padding if part.batch_dim(k) is not None]
        classes = _rows_by_prompt(per_row, part.first_consumed)
        if len(classes) == 1 or all(len(rows) == 1 for rows in classes):
            # one prompt; or no two rows alike over the prompt part (the loss reads from inside the
            # prompt, or the rows diverge early): one group over the prefix every row shares
            return [Group(every_row, self.prefix_len(values))]
        for rows in classes:
            if len(rows) == 1:
                names = ", ".join(f"`{argument_name(r.node) if r.node.op == 'placeholder' else r.node.name}`" for r in keyed)
                masks = "".join(f" and the padding mask from {_inputs_named(k)}" for k in self.key_padding)
                raise InputError(
                    f"row {rows[0]} shares no prompt with any other row: the batch holds {len(classes)} different "
                    f"prompts (rows equal in {names}{masks} over the first {part.first_consumed} positions, the ones "
                    "before the loss reads any), and this row's prompt appears once. Each prompt needs at least two "
                    "completions in the batch, padded the same way; drop the row or score it in a separate call."
                )
        return [Group(rows, part.first_consumed) for rows in classes]

    def check_padding(self, values: dict, groups: Sequence[Group]) -> None:
        """A padding mask must be one for each group over the prompt, the
        positions before the first one the loss reads (the prompt is
        computed once, with the group's first row's mask), and a padding
        mask in every row: zeros, then ones, then zeros, the prompt's zeros
        on the left. Checked on every call: the mask is data, never folded."""
        prefix_len = self.part.first_consumed
        for root in self.padding_roots:
            value = values[root.node]
            if root.batch_dim is None or not has_values(value):
                continue
            rows = value.movedim((root.batch_dim, root.token_dim), (0, 1))
            rows = rows.reshape(*rows.shape[:2], -1).narrow(1, 0, prefix_len)
            for group in groups:
                _check_same_prompt(rows, group.rows, root.node, _inputs_named(root.node))
        for node in self.key_padding:
            value, batch_dim = values[node], self.part.batch_dim(node)
            if not has_values(value):
                continue
            keys = value.movedim((batch_dim, -1), (0, 1)) if batch_dim is not None else value.movedim(-1, 0)[None]
            keys = keys.reshape(*keys.shape[:2], -1)  # [G, L, the other (size-1) dims]
            name = _inputs_named(node)
            if not bool((keys == keys[..., :1]).all()):
                raise InputError(f"the key mask built from {name} ({describe_node(node)}) differs between heads: "
                                 "LongStraw supports a 2-D padding mask, one value per row and position")
            keys = keys[..., 0].narrow(1, 0, self.part.end)
            for group in groups:
                _check_same_prompt(keys[:, :prefix_len, None], group.rows if batch_dim is not None else (0,), node, name)
            _check_is_padding(keys, prefix_len, name)

    def check_shared_values(self, values: dict, groups: Sequence[Group]) -> None:
        """Per-row values the prompt's computation reads must be the same in every row of a group."""
        for node in self.shared_values:
            value, batch_dim = values[node], self.part.batch_dim(node)
            if not (isinstance(value, torch.Tensor) and has_values(value) and batch_dim is not None and value.shape[batch_dim] > 1):
                continue
            name = argument_name(node) if node.op == "placeholder" else node.name
            per_row = value.movedim(batch_dim, 0).reshape(value.shape[batch_dim], 1, -1)  # [G, 1, values]
            for group in groups:
                rows_named = f" (rows {list(group.rows)}, which share one prompt)" if len(groups) > 1 else ""
                _check_rows_equal(per_row, group.rows, lambda row, _: (
                    f"`{name}` differs between the rows of the group but feeds the prompt's computation "
                    f"({describe_node(node)}){rows_named}: row {row} differs from row {group.rows[0]}, so the rows "
                    "would not share one prompt state. Pass one value for the whole group (or compute it after the "
                    "prompt)."
                ))

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
        groups = self.groups(values)
        self.check_shared_values(values, groups)
        self.check_padding(values, groups)
        self.last_call = CallRecord(groups[0].prefix_len, tuple(len(g.rows) for g in groups))
        leaves = self._graph_leaves(inputs, values) if backward and self.keeps_graphs else None
        room = 0
        if leaves is not None:
            room = self._graph_room_now(inputs, next(iter(leaves.values())).device)
            inputs = [leaves.get(i, x) for i, x in enumerate(inputs)]
        with posting_failures(self.ranks):
            return self.run(inputs, values, groups, self.part.end, backward, leaves, room)

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
        leaves: dict[int, torch.Tensor] | None = None, graph_room: int = 0,
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
        (`graph_room`: the room this call found, `_graph_room_now`)."""
        part = self.part
        probe = next(v for v in values.values() if isinstance(v, torch.Tensor))
        device, real = probe.device, has_values(probe)
        per_row: dict[int, dict[int, torch.Tensor]] = {}
        calls, kept = [], 0  # bytes of earlier groups' states and of graphs kept for the backward
        for i, group in enumerate(groups):
            rng: dict[tuple[str, int], RngState] = {}
            handed: dict[int, dict[Any, torch.Tensor]] = {row: {} for row in group.rows}
            branch_len = end - group.prefix_len
            last = i == len(groups) - 1
            spending = self._spending(kept, end, last, graph_room) if leaves is not None else None
            prompt_graph = (spending is not None and self.options.prompt_grad == "exact"
                            and any(position in self.state_ancestors for position in leaves)
                            and spending.take(self.schedule(group.prefix_len).count * self.graph_chunk_bytes))
            graph = [] if prompt_graph else None
            branches: dict[int, Sequence[torch.Tensor]] = {}
            for stage in self.stages:
                state = self._capture(inputs, values, group, end, backward, rng, device, real, stage, graph=graph)
                for turn in self._branch_turns(state, group, branch_len):
                    row = turn.row
                    if self.random:
                        rng["branch", row] = RngState.capture(device)
                    keep = (spending is not None and self.keeps_branch_graphs and turn.round is None
                            and spending.take(self.graph_chunk_bytes))
                    with _noting(f"running branch {row} of {part.group_size}"), torch.set_grad_enabled(keep):
                        ctx = StepContext(state, group.prefix_len, branch_len, grad_enabled=False, round=turn.round)
                        inputs_of_row = self._step_inputs(
                            stage.branch, inputs, values, row, group.prefix_len, branch_len, handed[row])
                        outs = stage.branch.module(ctx, *inputs_of_row)
                    if keep:
                        branches[row] = outs[:len(stage.outputs)]
                        outs = [o.detach() if isinstance(o, torch.Tensor) else o for o in outs]
                    for seat, got in _seated(turn, outs[:len(stage.outputs)], state):
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
            calls.append(GroupCall(group, state, rng, handed, graph, branches))
        rows = sorted(per_row)
        outputs = [
            torch.cat([per_row[row][i] for row in rows], dim=part.batch_dim(node))
            for i, node in enumerate(part.branch_outputs)
        ]
        log.info(
            "forward: %d rows in %d group(s), %s prompt positions captured, %d positions in all",
            len(rows), len(groups), "/".join(str(g.prefix_len) for g in groups), end,
        )
        return outputs, CallState(values, calls, end, device, real, leaves)

    def _spending(self, kept: int, end: int, last: bool, room: int) -> GraphSpending:
        """A group's `GraphSpending`: but for the last group, a kept graph
        keeps its state too, which the backward would otherwise capture again."""
        state = 0 if last else sum(slot.bytes_per_position() * end + slot.fixed_bytes() for slot in self.part.slots)
        return GraphSpending(room, kept, state)

    def _graph_room_now(self, inputs: Sequence[Any], device: torch.device) -> int:
        """`graph_room` as this call finds the device (`device_memory.room_now`):
        the gradients not allocated yet are counted as needed."""
        missing = sum(x.numel() * x.element_size() for i in self.param_positions
                      if isinstance(x := inputs[i], torch.Tensor) and x.requires_grad and x.grad is None)
        return room_now(device, self.graph_room, self.step_bytes, missing)

    def _capture(
        self, inputs: Sequence[Any], values: dict, group: Group, end: int, backward: bool,
        rng: dict[tuple[str, int], RngState], device: torch.device, real: bool, stage: Stage | None = None,
        again: bool = False, graph: list[KeptChunk] | None = None,
    ) -> PromptState:
        """The group's prompt state for `stage`'s slots (default: the
        replayed stage), captured chunk by chunk from its first row. `again`
        (in backward) restores each chunk's RNG state from `rng` instead of
        recording it, so the state is the forward's. `device` and `real`:
        the outer values', as `run` found them (see `CallState`). `graph`:
        run each chunk under autograd and append it there (`KeptChunk`)."""
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
            with _noting(f"{what} [{offset}, {offset + length}) (a capture round)"):
                ctx = StepContext(state, offset, length, grad_enabled=False, round=round_)
                stage.prefix.module(ctx, *self._step_inputs(stage.prefix, inputs, values, group.rows[0], offset, length))
        for offset, length in self._walk(rest, "prompt capture"):
            if self.random and not again:
                rng["chunk", offset] = RngState.capture(device)  # the replayed stage's, captured last
            restored = rng["chunk", offset].restored() if self.random and again else contextlib.nullcontext()
            with _noting(f"{what} [{offset}, {offset + length})"), restored, torch.set_grad_enabled(graph is not None):
                ctx = StepContext(state, offset, length, grad_enabled=False)
                outputs = stage.prefix.module(
                    ctx, *self._step_inputs(stage.prefix, inputs, values, group.rows[0], offset, length))
            if graph is not None:
                graph.append(KeptChunk(offset, length, outputs))
        failure = state.failure
        if failure is None and verify and (slot := state.unwritten()) is not None:
            failure = LongStrawError(f"verify_state: the prompt capture left positions of {slot.label()} unwritten")
        if failure is None and self.options.check_finite:
            failure = self._nonfinite(state)
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

    def _branch_turns(self, state: PromptState, group: Group, branch_len: int) -> list[BranchTurn]:
        """The group's branch steps this rank runs. Under context parallelism
        (where rounds apply) the rows are dealt in rounds of W, one per rank,
        each rank running its own (`StepContext.round`, `branches`: its
        queries travel to the ranks holding the prompt's keys and back, as
        in a prompt round, and nothing else is exchanged, since a branch
        reads no other branch), so the branches' per-position work divides;
        elsewhere every rank runs every row."""
        shard = state.shard
        if shard is None or not self.runs_rounds:
            return [BranchTurn(row, (row,)) for row in group.rows]
        world, span = len(shard.chunks), (group.prefix_len, branch_len)
        turns = []
        for first in range(0, len(group.rows), world):
            seats = group.rows[first:first + world]
            round_ = ChunkRound((span,) * world, tuple(range(world)), shard.rank, branches=True)
            turns.append(BranchTurn(seats[shard.rank] if shard.rank < len(seats) else seats[0], seats, round_))
        return turns

    def _raise(self, failure: LongStrawError | None, device: torch.device) -> None:
        """Raise a check's failure; under context parallelism on every rank
        at once, since the checks read the rank's own share."""
        if self.ranks is not None:
            raise_together(failure, self.ranks, device)
        elif failure is not None:
            raise failure

    def _nonfinite(self, state: PromptState) -> InputError | None:
        """NaN or Inf in the captured state would poison every branch: name the layer."""
        tensors = [(slot, state.prompt_part(slot)) for slot in self.part.slots if slot.index in state.buffers]
        # the carries branches read (a non-finite earlier boundary reaches the state after it)
        tensors += [(slot, state.carries[slot.index][state.prefix_len]) for slot in self.part.slots if slot.index in state.carries]
        if not tensors or not has_values(tensors[0][1]):
            return None
        finite = torch.stack([t.isfinite().all() for _, t in tensors])
        if bool(finite.all()):
            return None
        slot, _ = tensors[int((~finite).nonzero()[0, 0])]
        return InputError(
            f"the captured prompt state {slot.index} ({slot.reason}) in `{module_path(slot.node) or slot.node.name}` "
            "holds NaN or Inf: the prompt's forward overflowed or the weights are not finite. Every branch would "
            "read it; check the inputs and weights (or set options={'check_finite': False} to skip this check)."
        )

    # backward -----------------------------------------------------------

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
        turns = self._branch_turns(state, group, branch_len)
        parts = RankParts(leaves, None if state.shard is None else state.shard.ranks)
        if turns[0].round is not None:
            parts.divided()
        for turn in turns:
            row = turn.row
            slices = [
                None if grad_outputs[i] is None else grad_outputs[i].narrow(part.batch_dim(part.branch_outputs[i]), row, 1)
                for i in stage.outputs
            ]
            if turn.shadow:
                slices = [None if s is None else torch.zeros_like(s) for s in slices]
            kept = group_call.branches.pop(row, None)
            if kept is not None:
                with _noting(f"differentiating the kept branch {row} of {part.group_size}; no .grad was changed"):
                    self._accumulate(leaves, kept, slices)
                continue
            with self._replaying(group_call, ("branch", row), f"replaying branch {row} of {part.group_size}"):
                ctx = StepContext(state, prefix_len, branch_len, grad_enabled=True, round=turn.round)
                outs = self.replay_module("branch")(
                    ctx, *self._step_inputs(self.branch, inputs, values, row, prefix_len, branch_len, group_call.handed[row]))
                self._accumulate(leaves, outs, slices)
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
            with _noting(where):
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
        with _noting(f"{where}; no .grad was changed"), torch.enable_grad():
            with rng.restored() if rng is not None else contextlib.nullcontext():
                yield

    @staticmethod
    def _accumulate(leaves: list[torch.Tensor], outputs: Sequence[torch.Tensor], seeds: Sequence[torch.Tensor | None]) -> None:
        pairs = [(o, s) for o, s in zip(outputs, seeds) if s is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        if pairs and leaves:
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


_AROUND_STEPS: list[Callable[[str], contextlib.AbstractContextManager]] = []


@contextlib.contextmanager
def around_steps(around: Callable[[str], contextlib.AbstractContextManager]) -> Iterator[None]:
    """Run `around(where)` around every step the runtime runs while this is
    active, for timers and profilers. `where` names the step: "capturing
    prompt chunk [0, 8192)", "running branch 3 of 8", "replaying branch 3
    of 8; ...", "in the reverse pass over prompt chunk [0, 8192); ..."."""
    _AROUND_STEPS.append(around)
    try:
        yield
    finally:
        _AROUND_STEPS.remove(around)


def phase_of(where: str) -> str:
    """`replaying branch 3 of 8; ...` -> `replaying branch`: the phase of a step `around_steps` names."""
    words = itertools.takewhile(lambda w: not (w[0].isdigit() or w[0] == "["), where.split())
    return " ".join(list(words)[:4])


@contextlib.contextmanager
def _noting(where: str) -> Iterator[None]:
    """Add where a step failed to its exception, keeping the type (callers
    catch torch.OutOfMemoryError, IndexError...), inside `around_steps`."""
    with contextlib.ExitStack() as stack:
        for around in list(_AROUND_STEPS):
            stack.enter_context(around(where))
        try:
            yield
        except Exception as err:
            err.add_note(f"longstraw: raised {where}")
            raise


def _seated(turn: BranchTurn, outs: Sequence[torch.Tensor], state: PromptState) -> list[tuple[int, Sequence[torch.Tensor]]]:
    """(row, outputs) of the branch step just run: this rank's, or in a
    branch round every seat's, gathered (a shadow's are dropped)."""
    if turn.round is None:
        return [(turn.row, outs)]
    return list(zip(turn.seats, all_gathered(outs, state.shard.ranks)))


def _inputs_named(node: fx.Node) -> str:
    """The user's inputs `node` is computed from, for messages."""
    found = ancestors([node])
    names = [f"`{argument_name(n)}`" for n in node.graph.nodes if n.op == "placeholder" and n in found]
    return " and ".join(names) or f"`{node.name}`"


def _check_rows_equal(values: torch.Tensor, rows: Sequence[int], message: Callable[[int, int], str]) -> None:
    """`values` [G, positions, ...]: the group's `rows` equal to its first,
    else an InputError with `message(row, position)` for the first row that
    differs and the first position where it does."""
    group = values[list(rows)]
    differs = (group != group[:1]).flatten(2).any(-1)  # [rows, positions]
    if bool(differs.any()):
        i, position = (int(i) for i in differs.nonzero()[0])
        raise InputError(message(rows[i], position))


def _check_same_prompt(values: torch.Tensor, rows: Sequence[int], node: fx.Node, name: str) -> None:
    """`values` [G, prompt positions, ...]: a padding mask is the same in every row of a group."""
    _check_rows_equal(values, rows, lambda row, position: (
        f"row {row} of the attention mask {name} differs from row {rows[0]} at prompt position {position} "
        f"({describe_node(node)}): the rows share one prompt, computed once, so its padding must be the same "
        "in every row. Left-pad the prompt the same way for every completion of it."
    ))


def _check_is_padding(keys: torch.Tensor, prefix_len: int, name: str) -> None:
    """`keys` [G, L] bool: each row is zeros, ones, zeros (left padding in
    the prompt, right padding after it); otherwise name the row and position."""
    on = keys.long()
    ends = (on[:, :-1] > on[:, 1:]).long()  # a one followed by a zero: [G, L - 1]
    after_end = torch.cumsum(ends, 1) > 0  # positions 1.. at or after the first zero that follows a one
    restart = after_end & keys[:, 1:].bool()
    for row in range(keys.shape[0]):
        ended = ends[row].nonzero()
        if not ended.numel():
            continue
        hole = int(ended[0, 0]) + 1
        again = restart[row].nonzero()
        if hole < prefix_len:
            raise InputError(
                f"row {row} of the attention mask {name} has a hole inside the prompt: position {hole} is padding "
                "after real tokens. LongStraw takes padding masks: the prompt padded on the left, completions on "
                "the right (pad the prompt on the left, as TRL does)."
            )
        if again.numel():
            raise InputError(
                f"row {row} of the attention mask {name} marks position {int(again[0, 0]) + 1} real after padding "
                f"at position {hole}, after the prompt: a completion must be padded on the right only, its real "
                "tokens first."
            )


def _rows_by_prompt(values: Sequence[tuple[torch.Tensor, int, int]], length: int) -> list[tuple[int, ...]]:
    """Rows equal in every (value, batch dim, token dim) over the first
    `length` positions, as classes in order of their first row: each class
    is the rows equal to its first, one comparison (and one sync) per class.
    (`torch.unique(dim=0)` sorts the rows: 90 ms at 16 rows of 16K positions
    on an H200.)"""
    flat = []
    for value, batch_dim, token_dim in values:
        prompt = value.narrow(token_dim, 0, length).movedim(batch_dim, 0)
        flat.append(prompt.reshape(prompt.shape[0], -1))
    left, classes = list(range(flat[0].shape[0])), []
    while left:
        first = left[0]
        same = torch.stack([(rows == rows[first]).all(-1) for rows in flat]).all(0)  # [rows]
        members = same.nonzero().flatten().tolist()
        classes.append(tuple(members))
        taken = set(members)
        left = [row for row in left if row not in taken]
    return classes


def _shared_prefix(value: torch.Tensor, batch_dim: int | None, token_dim: int) -> int:
    """Number of leading positions at which every row equals the first."""
    if batch_dim is None:
        return value.shape[token_dim]
    same = value == value.narrow(batch_dim, 0, 1)
    other = [d for d in range(value.dim()) if d != token_dim]
    per_position = same.permute(token_dim, *other).reshape(value.shape[token_dim], -1).all(dim=1)
    differs = (~per_position).nonzero()
    return int(differs[0, 0]) if differs.numel() else value.shape[token_dim]


class GroupFunction(torch.autograd.Function):
    """Autograd boundary: inputs are all placeholders of the loss graph,
    outputs the stacked branch outputs."""

    @staticmethod
    def forward(ctx, runner: GroupRunner, backward: bool, *inputs):
        with runner.options.kernels.active():
            outputs, call = runner.forward(inputs, backward)
        ctx.runner, ctx.call = runner, call
        tensor_positions = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
        ctx.tensor_positions = tensor_positions
        ctx.others = [None if isinstance(x, torch.Tensor) else x for x in inputs]
        ctx.save_for_backward(*[inputs[i] for i in tensor_positions])
        ctx.mark_non_differentiable(*[o for o in outputs if not o.is_floating_point()])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        if torch.is_grad_enabled():
            raise LongStrawError(
                "backward with create_graph=True (a gradient of the gradient) is not supported: LongStraw's backward "
                "replays the branches and the prompt itself and its gradients are not differentiable"
            )
        if ctx.call is None:
            raise LongStrawError(
                "backward through a LongStraw loss a second time (retain_graph=True): the prompt state is freed by "
                "the first backward. Call the compiled loss again for another backward."
            )
        inputs = list(ctx.others)
        for i, t in zip(ctx.tensor_positions, ctx.saved_tensors):
            inputs[i] = t
        with ctx.runner.options.kernels.active():
            grads = ctx.runner.backward(ctx.call, inputs, grad_outputs)
        ctx.call = None
        return (None, None, *grads)
