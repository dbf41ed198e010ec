"""Running a loss through the compiled backend the way a user would."""

from __future__ import annotations

import torch

from helpers.reference import with_fresh_grads


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
