"""Choose what to capture: the cheapest tensor per prompt position.

For every input a pass claims (attention keys and values, say) the pass
lists candidate tensors from that input upwards, each reachable back to the
input by something the step can absorb (identity, head repetition). The
candidates form a chain in a flow network whose node capacities are bytes
per position; the minimum cut is the tensor to capture. Ties go to the
candidate farthest from the claimed input, which absorbs the most work.
"""

from __future__ import annotations

import networkx as nx
import torch.fx as fx

from longstraw.passes.base import ArchitecturePass, Candidate, SiteState

from longstraw.analysis.dims import DimAnalysis
from longstraw.errors import UnsupportedGraphError, describe_node
from longstraw.nodes import tensor_of
from longstraw.analysis.slots import SlotKind, StateSlot


def bytes_per_position(node: fx.Node, an: DimAnalysis, token: int, batch: int) -> int | None:
    """Bytes one position of one sequence occupies, or None without a sequence axis."""
    value = tensor_of(node)
    token_dim = an.dim_index(node, token)
    if value is None or token_dim is None:
        return None
    numel = value.numel() // max(1, value.shape[token_dim])
    batch_dim = an.dim_index(node, batch)
    if batch_dim is not None and batch_dim != token_dim:
        numel //= max(1, value.shape[batch_dim])
    return numel * value.element_size()


def _min_cut(candidates: list[Candidate], costs: list[int]) -> Candidate:
    graph = nx.DiGraph()
    scale = len(candidates) + 1
    for i, cost in enumerate(costs):
        tie_break = len(candidates) - 1 - i  # prefer candidates farther up
        graph.add_edge(("in", i), ("out", i), capacity=cost * scale + tie_break)
        downstream = ("sink",) if i == 0 else ("in", i - 1)
        graph.add_edge(("out", i), downstream)  # no capacity: infinite
    graph.add_edge(("source",), ("in", len(candidates) - 1))
    _, (reachable, _) = nx.minimum_cut(graph, ("source",), ("sink",))
    for i, candidate in enumerate(candidates):
        if ("in", i) in reachable and ("out", i) not in reachable:
            return candidate
    raise AssertionError("minimum cut crossed no candidate")


def choose_state(
    claims: dict[fx.Node, ArchitecturePass], an: DimAnalysis, token: int, batch: int
) -> tuple[list[StateSlot], dict[fx.Node, list[SiteState]]]:
    """Slots to capture and, per claimed node, which slot serves each state input."""
    slots: dict[object, StateSlot] = {}
    sites: dict[fx.Node, list[SiteState]] = {}
    for node, pass_ in claims.items():
        resolved = []
        for state_input in pass_.state_inputs(node):
            candidates = [c for c in pass_.candidates(node, state_input) if bytes_per_position(c.node, an, token, batch)]
            if not candidates:
                raise UnsupportedGraphError(
                    f"{describe_node(node)} ({pass_.name}) reads its state from {describe_node(state_input)}, "
                    "and no tensor on the way there holds one value per prompt position, so there is no state "
                    "to capture; pass options={'on_unsupported': 'eager'} to run this graph unchanged."
                )
            costs = [bytes_per_position(c.node, an, token, batch) for c in candidates]
            chosen = _min_cut(candidates, costs)
            if chosen.node not in slots:
                slots[chosen.node] = _slot(len(slots), chosen.node, an, token, batch, f"{pass_.name}:{node.name}")
            resolved.append(SiteState(chosen.node, slots[chosen.node].index, chosen.transform))
        for shape, dtype in pass_.carries(node):
            index = len(slots)
            slots[(node, len(resolved))] = StateSlot(
                index=index, kind=SlotKind.CARRY, node=node, token_dim=None, batch_dim=None,
                shape=tuple(shape), dtype=dtype, reason=f"{pass_.name}:{node.name}",
            )
            resolved.append(SiteState(node, index, None))
        sites[node] = resolved
    return list(slots.values()), sites


def _slot(index: int, node: fx.Node, an: DimAnalysis, token: int, batch: int, reason: str) -> StateSlot:
    value = tensor_of(node)
    shape = list(value.shape)
    batch_dim = an.dim_index(node, batch)
    if batch_dim is not None:
        shape[batch_dim] = 1
    return StateSlot(
        index=index,
        kind=SlotKind.SEQUENCE,
        node=node,
        token_dim=an.dim_index(node, token),
        batch_dim=batch_dim,
        shape=tuple(shape),
        dtype=value.dtype,
        reason=reason,
    )
