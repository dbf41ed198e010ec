"""`longstraw.explain`: what the backend does with a loss, and whether a run fits.

`explain(loss_fn, *example_args)` plans the loss on small example inputs
and stops before running anything. The report holds the partitioned graph
as a networkx graph (regions: the per-position model body that runs over
prompt chunks and is replayed per branch, the per-branch region after the
exits, the tail that reduces the branches), every captured state tensor
with its layer, operator and source line, and a memory model:

    peak = weights + grads + state(P) [+ d(state)(P), exact mode] + activations

State sizes are exact (they are the planned buffers); the activations
(one branch replay or one prompt or reverse chunk, whichever is larger,
and kernel workspaces) come from simulating the whole planned step on fake
tensors at the example's sizes (`longstraw.planning.planner`), and are reused for
other P and G: trace the example at the real model shapes and response
length (on the meta device this costs nothing) with a prompt of a few
chunks, so one chunk and one flash key block are full size.
"""

from __future__ import annotations

import dataclasses
import html
import importlib.resources
import json
import logging
import types
from collections.abc import Callable
from typing import Any

import torch

from longstraw.passes import ArchitecturePass

from longstraw.backend import Backend, GroupPlan, PlanningDone
from longstraw.errors import LongStrawError
from longstraw.planning.graph_model import COLORS, REGION_TITLES, REGIONS, describe_slot, graph_model
from longstraw.nodes import tensor_of
from longstraw.options import Options
from longstraw.planning.planner import (
    DEFAULT_CHUNK,
    KeptGraphs,
    MemoryModel,
    MemoryPlan,
    context_ranks,
    default_budget,
    kept_graphs,
)
from longstraw.planning.sizing import KEEP_EVERY_STATE
from longstraw.planning.step_time import RATES, StepWork, predict, simulate_work
from longstraw.runtime.kept_graphs import branch_graphs_keepable, graphs_keepable, one_row_reason, rows_per_step
from longstraw.runtime.schedule import ChunkSchedule

log = logging.getLogger("longstraw.planning.report")


