"""The `longstraw` torch.compile backend.

Dynamo hands over the FX graph of the whole loss with parameters lifted to
placeholders. Planning happens at the first call for each input signature:
the graph is specialised to the concrete sizes (so graphs traced with
`dynamic=True` plan the same way as static ones), every node's value is
recorded with FakeTensor propagation, then partitioned and turned into
step graphs. Plans are cached per signature; new prompt or response lengths
re-plan without recompiling in Dynamo.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from longstraw.passes import DEFAULT_PASSES, ArchitecturePass

from .errors import UnsupportedGraphError
from .options import Options
from .partition import Partition, partition
from .runtime import GroupFunction, GroupRunner
from .stepgraph import StepGraph, build_outer, build_step, build_tail

log = logging.getLogger("longstraw")


@dataclasses.dataclass
class GroupPlan:
    """The typed record of what the backend did with one graph and signature."""

    partition: Partition
    runner: GroupRunner
    tail: StepGraph
    options: Options

    @property
    def num_branches(self) -> int:
        return self.partition.group_size

    @property
    def seq_len(self) -> int:
        return self.partition.seq_len

    @property
    def prefix_len(self) -> int:
        """Prompt positions captured as state (the last call's, when it depends on values)."""
        if self.runner.last_prefix_len is not None:
            return self.runner.last_prefix_len
        if all(r.structural_prefix is not None for r in self.partition.roots):
            return self.runner.prefix_len({})
        return -1

    @property
    def state_bytes_per_position(self) -> int:
        """Captured bytes per prompt position of one group (K/V and the like)."""
        return sum(s.bytes_per_position() for s in self.partition.slots)

    @property
    def state_fixed_bytes(self) -> int:
        """Captured bytes that do not grow with the prompt (recurrent and conv state)."""
        return sum(s.fixed_bytes() for s in self.partition.slots)

    def summary(self) -> str:
        part = self.partition
        lines = [
            f"longstraw plan: G={part.group_size} sequences of {part.seq_len} positions, "
            f"prompt_grad={self.options.prompt_grad}, prefix_chunk_size={self.options.prefix_chunk_size}",
            f"  prefix: {len(self.runner.prefix.module.graph.nodes)} nodes per chunk, "
            f"{self.prefix_len} prompt positions captured",
            f"  branch: {len(self.runner.branch.module.graph.nodes)} nodes per response, "
            f"{part.end - max(self.prefix_len, 0)} positions each",
            f"  tail:   {len(self.tail.module.graph.nodes)} nodes on {len(part.branch_outputs)} stacked branch output(s): "
            + ", ".join(f"{n.name}{list(n.meta['longstraw_value'].shape)}" for n in part.branch_outputs),
            f"  state:  {len(part.slots)} tensors, {self.state_bytes_per_position} bytes per prompt position, "
            f"{self.state_fixed_bytes} bytes fixed",
        ]
        for slot in part.slots:
            size = (
                f"{slot.bytes_per_position()} B/position" if slot.kind == "sequence" else f"{slot.fixed_bytes()} B carried"
            )
            lines.append(
                f"    [{slot.index}] {slot.node.name} {list(slot.shape)} {str(slot.dtype).replace('torch.', '')} "
                f"({size}) for {slot.reason}"
            )
        return "\n".join(lines)


class PlanningDone(Exception):  # noqa: N818 - control flow, not an error
    """Raised instead of running the loss when a backend only plans (`longstraw.explain`)."""

    def __init__(self, plan: GroupPlan) -> None:
        super().__init__("planned; nothing was run")
        self.plan = plan


class Backend:
    """A `torch.compile` backend object; `backend="longstraw"` makes a fresh one.

    `plans` lists a `GroupPlan` per compiled graph and input signature, in
    the order they were made. With `stop_after_planning`, the first call
    raises `PlanningDone` instead of running (how `explain` plans)."""

    def __init__(
        self,
        options: Options | Mapping[str, Any] | None = None,
        *,
        passes: tuple[ArchitecturePass, ...] = DEFAULT_PASSES,
        **option_fields: Any,
    ) -> None:
        if option_fields:
            options = {**dataclasses.asdict(Options.from_any(options)), **option_fields}
        self.options = Options.from_any(options)
        self.passes = passes
        self.plans: list[GroupPlan] = []
        self.stop_after_planning = False

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], options: Any = None) -> Callable:
        opts = self.options if options is None else Options.from_any(options)
        return CompiledGroupLoss(gm, opts, self)


