"""The autograd boundary of a compiled loss: one `torch.autograd.Function` whose forward
runs the capture and the branches and whose backward runs `GroupRunner.backward`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from longstraw.errors import LongStrawError

if TYPE_CHECKING:
    from longstraw.runtime.runner import GroupRunner


class GroupFunction(torch.autograd.Function):
    """Autograd boundary: inputs are all placeholders of the loss graph,
    outputs the stacked branch outputs."""

    @staticmethod
    def forward(ctx, runner: GroupRunner, backward: bool, *inputs):
        gate = runner.options.kernels.gate()  # the backward runs the forward's kernels
        with runner.options.kernels.active(gate):
            outputs, call = runner.forward(inputs, backward)
        ctx.runner, ctx.call, ctx.gate = runner, call, gate
        tensor_positions = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
        ctx.tensor_positions = tensor_positions
        ctx.others = [None if isinstance(x, torch.Tensor) else x for x in inputs]
        ctx.save_for_backward(*[inputs[i] for i in tensor_positions])
        ctx.mark_non_differentiable(*[o for o in outputs if not o.is_floating_point()])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        if torch.is_grad_enabled():
            raise LongStrawError(
                "backward with create_graph=True (a gradient of the gradient) is not supported: LongStraw's backward "
                "replays the branches and the prompt itself and its gradients are not differentiable"
            )
        if ctx.call is None:
            raise LongStrawError(
                "backward through a LongStraw loss a second time (retain_graph=True): the prompt state is freed by "
                "the first backward. Call the compiled loss again for another backward."
            )
        inputs = list(ctx.others)
        for i, t in zip(ctx.tensor_positions, ctx.saved_tensors):
            inputs[i] = t
        with ctx.runner.options.kernels.active(ctx.gate):
            grads = ctx.runner.backward(ctx.call, inputs, grad_outputs)
        ctx.call = None
        return (None, None, *grads)
