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
