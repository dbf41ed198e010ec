"""Planning as a declared pipeline: the stages that turn Dynamo's graph of a loss into a plan to run.

`PIPELINE` names the stages in the order they run; each is a function from
the `Planning` record to the next one, which it returns with its own field
filled. `CompiledGroupLoss` runs them at the first call of each input
signature (`longstraw.backend`). What each stage made can be printed:

    LONGSTRAW_DUMP=classify,codegen python train.py     # or LONGSTRAW_DUMP=all

logs each named stage's output to the logger `longstraw.pipeline.<stage>`
(on stderr when the variable names it; through `logging` at DEBUG otherwise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

from longstraw.analysis.partition import Partition, classify, with_state
from longstraw.codegen.program import StepProgram, compile_program
from longstraw.errors import LongStrawError
from longstraw.options import Options
from longstraw.passes import ArchitecturePass
from longstraw.planning.planner import Simulations
from longstraw.planning.simulation import without_cyclic_gc
from longstraw.planning.sizing import KeptRoom, size_plan
from longstraw.runtime.runner import GroupRunner
from longstraw.runtime.step_seconds import StepSeconds
from longstraw.trace.specialize import Specialization, specialize

DUMP_VARIABLE = "LONGSTRAW_DUMP"


@dataclasses.dataclass(frozen=True)
class Planning:
    """What planning knows: its inputs, then each stage's output as it runs."""

    gm: fx.GraphModule
    args: Sequence[Any]
    options: Options
    passes: tuple[ArchitecturePass, ...]
    activations: Simulations  # the planner's simulations, shared by a compiled graph's plans
    kept_bytes: dict[str, float] | None = None  # kept graphs' measured bytes per position, shared likewise
    step_seconds: StepSeconds | None = None  # the steps' measured forward seconds, shared likewise
    specialization: Specialization | None = None
    partition: Partition | None = None
    program: StepProgram | None = None
    sized: Options | None = None  # the options with the chunk size and recomputation decided
    room: KeptRoom | None = None
    runner: GroupRunner | None = None
    seconds: tuple[tuple[str, float], ...] = ()  # per stage run, in order

    @property
    def guards(self) -> tuple[tuple[int, Any], ...]:
        """The argument values the plan folded (`Specialization.guards`); none before `specialize`."""
        return () if self.specialization is None else self.specialization.guards


@dataclasses.dataclass(frozen=True)
class Stage:
    """One named step of planning: `run` fills its field of `Planning`,
    `dump` says what it made, for `LONGSTRAW_DUMP`."""

    name: str
    run: Callable[[Planning], Planning]
    dump: Callable[[Planning], str]

    def apply(self, planning: Planning) -> Planning:
        start = time.perf_counter()
        planning = self.run(planning)
        planning = dataclasses.replace(planning, seconds=(*planning.seconds, (self.name, time.perf_counter() - start)))
        log = logging.getLogger(f"longstraw.pipeline.{self.name}")
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s\n%s", self.name, self.dump(planning))
        return planning


def _specialize(p: Planning) -> Planning:
    return dataclasses.replace(p, specialization=specialize(p.gm, p.args))


def _classify(p: Planning) -> Planning:
    gm = p.specialization.gm
    params = {n for n, a in zip(gm.graph.find_nodes(op="placeholder"), p.args) if is_module_state(n, a)}
    return dataclasses.replace(p, partition=classify(gm, params, p.passes))


def _state(p: Planning) -> Planning:
    return dataclasses.replace(p, partition=with_state(p.partition))


def _codegen(p: Planning) -> Planning:
    return dataclasses.replace(p, program=compile_program(p.partition, p.options.head_chunk_size))


def _size(p: Planning) -> Planning:
    sized, room = size_plan(p.program, p.options, p.args, p.activations)
    return dataclasses.replace(p, sized=sized, room=room)


def _runner(p: Planning) -> Planning:
    room = p.room
    runner = GroupRunner(p.program, p.sized, state_room=room.states, graph_room=room.graphs,
                         graph_chunk_bytes=room.graph_chunk, step_bytes=room.step, branch_room=room.spare,
                         kept_bytes=p.kept_bytes, step_seconds=p.step_seconds)
    if p.sized.prompt_grad == "exact":
        runner.batch.check_prompt_gradients([isinstance(a, torch.Tensor) and a.requires_grad for a in p.args],
                                            runner.prefix.externals)
    return dataclasses.replace(p, runner=runner)


def _dump_specialization(p: Planning) -> str:
    guards = ", ".join(f"argument {i} = {v!r}" for i, v in p.guards) or "none"
    return f"folded argument values (the plan is keyed on them): {guards}\n{p.specialization.gm.code}"


