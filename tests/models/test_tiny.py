"""Tiny random HF models (`longstraw.models.tiny`): `tiny_causal_lm` builds the
family asked for at the tiny shapes (GQA 4/2, SDPA), in the dtype asked
for, the same weights for the same seed, with overrides applied, and names
the families it knows when asked for another."""

from __future__ import annotations

import pytest
import torch
import transformers

from longstraw.models.tiny import tiny_causal_lm


@pytest.mark.parametrize("family,cls", [("qwen3", transformers.Qwen3ForCausalLM),
                                        ("llama", transformers.LlamaForCausalLM)])
def test_a_family_at_tiny_shapes_with_grouped_query_attention(family, cls):
    model = tiny_causal_lm(family)
    config = model.config
    assert type(model) is cls
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers, config.head_dim) == (128, 64, 2, 16)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config._attn_implementation == "sdpa"
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 128) and logits.dtype == torch.float64


def test_the_seed_fixes_the_weights():
    a, b, other = tiny_causal_lm(seed=3), tiny_causal_lm(seed=3), tiny_causal_lm(seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.lm_head.weight, other.lm_head.weight)


def test_overrides_and_dtype():
    model = tiny_causal_lm("llama", dtype=torch.float32, num_hidden_layers=1, vocab_size=32)
    assert (model.config.num_hidden_layers, model.config.vocab_size, model.config.hidden_size) == (1, 32, 64)
    assert len(model.model.layers) == 1 and model.lm_head.weight.shape == (32, 64)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_an_unknown_family_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown family 'gpt2'; choose from \['llama', 'qwen3'\]"):
        tiny_causal_lm("gpt2")
