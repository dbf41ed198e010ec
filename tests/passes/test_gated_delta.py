"""Gated DeltaNet as one operator (`passes/gated_delta.py`): the registered
operator's fake and gradients are the delta rule's, position by position,
and its backward keeps its own copy of the initial state; `GatedDeltaPass`
claims it, carries the recurrent matrix, ties the inputs' batch and
position axes, refuses a loss that passes its own initial state, and runs
the rule chunk by chunk from the carry. The chunked kernel against HF's is
`tests/models/test_qwen3_5.py`'s."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from longstraw.analysis.dims import DimAnalysis
from longstraw.passes.gated_delta import FLA_SPAN, GatedDeltaPass, gated_delta_rule
from longstraw.trace.specialize import specialize

from helpers.delta_rule import delta_rule_recurrence

OP = torch.ops.longstraw.gated_delta_rule.default
NAMES = ("q", "k", "v", "g", "beta")


def rule_inputs(length: int = 6, batch: int = 1, heads_k: int = 1, heads_v: int = 2, dim_k: int = 3, dim_v: int = 2,
                dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    """q, k [B, L, Hk, Dk], v [B, L, Hv, Dv], g (log decay, at most 0), beta [B, L, Hv]."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(batch, length, heads_k, dim_k, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(batch, length, heads_v, dim_v, generator=gen, dtype=torch.float64)
    g = -torch.rand(batch, length, heads_v, generator=gen, dtype=torch.float64)
    beta = torch.rand(batch, length, heads_v, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, g, beta)]


def rule_node(inputs: list[torch.Tensor], initial_state: torch.Tensor | None = None,
              use_qk_l2norm: bool = True) -> tuple[fx.Graph, list[fx.Node], fx.Node]:
    """`longstraw::gated_delta_rule` as one graph node, with the values the backend records."""
    graph = fx.Graph()
    args = [graph.placeholder(name) for name in NAMES]
    for node, value in zip(args, inputs):
        node.meta["longstraw_value"] = value
    state_arg = None
    if initial_state is not None:
        state_arg = graph.placeholder("initial_state")
        state_arg.meta["longstraw_value"] = initial_state
    node = graph.call_function(OP, (*args, state_arg, use_qk_l2norm))
    node.meta["longstraw_value"] = gated_delta_rule(*inputs, initial_state, use_qk_l2norm)
    return graph, args, node


