"""The short causal convolution through fla (`longstraw.runtime.kernels.fla_causal_conv`):
GPU only (fla's kernels are Triton). Forward, carry and gradients are
checked against the PyTorch kernel in float64 on the same 16-bit inputs;
end to end, the hybrid's gradients with fla's convolution are as accurate
as with the PyTorch kernel, against float64 eager."""

from __future__ import annotations

import pytest
import torch

from longstraw.passes import causal_conv
from longstraw.runtime.kernels import KernelPolicy, fla_causal_conv

from helpers.fused_kernels import assert_fused_as_accurate, relative_error

pytestmark = pytest.mark.gpu


def _need_fla():
    if fla_causal_conv.fla_ops() is None:
        pytest.fail("flash-linear-attention is not installed: these tests check its kernels")


@pytest.mark.parametrize("shape", [(1, 8192, 10240, 4), (2, 100, 10240, 4), (1, 5, 10240, 4)],
                         ids=["qwen3.5-27b-chunk", "batch-unaligned", "shortest"])
@pytest.mark.parametrize("activation, bias", [("silu", False), (None, True)])
def test_forward_and_grads_match_the_reference(shape, activation, bias):
    """x is a transposed [B, L, C] tensor, as in Qwen3.5; every output and
    gradient (carry included) within bf16 rounding of float64. One channel
    count (Qwen3.5-27B's): Triton compiles every autotuned configuration anew for each."""
    _need_fla()
    B, L, C, K = shape
    gen = torch.Generator().manual_seed(L)
    bf16 = lambda *s: torch.randn(*s, generator=gen).cuda().bfloat16()  # noqa: E731
    x = bf16(B, L, C).transpose(1, 2)
    weight, b = bf16(C, K) / 2, (bf16(C) if bias else None)
    tail, grad_out, grad_tail = bf16(B, C, K - 1), bf16(B, C, L), bf16(B, C, K - 1)
    assert fla_causal_conv.applies(x, weight, b, activation)

    inputs = [None if t is None else t.double().requires_grad_() for t in (tail, x, weight, b)]
    out, new_tail = causal_conv.causal_conv1d_reference(inputs[1], inputs[2], inputs[3], activation, inputs[0])
    wanted = [t for t in inputs if t is not None]
    want = torch.autograd.grad([out, new_tail], wanted, [grad_out.double(), grad_tail.double()])
    got_out, got_tail = fla_causal_conv.causal_conv_forward(tail, x, weight, b, activation)
    assert got_out.shape == out.shape and relative_error(got_out, out) < 1e-2
    assert torch.equal(got_tail, x[..., L - (K - 1):])  # the carry is the inputs themselves
    got = [g for g in fla_causal_conv.causal_conv_grads(tail, x, weight, b, grad_out, grad_tail, activation) if g is not None]
    for name, a, w in zip(["tail", "x", "weight", "bias"], got, want):
        assert a.shape == w.shape, name
        assert relative_error(a, w) < 2e-2, f"d{name}: relative error {relative_error(a, w):.2e}"


def test_not_on_fake_tensors_or_when_disabled():
    _need_fla()
    x, weight = torch.randn(1, 8, 16, device="cuda", dtype=torch.bfloat16), torch.randn(8, 4, device="cuda", dtype=torch.bfloat16)
    assert fla_causal_conv.applies(x, weight, None, "silu")
    with KernelPolicy(causal_conv="torch").active():
        assert not fla_causal_conv.applies(x, weight, None, "silu")
    with torch._subclasses.fake_tensor.FakeTensorMode():
        assert not fla_causal_conv.applies(torch.empty(1, 8, 16, device="cuda", dtype=torch.bfloat16),
                                           torch.empty(8, 4, device="cuda", dtype=torch.bfloat16), None, "silu")


@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_hybrid_with_fla_convolution_is_as_accurate_as_the_pytorch_kernel(mode, monkeypatch):
    """bf16 on CUDA, the same compiled loss with fla's convolution and with
    the PyTorch kernel, each against float64 eager gradients of the same
    weights: fla's error is at most twice the PyTorch kernel's."""
    _need_fla()
    grads = fla_causal_conv.causal_conv_grads

    def setup(fused):
        calls = []
        monkeypatch.setattr(fla_causal_conv, "causal_conv_grads", lambda *a, **k: (calls.append(1), grads(*a, **k))[1])
        return {"kernels": {"causal_conv": "auto" if fused else "torch"}}, lambda: bool(calls)

    assert_fused_as_accurate(mode, setup)