def _dump_partition(p: Planning) -> str:
    part = p.partition
    lines = [f"group of {part.group_size} rows, {part.seq_len} positions, first read by the loss at "
             f"{part.first_consumed}, run up to {part.end}"]
    lines += [f"claimed: {node.name} by {claim.name}" for node, claim in part.claims.items()]
    lines += [f"root: {root.node.name} (batch dim {root.batch_dim}, token dim {root.token_dim})" for root in part.roots]
    lines += [f"slot {slot.index}: {slot.label()}" for slot in part.slots]
    counts = {"sequence": part.sequence, "positional": part.positional, "branch": part.branch, "tail": part.tail,
              "outer data": part.outer_data}
    lines.append("nodes: " + ", ".join(f"{len(nodes)} {what}" for what, nodes in counts.items()))
    return "\n".join(lines)


def _dump_program(p: Planning) -> str:
    program = p.program
    steps = {"outer": program.outer, "prompt step": program.prefix, "branch step": program.branch,
             "tail": program.tail}
    return "\n".join(f"--- {name}\n{step.module.code}" for name, step in steps.items())


def _dump_size(p: Planning) -> str:
    o, room = p.sized, p.room
    return (f"prefix_chunk_size={o.prefix_chunk_size}, recompute_layers={o.recompute_layers}; room for the "
            f"backward: {room.states} bytes of earlier groups' states, {room.graphs} bytes of kept graphs "
            f"({room.graph_chunk} per chunk or branch), {room.step} bytes the step needs")


def _dump_runner(p: Planning) -> str:
    r = p.runner
    return (f"keeps graphs: {r.keeps_graphs} (branches: {r.keeps_branch_graphs}); "
            f"{len(r.stages)} stage(s); context parallel: {r.ranks is not None}")


@contextlib.contextmanager
def young_garbage_only() -> Iterator[None]:
    """Python's cyclic garbage collector off while a plan is made, then one
    collection of the two young generations.

    Planning makes hundreds of thousands of short-lived objects (graph
    copies, fake tensors). With the collector on, those alive at one of its
    young collections are promoted to the oldest generation, and every
    several new lengths that sets off a full collection, which walks the
    half million objects Dynamo leaves in a process: on a 2-core CPU one or
    two plans in twenty took 0.3 to 0.4 s more, a fifth to a third of all
    planning time (decision 0040). With it off until the plan is made, the
    collection at the end frees planning's cycles while they are young and
    promotes only what the plan keeps."""
    enabled = gc.isenabled()
    with without_cyclic_gc():
        try:
            yield
        finally:
            if enabled:  # before the collector is on again: its counts, reset, set off nothing at once
                gc.collect(1)


def run_pipeline(planning: Planning) -> Planning:
    """Every stage of `PIPELINE` in order, the collector held off (`young_garbage_only`)."""
    with young_garbage_only():
        for stage in PIPELINE:
            planning = stage.apply(planning)
    return planning


PIPELINE: tuple[Stage, ...] = (
    Stage("specialize", _specialize, _dump_specialization),
    Stage("classify", _classify, _dump_partition),
    Stage("state", _state, _dump_partition),
    Stage("codegen", _codegen, _dump_program),
    Stage("size", _size, _dump_size),
    Stage("runner", _runner, _dump_runner),
)
"""The stages of planning, in the order they run."""


def is_module_state(placeholder: fx.Node, value: Any) -> bool:
    """Parameters and buffers: shared by every row of the group whatever
    their `requires_grad`. Everything else is data, per row or shared as its
    dimensions say (advantages that require grad are still per row)."""
    return isinstance(value, torch.nn.Parameter) or "_parameters_" in placeholder.name or "_buffers_" in placeholder.name


def dumped_stages(value: str | None) -> tuple[str, ...]:
    """The stages `LONGSTRAW_DUMP`'s value names (`all`: every one)."""
    if not value:
        return ()
    names = [n.strip() for n in value.split(",") if n.strip()]
    if names == ["all"]:
        return tuple(s.name for s in PIPELINE)
    known = {s.name for s in PIPELINE}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise LongStrawError(f"{DUMP_VARIABLE}={value!r} names no stage {', '.join(map(repr, unknown))}: the stages are "
                             f"{', '.join(s.name for s in PIPELINE)} (or 'all')")
    return tuple(names)


def enable_dumps(value: str | None = None) -> None:
    """Log the output of the stages `value` names (default: the `LONGSTRAW_DUMP`
    environment variable) to stderr."""
    for name in dumped_stages(os.environ.get(DUMP_VARIABLE) if value is None else value):
        log = logging.getLogger(f"longstraw.pipeline.{name}")
        log.setLevel(logging.DEBUG)
        if not log.handlers:
            log.addHandler(logging.StreamHandler())
