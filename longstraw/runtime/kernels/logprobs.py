"""Per-token log-probabilities and entropies from logits, as one operator.

The scorer the integrations compile (`integrations.scoring`) reads, at
every completion position, the log-prob of the sampled token and the
entropy of the distribution at temperature T. Written as PyTorch ops
(`float()`, `/ T`, `log_softmax`, `gather`, `exp * logp`, `sum`), that is
about a dozen float32 passes over the `[B, R, vocab]` logits forward and
as many backward: on the dense slice's H100 profile (2 prompts x G = 8,
R = 1024, vocabulary 151,936) about 100 ms of a 0.68 s step, where TRL's
own trainer and prefix-grouper run fused kernels.

`longstraw::logprobs_and_entropy` is that computation as one operator with
a per-position dimension rule (`dim_rules._logprobs_and_entropy`): the
logits' last axis is the only one it mixes. On CUDA, for 16-bit and
float32 logits where TRL's Triton kernel is installed
(`trl.kernels.selective_log_softmax_and_entropy`), one pass reads the
logits forward and two backward (the kernel's forward again, then its
backward); elsewhere (the CPU, float64) the same quantities in PyTorch,
a block of rows at a time, in float32 as TRL computes them. Masked
positions are zero with zero gradient, as `torch.where(mask, x, 0)` gives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from longstraw.runtime.carry import recompute_grads
from longstraw.runtime.prompt_state import has_values

_ROWS_PER_BLOCK_ELEMENTS = 1 << 26  # elements of one block of the PyTorch path's float32 temporaries (256 MB)
_COMPUTE_DTYPE = torch.float32  # whatever the logits' dtype, as TRL computes (its losses and metrics read float32)


@functools.cache
def _triton_kernel() -> Callable | None:
    """TRL's fused kernel, or None where it is not installed (no Triton, no TRL, an older TRL)."""
    try:
        from trl.kernels import selective_log_softmax_and_entropy
    except ImportError:
        return None
    return selective_log_softmax_and_entropy


def _fused(logits: torch.Tensor) -> Callable | None:
    """The fused kernel where it applies to `logits` (CUDA, 16- or 32-bit, values, TRL installed)."""
    if logits.device.type != "cuda" or logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    if not has_values(logits):
        return None
    return _triton_kernel()


def _blocks(logits: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) blocks of the flattened rows that bound the PyTorch path's temporaries."""
    rows, vocab = logits.numel() // max(logits.shape[-1], 1), logits.shape[-1]
    size = max(1, _ROWS_PER_BLOCK_ELEMENTS // max(vocab, 1))
    return [(s, min(size, rows - s)) for s in range(0, rows, size)]


def _softmax(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-normaliser, probabilities, expected logit) of rows of logits `z` (at temperature)."""
    log_z = torch.logsumexp(z, dim=-1)
    p = torch.exp(z - log_z[:, None])
    return log_z, p, (p * z).sum(-1)


@torch.library.custom_op("longstraw::logprobs_and_entropy", mutates_args=())
def logprobs_and_entropy(
    logits: torch.Tensor, index: torch.Tensor, mask: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V]; index and mask (bool) [...]: the log-prob of `index`
    and the entropy of `softmax(logits / temperature)` at each position,
    float32, zero where `mask` is False."""
    fused = _fused(logits)
    if fused is not None:
        logps, entropy = fused(logits, index, temperature, mask)
        return logps, entropy
    compute = _COMPUTE_DTYPE
    flat, flat_index = logits.reshape(-1, logits.shape[-1]), index.reshape(-1)
    logps = torch.zeros(flat_index.shape, dtype=compute, device=logits.device)
    entropy = torch.zeros_like(logps)
    for start, length in _blocks(logits):
        rows = slice(start, start + length)
        z = flat[rows].to(compute) / temperature
        log_z, _, expected = _softmax(z)
        logps[rows] = z.gather(-1, flat_index[rows, None]).squeeze(-1) - log_z
        entropy[rows] = log_z - expected
    zero = torch.zeros((), dtype=compute, device=logits.device)
    return torch.where(mask, logps.view(index.shape), zero), torch.where(mask, entropy.view(index.shape), zero)


@logprobs_and_entropy.register_fake
def _(logits, index, mask, temperature):
    return index.new_empty(index.shape, dtype=_COMPUTE_DTYPE), index.new_empty(index.shape, dtype=_COMPUTE_DTYPE)


@torch.library.custom_op("longstraw::logprobs_and_entropy_backward", mutates_args=())
def logprobs_and_entropy_backward(
    logits: torch.Tensor, index: torch.Tensor, mask: torch.Tensor, temperature: float,
    grad_logps: torch.Tensor, grad_entropy: torch.Tensor,
) -> torch.Tensor:
    """d(logits) [..., V] (logits' dtype) from the gradients of both outputs,
    in PyTorch; zero on masked rows."""
    compute = _COMPUTE_DTYPE
    flat, flat_index = logits.reshape(-1, logits.shape[-1]), index.reshape(-1)
    real = mask.reshape(-1)
    g_lp, g_ent = grad_logps.reshape(-1).to(compute), grad_entropy.reshape(-1).to(compute)
    grad = torch.empty(flat.shape, dtype=logits.dtype, device=logits.device)
    for start, length in _blocks(logits):
        rows = slice(start, start + length)
        z = flat[rows].to(compute) / temperature
        idx = flat_index[rows]
        _, p, expected = _softmax(z)
        # d logp / dz = onehot - p;  d entropy / dz = p * (E[z] - z);  dz / dlogits = 1 / T
        block = -g_lp[rows, None] * p + g_ent[rows, None] * p * (expected[:, None] - z)
        block.scatter_add_(-1, idx[:, None], g_lp[rows, None])
        block = torch.where(real[rows, None], block / temperature, torch.zeros((), dtype=compute, device=z.device))
        grad[rows].copy_(block)
    return grad.view(logits.shape)


@logprobs_and_entropy_backward.register_fake
def _(logits, index, mask, temperature, grad_logps, grad_entropy):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    logits, index, mask, temperature = inputs
    ctx.temperature = temperature
    ctx.save_for_backward(logits, index, mask)


def _backward(ctx, grad_logps, grad_entropy):
    """The fused kernel's forward again under autograd, then its backward
    (at the autograd level: an operator's implementation runs below it);
    elsewhere `logprobs_and_entropy_backward`."""
    logits, index, mask = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return None, None, None, None
    fused = _fused(logits)
    if fused is not None:
        (grad,) = recompute_grads(lambda leaf: fused(leaf, index, ctx.temperature, mask), [logits],
                                  [grad_logps, grad_entropy], [True])
        return grad, None, None, None
    zeros = None
    if grad_logps is None or grad_entropy is None:
        zeros = torch.zeros(index.shape, dtype=_COMPUTE_DTYPE, device=logits.device)
    grad = torch.ops.longstraw.logprobs_and_entropy_backward(
        logits, index, mask, ctx.temperature, zeros if grad_logps is None else grad_logps,
        zeros if grad_entropy is None else grad_entropy)
    return grad, None, None, None


logprobs_and_entropy.register_autograd(_backward, setup_context=_setup)
