"""The extension point (`passes/base.py`): what `ArchitecturePass` requires and
defaults, and what `CarryPass` derives from a subclass's operator, state and
kernel (claims, dimensions, the carried state, the emitted step, run chunk by
chunk from its carry); `each_row_as_one_step` runs a step of several rows
one row at a time."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import pytest
import torch
import torch.fx as fx

from longstraw.analysis.dims import DimAnalysis
from longstraw.passes.base import ArchitecturePass, Candidate, CarryPass, SiteState, each_row_as_one_step
from longstraw.runtime.carry import CarryKernel


@torch.library.custom_op("lstest::running_sum", mutates_args=())
def running_sum(x: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, L, C] -> (scale * the sum of positions up to t [B, L, C], the total [B, C])."""
    return scale * x.cumsum(1), x.sum(1)


class RunningSumPass(CarryPass):
    """A carried operator that returns its final state: the running total `[1, C]` is the carry."""

    name = "running_sum"
    op = torch.ops.lstest.running_sum.default
    sequence = (0, 1)
    returns_state = True

    def step_inputs(self, node: fx.Node):
        return node.args[:1], {"scale": node.args[1]}

    def kernel(self, inputs, *, scale: float) -> CarryKernel:
        return CarryKernel(
            forward=lambda total, x: (scale * (total[:, None] + x.cumsum(1)), total + x.sum(1)),
            token_dims=(1, 1),
        )


class RunningSumOutputPass(RunningSumPass):
    """The same operator as one that returns its output alone, its carry declared by hand."""

    name = "running_sum_output"
    returns_state = False

    def carry(self, node: fx.Node) -> tuple[tuple[int, ...], torch.dtype]:
        return (1, node.args[0].meta["longstraw_value"].shape[2]), torch.float64


def running_sum_graph(x: torch.Tensor, scale: float = 2.0) -> tuple[fx.Graph, fx.Node, fx.Node]:
    """`running_sum(x, scale)` as one node, with the values the backend records."""
    graph = fx.Graph()
    placeholder = graph.placeholder("x")
    node = graph.call_function(torch.ops.lstest.running_sum.default, (placeholder, scale))
    graph.output(node)
    placeholder.meta["longstraw_value"] = x
    node.meta["longstraw_value"] = running_sum(x, scale)
    return graph, placeholder, node


class Emitter:
    """A `StepEmitter` over a fresh graph: each original placeholder becomes a step placeholder of its name."""

    def __init__(self, originals: list[fx.Node]) -> None:
        self.graph = fx.Graph()
        self.ctx = self.graph.placeholder("ctx")
        self.nodes = {node: self.graph.placeholder(node.name) for node in originals}
        self.carried: dict[int, fx.Node] = {}

    def mapped(self, a: Any) -> Any:
        return fx.node.map_arg(a, self.nodes.__getitem__)

    def query_key_block(self, node: fx.Node) -> fx.Node:
        raise AssertionError("a carried operator reads no mask")

    def carry_output(self, slot: int, node: fx.Node) -> None:
        self.carried[slot] = node


class OneRowStep:
    """What `CarryStep.forward` reads of a `StepContext` outside a prompt round."""

    prompt_round = None
    rows = 1

    def __init__(self, carry: torch.Tensor) -> None:
        self.carry = carry

    def carry_in(self, slot: int) -> torch.Tensor:
        return self.carry

    def carry_out(self, slot: int, value: torch.Tensor) -> None:
        self.carry = value


def test_the_required_hooks_raise_and_the_optional_ones_default():
    """Required: `claims`, `position_dims`, `state_inputs`, `emit_step`; the
    rest default to nothing claimed as unsupported, no carries, no
    positional or per-position inputs, the built-in dimension rules, and the
    claimed input itself as the one candidate."""
    graph, x, node = running_sum_graph(torch.ones(1, 3, 2))
    base = ArchitecturePass()
    for hook in (base.claims, base.position_dims, base.state_inputs):
        with pytest.raises(NotImplementedError):
            hook(node)
    with pytest.raises(NotImplementedError):
        base.emit_step(Emitter([x]), node, [])
    assert base.unsupported_reason(node) is None
    assert base.carries(node) == [] and base.positional_inputs(node) == [] and base.per_position_inputs(node) == []
    assert base.dim_rule(DimAnalysis(graph).rules, node) is None
    assert base.candidates(node, x) == [Candidate(x, None)]
    assert (base.name, base.overrides) == ("pass", ())
    assert not (base.runs_rounds or base.branch_graphs_kept or base.branches_batched)


def test_a_carry_pass_claims_its_operator_alone():
    graph, x, node = running_sum_graph(torch.ones(1, 3, 2))
    other = graph.call_function(torch.cumsum, (x, 1))
    method = graph.call_method("running_sum", (x, 2.0))
    carry_pass = RunningSumPass()
    assert carry_pass.claims(node)
    assert not any(carry_pass.claims(n) for n in (x, other, method))


