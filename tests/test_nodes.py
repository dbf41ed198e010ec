"""Predicates over FX nodes (`longstraw/nodes.py`), on graphs traced by
`torch.fx.symbolic_trace`: one name per operation whether called as a
function or a method, size lists however they were written, ancestors up
to a stop, and which calls draw random numbers."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from longstraw.nodes import ancestors, arg, is_random, op_name, size_args
from longstraw.trace.functionalize import updated


def _calls(fn) -> list[fx.Node]:
    return [n for n in fx.symbolic_trace(fn).graph.nodes if n.op in ("call_function", "call_method")]


def test_an_operation_has_one_name_called_either_way():
    def fn(x, y):
        return torch.matmul(x, y).view(4) & x.bool().view(4)
    assert [op_name(n) for n in _calls(fn)] == ["matmul", "view", "bool", "view", "and_"]


def test_sizes_are_read_however_they_were_written():
    def fn(x):
        return x.view(2, -1), x.view((2, -1)), torch.reshape(x, (2, -1)), x.reshape(shape=(2, -1))
    assert [size_args(n) for n in _calls(fn)] == [[2, -1]] * 4


def test_an_argument_is_found_by_position_or_by_name():
    def fn(x):
        return F.dropout(x, 0.5), F.dropout(x, p=0.25)
    first, second = _calls(fn)
    assert arg(first, 1, "p") == 0.5 and arg(second, 1, "p") == 0.25 and arg(second, 2, "training", True) is True


def test_ancestors_stop_where_told():
    def fn(x, y):
        a = x + 1
        b = a * y
        return b - x
    graph = fx.symbolic_trace(fn).graph
    x, y, a, b, c = (n for n in graph.nodes if n.op != "output")
    assert ancestors([c]) == {x, y, a, b, c}
    assert ancestors([c], stop=[b]) == {x, b, c}  # b's inputs are not looked at; x reaches c directly


def test_random_calls_are_known_also_as_updates():
    def fn(x):
        return F.dropout(x, 0.1), torch.randn_like(x), x.exp()
    assert [is_random(n) for n in _calls(fn)] == [True, True, False]
    graph = fx.Graph()
    x = graph.placeholder("x")
    drawn = graph.call_function(updated, (x, "normal_"))  # functionalisation's form of `x.normal_()`
    copied = graph.call_function(updated, (x, "copy_", x))
    assert is_random(drawn) and not is_random(copied) and not is_random(x)
