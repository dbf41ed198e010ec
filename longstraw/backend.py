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
import inspect
import logging
import os
import re
import types
import warnings
from collections import OrderedDict, deque
from typing import Any, Callable, Literal, Mapping, Sequence

import torch
import torch.fx as fx
from torch.utils.weak import WeakIdKeyDictionary

from longstraw.analysis.partition import Partition
from longstraw.analysis.slots import SlotKind
from longstraw.codegen.graphs import StepGraph
from longstraw.codegen.program import StepProgram
from longstraw.errors import LongStrawError, UnsupportedGraphError, module_path, name_arguments
from longstraw.options import Options
from longstraw.pass_registry import active_passes
from longstraw.passes import ArchitecturePass
from longstraw.pipeline import Planning, run_pipeline
from longstraw.planning.planner import Simulations
from longstraw.planning.sizing import KEEP_EVERY_STATE
from longstraw.runtime.autograd_boundary import GroupFunction
from longstraw.runtime.kept_graphs import one_row_reason
from longstraw.runtime.runner import GroupRunner
from longstraw.runtime.step_seconds import StepSeconds
from longstraw.trace.specialize import scalar_of
from longstraw.trace.whole_graph import DDP_SPLIT, is_ddp_split, partial_graph_reason

log = logging.getLogger("longstraw")


@dataclasses.dataclass(frozen=True)
class Fallback:
    """A graph the backend ran unchanged (`on_unsupported="eager"`), and why.

    `kind`: "ddp_split" (DDPOptimizer cut the loss into pieces), "partial_graph"
    (Dynamo handed over part of the loss) or "unsupported" (the analysis
    refused the graph); `node`: the graph node at fault, where there is one."""

    kind: Literal["ddp_split", "partial_graph", "unsupported"]
    reason: str
    node: str | None = None
    module: str | None = None


@dataclasses.dataclass(frozen=True)
class PlanSeconds:
    """Where planning one signature took its time (Dynamo's trace is not in it)."""

    specialize: float  # the graph at these sizes, values recorded (`specialize.py`)
    analysis: float  # classification, state and the generated steps (`StepProgram`)
    memory: float  # the planner's choice of chunk and recomputation, its simulations included

    @property
    def total(self) -> float:
        return self.specialize + self.analysis + self.memory


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """The typed record of what the backend did with one graph and
    signature: the program (the partition: claims, axes, regions, state;
    the generated steps and the tail), the options the planner chose and
    the runner built from both. It does not change between calls; what a
    call decided from its values is `runner.last_call`."""

    program: StepProgram
    runner: GroupRunner
    options: Options
    seconds: PlanSeconds

    @property
    def partition(self) -> Partition:
        return self.program.partition

    @property
    def tail(self) -> StepGraph:
        return self.program.tail

    @property
    def num_branches(self) -> int:
        return self.partition.group_size

    @property
    def seq_len(self) -> int:
        return self.partition.seq_len

    @property
    def prefix_len(self) -> int | None:
        """Prompt positions captured as state: fixed by the graph, or the
        last call's where it depends on the values (None before a call)."""
        structural = self.program.structural_prefix_len
        if structural is not None:
            return structural
        return None if self.runner.last_call is None else self.runner.last_call.prefix_len

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
            + ("the prompt positions captured are decided per call from the values" if self.prefix_len is None
               else f"{self.prefix_len} prompt positions captured"),
            f"  branch: {len(self.runner.branch.module.graph.nodes)} nodes per response"
            + ("" if self.prefix_len is None else f", {part.end - self.prefix_len} positions each"),
            f"  tail:   {len(self.tail.module.graph.nodes)} nodes on {len(part.branch_outputs)} stacked branch output(s): "
            + ", ".join(f"{n.name}{list(n.meta['longstraw_value'].shape)}" for n in part.branch_outputs),
            f"  state:  {len(part.slots)} tensors, {self.state_bytes_per_position} bytes per prompt position, "
            f"{self.state_fixed_bytes} bytes fixed",
            f"  schedule: recompute_layers={self.options.recompute_layers}, {self._kept_graphs()}",
            f"  branch steps: {self._branch_rows()}",
            f"  planned in {self.seconds.total:.3f} s: specialisation {self.seconds.specialize:.3f}, analysis "
            f"{self.seconds.analysis:.3f}, memory {self.seconds.memory:.3f} (Dynamo's trace not counted)",
        ]
        for slot in part.slots:
            size = (
                f"{slot.bytes_per_position()} B/position" if slot.kind == SlotKind.SEQUENCE else f"{slot.fixed_bytes()} B carried"
            )
            lines.append(
                f"    [{slot.index}] {slot.node.name} {list(slot.shape)} {str(slot.dtype).replace('torch.', '')} "
                f"({size}) for {slot.reason}"
            )
        return "\n".join(lines)

    def _branch_rows(self) -> str:
        """How many branch rows one step holds under this plan (`branch_rows`)."""
        runner = self.runner
        reason = one_row_reason(runner.program, runner.ranks is not None)
        if reason is not None:
            return f"one row each ({reason})"
        if self.options.branch_rows is not None:
            return f"{self.options.branch_rows} rows each (branch_rows={self.options.branch_rows})"
        if runner.branch_room <= 0 or runner.graph_chunk_bytes <= 0:
            return "one row each (nothing planned: set branch_rows, or a memory budget)"
        return (f"as many rows as {runner.branch_room / 1e9:.1f} GB of room holds beside the planned peak, "
                f"{runner.graph_chunk_bytes / 1e9:.2f} GB counted for each row beyond the first")

    def _kept_graphs(self) -> str:
        """What `keep_graphs` keeps for the backward under this plan."""
        runner, exact = self.runner, self.options.prompt_grad == "exact"
        kept = [what for what, keeps in (("the prompt's", exact), ("the branches'", runner.keeps_branch_graphs)) if keeps]
        if not runner.keeps_graphs or not kept:
            return "the backward replays the branches" + (" and runs the reverse pass" if exact else "")
        kept = " and ".join(kept) + (" graphs" if len(kept) > 1 else " graph" if exact else " graphs")
        if runner.graph_room >= KEEP_EVERY_STATE:
            return f"{kept} kept for the backward (keep_graphs=True)"
        return (f"{kept} kept for the backward while they fit: {runner.graph_room / 1e9:.1f} GB of room, "
                f"{runner.graph_chunk_bytes / 1e9:.2f} GB counted for each")


