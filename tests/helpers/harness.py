"""Running a loss through the compiled backend the way a user would."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

import longstraw
from longstraw.runtime import prompt_state as state_module

from helpers.compare import assert_close, assert_grads_close
from helpers.losses import grpo_loss_f64
from helpers.reference import eager_loss_and_grads, with_fresh_grads

Grads = dict[str, torch.Tensor | None]


def compile_loss(loss_fn, backend, **compile_kwargs):
    """`backend` is a `longstraw.Backend` object, or a dict of options for
    the entry-point name "longstraw"."""
    if isinstance(backend, dict):
        return torch.compile(loss_fn, backend="longstraw", options=backend, **compile_kwargs)
    return torch.compile(loss_fn, backend=backend, **compile_kwargs)


def compiled_loss_and_grads(compiled, model, *args):
    """(loss, name -> grad) of one compiled call + backward from empty .grad;
    the model's .grad is left as it was found."""

    def run():
        loss = compiled(model, *args)
        loss.backward()
        return loss

    return with_fresh_grads(model, run)


def assert_parity(loss_fn, backend: longstraw.Backend, detached: Callable[..., tuple[torch.Tensor, Grads]], model,
                  *args, tol: float, what: str = "loss") -> Grads:
    """The compiled loss and gradients against the reference of the
    backend's mode: plain eager (exact) or `detached(model, *args)`, the
    detached contract for `loss_fn`. Returns the compiled gradients for a
    test's own further checks."""
    if backend.options.prompt_grad == "exact":
        want_loss, want = eager_loss_and_grads(loss_fn, model, *args)
    else:
        want_loss, want = detached(model, *args)
    got_loss, got = compiled_loss_and_grads(compile_loss(loss_fn, backend), model, *args)
    assert_close(got_loss, want_loss, tol, what)
    assert_grads_close(got, want, tol)
    return got


def assert_branch_order_does_not_matter(model, mode: str, group, prefix_chunk_size: int) -> None:
    """Permuting the responses permutes nothing in the loss or the gradients:
    no branch sees state left by another."""
    prompt, responses, advantages, mask = group
    perm = torch.tensor([2, 0, 3, 1])
    compiled = compile_loss(grpo_loss_f64, longstraw.Backend(prompt_grad=mode, prefix_chunk_size=prefix_chunk_size))
    loss_a, grads_a = compiled_loss_and_grads(compiled, model, prompt, responses, advantages, mask)
    loss_b, grads_b = compiled_loss_and_grads(compiled, model, prompt, responses[perm], advantages[perm], mask[perm])
    assert_close(loss_b, loss_a, 1e-13, "loss")
    assert_grads_close(grads_b, grads_a, 1e-12)


@dataclasses.dataclass
class LiveStates:
    """PromptStates made, and the most holding memory at once."""

    made: int = 0
    peak: int = 0
    slots: list[int] = dataclasses.field(default_factory=list)  # buffers and carries of each state made


def count_live_states(monkeypatch) -> LiveStates:
    """Count `PromptState`s between construction and `release` for the rest of the test."""
    count, live = LiveStates(), set()
    init, release = state_module.PromptState.__init__, state_module.PromptState.release

    def counting_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        live.add(id(self))
        count.made += 1
        count.peak = max(count.peak, len(live))
        count.slots.append(len(self.buffers) + len(self.carries))

    def counting_release(self):
        live.discard(id(self))
        release(self)

    monkeypatch.setattr(state_module.PromptState, "__init__", counting_init)
    monkeypatch.setattr(state_module.PromptState, "release", counting_release)
    return count
