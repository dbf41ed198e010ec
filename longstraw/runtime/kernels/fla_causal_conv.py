"""Qwen3.5's short causal convolution through flash-linear-attention (fla).

The PyTorch kernel (`passes.causal_conv.causal_conv1d_reference`)
concatenates the carried tail in front of the input and runs PyTorch's
depthwise convolution, and its backward recomputes that under autograd
1,024 positions at a time: on an H200 at Qwen3.5-27B shapes the
convolution, its concatenations and its span-wise backward took about 3 s
of every 8 layers' exact step at 393K positions. fla does forward and
backward in one fused Triton kernel each, reading the strided input in place.

fla keeps a state of the last K inputs, `[B, C, K]`, and never reads the
first of them; the carry here is the last K-1, `[B, C, K-1]`, so fla's
state is the carry with a zero column in front. Inputs follow
`longstraw::causal_conv1d`: x `[B, C, L]`, weight `[C, K]`, bias `[C]` or None.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from longstraw.runtime.prompt_state import has_values
from longstraw.runtime.kernels.switch import KernelSwitch

ACTIVATIONS = (None, "silu", "swish")


@functools.cache
def fla_ops() -> SimpleNamespace | None:
    """fla's convolution entry points, or None when fla is not installed."""
    try:
        from fla.modules.causal_conv1d.ops import causal_conv1d_bwd, causal_conv1d_fwd
    except ImportError:
        return None
    return SimpleNamespace(fwd=causal_conv1d_fwd, bwd=causal_conv1d_bwd)


SWITCH = KernelSwitch("fla causal_conv")


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None) -> bool:
    """CUDA, 16-bit inputs and weights of one dtype, an activation fla has,
    and at least K positions (fla's final state of a shorter input mixes in
    the initial one, which the carry's gradient would have to undo). Tensors
    without values (meta, fake), which Triton cannot launch on, take it only
    in the planner's simulation of a CUDA target with fla
    (`SWITCH.simulating()`, with `FAKE_OPS`)."""
    on_device = x.is_cuda and fla_ops() is not None if has_values(x) else SWITCH.fakes
    return (
        SWITCH.on
        and on_device
        and x.dtype in (torch.float16, torch.bfloat16)
        and weight.dtype == x.dtype
        and (bias is None or bias.dtype == x.dtype)
        and activation in ACTIVATIONS
        and x.shape[-1] >= weight.shape[-1]
    )


def _ops(x: torch.Tensor) -> SimpleNamespace:
    """fla's entry points, or in the planner's simulation (no values) `FAKE_OPS`."""
    return fla_ops() if has_values(x) else FAKE_OPS


def causal_conv_forward(
    tail: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(activation(conv over [tail; x]), the last K-1 inputs), like the reference."""
    out, final = _ops(x).fwd(
        x=x.transpose(1, 2), weight=weight.contiguous(), bias=bias, residual=None,
        initial_state=F.pad(tail, (1, 0)), output_final_state=True, activation=activation,
    )
    return out.transpose(1, 2), final[..., 1:]


def causal_conv_grads(
    tail: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    grad_out: torch.Tensor | None,
    grad_tail: torch.Tensor | None,
    activation: str | None,
) -> tuple[torch.Tensor | None, ...]:
    """Gradients of `causal_conv_forward` for (tail, x, weight, bias)."""
    xt = x.transpose(1, 2)
    dy = torch.zeros_like(xt) if grad_out is None else grad_out.transpose(1, 2).to(x.dtype)
    dht = None if grad_tail is None else F.pad(grad_tail.to(x.dtype), (1, 0))
    dx, dw, db, _, dh0 = _ops(x).bwd(
        x=xt, dy=dy, dht=dht, weight=weight.contiguous(), bias=bias, residual=None,
        initial_state=F.pad(tail, (1, 0)), activation=activation,
    )
    return dh0[..., 1:], dx.transpose(1, 2), dw, db


# fla 0.6's entry points as the planner's simulation runs them: each allocates the outputs fla
# allocates (shapes, dtypes, order) and computes nothing. `FAKE_OPS` has `fla_ops()`'s names.


def _fake_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
              initial_state: torch.Tensor | None = None, output_final_state: bool = False,
              activation: str | None = None, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y [B, T, C] contiguous in x's dtype, the last K inputs [B, C, K] if asked for)."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    final = x.new_empty(x.shape[0], *weight.shape) if output_final_state else None
    return y, final


def _fake_bwd(x: torch.Tensor, dy: torch.Tensor, dht: torch.Tensor | None, weight: torch.Tensor,
              bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
              initial_state: torch.Tensor | None = None, activation: str | None = None, chunk_size: int = 64,
              **kwargs) -> tuple[torch.Tensor | None, ...]:
    """(dx like x, dweight, dbias, None, dh0 like the initial state): with
    an activation it recomputes the output before it, and it sums float32
    weight and bias gradients of every 64 positions."""
    batch, length = x.shape[:2]
    parts = batch * -(-length // chunk_size)
    y = None if activation is None else _fake_fwd(x, weight, bias, None, initial_state)[0]
    dx = torch.empty_like(x)
    dw = weight.new_empty(parts, *weight.shape, dtype=torch.float32)
    db = None if bias is None else bias.new_empty(parts, *bias.shape, dtype=torch.float32)
    dw = dw.sum(0).to(weight.dtype)
    db = None if db is None else db.sum(0).to(bias.dtype)
    dh0 = None if initial_state is None else torch.zeros_like(initial_state)  # its kernel reads y too
    del y
    return dx, dw, db, None, dh0


FAKE_OPS = SimpleNamespace(fwd=_fake_fwd, bwd=_fake_bwd)