class PlanningDone(Exception):  # noqa: N818 - control flow, not an error
    """Raised instead of running the loss when a backend only plans (`longstraw.explain`)."""

    def __init__(self, plan: GroupPlan, activations: Simulations) -> None:
        super().__init__("planned; nothing was run")
        self.plan = plan
        self.activations = activations  # what planning simulated, for the report's plans to reuse


class Backend:
    """A `torch.compile` backend object; `backend="longstraw"` makes a fresh one.

    `plans` lists the `GroupPlan`s made for the compiled graphs, in the order
    they were made, the last `options.plan_cache_size` of them. With `stop_after_planning`, the first call
    raises `PlanningDone` instead of running (how `explain` plans)."""

    def __init__(
        self,
        options: Options | Mapping[str, Any] | None = None,
        *,
        passes: tuple[ArchitecturePass, ...] | None = None,
        **option_fields: Any,
    ) -> None:
        if option_fields:
            base = Options.from_any(options)  # field by field: `dataclasses.asdict` would deep-copy the passes
            options = {**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, **option_fields}
        self.options = Options.from_any(options)
        # the complete list when given; else the built-in, installed, registered and optioned passes
        self.passes = (active_passes(self.options.passes, self.options.disable_passes) if passes is None
                       else tuple(passes))
        self.plans: deque[GroupPlan] = deque(maxlen=self.options.plan_cache_size)
        self.fallbacks: list[Fallback] = []  # graphs run unchanged, in the order they fell back
        self.stop_after_planning = False
        _install_recompile_hook()

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], options: Any = None) -> Callable:
        opts = self.options if options is None else Options.from_any(options)
        if is_ddp_split(gm):
            if opts.on_unsupported == "error":
                return _refuse(DDP_SPLIT)
            warnings.warn(f"longstraw: running the loss graph unchanged (no memory savings): {DDP_SPLIT}", stacklevel=2)
            self.fallbacks.append(Fallback("ddp_split", DDP_SPLIT))
            return gm.forward
        name_arguments(gm)
        _remember_compiled_code(opts)
        return CompiledGroupLoss(gm, opts, self, partial_graph_reason(gm))


