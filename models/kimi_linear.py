"""Kimi Linear (transformers `kimi_linear`): route its Kimi Delta Attention
layers' rule and convolution to LongStraw's operators.

The modeling module defines `chunk_kimi_delta_attention`, the gated delta
rule with a decay per key channel as a Python loop over 64-position chunks
(and a loop inside each chunk), which no pass could claim op by op, and
`causal_conv1d_fn`, the short causal convolution of q, k and v. Importing
longstraw has Dynamo trace the drop-ins below in their place
(`substitute_in_traces`, see `longstraw.models`): `longstraw::kimi_delta_rule`
(`passes/kimi_delta.py`) and `longstraw::causal_conv1d` (as for Qwen3.5).
Its full attention layers are MLA; eager calls are untouched.
"""

from __future__ import annotations

import types

from longstraw.passes.kimi_delta import kimi_delta_rule

from . import substitute_functions
from .qwen3_5 import causal_conv1d_fn


def chunk_kimi_delta_attention(
    query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, **kwargs,
):
    """Drop-in for transformers' `chunk_kimi_delta_attention` (no varlen `cu_seqlens`)."""
    if kwargs.get("cu_seqlens") is not None:
        raise NotImplementedError("longstraw's kimi_delta_rule does not support packed sequences (cu_seqlens)")
    out, state = kimi_delta_rule(query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel)
    return out, state if output_final_state else None


def substitute_in_traces(module: types.ModuleType) -> None:
    """Make Dynamo trace the drop-ins wherever `module`'s layers call its functions."""
    substitute_functions(module, {"causal_conv1d_fn": causal_conv1d_fn,
                                  "chunk_kimi_delta_attention": chunk_kimi_delta_attention})
