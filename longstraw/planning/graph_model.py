"""The partitioned loss graph as a networkx graph, for people: every node
with its region (input, outer, prefix, branch, tail), layer, operator,
shape and source line, and every captured state slot as a node with edges
from what it captures and to the operators that read it."""

from __future__ import annotations

import dataclasses

import networkx as nx
import torch
import torch.fx as fx

from longstraw.errors import module_path, source_line
from longstraw.nodes import op_name, tensor_of
from longstraw.analysis.slots import SlotKind

REGIONS = ("input", "outer", "prefix", "branch", "tail", "state")
REGION_TITLES = {
    "input": "inputs and parameters",
    "outer": "outer (once per call)",
    "prefix": "prefix: per position, over prompt chunks and replayed per branch",
    "branch": "branch: per response, after the exits",
    "tail": "tail: the loss over the stacked branches",
    "state": "captured state",
}


@dataclasses.dataclass(frozen=True)
class CapturedTensor:
    """One state slot, described for people."""

    index: int
    name: str
    kind: str  # "sequence" (per position) or "carry" (fixed size)
    layer: str | None
    operator: str
    source: str | None
    dtype: torch.dtype
    shape: tuple[int, ...]
    bytes_per_position: int
    fixed_bytes: int
    reason: str

COLORS = {"input": "#7f7f7f", "outer": "#bcbd22", "prefix": "#1f77b4", "branch": "#2ca02c", "tail": "#9467bd",
           "state": "#d62728"}


def _region(part, node: fx.Node) -> str:
    if node.op == "placeholder":
        return "input"
    if node in part.sequence or node in part.positional:
        return "prefix"
    if node in part.branch:
        return "branch"
    if node in part.tail or node.op == "output":
        return "tail"
    return "outer"


def graph_model(plan) -> nx.DiGraph:
    """The plan's graph (see the module docstring)."""
    part = plan.partition
    g = nx.DiGraph()
    for node in part.graph.nodes:
        value = tensor_of(node)
        claimed = part.claims.get(node)
        detail = f"claimed by {claimed.name}" if claimed is not None else ""
        g.add_node(
            node.name,
            region=_region(part, node),
            op=op_name(node),
            layer=_layer(node),
            shape=list(value.shape) if value is not None else None,
            dtype=str(value.dtype).removeprefix("torch.") if value is not None else None,
            source=source_line(node),
            detail=detail,
        )
        for src in node.all_input_nodes:
            g.add_edge(src.name, node.name)
    for slot in part.slots:
        state = f"state[{slot.index}]"
        size = f"{slot.bytes_per_position()} B/position" if slot.kind == SlotKind.SEQUENCE else f"{slot.fixed_bytes()} B fixed"
        g.add_node(state, region="state", op=f"{slot.kind} state", layer=_layer(slot.node), shape=list(slot.shape),
                   dtype=str(slot.dtype).removeprefix("torch."), source=source_line(slot.node),
                   detail=f"{size}; for {slot.reason}")
        g.add_edge(slot.node.name, state, state=True)
        for reader in _readers(part, slot):
            g.add_edge(state, reader.name, state=True)
    return g


def _readers(part, slot) -> list[fx.Node]:
    """The claimed operators that read a state slot."""
    return [claimed for claimed, sites in part.sites.items() if any(site.slot == slot.index for site in sites)]


def _layer(node: fx.Node) -> str | None:
    """The module path up to its first numbered component (`model.layers.3`)."""
    path = module_path(node)
    if not path:
        return None
    parts = path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return path


def describe_slot(part, slot) -> CapturedTensor:
    reader = next(iter(_readers(part, slot)), slot.node)
    return CapturedTensor(
        index=slot.index, name=slot.node.name, kind=slot.kind, layer=module_path(reader), operator=op_name(reader),
        source=source_line(reader), dtype=slot.dtype, shape=tuple(slot.shape),
        bytes_per_position=slot.bytes_per_position(), fixed_bytes=slot.fixed_bytes(), reason=slot.reason,
    )
