"""A step graph's depth: its model layers in order, the period after which
they repeat, and the step graph with the periods between its first and
its last taken out.

The memory planner simulates a step on fake tensors, operator by
operator; at 64 layers that is minutes. What a step holds grows with depth
by the same amount per period of identical layers (their inputs kept
through recomputation, their activations without it, their parameters'
gradients), so the planner simulates two and three periods and
extrapolates (`longstraw.planning.planner`). A layer's structure is the sequence
of its operators and their output shapes; layers of equal structure
differ only in their weights and state slots. The first and the last
period may differ from the rest: values every layer reads (RoPE's tables
reshaped for the heads) are computed once, in the first layer that needs
them, and the prompt's step computes only what the state needs of its
last layer (its K/V, not its MLP).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from longstraw.codegen.recompute import layer_of


@dataclasses.dataclass(frozen=True)
class Depth:
    """The layers of a step graph in graph order and their repeating period."""

    layers: list[str]  # module paths, `model.layers.0`, ...
    period: int

    @property
    def periods(self) -> int:
        return len(self.layers) // self.period


def depth_of(graph: fx.Graph) -> Depth | None:
    """The layers and their smallest period: every layer but those of the
    first and the last period has the structure of its counterpart in the
    second (None: fewer than three periods, or a depth that is not a whole
    number of them)."""
    members = _members(graph)
    layers = list(members)
    shapes = [_structure(members[layer]) for layer in layers]
    for period in range(1, len(layers) // 3 + 1):
        middle = range(period, len(layers) - period)
        if len(layers) % period == 0 and all(shapes[i] == shapes[period + i % period] for i in middle):
            return Depth(layers, period)
    return None


def without_middle(gm: fx.GraphModule, depth: Depth, periods: int) -> fx.GraphModule | None:
    """`gm` with `periods` periods of layers: the first `periods - 1` and
    the last. The first layer after the gap reads what the last layer
    before it computed in place of the last dropped layer's values, and
    the step returns None for the dropped layers' outputs. None where the
    layers do not hand over that way (a later node reads a dropped value
    that has no counterpart before the gap)."""
    members = _members(gm.graph)
    p, n = depth.period, depth.periods
    if not 2 <= periods < n:
        return gm if periods == n else None
    before = depth.layers[(periods - 1) * p - 1]  # the last layer before the gap
    last_dropped = depth.layers[(n - 1) * p - 1]
    dropped = {node for layer in depth.layers[(periods - 1) * p:(n - 1) * p] for node in members[layer]}
    handover = _aligned(members[last_dropped], members[before])
    kept = [node for node in gm.graph.nodes if node not in dropped]
    computing = [node for node in kept if node.op != "output"]
    if handover is None or any(a in dropped and a not in handover for node in computing for a in node.all_input_nodes):
        return None
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in computing:
        env[node] = graph.node_copy(node, lambda a: env[handover[a] if a in dropped else a])
    # what the step returns of a dropped layer (the prompt's step returns every state slot's value, the
    # reverse pass seeds them with d(state)) is None: the runtime seeds only what a step computed
    graph.output(fx.node.map_arg(gm.graph.output_node().args[0], lambda a: None if a in dropped else env[a]))
    graph.lint()
    return fx.GraphModule(gm, graph, class_name=type(gm).__name__)


def _members(graph: fx.Graph) -> dict[str, list[fx.Node]]:
    """Each layer's nodes. A node the step graph generated (a state write, an
    attention or carried step: no module stack of its own) belongs to the
    layer it follows in graph order, as in `recompute.segment_ids`."""
    members: dict[str, list[fx.Node]] = {}
    current = None
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        layer = layer_of(node)
        if layer is None and not node.meta.get("nn_module_stack"):
            layer = current
        if layer is not None:
            members.setdefault(layer, []).append(node)
            current = layer
    return members


def _aligned(regular: list[fx.Node], other: list[fx.Node]) -> dict[fx.Node, fx.Node] | None:
    """Each node of a regular layer matched, in order, to the next node of
    `other` with its structure (`other`, of the first period, may compute
    more); None where one has no match."""
    out: dict[fx.Node, fx.Node] = {}
    keys = [_key(n) for n in other]
    j = 0
    for node in regular:
        key = _key(node)
        while j < len(other) and keys[j] != key:
            j += 1
        if j == len(other):
            return None
        out[node] = other[j]
        j += 1
    return out


def _structure(nodes: list[fx.Node]) -> tuple:
    """Operators and output shapes, in order: equal for layers that differ only in weights and state slots."""
    return tuple(_key(n) for n in nodes)


def _key(node: fx.Node) -> tuple:
    return node.op, _target(node.target), _shape(node.meta.get("longstraw_value"))


def _target(target: object) -> str:
    """What a node calls, the same in every layer: the step functions the
    step graphs call are closures made per layer, so a function is named by
    its qualified name, not its address."""
    if isinstance(target, str) or isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    return f"{getattr(target, '__module__', None)}.{getattr(target, '__qualname__', repr(target))}"


def _shape(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    if isinstance(value, (tuple, list)):
        return tuple(_shape(v) for v in value)
    return None
