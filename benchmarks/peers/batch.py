"""One TRL micro-batch: several prompts, each with G completions, in TRL's layout."""

from __future__ import annotations

from collections.abc import Sequence

import torch

PAD_ID, EOS_ID = 0, 1


def trl_micro_batch(n_prompts: int, G: int, P: int, R: int, vocab: int, device: torch.device,
                    lengths: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """What `GRPOTrainer._prepare_inputs` hands `compute_loss`: prompts
    left-padded to the longest (prompt b has `lengths[b]` tokens, by default
    P - b * P // 8), each repeated for its G completions in consecutive rows
    (TRL's RepeatSampler), completions right-padded to R (lengths from R/2
    to R, one full per prompt), advantages, and no old log-probs (one step
    per generation: TRL's ratio is then exp(logp - logp.detach()))."""
    gen = torch.Generator().manual_seed(P * 1000 + n_prompts * G + sum(lengths or ()))
    lengths = [P - b * (P // 8) for b in range(n_prompts)] if lengths is None else list(lengths)
    P = max(lengths)
    prompt_ids = torch.full((n_prompts, P), PAD_ID, dtype=torch.long)  # [n, P]
    prompt_mask = torch.zeros(n_prompts, P, dtype=torch.long)  # [n, P]
    for b, length in enumerate(lengths):
        prompt_ids[b, P - length :] = torch.randint(2, vocab, (length,), generator=gen)
        prompt_mask[b, P - length :] = 1
    rows = n_prompts * G
    completion_lengths = torch.randint(R // 2, R + 1, (rows,), generator=gen)  # [B]
    completion_lengths[::G] = R
    completion_mask = (torch.arange(R)[None] < completion_lengths[:, None]).long()  # [B, R]
    completion_ids = torch.randint(2, vocab, (rows, R), generator=gen).masked_fill(completion_mask == 0, PAD_ID)
    batch = {
        "prompt_ids": prompt_ids.repeat_interleave(G, 0),  # [B, P]
        "prompt_mask": prompt_mask.repeat_interleave(G, 0),  # [B, P]
        "completion_ids": completion_ids,  # [B, R]
        "completion_mask": completion_mask,  # [B, R]
        "advantages": torch.randn(rows, generator=gen),  # [B]
        "num_items_in_batch": completion_mask.sum(),
    }
    return {key: value.to(device) for key, value in batch.items()}
