"""Mamba-2's state-space scan (SSD) as one operator.

`longstraw::ssd_scan(x, dA, B, C, initial_state)` runs the scan of
`longstraw.runtime.kernels.ssd` over a whole sequence from an initial state and
returns `(y, final_state)`. Model bindings (`longstraw.models.mamba2`)
route transformers' `mamba2_chunk_scan` to it, after the step `dt` is
folded into `x` and `A` and `B`, `C` are repeated to the heads as
transformers does, so Dynamo records one node per layer instead of the
chunked einsums and cumulative sums, and `SSDPass` runs it chunk by chunk:
the state carried between position ranges is `[heads, head_dim, state]`
in float32 (float64 for float64 inputs). Mamba-1's selective scan
(`longstraw.models.mamba`) runs as the same operator, each channel and
state dimension a head of size 1.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from longstraw.runtime.carry import CarryKernel, recompute_grads
from longstraw.runtime.kernels.ssd import scan_dtype, ssd_flops, ssd_scan_reference
from longstraw.nodes import arg

from .base import CarryPass, DimRules


@torch.library.custom_op("longstraw::ssd_scan", mutates_args=())
def ssd_scan(
    x: torch.Tensor, dA: torch.Tensor, B: torch.Tensor, C: torch.Tensor, initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return ssd_scan_reference(x, dA, B, C, initial_state)


@ssd_scan.register_fake
def _(x, dA, B, C, initial_state):
    batch, length, heads, dim = x.shape
    return x.new_empty(batch, length, heads, dim, dtype=scan_dtype(x)), \
        x.new_empty(batch, heads, dim, B.shape[-1], dtype=scan_dtype(x))


def _setup(ctx, inputs, output):
    initial_state = inputs[4]
    ctx.save_for_backward(*inputs[:4], None if initial_state is None else initial_state.clone())


def _backward(ctx, grad_y, grad_state):
    grads = recompute_grads(ssd_scan_reference, ctx.saved_tensors, [grad_y, grad_state], ctx.needs_input_grad[:5])
    return tuple(grads)


ssd_scan.register_autograd(_backward, setup_context=_setup)


class SSDPass(CarryPass):
    """The state `[heads, head_dim, state]` (float32, or float64) is the carry."""

    name = "ssd"
    op = torch.ops.longstraw.ssd_scan.default
    returns_state = True

    def dim_rule(self, dims: DimRules, node: fx.Node):
        x, dA, B, C = node.args[:4]
        dx = dims.of(x)
        for other in (dA, B, C):
            for a, b in zip(dx[:3], dims.of(other)[:3]):
                dims.same(a, b)
        dims.mixes(node, dx[1])
        state = node.meta["longstraw_value"][1]
        return [list(dx), [dx[0]] + dims.fresh(state.shape[1:])]

    def unsupported_reason(self, node: fx.Node) -> str | None:
        if arg(node, 4, "initial_state") is not None:
            return "a loss that passes its own initial state to the scan is not supported"
        return None

    def step_inputs(self, node: fx.Node):
        return node.args[:4], {}

    def kernel(self, inputs) -> CarryKernel:
        return CarryKernel(
            forward=lambda state, x, dA, B, C: ssd_scan_reference(x, dA, B, C, state),
            token_dims=(1, 1, 1, 1, 1),
            graph_key=("ssd",),
            flops=ssd_flops,
        )
