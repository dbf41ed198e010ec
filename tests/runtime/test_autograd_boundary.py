"""The autograd boundary of a compiled loss (`runtime/autograd_boundary.py`):
a second backward through one loss and a gradient of the gradient are
refused with `.grad` untouched, and `torch.autograd.grad` matches eager
without writing `.grad`."""

from __future__ import annotations

import pytest
import torch

import longstraw

from conftest import raises_longstraw
from helpers.compare import assert_grads_close, grads_equal
from helpers.harness import compile_loss
from helpers.losses import grpo_loss_f64, grpo_tail
from helpers.reference import detached_logits, eager_loss_and_grads, grads_of, seed_grads, trainable
from helpers.tiny_models import make_group, make_model


def test_second_backward_with_retained_graph_is_refused():
    """The first backward frees the prompt state, so a second one through
    the same loss raises (eager would add the gradients again); the first
    backward's gradients stay as they were."""
    model = make_model("plain")
    args = make_group(3, 13, 5)
    want = eager_loss_and_grads(grpo_loss_f64, model, *args)
    loss = compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=4))(model, *args)
    loss.backward(retain_graph=True)
    once = grads_of(model)
    assert_grads_close(once, want[1], 1e-9)
    with raises_longstraw(r"^backward through a LongStraw loss a second time \(retain_graph=True\).*Call the compiled loss again"):
        loss.backward()
    assert grads_equal(grads_of(model), once)


@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_autograd_grad_matches_eager_and_leaves_grad_alone(mode):
    model = make_model("plain")
    prompt, responses, advantages, mask = args = make_group(3, 13, 5)
    names, params = zip(*trainable(model).items())
    before = seed_grads(model)
    if mode == "exact":
        reference = grpo_loss_f64(model, *args)
    else:
        reference = grpo_tail(detached_logits(model, prompt, responses), responses, advantages, mask)
    want = torch.autograd.grad(reference, params)
    step = compile_loss(grpo_loss_f64, longstraw.Backend(prompt_grad=mode, prefix_chunk_size=4))
    got = torch.autograd.grad(step(model, *args), params)
    assert_grads_close(dict(zip(names, got)), dict(zip(names, want)), 1e-9)
    assert grads_equal(grads_of(model), before)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_is_refused_and_the_loss_stays_usable():
    """A gradient of the gradient is refused, through autograd.grad and
    through backward, before any .grad changes; the loss's plain backward
    still works afterwards (create_graph retains the graph)."""
    model = make_model("plain")
    args = make_group(3, 13, 5)
    params = list(trainable(model).values())
    step = compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=4))
    before = seed_grads(model)
    loss = step(model, *args)
    message = r"^backward with create_graph=True \(a gradient of the gradient\) is not supported"
    with raises_longstraw(message):
        torch.autograd.grad(loss, params, create_graph=True)
    with raises_longstraw(message):
        loss.backward(create_graph=True)
    assert grads_equal(grads_of(model), before)
    model.zero_grad(set_to_none=True)
    loss.backward()
    assert_grads_close(grads_of(model), eager_loss_and_grads(grpo_loss_f64, model, *args)[1], 1e-9)
