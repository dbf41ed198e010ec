"""Step graphs (`longstraw.codegen.stepgraph`) across prompt lengths."""

from __future__ import annotations

import re

import torch

from longstraw.backend import Backend, PlanningDone

from helpers.tiny_models import make_model


def _trl_loss(model, prompt_ids, prompt_mask, completion_ids, completion_mask, advantages):
    """TRL's layout: left-padded prompts, the mask passed to the model (so the steps build mask tiles)."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=completion_ids.shape[1] + 1).logits[:, :-1]
    logp = logits.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    weight = completion_mask.to(logp.dtype)
    return -((torch.exp(logp - logp.detach()) * advantages[:, None]) * weight).sum() / weight.sum()


def _batch(lengths: list[int], G: int, R: int, vocab: int) -> tuple[torch.Tensor, ...]:
    P, gen = max(lengths), torch.Generator().manual_seed(0)
    prompt_ids, prompt_mask = [], []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=gen)
        row = torch.cat([torch.zeros(P - n, dtype=torch.long), ids])
        prompt_ids += [row] * G
        prompt_mask += [torch.cat([torch.zeros(P - n, dtype=torch.long), torch.ones(n, dtype=torch.long)])] * G
    rows = len(lengths) * G
    completion_ids = torch.randint(0, vocab, (rows, R), generator=gen)
    completion_mask = torch.ones(rows, R, dtype=torch.long)
    advantages = torch.randn(rows, generator=gen, dtype=torch.float64)
    return torch.stack(prompt_ids), torch.stack(prompt_mask), completion_ids, completion_mask, advantages


def test_a_new_length_changes_the_steps_code_in_its_integer_constants_only():
    """At a new prompt and completion length the plan's step graphs are the
    same code but for the sizes folded into it (a mask tile's inputs were
    once ordered by a set of nodes, so a step's code changed from plan to
    plan for no reason)."""
    model = make_model("qwen3").double()
    backend = Backend(prompt_grad="exact", plan_cache_size=8)
    backend.stop_after_planning = True
    compiled = torch.compile(_trl_loss, backend=backend)
    codes = []
    for lengths, R in (([20, 24], 6), ([22, 27], 7), ([30, 31], 5), ([25, 33], 8)):
        try:
            compiled(model, *_batch(lengths, 2, R, model.config.vocab_size))
        except PlanningDone as done:
            program = done.plan.program
            codes.append({name: getattr(program, name).module.code for name in ("outer", "prefix", "branch", "tail")})
    assert len(codes) == 4
    dynamic = codes[1:]  # Dynamo traced the first call with static shapes, the rest with dynamic ones
    assert "mask_tiles_0" in dynamic[0]["prefix"]
    numbers = re.compile(r"\b\d+\b")
    for name in dynamic[0]:
        assert len({numbers.sub("N", code[name]) for code in dynamic}) == 1, name
    assert dynamic[0]["prefix"] != dynamic[1]["prefix"]  # the sizes themselves do change
