"""Dimension rules of operators that compute (linear maps, reductions, attention, MoE experts), and the table
`DimAnalysis` looks an operator's rule up in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.fx as fx

from longstraw.nodes import arg, op_name, tensor_of

if TYPE_CHECKING:
    from longstraw.analysis.dim_types import Dim
    from longstraw.analysis.dims import DimAnalysis
from longstraw.analysis.dim_types import BROADCAST, SAME_AS_SELF, normalize_dims, tensor_args
from longstraw.analysis.layout_rules import LAYOUT_RULES

_REDUCE = {"sum", "mean", "amax", "amin", "prod", "std", "var", "norm", "logsumexp", "all", "any", "count_nonzero"}


_ALONG_DIM = {"softmax", "log_softmax", "cumsum", "cumprod", "logcumsumexp", "argsort"}


_FACTORY = {"arange", "zeros", "ones", "empty", "full", "rand", "randn", "randint", "tensor",
            "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "linspace", "eye"}


_LIKE = {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like"}


def _same_as_self(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    src = node.args[0]
    if not isinstance(src, fx.Node) or tensor_of(src) is None:
        return None
    if tuple(tensor_of(src).shape) != an.shape_of(node):
        return _broadcast(an, node)
    return list(an.dims_of(src))


def _broadcast(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    if tensor_of(node) is None:
        return None
    return an.broadcast([an.dims_and_shape(n) for n in tensor_args(node)], an.shape_of(node))


def _linear(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    dims, _ = an.dims_and_shape(node.args[0])
    return dims[:-1] + [an.fresh(an.shape_of(node)[-1])]


def _embedding(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    dims, _ = an.dims_and_shape(node.args[0])
    return dims + [an.fresh(an.shape_of(node)[-1])]


def _addmm(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    """`addmm(bias, a, b)` / `baddbmm(x, a, b)`: a matmul plus a broadcast term
    (HF GPT-2's Conv1D over a `[batch * positions, channels]` view)."""
    first, second = ("batch1", "batch2") if op_name(node) == "baddbmm" else ("mat1", "mat2")
    product = _matmul_of(an, node, arg(node, 1, first), arg(node, 2, second))
    if product is None:
        return None
    bias = node.args[0]
    if isinstance(bias, fx.Node) and tensor_of(bias) is not None:
        bdims, bshape = an.dims_and_shape(bias)
        out_shape = an.shape_of(node)
        for i in range(1, len(bshape) + 1):
            if bshape[-i] == out_shape[-i]:
                an.unify(product[-i], bdims[-i])
    return product


def _reduce(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    src = node.args[0]
    if not isinstance(src, fx.Node) or tensor_of(src) is None:
        return None
    dims, shape = an.dims_and_shape(src)
    first = 2 if op_name(node) == "norm" else 1  # `norm(input, p, dim, keepdim)`
    which = arg(node, first, "dim")
    keepdim = arg(node, first + 1, "keepdim", False)
    if op_name(node) in ("std", "var") and "correction" in node.kwargs:
        keepdim = node.kwargs.get("keepdim", False)
    reduced = normalize_dims(which, len(shape))
    an.mixes[node] = [dims[i] for i in reduced]
    out = []
    for i, dim in enumerate(dims):
        if i in reduced:
            if keepdim:
                out.append(an.fresh(1))
        else:
            out.append(dim)
    return out if len(out) == len(an.shape_of(node)) else None


def _min_max(an: DimAnalysis, node: fx.Node) -> Any:
    """`min`/`max`: elementwise against a tensor, a full reduction, or
    `(values, indices)` along a dimension."""
    other = arg(node, 1, "dim")
    if isinstance(other, fx.Node) and tensor_of(other) is not None:
        return _broadcast(an, node)
    if other is None:
        return _reduce(an, node)
    dims, shape = an.dims_and_shape(node.args[0])
    d = other % len(shape)
    an.mixes[node] = [dims[d]]
    kept = [an.fresh(1) if i == d else dim for i, dim in enumerate(dims) if i != d or arg(node, 2, "keepdim", False)]
    return [kept, list(kept)]


def _topk(an: DimAnalysis, node: fx.Node) -> list[list[Dim]]:
    """`(values, indices)` of the `k` largest along `dim`: mixes that
    dimension only (MoE routers pick experts per position this way)."""
    dims, shape = an.dims_and_shape(node.args[0])
    d = arg(node, 2, "dim", -1) % len(shape)
    an.mixes[node] = [dims[d]]
    kept = dims[:d] + [an.fresh(arg(node, 1, "k"))] + dims[d + 1:]
    return [kept, list(kept)]


def _sort(an: DimAnalysis, node: fx.Node) -> list[list[Dim]]:
    """`(values, indices)` sorted along `dim`: every output row may come from
    any input row, so it mixes that dimension (HF's grouped_mm experts sort
    token rows by expert)."""
    dims, shape = an.dims_and_shape(node.args[0])
    d = arg(node, 1, "dim", -1) % len(shape)
    an.mixes[node] = [dims[d]]
    return [list(dims), list(dims)]


def _one_hot(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    """Each index becomes a row over a new class dimension, position by position."""
    dims, _ = an.dims_and_shape(node.args[0])
    return dims + [an.fresh(an.shape_of(node)[-1])]


def _tensor_attribute(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    """`x.T`, `x.mT`, `x.mH`: transposes; any other tensor attribute has no rule."""
    dims = an.dims_of(node.args[0])
    if node.args[1] == "T":
        return list(reversed(dims))
    if node.args[1] in ("mT", "mH") and len(dims) >= 2:
        return dims[:-2] + [dims[-1], dims[-2]]
    return None


def _diff(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    dims, shape = an.dims_and_shape(node.args[0])
    d = arg(node, 2, "dim", -1) % len(shape)
    an.mixes[node] = [dims[d]]
    out = list(dims)
    if an.shape_of(node)[d] != shape[d]:
        out[d] = an.fresh(an.shape_of(node)[d])
    return out


def _along_dim(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    dims, shape = an.dims_and_shape(node.args[0])
    d = arg(node, 1, "dim")
    an.mixes[node] = [dims[i] for i in normalize_dims(d, len(shape))]
    return list(dims)


def _norm(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    dims, shape = an.dims_and_shape(node.args[0])
    normalized = arg(node, 1, "normalized_shape")
    k = len(normalized) if isinstance(normalized, (tuple, list, torch.Size)) else 1
    an.mixes[node] = dims[len(dims) - k:]
    return list(dims)


def _matmul(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    return _matmul_of(an, node, node.args[0], node.args[1])


def _matmul_of(an: DimAnalysis, node: fx.Node, a: Any, b: Any) -> list[Dim] | None:
    (da, sa), (db, sb) = an.dims_and_shape(a), an.dims_and_shape(b)
    if len(sa) < 2 or len(sb) < 2:
        return None
    an.unify(da[-1], db[-2])
    an.mixes[node] = [da[-1]]
    out_shape = an.shape_of(node)
    batch = an.broadcast([(da[:-2], sa[:-2]), (db[:-2], sb[:-2])], out_shape[:-2])
    return batch + [da[-2], db[-1]]


def _gather(an: DimAnalysis, node: fx.Node) -> list[Dim] | None:
    src = node.args[0]
    d = arg(node, 1, "dim")
    index = arg(node, 2, "index")
    (ds, ss), (di, si) = an.dims_and_shape(src), an.dims_and_shape(index)
    d %= len(ss)
    for i, (a, b) in enumerate(zip(ds, di)):
        if i != d and ss[i] == si[i]:
            an.unify(a, b)
    an.mixes[node] = [ds[d]]
    return list(di)


def _sdpa(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    q, k, v = node.args[0], node.args[1], node.args[2]
    (dq, sq), (dk, sk), (dv, _) = an.dims_and_shape(q), an.dims_and_shape(k), an.dims_and_shape(v)
    for i in range(len(sq) - 2):
        if sk[i] == sq[i]:
            an.unify(dq[i], dk[i])
    an.unify(dk[-2], dv[-2])
    mask = arg(node, 3, "attn_mask")
    if isinstance(mask, fx.Node) and tensor_of(mask) is not None:
        dm, sm = an.dims_and_shape(mask)
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
    hidden, _ = an.dims_and_shape(node.args[0])
    for routing in node.args[1:3]:
        an.unify(an.dims_of(routing)[0], hidden[0])
    return list(hidden)


def _logprobs_and_entropy(an: DimAnalysis, node: fx.Node) -> list[list[Dim]] | None:
    """`longstraw::logprobs_and_entropy` (the scorer's log-probs and
    entropies from logits `[..., V]`) is per position: it mixes the
    vocabulary axis only, and the index and mask are the logits' positions."""
    if getattr(node.target, "namespace", None) != "longstraw":
        return None
    logits, _ = an.dims_and_shape(node.args[0])
    for per_position in node.args[1:3]:
        for a, b in zip(an.dims_of(per_position), logits[:-1]):
            an.unify(a, b)
    an.mixes[node] = [logits[-1]]
    return [list(logits[:-1]), list(logits[:-1])]


def _factory(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    return an.fresh_dims(an.shape_of(node))


def _like(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    return list(an.dims_of(node.args[0]))


def _triangular(an: DimAnalysis, node: fx.Node) -> list[Dim]:
    dims, _ = an.dims_and_shape(node.args[0])
    an.mixes[node] = dims[-2:]
    return list(dims)


_RULES: dict[str, Callable[[DimAnalysis, fx.Node], Any]] = {
    **LAYOUT_RULES,
    "linear": _linear,
    "embedding": _embedding,
    "matmul": _matmul, "bmm": _matmul, "mm": _matmul, "addmm": _addmm, "baddbmm": _addmm,
    "gather": _gather,
    "topk": _topk, "sort": _sort, "one_hot": _one_hot,
    "min": _min_max, "max": _min_max,
    "getattr": _tensor_attribute,
    "diff": _diff,
    "scaled_dot_product_attention": _sdpa,
    "rms_norm": _norm, "layer_norm": _norm,
    "tril": _triangular, "triu": _triangular,
    "moe_experts.default": _moe_experts,
    "logprobs_and_entropy.default": _logprobs_and_entropy,
    **{name: _reduce for name in _REDUCE},
    **{name: _along_dim for name in _ALONG_DIM},
    **{name: _factory for name in _FACTORY},
    **{name: _like for name in _LIKE},
}


def rule_for(name: str) -> Callable[[DimAnalysis, fx.Node], Any] | None:
    """The built-in rule of operator `name`, or None where there is none."""
    rule = _RULES.get(name)
    if rule is None and name in SAME_AS_SELF:
        return _same_as_self
    if rule is None and name in BROADCAST:
        return _broadcast
    return rule
