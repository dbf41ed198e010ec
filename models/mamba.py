"""Mamba-1 mixers (transformers `mamba`, `falcon_mamba`, and `jamba`'s Mamba
layers): route the mixer's selective scan and convolution to LongStraw's
operators.

Each modeling module defines its own `mamba_selective_scan`, whose PyTorch
path is a loop over positions or an associative scan (a functorch
transform inside Dynamo), and `causal_conv1d_fn`, a causal depthwise
convolution. Importing longstraw has Dynamo trace the drop-ins below in
their place (`substitute_in_traces`, see `longstraw.models`): the
convolution becomes `longstraw::causal_conv1d` (as for Qwen3.5 and Mamba-2)
and the scan `longstraw::ssd_scan` (as for Mamba-2), with each channel and
state dimension a head of size 1: Mamba-1's decay `exp(A[d, n] dt[d])`
differs per state dimension, where Mamba-2's is one number per head. The
state carried is then `[d * n, 1, 1]` per row, Mamba-1's own `[d, n]`.
Eager calls are untouched.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from longstraw.passes.ssd import ssd_scan
from longstraw.runtime.kernels.ssd import scan_dtype

from . import substitute_functions
from .qwen3_5 import causal_conv1d_fn


def mamba_selective_scan(
    hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False,
    **kwargs,
):
    """Drop-in for transformers' Mamba-1 `mamba_selective_scan`: `hidden_states`,
    `dt`, `z` [b, d, L]; `A` [d, n]; `B`, `C` [b, n, L]. Computes in float32
    (float64 for a float64 model), as HF's PyTorch path does."""
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    batch, channels, length = hidden_states.shape
    states = A.shape[-1]
    compute = torch.promote_types(scan_dtype(hidden_states), dt.dtype)
    # HF rounds the inputs and B to float32 before its products, whatever the model's dtype
    x = hidden_states.float().to(compute).transpose(1, 2)  # [b, L, d]
    step = dt.to(compute).transpose(1, 2)  # [b, L, d]
    heads = channels * states  # head (c, s): channel c's state dimension s

    def per_head(t: torch.Tensor) -> torch.Tensor:  # [b, L, d] or [b, L, n] broadcast to [b, L, d * n, 1]
        return t.expand(batch, length, channels, states).reshape(batch, length, heads, 1)

    y, state = ssd_scan(
        per_head((x * step)[..., None]),
        (step[..., None] * A.to(compute)).reshape(batch, length, heads),
        per_head(B.float().to(compute).transpose(1, 2)[:, :, None, :]),
        per_head(C.to(compute).transpose(1, 2)[:, :, None, :]),
        None,
    )
    out = y.reshape(batch, length, channels, states).sum(-1).transpose(1, 2)  # [b, d, L]
    if D is not None:
        out = out + hidden_states * D[None, :, None]
    if z is not None:
        out = out * F.silu(z)
    return (out, state.reshape(batch, channels, states)) if return_last_state else out


def substitute_in_traces(module: types.ModuleType) -> None:
    """Make Dynamo trace the drop-ins wherever `module`'s mixer calls its functions."""
    substitute_functions(module, {"causal_conv1d_fn": causal_conv1d_fn, "mamba_selective_scan": mamba_selective_scan})
