"""MiniMax (`longstraw.models.minimax`): the drop-in for HF's lightning
attention is HF's layer (output and cached state, with padding and a length
that is not a multiple of HF's block), Dynamo traces `longstraw::ssd_scan` in
its place only for a call from a zero state, and eager calls keep HF's.
Float64 parity of the family against eager is `tests/models/test_families.py`'s."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.minimax import modeling_minimax as hf

import longstraw  # noqa: F401 - installs the trace bindings
from longstraw.models.minimax import lightning_attention_forward

from helpers.compare import assert_close
from helpers.published import explain_published
from helpers.traced_ops import EagerOps, traced_targets

SCAN = "longstraw.ssd_scan.default"
# the state: HF's decay buffers are computed in float32 when the layer is built (`.double()` keeps their
# rounding, 2.4e-8 relative), where the drop-in takes the float64 exponential of the slope at every position
TOL = 1e-7
NORMED_TOL = 1e-6  # the output: HF's RMSNorm after it rounds through float32, whatever the dtype


def lightning_layer(block_size: int = 4) -> hf.MiniMaxLightningAttention:
    """Layer 1 of a 3-layer tiny config (its decay depends on the layer index), float64."""
    config = transformers.MiniMaxConfig(hidden_size=16, num_attention_heads=2, head_dim=8, num_hidden_layers=3,
                                        block_size=block_size, layer_types=["full_attention", "linear_attention",
                                                                            "full_attention"])
    torch.manual_seed(0)
    return hf.MiniMaxLightningAttention(config, layer_idx=1).double()


def inputs(length: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states [2, length, 16] and a left-padding mask (the second row's first three positions)."""
    torch.manual_seed(1)
    mask = torch.ones(2, length, dtype=torch.float64)
    mask[1, :3] = 0
    return torch.randn(2, length, 16, dtype=torch.float64), mask


@pytest.mark.parametrize("length", [11, 8, 1])  # 11: a last block of 3 positions; 8: whole blocks; 1: one position
def test_the_drop_in_is_hfs_layer(length):
    layer = lightning_layer()
    hidden, mask = inputs(length)
    cache = hf.MiniMaxCache()
    want, want_state = layer(hidden, None, mask, past_key_values=cache)
    out, state = lightning_attention_forward(layer, hidden, mask)
    assert_close(out, want, NORMED_TOL, "output")
    assert_close(state, want_state, TOL, "final state, as HF caches it")
    assert_close(state, cache.get_linear_cache(1), TOL, "HF's cached state")


def test_the_state_continues_hfs_recurrence():
    """The drop-in's final state, handed to HF's cached path, gives what HF's whole call gives."""
    layer = lightning_layer()
    hidden, mask = inputs(13)
    whole, _ = layer(hidden, None, mask)
    cache = hf.MiniMaxCache()
    _, state = lightning_attention_forward(layer, hidden[:, :9], mask[:, :9])
    cache.set_linear_cache(1, state)
    rest, _ = layer(hidden[:, 9:], None, mask[:, 9:], past_key_values=cache)
    assert_close(rest, whole[:, 9:], NORMED_TOL, "positions after the state")


def test_traces_record_the_scan_from_a_zero_state_and_eager_calls_keep_hfs():
    layer = lightning_layer()
    hidden, mask = inputs()
    targets, _ = traced_targets(lambda h, m: layer(h, None, m)[0], hidden, mask)
    assert targets.count(SCAN) == 1
    with EagerOps() as ops:
        layer(hidden, None, mask)
    assert SCAN not in ops.seen


def test_a_call_from_a_cached_state_traces_hfs_recurrence():
    """A continuation from HF's cache is HF's per-position loop, not the scan
    from zero (which would drop the cached state)."""
    layer = lightning_layer()
    hidden, mask = inputs()
    cache = hf.MiniMaxCache()
    layer(hidden, None, mask, past_key_values=cache)
    targets, _ = traced_targets(lambda h, m: layer(h, None, m, past_key_values=cache)[0], hidden[:, :3], mask[:, :3])
    assert SCAN not in targets


@pytest.mark.slow
def test_state_at_minimax_text_01():
    """MiniMax-Text-01's published shapes (80 layers, seven lightning layers
    then one full attention layer, 64 heads of 128, 8 K/V heads, 32 experts),
    bf16, on the meta device: K and V of the 10 full layers per position;
    fixed, the 70 lightning layers' `[64, 128, 128]` float32 state."""
    config = transformers.MiniMaxConfig(
        hidden_size=6144, intermediate_size=9216, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        num_hidden_layers=80, layer_types=(["linear_attention"] * 7 + ["full_attention"]) * 10,
        num_local_experts=32, num_experts_per_tok=2, vocab_size=200064, block_size=256)
    report = explain_published(transformers.MiniMaxForCausalLM, config, 128, 64, experts="grouped_mm")
    full, linear = config.layer_types.count("full_attention"), config.layer_types.count("linear_attention")
    assert report.state_bytes_per_position == full * 2 * 8 * 128 * 2 == 40_960
    assert report.state_fixed_bytes == linear * 64 * 128 * 128 * 4 == 293_601_280