def longstraw_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: Any = None) -> Callable:
    """Entry point for `torch.compile(..., backend="longstraw", options={...})`."""
    return Backend(options)(gm, example_inputs)


class CompiledGroupLoss:
    """What Dynamo calls in place of the loss graph."""

    def __init__(self, gm: fx.GraphModule, options: Options, backend: Backend) -> None:
        self.gm = gm
        self.options = options
        self.backend = backend
        self.plans: dict[tuple, GroupPlan | None] = {}
        self.warned = False

    def __call__(self, *args: Any) -> Any:
        key = _signature(args)
        if key not in self.plans:
            self.plans[key] = self._plan(args)
        plan = self.plans[key]
        if plan is not None and self.backend.stop_after_planning:
            raise PlanningDone(plan)
        if plan is None:
            return self.gm(*args)
        outputs = GroupFunction.apply(plan.runner, *args)
        return plan.tail.module(*args, *outputs)

    def _plan(self, args: Sequence[Any]) -> GroupPlan | None:
        gm = specialize(self.gm, args)
        params = {
            p for p, a in zip(gm.graph.find_nodes(op="placeholder"), args)
            if isinstance(a, torch.nn.Parameter) or "_parameters_" in p.name or "_buffers_" in p.name
            or (isinstance(a, torch.Tensor) and a.requires_grad)
        }
        try:
            part = partition(gm, params, self.backend.passes)
            runner = GroupRunner(part, self.options, build_outer(part), build_step(part, "prefix"), build_step(part, "branch"))
            plan = GroupPlan(part, runner, build_tail(part), self.options)
        except UnsupportedGraphError as err:
            if self.options.on_unsupported == "error":
                raise
            if not self.warned:
                warnings.warn(f"longstraw: running the loss graph unchanged (no memory savings): {err}", stacklevel=2)
                self.warned = True
            return None
        self.backend.plans.append(plan)
        log.info("%s", plan.summary())
        return plan


def _signature(args: Sequence[Any]) -> tuple:
    return tuple(
        (tuple(a.shape), a.dtype, a.device, a.requires_grad) if isinstance(a, torch.Tensor) else (type(a), a)
        for a in args
    )


class _Recorder(fx.Interpreter):
    def run_node(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        n.meta["longstraw_value"] = value
        return value


def specialize(gm: fx.GraphModule, args: Sequence[Any]) -> fx.GraphModule:
    """A copy of `gm` with every integer computed from sizes folded to a
    constant for these `args`, and each node's FakeTensor value recorded in
    `node.meta["longstraw_value"]`."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copy = fx.GraphModule(gm, graph)
    _fold_scalar_inputs(copy, args)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake_args = [fake_mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a for a in args]
    with fake_mode, torch.no_grad():
        _Recorder(copy).run(*fake_args)
    for node in list(copy.graph.nodes):
        value = node.meta.get("longstraw_value")
        if node.op != "output" and not isinstance(value, bool) and isinstance(value, (int, torch.SymInt)):
            _replace_with_constant(node, int(value))
    copy.graph.eliminate_dead_code()
    copy.recompile()
    return copy


def _replace_with_constant(node: fx.Node, constant: Any) -> None:
    for user in list(node.users):
        user.args = fx.node.map_arg(user.args, lambda a: constant if a is node else a)
        user.kwargs = fx.node.map_arg(user.kwargs, lambda a: constant if a is node else a)
    if node.op != "placeholder":
        node.graph.erase_node(node)


def _fold_scalar_inputs(gm: fx.GraphModule, args: Sequence[Any]) -> None:
    """`x.item()` of a scalar input (Dynamo lifts Python floats such as
    `F.embedding`'s norm_type to tensors under `dynamic=True`) becomes its value."""
    for placeholder, value in zip(list(gm.graph.find_nodes(op="placeholder")), args):
        for user in list(placeholder.users):
            if user.op == "call_method" and user.target == "item" and isinstance(value, torch.Tensor):
                _replace_with_constant(user, value.item())
