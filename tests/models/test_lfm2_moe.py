"""LFM2-MoE (`longstraw.models.lfm2`): the state LongStraw keeps at a
published full-size config (`explain` on the meta device). Its float64
parity against eager in both modes is `tests/models/test_families.py`'s."""

from __future__ import annotations

import pytest
import transformers

from helpers.published import explain_published

LFM2_8B_A1B_ATTENTION = [2, 6, 10, 14, 18, 21]
"""The `full_attention` layers of LiquidAI/LFM2-8B-A1B's `layer_types` (the other 18 of 24 are `conv`)."""

LFM2_8B_A1B = dict(
    vocab_size=65536, hidden_size=2048, intermediate_size=7168, moe_intermediate_size=1792, num_hidden_layers=24,
    num_attention_heads=32, num_key_value_heads=8, conv_L_cache=3, num_dense_layers=2, num_experts=32,
    num_experts_per_tok=4, layer_types=["full_attention" if i in LFM2_8B_A1B_ATTENTION else "conv" for i in range(24)],
)
"""LFM2-8B-A1B's published shapes (LiquidAI/LFM2-8B-A1B's config.json), as `Lfm2MoeConfig` arguments."""


@pytest.mark.slow
def test_state_at_lfm2_8b_a1b():
    """LFM2-8B-A1B (shapes from LiquidAI/LFM2-8B-A1B's config.json), bf16,
    HF's `batched_mm` experts: 6 attention layers keep K and V (8 heads of
    2,048 / 32 = 64) per position, 12,288 B; 18 short-convolution layers
    carry the last 2 inputs of their kernel of 3 (2,048 channels, bf16:
    8,192 B each); the 32 experts add none."""
    config = transformers.Lfm2MoeConfig(**LFM2_8B_A1B)
    report = explain_published(transformers.Lfm2MoeForCausalLM, config, experts="batched_mm")
    attention = len(LFM2_8B_A1B_ATTENTION)
    convs, channels, kernel = 24 - attention, 2048, 3
    assert (attention, convs) == (6, 18)
    assert report.state_bytes_per_position == attention * 2 * 8 * (2048 // 32) * 2 == 12_288
    assert report.state_fixed_bytes == convs * (kernel - 1) * channels * 2 == 147_456
