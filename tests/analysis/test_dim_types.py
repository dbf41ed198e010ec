"""The records and operator families of dimension propagation
(`analysis/dim_types.py`), checked against torch itself: every operator
listed as keeping its input's shape does, every broadcasting one
broadcasts, every elementwise one commutes with a permutation of positions
and draws no random numbers, and every value-less one returns no tensor."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from longstraw.analysis.dim_types import (BROADCAST, ELEMENTWISE, NO_VALUE, SAME_AS_SELF, Restriction,
                                          normalize_dims, tensor_args)
from longstraw.nodes import RANDOM_OPS


def _op(name: str) -> Callable[..., Any]:
    """The callable Dynamo records under `name`: an `operator` builtin, a Tensor method or a torch function."""
    for home in (operator, torch.Tensor, F, torch, torch._C):
        if hasattr(home, name):
            return getattr(home, name)
    raise AssertionError(f"no operator named {name}")


_SCALARS = {"clamp": (0.2,), "clamp_min": (0.2,), "clamp_max": (0.5,), "pow": (2,), "float_power": (2,),
            "to": (torch.float64,), "type": (torch.float64,)}


def _unary(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "type_as":
        return x.type_as(x.double())
    if name == "invert":
        x = x > 0.5
    return _op(name)(x, *_SCALARS.get(name, ()))


def _binary(name: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if name == "where":
        return torch.where(a > 0.5, a, b)
    if name == "masked_fill":
        return a.masked_fill(b > 0.5, 0.0)
    if name == "lerp":
        return a.lerp(b, 0.3)
    if name in ("addcmul", "addcdiv"):
        return _op(name)(a, a, b)
    if name in ("and_", "or_", "xor"):
        a, b = a > 0.5, b > 0.5
    return _op(name)(a, b)


def _positive(*shape: int) -> torch.Tensor:
    """Values in (0.1, 0.9): every listed operator (log, logit, sqrt...) is finite there."""
    return torch.rand(*shape, generator=torch.Generator().manual_seed(0)) * 0.8 + 0.1


def test_every_operator_listed_as_same_as_self_keeps_its_inputs_shape():
    x = _positive(2, 3)
    changed = [name for name in sorted(SAME_AS_SELF - {"cuda"}) if _unary(name, x.clone()).shape != x.shape]
    assert changed == []


def test_every_broadcasting_operator_broadcasts_its_operands():
    def shape(name: str) -> tuple[int, ...]:
        if name in ("iadd", "imul"):  # in place: the operand broadcasts into the target
            return tuple(_binary(name, _positive(3, 4), _positive(4)).shape)
        return tuple(_binary(name, _positive(3, 1), _positive(1, 4)).shape)

    assert {name: shape(name) for name in BROADCAST} == {name: (3, 4) for name in BROADCAST}


def test_elementwise_operators_commute_with_a_permutation_of_positions():
    a, b = _positive(7), _positive(7).flip(0)
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(1))
    unary = [name for name in sorted(ELEMENTWISE & SAME_AS_SELF)
             if not torch.equal(_unary(name, a.clone())[perm], _unary(name, a[perm].clone()))]
    binary = [name for name in sorted(ELEMENTWISE & BROADCAST)
              if not torch.equal(_binary(name, a.clone(), b)[perm], _binary(name, a[perm].clone(), b[perm]))]
    assert unary == [] and binary == []
    assert ELEMENTWISE <= SAME_AS_SELF | BROADCAST


def test_no_elementwise_operator_draws_random_numbers():
    assert "dropout" in SAME_AS_SELF and not ELEMENTWISE & RANDOM_OPS


def test_every_value_less_operator_returns_no_tensor():
    x = torch.ones(2, 3)
    results = {
        "size": x.size(), "dim": x.dim(), "numel": x.numel(), "stride": x.stride(),
        "_set_grad_enabled": _op("_set_grad_enabled")(torch.is_grad_enabled()),
        "_log_api_usage_once": _op("_log_api_usage_once")("longstraw.tests"),
    }
    assert set(results) == NO_VALUE
    assert not [name for name, value in results.items() if isinstance(value, torch.Tensor)]


@pytest.mark.parametrize("dims, rank, want", [
    (None, 3, [0, 1, 2]),
    (-1, 3, [2]),
    (1, 3, [1]),
    ((0, -2), 4, [0, 2]),
    ([-1], 0, [0]),
], ids=["none-is-every-dimension", "negative", "positive", "several", "rank-zero"])
def test_normalize_dims_counts_negative_dimensions_from_the_end(dims, rank, want):
    assert normalize_dims(dims, rank) == want


def test_tensor_args_lists_the_tensor_inputs_in_argument_order():
    def fn(x, y):
        return torch.add(y, x, alpha=x.size(1)), x * x, torch.add(x, other=y)

    gm = fx.symbolic_trace(fn)
    values = {"x": torch.ones(2, 3), "y": torch.ones(3)}
    nodes = {n.name: n for n in gm.graph.nodes}
    for node in gm.graph.nodes:
        node.meta["longstraw_value"] = values.get(node.name, 3 if node.name == "size" else None)
    x, y = nodes["x"], nodes["y"]
    assert [tensor_args(nodes[k]) for k in ("add", "mul", "add_1")] == [[y, x], [x, x], [x, y]]


def test_a_restriction_is_a_frozen_record_of_step_one_by_default():
    kept = Restriction(in_dim=1, out_dim=None, start=4, stop=5)
    assert kept.step == 1 and kept == Restriction(1, None, 4, 5, 1) != Restriction(1, 1, 4, 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        kept.start = 0
