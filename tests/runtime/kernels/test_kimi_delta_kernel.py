"""Kimi Delta Attention in PyTorch (`longstraw/runtime/kernels/kimi_delta.py`): the chunked
rule is the per-channel gated delta recurrence written out a position at a time (float64
outputs, final state and gradients, carried state, with and without the q/k L2 norm), any
split hands over the same state, and decays too strong to factor stay finite."""

from __future__ import annotations

import pytest
import torch

from longstraw.runtime.kernels import kimi_delta
from longstraw.runtime.kernels.kimi_delta import CHUNK, kimi_delta_rule_reference

from helpers.delta_rule import delta_rule_recurrence


def _inputs(length: int, dtype: torch.dtype = torch.float64, decay: float = 1.0) -> list[torch.Tensor]:
    """q, k, g [1, L, 2, 4] (g: per-channel log-decays in [-decay, 0]); v [1, L, 2, 3];
    beta [1, L, 2]; state [1, 2, 4, 3]."""
    gen = torch.Generator().manual_seed(length)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = rand(1, length, 2, 4), rand(1, length, 2, 4), rand(1, length, 2, 3)
    g = -decay * torch.rand(1, length, 2, 4, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, length, 2, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, g, beta, rand(1, 2, 4, 3))]


@pytest.mark.parametrize("length", [1, CHUNK, CHUNK + 6])
@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_the_chunked_rule_is_thedelta_rule_recurrence(length, use_qk_l2norm):
    q, k, v, g, beta, state = _inputs(length)
    out, final = kimi_delta_rule_reference(q, k, v, g, beta, state, use_qk_l2norm)
    want_out, want_final = delta_rule_recurrence(q, k, v, g, beta, state, use_qk_l2norm)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(final, want_final, rtol=1e-10, atol=1e-12)


def test_no_initial_state_starts_from_zeros():
    q, k, v, g, beta, state = _inputs(5)
    out, final = kimi_delta_rule_reference(q, k, v, g, beta, None)
    want_out, want_final = delta_rule_recurrence(q, k, v, g, beta, torch.zeros_like(state))
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(final, want_final, rtol=1e-10, atol=1e-12)


def test_gradients_are_the_recurrences(monkeypatch):
    """Chunks of 4 over 10 positions: every input's gradient (the per-channel
    decays' and the carried state's included) through outputs and final state."""
    monkeypatch.setattr(kimi_delta, "CHUNK", 4)
    inputs = [t.requires_grad_() for t in _inputs(10)]
    out, final = kimi_delta_rule_reference(*inputs)
    gen = torch.Generator().manual_seed(1)
    cotangents = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in (out, final)]
    got = torch.autograd.grad((out, final), inputs, cotangents)
    want = torch.autograd.grad(delta_rule_recurrence(*inputs), inputs, cotangents)
    for name, a, b in zip(["q", "k", "v", "g", "beta", "state"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=f"d{name}")


@pytest.mark.parametrize("cut", [3, CHUNK])
def test_any_split_hands_over_the_same_state(cut):
    inputs = _inputs(CHUNK + 9)
    out, final = kimi_delta_rule_reference(*inputs)
    head, carried = kimi_delta_rule_reference(*(t[:, :cut] for t in inputs[:5]), inputs[5])
    tail, after = kimi_delta_rule_reference(*(t[:, cut:] for t in inputs[:5]), carried)
    torch.testing.assert_close(torch.cat([head, tail], 1), out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(after, final, rtol=1e-10, atol=1e-12)


def test_strong_decays_stay_finite():
    """Log-decays down to -40 per position in float32: a chunk's cumulative decay
    falls far below e^-88, where the factored form exp(G_i) * exp(-G_j) would overflow."""
    inputs = _inputs(CHUNK, torch.float32, decay=40.0)
    out, final = kimi_delta_rule_reference(*inputs)
    assert out.isfinite().all() and final.isfinite().all()
    want_out, want_final = delta_rule_recurrence(*(t.double() for t in inputs))
    torch.testing.assert_close(out.double(), want_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final.double(), want_final, rtol=1e-4, atol=1e-5)


def test_no_positions_hand_the_state_through():
    inputs = _inputs(0)
    out, final = kimi_delta_rule_reference(*inputs)
    assert out.shape == (1, 0, 2, 3)
    assert torch.equal(final, inputs[5])


def test_low_precision_inputs_compute_in_float32():
    """bf16 inputs: bf16 outputs, a float32 state, within bf16's rounding of the float64 rule."""
    inputs = _inputs(CHUNK + 3, torch.bfloat16)
    out, final = kimi_delta_rule_reference(*inputs)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    want_out, want_final = delta_rule_recurrence(*(t.double() for t in inputs))
    torch.testing.assert_close(out.double(), want_out, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(final.double(), want_final, rtol=1e-5, atol=1e-5)


def test_the_counted_arithmetic_is_the_rules_products_over_whole_chunks():
    """`kimi_delta_flops` is what the rule's products count over positions
    that fill whole chunks (PyTorch's FLOP formulas, and C^2 Dv for the
    triangular solve, which has none); a span that does not fill its last
    chunk counts its positions."""
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v, g, beta, state = _inputs(2 * CHUNK)
    with FlopCounterMode(display=False) as counter:
        kimi_delta_rule_reference(q, k, v, g, beta, state, True)
    heads, chunks, dim_v = 2, 2, 3
    whole = counter.get_total_flops() + heads * chunks * CHUNK * CHUNK * dim_v
    assert kimi_delta.kimi_delta_flops(q, k, v, g, beta) == whole
    partial = kimi_delta.kimi_delta_flops(*(x[:, :CHUNK + 6] for x in (q, k, v, g, beta)))
    assert partial == pytest.approx(whole * (CHUNK + 6) / (2 * CHUNK))
