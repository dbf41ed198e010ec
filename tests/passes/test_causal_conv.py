"""The causal depthwise convolution (`passes/causal_conv.py`): position t sees
inputs t-K+1..t (zeros, or the given tail, before the start), then the
activation; the registered operator's fake and gradients are the
convolution's; `CausalConvPass` claims the operator, carries its last K-1
inputs and runs it chunk by chunk. Qwen3.5's parity through it is
`tests/models/test_qwen3_5.py`'s."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from longstraw.passes.causal_conv import (FUSED_SPAN, CausalConvPass, causal_conv1d, causal_conv1d_reference,
                                          causal_conv_flops)
from longstraw.trace.specialize import specialize

OP = torch.ops.longstraw.causal_conv1d.default


def by_hand(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            tail: torch.Tensor | None) -> torch.Tensor:
    """out[b, c, t] = sum_j weight[c, j] * input[b, c, t - K + 1 + j] (+ bias[c]), earlier inputs from `tail`."""
    width = weight.shape[1]
    past = x.new_zeros(*x.shape[:2], width - 1) if tail is None else tail
    full = torch.cat([past, x], -1)
    out = torch.stack([(full[..., t : t + width] * weight).sum(-1) for t in range(x.shape[-1])], -1)
    return out if bias is None else out + bias[:, None]


def inputs(length: int = 7, channels: int = 3, width: int = 4, batch: int = 2) -> list[torch.Tensor]:
    """x [B, C, L], weight [C, K], bias [C], tail [B, C, K-1] in float64."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=gen, dtype=torch.float64)
            for shape in ((batch, channels, length), (channels, width), (channels,), (batch, channels, width - 1))]


def conv_node(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None) -> fx.Node:
    """`longstraw::causal_conv1d` as one graph node, with the values the backend records."""
    graph = fx.Graph()
    args = [graph.placeholder(name) for name in ("x", "weight", "bias")]
    for node, value in zip(args, (x, weight, bias)):
        node.meta["longstraw_value"] = value
    node = graph.call_function(OP, (*args, activation))
    node.meta["longstraw_value"] = causal_conv1d(x, weight, bias, activation)
    return node


def test_a_kernel_of_two_worked_by_hand():
    """weight [1, 10]: out[t] = x[t-1] + 10 x[t] (+ 1 with a bias of 1); the given tail is the input before
    the start, the returned one the last input."""
    x = torch.tensor([[[1.0, 2.0, 3.0]]], dtype=torch.float64)
    weight = torch.tensor([[1.0, 10.0]], dtype=torch.float64)
    out, tail = causal_conv1d_reference(x, weight, None, None, None)
    assert out.tolist() == [[[10.0, 21.0, 32.0]]] and tail.tolist() == [[[3.0]]]
    out, tail = causal_conv1d_reference(x, weight, x.new_tensor([1.0]), None, x.new_tensor([[[5.0]]]))
    assert out.tolist() == [[[16.0, 22.0, 33.0]]] and tail.tolist() == [[[3.0]]]


@pytest.mark.parametrize("activation", [None, "silu", "swish"])
@pytest.mark.parametrize("with_tail", [False, True])
def test_the_reference_is_the_convolution_over_the_tail_and_the_input(activation, with_tail):
    x, weight, bias, tail = inputs()
    tail = tail if with_tail else None
    out, new_tail = causal_conv1d_reference(x, weight, bias, activation, tail)
    want = by_hand(x, weight, bias, tail)
    torch.testing.assert_close(out, want if activation is None else F.silu(want), rtol=1e-14, atol=1e-14)
    assert torch.equal(new_tail, x[..., -3:])


def test_the_tail_of_an_input_shorter_than_the_kernel_keeps_the_earlier_tail():
    x, weight, bias, tail = inputs(length=2)
    _, new_tail = causal_conv1d_reference(x, weight, bias, None, tail)
    assert torch.equal(new_tail, torch.cat([tail[..., -1:], x], -1))


def test_position_t_sees_inputs_t_minus_k_plus_1_to_t():
    x, weight, bias, _ = inputs(length=9)
    before = causal_conv1d(x, weight, bias, "silu")
    x[..., 3] += 1.0
    changed = (causal_conv1d(x, weight, bias, "silu") != before).any(1).any(0)
    assert changed.tolist() == [t in range(3, 3 + 4) for t in range(9)]


