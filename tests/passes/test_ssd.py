"""Mamba-2's scan (longstraw/runtime/kernels/ssd.py, passes/ssd.py): the chunked
kernel is the recurrence, any split of the positions gives the same
outputs from the state it hands over, and the registered operator's
gradients are the recurrence's."""

from __future__ import annotations

import torch

from longstraw.passes.ssd import ssd_scan
from longstraw.runtime.kernels.ssd import CHUNK, ssd_scan_reference


def inputs(length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    b, h, p, n = 2, 3, 4, 5
    x = torch.randn(b, length, h, p, generator=gen)
    dA = -torch.rand(b, length, h, generator=gen)  # A dt, at most 0
    B, C = (torch.randn(b, length, h, n, generator=gen) for _ in range(2))
    state = torch.randn(b, h, p, n, generator=gen)
    return x, dA, B, C, state


def recurrence(x, dA, B, C, state):
    """h_t = exp(dA_t) h_{t-1} + x_t B_t^T, y_t = h_t C_t, position by position, in float64."""
    x, dA, B, C, state = (t.double() for t in (x, dA, B, C, state))
    ys = []
    for t in range(x.shape[1]):
        state = state * dA[:, t].exp()[..., None, None] + x[:, t, :, :, None] * B[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    return torch.stack(ys, dim=1), state


def test_the_chunked_scan_is_the_recurrence():
    x, dA, B, C, state = inputs(2 * CHUNK + 7)  # two whole chunks and a short one
    y, final = ssd_scan_reference(x, dA, B, C, state)
    want_y, want_final = recurrence(x, dA, B, C, state)
    torch.testing.assert_close(y.double(), want_y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final.double(), want_final, rtol=1e-4, atol=1e-4)


def test_a_split_hands_its_state_over():
    x, dA, B, C, state = inputs(150)
    y, final = ssd_scan_reference(x, dA, B, C, state)
    head, carried = ssd_scan_reference(*(t[:, :37] for t in (x, dA, B, C)), state)
    tail, after = ssd_scan_reference(*(t[:, 37:] for t in (x, dA, B, C)), carried)
    torch.testing.assert_close(torch.cat([head, tail], dim=1), y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after, final, rtol=1e-5, atol=1e-5)


def test_the_operator_differentiates_as_the_recurrence():
    x, dA, B, C, state = (t.double().requires_grad_() for t in inputs(70))
    y, final = ssd_scan(x, dA, B, C, state)
    got = torch.autograd.grad((y.sum(), final.square().sum()), (x, dA, B, C, state))
    want_y, want_final = recurrence(x, dA, B, C, state)
    want = torch.autograd.grad((want_y.sum(), want_final.square().sum()), (x, dA, B, C, state))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-3)
