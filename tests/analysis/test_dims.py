"""Dimension propagation (`analysis/dims.py`) on small traced graphs: two
dimensions are one axis only where an operator says so and their sizes
agree, an operator without a rule gets new dimensions and is reported, a
claimed rule replaces the built-in one, and the queries a later stage asks
(the index of a class, a restriction to a slice) read what the walk found."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from longstraw.analysis.dim_types import Restriction
from longstraw.analysis.dims import DimAnalysis, DimRules
from longstraw.nodes import op_name

from helpers.recorded import ValueRecorder


def _traced(fn: Callable[..., Any], *args: torch.Tensor) -> dict[str, fx.Node]:
    gm = fx.symbolic_trace(fn)
    ValueRecorder(gm).run(*args)
    return {n.name: n for n in gm.graph.nodes}


def _analysed(fn: Callable[..., Any], *args: torch.Tensor, claimed_rule=None) -> tuple[DimAnalysis, dict[str, fx.Node]]:
    nodes = _traced(fn, *args)
    return DimAnalysis(nodes["output"].graph, claimed_rule), nodes


def _classes(an: DimAnalysis, node: fx.Node) -> list[tuple[int, ...]]:
    return [an.classes(d) for d in an.dims_of(node)]


def test_equal_sizes_are_one_axis_only_where_an_operator_says_so():
    an, n = _analysed(lambda x, y, z: (x * y, z), *(torch.ones(2, 3) for _ in range(3)))
    assert _classes(an, n["x"]) == _classes(an, n["y"]) == _classes(an, n["mul"])
    assert not set(_classes(an, n["z"])) & set(_classes(an, n["x"]))
    assert not an.unknown


def test_unify_joins_factors_of_equal_size_transitively_and_nothing_else():
    an = DimAnalysis(fx.Graph())
    a, b, c, d = an.fresh(4), an.fresh(4), an.fresh(5), an.fresh(4)
    an.unify(a, c)
    an.rules.same(b, c)
    an.unify(a, b + d)  # a dimension of one factor is not one of two
    assert len({an.classes(x) for x in (a, b, c, d)}) == 4
    an.unify(a, b)
    an.rules.same(b, d)
    assert an.classes(a) == an.classes(b) == an.classes(d) != an.classes(c)
    assert [an.factor_size(f) for f in a + c] == [4, 5]


def test_an_operator_without_a_rule_gets_new_dimensions_and_is_reported():
    an, n = _analysed(lambda x: (x.flip(0), x.size()), torch.ones(2, 3))
    assert an.unknown == {n["flip"]}
    assert [an.factor_size(f) for d in an.dims_of(n["flip"]) for f in d] == [2, 3]
    assert not set(_classes(an, n["flip"])) & set(_classes(an, n["x"]))
    assert n["size"] not in an.dims  # a size is no tensor: nothing to propagate


def test_a_claimed_rule_decides_its_operator_and_the_built_in_rules_the_rest():
    def flip_rule(rules: DimRules, node: fx.Node) -> list | None:
        if op_name(node) != "flip":
            return None
        x = rules.of(node.args[0])
        out = rules.fresh([2, 3])
        rules.same(out[1], x[1])
        rules.same(out[0], x[1])  # sizes 2 and 3: ignored
        rules.mixes(node, x[0])
        return out

    an, n = _analysed(lambda x: x.flip(0).exp(), torch.ones(2, 3), claimed_rule=flip_rule)
    x, flip = _classes(an, n["x"]), _classes(an, n["flip"])
    assert flip[1] == x[1] and flip[0] not in x
    assert an.mixes == {n["flip"]: [an.dims_of(n["x"])[0]]}
    assert _classes(an, n["exp"]) == flip and not an.unknown


def test_a_tuple_value_has_no_dimensions_of_its_own_but_carries_its_pieces_classes():
    an, n = _analysed(lambda x: x.split(2, 1)[0], torch.ones(3, 4))
    rows, cols = _classes(an, n["x"])
    assert an.dims_of(n["split"]) == [] and not an.has_class(n["split"], rows[0])
    assert an.carries_class(n["split"], rows[0]) and not an.carries_class(n["split"], cols[0])
    assert an.dim_index(n["getitem"], rows[0]) == 0 and an.dim_index(n["getitem"], cols[0]) is None


def test_a_dimension_is_found_by_any_of_its_factors():
    an, n = _analysed(lambda x: x.flatten(0, 1), torch.ones(2, 3, 4))
    g, t, c = (cls[0] for cls in _classes(an, n["x"]))
    assert [an.dim_index(n["flatten"], cls) for cls in (g, t, c)] == [0, 0, 1]


def test_a_restriction_is_found_by_the_class_of_the_dimension_it_slices():
    an, n = _analysed(lambda x: (x[:, 1:3], x.exp()), torch.ones(2, 5))
    rows, cols = _classes(an, n["x"])
    assert an.restriction(n["getitem"], cols[0]) == Restriction(in_dim=1, out_dim=1, start=1, stop=3)
    assert an.restriction(n["getitem"], rows[0]) is None
    assert an.restriction(n["exp"], cols[0]) is None


def test_a_broadcast_aligns_from_the_right_and_makes_a_dimension_no_input_has():
    an, n = _analysed(lambda x, y, z: (x + y, y * z), torch.ones(3, 1), torch.ones(4), torch.ones(2, 4))
    x, y, z = (_classes(an, n[k]) for k in "xyz")
    assert _classes(an, n["add"]) == [x[0], y[0]]
    assert y[0] == z[1] != x[1]
    one = an.fresh(1)
    (stretched,) = an.broadcast([([one], (1,))], (4,))
    assert an.classes(stretched) != an.classes(one) and an.factor_size(stretched[0]) == 4
