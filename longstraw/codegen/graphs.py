"""Generated graphs: the `StepGraph` record, and the two graphs around the steps.

- `outer`: computes, once per call and without autograd, the roots and the
  data-only values the steps read;
- `tail`: the nodes after the branch outputs, run under autograd.

The steps themselves (prefix and branch kinds) are `stepgraph.py`'s.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from longstraw.analysis.partition import Partition
from longstraw.codegen.head import HeadRegion
from longstraw.nodes import is_grad_mode_switch


@dataclasses.dataclass(frozen=True)
class StepGraph:
    """A generated graph and the original nodes its inputs stand for."""

    module: fx.GraphModule
    externals: list[fx.Node]  # placeholder i of `module` (after ctx) is externals[i]
    head: HeadRegion | None = None  # the region run chunk by chunk (`head.py`), if any


def needed_for(outputs: list[fx.Node], stop: set[fx.Node], positional: set[fx.Node] = frozenset()) -> set[fx.Node]:
    """Ancestors of `outputs`, not looking past `stop`. Nodes in `positional` are emitted as query x key
    blocks, not as themselves: only the inputs they read from outside are needed."""
    needed: set[fx.Node] = set()
    visited: set[fx.Node] = set()
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if n in visited:
            continue
        visited.add(n)
        if n not in positional:
            needed.add(n)
        if n in stop:
            continue
        stack.extend(n.all_input_nodes)
    return needed


class GradModeReplay:
    """Replays the graph's `_set_grad_enabled` regions in a generated graph,
    emitting a switch only where an emitted node needs another mode than
    the last one. Modes are and-ed with the mode at entry, so a region that
    re-enables grad (HF's rotary embedding does) cannot turn autograd on
    inside a no-grad capture."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        self.ambient = graph.call_function(torch.is_grad_enabled)
        self.wanted = self.emitted = True

    def track(self, node: fx.Node) -> bool:
        """Record a switch of the original graph; True if `node` is one."""
        if is_grad_mode_switch(node):
            self.wanted = bool(node.args[0])
            return True
        return False

    def sync(self) -> None:
        if self.wanted != self.emitted:
            flag = self.graph.call_function(operator.and_, (self.wanted, self.ambient))
            self.graph.call_function(torch._C._set_grad_enabled, (flag,))
            self.emitted = self.wanted

    def restore(self) -> None:
        self.wanted = True
        self.sync()


def generated_module(graph: fx.Graph, name: str, root: torch.nn.Module | None = None) -> fx.GraphModule:
    """A module running `graph`. Its Python code is generated when it first
    runs (`_LazyGraphModule`, as Inductor's passes use it): once, however
    often the graph is edited and recompiled before, and never for a graph
    that does not run."""
    graph.lint()
    return _LazyGraphModule(torch.nn.Module() if root is None else root, graph, class_name=name)


def build_outer(part: Partition) -> StepGraph:
    """Roots and data values the steps import, from the original placeholders."""
    return build_from_inputs(part, step_imports(part), "LongStrawOuter")


def build_from_inputs(part: Partition, values: list[fx.Node], name: str) -> StepGraph:
    """A graph computing `values` from the original placeholders, as the
    whole graph does (the scorer's masks, `read_cut.py`, use it too)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {p: graph.placeholder(p.name) for p in part.placeholders}
    needed = needed_for(values, set(part.placeholders))
    for node in part.graph.nodes:
        if node in needed and node.op != "placeholder":
            env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(tuple(env[n] for n in values))
    return StepGraph(generated_module(graph, name), list(part.placeholders))


def step_imports(part: Partition) -> list[fx.Node]:
    """Values computed once per call by the outer graph: roots, and data-only
    nodes read by sequence or branch nodes."""
    roots = [r.node for r in part.roots]
    used: dict[fx.Node, None] = {r: None for r in roots}
    for node in part.graph.nodes:
        if node in part.sequence or node in part.branch:
            if node in roots:
                continue
            for a in node.all_input_nodes:
                if a in part.outer_data:
                    used[a] = None
    return list(used)


def build_tail(part: Partition) -> StepGraph:
    """The original graph after the branch outputs: `tail(*placeholders, *branch_outputs)`."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {p: graph.placeholder(p.name) for p in part.placeholders}
    for out in part.branch_outputs:
        env[out] = graph.placeholder(f"branch_{out.name}")
    output = next(iter(part.graph.find_nodes(op="output")))
    needed = needed_for([output], set(env))
    grad_mode = GradModeReplay(graph)
    for node in part.graph.nodes:
        if grad_mode.track(node) or node in env or node not in needed or node is output:
            continue
        grad_mode.sync()
        env[node] = graph.node_copy(node, lambda a: env[a])
    grad_mode.restore()  # the caller's mode on return, where a region was left open at the output
    graph.node_copy(output, lambda a: env[a])
    return StepGraph(generated_module(graph, "LongStrawTail"), list(part.placeholders) + part.branch_outputs)
