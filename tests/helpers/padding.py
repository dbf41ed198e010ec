"""TRL's layout of a group: left-padded prompt, right-padded completions,
int64 masks; its loss (and one over the integrations' scorer), its
detached reference through HF's cache, and the parity check the padding
suites share."""

from __future__ import annotations

import torch

import longstraw
from longstraw.integrations.scoring import completion_logps_and_entropies
from longstraw.models import qwen3_5

from helpers.harness import assert_parity
from helpers.parity import deterministic_algorithms
from helpers.reference import with_fresh_grads
from helpers.tiny_models import make_llama, make_qwen3, make_qwen3_5

TOL = 1e-6  # HF norms and RoPE round through float32
PAD_ID = 0


def trl_tail(logits, completion_ids, completion_mask, advantages):
    """TRL's GRPO loss after the model: per-token log-probs of the
    completion, the importance ratio, masked by the completion mask and
    averaged per sequence, then over the group."""
    logps = torch.log_softmax(logits, -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)  # [G, R]
    ratio = torch.exp(logps - logps.detach())
    per_token = -ratio * advantages[:, None]
    mask = completion_mask.to(logps.dtype)
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def trl_grpo_loss(model, prompt_ids, prompt_mask, completion_ids, completion_mask, advantages):
    """TRL's forward: prompt and completion ids and masks concatenated, the
    mask passed to the model, logits for the completion only."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    logits_to_keep = completion_ids.shape[1]
    logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep + 1).logits[:, :-1]
    return trl_tail(logits, completion_ids, completion_mask, advantages)


def scored_grpo_loss(model, prompt_ids, prompt_mask, completion_ids, completion_mask, advantages, temperature):
    """A GRPO loss over the integrations' scorer (`longstraw::logprobs_and_entropy`), with an entropy bonus."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    logps, entropy = completion_logps_and_entropies(model, input_ids, attention_mask, completion_ids.shape[1],
                                                    temperature)
    mask = completion_mask.to(logps.dtype)
    per_token = -torch.exp(logps - logps.detach()) * advantages[:, None].to(logps.dtype) - 0.01 * entropy
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def padded_group(G: int, P: int, R: int, left: int, lengths: list[int] | None = None, seed: int = 0, vocab: int = 64):
    """(prompt_ids, prompt_mask, completion_ids, completion_mask, advantages):
    one prompt of P - left tokens after `left` pad positions in every row,
    completions of `lengths` tokens (default: all R) right-padded to R.
    Masks are int64, as a tokenizer's are."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, vocab, (P,), generator=gen)
    prompt[:left] = PAD_ID
    prompt_mask = (torch.arange(P) >= left).long()
    lengths = torch.tensor([R] * G if lengths is None else lengths)
    completion_mask = (torch.arange(R)[None, :] < lengths[:, None]).long()
    completion_ids = torch.randint(1, vocab, (G, R), generator=gen).masked_fill(completion_mask == 0, PAD_ID)
    advantages = torch.randn(G, generator=gen, dtype=torch.float64)
    return prompt.expand(G, -1).clone(), prompt_mask.expand(G, -1).clone(), completion_ids, completion_mask, advantages


def detached_reference(model, prompt_ids, prompt_mask, completion_ids, completion_mask, advantages):
    """The detached contract through HF's cache, with the mask: positions
    0..P-2 run under no_grad (for all G rows: the hybrid's cache cannot be
    repeated along the batch), then the branches `[prompt[-1], completion[:-1]]`
    with the whole mask so far."""

    def run():
        with torch.no_grad():
            prompt = model(input_ids=prompt_ids[:, :-1], attention_mask=prompt_mask[:, :-1], use_cache=True)
            cache = prompt.past_key_values
        ids = torch.cat([prompt_ids[:, -1:], completion_ids[:, :-1]], 1)
        mask = torch.cat([prompt_mask, completion_mask[:, :-1]], 1)
        logits = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
        loss = trl_tail(logits, completion_ids, completion_mask, advantages)
        loss.backward()
        return loss

    return with_fresh_grads(model, run)


MODELS = {"qwen3": make_qwen3, "llama": make_llama, "qwen3_5": make_qwen3_5}


def check_padding_parity(kind: str, mode: str, group: tuple, chunk: int, deterministic: bool = False,
                         device: str = "cpu") -> longstraw.Backend:
    model = MODELS[kind]().to(device)
    group = tuple(tensor.to(device) for tensor in group)
    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=chunk, verify_state=True)
    with qwen3_5.bound(), deterministic_algorithms(deterministic):
        assert_parity(trl_grpo_loss, backend, detached_reference, model, *group, tol=TOL)
    assert backend.plans[-1].prefix_len == group[0].shape[1] - 1
    return backend
