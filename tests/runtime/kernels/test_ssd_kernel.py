"""Mamba-2's chunked scan (`longstraw/runtime/kernels/ssd.py`) is the recurrence
h_t = exp(dA_t) h_{t-1} + x_t B_t^T, y_t = h_t C_t written out a position at a time
(float64, outputs, final state and gradients, across chunk boundaries, from a carried
state or from zeros), any split hands over the same state, and it computes in `scan_dtype`."""

from __future__ import annotations

import pytest
import torch

from longstraw.runtime.kernels import ssd
from longstraw.runtime.kernels.ssd import CHUNK, scan_dtype, ssd_scan_reference


def _inputs(length: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> list[torch.Tensor]:
    """x [b, L, h, p], dA [b, L, h] (at most 0), B, C [b, L, h, n], state [b, h, p, n]."""
    gen = torch.Generator().manual_seed(seed)
    b, h, p, n = 2, 2, 3, 4
    x = torch.randn(b, length, h, p, generator=gen, dtype=torch.float64)
    dA = -torch.rand(b, length, h, generator=gen, dtype=torch.float64)
    B, C = (torch.randn(b, length, h, n, generator=gen, dtype=torch.float64) for _ in range(2))
    state = torch.randn(b, h, p, n, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (x, dA, B, C, state)]


def _recurrence(x, dA, B, C, state):
    """The scan one position at a time."""
    ys = []
    for t in range(x.shape[1]):
        state = state * dA[:, t].exp()[..., None, None] + x[:, t, :, :, None] * B[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    return torch.stack(ys, dim=1), state


@pytest.mark.parametrize("length", [1, CHUNK, CHUNK + 5])
def test_the_chunked_scan_is_the_recurrence(length):
    x, dA, B, C, state = _inputs(length)
    y, final = ssd_scan_reference(x, dA, B, C, state)
    want_y, want_final = _recurrence(x, dA, B, C, state)
    torch.testing.assert_close(y, want_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, want_final, rtol=1e-12, atol=1e-12)


def test_no_initial_state_starts_from_zeros():
    x, dA, B, C, state = _inputs(7)
    y, final = ssd_scan_reference(x, dA, B, C, None)
    want_y, want_final = _recurrence(x, dA, B, C, torch.zeros_like(state))
    torch.testing.assert_close(y, want_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, want_final, rtol=1e-12, atol=1e-12)


def test_gradients_are_the_recurrences(monkeypatch):
    """Chunks of 4 over 11 positions: every input's gradient, the carried state's
    included, through outputs and final state both."""
    monkeypatch.setattr(ssd, "CHUNK", 4)
    inputs = [t.requires_grad_() for t in _inputs(11)]
    gen = torch.Generator().manual_seed(1)
    y, final = ssd_scan_reference(*inputs)
    cotangents = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in (y, final)]
    got = torch.autograd.grad((y, final), inputs, cotangents)
    want = torch.autograd.grad(_recurrence(*inputs), inputs, cotangents)
    for name, g, w in zip(["x", "dA", "B", "C", "state"], got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=f"d{name}")


@pytest.mark.parametrize("cut", [1, 37, CHUNK])
def test_any_split_hands_over_the_same_state(cut):
    x, dA, B, C, state = _inputs(CHUNK + 9)
    y, final = ssd_scan_reference(x, dA, B, C, state)
    head, carried = ssd_scan_reference(*(t[:, :cut] for t in (x, dA, B, C)), state)
    tail, after = ssd_scan_reference(*(t[:, cut:] for t in (x, dA, B, C)), carried)
    torch.testing.assert_close(torch.cat([head, tail], dim=1), y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(after, final, rtol=1e-12, atol=1e-12)


def test_no_positions_hand_the_state_through():
    x, dA, B, C, state = _inputs(0)
    y, final = ssd_scan_reference(x, dA, B, C, state)
    assert y.shape == (2, 0, 2, 3)
    assert torch.equal(final, state)


def test_low_precision_inputs_scan_in_float32():
    """bf16 inputs: float32 outputs and state (what HF's scans compute in), within
    float32's rounding of the float64 scan of the same bf16 values."""
    inputs = _inputs(CHUNK + 3, torch.bfloat16)
    y, final = ssd_scan_reference(*inputs)
    assert scan_dtype(inputs[0]) == torch.float32 and y.dtype == final.dtype == torch.float32
    want_y, want_final = _recurrence(*(t.double() for t in inputs))
    torch.testing.assert_close(y.double(), want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final.double(), want_final, rtol=1e-5, atol=1e-5)


def test_the_scan_dtype_is_float32_or_wider():
    dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
    assert [scan_dtype(torch.zeros(1, dtype=d)) for d in dtypes] == [torch.float32] * 3 + [torch.float64]


def test_the_counted_arithmetic_is_the_scans_products_over_whole_chunks():
    """`ssd_flops` is what the scan's products count over positions that
    fill whole chunks (PyTorch's FLOP formulas); a span that does not fill
    its last chunk counts its positions."""
    from torch.utils.flop_counter import FlopCounterMode

    x, dA, B, C, state = _inputs(2 * CHUNK)
    with FlopCounterMode(display=False) as counter:
        ssd_scan_reference(x, dA, B, C, state)
    assert ssd.ssd_flops(x, dA, B, C) == counter.get_total_flops()
    partial = ssd.ssd_flops(*(t[:, :CHUNK + 6] for t in (x, dA, B, C)))
    assert partial == pytest.approx(counter.get_total_flops() * (CHUNK + 6) / (2 * CHUNK))
