"""The rules of computing operators (`analysis/dim_rules.py`), one operator
at a time on a traced graph: which input dimensions each output dimension
is, which dimensions it mixes values along, and which inputs it ties
together; an operator without a rule, or a lookalike of a project
operator, is left unknown."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import longstraw.models.moe  # noqa: F401  (registers `longstraw::moe_experts`)
from longstraw.analysis.dim_rules import rule_for
from longstraw.analysis.dims import DimAnalysis
from longstraw.nodes import op_name
from longstraw.runtime.kernels.logprobs import logprobs_and_entropy

from helpers.recorded import ValueRecorder


def _analysed(fn: Callable[..., Any], *args: torch.Tensor) -> tuple[DimAnalysis, dict[str, fx.Node]]:
    gm = fx.symbolic_trace(fn)
    ValueRecorder(gm).run(*args)
    return DimAnalysis(gm.graph), {n.name: n for n in gm.graph.nodes}


def _positions(an: DimAnalysis, dims: list, source: fx.Node) -> list[int | None]:
    """Each of `dims` as the index of the same axis in `source`, None for an axis `source` lacks."""
    src = [an.classes(d) for d in an.dims_of(source)]
    return [src.index(an.classes(d)) if an.classes(d) in src else None for d in dims]


def _as(an: DimAnalysis, node: fx.Node, source: fx.Node) -> list[int | None]:
    return _positions(an, an.dims_of(node), source)


def _mixed(an: DimAnalysis, source: fx.Node) -> dict[str, list[int | None]]:
    return {op_name(n): _positions(an, dims, source) for n, dims in an.mixes.items()}


def _result(nodes: dict[str, fx.Node]) -> fx.Node:
    return nodes["output"].args[0]


X = torch.ones(2, 3, 4)


@pytest.mark.parametrize("fn, dims, mixes", [
    (lambda x: x.exp(), [0, 1, 2], {}),
    (lambda x: x.sum(1), [0, 2], {"sum": [1]}),
    (lambda x: x.amax(-1, keepdim=True), [0, 1, None], {"amax": [2]}),
    (lambda x: x.mean(), [], {"mean": [0, 1, 2]}),
    (lambda x: x.std(1, correction=0, keepdim=True), [0, None, 2], {"std": [1]}),
    (lambda x: torch.max(x, 1, keepdim=True)[0], [0, None, 2], {"max": [1]}),
    (lambda x: x.max(), [], {"max": [0, 1, 2]}),
    (lambda x: x.topk(2, dim=1)[1], [0, None, 2], {"topk": [1]}),
    (lambda x: x.sort(1)[0], [0, 1, 2], {"sort": [1]}),
    (lambda x: x.softmax(-1), [0, 1, 2], {"softmax": [2]}),
    (lambda x: x.cumsum(1), [0, 1, 2], {"cumsum": [1]}),
    (lambda x: torch.diff(x, dim=1), [0, None, 2], {"diff": [1]}),
    (lambda x: F.layer_norm(x, (4,)), [0, 1, 2], {"layer_norm": [2]}),
    (lambda x: F.rms_norm(x, (3, 4)), [0, 1, 2], {"rms_norm": [1, 2]}),
    (lambda x: x.tril(), [0, 1, 2], {"tril": [1, 2]}),
    (lambda x: x.mT, [0, 2, 1], {}),
    (lambda x: x[0].T, [2, 1], {}),
    (lambda x: torch.zeros_like(x), [0, 1, 2], {}),
    (lambda x: x.new_zeros(2, 3, 4), [None, None, None], {}),
    (lambda x: F.linear(x, torch.ones(5, 4)), [0, 1, None], {}),
    (lambda x: x @ torch.ones(4, 5), [0, 1, None], {"matmul": [2]}),
], ids=["exp", "sum", "amax-keepdim", "mean-all", "std-correction", "max-along", "max-all", "topk", "sort",
        "softmax", "cumsum", "diff", "layer_norm", "rms_norm", "tril", "mT", "T", "zeros_like", "new_zeros",
        "linear", "matmul"])
def test_an_operator_keeps_drops_or_adds_dimensions_and_mixes_the_ones_it_reads_along(fn, dims, mixes):
    an, n = _analysed(fn, X)
    assert _as(an, _result(n), n["x"]) == dims
    assert _mixed(an, n["x"]) == mixes
    assert not an.unknown


def test_a_batched_matmul_ties_its_batches_and_the_contracted_dimensions():
    an, n = _analysed(lambda a, b: a @ b, torch.ones(2, 3, 4), torch.ones(2, 4, 5))
    a, b = (an.dims_of(n[k]) for k in "ab")
    assert an.classes(a[0]) == an.classes(b[0]) and an.classes(a[2]) == an.classes(b[1])
    assert _as(an, n["matmul"], n["a"]) == [0, 1, None] and _as(an, n["matmul"], n["b"]) == [0, None, 2]


def test_addmm_ties_the_added_term_to_the_product():
    an, n = _analysed(lambda bias, m1, m2: torch.addmm(bias, m1, m2),
                      torch.ones(5), torch.ones(3, 4), torch.ones(4, 5))
    assert _as(an, n["addmm"], n["bias"]) == [None, 0]
    assert _as(an, n["m2"], n["m1"]) == [1, None]


def test_an_embedding_adds_a_channel_dimension_to_its_indices():
    an, n = _analysed(lambda ids, table: F.embedding(ids, table),
                      torch.zeros(2, 5, dtype=torch.long), torch.ones(10, 3))
    assert _as(an, n["embedding"], n["ids"]) == [0, 1, None]
    assert _as(an, n["embedding"], n["table"]) == [None, None, None]


def test_a_broadcast_operand_aligns_from_the_right():
    an, n = _analysed(lambda x, y: (x.pow(y), x + y), torch.ones(3, 1), torch.ones(4))
    for out in _result(n):
        assert _as(an, out, n["x"]) == [0, None] and _as(an, out, n["y"]) == [None, 0]


def test_attention_ties_queries_keys_values_and_mask_and_mixes_both_position_axes():
    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v = torch.ones(2, 3, 4, 8), torch.ones(2, 3, 5, 8), torch.ones(2, 3, 5, 6)
    an, n = _analysed(fn, q, k, v, torch.ones(2, 1, 4, 5, dtype=torch.bool))
    sdpa = n["scaled_dot_product_attention"]
    assert _as(an, n["k"], n["q"])[:3] == [0, 1, None]
    assert _as(an, n["v"], n["k"])[2] == 2
    assert _as(an, n["mask"], n["q"]) == [0, None, 2, None] and _as(an, n["mask"], n["k"])[3] == 2
    assert _as(an, sdpa, n["q"]) == [0, 1, 2, None] and _as(an, sdpa, n["v"])[3] == 3
    assert _mixed(an, n["q"]) == {"scaled_dot_product_attention": [2, None]}
    assert _mixed(an, n["k"]) == {"scaled_dot_product_attention": [None, 2]}


def test_grouped_query_heads_are_not_tied_to_the_key_heads():
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    an, n = _analysed(fn, torch.ones(1, 4, 3, 8), torch.ones(1, 2, 3, 8), torch.ones(1, 2, 3, 8))
    assert _as(an, n["k"], n["q"])[:3] == [0, None, None]


def test_gather_ties_the_index_where_it_covers_the_source_and_mixes_the_gathered_dimension():
    def fn(x, full, short):
        return x.gather(2, full), x.gather(2, short)

    an, n = _analysed(fn, X, torch.zeros(2, 3, 1, dtype=torch.long), torch.zeros(2, 1, 1, dtype=torch.long))
    assert _as(an, n["gather"], n["x"]) == [0, 1, None] and _as(an, n["gather"], n["full"]) == [0, 1, 2]
    assert _as(an, n["short"], n["x"]) == [0, None, None]
    assert [_positions(an, dims, n["x"]) for dims in an.mixes.values()] == [[2], [2]]


def test_one_hot_adds_a_class_dimension_position_by_position():
    an, n = _analysed(lambda ids: F.one_hot(ids, 7), torch.zeros(2, 5, dtype=torch.long))
    assert _as(an, n["one_hot"], n["ids"]) == [0, 1, None] and not an.mixes


def test_logprobs_and_entropy_are_per_position_and_mix_the_vocabulary():
    def fn(logits, index, mask):
        return logprobs_and_entropy(logits, index, mask, 1.0)

    an, n = _analysed(fn, torch.ones(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool))
    op = next(node for node in n.values() if node.op == "call_function")
    assert [[an.classes(d) for d in piece] for piece in an.dims[op]] == [
        [an.classes(d) for d in an.dims_of(n["logits"])[:2]]] * 2
    assert _as(an, n["index"], n["logits"]) == _as(an, n["mask"], n["logits"]) == [0, 1]
    assert _mixed(an, n["logits"]) == {"logprobs_and_entropy.default": [2]}


def _experts(hidden, index, weights, up, down):
    return torch.ops.longstraw.moe_experts.default(hidden, index, weights, up, down, None, None, True, False, "silu")


def _experts_graph() -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    gm = fx.symbolic_trace(_experts)
    with FakeTensorMode():
        ValueRecorder(gm).run(torch.ones(5, 4), torch.zeros(5, 2, dtype=torch.long), torch.ones(5, 2),
                          torch.ones(3, 16, 4), torch.ones(3, 4, 8))
    return gm, {n.name: n for n in gm.graph.nodes}


def test_moe_experts_is_per_position_over_its_routing():
    gm, n = _experts_graph()
    an = DimAnalysis(gm.graph)
    assert _as(an, n["moe_experts_default"], n["hidden"]) == [0, 1]
    assert _as(an, n["index"], n["hidden"]) == _as(an, n["weights"], n["hidden"]) == [0, None]
    assert not an.mixes and not an.unknown


def test_a_lookalike_of_a_project_operator_has_no_rule():
    def lookalike(*args: Any) -> None:
        raise AssertionError("never run")

    lookalike.__name__ = "moe_experts.default"  # the name, but not in the `longstraw` namespace
    gm, n = _experts_graph()
    n["moe_experts_default"].target = lookalike
    an = DimAnalysis(gm.graph)
    assert an.unknown == {n["moe_experts_default"]}


def test_only_operators_with_a_rule_have_one():
    assert all(rule_for(name) is not None for name in ("exp", "add", "where", "view", "getitem", "linear", "sum"))
    assert rule_for("flip") is None and rule_for("nonzero") is None


def test_norm_with_a_positional_p_reduces_the_dimension_it_names():
    an, n = _analysed(lambda x: x.norm(2, dim=-1, keepdim=True), torch.ones(2, 3))
    assert _as(an, n["norm"], n["x"]) == [0, None]
    assert _mixed(an, n["x"]) == {"norm": [1]}