@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_the_operators_gradients_are_the_recurrences(use_qk_l2norm):
    """Every input's gradient, the initial state's included, through both
    outputs, against autograd through the recurrence in float64."""
    leaves = [t.requires_grad_() for t in rule_inputs()]
    initial = torch.randn(1, 2, 3, 2, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(1, 6, 2, 2, dtype=torch.float64)
    out, state = gated_delta_rule(*leaves, initial, use_qk_l2norm)
    want_out, want_state = delta_rule_recurrence(*leaves, initial, use_qk_l2norm)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, want_state, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad((out * weights).sum() + state.square().sum(), [*leaves, initial])
    want = torch.autograd.grad((want_out * weights).sum() + want_state.square().sum(), [*leaves, initial])
    for name, g, w in zip([*NAMES, "initial state"], got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=lambda m: f"d{name}: {m}")


def test_the_operator_registration_is_consistent():
    """`torch.library.opcheck`: the fake's shapes and dtypes are the
    kernel's and the operator traces, with and without an initial state
    (inputs without gradients: AOT tracing the backward through the chunked
    kernel takes seconds; the gradients are the test above's)."""
    inputs = rule_inputs()
    for initial in (None, torch.randn(1, 2, 3, 2, dtype=torch.float64)):
        torch.library.opcheck(gated_delta_rule, (*inputs, initial, True))


def test_the_fake_state_of_a_16_bit_rule_is_float32_as_the_kernels():
    inputs = rule_inputs(dtype=torch.bfloat16)
    torch.library.opcheck(gated_delta_rule, (*inputs, None, True), test_utils="test_faketensor")
    out, state = gated_delta_rule(*inputs, None, True)
    assert (out.dtype, state.dtype) == (torch.bfloat16, torch.float32)


def test_the_backward_keeps_its_own_copy_of_the_initial_state():
    """HF's cache overwrites its state in place after the call: the
    gradients are those of the state the call saw."""
    leaves = [t.requires_grad_() for t in rule_inputs()]
    initial = torch.randn(1, 2, 3, 2, dtype=torch.float64)
    want = torch.autograd.grad(gated_delta_rule(*leaves, initial, True)[0].sum(), leaves)
    out, _ = gated_delta_rule(*leaves, initial, True)
    initial.zero_()
    got = torch.autograd.grad(out.sum(), leaves)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_the_pass_claims_the_operator_and_carries_the_recurrent_matrix():
    """The state `[Hv, Dk, Dv]` with batch 1, in the rule's working dtype
    (float32 for 16-bit inputs); positions and rows on q's axes 1 and 0."""
    _, args, node = rule_node(rule_inputs(batch=3, dtype=torch.bfloat16))
    gated = GatedDeltaPass()
    assert gated.name == "gated_delta" and gated.claims(node) and not gated.claims(args[0])
    assert gated.carries(node) == [((1, 2, 3, 2), torch.float32)]
    assert gated.position_dims(node) == ((args[0], 1), (args[0], 0))


def test_the_dim_rule_ties_batch_and_positions_and_mixes_the_positions():
    """Out: q's batch and positions, v's heads and values; the state: q's
    batch and axes of its own."""
    graph, args, node = rule_node(rule_inputs(batch=2, heads_k=2, heads_v=2, dim_k=3, dim_v=3))
    gated = GatedDeltaPass()
    analysis = DimAnalysis(graph, lambda rules, n: gated.dim_rule(rules, n) if gated.claims(n) else None)
    classes = [[analysis.classes(d) for d in analysis.dims_of(a)] for a in args]
    for other in classes[1:]:
        assert other[:2] == classes[0][:2]
    out, state = ([analysis.classes(d) for d in dims] for dims in analysis.dims[node])
    assert out == classes[0][:2] + classes[2][2:]
    assert state[0] == classes[0][0]
    inputs_classes = {c for dims in classes for c in dims}
    assert not set(state[1:]) & inputs_classes and len(set(state[1:])) == 3
    assert [analysis.classes(d) for d in analysis.mixes[node]] == [classes[0][1]]


@pytest.mark.parametrize("as_keyword", [False, True])
def test_a_loss_that_passes_its_own_initial_state_is_refused(as_keyword):
    inputs = rule_inputs()
    _, _, node = rule_node(inputs, torch.zeros(1, 2, 3, 2, dtype=torch.float64))
    if as_keyword:
        node.args, node.kwargs = node.args[:5], {"initial_state": node.args[5], "use_qk_l2norm": True}
    assert "passes its own initial recurrent state is not supported" in GatedDeltaPass().unsupported_reason(node)
    assert GatedDeltaPass().unsupported_reason(rule_node(inputs)[2]) is None


def test_the_step_passes_the_five_inputs_and_the_norm_flag_as_a_constant():
    _, args, node = rule_node(rule_inputs(), use_qk_l2norm=False)
    inputs, constants = GatedDeltaPass().step_inputs(node)
    assert list(inputs) == args and constants == {"use_qk_l2norm": False}


def test_a_keyword_norm_flag_reaches_the_step():
    """Dynamo records a keyword as the caller wrote it; specialisation makes
    it positional, where the pass reads it."""
    gm = fx.symbolic_trace(lambda q, k, v, g, beta: OP(q, k, v, g, beta, None, use_qk_l2norm=True))
    node = next(n for n in specialize(gm, rule_inputs()).gm.graph.nodes if n.target is OP)
    assert GatedDeltaPass().step_inputs(node)[1] == {"use_qk_l2norm": True}


@pytest.mark.parametrize("use_qk_l2norm", [True, False])
@pytest.mark.parametrize("cut", [1, 4])
def test_the_kernel_run_from_its_carry_is_the_rule_over_all_positions(cut, use_qk_l2norm):
    """Positions [0, cut) from a zero state, then the rest from the state
    the first left; on the CPU, the PyTorch kernel, differentiated by
    autograd, and graphed per norm flag."""
    inputs = rule_inputs()
    kernel = GatedDeltaPass().kernel(inputs, use_qk_l2norm=use_qk_l2norm)
    assert kernel.token_dims == (1,) * 6 and kernel.graph_key == ("gated_delta", use_qk_l2norm)
    assert kernel.grads is None and kernel.span == FLA_SPAN
    first, carry = kernel.forward(torch.zeros(1, 2, 3, 2, dtype=torch.float64), *(x[:, :cut] for x in inputs))
    rest, final = kernel.forward(carry, *(x[:, cut:] for x in inputs))
    want, want_state = delta_rule_recurrence(*inputs, torch.zeros(1, 2, 3, 2, dtype=torch.float64), use_qk_l2norm)
    torch.testing.assert_close(torch.cat([first, rest], 1), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, want_state, rtol=1e-12, atol=1e-12)
