"""Mamba-2 hybrids (`longstraw.models.mamba2`): the state LongStraw keeps at
a published full-size config (`explain` on the meta device). Their float64
parity against eager in both modes is `tests/models/test_families.py`'s,
the scan's `tests/passes/test_ssd.py`."""

from __future__ import annotations

import pytest
import transformers

from helpers.published import explain_published


def mixer_bytes(heads: int, head_dim: int, state: int, groups: int, kernel: int = 4) -> int:
    """What one Mamba-2 mixer carries, bf16 model: the scan's state `[heads,
    head_dim, state]` in float32 and the convolution's last `kernel - 1`
    inputs (x, B and C: `heads * head_dim + 2 * groups * state` channels) in bf16."""
    conv_channels = heads * head_dim + 2 * groups * state
    return heads * head_dim * state * 4 + (kernel - 1) * conv_channels * 2


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
    report = explain_published(transformers.NemotronHForCausalLM, config)
    attention, mixers = NEMOTRON_H_8B_PATTERN.count("*"), NEMOTRON_H_8B_PATTERN.count("M")
    heads, head_dim, state, groups = 128, 64, 128, 8
    assert (attention, mixers) == (4, 24)
    assert report.state_bytes_per_position == attention * 2 * 8 * 128 * 2 == 16_384
    assert report.state_fixed_bytes == mixers * mixer_bytes(heads, head_dim, state, groups) == 102_137_856


BAMBA_9B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    attn_layer_indices=[9, 18, 27], mamba_n_heads=128, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
    mamba_d_conv=4, mamba_expand=2, vocab_size=128256,
)
"""ibm-ai-platform/Bamba-9B's published config.json, as `BambaConfig` arguments."""