class ExplainReport:
    """What `explain` found; see the module docstring for the memory model."""

    def __init__(self, plan: GroupPlan, options: Options | None = None,
                 activations: dict[tuple, dict[int, int]] | None = None) -> None:
        self.group_plan = plan
        # the options asked for: the plan's have the chunk size and recomputation decided
        self.options: Options = options or plan.options
        part = plan.partition
        self.graph = graph_model(plan)
        self.state = [describe_slot(part, slot) for slot in part.slots]
        self.memory = MemoryModel(plan.program, plan.options, activations)
        self.weights_bytes, self.grads_bytes = self.memory.weights, self.memory.grads
        self.traced_positions = part.seq_len
        self.traced_group_size = part.group_size
        self.traced_response_len = self.memory.branch_len
        params = [tensor_of(p) for p in part.placeholders if p in part.params and tensor_of(p) is not None]
        self.example_device = params[0].device if params else torch.device("cpu")
        self._work: dict[tuple, StepWork | None] = {}  # (recompute, device, dtype) -> the simulated `StepWork`

    @property
    def traced_prompt_len(self) -> int:
        """P of the traced example (its branches open with the last prompt token)."""
        return self.traced_positions - self.traced_response_len + 1

    @property
    def state_bytes_per_position(self) -> int:
        """All captured per-position state of one group's prompt."""
        return sum(t.bytes_per_position for t in self.state)

    @property
    def state_fixed_bytes(self) -> int:
        """Captured state whose size does not grow with P (kept at every chunk boundary)."""
        return sum(t.fixed_bytes for t in self.state)

    def plan(
        self,
        P: int,
        G: int | None = None,
        R: int | None = None,
        budget_gb: float | None = None,
        prompt_grad: str | None = None,
        prefix_chunk_size: int | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        recompute_layers: bool | None = None,
        ranks: int | None = None,
        tflops: float | None = None,
        op_us: float | None = None,
    ) -> MemoryPlan:
        """Predicted peak for a group of G branches of R positions after a
        P-token prompt (R as in the plan summary: the positions one branch
        runs). `device` (default: the example's) decides the attention
        kernels; `dtype` recasts the example's floating parameters and
        activations (state keeps its own dtype: float32 recurrent state).

        The chunk size and recomputation are the arguments', else the
        options'; where both leave one open they are chosen as the backend
        would choose them (the `prefix_chunk_size` and `recompute_layers` of
        the result) for the budget: `budget_gb`, else the options'
        `memory_budget_gb`, else on CUDA the device's free memory; with
        none of these, 8192 without recomputation. `ranks` (default: the
        options' `context_parallel` group's size, else 1) predicts one
        rank's peak with the prompt state sharded over that many.

        The result's `time` is the step's predicted time on one rank
        (`longstraw.planning.step_time`) at `tflops` (achieved TFLOP/s) and
        `op_us` (microseconds per operator launched), by default the
        measured `step_time.RATES` of the device type for 16-bit floats;
        None where neither applies (the CPU, float32) or under `ranks` > 1."""
        G = self.traced_group_size if G is None else G
        R = self.traced_response_len if R is None else R
        mode = prompt_grad or self.options.prompt_grad
        chunk = prefix_chunk_size or self.options.prefix_chunk_size
        recompute = self.options.recompute_layers if recompute_layers is None else recompute_layers
        device = torch.device(device) if device is not None else self.example_device
        budget_gb = self.options.memory_budget_gb if budget_gb is None else budget_gb
        budget = default_budget(device) if budget_gb is None else int(budget_gb * 1e9)
        ranks = context_ranks(self.options) if ranks is None else ranks
        if budget is not None and (chunk is None or recompute is None):
            chosen = self.memory.choose(P, R, mode, device, budget, chunk, recompute, dtype, ranks)
            chunk, recompute = chosen.prefix_chunk_size, chosen.recompute_layers
        chunk = DEFAULT_CHUNK if chunk is None else chunk
        plan = self.memory.predict(P, G, R, mode, chunk, bool(recompute), device, dtype, budget, ranks)
        if budget is not None:
            plan = dataclasses.replace(plan, kept=self._kept(plan, budget))
        rate = self._rate(device, dtype, tflops, op_us)
        if rate is None or plan.ranks > 1:
            return plan
        key = (plan.recompute_layers, str(device), dtype)
        if key not in self._work:
            try:
                self._work[key] = simulate_work(self.group_plan.program, self.options, plan.recompute_layers, device,
                                                dtype)
            except (ValueError, LongStrawError) as err:  # an example too small to fit the costs from, say
                log.warning("longstraw: no predicted time for this plan: %s", err)
                self._work[key] = None
        if self._work[key] is None:
            return plan
        try:
            time = predict(self._work[key], P, G, R, mode == "exact", plan.prefix_chunk_size, plan.kept, *rate)
        except ValueError as err:
            log.warning("longstraw: no predicted time for this plan: %s", err)
            return plan
        return dataclasses.replace(plan, time=time)

    def _rate(self, device: torch.device, dtype: torch.dtype | None, tflops: float | None,
              op_us: float | None) -> tuple[float, float] | None:
        """(FLOP/s, seconds per operator): the arguments', else the device
        type's measured `RATES` for 16-bit floats."""
        known = RATES.get(device.type) if (dtype or self.memory.float_dtype).itemsize == 2 else None
        if tflops is None and known is None:
            return None
        rate = tflops * 1e12 if tflops is not None else known[0]
        per_op = op_us * 1e-6 if op_us is not None else (known[1] if known is not None else 0.0)
        return rate, per_op

    def _kept(self, plan: MemoryPlan, budget: int) -> KeptGraphs:
        """The graphs a run of `plan` keeps for the backward in the budget's
        room beside its peak (`keep_graphs`: None, as room allows; True,
        all; False, none), as `GroupRunner` decides at a group's forward."""
        o, program = self.options, self.group_plan.program
        keeps = plan.ranks == 1 and graphs_keepable(
            program, dataclasses.replace(o, recompute_layers=plan.recompute_layers, context_parallel=None))
        exact = plan.prompt_grad == "exact"
        branches = keeps and branch_graphs_keepable(program)
        spare = max(budget - plan.peak, 0)
        room = KEEP_EVERY_STATE if o.keep_graphs else spare if o.keep_graphs is None else 0
        rows = 1
        if one_row_reason(program, plan.ranks > 1) is None:
            rows = rows_per_step(o.branch_rows, plan.G, spare, plan.activations)
        chunks = ChunkSchedule(max(plan.P - 1, 1), plan.prefix_chunk_size).count
        return kept_graphs(room, plan.activations, chunks, plan.G, exact, keeps and exact and self.grads_bytes > 0,
                           branches, rows, (plan.P - 1, plan.R), o.branch_rows is None and keeps)

    # views ---------------------------------------------------------------

    def state_table(self) -> str:
        lines = [f"{'#':>3} {'kind':8} {'dtype':9} {'B/position':>11} {'fixed B':>11}  layer / operator / source"]
        for t in self.state:
            lines.append(
                f"{t.index:>3} {t.kind:8} {str(t.dtype).removeprefix('torch.'):9} {t.bytes_per_position:>11} "
                f"{t.fixed_bytes:>11}  {t.layer or '-'} / {t.operator} / {t.source or '-'}"
            )
        lines.append(f"    total: {self.state_bytes_per_position} B per prompt position, {self.state_fixed_bytes} B fixed")
        return "\n".join(lines)

    def __str__(self) -> str:
        counts = {r: sum(1 for _, d in self.graph.nodes(data=True) if d["region"] == r) for r in REGIONS}
        head = ", ".join(f"{r} {counts[r]}" for r in REGIONS if counts[r])
        program = self.group_plan.program
        cut = ("stop after each row's last read position (analysis/read_cut.py)" if program.read_masks is not None
               else f"run every position: {program.uncut}")
        return f"longstraw explain: graph nodes by region: {head}\nbranch steps: {cut}\n{self.state_table()}"

    def to_dot(self) -> str:
        """Graphviz DOT: one cluster per region, nested clusters per layer, state edges red."""
        lines = ["digraph longstraw {", "  rankdir=TB; node [shape=box, fontsize=10];"]
        for region in REGIONS:
            members = [n for n, d in self.graph.nodes(data=True) if d["region"] == region]
            if not members:
                continue
            lines.append(f'  subgraph cluster_{region} {{ label="{REGION_TITLES[region]}"; color="{COLORS[region]}";')
            by_layer: dict[str, list[str]] = {}
            for n in members:
                by_layer.setdefault(self.graph.nodes[n]["layer"] or "", []).append(n)
            for i, (layer, nodes) in enumerate(by_layer.items()):
                indent = "    "
                if layer:
                    lines.append(f'    subgraph cluster_{region}_{i} {{ label="{layer}"; style=dashed;')
                    indent = "      "
                for n in nodes:
                    d = self.graph.nodes[n]
                    label = f"{d['op']}\\n{d['shape']}"
                    lines.append(f'{indent}"{n}" [label="{label}", color="{COLORS[region]}"];')
                if layer:
                    lines.append("    }")
            lines.append("  }")
        for a, b, d in self.graph.edges(data=True):
            style = ' [color="#d62728", penwidth=2]' if d.get("state") else ""
            lines.append(f'  "{a}" -> "{b}"{style};')
        lines.append("}")
        return "\n".join(lines)

    def to_html(self, path: str, P: int | None = None, G: int | None = None, R: int | None = None,
                budget_gb: float | None = None, ranks: int | None = None) -> None:
        """One self-contained page: regions side by side, layers collapsible,
        state edges drawn over the page, details on hover; the plan table
        for P, G, R when given."""
        nodes = []
        for n, d in self.graph.nodes(data=True):
            nodes.append({"id": n, **{k: d[k] for k in ("region", "op", "layer", "shape", "dtype", "source", "detail")}})
        edges = [{"from": a, "to": b} for a, b, d in self.graph.edges(data=True) if d.get("state")]
        plan = self.plan(P, G, R, budget_gb, ranks=ranks).table() if P else ""
        data = json.dumps({"nodes": nodes, "stateEdges": edges, "regions": [r for r in REGIONS],
                           "titles": REGION_TITLES, "colors": COLORS})
        page = _page().replace("__DATA__", data.replace("</", "<\\/"))
        page = page.replace("__STATE__", html.escape(self.state_table())).replace("__PLAN__", html.escape(plan))
        with open(path, "w", encoding="utf-8") as f:
            f.write(page)