RECOMPILE_LIMIT = (
    "longstraw: Dynamo has compiled {where} as often as torch._dynamo.config.{limit_type} ({limit}) allows and would "
    "now run it eagerly, without calling LongStraw, on every call whose guards no compile matches: {what}. "
    "LongStraw refuses that on every such call instead. Dynamo recompiles because {reason}. Keep the "
    "loss's guards stable (the same model object; floats that change are fine, Python ints and strings that "
    "change are guarded), or raise torch._dynamo.config.recompile_limit before the first call."
)

_LONGSTRAW_CODE: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Code objects LongStraw compiled (the frame Dynamo traced) -> the prompt_grad they were compiled for. By
identity, as Dynamo keeps its caches: code objects compare equal by value, and `explain` compiles an equal
copy of the loss's, whose going must not take the loss's own entry with it."""


def _remember_compiled_code(opts: Options) -> None:
    """Record the frame Dynamo is compiling for LongStraw, for `_refuse_at_the_recompile_limit`."""
    context = torch._guards.TracingContext.try_get()
    if context is not None and context.traced_code:
        _LONGSTRAW_CODE[context.traced_code[0]] = opts.prompt_grad


def _refuse_at_the_recompile_limit() -> str:
    """A Dynamo recompile hook (`register_hook_for_recompile_user_context`,
    called before every compile and before Dynamo checks its recompile
    limit). Past the limit Dynamo runs a frame eagerly without asking the
    backend, for good: detached mode would silently get eager's exact
    gradient, exact mode eager's memory. For a frame LongStraw compiled,
    this raises instead; Dynamo then tries again at the next call, which
    raises again. Other frames are left to Dynamo."""
    from torch._dynamo import convert_frame
    from torch._dynamo.cache_size import exceeds_recompile_limit

    frame = inspect.currentframe()
    while frame is not None and frame.f_code is not convert_frame._compile.__code__:
        frame = frame.f_back
    if frame is None:
        return ""
    code, local = frame.f_locals.get("code"), frame.f_locals
    mode = _LONGSTRAW_CODE.get(code) if isinstance(code, types.CodeType) else None
    if mode is None or torch._dynamo.config.fail_on_recompile_limit_hit or local.get("one_graph"):
        return ""  # not LongStraw's, or Dynamo itself raises at the limit
    exceeded, limit_type = exceeds_recompile_limit(local["cache_size"], local["compile_id"])
    if not exceeded:
        return ""
    what = ("eager's exact gradient instead of the detached one, and no memory savings" if mode == "detached"
            else "the same gradients without LongStraw's memory savings")
    raise LongStrawError(RECOMPILE_LIMIT.format(
        where=f"`{code.co_name}` ({os.path.basename(code.co_filename)}:{code.co_firstlineno})",
        limit_type=limit_type,
        limit=getattr(torch._dynamo.config, limit_type), what=what,
        reason=_first_guard(local.get("recompile_reason")),
    ))


def _first_guard(reason: str | None) -> str:
    """`0/1: scale == 'ab'   # source...` -> "the guard `scale == 'ab'` failed"."""
    if not reason:
        return "unknown"
    guard = re.sub(r"^\d+/\d+: ", "", reason.strip().splitlines()[0]).split("  #")[0].strip()
    return f"the guard `{guard}` failed"


def _install_recompile_hook() -> None:
    from torch._dynamo.utils import get_hook_for_recompile_user_context, register_hook_for_recompile_user_context

    if _refuse_at_the_recompile_limit not in (get_hook_for_recompile_user_context() or []):
        register_hook_for_recompile_user_context(_refuse_at_the_recompile_limit)


def _refuse(message: str) -> Callable:
    """A graph that raises when it runs. DDPOptimizer compiles its pieces in
    an fx Interpreter, which appends every argument of the piece to an error
    raised while compiling; at run time the message stays as written."""

    def refuse(*args: Any) -> Any:
        raise UnsupportedGraphError(message)

    return refuse


def longstraw_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: Any = None) -> Callable:
    """Entry point for `torch.compile(..., backend="longstraw", options={...})`."""
    return Backend(options)(gm, example_inputs)


class CompiledGroupLoss:
    """What Dynamo calls in place of the loss graph.

    Plans are cached per input signature (shapes, strides, dtypes, devices,
    requires_grad, Python scalars) and, where a plan folded an argument's
    value, per that value; the cache keeps the `options.plan_cache_size`
    most recently used."""

    def __init__(self, gm: fx.GraphModule, options: Options, backend: Backend, partial: str | None = None) -> None:
        self.gm = gm
        self.partial = partial  # why Dynamo handed over only part of the loss, if it did
        self.options = options
        self.backend = backend
        self.plans: OrderedDict[tuple, GroupPlan | None] = OrderedDict()
        self.guarded: dict[tuple, tuple[int, ...]] = {}  # signature -> arguments its plans fold
        self.activations: Simulations = {}  # the planner's simulations, shared by this graph's plans
        self.kept_bytes: dict[str, float] = {}  # kept graphs' measured bytes per position, likewise
        self.step_seconds = StepSeconds()  # the steps' measured forward seconds, likewise
        self.warned = False

    def __call__(self, *args: Any) -> Any:
        plan = self._plan_for(args)
        if plan is not None and self.backend.stop_after_planning:
            raise PlanningDone(plan, self.activations)
        if plan is None:
            return self.gm(*args)
        # without a backward to follow (no_grad, or nothing requires grad) the capture keeps nothing for one
        backward = torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        outputs = GroupFunction.apply(plan.runner, backward, *args)
        return plan.tail.module(*args, *outputs)

    def _plan_for(self, args: Sequence[Any]) -> GroupPlan | None:
        signature = _signature(args)
        key = None
        if signature in self.guarded:
            key = (signature, tuple(scalar_of(args[i]) for i in self.guarded[signature]))
            if key in self.plans:
                self.plans.move_to_end(key)
                return self.plans[key]
        guards, plan = self._plan(args)
        self.guarded[signature] = tuple(i for i, _ in guards)
        key = (signature, tuple(v for _, v in guards))
        self.plans[key] = plan
        while len(self.plans) > self.options.plan_cache_size:
            self.plans.popitem(last=False)
        return self.plans[key]

    def _plan(self, args: Sequence[Any]) -> tuple[tuple[tuple[int, Any], ...], GroupPlan | None]:
        """(guards, plan); the plan is None when the graph runs unchanged.
        Specialising is part of planning: a graph it refuses (an in-place
        write into an argument, a functorch transform) follows
        `on_unsupported` like any other."""
        planning = Planning(self.gm, args, self.options, self.backend.passes, self.activations, self.kept_bytes,
                            self.step_seconds)
        try:
            planning = run_pipeline(planning)
            spent = dict(planning.seconds)
            seconds = PlanSeconds(spent["specialize"], spent["classify"] + spent["state"] + spent["codegen"],
                                  spent["size"] + spent["runner"])
            plan = GroupPlan(planning.program, planning.runner, planning.sized, seconds)
        except UnsupportedGraphError as err:
            node = err.node
            if self.partial is not None:
                cause = err
                err = UnsupportedGraphError(f"{self.partial}\n(The analysis of the piece it got failed: {cause})", node)
                err.__cause__ = cause
            if self.options.on_unsupported == "error":
                raise err
            if not self.warned:
                warnings.warn(f"longstraw: running the loss graph unchanged (no memory savings): {err}", stacklevel=2)
                self.warned = True
            kind = "unsupported" if self.partial is None else "partial_graph"
            self.backend.fallbacks.append(
                Fallback(kind, str(err), None if node is None else node.name, None if node is None else module_path(node))
            )
            return planning.guards, None
        self.backend.plans.append(plan)
        log.info("%s", plan.summary())
        return planning.guards, plan


def _signature(args: Sequence[Any]) -> tuple:
    return tuple(
        (tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad) if isinstance(a, torch.Tensor) else (type(a), a)
        for a in args
    )
