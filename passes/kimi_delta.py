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

from longstraw.runtime.carry import CarryKernel
from longstraw.runtime.kernels.kimi_delta import kimi_delta_flops, kimi_delta_rule_reference

from .gated_delta import GatedDeltaPass, register_delta_rule


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


register_delta_rule(kimi_delta_rule, kimi_delta_rule_reference)


class KimiDeltaPass(GatedDeltaPass):
    """The recurrent matrix `[H, Dk, Dv]` is the carry. Its operator takes
    the gated delta rule's arguments (only `g` has one more dimension, which
    the dimension rule leaves free), so the rule, the refusal and the step's
    inputs are `GatedDeltaPass`'s; the kernel is the PyTorch one alone."""

    name = "kimi_delta"
    op = torch.ops.longstraw.kimi_delta_rule.default

    def kernel(self, inputs, *, use_qk_l2norm: bool) -> CarryKernel:
        return CarryKernel(
            forward=lambda state, *x: kimi_delta_rule_reference(*x, state, use_qk_l2norm),
            token_dims=(1, 1, 1, 1, 1, 1),
            graph_key=("kimi_delta", use_qk_l2norm),
            flops=kimi_delta_flops,
        )
