"""What the partition refuses, and how it says so: the refusal of an
operator (naming it, its module path and source line, and the fix the
hints find), the diagnosis when no pass claims anything, and the checks
over the sequence operators and learned position tables."""

from __future__ import annotations

import torch.fx as fx

from longstraw.analysis.dims import DimAnalysis
from longstraw.errors import (
    NO_FIX,
    InputError,
    UnsupportedGraphError,
    binding_hint,
    describe_node,
    experts_hint,
    module_classes,
    positions_hint,
    random_hint,
    sdpa_advice,
)
from longstraw.nodes import ancestors, is_call, is_side_effect, op_name, tensor_of
from longstraw.trace.functionalize import is_updated


def unsupported(node: fx.Node, why: str, advice: str = "") -> UnsupportedGraphError:
    """The refusal of `node`: `why`, then `advice`, else what the hints find
    for this node (a binding, HF's experts implementation, position ids, a
    sampling router), else that LongStraw has no fix."""
    if advice:
        said = f"{why}: {advice.rstrip('.')}."
    else:
        hints = f"{binding_hint(node)}{experts_hint(node)}{positions_hint(node)}{random_hint(node)}"
        said = f"{why}.{hints or f' {NO_FIX}.'}"
    return UnsupportedGraphError(
        f"{describe_node(node)} {said} LongStraw needs every operator that mixes sequence positions to be claimed by "
        "an architecture pass (see longstraw.passes; a pass of your own goes in options={'passes': [...]} or "
        "longstraw.register_pass). Pass options={'on_unsupported': 'eager'} to run this graph unchanged instead.",
        node,
    )


def check_position_tables(graph: fx.Graph, end: int) -> None:
    """A learned position table (an embedding looked up with indices built
    from `arange` alone) must have a row for every position the group runs."""
    for node in graph.nodes:
        if op_name(node) != "embedding" or len(node.args) < 2:
            continue
        index, weight = node.args[0], node.args[1]
        if not isinstance(index, fx.Node) or tensor_of(weight) is None:
            continue
        found = ancestors([index])
        if any(n.op == "placeholder" for n in found) or not any(op_name(n) == "arange" for n in found):
            continue
        rows = tensor_of(weight).shape[0]
        if rows < end:
            raise InputError(
                f"{describe_node(node)} looks up a learned position table of {rows} rows, but the group runs "
                f"{end} positions (prompt plus response): the sequences are longer than the model's positions. "
                "Shorten the prompt or the responses."
            )


_MATMULS = {"matmul", "bmm", "einsum", "baddbmm", "mm"}


def nothing_claimed(graph: fx.Graph, an: DimAnalysis) -> UnsupportedGraphError:
    """No pass claims any operator: say what mixes positions instead."""
    for node in graph.nodes:
        if op_name(node) == "flex_attention":
            return unsupported(node, "is flex attention, which no pass claims", sdpa_advice(module_classes(node)))
    for node in graph.nodes:
        if op_name(node) == "softmax" and _near(node, _MATMULS, "up") and _near(node, _MATMULS, "down"):
            return unsupported(
                node, "computes attention with explicit matmul and softmax (HF's attn_implementation='eager'), and "
                "LongStraw claims attention only as `scaled_dot_product_attention`", sdpa_advice(module_classes(node))
            )
    lookups = [n for n in graph.nodes if op_name(n) == "embedding" and tensor_of(n.args[0]) is not None
               and tensor_of(n.args[0]).dim() >= 2]
    if lookups:
        token = an.classes(an.dims_of(lookups[0].args[0])[-1])[0]
        for node in graph.nodes:
            if not is_call(node):
                continue
            if not any(an.carries_class(n, token) for n in (node, *node.all_input_nodes)):
                continue
            if node in an.unknown:
                return unsupported(
                    node, "touches the sequence axis and has no dimension rule, so LongStraw cannot tell which "
                    "positions it reads (no operator in this graph is claimed by a pass)"
                )
            if any(token in an.classes(d) for d in an.mixes.get(node, [])):
                return unsupported(node, "mixes sequence positions, and no attention or other operator a pass claims was found")
    return UnsupportedGraphError(
        "no attention (or other position-mixing operator claimed by a pass) found in the loss graph: there is no "
        "prompt state to share between the group's responses"
    )


def _near(node: fx.Node, names: set[str], direction: str, hops: int = 8) -> bool:
    """Whether an operator in `names` is within `hops` edges of `node`."""
    frontier = {node}
    for _ in range(hops):
        frontier = {m for n in frontier for m in (n.all_input_nodes if direction == "up" else n.users)}
        if any(op_name(n) in names for n in frontier):
            return True
    return False


def position_length(position: tuple[fx.Node, int]) -> int | None:
    """The traced length of a claimed operator's position axis (None where not a concrete size)."""
    seq_node, seq_dim = position
    value = tensor_of(seq_node)
    size = None if value is None else value.shape[seq_dim]
    return size if isinstance(size, int) else None


def padded_to_a_window(*positions: tuple[fx.Node, int]) -> bool:
    """Whether one claimed operator's position axis is a `pad` of a tensor
    as long as the other's: one sequence, which HF's cache pads to a causal
    convolution's kernel where it is shorter."""
    for (node, dim), other in (positions, positions[::-1]):
        source = node.args[0] if node.op == "call_function" and op_name(node) == "pad" and node.args else None
        value, padded = tensor_of(source) if isinstance(source, fx.Node) else None, tensor_of(node)
        if value is not None and padded is not None and value.dim() == padded.dim() \
                and value.shape[dim] == position_length(other):
            return True
    return False


def check_sequence_ops(
    graph: fx.Graph, an: DimAnalysis, token: int, batch: int, sequence: set[fx.Node], claims: dict,
    positional: set[fx.Node],
) -> None:
    """Every unclaimed operator that reads the sequence keeps its positions
    apart: it does not split the sequence axis, write a range of positions
    or of the group's rows in place, mix or drop positions, or lack a
    dimension rule; the first that does is refused."""
    for node in graph.nodes:
        if not is_call(node) or is_side_effect(node) or node in claims or node in positional:
            continue
        seq_inputs = [a for a in node.all_input_nodes if a in sequence]
        for dim in an.splits.get(node, []):
            if token in an.classes(dim):
                raise unsupported(node, "splits the sequence axis (e.g. into fixed-size chunks)")
        if not seq_inputs and node not in sequence:
            continue
        if is_updated(node) and an.restriction(node, token):
            raise unsupported(node, "writes a range of sequence positions in place")
        if is_updated(node) and node in sequence and an.restriction(node, batch):
            raise unsupported(node, "writes into some rows of the group in place inside the per-position computation")
        if node in an.unknown:
            raise unsupported(node, "touches the sequence axis and has no dimension rule")
        if any(token in an.classes(d) for d in an.mixes.get(node, [])):
            raise unsupported(node, "mixes values across sequence positions")
        if node not in sequence and not an.restriction(node, token):
            raise unsupported(node, "reduces or drops the sequence axis")
