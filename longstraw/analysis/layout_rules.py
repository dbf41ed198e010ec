"""Dimension rules of operators that move, index or join dimensions without computing along them:
views, transposes, indexing, scatters, `cat`, `stack`, `split`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.fx as fx

from longstraw.nodes import arg, op_name, size_args, tensor_of

if TYPE_CHECKING:
    from longstraw.analysis.dim_types import Dim
    from longstraw.analysis.dims import DimAnalysis
from longstraw.analysis.dim_types import BROADCAST, SAME_AS_SELF, Restriction, normalize_dims


def _view(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    """Map the input's factors, in order, onto the output sizes: whole
    factors are kept, merged into products, or split where a size requires
    it (the split factor is recorded; splitting the token axis is an error
    later). Size-1 dimensions stay aligned where both sides have one, and a
    size-1 factor merged into a larger dimension stays one of its factors
    (GPT-2 flattens `[G, T, C]` to `[G * T, C]` at G = 1 too)."""
    in_dims, _ = an.dims_and_shape(node.args[0])
    out_shape = an.shape_of(node)
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
    return an.fresh_dims(out_shape)


def _transpose(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    dims, shape = an.dims_and_shape(node.args[0])
    rank = len(shape)
    if op_name(node) == "t":
        a, b = 0, rank - 1
    else:
        a, b = arg(node, 1, "dim0"), arg(node, 2, "dim1")
        a = node.kwargs.get("axis0") if a is None else a  # swapaxes names them axis0, axis1
        b = node.kwargs.get("axis1") if b is None else b
        a, b = a % rank, b % rank
    out = list(dims)
    out[a], out[b] = out[b], out[a]
    return out


def _permute(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    dims, shape = an.dims_and_shape(node.args[0])
    order = size_args(node) if node.op == "call_method" else list(arg(node, 1, "dims"))
    return [dims[d % len(shape)] for d in order]


def _unsqueeze(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    dims, shape = an.dims_and_shape(node.args[0])
    d = arg(node, 1, "dim") % (len(shape) + 1)
    return dims[:d] + [an.fresh(1)] + dims[d:]


def _squeeze(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    dims, shape = an.dims_and_shape(node.args[0])
    which = arg(node, 1, "dim")
    drop = set(normalize_dims(which, len(shape))) if which is not None else set(range(len(shape)))
    return [d for i, (d, s) in enumerate(zip(dims, shape)) if not (i in drop and s == 1)]


def _view_as_complex(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    """`[..., 2]` real pairs -> `[...]` complex numbers (complex rotary embeddings)."""
    dims, _ = an.dims_and_shape(node.args[0])
    return dims[:-1]


def _view_as_real(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    """`[...]` complex numbers -> `[..., 2]` real pairs."""
    dims, _ = an.dims_and_shape(node.args[0])
    return dims + [an.fresh(2)]


def _expand(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    """expand, broadcast_to, repeat: aligned dims of unchanged size are kept."""
    dims, shape = an.dims_and_shape(node.args[0])
    out_shape = an.shape_of(node)
    out = []
    for i, size in enumerate(out_shape):
        j = i - (len(out_shape) - len(shape))
        out.append(dims[j] if j >= 0 and shape[j] == size else an.fresh(size))
    if op_name(node) == "expand_as":
        other, _ = an.dims_and_shape(node.args[1])
        for o, d in zip(other, out):
            an.unify(o, d)
    return out


def _repeat_interleave(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    """An integer repeat count `r` along `d` makes row `i * r + j` a copy of
    row `i`: the output dimension is the input's factors times a new one of
    size `r` (HF's batched_mm experts repeat each token once per expert it
    routes to). A tensor of counts gives a dimension of its own."""
    dims, shape = an.dims_and_shape(node.args[0])
    d = arg(node, 2, "dim")
    if d is None:
        return None
    d %= len(shape)
    out = list(dims)
    repeats = arg(node, 1, "repeats")
    out[d] = dims[d] + an.fresh(repeats) if type(repeats) is int else an.fresh(an.shape_of(node)[d])
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
    dims, shape = an.dims_and_shape(src)
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
    dims, shape = an.dims_and_shape(src)
    index_shape = tuple(torch.broadcast_shapes(*(tuple(tensor_of(i).shape) for i in indices)))
    return an.broadcast([an.dims_and_shape(n) for n in indices], index_shape) + dims[len(indices):], [], dims[: len(indices)]


def _updated(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    """`updated(x, op, ...)` (functionalize.py): x after an in-place write.
    The result has x's dimensions; the value written is aligned with the
    part of x it lands on (the indexed part for `setitem`, all of x for
    elementwise ops such as `copy_` and `add_`)."""
    target, op, rest = node.args[0], node.args[1], node.args[2:]
    dims, shape = an.dims_and_shape(target)
    if op.rstrip("_") in _SCATTERS:
        named = dict(zip(("dim", "index", "src"), rest)) | dict(node.kwargs)
        return _scatter_into(an, node, target, named["dim"], named["index"], named.get("src", named.get("value")))
    if op == "setitem":
        index, value = rest
        mask = index[0] if isinstance(index, tuple) and len(index) == 1 else index
        if isinstance(mask, fx.Node) and tensor_of(mask) is not None and tensor_of(mask).dtype == torch.bool:
            if isinstance(value, fx.Node) and tensor_of(value) is not None and tensor_of(value).numel() != 1:
                return None  # x[mask] = values: one value per selected element
            mask_dims, _ = an.dims_and_shape(mask)
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
        if op.rstrip("_") not in SAME_AS_SELF | BROADCAST | _FILLS:
            return None
        written, values = list(dims), list(rest)
    written_shape = [math.prod(an.factor_size(f) for f in d) for d in written]
    for value in values:
        if isinstance(value, fx.Node) and tensor_of(value) is not None:
            vdims, vshape = an.dims_and_shape(value)
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
    dims, shape = an.dims_and_shape(target)
    if not isinstance(index, fx.Node) or tensor_of(index) is None:
        return None
    d = dim % len(shape)
    index_dims, index_shape = an.dims_and_shape(index)
    if len(index_shape) != len(shape) or any(index_shape[i] != shape[i] for i in range(len(shape)) if i != d):
        return None
    for i in range(len(shape)):
        if i != d:
            an.unify(dims[i], index_dims[i])
    if isinstance(src, fx.Node) and tensor_of(src) is not None:
        src_dims, src_shape = an.dims_and_shape(src)
        if tuple(src_shape) != tuple(index_shape):
            return None
        for a, b in zip(index_dims, src_dims):
            an.unify(a, b)
    an.mixes[node] = [dims[d]]
    return list(dims)


def _narrow(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    dims, shape = an.dims_and_shape(node.args[0])
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
    dims, shape = an.dims_and_shape(node.args[0])
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
    out_shape = an.shape_of(node)
    d %= len(out_shape)
    # `torch.cat([torch.tensor([]), k])`, as HF attention does without a cache
    parts = [p for p in parts if not (tensor_of(p).dim() == 1 and tensor_of(p).numel() == 0)]
    if not parts:
        return None
    first, _ = an.dims_and_shape(parts[0])
    for p in parts[1:]:
        dims, _ = an.dims_and_shape(p)
        for i, (a, b) in enumerate(zip(first, dims)):
            if i != d:
                an.unify(a, b)
    out = list(first)
    if len(parts) > 1:
        out[d] = an.fresh(out_shape[d])
    return out


def _stack(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    tensors = arg(node, 0, "tensors")
    d = arg(node, 1, "dim", 0) % len(an.shape_of(node))
    first, _ = an.dims_and_shape(tensors[0])
    for t in tensors[1:]:
        dims, _ = an.dims_and_shape(t)
        for a, b in zip(first, dims):
            an.unify(a, b)
    return first[:d] + [an.fresh(len(tensors))] + first[d:]


def _split(an: DimAnalysis, node: fx.Node) -> list[list[Dim]] | None:
    dims, shape = an.dims_and_shape(node.args[0])
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


LAYOUT_RULES: dict[str, Callable[[DimAnalysis, fx.Node], Any]] = {
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
    "scatter": _scatter, "scatter_add": _scatter,
}
"""The rules of operators that move, index or join dimensions without computing along them."""
