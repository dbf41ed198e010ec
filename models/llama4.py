"""Llama 4's mixture of experts (transformers `llama4_text`): the routed
experts with the token axis kept apart from the expert axis.

HF's `Llama4TextMoe.forward` runs every token through every expert, each
scaled by its router score (the sigmoid of the top-k logits, 0 elsewhere):
it repeats the flattened tokens once per expert (`repeat`), so one axis
holds expert and token together, which no per-position rule can prove
per position. The drop-in computes the same products in the same order on
an `[experts, tokens, hidden]` broadcast instead, so the token axis stays
its own dimension. Importing longstraw has Dynamo trace it in place of
HF's method (`substitute_in_traces`, see `longstraw.models`); eager calls
run HF's. Dynamo's `substitute_in_graph` does not reach a module's
`forward` (Dynamo inlines it without looking it up), so the class's
`forward` becomes one that picks the drop-in while Dynamo traces.
"""

from __future__ import annotations

import types

import torch

from . import substitute_forward


def llama4_moe_forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`Llama4TextMoe.forward`: returns the layer's output and the router logits, as HF's."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)  # [T, H]
    router_scores, router_logits = self.router(hidden_states)  # [T, E]
    experts = self.experts
    routed_in = hidden_states[None] * router_scores.transpose(0, 1)[..., None]  # [E, T, H]
    gate, up = torch.bmm(routed_in, experts.gate_up_proj).chunk(2, dim=-1)
    routed_out = torch.bmm(up * experts.act_fn(gate), experts.down_proj)  # [E, T, H]
    out = self.shared_expert(hidden_states)
    return out + routed_out.sum(dim=0), router_logits


def substitute_in_traces(module: types.ModuleType) -> None:
    """Make Dynamo trace the drop-in wherever a `Llama4TextMoe` runs."""

    def traced(hf_forward):
        def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if torch.compiler.is_compiling():
                return llama4_moe_forward(self, hidden_states)
            return hf_forward(self, hidden_states)
        return forward

    substitute_forward(module, "Llama4TextMoe", traced)


__all__ = ["llama4_moe_forward", "substitute_in_traces"]
