"""`CarryStep.backward` differentiates a long step span by span from the
carry (`RECOMPUTE_SPAN`): the same gradients as one recomputation over the
whole step, for both carried operators, and end to end on the hybrid."""

from __future__ import annotations

import types

import pytest
import torch
import transformers

import longstraw
from longstraw.models import qwen3_5
from longstraw.parallel.ranks import SimulatedRanks
from longstraw.passes.causal_conv import causal_conv1d_reference
from longstraw.runtime import carry
from longstraw.runtime.kernels.gated_delta import gated_delta_rule_reference
from longstraw.runtime.prompt_state import ChunkRound

from helpers.compare import assert_close, assert_grads_close
from helpers.harness import compile_loss, compiled_loss_and_grads
from helpers.losses import grpo_loss_f64
from helpers.reference import eager_loss_and_grads, hybrid_detached_reference
from helpers.tiny_models import make_group


def _gated_delta_case(L: int, gen: torch.Generator):
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    inputs = [rand(1, L, 2, 8), rand(1, L, 2, 8), rand(1, L, 4, 8), -torch.rand(1, L, 4, generator=gen,
              dtype=torch.float64), torch.rand(1, L, 4, generator=gen, dtype=torch.float64)]
    fn = lambda state, *x: gated_delta_rule_reference(*x, state, True)  # noqa: E731
    return fn, (1, 1, 1, 1, 1, 1), rand(1, 4, 8, 8), inputs, rand(1, L, 4, 8), rand(1, 4, 8, 8)


def _conv_case(L: int, gen: torch.Generator):
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    fn = lambda tail, x, w, b: causal_conv1d_reference(x, w, b, "silu", tail)  # noqa: E731
    return fn, (2, 2, None, None), rand(1, 6, 3), [rand(1, 6, L), rand(6, 4), rand(6)], rand(1, 6, L), rand(1, 6, 3)


@pytest.mark.parametrize("span", [1, 7, 64, 1024])
@pytest.mark.parametrize("case", [_gated_delta_case, _conv_case], ids=["gated_delta", "causal_conv"])
def test_spanwise_gradients_equal_one_recomputation(case, span, monkeypatch):
    fn, dims, state, inputs, grad_out, grad_carry = case(150, torch.Generator().manual_seed(span))
    wanted = [True] * (1 + len(inputs))
    want = carry.recompute_grads(fn, [state, *inputs], [grad_out, grad_carry], wanted)
    monkeypatch.setattr(carry, "RECOMPUTE_SPAN", span)
    got = carry._spanwise_grads(fn, dims, state, inputs, grad_out, grad_carry, wanted)
    for g, w in zip(got, want):
        assert_close(g, w, 1e-12)
    # without the outgoing carry's gradient, and without the incoming carry's
    want = carry.recompute_grads(fn, [state, *inputs], [grad_out, None], [False, *wanted[1:]])
    got = carry._spanwise_grads(fn, dims, state, inputs, grad_out, None, [False, *wanted[1:]])
    assert got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert_close(g, w, 1e-12)


@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_hybrid_parity_with_short_spans(mode, monkeypatch):
    """Spans shorter than every step (prompt chunks of 8, branches of 9)."""
    monkeypatch.setattr(carry, "RECOMPUTE_SPAN", 3)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(qwen3_5.tiny_config()).double()
    group = make_group(3, 30, 9, pad=True)
    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=8, verify_state=True)
    with qwen3_5.bound():
        if mode == "exact":
            want_loss, want = eager_loss_and_grads(grpo_loss_f64, model, *group)
        else:
            want_loss, want = hybrid_detached_reference(model, *group)
        got_loss, got = compiled_loss_and_grads(compile_loss(grpo_loss_f64, backend), model, *group)
    assert_close(got_loss, want_loss, 1e-6)
    assert_grads_close(got, want, 1e-6)


class _OneStep:
    """What `CarryStep.forward` reads of a StepContext outside a prompt round."""

    prompt_round = None
    rows = 1

    def __init__(self, carry: torch.Tensor) -> None:
        self.carry, self.kept = carry, None

    def carry_in(self, slot: int) -> torch.Tensor:
        return self.carry

    def carry_out(self, slot: int, value: torch.Tensor) -> None:
        self.kept = value


def test_the_carry_a_step_returns_holds_no_chunk_sized_storage():
    """The conv's carry is a slice of `cat([tail, x])`: returned as a view it
    kept that chunk-sized tensor alive as long as the step's outputs, which
    under layer-wise recomputation is the whole reverse chunk (20 KB per
    position per Gated DeltaNet layer at Qwen3.5-27B shapes)."""
    fn, dims, tail, inputs, _, _ = _conv_case(4096, torch.Generator().manual_seed(0))
    step = _OneStep(tail)
    out, new_carry = carry.CarryStep.apply(step, 0, carry.CarryKernel(fn, dims), *inputs)
    assert new_carry.shape == tail.shape
    assert new_carry.untyped_storage().nbytes() == new_carry.numel() * new_carry.element_size()
    assert_close(new_carry, inputs[0][..., -3:], 0.0)


class _RoundStep:
    """What `CarryStep.forward` reads of a StepContext in a prompt round:
    rank 0's chunk of two, the group simulated (`SimulatedRanks`: the gathers
    leave their outputs as allocated, which is all this test reads)."""

    grad_enabled = True

    def __init__(self, carry: torch.Tensor, length: int) -> None:
        self.prompt_round = self.round = ChunkRound(((0, length), (length, length)), (0, 1), 0)
        shard = types.SimpleNamespace(ranks=SimulatedRanks(0, 2))
        self.state = types.SimpleNamespace(shard=shard, carry_at=lambda slot, position: carry)


