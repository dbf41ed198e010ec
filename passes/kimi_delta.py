"""Kimi Delta Attention (Kimi Linear's linear attention layers) as one operator.

`longstraw::kimi_delta_rule(q, k, v, g, beta, initial_state)` is the gated
delta rule with a decay per key channel (`g` [B, L, H, Dk] where Gated
DeltaNet's is [B, L, H]) over a whole sequence from an initial recurrent
state; it returns `(out, final_state)`. The binding
(`longstraw.models.kimi_linear`) routes transformers'
`chunk_kimi_delta_attention` to it, so Dynamo records one node per layer
instead of a loop unrolled over 64-token chunks, and `KimiDeltaPass` runs it
chunk by chunk: the state carried between position ranges is the recurrent
matrix `[H, Dk, Dv]`. The kernel is the chunked PyTorch rule
(`longstraw.runtime.kernels.kimi_delta`).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from longstraw.nodes import arg
from longstraw.runtime.carry import CarryKernel, recompute_grads
from longstraw.runtime.kernels.kimi_delta import kimi_delta_rule_reference

from .base import CarryPass, DimRules


@torch.library.custom_op("longstraw::kimi_delta_rule", mutates_args=())
def kimi_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, state = kimi_delta_rule_reference(q, k, v, g, beta, initial_state, use_qk_l2norm)
    return out, state


@kimi_delta_rule.register_fake
def _(q, k, v, g, beta, initial_state, use_qk_l2norm):
    batch, length, heads, dim_k = k.shape
    work = torch.promote_types(q.dtype, torch.float32)
    return q.new_empty(batch, length, heads, v.shape[-1]), q.new_empty(batch, heads, dim_k, v.shape[-1], dtype=work)


def _setup(ctx, inputs, output):
    ctx.use_qk_l2norm = inputs[-1]
    initial_state = inputs[5]
    # HF caches update their recurrent state in place after the call: keep our own copy
    ctx.save_for_backward(*inputs[:5], None if initial_state is None else initial_state.clone())


def _backward(ctx, grad_out, grad_state):
    grads = recompute_grads(
        lambda *x: kimi_delta_rule_reference(*x, ctx.use_qk_l2norm),
        ctx.saved_tensors,
        [grad_out, grad_state],
        ctx.needs_input_grad[:6],
    )
    return (*grads, None)


kimi_delta_rule.register_autograd(_backward, setup_context=_setup)


class KimiDeltaPass(CarryPass):
    """The recurrent matrix `[H, Dk, Dv]` is the carry."""

    name = "kimi_delta"
    op = torch.ops.longstraw.kimi_delta_rule.default
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
            forward=lambda state, *x: kimi_delta_rule_reference(*x, state, use_qk_l2norm),
            token_dims=(1, 1, 1, 1, 1, 1),
            graph_key=("kimi_delta", use_qk_l2norm),
        )
