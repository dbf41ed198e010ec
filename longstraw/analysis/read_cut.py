"""Which branch positions a call may leave out, proved from the graph.

A GRPO batch pads each completion on the right to the longest in the
batch; eager runs every padded position through every layer and the loss
masks it out. A branch step whose rows' real completions end at read
position n needs only the positions up to n: the claimed operators are
causal (a pass claims an operator only where no position sees a later
one, or the prompt could not be captured once), so positions after n
change nothing before n. The step may stop there, its outputs padded back
with zeros, exactly when nothing the loss computes reads those outputs
past n. `read_cut` proves that for the integrations' scorer:

- every branch output is read by the tail only as the logits or the index
  of `longstraw::logprobs_and_entropy`, which is zero with zero gradient
  wherever its mask is False, and whose mask is computed from the loss's
  inputs alone (`attention_mask[:, -R:] != 0`), so the runtime evaluates
  it before any branch step and cuts each step after the last True (a
  mask the branch step computes too, as the hybrid's is, comes out of a
  cut step padded with False, which it was there);
- every branch output is `[rows, reads, ...]`, the op's `[B, R]` layout;
- the branch nodes keep each read position where it was: no operator
  mixes, splits, shifts, pads or concatenates along a position axis, every
  slice of one starts at a fixed position (an exit's start, or a start
  counted from the front), and no size along a read axis is a traced
  constant (a `view(B, R, -1)` would silently regroup a shorter tensor).

Then a step run over `L = n + (F - R)` of its `F` positions gives at least
n read positions of every output (a slice loses at most what its input
lost), each equal to the full step's. Anything else keeps the padded
rows: `read_cut` returns why, for the log.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from longstraw.analysis.partition import Partition
from longstraw.nodes import ancestors, is_call, is_random, is_side_effect, op_name, size_args, tensor_of

SCORER_OP = "longstraw.logprobs_and_entropy.default"  # str() of the traced OpOverload

# operators that place positions by a traced size or move them along their axis
_SIZED = {"view", "reshape", "expand", "broadcast_to", "unflatten", "repeat", "new_zeros", "new_ones", "new_empty",
          "new_full", "zeros", "ones", "empty", "full", "rand", "randn", "arange", "linspace", "tensor", "eye"}
_MOVES = {"cat", "concat", "concatenate", "stack", "pad", "roll", "flip", "fliplr", "flipud", "rot90", "repeat_interleave",
          "unfold", "as_strided", "tile", "diff"}


@dataclasses.dataclass(frozen=True)
class ReadCut:
    """The scorer ops' masks (`[B, R]`, True where the loss reads a
    position), each computed from the loss's inputs alone."""

    masks: tuple[fx.Node, ...]
    reads: int  # R: the read positions of every branch output


def read_cut(part: Partition) -> ReadCut | str:
    """The proof (module docstring), or why the branch steps must run every position."""
    an = part.dims
    masks: dict[fx.Node, None] = {}
    reads: set[int] = set()
    for out in part.branch_outputs:
        value = tensor_of(out)
        if value is None or value.dim() < 2:
            return f"branch output `{out.name}` is not a [rows, reads, ...] tensor"
        for user in out.users:
            if user.op != "call_function" or str(user.target) != SCORER_OP:
                return f"branch output `{out.name}` is read by `{user.name}`, not only by longstraw::logprobs_and_entropy"
            mask = user.args[2]
            if not isinstance(mask, fx.Node) or tensor_of(mask) is None or tensor_of(mask).dim() != 2:
                return f"the mask of `{user.name}` is not a [B, R] tensor"
            masks[mask] = None
        if part.batch_dim(out) != 0:
            return f"branch output `{out.name}` does not have its rows first"
        reads.add(value.shape[1])
    if len(reads) != 1 or any(tensor_of(m).shape[1] not in reads for m in masks):
        return "the scorer's outputs and masks disagree on the number of read positions"
    for mask in masks:
        sources = ancestors([mask])
        if sources & (part.params | set(part.claims)) or any(is_random(n) for n in sources):
            return f"the mask `{mask.name}` is computed from the model's values, not from the loss's inputs alone"
    positions = _position_classes(part)
    for out in part.branch_outputs:
        dims = an.dims_of(out)
        held = [i for i, d in enumerate(dims) if set(an.classes(d)) & positions]
        if held != [1] or len(dims[1]) != 1:
            return f"branch output `{out.name}` does not hold its read positions on its second axis alone"
    for node in part.graph.nodes:
        if node in part.branch and is_call(node) and node not in part.positional and not is_side_effect(node):
            reason = _moves_positions(part, node, positions)
            if reason is not None:
                return f"`{node.name}` ({op_name(node)}) {reason}"
    return ReadCut(tuple(masks), reads.pop())


