"""`longstraw::logprobs_and_entropy`: the scorer's per-token log-probs and
entropies as one operator, against the PyTorch ops it replaces (float64),
and its fused CUDA kernel against its PyTorch path."""

from __future__ import annotations

import pytest
import torch

from longstraw.runtime.kernels import logprobs as kernel
from longstraw.runtime.kernels.logprobs import logprobs_and_entropy


def _eager(logits, index, mask, temperature, dtype=torch.float32):
    """What the scorer computed before the operator: log_softmax, gather, -(p log p).sum, zero on padding."""
    logp_all = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)
    logps = logp_all.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return torch.where(mask, logps, 0.0), torch.where(mask, entropy, 0.0)


def _inputs(dtype=torch.float64, device="cpu", rows=(3, 5), vocab=37, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(*rows, vocab, generator=gen, dtype=torch.float64)).to(dtype=dtype, device=device)
    index = torch.randint(0, vocab, rows, generator=gen).to(device)
    mask = (torch.rand(rows, generator=gen) > 0.3).to(device)
    return logits, index, mask


def _grads(fn, logits, index, mask, temperature, which=(0, 1), seed=1):
    leaf = logits.detach().requires_grad_(True)
    outs = fn(leaf, index, mask, temperature)
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o) for o in outs]
    loss = sum((outs[i] * weights[i]).sum() for i in which)
    loss.backward()
    return [o.detach() for o in outs], leaf.grad


@pytest.mark.parametrize("which", [(0, 1), (0,)], ids=["both", "logps-only"])
@pytest.mark.parametrize("block_elements", [1 << 26, 2 * 37], ids=["one-block", "blocks-of-two-rows"])
def test_matches_the_pytorch_ops(which, block_elements, monkeypatch):
    """Computed in float64: outputs and d(logits) equal log_softmax/gather/
    entropy's under autograd to float64's rounding, at a temperature, with
    padding, one block or many, and with the entropy unused (its gradient None)."""
    monkeypatch.setattr(kernel, "_ROWS_PER_BLOCK_ELEMENTS", block_elements)
    monkeypatch.setattr(kernel, "_COMPUTE_DTYPE", torch.float64)
    logits, index, mask = _inputs()
    got, got_grad = _grads(logprobs_and_entropy, logits, index, mask, 0.7, which)
    want, want_grad = _grads(lambda *a: _eager(*a, dtype=torch.float64), logits, index, mask, 0.7, which)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)


def test_computes_in_float32_as_trl():
    """Float64 logits: float32 results (TRL's losses read float32), within
    float32's rounding of the PyTorch ops (the entropy as log Z - E[z], the
    fused kernel's form); d(logits) in the logits' dtype."""
    logits, index, mask = _inputs()
    got, got_grad = _grads(logprobs_and_entropy, logits, index, mask, 0.7)
    want, want_grad = _grads(_eager, logits, index, mask, 0.7)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=1e-4, atol=2e-5)
    assert got_grad.dtype == torch.float64
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-5)


def test_padding_gets_zeros_whatever_its_logits_hold():
    """A padded position's logits may be anything (NaN-filled memory): its
    outputs and its gradient are zero, the other rows' untouched."""
    logits, index, mask = _inputs()
    dirty = logits.clone()
    dirty[~mask] = float("nan")
    got, got_grad = _grads(logprobs_and_entropy, dirty, index, mask, 1.0)
    want, want_grad = _grads(logprobs_and_entropy, logits, index, mask, 1.0)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.equal(got_grad[~mask], torch.zeros_like(got_grad[~mask]))
    assert torch.equal(got_grad[mask], want_grad[mask])


def test_low_precision_logits_compute_in_float32():
    """bf16 logits (the CPU's PyTorch path): float32 results, as TRL's; d(logits) in bf16."""
    logits, index, mask = _inputs(torch.bfloat16)
    got, got_grad = _grads(logprobs_and_entropy, logits, index, mask, 1.0)
    want, _ = _grads(_eager, logits, index, mask, 1.0)
    assert got[0].dtype == torch.float32 and got_grad.dtype == torch.bfloat16
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=2e-5)


def test_the_operator_registration_is_consistent():
    """Fake tensors, autograd and the schema agree (`torch.library.opcheck`)."""
    logits, index, mask = _inputs()
    torch.library.opcheck(torch.ops.longstraw.logprobs_and_entropy.default,
                          (logits.requires_grad_(True), index, mask, 0.7))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_fused_kernel_matches_the_pytorch_path(dtype, monkeypatch):
    """On CUDA the fused kernel (TRL's Triton kernel) gives the PyTorch
    path's log-probs, entropies and d(logits), at a vocabulary wider than
    one of its blocks, with padding and a temperature."""
    pytest.importorskip("triton")
    if kernel._triton_kernel() is None:
        pytest.skip("trl.kernels.selective_log_softmax_and_entropy is not installed")
    logits, index, mask = _inputs(dtype, "cuda", rows=(4, 33), vocab=5000)
    fused, fused_grad = _grads(logprobs_and_entropy, logits, index, mask, 0.9)
    monkeypatch.setattr(kernel, "_fused", lambda logits: None)
    plain, plain_grad = _grads(logprobs_and_entropy, logits, index, mask, 0.9)
    for f, p in zip(fused, plain):
        torch.testing.assert_close(f, p, rtol=1e-4, atol=1e-4)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(fused_grad.float(), plain_grad.float(), rtol=tol, atol=tol)
