"""A trainer's batch of several prompts: rows `[prompt; completion]` for
each prompt's completions, shuffled, and its GRPO loss and detached reference."""

from __future__ import annotations

import torch

from helpers.losses import grpo_tail, logits_of
from helpers.reference import eager_loss_and_grads, prompt_state_detached


def batch_loss(model, ids, advantages, mask):
    """GRPO over a trainer's batch: rows `[prompt; completion]`, the last
    `R` positions of each row scored (as TRL's `logits_to_keep`)."""
    R = mask.shape[1]
    logits = logits_of(model(input_ids=ids))[:, -R - 1 : -1]
    return grpo_tail(logits, ids[:, -R:], advantages, mask)


def make_batch(sizes: list[int], P: int, R: int, vocab: int = 128, seed: int = 0):
    """Rows for `len(sizes)` prompts of P tokens with `sizes[i]` completions
    each, shuffled; advantages and a ragged completion mask per row."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (len(sizes), P), generator=gen)
    rows = torch.cat([prompts[i].expand(n, P) for i, n in enumerate(sizes)])
    ids = torch.cat([rows, torch.randint(0, vocab, (rows.shape[0], R), generator=gen)], dim=1)
    order = torch.randperm(ids.shape[0], generator=gen)
    lengths = torch.randint(1, R + 1, (ids.shape[0],), generator=gen)
    mask = (torch.arange(R)[None, :] < lengths[:, None]).to(torch.float64)
    return ids[order], torch.randn(ids.shape[0], generator=gen, dtype=torch.float64), mask


def detached_batch_reference(model, ids, advantages, mask):
    """The detached contract for `batch_loss`: eager with the keys and
    values at each row's prompt positions 0..P-2 constants."""
    with prompt_state_detached(ids.shape[1] - mask.shape[1]):
        return eager_loss_and_grads(batch_loss, model, ids, advantages, mask)
