"""What a traced attention mask is, proved from its graph.

`band_of` reads a positions-only mask as a band of key offsets (causal, a
sliding window) by abstract interpretation over affine position values.
A padding mask (HF's `causal & attention_mask[batch, key]`) reads an input:
`key_padding_of` splits it into the positions-only part and one key mask,
broadcast over queries, which the outer graph computes once per call for
the whole sequence and the step reads for its row and visible columns.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import torch
from torch import fx

from longstraw.nodes import ancestors, arg, is_sdpa, op_name, tensor_of

_CONJUNCTIONS = ("and_", "logical_and", "__and__")


_SAME_VALUES = ("expand", "to", "contiguous", "clone")


def reads_input(node: fx.Node) -> bool:
    """Whether `node` is computed from a graph input (not from positions alone)."""
    return any(n.op == "placeholder" for n in ancestors([node]))


def key_padding_of(mask: fx.Node) -> fx.Node | None:
    """The one factor of the boolean `mask` (`[..., queries, keys]`) that
    reads an input, when the mask is a conjunction of positions-only
    factors and that factor, and the factor is boolean and broadcast over
    the queries (`[..., 1, keys]`): a key mask, true where a key may be
    attended to. This is HF's `sdpa_mask` with a 2-D `attention_mask`
    (`causal & attention_mask[batch, key]`). None otherwise (a mask that
    reads inputs some other way is not a padding mask)."""
    factors: list[fx.Node] = []
    pending = [mask]
    while pending:
        node = pending.pop()
        value = tensor_of(node)
        if value is None or value.dtype != torch.bool or not reads_input(node):
            factors.append(node)
        elif op_name(node) in _CONJUNCTIONS and len(node.args) == 2 and all(isinstance(a, fx.Node) for a in node.args):
            pending.extend(node.args)
        elif op_name(node) in _SAME_VALUES and _keeps_bool(node):
            pending.append(node.args[0])
        else:
            factors.append(node)
    keys = [f for f in factors if reads_input(f)]
    if len(keys) != 1:
        return None
    value = tensor_of(keys[0])
    if value is None or value.dtype != torch.bool or value.dim() < 2 or value.shape[-2] != 1:
        return None
    return keys[0]


def _keeps_bool(node: fx.Node) -> bool:
    """A view, copy or device move that keeps a boolean tensor's values."""
    casts = [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, torch.dtype)]
    return all(t == torch.bool for t in casts)


@dataclasses.dataclass(frozen=True)
class _Affine:
    """An integer tensor `sum(coeff[a] * index along axis a) + const`, axes
    counted from the end (-1: the mask's columns, -2: its rows)."""

    coeffs: tuple[tuple[int, int], ...]
    const: int

    def plus(self, other: "_Affine", sign: int = 1) -> "_Affine":
        coeffs = dict(self.coeffs)
        for axis, c in other.coeffs:
            coeffs[axis] = coeffs.get(axis, 0) + sign * c
        return _Affine(tuple(sorted((a, c) for a, c in coeffs.items() if c)), self.const + sign * other.const)

    def times(self, k: int) -> "_Affine":
        return _Affine(tuple((a, k * c) for a, c in self.coeffs if k * c), k * self.const)

    def coeff(self, axis: int) -> int:
        return dict(self.coeffs).get(axis, 0)


@dataclasses.dataclass(frozen=True)
class _Band:
    """A boolean tensor true exactly where `lo <= row - column <= hi`."""

    lo: float
    hi: float


_ANY = _Band(-math.inf, math.inf)


_NONE = _Band(math.inf, -math.inf)  # false everywhere


def band_of(mask: fx.Node) -> tuple[float, float] | None:
    """`(lo, hi)` when the positions-only boolean `mask` (rows: queries,
    columns: keys) is proved, from the operators that build it, to be true
    exactly where `lo <= row - column <= hi` (causal: `(0, inf)`; a sliding
    window of W positions: `(0, W - 1)`); None when it is anything else or
    built by operators this proof does not know. Reads no values, so it
    holds for every length."""
    values: dict[fx.Node, Any] = {}
    needed = ancestors([mask])
    for node in (n for n in mask.graph.nodes if n in needed):  # graph order: inputs first
        values[node] = _on_shape(_abstract(node, values), tensor_of(node))
        if values[node] is None:
            return None
    band, value = values[mask], tensor_of(mask)
    if not isinstance(band, _Band) or value is None or value.dtype != torch.bool:
        return None
    return band.lo, band.hi


