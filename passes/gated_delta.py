"""Gated DeltaNet (Qwen3.5 / Qwen3.6 linear attention) as one operator.

`longstraw::gated_delta_rule(q, k, v, g, beta, initial_state)` computes the
gated delta rule over a whole sequence from an initial recurrent state and
returns `(out, final_state)`. Model bindings route their implementation to
it, so Dynamo records one node per layer instead of a loop unrolled over
64-token chunks, and `GatedDeltaPass` can run it chunk by chunk: the state
carried between position ranges is the recurrent matrix `[Hv, Dk, Dv]`.

The kernels are in `longstraw.runtime.kernels`: the chunked PyTorch rule
(`gated_delta`) and fla's (`fla_gated_delta`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.fx as fx

from longstraw.runtime.carry import CarryKernel, recompute_grads
from longstraw.runtime.kernels import fla_gated_delta
from longstraw.runtime.kernels.gated_delta import gated_delta_flops, gated_delta_rule_reference
from longstraw.nodes import arg

from .base import CarryPass, DimRules


@torch.library.custom_op("longstraw::gated_delta_rule", mutates_args=())
def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, state = gated_delta_rule_reference(q, k, v, g, beta, initial_state, use_qk_l2norm)
    return out, state


def _delta_rule_fake(q, k, v, g, beta, initial_state, use_qk_l2norm):
    batch, length, _, dim_k = k.shape
    heads_v, dim_v = v.shape[-2:]
    work = torch.promote_types(q.dtype, torch.float32)
    return q.new_empty(batch, length, heads_v, dim_v), q.new_empty(batch, heads_v, dim_k, dim_v, dtype=work)


def register_delta_rule(
    op: torch.library.CustomOpDef, reference: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """The fake and the autograd of a delta-rule operator `op(q, k, v, g,
    beta, initial_state, use_qk_l2norm) -> (out [B, T, Hv, Dv], state [B,
    Hv, Dk, Dv] in at least float32)` whose PyTorch kernel is `reference`:
    the backward recomputes `reference` under autograd."""

    def setup(ctx, inputs, output):
        ctx.use_qk_l2norm = inputs[-1]
        initial_state = inputs[5]
        # HF caches update their recurrent state in place after the call: keep our own copy
        ctx.save_for_backward(*inputs[:5], None if initial_state is None else initial_state.clone())

    def backward(ctx, grad_out, grad_state):
        grads = recompute_grads(
            lambda *x: reference(*x, ctx.use_qk_l2norm),
            ctx.saved_tensors,
            [grad_out, grad_state],
            ctx.needs_input_grad[:6],
        )
        return (*grads, None)

    op.register_fake(_delta_rule_fake)
    op.register_autograd(backward, setup_context=setup)


register_delta_rule(gated_delta_rule, gated_delta_rule_reference)


def _step_kernel(q, k, v, g, beta, initial_state, use_qk_l2norm):
    """fla's fused forward where nothing is differentiated through the call
    and fla applies; the PyTorch kernel otherwise."""
    fused = not torch.is_grad_enabled() and fla_gated_delta.applies(q)
    kernel = fla_gated_delta.gated_delta_forward if fused else gated_delta_rule_reference
    return kernel(q, k, v, g, beta, initial_state, use_qk_l2norm)


FLA_SPAN = 8192
"""Positions per call of fla's backward in `CarryStep.backward`: it holds
about 0.25 MB per position at Qwen3.5-27B shapes (the chunk states h and
dh, and float32 copies of both in `_dqkwg`), against 0.76 MB for autograd
through the PyTorch kernel."""


class GatedDeltaPass(CarryPass):
    """The recurrent matrix `[Hv, Dk, Dv]` is the carry.

    Where fla applies (CUDA, 16-bit inputs, fla installed) every forward
    without autograd takes its fused kernel (prompt capture, branch
    forwards, `CarryStep.forward` in replays and the reverse pass), and
    `CarryStep.backward` takes fla's backward pipeline
    (`fla_gated_delta.gated_delta_grads`), `FLA_SPAN` positions at a time.
    Eager HF with fla installed computes with the same kernels. Elsewhere
    the PyTorch kernel runs, and the backward recomputes it under autograd
    (replayed as CUDA graphs on a GPU: `carry.SpanGraphs`)."""

    name = "gated_delta"
    op = torch.ops.longstraw.gated_delta_rule.default
    returns_state = True

    def dim_rule(self, dims: DimRules, node: fx.Node):
        q, k, v, g, beta = node.args[:5]
        dq, dv = dims.of(q), dims.of(v)
        for other in (k, v, g, beta):
            for a, b in zip(dq[:2], dims.of(other)[:2]):
                dims.same(a, b)
        dims.mixes(node, dq[1])
        state = node.meta["longstraw_value"][1]
        return [dq[:2] + dv[2:], [dq[0]] + dims.fresh(state.shape[1:])]

    def unsupported_reason(self, node: fx.Node) -> str | None:
        if arg(node, 5, "initial_state") is not None:
            return "a loss that passes its own initial recurrent state is not supported"
        return None

    def step_inputs(self, node: fx.Node):
        return node.args[:5], {"use_qk_l2norm": bool(node.args[6])}

    def kernel(self, inputs, *, use_qk_l2norm: bool) -> CarryKernel:
        return CarryKernel(
            forward=lambda state, *x: _step_kernel(*x, state, use_qk_l2norm),
            token_dims=(1, 1, 1, 1, 1, 1),
            graph_key=("gated_delta", use_qk_l2norm),
            grads=functools.partial(fla_gated_delta.gated_delta_grads, use_qk_l2norm=use_qk_l2norm)
            if fla_gated_delta.applies(inputs[0]) else None,
            span=FLA_SPAN,
            flops=gated_delta_flops,
        )
