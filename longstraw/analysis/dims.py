"""Dimension propagation: which tensor dimensions are the same axis.

Every dimension of every tensor in the graph is a product of *factors*
(usually one). Operators impose equalities between factors, recorded in a
union-find: `a * b` unifies aligned dimensions of equal size, `linear` keeps
all but the last, `view` maps groups of dimensions with equal products, and
so on. Nothing is inferred from sizes alone: two dimensions of size 17 are
the same axis only if some operator says so. After the walk, the sequence
axis is the class of the attention queries' position dimension and the group
axis the class of their batch dimension (`partition.py` seeds both).

The walk also records what later stages must check: dimensions an operator
mixes values along (`mixes`), restrictions of a dimension to a sub-range
(`restricts`: slices, `narrow`, integer indices), dimensions split in a way
that does not follow their factors (`splits`), and operators without a rule
(`unknown`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.fx as fx

from longstraw.nodes import is_call, op_name, tensor_of

if TYPE_CHECKING:
    from longstraw.analysis.dim_types import Dim, Restriction
from longstraw.analysis.dim_rules import rule_for
from longstraw.analysis.dim_types import NO_VALUE


class DimRules:
    """What an architecture pass's `dim_rule` may do with the analysis: read
    the dimensions of a node, make new ones, say two are the same axis, and
    declare the dimensions its operator mixes values along (the positions
    it reads earlier values from). A dimension is a tuple of factors; two
    dimensions are the same axis only where a rule says so."""

    def __init__(self, analysis: "DimAnalysis") -> None:
        self._analysis = analysis

    def of(self, node: fx.Node) -> list[Dim]:
        """The dimensions of a tensor node's value, one per axis."""
        return self._analysis.dims_of(node)

    def fresh(self, shape: Sequence[int]) -> list[Dim]:
        """New dimensions, one per size in `shape`, unrelated to any other."""
        return self._analysis.fresh_dims(shape)

    def same(self, a: Dim, b: Dim) -> None:
        """`a` and `b` are the same axis (ignored where their sizes differ)."""
        self._analysis.unify(a, b)

    def mixes(self, node: fx.Node, *dims: Dim) -> None:
        """`node`'s operator combines values along `dims` (its sequence axis)."""
        self._analysis.mixes[node] = list(dims)


class DimAnalysis:
    """Union-find over dimension factors for one graph (see module docstring).
    `claimed_rule(rules, node)` gives the dimensions of claimed operators
    (an architecture pass's `dim_rule`), or None for the built-in rules."""

    def __init__(self, graph: fx.Graph, claimed_rule: Callable[[DimRules, fx.Node], Any] | None = None) -> None:
        self._claimed_rule = claimed_rule
        self.rules = DimRules(self)
        self._parent: list[int] = []
        self._size: list[int] = []
        self.dims: dict[fx.Node, Any] = {}
        self.mixes: dict[fx.Node, list[Dim]] = {}
        self.restricts: dict[fx.Node, list[Restriction]] = {}
        self.splits: dict[fx.Node, list[Dim]] = {}
        self.unknown: set[fx.Node] = set()
        for node in graph.nodes:
            self._visit(node)

    # union-find -------------------------------------------------------

    def fresh(self, size: int) -> Dim:
        self._parent.append(len(self._parent))
        self._size.append(int(size))
        return (len(self._parent) - 1,)

    def find(self, factor: int) -> int:
        while self._parent[factor] != factor:
            self._parent[factor] = self._parent[self._parent[factor]]
            factor = self._parent[factor]
        return factor

    def unify(self, a: Dim, b: Dim) -> None:
        if len(a) != len(b):
            return
        for fa, fb in zip(a, b):
            ra, rb = self.find(fa), self.find(fb)
            if ra != rb and self._size[ra] == self._size[rb]:
                self._parent[rb] = ra

    def classes(self, dim: Dim) -> tuple[int, ...]:
        return tuple(self.find(f) for f in dim)

    def factor_size(self, factor: int) -> int:
        return self._size[self.find(factor)]

    def dims_of(self, node: fx.Node) -> list[Dim]:
        dims = self.dims.get(node)
        return dims if isinstance(dims, list) and (not dims or isinstance(dims[0], tuple)) else []

    def dim_index(self, node: fx.Node, cls: int) -> int | None:
        """Index of the first dimension of `node` that contains class `cls`."""
        for i, dim in enumerate(self.dims_of(node)):
            if cls in self.classes(dim):
                return i
        return None

    def has_class(self, node: fx.Node, cls: int) -> bool:
        return self.dim_index(node, cls) is not None

    def carries_class(self, node: fx.Node, cls: int) -> bool:
        """Whether a dimension of `node`, or of any piece of a tuple value, contains class `cls`."""
        dims = self.dims.get(node)
        if not dims:
            return False
        if isinstance(dims[0], list):
            return any(cls in self.classes(d) for piece in dims for d in piece)
        return any(cls in self.classes(d) for d in dims)

    def restriction(self, node: fx.Node, cls: int) -> Restriction | None:
        """How `node` restricts its first argument's dimension of class `cls` (a slice of it), if it does."""
        src = node.args[0] if node.args else None
        if not isinstance(src, fx.Node):
            return None
        dims = self.dims_of(src)
        for r in self.restricts.get(node, []):
            if cls in self.classes(dims[r.in_dim]):
                return r
        return None

    # the walk -----------------------------------------------------------

    def fresh_dims(self, shape: Sequence[int]) -> list[Dim]:
        return [self.fresh(s) for s in shape]

    def _visit(self, node: fx.Node) -> None:
        value = node.meta.get("longstraw_value")
        if node.op in ("placeholder", "get_attr"):
            self.dims[node] = self._fresh_for(value)
            return
        if not is_call(node):
            return
        name = op_name(node)
        if name in NO_VALUE or value is None or (name == "getattr" and not isinstance(value, torch.Tensor)):
            return
        out = self._claimed_rule(self.rules, node) if self._claimed_rule is not None else None
        if out is not None:
            self.dims[node] = out
            return
        rule = rule_for(name)
        out = rule(self, node) if rule is not None else None
        if out is None:
            self.dims[node] = self._fresh_for(value)
            if any(tensor_of(a) is not None for a in node.all_input_nodes) or isinstance(value, torch.Tensor):
                self.unknown.add(node)
            return
        self.dims[node] = out

    def _fresh_for(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self.fresh_dims(value.shape)
        if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
            return [self.fresh_dims(v.shape) for v in value]
        return None

    def dims_and_shape(self, node: Any) -> tuple[list[Dim], tuple[int, ...]]:
        t = tensor_of(node)
        return self.dims_of(node), tuple(t.shape)

    def shape_of(self, node: fx.Node) -> tuple[int, ...]:
        return tuple(tensor_of(node).shape)

    def broadcast(self, ins: Sequence[tuple[list[Dim], Sequence[int]]], out_shape: Sequence[int]) -> list[Dim]:
        """The dimensions of a broadcast of `ins` ((dimensions, shape) pairs)
        to `out_shape`: inputs' dimensions aligned from the right and of the
        output's size are the same axis."""
        out: list[Dim] = []
        for i, size in enumerate(out_shape):
            candidates = []
            for dims, shape in ins:
                j = i - (len(out_shape) - len(shape))
                if j >= 0 and shape[j] == size:
                    candidates.append(dims[j])
            for c in candidates[1:]:
                self.unify(candidates[0], c)
            out.append(candidates[0] if candidates else self.fresh(size))
        return out
