"""RL post-training objectives as plain loss functions over `[prompt; response_g]`.

Each objective is what a trainer writes in eager PyTorch; compile it with
`torch.compile(objective, backend="longstraw")` unchanged. All take

    model, prompt [P], responses [G, R], advantages [G], mask [G, R] (float,
    1 on completion tokens), old_logp [G, R] (the sampling policy's per-token
    log-probs, no grad)

and `kl_penalty` also ref_logp [G, R] (a frozen reference model's). The
log-probs of the policy are `response_logprobs`; what differs between the
objectives is the tail:

- `grpo`: PPO's clipped ratio per token, averaged over each response's
  tokens, then over the group (DeepSeekMath's sequence mean).
- `dapo`: clip-higher (a wider upper clip) and the token mean over the
  whole group (DAPO), so long responses weigh by their length.
- `dr_grpo`: the sum over tokens divided by a constant (G times the
  maximum response length), no per-response length normalisation (Dr. GRPO).
- `gspo`: one importance ratio per response, the geometric mean of its
  token ratios, clipped per response (GSPO).
- `kl_penalty`: GRPO plus beta times the k3 estimator of KL(policy || reference),
  exp(ref - logp) - (ref - logp) - 1 per token.

    python examples/objectives.py    # each against eager on a tiny model
"""

from __future__ import annotations

import torch


def response_logprobs(model, prompt: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """log pi(response token | prefix) per response token: [G, R]."""
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    logits = model(input_ids=ids).logits[:, prompt.shape[0] - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """-min(ratio * A, clip(ratio, 1 - low, 1 + high) * A), per element."""
    return -torch.minimum(ratio * advantages, torch.clamp(ratio, 1 - low, 1 + high) * advantages)


def grpo(model, prompt, responses, advantages, mask, old_logp, clip: float = 0.2):
    logp = response_logprobs(model, prompt, responses)
    per_token = _clipped_surrogate(torch.exp(logp - old_logp), advantages[:, None], clip, clip)
    return ((per_token * mask).sum(1) / mask.sum(1)).mean()


def dapo(model, prompt, responses, advantages, mask, old_logp, clip_low: float = 0.2, clip_high: float = 0.28):
    logp = response_logprobs(model, prompt, responses)
    per_token = _clipped_surrogate(torch.exp(logp - old_logp), advantages[:, None], clip_low, clip_high)
    return (per_token * mask).sum() / mask.sum()


def dr_grpo(model, prompt, responses, advantages, mask, old_logp, clip: float = 0.2):
    logp = response_logprobs(model, prompt, responses)
    per_token = _clipped_surrogate(torch.exp(logp - old_logp), advantages[:, None], clip, clip)
    return (per_token * mask).sum() / (responses.shape[0] * responses.shape[1])


def gspo(model, prompt, responses, advantages, mask, old_logp, clip_low: float = 3e-4, clip_high: float = 4e-4):
    logp = response_logprobs(model, prompt, responses)
    log_ratio = ((logp - old_logp) * mask).sum(1) / mask.sum(1)  # [G]: the mean token log-ratio of each response
    return _clipped_surrogate(torch.exp(log_ratio), advantages, clip_low, clip_high).mean()


def kl_penalty(model, prompt, responses, advantages, mask, old_logp, ref_logp, beta: float = 0.04, clip: float = 0.2):
    logp = response_logprobs(model, prompt, responses)
    per_token = _clipped_surrogate(torch.exp(logp - old_logp), advantages[:, None], clip, clip)
    delta = ref_logp - logp
    per_token = per_token + beta * (torch.exp(delta) - delta - 1)
    return ((per_token * mask).sum(1) / mask.sum(1)).mean()


OBJECTIVES = {"grpo": grpo, "dapo": dapo, "dr_grpo": dr_grpo, "gspo": gspo, "kl_penalty": kl_penalty}


def _demo() -> None:
    """Each objective, compiled in exact mode, against eager in float64."""
    import longstraw
    from longstraw.models.tiny import tiny_causal_lm

    torch.manual_seed(0)
    model = tiny_causal_lm().double()
    G, P, R = 4, 40, 12
    vocab = model.config.vocab_size
    prompt, responses = torch.randint(0, vocab, (P,)), torch.randint(0, vocab, (G, R))
    mask = (torch.arange(R) < torch.randint(R // 2, R + 1, (G, 1))).double()
    advantages = torch.randn(G, dtype=torch.float64)
    with torch.no_grad():
        old_logp = response_logprobs(model, prompt, responses) + 0.05 * torch.randn(G, R, dtype=torch.float64)
        ref_logp = old_logp + 0.1 * torch.randn(G, R, dtype=torch.float64)
    for name, objective in OBJECTIVES.items():
        extra = (old_logp, ref_logp) if objective is kl_penalty else (old_logp,)
        results = []
        for fn in (objective, torch.compile(objective, backend=longstraw.Backend(prefix_chunk_size=16))):
            model.zero_grad(set_to_none=True)
            loss = fn(model, prompt, responses, advantages, mask, *extra)
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
        (want, want_grads), (got, got_grads) = results
        error = max((g - w).abs().max().item() / w.abs().max().clamp_min(1e-30).item() for g, w in zip(got_grads, want_grads))
        print(f"{name:11} loss {got.item():+.6f} (eager {want.item():+.6f})  max relative gradient error {error:.2e}")


if __name__ == "__main__":
    _demo()
