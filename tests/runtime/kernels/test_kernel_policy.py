"""The kernel policy (`longstraw.runtime.kernels.KernelPolicy`, `Options.kernels`):
validated with the options, and the steps of a compiled loss choose their
attention and Gated DeltaNet kernels through it, not through module globals."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

import longstraw
from longstraw.runtime.kernels import KernelPolicy, attention, fla_causal_conv, fla_gated_delta

from conftest import raises_longstraw
from helpers.harness import compile_loss, compiled_loss_and_grads
from helpers.losses import grpo_loss_f64
from helpers.tiny_models import make_group, make_model


def test_options_take_a_policy_or_a_dict():
    assert longstraw.Options(kernels={"attention": "cudnn"}).kernels == KernelPolicy(attention="cudnn")
    assert longstraw.Options().kernels == KernelPolicy("sdpa", "auto")
    with raises_longstraw(r"kernels\['attention'\] must be one of"):
        longstraw.Options(kernels={"attention": "flash3"})
    with raises_longstraw(r"unknown kernels option\(s\) \['softmax'\]"):
        longstraw.Options(kernels={"softmax": "math"})


def test_a_preferred_kernel_runs_only_where_it_applies():
    q = torch.randn(1, 2, 4, 8)
    with KernelPolicy(attention="flash").active():
        assert attention.kernel_for(q, None) is attention.MATH  # flash needs CUDA and 16-bit inputs
    with KernelPolicy(attention="math").active():
        assert attention.kernel_for(q, None) is attention.MATH
    assert attention.kernel_for(q, None) is attention.MATH


def test_fla_never_runs_on_fake_tensors(monkeypatch):
    """The planner simulates steps on fake CUDA tensors: a Triton launch on
    their made-up data pointers faults the device (an H200 run of the hybrid
    died of it in fla's l2norm), so fla applies only to real tensors. fla
    itself is stood in for: this runs without CUDA or fla installed."""
    for family in (fla_gated_delta, fla_causal_conv):
        monkeypatch.setattr(family, "fla_ops", lambda: object())
    with torch._subclasses.fake_tensor.FakeTensorMode():
        q = torch.empty(1, 8, 2, 16, device="cuda", dtype=torch.bfloat16)
        x, weight = torch.empty(1, 16, 8, device="cuda", dtype=torch.bfloat16), torch.empty(16, 4, device="cuda", dtype=torch.bfloat16)
    assert q.is_cuda and not fla_gated_delta.applies(q)
    assert not fla_causal_conv.applies(x, weight, None, "silu")
    real_q, real_x, real_weight = (torch.empty(t.shape, dtype=t.dtype) for t in (q, x, weight))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert fla_gated_delta.applies(real_q) and fla_causal_conv.applies(real_x, real_weight, None, "silu")
    with KernelPolicy(gated_delta="torch", causal_conv="torch").active():
        assert not fla_gated_delta.applies(real_q) and not fla_causal_conv.applies(real_x, real_weight, None, "silu")


@pytest.mark.parametrize("kernels, active", [({}, (False, False, False)),
                                              ({"attention": "flash", "gated_delta": "torch", "causal_conv": "torch"},
                                               (True, True, True))])
def test_the_compiled_loss_runs_its_policy(kernels, active, caplog):
    """The policy is active in every step of the compiled call (forward,
    replays, reverse pass) and only there; steps log the attention kernel
    they choose (on the CPU the explicit softmax, whatever is preferred)."""
    seen: set[tuple[bool, bool, bool]] = set()

    def record(where: str):
        seen.add((bool(attention._CHOOSERS), not fla_gated_delta.SWITCH.on, not fla_causal_conv.SWITCH.on))
        return contextlib.nullcontext()

    backend = longstraw.Backend(kernels=kernels, prefix_chunk_size=8)
    with longstraw.around_steps(record), caplog.at_level(logging.DEBUG, logger="longstraw.attention"):
        compiled_loss_and_grads(compile_loss(grpo_loss_f64, backend), make_model("qwen3"), *make_group(2, 20, 4))
    assert seen == {active}
    assert {r.getMessage().split()[0] for r in caplog.records if r.name == "longstraw.attention"} == {"MathKernel"}
    assert fla_gated_delta.SWITCH.on and fla_causal_conv.SWITCH.on and not attention._CHOOSERS


def test_cudnn_runs_only_at_shapes_an_earlier_step_ran():
    """A gate is frozen when taken: the shapes its own step meets are
    admitted only from the next step's gate on."""
    shapes = KernelPolicy().cudnn_shapes
    first = shapes.gate()
    assert not first.admits(("forward", (1, 2, 4, 8)))
    assert not first.admits(("forward", (1, 2, 4, 8)))  # still this step: the same kernel as its first call
    second = shapes.gate()
    assert second.admits(("forward", (1, 2, 4, 8))) and not second.admits(("backward", (1, 2, 4, 8)))
    assert shapes.gate().admits(("backward", (1, 2, 4, 8)))
    assert KernelPolicy(attention="cudnn").gate() is None and KernelPolicy(attention="flash").gate() is None
    assert KernelPolicy() == KernelPolicy() and hash(KernelPolicy()) == hash(KernelPolicy())  # history is not configuration


def test_with_flash_switched_off_every_call_runs_cudnn():
    """`sdpa_kernel` without flash: the gate does not send new layouts to flash."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.empty(1, 2, 4, 8)
    with attention.gated(attention.CudnnShapes().gate()):
        assert not attention._admits("forward", True, q, q, q)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]):
            assert attention._admits("forward", True, q, q, q)


def test_a_call_over_few_keys_runs_flash_even_at_a_seen_layout(monkeypatch):
    """Below `CUDNN_MIN_KEYS` keys a gated call runs flash, at a layout seen
    before too, and is not remembered; at or above it the gate decides."""
    q, keys = torch.empty(1, 2, 4, 8), torch.empty(1, 2, 6, 8)
    shapes = attention.CudnnShapes()
    monkeypatch.setattr(attention, "CUDNN_MIN_KEYS", 7)
    for _ in range(2):
        with attention.gated(shapes.gate()):
            assert not attention._admits("forward", True, q, keys, keys)
    assert shapes.seen == {} and shapes.calls == {"cudnn": 0, "flash": 2}
    monkeypatch.setattr(attention, "CUDNN_MIN_KEYS", 6)
    admitted = []
    for _ in range(2):
        with attention.gated(shapes.gate()):
            admitted.append(attention._admits("forward", True, q, keys, keys))
    assert admitted == [False, True] and len(shapes.seen) == 1


def test_the_shapes_kept_are_bounded(monkeypatch):
    """A long run of new lengths keeps the last `CUDNN_SHAPES_KEPT` layouts, the oldest forgotten first."""
    monkeypatch.setattr(attention, "CUDNN_SHAPES_KEPT", 3)
    shapes = attention.CudnnShapes()
    gate = shapes.gate()
    for n in range(5):
        gate.admits(("forward", n))
    assert list(shapes.seen) == [("forward", 2), ("forward", 3), ("forward", 4)]
    assert shapes.calls == {"cudnn": 0, "flash": 5}
    assert shapes.gate().admits(("forward", 4)) and not shapes.gate().admits(("forward", 0))


def test_a_step_and_its_backward_share_one_gate():
    """Forward, replays and reverse pass of one call run under the gate its
    forward took (a recaptured prompt runs the forward's kernels); the next
    call takes a new one from the same loss's history; a loss that names
    its kernel has none."""
    gates: list[list] = []

    def record(where: str):
        gates[-1].append(attention._GATES[-1] if attention._GATES else None)
        return contextlib.nullcontext()

    for kernels in ({}, {"attention": "cudnn"}):
        backend = longstraw.Backend(kernels=kernels, prefix_chunk_size=8)
        loss = compile_loss(grpo_loss_f64, backend)
        with longstraw.around_steps(record):
            for _ in range(2):
                gates.append([])
                compiled_loss_and_grads(loss, make_model("qwen3"), *make_group(2, 20, 4))
    (first, second), (named, _) = gates[:2], gates[2:]
    assert len(first) > 2 and len({id(g) for g in first}) == 1 and first[0] is not None
    assert len({id(g) for g in second}) == 1 and second[0] is not first[0] and second[0].shapes is first[0].shapes
    assert set(named) == {None} and not attention._GATES


@pytest.mark.gpu
def test_a_gated_cudnn_kernel_runs_flash_at_new_shapes(monkeypatch):
    """Under a gate that admits nothing, the cuDNN kernel's blocks run
    flash: the same attention and gradients (float64 reference), every
    forward and backward shape recorded for the next step's gate (small
    shapes: `CUDNN_MIN_KEYS` lowered to let cuDNN run them)."""
    monkeypatch.setattr(attention, "CUDNN_MIN_KEYS", 0)
    torch.manual_seed(0)
    q = torch.randn(1, 4, 96, 64, device="cuda", dtype=torch.bfloat16)
    keys, values = (torch.randn(1, 2, 160, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q_start, scale = 64, 64 ** -0.5
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.double(), keys.double()[..., : q_start + 96, :].repeat_interleave(2, 1),
        values.double()[..., : q_start + 96, :].repeat_interleave(2, 1), scale=scale,
        attn_mask=torch.ones(96, q_start + 96, dtype=torch.bool, device="cuda").tril(q_start))
    k, v = keys[..., : q_start + 96, :], values[..., : q_start + 96, :]
    shapes = attention.CudnnShapes()
    outputs = {}
    for name, gate in (("new", shapes.gate()), ("seen", None)):
        with attention.gated(gate) if gate is not None else contextlib.nullcontext():
            out, lse = attention.CUDNN.forward(q, k, v, None, scale, q_start)
            grads = [attention.CUDNN.backward(torch.ones_like(out), q, k.narrow(-2, s, n), v.narrow(-2, s, n), out, lse,
                                              None, scale, q_start, s) for s, n in attention.CUDNN.blocks(q, q_start)]
        outputs[name] = out, [g[0] for g in grads]
        assert (out.double() - reference).abs().max() < 2e-2
    assert {key[0] for key in shapes.seen} == {"forward", "backward"} and len(shapes.seen) == 4
    wider = torch.randn(1, 2, 192, 64, device="cuda", dtype=torch.bfloat16)[..., : q_start + 96, :]  # new strides
    with attention.gated(shapes.gate()):
        attention.CUDNN.forward(q, k, v, None, scale, q_start)
        assert len(shapes.seen) == 4
        attention.CUDNN.forward(q, wider, wider, None, scale, q_start)
        assert len(shapes.seen) == 6  # a new plan for cuDNN
    assert shapes.calls == {"cudnn": 2, "flash": 6}
    for a, b in zip(outputs["new"][1], outputs["seen"][1]):
        assert (a.double() - b.double()).abs().max() < 5e-2 * (1 + b.double().abs().max())


@pytest.mark.gpu
def test_policy_picks_the_kernels_on_cuda():
    q = torch.randn(1, 2, 4, 64, device="cuda", dtype=torch.bfloat16)
    with KernelPolicy(attention="cudnn").active():
        assert attention.kernel_for(q, None) is attention.CUDNN
    with KernelPolicy(attention="math").active():
        assert attention.kernel_for(q, None) is attention.MATH
    if fla_gated_delta.fla_ops() is not None:
        assert fla_gated_delta.applies(q)
    with KernelPolicy(gated_delta="torch").active():
        assert not fla_gated_delta.applies(q)
