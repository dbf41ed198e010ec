"""gpt-oss and MiMo-V2-Flash (`longstraw.models.sinks`): the drop-in for HF's
eager sink attention gives HF's output in HF's layout, no attention
weights, the module's sinks where it has them and none where it has not;
with longstraw imported Dynamo traces `longstraw::sink_attention` in place
of both modeling modules' `eager_attention_forward`, and eager calls keep
HF's. The operator and its passes are `tests/passes/test_sinks.py`'s."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.mimo_v2_flash import modeling_mimo_v2_flash

import longstraw  # noqa: F401 - installs the trace bindings
from longstraw.models.sinks import eager_attention_forward

from helpers.traced_ops import EagerOps, traced_targets

SINK = "longstraw.sink_attention.default"
SCALING = 0.3  # not 1 / sqrt(d): the drop-in must pass HF's own


def attention_inputs(heads: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    """q [B, Hq, L, D], k [B, Hkv, L, D], v [B, Hkv, L, Dv], HF's eager causal mask [B, 1, L, L] and
    sinks [Hq], in float64."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, 5, 4, generator=gen, dtype=torch.float64)
    k = torch.randn(2, kv_heads, 5, 4, generator=gen, dtype=torch.float64)
    v = torch.randn(2, kv_heads, 5, 3, generator=gen, dtype=torch.float64)
    allowed = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 1, 5, 5)
    mask = torch.where(allowed, torch.zeros((), dtype=torch.float64), torch.finfo(torch.float64).min)
    return q, k, v, mask, torch.randn(heads, generator=gen, dtype=torch.float64)


def hf_module(heads: int, kv_heads: int, sinks: torch.Tensor | None) -> types.SimpleNamespace:
    """What HF's eager attention reads of its attention module."""
    return types.SimpleNamespace(num_key_value_groups=heads // kv_heads, training=False, sinks=sinks)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_the_drop_in_is_gpt_oss_eager_attention_in_hfs_layout(heads, kv_heads):
    q, k, v, mask, sinks = attention_inputs(heads, kv_heads)
    want, weights = modeling_gpt_oss.eager_attention_forward(hf_module(heads, kv_heads, sinks), q, k, v, mask, SCALING)
    out, no_weights = eager_attention_forward(hf_module(heads, kv_heads, sinks), q, k, v, mask, SCALING)
    assert weights is not None and no_weights is None
    assert out.shape == (2, 5, heads, 3) and out.is_contiguous()
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def test_a_module_without_sinks_is_mimo_full_attention():
    """MiMo-V2-Flash's full layers have `sinks = None`; a module without the
    attribute attends the same way."""
    q, k, v, mask, _ = attention_inputs(4, 2)
    want, _ = modeling_mimo_v2_flash.eager_attention_forward(hf_module(4, 2, None), q, k, v, mask, SCALING)
    no_attribute = types.SimpleNamespace(num_key_value_groups=2, training=False)
    for module in (hf_module(4, 2, None), no_attribute):
        out, _ = eager_attention_forward(module, q, k, v, mask, SCALING)
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("modeling", [modeling_gpt_oss, modeling_mimo_v2_flash],
                         ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_traces_record_the_operator_and_eager_calls_keep_hfs_attention(modeling):
    q, k, v, mask, sinks = attention_inputs(6, 2)
    module = hf_module(6, 2, sinks)
    attend = lambda q, k, v, mask: modeling.eager_attention_forward(module, q, k, v, mask, SCALING)[0]  # noqa: E731
    assert traced_targets(attend, q, k, v, mask)[0].count(SINK) == 1
    with EagerOps() as ops:
        attend(q, k, v, mask)
    assert SINK not in ops.seen and "aten.cat.default" in ops.seen  # HF's sink column
