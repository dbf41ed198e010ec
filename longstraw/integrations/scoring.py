"""The scorer the integrations compile: per-token log-probs and entropies of
the completions in a padded `[prompt; completion]` batch."""

from __future__ import annotations

import torch

from longstraw.runtime.kernels.logprobs import logprobs_and_entropy


def completion_logps_and_entropies(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    temperature: float | torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What TRL's fused LM head returns, from the model's own logits: the
    log-prob of each completion token and the entropy of its distribution,
    both at temperature `temperature` (one, or one per row `[B]`, as verl
    samples) and zero on padding, in float32 as TRL computes them, by one
    operator over the logits
    (`longstraw::logprobs_and_entropy`: a fused kernel on CUDA). The HF forward
    applies the model's logit scaling and soft-capping itself. `position_ids`
    (optional, `[B, P + R]`): the positions the model sees, as in a packed
    row where each sequence starts at 0 whatever padding precedes it."""
    # input_ids, attention_mask: [B, P + R]; R = logits_to_keep
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   logits_to_keep=logits_to_keep + 1).logits
    logits = logits[:, :-1]  # [B, R, V]: position t predicts token t + 1
    if isinstance(temperature, torch.Tensor):
        logits = logits.float() / temperature.float().view(-1, 1, 1)  # one temperature per row
        temperature = 1.0
    completion_ids = input_ids[:, -logits_to_keep:]  # [B, R]
    real = attention_mask[:, -logits_to_keep:] != 0  # [B, R]
    return logprobs_and_entropy(logits, completion_ids, real, float(temperature))
