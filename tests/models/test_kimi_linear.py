"""Kimi Linear (`longstraw.models.kimi_linear`): the drop-in for HF's
`chunk_kimi_delta_attention` is HF's rule, its final state only when asked
for, and refuses packed sequences; with longstraw imported Dynamo traces
`longstraw::kimi_delta_rule` and `longstraw::causal_conv1d` in place of the
modeling module's two functions, and eager calls keep HF's. The rule's
kernel is `tests/passes/test_kimi_delta.py`'s, float64 parity of the family
against eager `tests/models/test_families.py`'s."""

from __future__ import annotations

import pytest
import torch
from transformers.models.kimi_linear import modeling_kimi_linear as hf

import longstraw  # noqa: F401 - installs the trace bindings
from longstraw.models.kimi_linear import chunk_kimi_delta_attention

from helpers.compare import assert_close
from helpers.traced_ops import EagerOps, traced_targets

HF_FLOAT32 = 2e-6  # transformers computes the rule in float32 whatever the inputs
RULE, CONV = "longstraw.kimi_delta_rule.default", "longstraw.causal_conv1d.default"


def rule_inputs(length: int = 20) -> list[torch.Tensor]:
    """q, k [B, L, H, Dk], v [B, L, H, Dv], g (a log decay per key channel) [B, L, H, Dk], beta [B, L, H]; and
    an initial state [B, H, Dk, Dv]; float64."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, length, 2, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, length, 2, 3, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, length, 2, 4, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, length, 2, generator=gen, dtype=torch.float64)
    return [q, k, v, g, beta, torch.randn(1, 2, 4, 3, generator=gen, dtype=torch.float64)]


@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_the_drop_in_is_hfs_rule_from_an_initial_state(use_qk_l2norm):
    *qkvgb, initial = rule_inputs()
    kwargs = dict(initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm)
    out, state = chunk_kimi_delta_attention(*qkvgb, chunk_size=64, cu_seqlens=None, **kwargs)
    want, want_state = hf.chunk_kimi_delta_attention(*qkvgb, **kwargs)
    assert_close(out, want, HF_FLOAT32, "output")
    assert_close(state, want_state, HF_FLOAT32, "final state")


def test_the_final_state_is_returned_only_when_asked_for():
    *qkvgb, _ = rule_inputs()
    out, state = chunk_kimi_delta_attention(*qkvgb)
    with_state, _ = chunk_kimi_delta_attention(*qkvgb, output_final_state=True)
    assert state is None and torch.equal(out, with_state)


def test_packed_sequences_are_refused():
    *qkvgb, _ = rule_inputs()
    with pytest.raises(NotImplementedError, match=r"does not support packed sequences \(cu_seqlens\)"):
        chunk_kimi_delta_attention(*qkvgb, cu_seqlens=torch.tensor([0, 8, 20]))


def test_traces_record_the_operators_and_eager_calls_keep_hfs_functions():
    *qkvgb, initial = rule_inputs()
    x, weight = torch.randn(1, 6, 5, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    rule = lambda *a: hf.chunk_kimi_delta_attention(*a, initial_state=initial, output_final_state=True)  # noqa: E731
    conv = lambda x, w: hf.causal_conv1d_fn(x, weight=w, bias=None, activation="silu")  # noqa: E731
    assert traced_targets(rule, *qkvgb)[0].count(RULE) == 1
    assert traced_targets(conv, x, weight)[0] == [CONV]
    with EagerOps() as ops:
        rule(*qkvgb)
        conv(x, weight)
    assert not {RULE, CONV} & ops.seen