def test_a_carry_pass_reads_positions_and_rows_from_its_sequence_argument():
    _, x, node = running_sum_graph(torch.ones(3, 5, 2))
    assert RunningSumPass().position_dims(node) == ((x, 1), (x, 0))
    assert RunningSumPass().state_inputs(node) == []


def test_the_carry_of_an_operator_that_returns_its_state_is_that_state_with_batch_one():
    _, _, node = running_sum_graph(torch.ones(3, 5, 2, dtype=torch.float32))
    assert RunningSumPass().carries(node) == [((1, 2), torch.float32)]


def test_an_operator_that_does_not_return_its_state_must_name_its_carry():
    _, _, node = running_sum_graph(torch.ones(3, 5, 2))

    class Unnamed(RunningSumPass):
        returns_state = False

    with pytest.raises(NotImplementedError):
        Unnamed().carries(node)
    assert RunningSumOutputPass().carries(node) == [((1, 2), torch.float64)]


def test_the_default_dim_rule_keeps_the_sequence_arguments_dimensions_and_mixes_its_positions():
    graph, x, node = running_sum_graph(torch.ones(3, 5, 2))
    carry_pass = RunningSumPass()
    analysis = DimAnalysis(graph, lambda rules, n: carry_pass.dim_rule(rules, n) if carry_pass.claims(n) else None)
    assert analysis.dims_of(node) == analysis.dims_of(x)
    assert analysis.mixes[node] == [analysis.dims_of(x)[1]]
    assert not analysis.unknown


@pytest.mark.parametrize("carry_pass", [RunningSumPass(), RunningSumOutputPass()], ids=lambda p: p.name)
def test_the_emitted_step_calls_the_kernel_with_the_slot_inputs_and_constants(carry_pass):
    """One call `running_sum_step(ctx, slot, x, scale=...)`; the carry leaves
    as its second output; the node stands for the step's whole result
    (`returns_state`) or its first output."""
    _, x, node = running_sum_graph(torch.ones(1, 4, 2), scale=3.0)
    emitter = Emitter([x])
    result = carry_pass.emit_step(emitter, node, [SiteState(x, 7, None)])
    (step,) = [n for n in emitter.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    assert step.target.__name__ == f"{carry_pass.name}_step"
    assert step.args == (emitter.ctx, 7, emitter.nodes[x]) and step.kwargs == {"scale": 3.0}
    carried = emitter.carried[7]
    assert (carried.target, carried.args) == (operator.getitem, (step, 1))
    if carry_pass.returns_state:
        assert result is step
    else:
        assert (result.target, result.args) == (operator.getitem, (step, 0))


@pytest.mark.parametrize("carry_pass", [RunningSumPass(), RunningSumOutputPass()], ids=lambda p: p.name)
def test_the_emitted_step_run_chunk_by_chunk_is_the_operator_over_all_positions(carry_pass):
    """Steps over positions [0, 3) and [3, 7), the second from the carry the
    first left, give the operator's output over all seven and its total."""
    x = torch.randn(1, 7, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    _, placeholder, node = running_sum_graph(x, scale=0.5)
    emitter = Emitter([placeholder])
    result = carry_pass.emit_step(emitter, node, [SiteState(placeholder, 0, None)])
    emitter.graph.output(result)
    step = fx.GraphModule(torch.nn.Module(), emitter.graph)
    ctx = OneRowStep(torch.zeros(1, 2, dtype=torch.float64))
    outputs = [step(ctx, part) for part in (x[:, :3], x[:, 3:])]
    if carry_pass.returns_state:
        assert torch.equal(outputs[1][1], ctx.carry)
        outputs = [out for out, _ in outputs]
    torch.testing.assert_close(torch.cat(outputs, 1), 0.5 * x.cumsum(1), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(ctx.carry, x.sum(1), rtol=1e-14, atol=1e-14)


def test_carry_passes_run_rounds_and_batch_branch_rows():
    carry_pass = RunningSumPass()
    assert carry_pass.runs_rounds and carry_pass.branch_graphs_kept and carry_pass.branches_batched


@dataclasses.dataclass(frozen=True)
class Rows:
    rows: int


def test_each_row_as_one_step_narrows_the_rows_shares_the_weights_and_concatenates():
    """Rows along dim 0 of x and dim 1 of y, a weight shared: each one-row
    step sees a context of one row and its own row of each input."""
    gen = torch.Generator().manual_seed(0)
    x, weight, y = torch.randn(3, 4, generator=gen), torch.randn(4, generator=gen), torch.randn(4, 3, generator=gen)
    seen = []

    def step(ctx, x, weight, y, *, shift):
        seen.append((ctx.rows, x.shape, weight.shape, y.shape))
        return x * weight + y.T + shift

    out = each_row_as_one_step(Rows(3), step, (x, weight, y), (0, None, 1), shift=1.0)
    torch.testing.assert_close(out, x * weight + y.T + 1.0, rtol=0, atol=0)
    assert seen == [(1, (1, 4), (4,), (4, 1))] * 3
