"""Gated DeltaNet in PyTorch (`longstraw/runtime/kernels/gated_delta.py`): the chunked
rule is the gated delta recurrence written out a position at a time (float64 outputs,
final state and gradients, grouped value heads, carried state, with and without the
q/k L2 norm), the chunk scan's hand-written backward passes gradcheck, and shape-only
tensors run without values."""

from __future__ import annotations

import pytest
import torch

from longstraw.runtime.kernels import gated_delta
from longstraw.runtime.kernels.gated_delta import CHUNK, _ChunkScan, gated_delta_rule_reference

from helpers.delta_rule import delta_rule_recurrence


def _inputs(length: int, heads_k: int = 1, heads_v: int = 2, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    """q, k [1, L, Hk, 4]; v [1, L, Hv, 3]; g [1, L, Hv] (log-decays, at most 0);
    beta [1, L, Hv] in (0, 1); state [1, Hv, 4, 3]."""
    gen = torch.Generator().manual_seed(length)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = rand(1, length, heads_k, 4), rand(1, length, heads_k, 4), rand(1, length, heads_v, 3)
    g = -torch.rand(1, length, heads_v, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, length, heads_v, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, g, beta, rand(1, heads_v, 4, 3))]


@pytest.mark.parametrize("length", [1, CHUNK, CHUNK + 6])
@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_the_chunked_rule_is_thedelta_rule_recurrence(length, use_qk_l2norm):
    q, k, v, g, beta, state = _inputs(length)
    out, final = gated_delta_rule_reference(q, k, v, g, beta, state, use_qk_l2norm)
    want_out, want_final = delta_rule_recurrence(q, k, v, g, beta, state, use_qk_l2norm)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(final, want_final, rtol=1e-10, atol=1e-12)


def test_no_initial_state_starts_from_zeros():
    q, k, v, g, beta, state = _inputs(5, heads_k=2, heads_v=2)
    out, final = gated_delta_rule_reference(q, k, v, g, beta, None)
    want_out, want_final = delta_rule_recurrence(q, k, v, g, beta, torch.zeros_like(state))
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(final, want_final, rtol=1e-10, atol=1e-12)


def test_gradients_are_the_recurrences(monkeypatch):
    """Chunks of 4 over 10 positions (two whole chunks and a padded one):
    every input's gradient through the outputs and the final state."""
    monkeypatch.setattr(gated_delta, "CHUNK", 4)
    inputs = [t.requires_grad_() for t in _inputs(10)]
    out, final = gated_delta_rule_reference(*inputs)
    gen = torch.Generator().manual_seed(1)
    cotangents = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in (out, final)]
    got = torch.autograd.grad((out, final), inputs, cotangents)
    want = torch.autograd.grad(delta_rule_recurrence(*inputs), inputs, cotangents)
    for name, a, b in zip(["q", "k", "v", "g", "beta", "state"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=f"d{name}")


def test_the_chunk_scans_backward_passes_gradcheck():
    """The hand-written backward of the sequential part, on three chunks of
    three positions, through its output and its final state."""
    gen = torch.Generator().manual_seed(2)
    rows, chunks, c, dk, dv = 2, 3, 3, 2, 2
    shapes = [(rows, chunks, c, dv), (rows, chunks, c, dk), (rows, chunks, c, dk), (rows, chunks, c, c),
              (rows, chunks, c, dk), (rows, chunks), (rows, dk, dv)]
    inputs = [torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_() for s in shapes]
    assert torch.autograd.gradcheck(_ChunkScan.apply, inputs)


def test_low_precision_inputs_compute_in_float32():
    """bf16 inputs: bf16 outputs, a float32 state, within bf16's rounding of the float64 rule."""
    inputs = _inputs(CHUNK + 3, heads_k=1, heads_v=2, dtype=torch.bfloat16)
    out, final = gated_delta_rule_reference(*inputs)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    want_out, want_final = delta_rule_recurrence(*(t.double() for t in inputs))
    torch.testing.assert_close(out.double(), want_out, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(final.double(), want_final, rtol=1e-5, atol=1e-5)


def test_shape_only_tensors_run_forward_and_backward():
    """Meta tensors (the planner's shape-only runs) take the same path and give the shapes."""
    inputs = [torch.empty(t.shape, device="meta", requires_grad=True) for t in _inputs(CHUNK + 6, heads_k=1, heads_v=2)]
    out, final = gated_delta_rule_reference(*inputs)
    assert out.shape == (1, CHUNK + 6, 2, 3) and final.shape == (1, 2, 4, 3)
    grads = torch.autograd.grad((out.sum(), final.sum()), inputs)
    assert [g.shape for g in grads] == [t.shape for t in inputs]


def test_the_counted_arithmetic_is_the_rules_products_over_whole_chunks():
    """`gated_delta_flops` is what the rule's matrix products count over
    positions that fill whole chunks (PyTorch's FLOP formulas for its
    batched products, and C^2 D for each triangular solve, which has none):
    the count a work recorder takes in place of the padded blocks."""
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v, g, beta, state = _inputs(2 * CHUNK, heads_k=1, heads_v=2)
    with FlopCounterMode(display=False) as counter:
        gated_delta_rule_reference(q, k, v, g, beta, state, True)
    rows, chunks, dim_k, dim_v = 2, 2, 4, 3
    solves = rows * chunks * CHUNK * CHUNK * (dim_k + dim_v)
    assert gated_delta.gated_delta_flops(q, k, v, g, beta) == counter.get_total_flops() + solves
    # a span that does not fill its last chunk counts its positions, not the padded chunk
    assert gated_delta.gated_delta_flops(*(x[:, :CHUNK + 6] for x in (q, k, v, g, beta))) == pytest.approx(
        counter.get_total_flops() / 2 * (CHUNK + 6) / CHUNK + solves / 2 * (CHUNK + 6) / CHUNK)
