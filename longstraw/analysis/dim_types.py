"""The records of dimension propagation (`analysis.dims`): a dimension as a tuple of factors, a restriction, and the operator families."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.fx as fx

from longstraw.nodes import tensor_of

Dim = tuple[int, ...]


SAME_AS_SELF = {
    "to", "type_as", "float", "double", "half", "bfloat16", "int", "long", "bool", "type",
    "contiguous", "clone", "detach", "requires_grad_", "cpu", "cuda", "dropout",
    "neg", "abs", "exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "sin", "cos", "tanh",
    "sigmoid", "silu", "gelu", "relu", "softplus", "erf", "square", "reciprocal", "sign",
    "logical_not", "invert", "nan_to_num", "clamp", "clamp_min", "clamp_max", "pow",
    "leaky_relu", "elu", "mish", "hardtanh", "relu6", "logit", "float_power",
    "floor", "ceil", "round", "trunc", "frac",
}


BROADCAST = {
    "add", "sub", "mul", "truediv", "div", "floordiv", "mod", "remainder", "maximum", "minimum",
    "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "logical_and", "logical_or",
    "where", "masked_fill", "atan2", "lerp", "addcmul", "addcdiv", "rsub", "iadd", "imul", "polar",
    "multiply", "subtract", "divide", "true_divide",  # torch's aliases of mul, sub and div
}


ELEMENTWISE = frozenset(SAME_AS_SELF | BROADCAST) - {"to", "type", "type_as", "dropout", "cpu", "cuda"}
"""Operators applied position by position, whose scalar operands may change between calls."""


NO_VALUE = {"_set_grad_enabled", "_log_api_usage_once", "size", "dim", "numel", "stride"}


@dataclasses.dataclass(frozen=True)
class Restriction:
    """A dimension of the input kept only over `[start, stop)` (or one index)."""

    in_dim: int
    out_dim: int | None  # None: the dimension was indexed away
    start: int
    stop: int
    step: int = 1


def normalize_dims(dims: Any, rank: int) -> list[int]:
    if dims is None:
        return list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return [d % rank if rank else 0 for d in dims]


def tensor_args(node: fx.Node) -> list[fx.Node]:
    flat: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: flat.append(n) if tensor_of(n) is not None else None)
    return flat