def _abstract(node: fx.Node, values: dict[fx.Node, Any]) -> Any:
    """The abstract value of one node of a mask's construction, or None."""
    name = op_name(node)
    args = [values.get(a, a) if isinstance(a, fx.Node) else a for a in node.args]

    def affine(x: Any) -> _Affine | None:
        if isinstance(x, bool):
            return None
        if isinstance(x, int):
            return _Affine((), x)
        return x if isinstance(x, _Affine) else None

    if node.op == "placeholder":
        return None
    if name == "arange":
        ints = [a for a in node.args if isinstance(a, int) and not isinstance(a, bool)]
        if len(node.args) == 1 and len(ints) == 1:
            return _Affine(((-1, 1),), 0)
        if len(node.args) == 2 and len(ints) == 2 and node.kwargs.get("step", 1) == 1:
            return _Affine(((-1, 1),), ints[0])
        return None
    if name in ("to", "contiguous", "expand", "clone"):
        casts = [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, torch.dtype)]
        if any(t != (torch.bool if isinstance(args[0], _Band) else torch.long) for t in casts):
            return None  # a cast changes what the values mean (a float mask is added to the scores)
        return args[0] if isinstance(args[0], (_Affine, _Band)) else None
    if name in ("new_ones", "ones") and node.kwargs.get("dtype") is torch.bool:
        return _ANY
    if name == "unsqueeze" and isinstance(args[0], _Affine):
        return _unsqueezed(args[0], tensor_of(node.args[0]).dim(), arg(node, 1, "dim"))
    if name == "getitem" and isinstance(args[0], _Affine):
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        shape = tensor_of(node.args[0]).shape
        if index and all(isinstance(i, fx.Node) for i in index):
            return _gathered(args[0], shape, index, values)
        index += (slice(None),) * (len(shape) - sum(1 for i in index if i is not None))  # the axes left whole
        if all(isinstance(i, slice) for i in index):
            return _sliced(args[0], shape, index)
        return _moved_axes(args[0], index)
    if name == "diff" and isinstance(args[0], _Affine):
        return _differenced(node, args[0], values)
    if name == "cumsum" and not node.kwargs.keys() - {"dim"}:
        return _summed(args[0], _axis(arg(node, 1, "dim"), tensor_of(node).dim()))
    if name in ("add", "sub"):
        a, b = affine(args[0]), affine(args[1])
        if a is None or b is None:
            return None
        return a.plus(b, 1 if name == "add" else -1)
    if name in _COMPARISONS:
        a, b = affine(args[0]), affine(args[1])
        return None if a is None or b is None else _compare(name, a, b)
    if name in ("and_", "logical_and", "mul") and all(isinstance(a, _Band) for a in args[:2]):
        (a, b) = args[:2]
        return _Band(max(a.lo, b.lo), min(a.hi, b.hi))
    return None


def _moved_axes(value: _Affine, index: tuple) -> _Affine | None:
    """An affine index tensor after `x[index]` with only `None`, full slices
    and `...`: its axes, counted from the end, move with the new ones."""
    full = slice(None, None, None)
    if not all(i is None or i == full for i in index):
        return None
    old_rank = sum(1 for i in index if i is not None)
    if old_rank != 1 or len(value.coeffs) > 1 or (value.coeffs and value.coeffs[0][0] != -1):
        return None  # only a 1-D position vector is placed on an axis
    axis = next(k for k, i in enumerate(index) if i is not None) - len(index)
    return _Affine(tuple((axis, c) for _, c in value.coeffs), value.const)


_COMPARISONS = {"gt": operator.gt, "ge": operator.ge, "lt": operator.lt, "le": operator.le, "eq": operator.eq,
                "ne": operator.ne}


def _compare(name: str, a: _Affine, b: _Affine) -> _Band | None:
    """`a <op> b` as a band, when `a - b` is `k * (row - column) + c` with k = +-1
    or the same everywhere (true or false everywhere)."""
    diff = a.plus(b, -1)
    if not diff.coeffs:
        return _ANY if _COMPARISONS[name](diff.const, 0) else _NONE
    if name == "ne":
        return None  # two half-planes, not a band
    coeffs = dict(diff.coeffs)
    k = coeffs.get(-2, 0)
    if set(coeffs) - {-1, -2} or k not in (1, -1) or coeffs.get(-1, 0) != -k:
        return None
    # k * d + c <op> 0, d = row - column
    c = diff.const
    if k == -1:  # -d + c <op> 0  <=>  d <flipped op> c
        bounds = {"gt": (-math.inf, c - 1), "ge": (-math.inf, c), "lt": (c + 1, math.inf), "le": (c, math.inf), "eq": (c, c)}
    else:  # d + c <op> 0  <=>  d <op> -c
        bounds = {"gt": (-c + 1, math.inf), "ge": (-c, math.inf), "lt": (-math.inf, -c - 1), "le": (-math.inf, -c), "eq": (-c, -c)}
    return _Band(*bounds[name])


def _axis(dim: object, rank: int) -> int | None:
    """`dim` counted from the end."""
    if not isinstance(dim, int) or isinstance(dim, bool) or not -rank <= dim < rank:
        return None
    return dim - rank if dim >= 0 else dim