def test_a_round_keeps_no_chunk_sized_storage_for_its_backward():
    """In a round (context parallelism) every rank runs the operator over
    the round's chunks and keeps the carry at each chunk's start for the
    backward, on the autograd context through the chunk's backward: the
    conv's are slices of each chunk's `cat([tail, x])`, and as views they
    kept W - 1 chunk-sized tensors per convolution layer (8 GB at 64 layers
    of Qwen3.5-27B, chunk 8192, two ranks; found by the planner simulating
    one rank's rounds). None of them is a tensor autograd gave a grad_fn
    (the Function's output): that would close a reference cycle through
    the context (`test_context_parallel`'s
    `test_a_step_leaves_nothing_in_reference_cycles`)."""
    fn, dims, tail, inputs, _, _ = _conv_case(4096, torch.Generator().manual_seed(0))
    inputs = [x.requires_grad_() for x in inputs]
    with torch.enable_grad():
        out, new_carry = carry.CarryStep.apply(_RoundStep(tail, 4096), 0, carry.CarryKernel(fn, dims), *inputs)
    kept = out.grad_fn.round_carries
    assert len(kept) == 2  # the round's start, then the first chunk's end
    assert kept[0].untyped_storage().data_ptr() == tail.untyped_storage().data_ptr()
    assert all(value.grad_fn is None and value is not new_carry for value in kept)
    for value in [*kept, new_carry]:
        assert value.shape == tail.shape
        assert value.untyped_storage().nbytes() == value.numel() * value.element_size()


def _on_cuda(case, seed: int):
    fn, dims, state, inputs, grad_out, grad_carry = case(150, torch.Generator().manual_seed(seed))
    cuda = lambda x: x.cuda()  # noqa: E731
    return fn, dims, cuda(state), [cuda(x) for x in inputs], cuda(grad_out), cuda(grad_carry)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [_gated_delta_case, _conv_case], ids=["gated_delta", "causal_conv"])
def test_span_graphs_give_the_eager_gradients(case, monkeypatch):
    """Spans of 64, 64 and 22 positions, with and without the carries'
    gradients: captured on the first call, replayed on new values after."""
    monkeypatch.setattr(carry, "RECOMPUTE_SPAN", 64)
    graphs = carry.SpanGraphs()
    replayed = lambda *a: graphs.grads("case", *a)  # noqa: E731
    for seed in range(3):
        fn, dims, state, inputs, grad_out, grad_carry = _on_cuda(case, seed)
        for flows, g_carry in [(True, grad_carry), (False, None)]:
            wanted = [flows] + [True] * len(inputs)
            want = carry._spanwise_grads(fn, dims, state, inputs, grad_out, g_carry, wanted)
            got = carry._spanwise_grads(fn, dims, state, inputs, grad_out, g_carry, wanted, replayed)
            for g, w in zip(got, want):
                assert (g is None) == (w is None)
                if w is not None:
                    assert_close(g, w, 1e-12)
        if seed == 0:
            signatures = set(graphs.captured)
    assert signatures == set(graphs.captured) and len(signatures) >= 3


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_hybrid_on_cuda_with_and_without_graphs(mode, monkeypatch):
    """End to end: the tiny hybrid in float64 on CUDA, spans shorter than
    the steps; the same gradients with CUDA graphs as without, and eager's."""
    monkeypatch.setattr(carry, "RECOMPUTE_SPAN", 3)
    torch.manual_seed(0)
    captures: list[int] = []
    original = carry.SpanGraphs._capture
    monkeypatch.setattr(carry.SpanGraphs, "_capture", lambda self, *a: (captures.append(1), original(self, *a))[1])
    model = transformers.Qwen3_5ForCausalLM(qwen3_5.tiny_config()).double().cuda()
    group = [x.cuda() for x in make_group(3, 30, 9, pad=True)]
    results = []
    with qwen3_5.bound():
        for graphs in (True, False):
            torch._dynamo.reset()
            backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=8, cuda_graphs=graphs)
            results.append(compiled_loss_and_grads(compile_loss(grpo_loss_f64, backend), model, *group))
            if graphs:
                assert captures, "no span was replayed from a CUDA graph"
                captures.clear()
        assert not captures
        if mode == "exact":
            want_loss, want = eager_loss_and_grads(grpo_loss_f64, model, *group)
        else:
            want_loss, want = hybrid_detached_reference(model, *group)
    (loss, grads), (loss_eager_steps, grads_eager_steps) = results
    assert_close(loss, loss_eager_steps, 1e-12)
    assert_grads_close(grads, grads_eager_steps, 1e-12)
    assert_close(loss, want_loss, 1e-6)
    assert_grads_close(grads, want, 1e-6)


@pytest.mark.gpu
def test_a_span_that_cannot_be_captured_names_the_option():
    """A carried operator whose kernel synchronises with the host cannot be
    captured: the error says so and how to run it eagerly, and the device's
    random generator still draws afterwards (a failed capture left it in its
    capture state, and every later `torch.randn` on the device raised)."""
    state, x = torch.randn(1, 4, device="cuda"), torch.randn(1, 8, 4, device="cuda")
    fn = lambda carry, x: (x * float(x.sum()), carry + x[:, -1])  # noqa: E731 - float(): a host synchronisation
    with pytest.raises(longstraw.LongStrawError, match="cuda_graphs"):
        carry.SpanGraphs().grads("syncs", fn, [state, x], [torch.ones_like(x), None], [False, True])
    torch.manual_seed(0)
    first = torch.randn(3, device="cuda")
    torch.manual_seed(0)
    assert torch.equal(torch.randn(3, device="cuda"), first)
