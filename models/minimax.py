"""MiniMax's lightning attention (transformers `minimax`): its linear
attention routed to `longstraw::ssd_scan`.

HF's `MiniMaxLightningAttention.forward` computes, per head h with decay
`lambda_h = exp(-slope_rate[h])`, the state `S_t = lambda_h S_{t-1} + k_t v_t^T`
and the output `q_t S_t`, as a Python loop over blocks of `block_size`
positions (products within a block, a carried `K^T V` between blocks), which
no pass can claim op by op. That recurrence is Mamba-2's state-space scan
with `x = v`, `B = k`, `C = q` and a log-decay of `-slope_rate[h]` at every
position, so the drop-in runs the same `longstraw::ssd_scan` as Mamba-2
(`SSDPass`: the carry is the `[heads, head_dim, head_dim]` state, in float32
for bf16 models). It computes in float32 where HF computes in the model's
dtype; in float64 the two agree to rounding.

Dynamo does not look a module's `forward` up through
`substitute_in_graph`, so, as for Llama 4 (`longstraw.models.llama4`), the
class's `forward` becomes one that picks the drop-in while Dynamo traces a
call that starts from a zero state (writing the final state into HF's cache
where there is one, as HF does); eager calls and calls that continue from a
cached state run HF's.
"""

from __future__ import annotations

import types

import torch

from longstraw.passes.ssd import ssd_scan
from longstraw.runtime.kernels.ssd import scan_dtype

from . import substitute_forward


def lightning_attention_forward(
    self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`MiniMaxLightningAttention.forward` from a zero state: the layer's output
    and the final state as HF returns and caches it, `K^T V`
    (`[batch, heads, head_dim (k), head_dim (v)]`, the model's dtype)."""
    batch, length, _ = hidden_states.shape
    heads, dim = self.num_attention_heads, self.head_dim
    qkv = self.act_fn(self.qkv_proj(hidden_states))
    if attention_mask is not None:  # HF's `apply_mask_to_padding_states`: padding's q, k and v are zero
        qkv = (qkv * attention_mask[:, :, None]).to(qkv.dtype)
    query, key, value = torch.split(qkv.reshape(batch, length, heads, 3 * dim), dim, dim=3)
    compute = scan_dtype(value)
    log_decay = -self.slope_rate.reshape(1, 1, heads).to(compute).expand(batch, length, heads)
    out, state = ssd_scan(value.to(compute), log_decay, key.to(compute), query.to(compute), None)
    out = self.norm(out.to(value.dtype).reshape(batch, length, heads * dim))
    out = torch.sigmoid(self.output_gate(hidden_states)) * out
    return self.out_proj(out), state.transpose(-1, -2).to(value.dtype)


def substitute_in_traces(module: types.ModuleType) -> None:
    """Make Dynamo trace the drop-in wherever a `MiniMaxLightningAttention`
    starts from a zero state (no cache, or a cache without this layer's state)."""

    def traced(hf_forward):
        def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                    **kwargs):
            cached = None if past_key_values is None else past_key_values.get_linear_cache(self.layer_idx)
            if not torch.compiler.is_compiling() or cached is not None:
                return hf_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
            out, state = lightning_attention_forward(self, hidden_states, attention_mask)
            if past_key_values is not None:
                past_key_values.set_linear_cache(self.layer_idx, state)
            return out, state
        return forward

    substitute_forward(module, "MiniMaxLightningAttention", traced)


__all__ = ["lightning_attention_forward", "substitute_in_traces"]
