"""The state LongStraw plans for a model at its full size: `explain` on the meta device, nothing allocated."""

from __future__ import annotations

import torch

import longstraw

from helpers.losses import grpo_loss_f64


def explain_on_meta(model: torch.nn.Module, prompt_len: int = 256, chunk: int = 100) -> longstraw.ExplainReport:
    """`explain` of the GRPO loss for a bf16 `model` built on the meta device:
    a prompt of `prompt_len` positions, two completions of 8, chunks of `chunk`."""
    model.config.use_cache = False
    prompt = torch.zeros(prompt_len, dtype=torch.long, device="meta")
    responses = torch.zeros(2, 8, dtype=torch.long, device="meta")
    weights = torch.zeros(2, dtype=torch.bfloat16, device="meta")
    return longstraw.explain(grpo_loss_f64, model, prompt, responses, weights, weights[:, None].expand(2, 8),
                             options={"prefix_chunk_size": chunk})


def explain_published(model_class: type, config, prompt_len: int = 256, chunk: int = 100, *,
                      experts: str | None = None, eval_mode: bool = False) -> longstraw.ExplainReport:
    """`explain_on_meta` of `model_class(config)` built on the meta device in
    bf16, with HF's `experts` implementation for its MoE layers where given,
    in eval mode if `eval_mode` (a model that writes its weights in train mode)."""
    with torch.device("meta"):
        model = model_class(config).to(torch.bfloat16)
    model.train(not eval_mode)
    if experts is not None:
        model.set_experts_implementation(experts)
    return explain_on_meta(model, prompt_len, chunk)
