"""Layer-by-layer recomputation of the steps run under autograd.

A branch replay or a reverse-pass chunk runs its step graph with autograd
through every layer of the model, so what it holds grows with depth: at 64
layers one 1,024-token branch held about 34 GB. `LayerwiseStep` cuts a step
graph into one segment per model layer and runs each under non-reentrant
`torch.utils.checkpoint`: autograd keeps the segments' inputs (the residual
stream between layers, and what later layers read from earlier ones) and
recomputes one layer's activations at a time during the backward. The last
segment (the last layer with the LM head and the loss's per-position part,
in a branch) is not checkpointed: the backward starts there right after
its forward, so recomputing it would only repeat the head.

What recomputation would repeat at a high price is kept instead: a pass
registers the operator (`keep_through_recomputation`), and the segments
whose graph calls its step function run under selective checkpointing
that saves that operator's outputs (attention's forward over a long
prompt: without it, each reverse chunk ran every attention layer's
forward over all earlier positions twice).

Recomputing a segment is safe because everything a step does besides
computing is idempotent: it writes the same state values at the same
positions (`StepContext.write`, `carry_out`), and gradients into d(state)
are only added by backward functions, which recomputation does not run.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from longstraw.errors import clean_module_path
from longstraw.nodes import is_grad_mode_switch

_KEPT: dict[Callable[..., Any], torch._ops.OpOverload] = {}


def keep_through_recomputation(step_function: Callable[..., Any], op: torch._ops.OpOverload) -> None:
    """Keep the outputs of `op`, which `step_function` (a call in step
    graphs) dispatches, through layer-wise recomputation."""
    _KEPT[step_function] = op


def layer_of(node: fx.Node) -> str | None:
    """The model layer a node was traced in: the outermost module on its
    stack that is an entry of a ModuleList (`model.layers.3`), else None."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        clean = clean_module_path(path)
        if clean.rsplit(".", 1)[-1].isdigit():
            return clean
    return None


def segment_ids(graph: fx.Graph) -> dict[fx.Node, int]:
    """Segment of every computing node: a new segment starts at the first
    node of each new layer. Segments are contiguous in graph order (a node
    of an earlier layer that appears later stays in the current segment),
    and never start inside a region that switched autograd off, so each
    segment's recomputation runs in the grad mode its forward ran in."""
    ids: dict[str, int] = {}
    out: dict[fx.Node, int] = {}
    current, grad_off = 0, False
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if is_grad_mode_switch(node):
            flag = node.args[0]
            grad_off = not (flag is True or (isinstance(flag, fx.Node) and flag.target is operator.and_ and flag.args[0] is True))
        layer = layer_of(node)
        if layer is not None and not grad_off:
            current = max(current, ids.setdefault(layer, len(ids) + 1))
        out[node] = current
    return out


@dataclasses.dataclass
class _Segment:
    module: fx.GraphModule
    inputs: list[fx.Node]  # values of the original graph it reads
    outputs: list[fx.Node]  # values of the original graph it defines and later segments or the output read
    kept: list[torch._ops.OpOverload]  # operators whose outputs recomputation reuses

    def run(self, *args: Any) -> Any:
        """Under `checkpoint`, selective when the segment has outputs to keep."""
        if not self.kept:
            return checkpoint(self.module, *args, use_reentrant=False)
        contexts = functools.partial(create_selective_checkpoint_contexts, self.kept)
        return checkpoint(self.module, *args, use_reentrant=False, context_fn=contexts)


class LayerwiseStep(torch.nn.Module):
    """A step graph run segment by segment, each under `checkpoint`; called
    like the step graph itself."""

    def __init__(self, step: fx.GraphModule) -> None:
        super().__init__()
        graph = step.graph
        ids = segment_ids(graph)
        self.placeholders = list(graph.find_nodes(op="placeholder"))
        self.output = next(iter(graph.find_nodes(op="output")))
        self.segments: list[_Segment] = []
        for sid in sorted(set(ids.values())):
            nodes = [n for n in graph.nodes if ids.get(n) == sid]
            self.segments.append(_build_segment(step, nodes, set(nodes)))
        for i, segment in enumerate(self.segments):
            self.add_module(f"layer_segment_{i}", segment.module)

    @property
    def depth(self) -> int:
        return len(self.segments)

    def forward(self, *args: Any) -> Any:
        env: dict[fx.Node, Any] = dict(zip(self.placeholders, args))
        for segment in self.segments[:-1]:
            values = segment.run(*[env[n] for n in segment.inputs])
            env.update(zip(segment.outputs, values))
        # the last segment (the last layer and the head) runs as is: its backward comes
        # first, right after its forward, so recomputing it would hold no less
        last = self.segments[-1]
        env.update(zip(last.outputs, last.module(*[env[n] for n in last.inputs])))
        return fx.node.map_arg(self.output.args[0], lambda n: env[n])


def _build_segment(step: fx.GraphModule, nodes: list[fx.Node], members: set[fx.Node]) -> _Segment:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []

    def load(node: fx.Node) -> fx.Node:
        if node not in env:
            if node.op == "get_attr":
                env[node] = graph.node_copy(node)
            else:
                env[node] = graph.placeholder(node.name)
                inputs.append(node)
        return env[node]

    for node in nodes:
        env[node] = graph.node_copy(node, load)
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    graph.output(tuple(env[n] for n in outputs))
    graph.lint()
    kept = list(dict.fromkeys(_KEPT[n.target] for n in nodes if n.op == "call_function" and n.target in _KEPT))
    return _Segment(fx.GraphModule(step, graph, class_name="LayerSegment"), inputs, outputs, kept)
