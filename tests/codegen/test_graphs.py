"""The graphs around the steps (`codegen/graphs.py`), on small hand-built graphs: which nodes a value
needs, the outer graph's imports and values, the tail fed with the branch outputs, and grad-mode
regions replayed so that none turns autograd on inside a no-grad call."""

from __future__ import annotations

import operator
import types

import pytest
import torch
import torch.fx as fx

from longstraw.codegen.graphs import build_from_inputs, build_outer, build_tail, generated_module, needed_for, step_imports


def _call(graph: fx.Graph, target, *args) -> fx.Node:
    return graph.call_function(target, args)


def _partition(graph: fx.Graph, **fields) -> types.SimpleNamespace:
    """The fields of a `Partition` these functions read."""
    part = dict(graph=graph, placeholders=list(graph.find_nodes(op="placeholder")), roots=[], sequence=set(),
                branch=set(), outer_data=set(), branch_outputs=[])
    part.update(fields)
    return types.SimpleNamespace(**part)


def test_needed_nodes_stop_at_the_stop_set_and_leave_out_positional_ones():
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    c = _call(graph, operator.add, a, 1.0)
    d = _call(graph, operator.mul, c, b)
    e = _call(graph, torch.sin, d)
    _call(graph, torch.cos, a)
    assert needed_for([e], set()) == {e, d, c, b, a}
    assert needed_for([e], {c}) == {e, d, c, b}
    assert needed_for([e], {c}, positional={d}) == {e, c, b}  # d's inputs are needed, d itself is not


def test_the_steps_import_the_roots_and_the_outer_data_they_read_once_in_order():
    """`m` is read by a prefix node and `n` by prefix and branch nodes; `t`
    only by the tail, `r0`'s own input by the root alone: neither imported."""
    graph = fx.Graph()
    ids, w = graph.placeholder("ids"), graph.placeholder("w")
    r_in = _call(graph, operator.add, ids, 1.0)
    r0 = _call(graph, operator.mul, r_in, w)
    m, n, t = (_call(graph, operator.mul, ids, float(k)) for k in (2, 3, 4))
    seq = _call(graph, operator.add, r0, m)
    seq2 = _call(graph, operator.add, seq, n)
    br = _call(graph, operator.sub, seq2, n)
    tail = _call(graph, operator.add, br, t)
    graph.output(tail)
    part = _partition(graph, roots=[types.SimpleNamespace(node=r0)], sequence={r0, seq, seq2}, branch={br},
                      outer_data={r_in, m, n, t})
    assert step_imports(part) == [r0, m, n]
    outer = build_outer(part)
    x, weight = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])
    got = outer.module(x, weight)
    assert outer.externals == [ids, w] and type(outer.module).__name__ == "LongStrawOuter"
    assert [g.tolist() for g in got] == [((x + 1) * weight).tolist(), (x * 2).tolist(), (x * 3).tolist()]
    assert len(list(outer.module.graph.find_nodes(op="call_function", target=operator.mul))) == 3  # not t's


def test_a_graph_from_the_inputs_computes_only_the_values_asked_for():
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    a = _call(graph, operator.add, x, 1.0)
    b = _call(graph, operator.mul, a, y)
    _call(graph, torch.sin, x)
    built = build_from_inputs(_partition(graph), [b, a], "Scorer")
    assert [t.tolist() for t in built.module(torch.tensor(2.0), torch.tensor(5.0))] == [15.0, 3.0]
    assert not list(built.module.graph.find_nodes(op="call_function", target=torch.sin))


def test_the_tail_reads_the_branch_outputs_instead_of_computing_them():
    graph = fx.Graph()
    x = graph.placeholder("x")
    row = _call(graph, operator.mul, x, 3.0)  # a branch output
    graph.output(_call(graph, operator.add, row, x))
    tail = build_tail(_partition(graph, branch_outputs=[row]))
    assert tail.externals == [x, row] and type(tail.module).__name__ == "LongStrawTail"
    assert tail.module(torch.tensor(2.0), torch.tensor(100.0)).item() == 102.0
    assert not list(tail.module.graph.find_nodes(op="call_function", target=operator.mul))


def _switch(graph: fx.Graph, enabled: bool) -> None:
    _call(graph, torch._C._set_grad_enabled, enabled)


def _tail_with_grad_regions() -> fx.GraphModule:
    """a = 2x under no_grad, then b = a * x where the graph re-enables grad
    (HF's rotary embedding does), an empty no-grad region, c = b + x, and
    d = -c under no_grad again, closed before the output as Dynamo closes it."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    _switch(graph, False)
    a = _call(graph, operator.mul, x, 2.0)
    _switch(graph, True)
    b = _call(graph, operator.mul, a, x)
    _switch(graph, False)
    _switch(graph, True)
    c = _call(graph, operator.add, b, x)
    _switch(graph, False)
    d = _call(graph, operator.neg, c)
    _switch(graph, True)
    graph.output((a, b, c, d))
    return build_tail(_partition(graph)).module


@pytest.mark.parametrize("ambient", [True, False])
def test_grad_mode_regions_are_replayed_and_never_turn_autograd_on_inside_no_grad(ambient):
    tail = _tail_with_grad_regions()
    x = torch.tensor(3.0, requires_grad=True)
    with torch.set_grad_enabled(ambient):
        a, b, c, d = tail(x)
        assert torch.is_grad_enabled() == ambient
    assert [t.requires_grad for t in (a, b, c, d)] == [False, ambient, ambient, False]
    assert [t.item() for t in (a, b, c, d)] == [6.0, 18.0, 21.0, -21.0]


def test_a_switch_is_emitted_only_where_an_emitted_node_needs_another_mode():
    switches = _tail_with_grad_regions().graph.find_nodes(op="call_function", target=torch._C._set_grad_enabled)
    assert len(switches) == 4  # off before a, on before b, off before d, on before the output; none for the empty region


def test_a_no_grad_region_left_open_at_the_output_returns_in_the_callers_mode():
    """Dynamo leaves a region open after `torch.set_grad_enabled(False)`
    called as a function: the tail computes in it and gives the caller's
    mode back before it returns, as a Dynamo graph does."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    _switch(graph, False)
    graph.output(_call(graph, operator.neg, x))
    tail = build_tail(_partition(graph)).module
    assert list(tail.graph.nodes)[-1].op == "output"
    with torch.enable_grad():
        out = tail(torch.ones(2, requires_grad=True))
        assert torch.is_grad_enabled() and not out.requires_grad


def test_a_malformed_graph_is_refused_when_its_module_is_made():
    other = fx.Graph()
    graph = fx.Graph()
    graph.output(_call(graph, operator.neg, other.placeholder("x")))
    with pytest.raises(RuntimeError, match="does not belong to this Graph"):
        generated_module(graph, "Broken")
