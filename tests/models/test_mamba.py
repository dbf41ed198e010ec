"""Mamba-1 mixers (`longstraw.models.mamba`): the drop-in for HF's selective
scan is HF's scan, its final state included; the detached reference the
families suite uses tells the two modes apart; and the state LongStraw
keeps at the published full-size configs (`explain` on the meta device).
The float64 parity of `mamba`, `falcon_mamba` and `jamba` against eager in
both modes is `tests/models/test_families.py`'s."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.mamba import modeling_mamba

from longstraw.models import mamba

from helpers.compare import assert_close, rel_err
from helpers.families import FAMILIES
from helpers.losses import grpo_loss_f64
from helpers.published import explain_published
from helpers.reference import eager_loss_and_grads
from helpers.tiny_models import make_group


def _scan_inputs(dtype: torch.dtype, batch: int = 2, channels: int = 6, states: int = 3, length: int = 70) -> dict:
    """Inputs in HF's layout (`[b, d, L]`, `A` [d, n], `B`, `C` [b, n, L]);
    longer than one chunk of the SSD kernel (64 positions)."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    return dict(
        hidden_states=randn(batch, channels, length), dt=randn(batch, channels, length),
        A=-torch.rand(channels, states, generator=gen) - 0.1, B=randn(batch, states, length),
        C=randn(batch, states, length), D=torch.rand(channels, generator=gen), z=randn(batch, channels, length),
        delta_bias=torch.rand(channels, generator=gen), delta_softplus=True,
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_drop_in_is_hfs_selective_scan(dtype):
    inputs = _scan_inputs(dtype)
    want, want_state = modeling_mamba.mamba_selective_scan(**inputs, return_last_state=True, use_associative_scan=False)
    got, got_state = mamba.mamba_selective_scan(**inputs, return_last_state=True)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert got.dtype == want.dtype and got_state.shape == want_state.shape
    assert_close(got, want, tol, "scan output")
    assert_close(got_state.to(want_state.dtype), want_state, tol, "final state")


def test_the_detached_reference_differs_from_exact():
    """The families' detached reference for Mamba-1 (the state at the
    prompt's end held constant in the mixer's functions) is not the exact
    gradient: the two modes are told apart."""
    family = FAMILIES["mamba"]
    model, group = family.build(), make_group(3, 13, 5, pad=True)
    _, detached = family.detached(grpo_loss_f64, model, *group)
    _, exact = eager_loss_and_grads(grpo_loss_f64, model, *group)
    assert max(rel_err(detached[n], exact[n]) for n in exact if exact[n] is not None) > 1e-2


MAMBA_2_8B = dict(hidden_size=2560, num_hidden_layers=64, state_size=16, expand=2, conv_kernel=4, vocab_size=50280)
"""state-spaces/mamba-2.8b-hf's published config."""


@pytest.mark.slow
def test_state_at_mamba_2_8b():
    """mamba-2.8b, bf16: nothing per position; per layer the scan's state
    (5,120 channels x 16, float32: 327,680 B) and the convolution's last 3
    inputs (5,120 channels, bf16: 30,720 B)."""
    config = transformers.MambaConfig(**MAMBA_2_8B)
    report = explain_published(transformers.MambaForCausalLM, config)
    d, n, k = config.intermediate_size, config.state_size, config.conv_kernel
    assert report.state_bytes_per_position == 0
    assert report.state_fixed_bytes == config.num_hidden_layers * (d * n * 4 + d * (k - 1) * 2) == 22_937_600


@pytest.mark.slow
def test_state_at_jamba_v0_1():
    """Jamba-v0.1 (`JambaConfig`'s defaults), bf16: 4 attention layers keep
    K and V (8 heads of 128) per position, 16,384 B; 28 Mamba layers carry
    8,192 channels x 16 of float32 state and 3 bf16 inputs, 573,440 B each."""
    config = transformers.JambaConfig(use_mamba_kernels=False)
    report = explain_published(transformers.JambaForCausalLM, config, experts="batched_mm")
    attention = sum(1 for i in range(config.num_hidden_layers)
                    if i % config.attn_layer_period == config.attn_layer_offset)
    mixers, d = config.num_hidden_layers - attention, config.mamba_expand * config.hidden_size
    head_dim = config.hidden_size // config.num_attention_heads
    assert (attention, mixers) == (4, 28)
    assert report.state_bytes_per_position == attention * 2 * config.num_key_value_heads * head_dim * 2 == 16_384
    assert report.state_fixed_bytes == mixers * d * (config.mamba_d_state * 4 + (config.mamba_d_conv - 1) * 2) \
        == 16_056_320


FALCON_MAMBA_7B = dict(hidden_size=4096, num_hidden_layers=64, state_size=16, expand=16, intermediate_size=8192,
                       conv_kernel=4, time_step_rank=256, vocab_size=65024, tie_word_embeddings=False)
"""tiiuae/falcon-mamba-7b's published config.json (its `expand` of 16 is
overridden by its explicit `intermediate_size` of 8,192 = 2 x 4,096)."""


@pytest.mark.slow
def test_state_at_falcon_mamba_7b():
    """falcon-mamba-7b (shapes from tiiuae/falcon-mamba-7b's config.json),
    bf16: nothing per position; per layer the scan's state (8,192 channels x
    16, float32: 524,288 B) and the convolution's last 3 inputs (8,192
    channels, bf16: 49,152 B); the RMS norms of B, C and dt add none."""
    config = transformers.FalconMambaConfig(**FALCON_MAMBA_7B)
    report = explain_published(transformers.FalconMambaForCausalLM, config)
    layers, channels, n, k = 64, 8192, 16, 4  # the published config's numbers, not the config object's
    assert report.state_bytes_per_position == 0
    assert report.state_fixed_bytes == layers * (channels * n * 4 + channels * (k - 1) * 2) == 36_700_160
