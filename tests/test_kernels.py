"""The kernel policy (`longstraw.kernels.KernelPolicy`, `Options.kernels`):
validated with the options, and the steps of a compiled loss choose their
attention and Gated DeltaNet kernels through it, not through module globals."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

import longstraw
from longstraw.kernels import KernelPolicy, attention, fla_causal_conv, fla_gated_delta

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


@pytest.mark.parametrize("kernels, active", [({}, (False, False, False)),
                                              ({"attention": "flash", "gated_delta": "torch", "causal_conv": "torch"},
                                               (True, True, True))])
def test_the_compiled_loss_runs_its_policy(kernels, active, caplog):
    """The policy is active in every step of the compiled call (forward,
    replays, reverse pass) and only there; steps log the attention kernel
    they choose (on the CPU the explicit softmax, whatever is preferred)."""
    seen: set[tuple[bool, bool, bool]] = set()

    def record(where: str):
        seen.add((bool(attention._CHOOSERS), bool(fla_gated_delta._DISABLED), bool(fla_causal_conv._DISABLED)))
        return contextlib.nullcontext()

    backend = longstraw.Backend(kernels=kernels, prefix_chunk_size=8)
    with longstraw.around_steps(record), caplog.at_level(logging.DEBUG, logger="longstraw.attention"):
        compiled_loss_and_grads(compile_loss(grpo_loss_f64, backend), make_model("qwen3"), *make_group(2, 20, 4))
    assert seen == {active}
    assert {r.getMessage().split()[0] for r in caplog.records if r.name == "longstraw.attention"} == {"MathKernel"}
    assert not fla_gated_delta._DISABLED and not fla_causal_conv._DISABLED and not attention._CHOOSERS


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
