"""LFM2 and LFM2-MoE (`longstraw.models.lfm2`): with longstraw imported, Dynamo
traces `longstraw::causal_conv1d` in place of both modeling modules'
`causal_conv1d_fn`, a short-convolution layer records that one operator
and computes what HF's does, and eager calls keep HF's convolution. Float64
parity of both families against eager is `tests/models/test_families.py`'s."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.lfm2 import modeling_lfm2
from transformers.models.lfm2_moe import modeling_lfm2_moe

import longstraw  # noqa: F401 - installs the trace bindings

from helpers.traced_ops import EagerOps, traced_targets

CONV = "longstraw.causal_conv1d.default"
MODULES = [modeling_lfm2, modeling_lfm2_moe]


def conv_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, C, L], weight [C, K], bias [C] in float64."""
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in ((2, 4, 7), (4, 3), (4,)))


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_traces_record_the_operator_and_eager_calls_keep_hfs_convolution(module):
    x, weight, bias = conv_inputs()
    targets, traced = traced_targets(lambda x, w, b: module.causal_conv1d_fn(x, w, b), x, weight, bias)
    assert targets == [CONV]
    with EagerOps() as ops:
        eager = module.causal_conv1d_fn(x, weight, bias)
    assert CONV not in ops.seen and "aten.convolution.default" in ops.seen
    torch.testing.assert_close(traced, eager, rtol=1e-13, atol=1e-13)


def test_a_short_convolution_layer_records_one_operator_and_matches_eager():
    """HF's `Lfm2ShortConv` (gates around a kernel-3 convolution) traced
    whole: one `longstraw::causal_conv1d`, no padded `conv1d`, HF's values."""
    config = transformers.Lfm2Config(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=1, conv_L_cache=3, layer_types=["conv", "full_attention"])
    torch.manual_seed(0)
    layer = modeling_lfm2.Lfm2ShortConv(config, layer_idx=0).double()
    hidden = torch.randn(2, 5, 8, dtype=torch.float64)
    targets, traced = traced_targets(layer, hidden)
    assert targets.count(CONV) == 1 and not any("conv1d" in t and t != CONV for t in targets)
    torch.testing.assert_close(traced, layer(hidden), rtol=1e-13, atol=1e-13)
