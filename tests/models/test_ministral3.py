"""Ministral 3 (transformers `ministral3`): the state LongStraw keeps at a
published full-size config (`explain` on the meta device). Its float64
parity against eager in both modes is `tests/models/test_families.py`'s."""

from __future__ import annotations

import pytest
import transformers

from helpers.published import explain_published


@pytest.mark.slow
def test_state_at_ministral_3_8b():
    """`Ministral3Config`'s defaults (the full-size shapes HF documents with
    mistralai/Ministral-3-8B-Base-2512; its config.json was not checked
    offline), bf16: 34 layers of full attention (YaRN with Llama 4's
    position-dependent scale) keep K and V (8 heads of 128) per position,
    4,096 B each; no sliding window, so nothing fixed."""
    config = transformers.Ministral3Config()
    report = explain_published(transformers.Ministral3ForCausalLM, config)
    layers, kv_heads, head_dim = 34, 8, 128  # the 8B's shapes as HF documents them, written out
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (layers, kv_heads, head_dim)
    assert config.sliding_window is None
    assert report.state_bytes_per_position == layers * 2 * kv_heads * head_dim * 2 == 139_264
    assert report.state_fixed_bytes == 0
