"""LFM2 and LFM2-MoE (transformers `lfm2`, `lfm2_moe`): route the short
convolution of their convolution layers to `longstraw::causal_conv1d`.

The layer calls a module-level `causal_conv1d_fn` (a causal depthwise
convolution over `[B, C, L]`, the same function Qwen3.5's Gated DeltaNet
calls), which Dynamo would trace as a padded `conv1d` sliced back to the
sequence, an operator no pass claims. Importing longstraw has Dynamo trace
the Qwen3.5 drop-in in its place (`substitute_in_traces`, see
`longstraw.models`); `CausalConvPass` then carries its last K-1 inputs.
Eager calls are untouched.
"""

from __future__ import annotations

import types

from . import substitute_functions
from .qwen3_5 import causal_conv1d_fn

def substitute_in_traces(module: types.ModuleType) -> None:
    """Make Dynamo trace the drop-in wherever `module`'s convolution layer calls `causal_conv1d_fn`."""
    substitute_functions(module, {"causal_conv1d_fn": causal_conv1d_fn})
