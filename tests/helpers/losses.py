"""GRPO-style losses the tests compile.

`grpo_loss` is the loss from the issue, verbatim (`.float()` logits). The
other losses change only what the parity tests need: float64 logits so that
tolerances can be 1e-9, a tail that couples the branches non-linearly, and
inputs the backend must refuse.

`logits_of` accepts both an HF `CausalLMOutput` and a plain logits tensor, so
the same loss runs over HF models and `PlainTransformer`.
"""

from __future__ import annotations

import torch


def logits_of(out):
    return out if isinstance(out, torch.Tensor) else out.logits


def grpo_loss(model, prompt, responses, advantages, mask):
    """The loss from the issue (HF models only: uses `.logits`)."""
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    logits = model(input_ids=ids).logits[:, prompt.shape[0] - 1 : -1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - logp.detach())
    return -((ratio * advantages[:, None]) * mask).sum() / mask.sum()


def grpo_tail(logits, responses, advantages, mask):
    """The GRPO loss after the model: logits [G, R, V] at positions P-1..P+R-2."""
    logp = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)  # [G, R]
    ratio = torch.exp(logp - logp.detach())
    return -((ratio * advantages[:, None]) * mask).sum() / mask.sum()


def grpo_loss_f64(model, prompt, responses, advantages, mask):
    """`grpo_loss` without the float32 cast (logits keep the model dtype)."""
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    logits = logits_of(model(input_ids=ids))[:, prompt.shape[0] - 1 : -1]
    return grpo_tail(logits, responses, advantages, mask)


def coupled_tail(logits, responses, advantages, mask):
    """A tail whose value depends on the log-probs and couples all branches
    non-linearly: per-branch summed log-probs are standardised over the group
    inside the loss (a group-normalised score), then mixed with the
    advantages; plus a token-level policy-gradient term."""
    logp = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)  # [G, R]
    seq = (logp * mask).sum(1)  # [G]
    z = (seq - seq.mean()) / (seq.std(correction=0) + 1e-3)
    pg = -((logp * advantages[:, None]) * mask).sum() / mask.sum()
    return pg + (z * advantages).sum() + 0.1 * (z**2 * seq).sum()


def coupled_loss(model, prompt, responses, advantages, mask):
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    logits = logits_of(model(input_ids=ids))[:, prompt.shape[0] - 1 : -1]
    return coupled_tail(logits, responses, advantages, mask)


def pg_tail(logits, responses, advantages, mask):
    """Plain policy gradient: the loss value depends on every log-prob, so a
    wrong forward shows in the value, not only in the gradient."""
    logp = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    return -((logp * advantages[:, None]) * mask).sum() / mask.sum()


def pg_loss(model, prompt, responses, advantages, mask):
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    logits = logits_of(model(input_ids=ids))[:, prompt.shape[0] - 1 : -1]
    return pg_tail(logits, responses, advantages, mask)


TAILS = {grpo_loss_f64: grpo_tail, coupled_loss: coupled_tail, pg_loss: pg_tail}
"""The tail of each full loss, for `reference.detached_reference`."""


# --- losses the backend must refuse -------------------------------------------


def responses_only_loss(model, prompt, responses, advantages, mask):
    """No prompt at all: nothing is shared across the group."""
    logits = logits_of(model(input_ids=responses))[:, :-1]
    return pg_tail(logits, responses[:, 1:], advantages, mask[:, 1:])


def per_group_prefix_loss(model, prompts, responses, advantages, mask):
    """`prompts` is [G, P] with different rows: a concatenation whose first
    part is per-group data, not an expanded shared prompt."""
    ids = torch.cat([prompts, responses], dim=1)
    logits = logits_of(model(input_ids=ids))[:, prompts.shape[1] - 1 : -1]
    return pg_tail(logits, responses, advantages, mask)


def kl_tail(logits, ref_logits, responses, advantages, mask, beta=0.2):
    """GRPO with the k3 KL estimator against a reference model's log-probs."""
    logp = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    ref = torch.log_softmax(ref_logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    per_token = -advantages[:, None] * torch.exp(logp - logp.detach()) + beta * kl
    return (per_token * mask).sum() / mask.sum()


def sequences(prompt, responses):
    return torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)


def kl_to_reference_loss(reference):
    def loss_fn(model, prompt, responses, advantages, mask):
        p = prompt.shape[0]
        logits = logits_of(model(input_ids=sequences(prompt, responses)))[:, p - 1 : -1]
        with torch.no_grad():
            ref_logits = logits_of(reference(input_ids=sequences(prompt, responses)))[:, p - 1 : -1]
        return kl_tail(logits, ref_logits, responses, advantages, mask)

    return loss_fn