def explain(
    loss_fn: Callable[..., Any],
    *example_args: Any,
    options: Options | dict | None = None,
    passes: tuple[ArchitecturePass, ...] | None = None,
    **example_kwargs: Any,
) -> ExplainReport:
    """Plan `loss_fn` on example inputs without running it and describe the plan.

    The example can be small: state sizes per position do not depend on P,
    and `report.plan(P=...)` extrapolates."""
    opts = dataclasses.replace(Options.from_any(options), on_unsupported="error")
    backend = Backend(opts, passes=passes)
    backend.stop_after_planning = True
    compiled = torch.compile(_with_code_of_its_own(loss_fn), backend=backend)
    try:
        compiled(*example_args, **example_kwargs)
    except PlanningDone as done:
        return ExplainReport(done.plan, opts, done.activations)
    raise LongStrawError(
        "explain: the loss ran without a graph reaching the backend (was it compiled before with another "
        "backend in a way Dynamo reuses, or does it contain no tensor operations?)"
    )


def _with_code_of_its_own(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, where it is a plain function, as a copy with a code object of its
    own. Dynamo keeps compiled code, and counts recompiles against
    `recompile_limit`, per code object: each `explain` then compiles afresh
    and leaves nothing behind (the copy's entries go with it), where
    explaining a loss for several models would otherwise add a compile of the
    loss per model and reach the limit of the user's own compiles of it."""
    if not isinstance(fn, types.FunctionType):
        return fn
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    copy.__dict__.update(fn.__dict__)
    return copy


def _page() -> str:
    """The explain page's template (package data: `longstraw/templates/explain.html`)."""
    return importlib.resources.files("longstraw").joinpath("templates/explain.html").read_text(encoding="utf-8")