def _on_shape(value: Any, tensor: torch.Tensor | None) -> Any:
    """`value` without coefficients on axes of size 1 (their index is always
    0), so a broadcast never stretches an axis the value depends on."""
    if not isinstance(value, _Affine) or tensor is None:
        return value
    if any(-a > tensor.dim() for a, _ in value.coeffs):
        return None
    return _Affine(tuple((a, c) for a, c in value.coeffs if tensor.shape[a] != 1), value.const)


def _bounds(value: _Affine, shape: torch.Size) -> tuple[int, int]:
    """The least and greatest entries of an affine tensor of `shape`."""
    spans = [c * (shape[a] - 1) for a, c in value.coeffs]
    return value.const + sum(min(0, s) for s in spans), value.const + sum(max(0, s) for s in spans)


def _unsqueezed(value: _Affine, rank: int, dim: object) -> _Affine | None:
    """`x.unsqueeze(dim)`: the axes before the new one move one further from the end."""
    new = _axis(dim, rank + 1)
    if new is None:
        return None
    return _Affine(tuple((a if a > new else a - 1, c) for a, c in value.coeffs), value.const)


def _sliced(value: _Affine, shape: torch.Size, index: tuple) -> _Affine | None:
    """`x[s0, s1, ...]` with slices only: index `i` along a sliced axis reads `start + step * i`."""
    parts = [p for s in index for p in (s.start, s.stop, s.step)]
    if len(index) > len(shape) or not all(p is None or type(p) is int for p in parts):
        return None
    moved = _Affine((), value.const)
    for k, size in enumerate(shape):
        axis, c = k - len(shape), value.coeff(k - len(shape))
        start, _, step = index[k].indices(size) if k < len(index) else (0, size, 1)
        moved = moved.plus(_Affine(((axis, c * step),) if c * step else (), c * start))
    return moved


def _gathered(value: _Affine, shape: torch.Size, index: tuple, values: dict[fx.Node, Any]) -> _Affine | None:
    """`x[i0, i1, ...]` with one integer index tensor per axis of `x`: the
    value at those indices, when every index an axis depends on is proved
    within the axis (a negative index would wrap around)."""
    if len(index) != len(shape):
        return None
    gathered = _Affine((), value.const)
    for k, node in enumerate(index):
        tensor, c = tensor_of(node), value.coeff(k - len(shape))
        if tensor is None or tensor.dtype == torch.bool or tensor.is_floating_point():
            return None
        if c:
            at = values.get(node)
            if not isinstance(at, _Affine):
                return None
            low, high = _bounds(at, tensor.shape)
            if low < 0 or high >= shape[k]:
                return None
            gathered = gathered.plus(at.times(c))
    return gathered


def _differenced(node: fx.Node, value: _Affine, values: dict[fx.Node, Any]) -> _Affine | None:
    """`torch.diff(x, dim=d, prepend=p)`: x's coefficient along `d` everywhere,
    when there is no `p` or `p` is x one step before its first index (HF's
    packed-sequence check of position ids that count up by one)."""
    rank = tensor_of(node.args[0]).dim()
    axis = _axis(arg(node, 2, "dim", -1), rank)
    if axis is None or arg(node, 1, "n", 1) != 1 or arg(node, 4, "append") is not None:
        return None
    step = value.coeff(axis)
    rest = _Affine(tuple((a, c) for a, c in value.coeffs if a != axis), value.const - step)
    prepend = arg(node, 3, "prepend")
    if prepend is not None:
        if not isinstance(prepend, fx.Node) or tensor_of(prepend) is None or tensor_of(prepend).shape[axis] != 1:
            return None
        before = values.get(prepend)
        if not isinstance(before, _Affine) or before.plus(rest, -1) != _Affine((), 0):
            return None
    return _Affine((), step)


def _summed(value: Any, axis: int | None) -> _Affine | None:
    """`cumsum` along `axis` of a tensor that is the same everywhere: `k * (i + 1)`."""
    if axis is None:
        return None
    if value == _NONE or value == _ANY:
        value = _Affine((), int(value == _ANY))
    if not isinstance(value, _Affine) or value.coeffs:
        return None
    return _Affine(((axis, value.const),) if value.const else (), value.const)


def selected_by_topk(node: fx.Node, hops: int = 12) -> bool:
    """An SDPA whose mask is built with a top-k (within `hops` operators of
    it; DSA's is 7 away): a selection, which only a pass that proves it may run
    (`passes/sparse_index.py`)."""
    mask = arg(node, 3, "attn_mask")
    if not is_sdpa(node) or not isinstance(mask, fx.Node):
        return False
    frontier, seen = {mask}, {mask}
    for _ in range(hops):
        if any(op_name(n) == "topk" for n in frontier):
            return True
        frontier = {m for n in frontier for m in n.all_input_nodes} - seen
        seen |= frontier
    return False
