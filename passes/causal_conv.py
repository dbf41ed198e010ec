"""Causal depthwise convolution over positions (Qwen3.5's short conv) as one operator.

`longstraw::causal_conv1d(x, weight, bias, activation)`: x [B, C, L],
weight [C, K]; position t sees inputs t-K+1..t (zeros before the start),
then the activation. `CausalConvPass` runs it chunk by chunk: the state
carried between position ranges is the last K-1 inputs `[C, K-1]`.
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx
import torch.nn.functional as F

from longstraw.runtime.carry import CarryKernel, recompute_grads
from longstraw.runtime.kernels import fla_causal_conv

from .base import CarryPass

_ACTIVATIONS = {None: lambda x: x, "silu": F.silu, "swish": F.silu}


def causal_conv1d_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None, tail: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(activation(conv over [tail; x]), the last K-1 inputs of [tail; x])."""
    channels, width = weight.shape
    x_work = x.to(weight.dtype)
    if tail is None:
        tail = x_work.new_zeros(x.shape[0], channels, width - 1)
    full = torch.cat([tail.to(weight.dtype), x_work], dim=-1)  # [B, C, K-1+L]
    out = F.conv1d(full, weight.unsqueeze(1), bias, groups=channels)
    return _ACTIVATIONS[activation](out).to(x.dtype), full[..., full.shape[-1] - (width - 1):]


def causal_conv_flops(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> float:
    """The convolution's products over these positions, as PyTorch counts a
    depthwise `conv1d`: 2 K per channel and position (`CarryKernel.flops`:
    fla's kernel, not an operator, would count nothing)."""
    batch, channels, length = x.shape
    return float(2 * batch * channels * weight.shape[-1] * length)


@torch.library.custom_op("longstraw::causal_conv1d", mutates_args=())
def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None) -> torch.Tensor:
    return causal_conv1d_reference(x, weight, bias, activation, None)[0]


@causal_conv1d.register_fake
def _(x, weight, bias, activation):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.activation = inputs[3]
    ctx.save_for_backward(*inputs[:3])


def _backward(ctx, grad_out):
    grads = recompute_grads(
        lambda x, w, b: causal_conv1d_reference(x, w, b, ctx.activation, None)[:1],
        ctx.saved_tensors,
        [grad_out],
        ctx.needs_input_grad[:3],
    )
    return (*grads, None)


causal_conv1d.register_autograd(_backward, setup_context=_setup)


class CausalConvPass(CarryPass):
    """The last K-1 inputs `[C, K-1]` are the carry."""

    name = "causal_conv"
    op = torch.ops.longstraw.causal_conv1d.default
    sequence = (0, 2)

    def carry(self, node: fx.Node) -> tuple[tuple[int, ...], torch.dtype]:
        weight = node.args[1].meta["longstraw_value"]
        return (1, weight.shape[0], weight.shape[1] - 1), weight.dtype

    def step_inputs(self, node: fx.Node):
        return node.args[:3], {"activation": node.args[3]}

    def kernel(self, inputs, *, activation: str | None) -> CarryKernel:
        x, weight, bias = inputs
        fused = fla_causal_conv.applies(x, weight, bias, activation)
        return CarryKernel(
            forward=lambda tail, x, w, b: _step_kernel(tail, x, w, b, activation, fused),
            token_dims=(2, 2, None, None),
            graph_key=("causal_conv", activation),
            grads=functools.partial(fla_causal_conv.causal_conv_grads, activation=activation) if fused else None,
            span=FUSED_SPAN,
            flops=causal_conv_flops,
        )


def _step_kernel(tail, x, weight, bias, activation: str | None, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's fused forward where nothing is differentiated through the call
    and fla applies; the PyTorch kernel otherwise."""
    if fused and not torch.is_grad_enabled():
        return fla_causal_conv.causal_conv_forward(tail, x, weight, bias, activation)
    return causal_conv1d_reference(x, weight, bias, activation, tail)


FUSED_SPAN = 1 << 16
"""Positions per call of fla's backward in `CarryStep.backward` (the
reference's autograd recomputation goes `carry.RECOMPUTE_SPAN` at a time):
it holds the input's gradient and a float32 weight gradient per 64
positions, so a whole prompt chunk goes at once."""