def _position_classes(part: Partition) -> set[int]:
    """The token class and every class a restriction of a position axis gives."""
    an = part.dims
    positions = {an.find(part.token)}
    for node in part.graph.nodes:
        src = node.args[0] if node.args else None
        if node not in an.restricts or not isinstance(src, fx.Node):
            continue
        for r in an.restricts[node]:
            if r.out_dim is not None and _classes(part, src, r.in_dim) & positions:
                positions |= _classes(part, node, r.out_dim)
    return positions


def _moves_positions(part: Partition, node: fx.Node, positions: set[int]) -> str | None:
    """Why a branch node could move a read position at another length, or None."""
    an = part.dims
    in_classes = {c for i in node.all_input_nodes for d in an.dims_of(i) for c in an.classes(d)} & positions
    out_dims = an.dims_of(node)
    out_classes = {c for d in out_dims for c in an.classes(d)} & positions
    if not in_classes and not out_classes:
        return None
    if node in an.unknown:
        return "has no dimension rule"
    if any(set(an.classes(d)) & positions for d in an.mixes.get(node, []) + an.splits.get(node, [])):
        return "mixes or splits positions"
    name = op_name(node)
    if name in _MOVES:
        return "moves positions along their axis"
    if name in _SIZED:
        sizes = size_args(node) if node.op == "call_method" or name in ("reshape", "broadcast_to") else []
        for i, d in enumerate(out_dims):
            if set(an.classes(d)) & positions and an.find(part.token) not in an.classes(d):
                if i >= len(sizes) or sizes[i] != -1:
                    return "sizes a read axis with a traced constant"
    src = node.args[0] if node.args else None
    for r in an.restricts.get(node, []):
        restricted = _classes(part, src, r.in_dim) if isinstance(src, fx.Node) else set()
        if not restricted & positions:
            continue
        if r.out_dim is None or r.step != 1:
            return "picks positions one by one or with a step"
        if not any(e.node is node for e in part.exits) and not _counts_from_front(node, r.in_dim):
            return "slices positions counted from the end"
        in_classes -= restricted  # the slice's output axis carries them on
    if not in_classes <= out_classes:
        return "drops a position axis"
    return None


def _classes(part: Partition, node: fx.Node, dim: int) -> set[int]:
    """The classes of `node`'s dimension `dim` (none for a value without tensor dimensions)."""
    dims = part.dims.dims_of(node)
    return set(part.dims.classes(dims[dim])) if dim < len(dims) else set()


def _counts_from_front(node: fx.Node, dim: int) -> bool:
    """Whether `node` (a slice or narrow of input axis `dim`) starts at a
    position counted from the front, or from so far back that it starts at
    0 at any length."""
    src = tensor_of(node.args[0])
    name = op_name(node)
    if name == "narrow":
        start = node.args[2] if len(node.args) > 2 else node.kwargs.get("start")
        return isinstance(start, int) and start >= 0
    if name != "getitem" or src is None:
        return False
    items = list(node.args[1]) if isinstance(node.args[1], tuple) else [node.args[1]]
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    d = 0
    for item in items:
        if item is Ellipsis:
            d += src.dim() - consumed
            continue
        if item is None:
            continue
        if d == dim:
            if not isinstance(item, slice) or not (item.start is None or isinstance(item.start, int)):
                return False
            return item.start is None or item.start >= 0 or item.start + src.shape[d] <= 0
        d += 1
    return False
