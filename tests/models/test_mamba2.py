"""Mamba-2 hybrids (`longstraw.models.mamba2`): the state LongStraw keeps at
a published full-size config (`explain` on the meta device). Their float64
parity against eager in both modes is `tests/models/test_families.py`'s,
the scan's `tests/passes/test_ssd.py`."""

from __future__ import annotations

import pytest
import torch
import transformers

from helpers.published import explain_on_meta

NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
"""nvidia/Nemotron-H-8B-Base-8K's `hybrid_override_pattern`: M a Mamba-2 layer, * attention, - an MLP."""

NEMOTRON_H_8B = dict(
    hidden_size=4096, intermediate_size=21504, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, vocab_size=131072,
    layers_block_type=[{"M": "linear_attention", "*": "full_attention", "-": "mlp"}[c] for c in NEMOTRON_H_8B_PATTERN],
)
"""Nemotron-H-8B's published shapes, as `NemotronHConfig` arguments."""


@pytest.mark.slow
def test_state_at_nemotron_h_8b():
    """Nemotron-H-8B, bf16: 4 attention layers keep K and V (8 heads of 128)
    per position, 16,384 B; 24 Mamba-2 layers carry the scan's state (128
    heads x 64 x 128, float32: 4,194,304 B) and the convolution's last 3
    inputs (8,192 channels and B, C of 8 groups x 128, bf16: 61,440 B)."""
    config = transformers.NemotronHConfig(num_hidden_layers=len(NEMOTRON_H_8B_PATTERN), use_mamba_kernels=False,
                                          **NEMOTRON_H_8B)
    with torch.device("meta"):
        model = transformers.NemotronHForCausalLM(config).to(torch.bfloat16)
    report = explain_on_meta(model, 256, 100)
    attention, mixers = NEMOTRON_H_8B_PATTERN.count("*"), NEMOTRON_H_8B_PATTERN.count("M")
    heads, head_dim, state, groups = 128, 64, 128, 8
    conv_channels = heads * head_dim + 2 * groups * state
    assert (attention, mixers) == (4, 24)
    assert report.state_bytes_per_position == attention * 2 * 8 * 128 * 2 == 16_384
    assert report.state_fixed_bytes == mixers * (heads * head_dim * state * 4 + 3 * conv_channels * 2) == 102_137_856
