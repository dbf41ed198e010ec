"""Gemma 3n's state at its published full-size config (`explain` on the meta
device). Its float64 parity against eager in both modes is
`tests/models/test_families.py`'s."""

from __future__ import annotations

import pytest
import transformers

from helpers.published import explain_published


@pytest.mark.slow
def test_state_at_gemma_3n_defaults():
    """`Gemma3nTextConfig`'s defaults (35 layers, every fifth of full
    attention, the last 15 reusing an earlier layer's K/V), bf16, in eval
    mode (in train mode HF clamps AltUp's weights in place). The layers that
    compute their own K/V: 4 full ones keep K and V (2 heads of 256) per
    position, 2,048 B each. Every sliding layer (window 512), the 12 that
    reuse K/V included, carries the last 511 positions' keys, values and a
    flag at the 2 K/V heads (before `repeat_kv`), 1,048,572 B each: a
    reusing layer's window is a copy of its source's, not shared yet.

    HF's activation sparsity (the first 10 layers' Gaussian top-k) is set
    to zero: its `torch.tensor(..., device=inputs.device)` becomes a real
    meta tensor under Dynamo, which fake propagation refuses. It is per
    position in the MLP and changes no state."""
    defaults = transformers.Gemma3nTextConfig()
    config = transformers.Gemma3nTextConfig(activation_sparsity_pattern=[0.0] * defaults.num_hidden_layers)
    report = explain_published(transformers.Gemma3nForCausalLM, config, 1024, 200, eval_mode=True)
    own = [t for t, mode in zip(config.layer_types, config.kv_sharing_modes) if mode != "reuse"]
    full, sliding = own.count("full_attention"), config.layer_types.count("sliding_attention")
    kv, d, w = config.num_key_value_heads, config.head_dim, config.sliding_window
    assert (config.num_hidden_layers, full, sliding, kv, d, w) == (35, 4, 28, 2, 256, 512)
    assert report.state_bytes_per_position == full * 2 * kv * d * 2 == 8_192
    assert report.state_fixed_bytes == sliding * kv * (w - 1) * (2 * d + 1) * 2 == 29_360_016