def test_the_output_keeps_the_inputs_dtype_and_computes_in_the_weights():
    x, weight, bias, _ = inputs()
    out = causal_conv1d(x.float(), weight, bias, "silu")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.silu(by_hand(x.float().double(), weight, bias, None)).float(), rtol=0, atol=0)


def test_the_operator_registration_is_consistent():
    """`torch.library.opcheck`: the fake's shapes and dtypes, the autograd
    registration, tracing."""
    x, weight, bias, _ = (t.requires_grad_() for t in inputs())
    torch.library.opcheck(causal_conv1d, (x, weight, bias, "silu"))


@pytest.mark.parametrize("with_bias", [True, False])
def test_the_operators_gradients_are_the_convolutions(with_bias):
    """Every input's gradient against autograd through the convolution by hand."""
    x, weight, bias, _ = (t.requires_grad_() for t in inputs())
    bias = bias if with_bias else None
    leaves = [t for t in (x, weight, bias) if t is not None]
    grad_out = torch.randn_like(x)
    got = torch.autograd.grad(causal_conv1d(x, weight, bias, "silu"), leaves, grad_out)
    want = torch.autograd.grad(F.silu(by_hand(x, weight, bias, None)), leaves, grad_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_the_pass_claims_the_operator_over_its_last_axis():
    x, weight, bias, _ = inputs()
    node = conv_node(x, weight, bias, "silu")
    conv_pass = CausalConvPass()
    placeholder = node.args[0]
    assert conv_pass.name == "causal_conv" and conv_pass.claims(node) and not conv_pass.claims(placeholder)
    assert conv_pass.position_dims(node) == ((placeholder, 2), (placeholder, 0))


def test_the_carry_is_the_last_k_minus_1_inputs_per_channel_in_the_weights_dtype():
    x, weight, bias, _ = inputs(channels=5, width=4, batch=3)
    node = conv_node(x.float(), weight, bias, None)
    assert CausalConvPass().carries(node) == [((1, 5, 3), torch.float64)]


def test_the_step_passes_input_weight_and_bias_and_the_activation_as_a_constant():
    x, weight, _, _ = inputs()
    node = conv_node(x, weight, None, "silu")
    args, constants = CausalConvPass().step_inputs(node)
    assert tuple(args) == node.args[:3] and constants == {"activation": "silu"}


def test_a_keyword_activation_reaches_the_step():
    """Dynamo records a keyword as the caller wrote it; specialisation makes
    it positional, where the pass reads it."""
    x, weight, _, _ = inputs()
    gm = fx.symbolic_trace(lambda x, weight: OP(x, weight, None, activation="silu"))
    node = next(n for n in specialize(gm, [x, weight]).gm.graph.nodes if n.target is OP)
    assert CausalConvPass().step_inputs(node)[1] == {"activation": "silu"}


@pytest.mark.parametrize("cut", [1, 2, 5])
def test_the_kernel_run_from_its_carry_is_the_convolution_over_all_positions(cut):
    """Positions [0, cut) from a zero carry, then [cut, 7) from the carry
    the first left (cuts shorter than K-1 included); on the CPU, the
    PyTorch kernel, differentiated by autograd."""
    x, weight, bias, _ = inputs(batch=1)
    kernel = CausalConvPass().kernel((x, weight, bias), activation="silu")
    assert kernel.token_dims == (2, 2, None, None) and kernel.graph_key == ("causal_conv", "silu")
    assert kernel.grads is None and kernel.span == FUSED_SPAN
    first, carry = kernel.forward(x.new_zeros(1, 3, 3), x[..., :cut], weight, bias)
    rest, final = kernel.forward(carry, x[..., cut:], weight, bias)
    want = causal_conv1d(x, weight, bias, "silu")
    torch.testing.assert_close(torch.cat([first, rest], -1), want, rtol=1e-14, atol=1e-14)
    assert torch.equal(final, x[..., -3:])


def test_the_counted_arithmetic_is_what_pytorch_counts_for_the_reference():
    """`causal_conv_flops` is PyTorch's count of the reference's convolution
    over a span after a carried tail: what fla's kernel, which counts
    nothing, is counted as."""
    from torch.utils.flop_counter import FlopCounterMode

    x, weight, bias = torch.randn(2, 6, 11), torch.randn(6, 4), torch.randn(6)
    with FlopCounterMode(display=False) as counter:
        causal_conv1d_reference(x, weight, bias, "silu", torch.randn(2, 6, 3))
    assert causal_conv_flops(x, weight, bias) == counter.get_total_flops() > 0
