"""End-to-end checks of a fused kernel on the tiny Qwen3.5 hybrid in bf16 on
CUDA: the same compiled loss with the fused kernel and with the PyTorch
kernel, each against float64 eager gradients of the same weights."""

from __future__ import annotations

from typing import Callable

import torch
import transformers

import longstraw
from longstraw.models import qwen3_5

from helpers.harness import compile_loss, compiled_loss_and_grads
from helpers.losses import grpo_loss_f64
from helpers.reference import eager_loss_and_grads, hybrid_detached_reference
from helpers.tiny_models import make_group

PREFIX_CHUNK = 96  # the prompt is 300 positions: carries cross steps both ways


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def assert_fused_as_accurate(mode: str, setup: Callable[[bool], tuple[dict, Callable[[], bool]]]) -> None:
    """`setup(fused)` prepares one variant (the fused kernel or PyTorch's)
    and returns its backend options and whether the fused kernel ran; the
    fused variant's loss and every parameter's gradient are at most twice
    as far from float64 eager as the PyTorch kernel's (plus 1e-3)."""
    torch.manual_seed(0)
    cfg = qwen3_5.tiny_config(hidden_size=128, linear_key_head_dim=32, linear_value_head_dim=32, head_dim=32)
    model = transformers.Qwen3_5ForCausalLM(cfg).cuda().bfloat16()
    group = [x.cuda() for x in make_group(3, 300, 40, vocab=cfg.vocab_size, pad=True)]
    results = {}
    with qwen3_5.bound():
        for fused in (True, False):
            options, ran_fused = setup(fused)
            torch._dynamo.reset()
            backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=PREFIX_CHUNK, **options)
            results[fused] = compiled_loss_and_grads(compile_loss(grpo_loss_f64, backend), model, *group)
            assert ran_fused() == fused
        model = model.double()
        truth = (eager_loss_and_grads if mode == "exact" else hybrid_detached_reference)(
            *((grpo_loss_f64,) if mode == "exact" else ()), model, *group
        )
    (loss, grads), (loss_ref, grads_ref), (loss_true, grads_true) = results[True], results[False], truth
    assert relative_error(loss, loss_true) <= 2 * relative_error(loss_ref, loss_true) + 1e-3
    errors = {
        name: (relative_error(grads[name], want), relative_error(grads_ref[name], want))
        for name, want in grads_true.items() if want is not None and want.abs().max() > 0
    }
    worse = {name: e for name, e in errors.items() if e[0] > 2 * e[1] + 1e-3}
    assert not worse, f"(fused, PyTorch kernel) relative errors against float64 eager: {worse}"
