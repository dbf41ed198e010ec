"""Running an operator from a carried state, and differentiating it.

A carried state (a recurrent matrix, a convolution's last inputs) enters a
step from `StepContext.carry_in` and leaves through `carry_out`; it is not
an autograd input of the step, so `CarryStep` is: its backward recomputes
the operator with autograd, returns the gradients of the step's own inputs,
and adds the gradient of the incoming carry into d(state) (exact mode).
Forward saves only the step's inputs.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .state import StepContext

CarryFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def recompute_grads(
    fn: Callable[..., Sequence[torch.Tensor]],
    inputs: Sequence[torch.Tensor | None],
    grad_outputs: Sequence[torch.Tensor | None],
    wanted: Sequence[bool],
) -> list[torch.Tensor | None]:
    """Gradients of `fn(*inputs)` with respect to the inputs flagged in `wanted`."""
    with torch.enable_grad():
        leaves = [
            x.detach().requires_grad_(True) if w and x is not None else (None if x is None else x.detach())
            for x, w in zip(inputs, wanted)
        ]
        outputs = fn(*leaves)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None and o.requires_grad]
        targets = [x for x in leaves if x is not None and x.requires_grad]
        if not pairs or not targets:
            return [None] * len(inputs)
        grads = iter(torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs], allow_unused=True))
    return [next(grads) if x is not None and x.requires_grad else None for x in leaves]


class CarryStep(torch.autograd.Function):
    """`fn(carry, *inputs) -> (out, new_carry)` with the carry taken from and
    kept in the step's `StepContext`."""

    @staticmethod
    def forward(ctx, step: StepContext, slot: int, fn: CarryFn, *inputs):
        carry = step.carry_in(slot)
        out, new_carry = fn(carry, *inputs)
        step.carry_out(slot, new_carry)
        ctx.step, ctx.slot, ctx.fn = step, slot, fn
        ctx.save_for_backward(*inputs)
        return out, new_carry

    @staticmethod
    def backward(ctx, grad_out, grad_carry):
        step: StepContext = ctx.step
        inputs = ctx.saved_tensors
        carry = step.carry_in(ctx.slot)
        wanted = [step.state.carry_grads is not None and step.offset > 0] + list(ctx.needs_input_grad[3:])
        grads = recompute_grads(ctx.fn, [carry, *inputs], [grad_out, grad_carry], wanted)
        step.accumulate_carry_grad(ctx.slot, grads[0])
        return (None, None, None, *grads[1:])
