"""The simulated step's peak as a function of the keys attention reads
(`longstraw.simulation.Peak`)."""

from __future__ import annotations

import pytest
import torch
import transformers

import longstraw
from longstraw.kernels import attention
from longstraw.simulation import Peak

from helpers.losses import grpo_loss_f64


def test_a_peak_reads_its_workspaces_off_for_more_keys():
    """`at` grows each workspace with the keys up to its block's cap and
    never goes under the simulated peak; `largest` and `extrapolated`
    combine per workspace."""
    peak = Peak(1000, ((10, 64, 500), (1, 1 << 20, 900)))
    assert peak.at(0) == peak.at(40) == 1000  # 500 + 400 and 900 + 40: under the simulated peak
    assert peak.at(64) == 500 + 10 * 64  # the first at its cap
    assert peak.at(10_000) == 900 + 10_000  # the first capped, the second not
    assert peak.at(1 << 30) == 900 + (1 << 20)
    assert peak.less(600) == Peak(400, ((10, 64, 0), (1, 1 << 20, 300)))
    other = Peak(1200, ((10, 64, 700),))
    assert Peak.largest([peak, other]) == Peak(1200, ((1, 1 << 20, 900), (10, 64, 700)))
    two, three = Peak(100, ((10, 64, 50),)), Peak(130, ((10, 64, 60),))
    assert Peak.extrapolated(two, three, 6) == Peak(220, ((10, 64, 90),))
    assert Peak.extrapolated(two, Peak(130, ((20, 64, 60),)), 6) is None


def _model() -> transformers.PreTrainedModel:
    """Many query heads over two key/value heads and narrow layers: flash
    attention's backward workspace (dK/dV expanded to 32 heads) is most of
    a step's activations."""
    config = transformers.Qwen3Config(num_hidden_layers=2, hidden_size=64, intermediate_size=64, num_attention_heads=32,
                                      num_key_value_heads=2, head_dim=64, vocab_size=64, max_position_embeddings=4096)
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.config.use_cache = False
    return model


def _report(model, P: int) -> longstraw.ExplainReport:
    meta = torch.device("meta")
    prompt = torch.zeros(P, dtype=torch.long, device=meta)
    responses = torch.zeros(4, 16, dtype=torch.long, device=meta)
    weights = torch.zeros(4, dtype=torch.bfloat16, device=meta)
    return longstraw.explain(grpo_loss_f64, model, prompt, responses, weights, weights[:, None].expand(4, 16),
                             options={"prefix_chunk_size": 32, "recompute_layers": False})


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_short_trace_plans_the_attention_workspace_of_a_long_prompt(ranks, monkeypatch):
    """Traced at 65 positions (earlier keys of 32 a call) and planned for
    513 on CUDA, where the backward's key blocks (capped at 64 here) are
    twice as long: the plan is within 5% of the one traced at 513, and
    the simulated peak alone (`Peak.held`, the traced prompt's workspace)
    is more than 8% under it, one process or one rank of two."""
    monkeypatch.setattr(attention, "FLASH_KEY_BLOCK", 64)
    model = _model()
    short, long = _report(model, 65), _report(model, 513)
    planned = {name: r.plan(P=513, G=4, prompt_grad="exact", device="cuda", ranks=ranks).activations
               for name, r in (("short", short), ("long", long))}
    held = short.memory.activations("exact", 32, False, torch.device("cuda"), None, ranks).held
    assert abs(planned["short"] - planned["long"]) <= 0.05 * planned["long"], planned
    assert held < 0.92 * planned["long"], (held, planned)
