"""The scorer the integrations compile (`integrations/scoring.py`), run
eagerly: each completion token's log-prob and its distribution's entropy
at the row's temperature, zero on padding, as TRL computes them."""

from __future__ import annotations

import pytest
import torch

from longstraw.integrations.scoring import completion_logps_and_entropies

from helpers.padding import padded_group
from helpers.tiny_models import make_qwen3


@pytest.mark.parametrize("temperature", [0.7, "per row"])
def test_log_probs_and_entropies_are_the_softmax_s(temperature):
    model = make_qwen3().double()
    prompt_ids, prompt_mask, completion_ids, completion_mask, _ = padded_group(3, 9, 4, left=2, lengths=[4, 2, 3])
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    R = completion_ids.shape[1]
    t = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64) if temperature == "per row" else temperature
    logps, entropies = completion_logps_and_entropies(model, input_ids, attention_mask, R, t)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -R - 1:-1]
    scale = t.view(-1, 1, 1) if isinstance(t, torch.Tensor) else t
    log_p = torch.log_softmax(logits / scale, -1)
    want_logps = log_p.gather(-1, completion_ids[..., None])[..., 0] * completion_mask
    want_entropies = -(log_p.exp() * log_p).sum(-1) * completion_mask
    assert torch.allclose(logps.double(), want_logps, atol=1e-5, rtol=1e-5)
    assert torch.allclose(entropies.double(), want_entropies, atol=1e-5, rtol=1e-5)
    assert bool((logps[completion_mask == 0] == 0).all()) and bool((entropies[completion_mask == 0] == 0).all())
