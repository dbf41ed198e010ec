"""Mamba-2 mixers (transformers `mamba2` and the hybrids built on its mixer:
`nemotron_h`, `granitemoehybrid` (Granite 4.0-H), `falcon_h1`, `bamba`,
`zamba2`): route the mixer's scan and convolution to LongStraw's operators.

Each of these modeling modules defines its own copies of two module-level
functions the mixer's PyTorch path calls: `causal_conv1d_fn`, a causal
depthwise convolution, and `mamba2_chunk_scan`, the state-space scan as
chunked einsums and cumulative sums over the sequence, which no pass could
claim op by op. Importing longstraw has Dynamo trace the drop-ins below in
their place (`substitute_in_traces`, see `longstraw.models`): the
convolution becomes `longstraw::causal_conv1d` (as for Qwen3.5) and the
scan `longstraw::ssd_scan`, after the same per-position preparation
transformers does (the step `dt` with its bias, softplus and limits folded
into the inputs, in float32; `B`, `C` repeated to the heads; the `D` skip
added after). Eager calls are untouched.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from longstraw.passes.ssd import ssd_scan

from . import substitute_functions
from .qwen3_5 import causal_conv1d_fn

def mamba2_chunk_scan(
    hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None, dt_softplus=False,
    dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs,
):
    """Drop-in for transformers' `mamba2_chunk_scan` (no packed sequences)."""
    if kwargs.get("seq_idx") is not None or kwargs.get("cu_seqlens") is not None:
        raise NotImplementedError("longstraw's ssd_scan does not support packed sequences (seq_idx, cu_seqlens)")
    heads, groups = hidden_states.shape[2], B.shape[2]  # hidden_states: [b, L, h, p]; B, C: [b, L, g, n]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])  # [b, L, h]
    x = hidden_states.float()
    B = B.float().repeat_interleave(heads // groups, dim=2, output_size=heads)
    C = C.float().repeat_interleave(heads // groups, dim=2, output_size=heads)
    y, final_state = ssd_scan(x * dt[..., None].float(), A.to(x.dtype) * dt.float(), B, C, initial_states)
    if D is not None:
        y = y + D[..., None] * x
    return (y, final_state) if return_final_states else y


def substitute_in_traces(module: types.ModuleType) -> None:
    """Make Dynamo trace the drop-ins wherever `module`'s mixer calls its functions."""
    substitute_functions(module, {"causal_conv1d_fn": causal_conv1d_fn, "mamba2_chunk_scan": mamba2_chunk_scan})
