"""gpt-oss and MiMo-V2-Flash (transformers `gpt_oss`, `mimo_v2_flash`):
route their eager attention with learned sinks to `longstraw::sink_attention`.

HF runs these models with eager attention only (`_supports_sdpa = False`:
SDPA has no sinks): a module-level `eager_attention_forward` computes the
scores with `matmul`, appends the sink logit of each head, takes the
softmax and drops the sink column. No pass could claim that op by op.
Importing longstraw has Dynamo trace the drop-in below in its place
(`substitute_in_traces`, see `longstraw.models`): one
`longstraw::sink_attention` node per layer, over HF's eager mask as HF
built it, which `passes.sinks` proves causal or a sliding window. Layers
without sinks (MiMo-V2-Flash's full attention) go through the same
operator with none. Eager calls are untouched.
"""

from __future__ import annotations

import types

from longstraw.passes.sinks import sink_attention

from . import substitute_functions


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Drop-in for HF's sink `eager_attention_forward`: (output
    `[B, L, Hq, Dv]`, no attention weights, as HF's SDPA path returns)."""
    sinks = getattr(module, "sinks", None)
    enable_gqa = query.shape[1] != key.shape[1]
    out = sink_attention(query, key, value, attention_mask, sinks, float(dropout), float(scaling), enable_gqa)
    return out.transpose(1, 2).contiguous(), None


def substitute_in_traces(module: types.ModuleType) -> None:
    """Make Dynamo trace the drop-in wherever `module`'s attention calls its eager attention."""
    substitute_functions(module, {"eager_attention_forward": eager_attention_forward})


__all__ = ["eager_attention_forward", "substitute_in_traces"]
