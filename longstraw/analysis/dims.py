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

import dataclasses
import math
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from longstraw.nodes import arg, is_call, op_name, size_args, tensor_of

Dim = tuple[int, ...]

_SAME_AS_SELF = {
    "to", "type_as", "float", "double", "half", "bfloat16", "int", "long", "bool", "type",
    "contiguous", "clone", "detach", "requires_grad_", "cpu", "cuda", "dropout",
    "neg", "abs", "exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "sin", "cos", "tanh",
    "sigmoid", "silu", "gelu", "relu", "softplus", "erf", "square", "reciprocal", "sign",
    "logical_not", "invert", "nan_to_num", "clamp", "clamp_min", "clamp_max", "pow",
    "leaky_relu", "elu", "mish", "hardtanh", "relu6", "logit", "float_power",
    "floor", "ceil", "round", "trunc", "frac",
}
_BROADCAST = {
    "add", "sub", "mul", "truediv", "div", "floordiv", "mod", "remainder", "maximum", "minimum",
    "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "logical_and", "logical_or",
    "where", "masked_fill", "atan2", "lerp", "addcmul", "addcdiv", "rsub", "iadd", "imul", "polar",
}
ELEMENTWISE = frozenset(_SAME_AS_SELF | _BROADCAST) - {"to", "type", "type_as", "dropout", "cpu", "cuda"}
"""Operators applied position by position, whose scalar operands may change between calls."""
_REDUCE = {"sum", "mean", "amax", "amin", "prod", "std", "var", "norm", "logsumexp", "all", "any", "count_nonzero"}
_ALONG_DIM = {"softmax", "log_softmax", "cumsum", "cumprod", "logcumsumexp", "argsort"}
_FACTORY = {"arange", "zeros", "ones", "empty", "full", "rand", "randn", "randint", "tensor",
            "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "linspace", "eye"}
_LIKE = {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like"}
_NO_VALUE = {"_set_grad_enabled", "_log_api_usage_once", "size", "dim", "numel", "stride"}


@dataclasses.dataclass(frozen=True)
class Restriction:
    """A dimension of the input kept only over `[start, stop)` (or one index)."""

    in_dim: int
    out_dim: int | None  # None: the dimension was indexed away
    start: int
    stop: int
    step: int = 1


def _normalize_dims(dims: Any, rank: int) -> list[int]:
    if dims is None:
        return list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return [d % rank if rank else 0 for d in dims]


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
        return self._analysis._fresh_dims(shape)

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

    # the walk -----------------------------------------------------------

    def _fresh_dims(self, shape: Sequence[int]) -> list[Dim]:
        return [self.fresh(s) for s in shape]

    def _visit(self, node: fx.Node) -> None:
        value = node.meta.get("longstraw_value")
        if node.op in ("placeholder", "get_attr"):
            self.dims[node] = self._fresh_for(value)
            return
        if not is_call(node):
            return
        name = op_name(node)
        if name in _NO_VALUE or value is None or (name == "getattr" and not isinstance(value, torch.Tensor)):
            return
        out = self._claimed_rule(self.rules, node) if self._claimed_rule is not None else None
        if out is not None:
            self.dims[node] = out
            return
        rule = _RULES.get(name)
        if rule is None:
            if name in _SAME_AS_SELF:
                rule = _same_as_self
            elif name in _BROADCAST:
                rule = _broadcast
        out = rule(self, node) if rule is not None else None
        if out is None:
            self.dims[node] = self._fresh_for(value)
            if any(tensor_of(a) is not None for a in node.all_input_nodes) or isinstance(value, torch.Tensor):
                self.unknown.add(node)
            return
        self.dims[node] = out

    def _fresh_for(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._fresh_dims(value.shape)
        if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
            return [self._fresh_dims(v.shape) for v in value]
        return None

    def _in(self, node: Any) -> tuple[list[Dim], tuple[int, ...]]:
        t = tensor_of(node)
        return self.dims_of(node), tuple(t.shape)

    def _out_shape(self, node: fx.Node) -> tuple[int, ...]:
        return tuple(tensor_of(node).shape)

    def _broadcast_dims(self, inputs: list[fx.Node], out_shape: tuple[int, ...]) -> list[Dim]:
        out: list[Dim] = []
        ins = [self._in(n) for n in inputs]
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


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    flat: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: flat.append(n) if tensor_of(n) is not None else None)
    return flat


def _same_as_self(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    src = node.args[0]
    if not isinstance(src, fx.Node) or tensor_of(src) is None:
        return None
    if tuple(tensor_of(src).shape) != an._out_shape(node):
        return _broadcast(an, node)
    return list(an.dims_of(src))


def _broadcast(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    if tensor_of(node) is None:
        return None
    return an._broadcast_dims(_tensor_args(node), an._out_shape(node))


def _linear(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    dims, _ = an._in(node.args[0])
    return dims[:-1] + [an.fresh(an._out_shape(node)[-1])]


def _embedding(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    dims, _ = an._in(node.args[0])
    return dims + [an.fresh(an._out_shape(node)[-1])]


def _view(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    """Map the input's factors, in order, onto the output sizes: whole
    factors are kept, merged into products, or split where a size requires
    it (the split factor is recorded; splitting the token axis is an error
    later). Size-1 dimensions stay aligned where both sides have one, and a
    size-1 factor merged into a larger dimension stays one of its factors
    (GPT-2 flattens `[G, T, C]` to `[G * T, C]` at G = 1 too)."""
    in_dims, _ = an._in(node.args[0])
    out_shape = an._out_shape(node)
    queue = [(f, an.factor_size(f)) for dim in in_dims for f in dim]
    out: list[Dim] = []
    for size in out_shape:
        if size == 1:
            out.append((queue.pop(0)[0],) if queue and queue[0][1] == 1 else an.fresh(1))
            continue
        taken: list[int] = []
        product = 1
        while product < size and queue:
            factor, factor_size = queue.pop(0)
            if factor_size == 1:  # kept in the product: a group of one merged with positions stays the group
                taken.append(factor)
                continue
            if size % (product * factor_size) == 0:
                taken.append(factor)
                product *= factor_size
                continue
            need = size // product
            if factor_size % need:
                return _view_fallback(an, node, in_dims, out_shape)
            an.splits.setdefault(node, []).append((factor,))
            taken.append(an.fresh(need)[0])
            queue.insert(0, (an.fresh(factor_size // need)[0], factor_size // need))
            product *= need
        if product != size:
            return _view_fallback(an, node, in_dims, out_shape)
        out.append(tuple(taken))
    return out


def _view_fallback(an: DimAnalysis, node: fx.Node, in_dims: list[Dim], out_shape: tuple[int, ...]) -> list[Dim]:
    an.splits.setdefault(node, []).extend(in_dims)
    return an._fresh_dims(out_shape)


def _transpose(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    dims, shape = an._in(node.args[0])
    rank = len(shape)
    if op_name(node) == "t":
        a, b = 0, rank - 1
    else:
        a, b = arg(node, 1, "dim0") % rank, arg(node, 2, "dim1") % rank
    out = list(dims)
    out[a], out[b] = out[b], out[a]
    return out


def _permute(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    dims, shape = an._in(node.args[0])
    order = size_args(node) if node.op == "call_method" else list(arg(node, 1, "dims"))
    return [dims[d % len(shape)] for d in order]


def _unsqueeze(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    dims, shape = an._in(node.args[0])
    d = arg(node, 1, "dim") % (len(shape) + 1)
    return dims[:d] + [an.fresh(1)] + dims[d:]


def _squeeze(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    dims, shape = an._in(node.args[0])
    which = arg(node, 1, "dim")
    drop = set(_normalize_dims(which, len(shape))) if which is not None else set(range(len(shape)))
    return [d for i, (d, s) in enumerate(zip(dims, shape)) if not (i in drop and s == 1)]


def _view_as_complex(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    """`[..., 2]` real pairs -> `[...]` complex numbers (complex rotary embeddings)."""
    dims, _ = an._in(node.args[0])
    return dims[:-1]


def _view_as_real(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    """`[...]` complex numbers -> `[..., 2]` real pairs."""
    dims, _ = an._in(node.args[0])
    return dims + [an.fresh(2)]


def _expand(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    """expand, broadcast_to, repeat: aligned dims of unchanged size are kept."""
    dims, shape = an._in(node.args[0])
    out_shape = an._out_shape(node)
    out = []
    for i, size in enumerate(out_shape):
        j = i - (len(out_shape) - len(shape))
        out.append(dims[j] if j >= 0 and shape[j] == size else an.fresh(size))
    if op_name(node) == "expand_as":
        other, _ = an._in(node.args[1])
        for o, d in zip(other, out):
            an.unify(o, d)
    return out


def _repeat_interleave(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    """An integer repeat count `r` along `d` makes row `i * r + j` a copy of
    row `i`: the output dimension is the input's factors times a new one of
    size `r` (HF's batched_mm experts repeat each token once per expert it
    routes to). A tensor of counts gives a dimension of its own."""
    dims, shape = an._in(node.args[0])
    d = arg(node, 2, "dim")
    if d is None:
        return None
    d %= len(shape)
    out = list(dims)
    repeats = arg(node, 1, "repeats")
    out[d] = dims[d] + an.fresh(repeats) if type(repeats) is int else an.fresh(an._out_shape(node)[d])
    return out


def _getitem(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    src = node.args[0]
    src_dims = an.dims.get(src)
    index = node.args[1]
    if tensor_of(src) is None:
        # element of a tuple-valued node (split, chunk, unbind...)
        if isinstance(src_dims, list) and isinstance(index, int) and src_dims and isinstance(src_dims[0], list):
            return src_dims[index]
        return None
    indexed = _index(an, src, index)
    if indexed is None:
        return None
    out, restrictions, read_at_indices = indexed
    if read_at_indices:
        an.mixes[node] = read_at_indices
    if restrictions:
        an.restricts[node] = restrictions
    return out


def _as_slice(item: Any) -> Any:
    """A constant list index of consecutive ints (`x[:, [-2]]`) selects what a
    slice does; other lists stay lists (no rule)."""
    if isinstance(item, list) and item and all(type(i) is int for i in item):
        if all(i >= 0 for i in item) or all(i < 0 for i in item):
            if all(b == a + 1 for a, b in zip(item, item[1:])):
                return slice(item[0], item[-1] + 1 or None)
    return item


def _index(an: DimAnalysis, src: fx.Node, index: Any) -> tuple[list[Dim], list[Restriction], list[Dim]] | None:
    """Dimensions of `src[index]`, the restrictions the index applies, and
    the dimensions read at positions given by index tensors."""
    dims, shape = an._in(src)
    items = [_as_slice(i) for i in (index if isinstance(index, tuple) else [index])]
    if any(isinstance(i, (torch.Tensor, list)) for i in items):
        return None
    if any(isinstance(i, fx.Node) for i in items):
        return _advanced_index(an, src, items)
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    if Ellipsis in items:
        k = items.index(Ellipsis)
        items = items[:k] + [slice(None)] * (len(shape) - consumed) + items[k + 1:]
    else:
        items = items + [slice(None)] * (len(shape) - consumed)
    out: list[Dim] = []
    restrictions: list[Restriction] = []
    d = 0
    for item in items:
        if item is None:
            out.append(an.fresh(1))
            continue
        size = shape[d]
        if isinstance(item, int):
            pos = item % size
            restrictions.append(Restriction(d, None, pos, pos + 1))
        elif isinstance(item, slice):
            start, stop, step = item.indices(size)
            if step < 1:
                return None
            if start == 0 and stop == size and step == 1:
                out.append(dims[d])
            else:
                restrictions.append(Restriction(d, len(out), start, max(start, stop), step))
                out.append(an.fresh(len(range(start, stop, step))))
        else:
            return None
        d += 1
    return out, restrictions, []


def _advanced_index(
    an: DimAnalysis, src: fx.Node, items: list[Any]
) -> tuple[list[Dim], list[Restriction], list[Dim]] | None:
    """`x[i0, i1, ...]` with index tensors leading (`packed[(batch_idx, q_idx)]`):
    the output is the broadcast of the index tensors, then x's other dims.
    The indexed dims of x are read at arbitrary positions: recorded as mixed."""
    indices = [i for i in items if isinstance(i, fx.Node)]
    if items[: len(indices)] != indices or any(i != slice(None) for i in items[len(indices):]):
        return None
    if any(tensor_of(i) is None or tensor_of(i).dtype in (torch.bool, torch.uint8) for i in indices):
        return None
    dims, shape = an._in(src)
    index_shape = tuple(torch.broadcast_shapes(*(tuple(tensor_of(i).shape) for i in indices)))
    return an._broadcast_dims(indices, index_shape) + dims[len(indices):], [], dims[: len(indices)]


def _updated(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    """`updated(x, op, ...)` (functionalize.py): x after an in-place write.
    The result has x's dimensions; the value written is aligned with the
    part of x it lands on (the indexed part for `setitem`, all of x for
    elementwise ops such as `copy_` and `add_`)."""
    target, op, rest = node.args[0], node.args[1], node.args[2:]
    dims, shape = an._in(target)
    if op.rstrip("_") in _SCATTERS:
        named = dict(zip(("dim", "index", "src"), rest)) | dict(node.kwargs)
        return _scatter_into(an, node, target, named["dim"], named["index"], named.get("src", named.get("value")))
    if op == "setitem":
        index, value = rest
        mask = index[0] if isinstance(index, tuple) and len(index) == 1 else index
        if isinstance(mask, fx.Node) and tensor_of(mask) is not None and tensor_of(mask).dtype == torch.bool:
            if tensor_of(value) is not None and tensor_of(value).numel() != 1:
                return None  # x[mask] = values: one value per selected element
            mask_dims, _ = an._in(mask)
            for a, b in zip(dims, mask_dims):
                an.unify(a, b)
            return list(dims)
        indexed = _index(an, target, index)
        if indexed is None or indexed[2]:
            return None
        written, restrictions, _ = indexed
        if restrictions:
            an.restricts[node] = restrictions
        values = [value]
    else:
        if op.rstrip("_") not in _SAME_AS_SELF | _BROADCAST | _FILLS:
            return None
        written, values = list(dims), list(rest)
    written_shape = [math.prod(an.factor_size(f) for f in d) for d in written]
    for value in values:
        if isinstance(value, fx.Node) and tensor_of(value) is not None:
            vdims, vshape = an._in(value)
            for i in range(1, min(len(vshape), len(written_shape)) + 1):
                if vshape[-i] == written_shape[-i]:
                    an.unify(written[-i], vdims[-i])
    return list(dims)


_FILLS = {"copy", "fill", "zero"}
_SCATTERS = {"scatter", "scatter_add"}


def _scatter(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    """`x.scatter(dim, index, src)` / `scatter_add`, out of place."""
    src = arg(node, 3, "src")
    return _scatter_into(an, node, node.args[0], arg(node, 1, "dim"), arg(node, 2, "index"),
                         arg(node, 3, "value") if src is None else src)


def _scatter_into(an: DimAnalysis, node: fx.Node, target: fx.Node, dim: int, index: Any, src: Any) -> list[Dim] | None:
    """x with `src` written along `dim` at `index`: mixes `dim` only. Along
    every other dimension the index must cover x (a shorter index writes
    only x's first rows there, which depends on where a row is, so no rule);
    a tensor `src` is aligned with the index (DeepSeek-V3's router marks
    its chosen expert groups this way)."""
    dims, shape = an._in(target)
    if not isinstance(index, fx.Node) or tensor_of(index) is None:
        return None
    d = dim % len(shape)
    index_dims, index_shape = an._in(index)
    if len(index_shape) != len(shape) or any(index_shape[i] != shape[i] for i in range(len(shape)) if i != d):
        return None
    for i in range(len(shape)):
        if i != d:
            an.unify(dims[i], index_dims[i])
    if isinstance(src, fx.Node) and tensor_of(src) is not None:
        src_dims, src_shape = an._in(src)
        if tuple(src_shape) != tuple(index_shape):
            return None
        for a, b in zip(index_dims, src_dims):
            an.unify(a, b)
    an.mixes[node] = [dims[d]]
    return list(dims)


def _addmm(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    """`addmm(bias, a, b)` / `baddbmm(x, a, b)`: a matmul plus a broadcast term
    (HF GPT-2's Conv1D over a `[batch * positions, channels]` view)."""
    first, second = ("batch1", "batch2") if op_name(node) == "baddbmm" else ("mat1", "mat2")
    product = _matmul_of(an, node, arg(node, 1, first), arg(node, 2, second))
    if product is None:
        return None
    bias = node.args[0]
    if isinstance(bias, fx.Node) and tensor_of(bias) is not None:
        bdims, bshape = an._in(bias)
        out_shape = an._out_shape(node)
        for i in range(1, len(bshape) + 1):
            if bshape[-i] == out_shape[-i]:
                an.unify(product[-i], bdims[-i])
    return product


def _narrow(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    dims, shape = an._in(node.args[0])
    d, start, length = arg(node, 1, "dim"), arg(node, 2, "start"), arg(node, 3, "length")
    if not all(isinstance(v, int) for v in (d, start, length)):
        return None
    d %= len(shape)
    start %= shape[d] if shape[d] else 1
    out = list(dims)
    if start == 0 and length == shape[d]:
        return out
    out[d] = an.fresh(length)
    an.restricts[node] = [Restriction(d, d, start, start + length)]
    return out


def _select(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    dims, shape = an._in(node.args[0])
    d, index = arg(node, 1, "dim"), arg(node, 2, "index")
    if not isinstance(index, int):
        return None
    d %= len(shape)
    pos = index % shape[d]
    an.restricts[node] = [Restriction(d, None, pos, pos + 1)]
    return dims[:d] + dims[d + 1:]


def _cat(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    tensors = arg(node, 0, "tensors")
    d = arg(node, 1, "dim", 0)
    parts = [t for t in tensors if isinstance(t, fx.Node) and tensor_of(t) is not None]
    out_shape = an._out_shape(node)
    d %= len(out_shape)
    # `torch.cat([torch.tensor([]), k])`, as HF attention does without a cache
    parts = [p for p in parts if not (tensor_of(p).dim() == 1 and tensor_of(p).numel() == 0)]
    if not parts:
        return None
    first, _ = an._in(parts[0])
    for p in parts[1:]:
        dims, _ = an._in(p)
        for i, (a, b) in enumerate(zip(first, dims)):
            if i != d:
                an.unify(a, b)
    out = list(first)
    if len(parts) > 1:
        out[d] = an.fresh(out_shape[d])
    return out


def _stack(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    tensors = arg(node, 0, "tensors")
    d = arg(node, 1, "dim", 0) % len(an._out_shape(node))
    first, _ = an._in(tensors[0])
    for t in tensors[1:]:
        dims, _ = an._in(t)
        for a, b in zip(first, dims):
            an.unify(a, b)
    return first[:d] + [an.fresh(len(tensors))] + first[d:]


def _split(an: DimAnalysis, node: fx.Node) -> list[list[Dim]] | None:
    dims, shape = an._in(node.args[0])
    name = op_name(node)
    d = arg(node, 2 if name != "unbind" else 1, "dim", 0) % len(shape)
    value = node.meta["longstraw_value"]
    an.splits.setdefault(node, []).append(dims[d])
    result = []
    for piece in value:
        out = list(dims)
        if name == "unbind":
            out.pop(d)
        else:
            out[d] = an.fresh(piece.shape[d])
        result.append(out)
    return result


def _reduce(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    src = node.args[0]
    if not isinstance(src, fx.Node) or tensor_of(src) is None:
        return None
    dims, shape = an._in(src)
    which = arg(node, 1, "dim")
    keepdim = arg(node, 2, "keepdim", False)
    if op_name(node) in ("std", "var") and "correction" in node.kwargs:
        keepdim = node.kwargs.get("keepdim", False)
    reduced = _normalize_dims(which, len(shape))
    an.mixes[node] = [dims[i] for i in reduced]
    out = []
    for i, dim in enumerate(dims):
        if i in reduced:
            if keepdim:
                out.append(an.fresh(1))
        else:
            out.append(dim)
    return out if len(out) == len(an._out_shape(node)) else None


def _min_max(an: DimAnalysis, node: fx.Node) -> Any:
    """`min`/`max`: elementwise against a tensor, a full reduction, or
    `(values, indices)` along a dimension."""
    other = arg(node, 1, "dim")
    if isinstance(other, fx.Node) and tensor_of(other) is not None:
        return _broadcast(an, node)
    if other is None:
        return _reduce(an, node)
    dims, shape = an._in(node.args[0])
    d = other % len(shape)
    an.mixes[node] = [dims[d]]
    kept = [an.fresh(1) if i == d else dim for i, dim in enumerate(dims) if i != d or arg(node, 2, "keepdim", False)]
    return [kept, list(kept)]


def _topk(an: DimAnalysis, node: fx.Node) -> list[list[Dim]]:
    """`(values, indices)` of the `k` largest along `dim`: mixes that
    dimension only (MoE routers pick experts per position this way)."""
    dims, shape = an._in(node.args[0])
    d = arg(node, 2, "dim", -1) % len(shape)
    an.mixes[node] = [dims[d]]
    kept = dims[:d] + [an.fresh(arg(node, 1, "k"))] + dims[d + 1:]
    return [kept, list(kept)]


def _sort(an: DimAnalysis, node: fx.Node) -> list[list[Dim]]:
    """`(values, indices)` sorted along `dim`: every output row may come from
    any input row, so it mixes that dimension (HF's grouped_mm experts sort
    token rows by expert)."""
    dims, shape = an._in(node.args[0])
    d = arg(node, 1, "dim", -1) % len(shape)
    an.mixes[node] = [dims[d]]
    return [list(dims), list(dims)]


def _one_hot(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    """Each index becomes a row over a new class dimension, position by position."""
    dims, _ = an._in(node.args[0])
    return dims + [an.fresh(an._out_shape(node)[-1])]


def _tensor_attribute(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    """`x.T`, `x.mT`, `x.mH`: transposes; any other tensor attribute has no rule."""
    dims = an.dims_of(node.args[0])
    if node.args[1] == "T":
        return list(reversed(dims))
    if node.args[1] in ("mT", "mH") and len(dims) >= 2:
        return dims[:-2] + [dims[-1], dims[-2]]
    return None


def _diff(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    dims, shape = an._in(node.args[0])
    d = arg(node, 2, "dim", -1) % len(shape)
    an.mixes[node] = [dims[d]]
    out = list(dims)
    if an._out_shape(node)[d] != shape[d]:
        out[d] = an.fresh(an._out_shape(node)[d])
    return out


def _along_dim(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    dims, shape = an._in(node.args[0])
    d = arg(node, 1, "dim")
    an.mixes[node] = [dims[i] for i in _normalize_dims(d, len(shape))]
    return list(dims)


def _norm(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    dims, shape = an._in(node.args[0])
    normalized = arg(node, 1, "normalized_shape")
    k = len(normalized) if isinstance(normalized, (tuple, list, torch.Size)) else 1
    an.mixes[node] = dims[len(dims) - k:]
    return list(dims)


def _matmul(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    return _matmul_of(an, node, node.args[0], node.args[1])


def _matmul_of(an: DimAnalysis, node: fx.Node, a: Any, b: Any) -> list[Dim] | None:
    (da, sa), (db, sb) = an._in(a), an._in(b)
    if len(sa) < 2 or len(sb) < 2:
        return None
    an.unify(da[-1], db[-2])
    an.mixes[node] = [da[-1]]
    out_shape = an._out_shape(node)
    batch_shape = out_shape[:-2]
    batch: list[Dim] = []
    for i, size in enumerate(batch_shape):
        candidates = []
        for dims, shape in ((da[:-2], sa[:-2]), (db[:-2], sb[:-2])):
            j = i - (len(batch_shape) - len(shape))
            if j >= 0 and shape[j] == size:
                candidates.append(dims[j])
        for c in candidates[1:]:
            an.unify(candidates[0], c)
        batch.append(candidates[0] if candidates else an.fresh(size))
    return batch + [da[-2], db[-1]]


def _gather(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    src = node.args[0]
    d = arg(node, 1, "dim")
    index = arg(node, 2, "index")
    (ds, ss), (di, si) = an._in(src), an._in(index)
    d %= len(ss)
    for i, (a, b) in enumerate(zip(ds, di)):
        if i != d and ss[i] == si[i]:
            an.unify(a, b)
    an.mixes[node] = [ds[d]]
    return list(di)


def _sdpa(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    q, k, v = node.args[0], node.args[1], node.args[2]
    (dq, sq), (dk, sk), (dv, _) = an._in(q), an._in(k), an._in(v)
    for i in range(len(sq) - 2):
        if sk[i] == sq[i]:
            an.unify(dq[i], dk[i])
    an.unify(dk[-2], dv[-2])
    mask = arg(node, 3, "attn_mask")
    if isinstance(mask, fx.Node) and tensor_of(mask) is not None:
        dm, sm = an._in(mask)
        if len(sm) >= 1 and sm[-1] == sk[-2]:
            an.unify(dm[-1], dk[-2])
        if len(sm) >= 2 and sm[-2] == sq[-2]:
            an.unify(dm[-2], dq[-2])
        for i in range(2, len(sm)):  # leading mask dims against [batch, heads]
            j = len(sq) - 1 - i
            if j >= 0 and sm[-1 - i] == sq[j] and sm[-1 - i] != 1:
                an.unify(dm[-1 - i], dq[j])
    an.mixes[node] = [dq[-2], dk[-2]]
    return dq[:-1] + [dv[-1]]


def _moe_experts(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    """`longstraw::moe_experts` (HF's experts as one operator) is per position:
    a token's output row reads its own hidden, expert-id and routing-weight
    rows and the expert weights, which are parameters."""
    if getattr(node.target, "namespace", None) != "longstraw":
        return None
    hidden, _ = an._in(node.args[0])
    for routing in node.args[1:3]:
        an.unify(an.dims_of(routing)[0], hidden[0])
    return list(hidden)


def _factory(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    return an._fresh_dims(an._out_shape(node))


def _like(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    return list(an.dims_of(node.args[0]))


def _triangular(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    dims, _ = an._in(node.args[0])
    an.mixes[node] = dims[-2:]
    return list(dims)


_RULES: dict[str, Callable[[DimAnalysis, fx.Node], Any]] = {
    "linear": _linear,
    "embedding": _embedding,
    "view": _view, "reshape": _view, "flatten": _view, "unflatten": _view, "view_as": _view, "reshape_as": _view,
    "transpose": _transpose, "swapaxes": _transpose, "swapdims": _transpose, "t": _transpose,
    "permute": _permute,
    "unsqueeze": _unsqueeze, "squeeze": _squeeze,
    "view_as_complex": _view_as_complex, "view_as_real": _view_as_real,
    "expand": _expand, "expand_as": _expand, "broadcast_to": _expand,
    "repeat": _expand, "repeat_interleave": _repeat_interleave,
    "getitem": _getitem, "narrow": _narrow, "select": _select, "updated": _updated,
    "cat": _cat, "concat": _cat, "concatenate": _cat, "stack": _stack,
    "split": _split, "chunk": _split, "unbind": _split,
    "matmul": _matmul, "bmm": _matmul, "mm": _matmul, "addmm": _addmm, "baddbmm": _addmm,
    "gather": _gather, "scatter": _scatter, "scatter_add": _scatter,
    "topk": _topk, "sort": _sort, "one_hot": _one_hot,
    "min": _min_max, "max": _min_max,
    "getattr": _tensor_attribute,
    "diff": _diff,
    "scaled_dot_product_attention": _sdpa,
    "rms_norm": _norm, "layer_norm": _norm,
    "tril": _triangular, "triu": _triangular,
    "moe_experts.default": _moe_experts,
    **{name: _reduce for name in _REDUCE},
    **{name: _along_dim for name in _ALONG_DIM},
    **{name: _factory for name in _FACTORY},
    **{name: _like for name in _LIKE},
}
