"""The LM head of a branch step, run a chunk of positions at a time.

A branch step ends with the LM head and the loss's per-token part
(`log_softmax`, `gather`, the ratio...). Run over all R response positions
at once, its float32 logits, log-softmax and their gradients are
`[R, vocab]` each: several GB per branch at a 248K vocabulary. As Liger's
fused linear cross-entropy does, `HeadChunks` runs that region over
`chunk` positions at a time, each chunk under non-reentrant
`torch.utils.checkpoint`, so autograd keeps only the chunk's inputs and
the backward recomputes one chunk's logits at a time.

The region is found from the graph, not by names (`head_region`): the
largest suffix of the branch step, ending at its outputs, in which every
node is per position (no operator mixes, splits or samples along the
token axis or the axis of the positions the loss reads, nothing is claimed
or writes state). Its only restrictions are the exits (`logits[:, s:e]`),
each taking a step-1 range of sequence positions to the one axis of read
positions that every region output has. Chunk `[c, c+n)` of read positions
is then computed from sequence positions `[s + c, s + c + n)` of each exit,
and concatenating the chunks' outputs along the read axis gives the
unchunked outputs, position for position. Anything else is left unchunked.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint

from longstraw.analysis.dim_types import Restriction
from longstraw.analysis.partition import Partition
from longstraw.errors import LongStrawError
from longstraw.nodes import is_call, is_random, is_side_effect, tensor_of


@dataclasses.dataclass(frozen=True)
class HeadSpan:
    """The context of one chunk's graph: sequence positions `[offset,
    offset + length)`, read positions `[head_start, head_start + head_length)`."""

    offset: int
    length: int
    head_start: int
    head_length: int


@dataclasses.dataclass(frozen=True)
class HeadRegion:
    """The chunked region of a branch step (see module docstring)."""

    nodes: set[fx.Node]
    outputs: list[fx.Node]  # branch outputs computed in the region
    read: int  # class of the read positions, which every output has
    rows: int  # number of read positions
    exit_starts: list[int]  # first sequence position of each exit in the region


def _position_dims(part: Partition, node: fx.Node, positions: set[int]) -> list[tuple[int, ...]]:
    """The dimensions of `node` (of every piece of a tuple value) that carry a class in `positions`."""
    an = part.dims
    dims = an.dims.get(node)
    if not dims:
        return []
    pieces = dims if isinstance(dims[0], list) else [dims]
    return [d for piece in pieces for d in piece if any(an.find(f) in positions for f in d)]


def _single_position_dim(part: Partition, node: fx.Node, positions: set[int]) -> int | None:
    """The class of `node`'s one position dimension, or None if it has several or a product."""
    dims = _position_dims(part, node, positions)
    if len(dims) != 1 or len(dims[0]) != 1:
        return None
    return part.dims.find(dims[0][0])


def _per_position(part: Partition, node: fx.Node, positions: set[int], exits: dict[fx.Node, Restriction]) -> bool:
    """Whether `node` computes each position from the same position of its inputs only."""
    an = part.dims
    if node in part.claims or node in part.positional or node in an.unknown or is_random(node) or is_side_effect(node):
        return False
    if _single_position_dim(part, node, positions) is None:
        return False
    for dim in an.mixes.get(node, []) + an.splits.get(node, []):
        if any(an.find(f) in positions for f in dim):
            return False
    src = node.args[0] if node.args else None
    for r in an.restricts.get(node, []):
        if not isinstance(src, fx.Node) or not any(an.find(f) in positions for f in an.dims_of(src)[r.in_dim]):
            continue
        if node not in exits or r.out_dim is None or r.step != 1:
            return False
    return True


def head_region(part: Partition, outputs: list[fx.Node], needed: set[fx.Node], stop: set[fx.Node]) -> HeadRegion | None:
    """The region of a branch step that can run chunk by chunk, or None.
    `needed` and `stop`: the nodes the step computes and the ones it imports."""
    an = part.dims
    exits = {e.node: e.restriction for e in part.exits if e.node in needed}
    reads = {an.find(an.dims_of(e)[r.out_dim][0]) for e, r in exits.items() if r.out_dim is not None}
    positions = {part.token} | reads
    region: set[fx.Node] = set()
    for node in reversed(part.graph.nodes):
        if node not in needed or node in stop or not is_call(node) or not _position_dims(part, node, positions):
            continue
        users = [u for u in node.users if u in needed or u in part.positional]
        if all(u in region for u in users) and _per_position(part, node, positions, exits):
            region.add(node)
    # a piece of a tuple computed outside (`torch.chunk` of a projection into query and gate) enters as a tensor
    region -= {n for n in region if any(_is_sequence(i) and i not in region for i in n.all_input_nodes)}
    region = _closed(region, needed, part.positional)
    region_outputs = [o for o in outputs if o in region]
    if not region_outputs:
        return None
    read = _single_position_dim(part, region_outputs[0], positions)
    if read == part.token or any(_single_position_dim(part, o, positions) != read for o in region_outputs):
        return None
    region_exits = [e for e in exits if e in region]
    if not region_exits or any(an.find(an.dims_of(e)[exits[e].out_dim][0]) != read for e in region_exits):
        return None
    inputs = {i for n in region for i in n.all_input_nodes if i not in region}
    roots = {r.node for r in part.roots}
    for i in inputs:
        if not _position_dims(part, i, positions):
            continue
        axis = _single_position_dim(part, i, positions)
        if tensor_of(i) is None or axis not in (part.token, read):
            return None
        if axis == part.token and i.op == "placeholder" and i not in roots:
            return None  # not cut to the step's positions by the runtime
    if not _widens(part, region, inputs, positions):
        return None
    return HeadRegion(region, region_outputs, read, an.factor_size(read), [exits[e].start for e in region_exits])


def _is_sequence(node: fx.Node) -> bool:
    return isinstance(node.meta.get("longstraw_value"), (tuple, list))


def _closed(region: set[fx.Node], needed: set[fx.Node], positional: set[fx.Node]) -> set[fx.Node]:
    """The largest part of `region` whose nodes are read only inside it:
    a node taken out takes out what feeds only it."""
    region = set(region)
    while True:
        leaving = {n for n in region if any(u not in region for u in n.users if u in needed or u in positional)}
        if not leaving:
            return region
        region -= leaving


def _width(part: Partition, node: fx.Node, positions: set[int]) -> int:
    """Elements per position and row of a tensor node (0 for other values)."""
    value = tensor_of(node)
    if value is None:
        return 0
    axes = positions | {part.batch}
    dims = part.dims.dims_of(node)
    return math.prod(s for s, d in zip(value.shape, dims) if not any(part.dims.find(f) in axes for f in d))


def _widens(part: Partition, region: set[fx.Node], inputs: set[fx.Node], positions: set[int]) -> bool:
    """Chunking pays only where the region makes tensors wider per position
    than the ones it reads per position (the logits from the hidden state):
    checkpointing keeps the inputs, so a region that does not widen holds as much either way."""
    read_width = max((_width(part, i, positions) for i in inputs if _position_dims(part, i, positions)), default=0)
    return max(_width(part, n, positions) for n in region) > read_width


class HeadChunks(torch.nn.Module):
    """Runs a region's graph (built for a `HeadSpan`) chunk by chunk; called
    in the branch step with the step's context and the region's inputs."""

    def __init__(
        self, graph: fx.GraphModule, region: HeadRegion, input_dims: list[tuple[str, int] | None],
        output_dims: list[int], chunk: int,
    ) -> None:
        super().__init__()
        self.chunk_graph = graph
        self.rows = region.rows
        self.first = min(region.exit_starts)
        self.spread = max(region.exit_starts) - self.first  # extra sequence positions a chunk reads
        self.input_dims = input_dims  # per input: ("sequence" | "read", dim) to narrow, or None to pass whole
        self.output_dims = output_dims
        self.chunk = chunk

    def forward(self, ctx: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pieces = []
        # a step cut short (`read_cut.py`) has the read positions its last exit still reaches
        rows = min(self.rows, ctx.offset + ctx.length - self.first - self.spread)
        for start in range(0, rows, self.chunk):
            length = min(self.chunk, rows - start)
            span = HeadSpan(self.first + start, length + self.spread, start, length)
            args = [self._narrowed(x, how, span, ctx.offset) for x, how in zip(inputs, self.input_dims)]
            if torch.is_grad_enabled():
                outs = checkpoint(self.chunk_graph, span, *args, use_reentrant=False)
            else:
                outs = self.chunk_graph(span, *args)
            if any(o.shape[d] != length for o, d in zip(outs, self.output_dims)):
                raise LongStrawError(f"a chunk of the LM head over read positions {span.head_start}..+{length} "
                                     f"returned {[tuple(o.shape) for o in outs]}: its positions do not line up")
            pieces.append(outs)
        return tuple(torch.cat([p[i] for p in pieces], dim=d) for i, d in enumerate(self.output_dims))

    @staticmethod
    def _narrowed(value: Any, how: tuple[str, int] | None, span: HeadSpan, step_offset: int) -> Any:
        if how is None:
            return value
        kind, dim = how
        if kind == "sequence":
            return value.narrow(dim, span.offset - step_offset, span.length)
        return value.narrow(dim, span.head_start, span.head_length)
