"""Gated DeltaNet for the TRL peers on Hopper: fla's forward, a backward fla allows there.

HF's Qwen3.5 layers call fla's `chunk_gated_delta_rule` where fla is
installed, and fla refuses its own backward on Hopper GPUs with Triton 3.4
to 3.7.0 (one kernel, `chunk_bwd_dqkwg`, is miscompiled there), so TRL's
modes could not train the hybrid slice on an H100 or H200. LongStraw's steps
run fla's forward and its backward pipeline with that one kernel replaced
(`longstraw.runtime.kernels.fla_gated_delta`); `hopper_safe_gated_delta()`
gives HF's layers the same two, so the peers and LongStraw run the same
kernels. Elsewhere (the CPU, float32, packed sequences, a returned final
state) HF's own function runs.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator

import torch

from longstraw.runtime.kernels import fla_gated_delta

HF_MODULES = ("transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
"""The HF modeling modules of the benchmarks' hybrid slices; each calls `torch_chunk_gated_delta_rule` by that name."""


class _FlaGatedDelta(torch.autograd.Function):
    """fla's fused forward; in backward `fla_gated_delta.gated_delta_grads`
    (recomputing from the inputs what the backward reads)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, state, use_qk_l2norm: bool):
        out, _ = fla_gated_delta.gated_delta_forward(q, k, v, g, beta, state, use_qk_l2norm)
        ctx.use_qk_l2norm = use_qk_l2norm
        ctx.save_for_backward(q, k, v, g, beta, state)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, g, beta, state = ctx.saved_tensors
        _, dq, dk, dv, dg, dbeta = fla_gated_delta.gated_delta_grads(
            state, q, k, v, g, beta, grad_out, None, ctx.use_qk_l2norm)
        return dq, dk, dv, dg, dbeta, None, None


def drop_in(original: Callable) -> Callable:
    """HF's `torch_chunk_gated_delta_rule` signature: fla's forward and the
    Hopper-safe backward where they apply, `original` elsewhere."""

    def chunk_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        if (cu_seqlens is not None or output_final_state or initial_state is not None
                or not fla_gated_delta.applies(query)):
            return original(query, key, value, g=g, beta=beta, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            cu_seqlens=cu_seqlens, **kwargs)
        batch, _, heads, dim_v = value.shape
        state = torch.zeros(batch, heads, key.shape[-1], dim_v, dtype=torch.float32, device=query.device)
        return _FlaGatedDelta.apply(query, key, value, g, beta, state, use_qk_l2norm_in_kernel), None

    return chunk_gated_delta_rule


@contextlib.contextmanager
def hopper_safe_gated_delta() -> Iterator[None]:
    """HF's hybrid layers call `drop_in` inside the block."""
    saved = []
    for name in HF_MODULES:
        module = importlib.import_module(name)
        saved.append((module, module.torch_chunk_gated_delta_rule))
        module.torch_chunk_gated_delta_rule = drop_in(module.torch_chunk_gated_delta_rule)
    try:
        yield
    finally:
        for module, original in saved:
            module.torch_chunk_gated_delta_rule = original