@pytest.mark.slow
def test_state_at_bamba_9b():
    """Bamba-9B (shapes from ibm-ai-platform/Bamba-9B's config.json), bf16:
    3 attention layers keep K and V (8 heads of 4,096 / 32 = 128) per
    position, 12,288 B; 29 Mamba-2 layers carry the scan's state (128 heads
    x 64 x 128, float32: 4,194,304 B) and the convolution's last 3 inputs
    (8,192 channels and B, C of 1 group x 128, bf16: 50,688 B)."""
    config = transformers.BambaConfig(**BAMBA_9B)
    report = explain_published(transformers.BambaForCausalLM, config)
    layers, attention = 32, len([9, 18, 27])
    mixers = layers - attention
    heads, head_dim, state, groups, kernel = 128, 64, 128, 1, 4
    assert (attention, mixers) == (3, 29)
    assert report.state_bytes_per_position == attention * 2 * 8 * (4096 // 32) * 2 == 12_288
    assert report.state_fixed_bytes == mixers * mixer_bytes(heads, head_dim, state, groups, kernel) == 123_104_768


GRANITE_4_H_SMALL_ATTENTION = [5, 15, 25, 35]
"""The attention layers of ibm-granite/granite-4.0-h-small's `layer_types` (the other 36 of 40 are Mamba-2)."""

GRANITE_4_H_SMALL = dict(
    hidden_size=4096, intermediate_size=768, shared_intermediate_size=1536, num_hidden_layers=40,
    num_attention_heads=32, num_key_value_heads=8, num_local_experts=72, num_experts_per_tok=10,
    mamba_n_heads=128, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2,
    vocab_size=100352, position_embedding_type="nope",
    layer_types=["attention" if i in GRANITE_4_H_SMALL_ATTENTION else "mamba" for i in range(40)],
)
"""Granite 4.0-H Small's published shapes (ibm-granite/granite-4.0-h-small's
config.json), as `GraniteMoeHybridConfig` arguments."""


@pytest.mark.slow
def test_state_at_granite_4_0_h_small():
    """Granite 4.0-H Small (32B-A9B; shapes from
    ibm-granite/granite-4.0-h-small's config.json), bf16, HF's `batched_mm`
    experts: 4 attention layers keep K and V (8 heads of 4,096 / 32 = 128)
    per position, 16,384 B; 36 Mamba-2 layers carry the scan's state (128
    heads x 64 x 128, float32: 4,194,304 B) and the convolution's last 3
    inputs (8,192 channels and B, C of 1 group x 128, bf16: 50,688 B); the
    72 experts and the shared expert add none."""
    config = transformers.GraniteMoeHybridConfig(**GRANITE_4_H_SMALL)
    report = explain_published(transformers.GraniteMoeHybridForCausalLM, config, experts="batched_mm")
    attention = len(GRANITE_4_H_SMALL_ATTENTION)
    mixers = 40 - attention
    heads, head_dim, state, groups, kernel = 128, 64, 128, 1, 4
    assert (attention, mixers) == (4, 36)
    assert report.state_bytes_per_position == attention * 2 * 8 * (4096 // 32) * 2 == 16_384
    assert report.state_fixed_bytes == mixers * mixer_bytes(heads, head_dim, state, groups, kernel) == 152_819_712


FALCON_H1_7B = dict(
    hidden_size=3072, intermediate_size=12288, num_hidden_layers=44, num_attention_heads=12, num_key_value_heads=2,
    head_dim=128, mamba_d_ssm=3072, mamba_n_heads=24, mamba_d_head=128, mamba_n_groups=1, mamba_d_state=256,
    mamba_d_conv=4, mamba_expand=2, vocab_size=130048,
)
"""Falcon-H1-7B's published shapes (tiiuae/Falcon-H1-7B-Base's config.json;
the table in transformers' FalconH1 docs), as `FalconH1Config` arguments."""


@pytest.mark.slow
def test_state_at_falcon_h1_7b():
    """Falcon-H1-7B (shapes from tiiuae/Falcon-H1-7B-Base's config.json),
    bf16: attention and Mamba-2 side by side in each of the 44 layers. Each
    keeps K and V (2 heads of 128) per position, 1,024 B, and carries the
    scan's state (24 heads x 128 x 256, float32: 3,145,728 B) and the
    convolution's last 3 inputs (3,072 channels and B, C of 1 group x 256,
    bf16: 21,504 B)."""
    config = transformers.FalconH1Config(**FALCON_H1_7B)
    report = explain_published(transformers.FalconH1ForCausalLM, config)
    layers, kv_heads, kv_dim = 44, 2, 128
    heads, head_dim, state, groups, kernel = 24, 128, 256, 1, 4
    assert report.state_bytes_per_position == layers * 2 * kv_heads * kv_dim * 2 == 45_056
    assert report.state_fixed_bytes == layers * mixer_bytes(heads, head_dim, state, groups, kernel) == 139_358_208


ZAMBA2_2_7B_HYBRID = [6, 12, 18, 24, 30, 36, 42, 47, 51]
"""Zyphra/Zamba2-2.7B's `hybrid_layer_ids`: the layers running the shared attention block, then Mamba-2."""

ZAMBA2_2_7B = dict(
    hidden_size=2560, intermediate_size=10240, num_hidden_layers=54, num_attention_heads=32, num_key_value_heads=32,
    n_mamba_heads=80, mamba_d_state=64, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1, num_mem_blocks=2,
    vocab_size=32000, use_mamba_kernels=False,
    layers_block_type=["hybrid" if i in ZAMBA2_2_7B_HYBRID else "mamba" for i in range(54)],
)
"""Zamba2-2.7B's published shapes (Zyphra/Zamba2-2.7B-Instruct-v2's config.json), as `Zamba2Config` arguments."""


@pytest.mark.slow
def test_state_at_zamba2_2_7b():
    """Zamba2 at Zyphra/Zamba2-2.7B's published config.json (Zamba2-7B's
    config.json could not be found with confidence offline; these are also
    `Zamba2Config`'s default layout), bf16: the shared attention block runs
    at 9 hybrid layers, each keeping its own K and V (32 heads of
    2 x 2,560 / 32 = 160) per position, 184,320 B in all; all 54 layers have
    a Mamba-2 mixer carrying the scan's state (80 heads x 64 x 64, float32:
    1,310,720 B) and the convolution's last 3 inputs (5,120 channels and
    B, C of 1 group x 64, bf16: 31,488 B)."""
    config = transformers.Zamba2Config(**ZAMBA2_2_7B)
    report = explain_published(transformers.Zamba2ForCausalLM, config)
    layers, attention = 54, len(ZAMBA2_2_7B_HYBRID)
    kv_heads, kv_dim = 32, 2 * 2560 // 32
    heads, state, groups, kernel = 80, 64, 1, 4
    head_dim = 2 * 2560 // heads
    assert (attention, head_dim) == (9, 64)
    assert report.state_bytes_per_position == attention * 2 * kv_heads * kv_dim * 2 == 184_320
    assert report.state_fixed_bytes == layers * mixer_bytes(heads, head_dim, state, groups, kernel) == 72_479_232
