"""Llama 4 (transformers `llama4_text`): the MoE drop-in
(`longstraw.models.llama4`) and the state LongStraw keeps at the published
full-size config (`explain` on the meta device). Float64 parity against
eager in both modes is `tests/models/test_families.py`'s."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama4 import modeling_llama4

import longstraw  # noqa: F401 - installs the trace bindings
from longstraw.models.llama4 import llama4_moe_forward

from helpers.published import explain_published


def test_the_drop_in_is_hfs_moe():
    """The drop-in gives HF's output and router logits bit for bit in
    float64 (the same products in the same order, on `[experts, tokens,
    hidden]` instead of the repeated tokens), and an eager call of the
    layer still runs HF's own forward."""
    config = transformers.Llama4TextConfig(hidden_size=16, intermediate_size=8, intermediate_size_mlp=24,
                                           num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    moe = modeling_llama4.Llama4TextMoe(config).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    hf_forward = modeling_llama4.Llama4TextMoe.forward.__wrapped__
    want_out, want_logits = hf_forward(moe, x)
    got_out, got_logits = llama4_moe_forward(moe, x)
    assert torch.equal(got_logits, want_logits)
    torch.testing.assert_close(got_out, want_out, rtol=0, atol=1e-14)
    eager_out, _ = moe(x)
    assert torch.equal(eager_out, want_out)


@pytest.mark.slow
def test_state_at_llama_4_scout():
    """`Llama4TextConfig`'s defaults, which are Llama-4-Scout-17B-16E's text
    shapes (48 layers, 8 K/V heads of 128, 16 experts, chunked attention
    over 8,192 positions in three of every four layers), bf16: every layer
    keeps K and V per prompt position, 4,096 B each (the chunked layers
    too: their mask is positions-only, and a window of the last chunk is
    not taken yet), nothing fixed."""
    config = transformers.Llama4TextConfig()
    report = explain_published(transformers.Llama4ForCausalLM, config)
    layers, kv_heads, head_dim = 48, 8, 128
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (layers, kv_heads, head_dim)
    assert config.layer_types.count("chunked_attention") == 36 and config.attention_chunk_size == 8192
    assert report.state_bytes_per_position == layers * 2 * kv_heads * head_dim * 2 == 196_608
    assert report.state_fixed_bytes == 0
