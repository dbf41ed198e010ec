"""Gated DeltaNet's backward through fla (`longstraw.runtime.kernels.fla_gated_delta`):
GPU only (fla's kernels are Triton). Its gradients are checked against
autograd through the PyTorch kernel in float64 on the same 16-bit inputs,
next to fla's own forward error on them; end to end, the hybrid's
gradients with fla's backward equal those with the PyTorch kernel's."""

from __future__ import annotations

import pytest
import torch

from longstraw.passes import gated_delta
from longstraw.runtime import carry
from longstraw.runtime.kernels import fla_gated_delta
from longstraw.runtime.kernels.gated_delta import gated_delta_rule_reference

from helpers.fused_kernels import assert_fused_as_accurate, relative_error

pytestmark = pytest.mark.gpu


def _need_fla():
    if fla_gated_delta.fla_ops() is None:
        pytest.fail("flash-linear-attention is not installed: these tests check its kernels")


@pytest.mark.parametrize("shape", [(2, 1000, 4, 8, 64), (1, 4096, 16, 48, 128), (3, 64, 2, 2, 32)],
                         ids=["gqa-unaligned", "qwen3.5-27b-heads", "one-chunk"])
@pytest.mark.parametrize("l2norm", [True, False])
def test_grads_match_autograd_through_the_reference(shape, l2norm):
    _need_fla()
    B, L, Hk, Hv, D = shape
    gen = torch.Generator().manual_seed(L)
    bf16 = lambda *s: torch.randn(*s, generator=gen).cuda().bfloat16()  # noqa: E731
    q, k, v = bf16(B, L, Hk, D), bf16(B, L, Hk, D), bf16(B, L, Hv, D)
    if not l2norm:
        q, k = q / D**0.5, k / D**0.5  # keep the unnormalised rule stable
    g = (-torch.rand(B, L, Hv, generator=gen) * 0.2).cuda()
    beta = torch.rand(B, L, Hv, generator=gen).cuda().bfloat16()
    state = torch.randn(B, Hv, D, D, generator=gen).cuda()
    grad_out, grad_state = bf16(B, L, Hv, D), torch.randn(B, Hv, D, D, generator=gen).cuda()

    inputs = [x.double().requires_grad_() for x in (state, q, k, v, g, beta)]
    out, final = gated_delta_rule_reference(*inputs[1:], inputs[0], l2norm)
    want = torch.autograd.grad([out, final], inputs, [grad_out.double(), grad_state.double()])
    fla_out, fla_final = fla_gated_delta.gated_delta_forward(q, k, v, g, beta, state, l2norm)
    forward_error = max(relative_error(fla_out, out), relative_error(fla_final, final))
    got = fla_gated_delta.gated_delta_grads(state, q, k, v, g, beta, grad_out, grad_state, use_qk_l2norm=l2norm)
    for name, x, a, b in zip(["state", "q", "k", "v", "g", "beta"], (state, q, k, v, g, beta), got, want):
        assert a.dtype == x.dtype and a.shape == b.shape, name
        err = relative_error(a, b)
        assert err < max(3e-2, 10 * forward_error), f"d{name}: relative error {err:.2e} (forward {forward_error:.2e})"


@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_hybrid_with_fla_backward_is_as_accurate_as_the_pytorch_backward(mode, monkeypatch):
    """bf16 on CUDA, the same compiled loss with fla's backward and with
    autograd through the PyTorch kernel (the forwards are fla's in both),
    each against the float64 eager gradients of the same weights: fla's
    error is at most twice the PyTorch kernel's. Spans of 64 inside a step."""
    _need_fla()
    monkeypatch.setattr(gated_delta, "FLA_SPAN", 64)
    grads = fla_gated_delta.gated_delta_grads

    def setup(fused):
        if not fused:
            monkeypatch.setattr(gated_delta, "CarryKernel", lambda **k: carry.CarryKernel(**{**k, "grads": None}))
        calls = []
        monkeypatch.setattr(fla_gated_delta, "gated_delta_grads", lambda *a, **k: (calls.append(1), grads(*a, **k))[1])
        return {}, lambda: bool(calls)

    assert_fused_as_accurate(mode, setup)
