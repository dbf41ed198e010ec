"""One GRPO step on a tiny random Qwen3 model, on the CPU, with LongStraw.

Samples G responses to one prompt from the old policy (one update behind
the policy being trained, as when a trainer takes several steps per
generation), scores them with a toy reward, computes group-normalised
advantages, and takes an optimizer step on the clipped GRPO objective
compiled with `backend="longstraw"`. Before stepping, it checks the loss
and every gradient against plain eager PyTorch in float64 (exits non-zero
past `TOLERANCE`), shows what detached mode drops, and prints the
partition the backend chose.

    python examples/grpo_step.py
"""

from __future__ import annotations

import copy

import torch

import longstraw
from longstraw.models.tiny import tiny_causal_lm

G, P, R, CHUNK = 4, 96, 24, 32
TOLERANCE = 1e-6
"""Relative, loss and every gradient. The model is float64, but HF's RMSNorm
and rotary embedding compute in float32 inside it: LongStraw's chunked
sums (a weight's gradient over prompt chunks, then branches) round through
those float32 casts differently from eager's, so the two agree to float32's
~1e-7, not float64's ~1e-16 (models without float32 casts agree within
1e-9: tests/contract/test_parity_dense.py)."""


def grpo_loss(model, prompt, responses, old_logp, advantages, mask, clip: float = 0.2):
    """Token-level clipped GRPO objective over `[prompt; response_g]`."""
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    logits = model(input_ids=ids).logits[:, prompt.shape[0] - 1 : -1]
    logp = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1 - clip, 1 + clip)
    per_token = -torch.minimum(ratio * advantages[:, None], clipped * advantages[:, None])
    return (per_token * mask).sum() / mask.sum()


def sample_group(model, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """G sampled responses, right-padded to R, and their completion mask."""
    eos = model.config.eos_token_id or 0
    with torch.no_grad():
        out = model.generate(
            prompt[None], do_sample=True, max_new_tokens=R, min_new_tokens=R // 2,
            num_return_sequences=G, pad_token_id=eos, eos_token_id=eos,
        )
    responses = out[:, prompt.shape[0]:]
    responses = torch.nn.functional.pad(responses, (0, R - responses.shape[1]), value=eos)
    finished = (responses == eos).int().cumsum(1)
    mask = ((finished == 0) | ((finished == 1) & (responses == eos))).to(torch.float64)
    return responses, mask


def toy_reward(responses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Reward responses rich in even token ids (anything the group disagrees on will do)."""
    return ((responses % 2 == 0).double() * mask).sum(1) / mask.sum(1)


def max_rel_error(model: torch.nn.Module, reference: dict[str, torch.Tensor]) -> float:
    errors = [
        ((p.grad - reference[n]).norm() / reference[n].norm().clamp_min(1e-30)).item()
        for n, p in model.named_parameters() if p.grad is not None
    ]
    return max(errors)


def example_group():
    """A random group for `longstraw explain examples/grpo_step.py:example_group --P ...`."""
    torch.manual_seed(0)
    model = tiny_causal_lm("qwen3", dtype=torch.float64)
    prompt = torch.randint(1, model.config.vocab_size, (P,))
    responses = torch.randint(1, model.config.vocab_size, (G, R))
    old_logp = torch.zeros(G, R, dtype=torch.float64)
    advantages = torch.randn(G, dtype=torch.float64)
    return grpo_loss, (model, prompt, responses, old_logp, advantages, torch.ones(G, R, dtype=torch.float64))


def old_policy_of(model: torch.nn.Module) -> torch.nn.Module:
    """The policy that sampled: the trained one before its last update, here a small random step away."""
    old = copy.deepcopy(model)
    with torch.no_grad():
        for p in old.parameters():
            p.add_(torch.randn_like(p), alpha=0.02)
    return old


def token_logp(model: torch.nn.Module, prompt: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompt.expand(G, -1), responses], 1)).logits[:, P - 1 : -1]
        return torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def main() -> None:
    torch.manual_seed(0)
    model = tiny_causal_lm("qwen3", dtype=torch.float64)
    old_policy = old_policy_of(model)
    old_policy.generation_config.pad_token_id = old_policy.config.eos_token_id or 0
    prompt = torch.randint(1, model.config.vocab_size, (P,))
    responses, mask = sample_group(old_policy, prompt)
    old_logp = token_logp(old_policy, prompt, responses)
    rewards = toy_reward(responses, mask)
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)

    eager_model = copy.deepcopy(model)
    eager_loss = grpo_loss(eager_model, prompt, responses, old_logp, advantages, mask)
    eager_loss.backward()
    reference = {n: p.grad for n, p in eager_model.named_parameters()}

    print(f"GRPO group: G={G} responses of up to R={R} tokens after a P={P}-token prompt")
    print(f"rewards {rewards.tolist()}")
    for mode in ("exact", "detached"):
        backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=CHUNK)
        step = torch.compile(grpo_loss, backend=backend)
        model.zero_grad()
        loss = step(model, prompt, responses, old_logp, advantages, mask)
        loss.backward()
        if mode == "exact":
            print(backend.plans[-1].summary())
            loss_error = abs(loss.item() - eager_loss.item()) / abs(eager_loss.item())
            grad_error = max_rel_error(model, reference)
            print(f"parity vs eager (exact, float64): loss {loss.item():+.12e} vs {eager_loss.item():+.12e} "
                  f"(relative {loss_error:.1e}), max relative gradient error {grad_error:.1e}; "
                  f"tolerance {TOLERANCE:.0e} (HF's norms and RoPE compute in float32)")
            if not max(loss_error, grad_error) <= TOLERANCE:
                raise SystemExit(f"parity FAILED: {max(loss_error, grad_error):.1e} > {TOLERANCE:.0e}")
        else:
            print(f"detached mode: loss {loss.item():+.12e} (same value), gradient differs from exact by "
                  f"{max_rel_error(model, reference):.2e} (the prompt-side term it drops)")

    backend = longstraw.Backend(prefix_chunk_size=CHUNK)
    step = torch.compile(grpo_loss, backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.zero_grad()
    loss = step(model, prompt, responses, old_logp, advantages, mask)
    loss.backward()
    optimizer.step()
    after = step(model, prompt, responses, old_logp, advantages, mask)
    print(f"optimizer step: loss {loss.item():+.6e} -> {after.item():+.6e}")


if __name__ == "__main__":
    main()
