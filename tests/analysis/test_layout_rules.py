"""The rules of operators that move, index or join dimensions
(`analysis/layout_rules.py`) on traced graphs: a view keeps, merges or
splits the input's factors (and records a split), indexing restricts a
dimension to the range it keeps, joins tie the parts they line up, and
writes align the value written with where it lands; an index or a write
the rules cannot follow is left unknown."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.fx as fx

from longstraw.analysis.dim_types import Restriction
from longstraw.analysis.dims import DimAnalysis
from longstraw.trace.functionalize import updated

from helpers.recorded import ValueRecorder


def _analysed(fn: Callable[..., Any], *args: torch.Tensor) -> tuple[DimAnalysis, dict[str, fx.Node]]:
    """`fn` traced with `updated` (functionalisation's form of an in-place write) kept as one call."""
    tracer = fx.Tracer(autowrap_functions=(updated,))
    graph = tracer.trace(fn)
    ValueRecorder(fx.GraphModule(tracer.root, graph)).run(*args)
    return DimAnalysis(graph), {n.name: n for n in graph.nodes}


def _positions(an: DimAnalysis, dims: list, source: fx.Node) -> list[int | None]:
    """Each of `dims` as the index of the same axis in `source`, None for an axis `source` lacks."""
    src = [an.classes(d) for d in an.dims_of(source)]
    return [src.index(an.classes(d)) if an.classes(d) in src else None for d in dims]


def _as(an: DimAnalysis, node: fx.Node, source: fx.Node) -> list[int | None]:
    return _positions(an, an.dims_of(node), source)


def _result(nodes: dict[str, fx.Node]) -> fx.Node:
    return nodes["output"].args[0]


def test_a_view_merges_whole_factors_and_its_inverse_gives_the_axes_back():
    an, n = _analysed(lambda x: x.view(6, 4).view(2, 3, 4), torch.ones(2, 3, 4))
    g, t, c = an.dims_of(n["x"])
    merged, channels = an.dims_of(n["view"])
    assert an.classes(merged) == an.classes(g) + an.classes(t) and an.classes(channels) == an.classes(c)
    assert _as(an, n["view_1"], n["x"]) == [0, 1, 2]
    assert not an.splits and not an.unknown


@pytest.mark.parametrize("fn, shape, dims", [
    (lambda x: x.view(2, 3, 4), (6, 4), [None, None, 1]),
    (lambda x: x.unflatten(1, (3, 4)), (2, 12), [0, None, None]),
], ids=["view", "unflatten"])
def test_a_view_that_splits_a_factor_records_the_split(fn, shape, dims):
    an, n = _analysed(fn, torch.ones(*shape))
    view = _result(n)
    assert _as(an, view, n["x"]) == dims
    split = dims.index(None)
    assert [an.classes(d) for d in an.splits[view]] == [an.classes(an.dims_of(n["x"])[split])]
    assert [an.factor_size(f) for d in an.dims_of(view) for f in d] == [2, 3, 4]


def test_a_view_across_factor_boundaries_splits_every_input_dimension():
    an, n = _analysed(lambda x: x.view(4, 6), torch.ones(6, 4))
    assert _as(an, n["view"], n["x"]) == [None, None]
    assert an.splits[n["view"]] == an.dims_of(n["x"])


def test_a_group_of_one_merged_with_positions_stays_one_of_its_factors():
    an, n = _analysed(lambda x: x.view(5, 3).view(1, 5, 3), torch.ones(1, 5, 3))
    g, t, c = an.dims_of(n["x"])
    assert [an.classes(d) for d in an.dims_of(n["view"])] == [an.classes(g) + an.classes(t), an.classes(c)]
    assert _as(an, n["view_1"], n["x"]) == [0, 1, 2]


@pytest.mark.parametrize("fn, shape, dims", [
    (lambda x: x.transpose(0, 2), (2, 1, 4), [2, 1, 0]),
    (lambda x: x.swapdims(-1, 0), (2, 1, 4), [2, 1, 0]),
    (lambda x: x.t(), (2, 4), [1, 0]),
    (lambda x: x.permute(2, 0, 1), (2, 1, 4), [2, 0, 1]),
    (lambda x: torch.permute(x, (1, 2, 0)), (2, 1, 4), [1, 2, 0]),
    (lambda x: x.unsqueeze(-2), (2, 1, 4), [0, 1, None, 2]),
    (lambda x: x.squeeze(1), (2, 1, 4), [0, 2]),
    (lambda x: x.squeeze(0), (2, 1, 4), [0, 1, 2]),
    (lambda x: x.squeeze(), (2, 1, 4, 1), [0, 2]),
    (lambda x: torch.view_as_complex(x), (2, 3, 2), [0, 1]),
    (lambda x: torch.view_as_real(x.to(torch.complex64)), (2, 3), [0, 1, None]),
    (lambda x: x.expand(2, 3, 4), (3, 1), [None, 0, None]),
    (lambda x: torch.broadcast_to(x, (3, 4)), (3, 1), [0, None]),
    (lambda x: x.repeat(2, 1), (3, 4), [None, 1]),
    (lambda x: x.repeat(2, 1, 1), (3, 4), [None, 0, 1]),
], ids=["transpose", "swapdims", "t", "permute-method", "permute-function", "unsqueeze", "squeeze-one",
        "squeeze-not-one", "squeeze-all", "view_as_complex", "view_as_real", "expand", "broadcast_to", "repeat",
        "repeat-new-leading"])
def test_moving_dimensions_keeps_each_axis(fn, shape, dims):
    an, n = _analysed(fn, torch.ones(*shape))
    assert _as(an, _result(n), n["x"]) == dims
    assert not an.unknown and not an.splits and not an.restricts


def test_expand_as_ties_the_expanded_dimensions_to_the_other_tensor():
    an, n = _analysed(lambda x, y: x.expand_as(y), torch.ones(3, 1), torch.ones(3, 4))
    assert _as(an, n["expand_as"], n["x"]) == [0, None] and _as(an, n["expand_as"], n["y"]) == [0, 1]


def test_repeat_interleave_makes_each_row_a_factor_times_its_copies():
    an, n = _analysed(lambda x, r: (x.repeat_interleave(2, dim=0), x.repeat_interleave(r, dim=0)),
                      torch.ones(3, 4), torch.tensor([1, 2, 1]))
    by_count, by_tensor = _result(n)
    rows, cols = an.dims_of(n["x"])
    copies, kept = an.dims_of(by_count)
    assert an.classes(copies)[0] == an.classes(rows)[0] and an.factor_size(copies[1]) == 2
    assert an.classes(kept) == an.classes(cols)
    assert _as(an, by_tensor, n["x"]) == [None, 1]


X = torch.ones(2, 5, 4)


@pytest.mark.parametrize("fn, dims, restrictions", [
    (lambda x: x[:, :], [0, 1, 2], []),
    (lambda x: x[:, 1:4], [0, None, 2], [Restriction(1, 1, 1, 4)]),
    (lambda x: x[:, -1], [0, 2], [Restriction(1, None, 4, 5)]),
    (lambda x: x[..., ::2], [0, 1, None], [Restriction(2, 2, 0, 4, 2)]),
    (lambda x: x[None, :, 2:], [None, 0, None, 2], [Restriction(1, 2, 2, 5)]),
    (lambda x: x[1:, :, 0], [None, 1], [Restriction(0, 0, 1, 2), Restriction(2, None, 0, 1)]),
    (lambda x: x[:, [3]], [0, None, 2], [Restriction(1, 1, 3, 4)]),
    (lambda x: x[:, [-2, -1]], [0, None, 2], [Restriction(1, 1, 3, 5)]),
    (lambda x: x.narrow(1, -2, 2), [0, None, 2], [Restriction(1, 1, 3, 5)]),
    (lambda x: x.narrow(1, 0, 5), [0, 1, 2], []),
    (lambda x: x.select(1, -1), [0, 2], [Restriction(1, None, 4, 5)]),
], ids=["whole", "slice", "last", "every-other", "new-axis", "slice-and-index", "one-item-list", "run-of-items",
        "narrow", "narrow-whole", "select"])
def test_indexing_restricts_the_dimension_to_the_range_it_keeps(fn, dims, restrictions):
    an, n = _analysed(fn, X)
    out = _result(n)
    assert _as(an, out, n["x"]) == dims
    assert an.restricts.get(out, []) == restrictions
    assert not an.unknown and not an.mixes


def test_index_tensors_give_their_own_dimensions_and_read_the_indexed_ones_anywhere():
    an, n = _analysed(lambda x, i, j: (x[i], x[i, j]), X, torch.zeros(2, 1, dtype=torch.long),
                      torch.zeros(3, dtype=torch.long))
    one, two = _result(n)
    assert _as(an, one, n["i"]) == [0, 1, None, None] and _as(an, one, n["x"])[2:] == [1, 2]
    assert _as(an, two, n["i"])[0] == 0 and _as(an, two, n["j"])[1] == 0 and _as(an, two, n["x"])[2] == 2
    assert [_positions(an, dims, n["x"]) for dims in an.mixes.values()] == [[0], [0, 1]]


@pytest.mark.parametrize("fn", [
    lambda x: x[:, [0, 2]],
    lambda x: x[x > 0],
    lambda x: x[:, x[0, :2, 0].long()],
], ids=["scattered-items", "boolean-mask", "index-tensor-after-a-slice"])
def test_an_index_the_rules_cannot_follow_is_unknown(fn):
    an, n = _analysed(fn, X)
    assert _result(n) in an.unknown


def test_cat_ties_every_dimension_but_the_joined_one():
    an, n = _analysed(lambda a, b: torch.cat([a, b], 1), torch.ones(2, 3), torch.ones(2, 5))
    assert _as(an, n["b"], n["a"]) == [0, None]
    assert _as(an, n["cat"], n["a"]) == [0, None] and an.factor_size(an.dims_of(n["cat"])[1][0]) == 8


def test_cat_after_an_empty_tensor_is_the_other_part():
    an, n = _analysed(lambda k: torch.cat([k.new_empty(0), k], -2), torch.ones(2, 5, 4))
    assert _as(an, n["cat"], n["k"]) == [0, 1, 2] and not an.unknown


def test_stack_ties_its_parts_and_adds_a_dimension():
    an, n = _analysed(lambda a, b: torch.stack([a, b], 1), torch.ones(2, 3), torch.ones(2, 3))
    assert _as(an, n["b"], n["a"]) == [0, 1] and _as(an, n["stack"], n["a"]) == [0, None, 1]


@pytest.mark.parametrize("fn, pieces", [
    (lambda x: x.split(2, 1), [[0, None], [0, None]]),
    (lambda x: x.chunk(2, dim=1), [[0, None], [0, None]]),
    (lambda x: x.unbind(1), [[0]] * 4),
], ids=["split", "chunk", "unbind"])
def test_splitting_a_dimension_records_it_and_gives_each_piece_the_others(fn, pieces):
    an, n = _analysed(fn, torch.ones(3, 4))
    op = next(node for node in n.values() if node.op == "call_method")
    assert [_positions(an, piece, n["x"]) for piece in an.dims[op]] == pieces
    assert an.splits == {op: [an.dims_of(n["x"])[1]]}


def test_scatter_ties_index_and_source_to_the_target_and_mixes_the_scattered_dimension():
    an, n = _analysed(lambda x, i, s: x.scatter(1, i, s), torch.ones(2, 3), torch.zeros(2, 1, dtype=torch.long),
                      torch.ones(2, 1))
    assert _as(an, n["scatter"], n["x"]) == [0, 1]
    assert _as(an, n["i"], n["x"]) == [0, None] and _as(an, n["s"], n["i"]) == [0, 1]
    assert an.mixes == {n["scatter"]: [an.dims_of(n["x"])[1]]}


@pytest.mark.parametrize("index, src", [((1, 1), (1, 1)), ((2, 1), (2, 2))], ids=["short-index", "larger-source"])
def test_a_scatter_whose_index_does_not_cover_the_target_is_unknown(index, src):
    an, n = _analysed(lambda x, i, s: x.scatter_add(1, i, s), torch.ones(2, 3), torch.zeros(*index, dtype=torch.long),
                      torch.ones(*src))
    assert an.unknown == {n["scatter_add"]}


def test_a_write_into_a_slice_restricts_it_and_ties_the_value_to_where_it_lands():
    an, n = _analysed(lambda x, v: updated(x, "setitem", (slice(None), slice(1, 3)), v), torch.ones(4, 5),
                      torch.ones(4, 2))
    assert _as(an, n["updated"], n["x"]) == [0, 1] and _as(an, n["v"], n["x"]) == [0, None]
    assert an.restricts == {n["updated"]: [Restriction(1, 1, 1, 3)]}


def test_an_elementwise_write_ties_the_operand_from_the_right():
    an, n = _analysed(lambda x, y: updated(x, "add_", y), torch.ones(4, 5), torch.ones(5))
    assert _as(an, n["updated"], n["x"]) == [0, 1] and _as(an, n["y"], n["x"]) == [1]


def test_a_write_of_a_number_through_a_boolean_mask_ties_the_mask_to_the_target():
    an, n = _analysed(lambda x, m: updated(x, "setitem", m, 0.0), torch.ones(4, 5), torch.ones(4, 5, dtype=torch.bool))
    assert _as(an, n["m"], n["x"]) == [0, 1] and not an.unknown


def test_a_scattering_write_mixes_the_scattered_dimension():
    an, n = _analysed(lambda x, i: updated(x, "scatter_", 1, i, 1.0),
                      torch.ones(2, 3), torch.zeros(2, 1, dtype=torch.long))
    assert _as(an, n["i"], n["x"]) == [0, None]
    assert an.mixes == {n["updated"]: [an.dims_of(n["x"])[1]]}


@pytest.mark.parametrize("fn", [
    lambda x, m: updated(x, "setitem", m, x[m] * 2),
    lambda x, m: updated(x, "exponential_"),
], ids=["one-value-per-selected-element", "random-draw"])
def test_a_write_the_rules_cannot_follow_is_unknown(fn):
    an, n = _analysed(fn, torch.ones(4, 5), torch.ones(4, 5, dtype=torch.bool))
    assert n["updated"] in an.unknown


def test_permute_with_the_order_as_a_keyword_moves_the_dimensions():
    an, n = _analysed(lambda x: x.permute(dims=(2, 0, 1)), torch.ones(2, 3, 4))
    assert _as(an, n["permute"], n["x"]) == [2, 0, 1]


def test_swapaxes_with_keyword_axes_swaps_them():
    an, n = _analysed(lambda x: x.swapaxes(axis0=0, axis1=2), torch.ones(2, 3, 4))
    assert _as(an, n["swapaxes"], n["x"]) == [2, 1, 0]
