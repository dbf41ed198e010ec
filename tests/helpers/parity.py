"""Parity checks shared by the suites: a family, a dense kind, both under
NaN-filled uninitialised memory where asked."""

from __future__ import annotations

import contextlib
import functools

import torch

import longstraw

from helpers.compare import assert_close, assert_grads_close
from helpers.families import FAMILIES
from helpers.harness import assert_parity, compile_loss, compiled_loss_and_grads
from helpers.losses import TAILS, grpo_loss_f64
from helpers.reference import detached_at_attention, detached_reference, eager_loss_and_grads
from helpers.tiny_models import make_group, make_model, parity_tol


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool):
    """`torch.use_deterministic_algorithms(enabled)` with uninitialised
    memory filled (NaN for floats), restored afterwards."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(enabled)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = fill


def check_family(name: str, mode: str, shape: tuple, deterministic: bool, **options) -> None:
    family = FAMILIES[name]
    G, P, R, chunk, pad = shape
    model = family.build()
    group = make_group(G, P, R, pad=pad)
    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=chunk, verify_state=True, **options)
    detached = functools.partial(family.detached or detached_at_attention, grpo_loss_f64)
    with family.bind(), deterministic_algorithms(deterministic):
        assert_parity(grpo_loss_f64, backend, detached, model, *group, tol=family.tol, what=f"{name} loss")


def expected(mode, loss_fn, model, *args):
    if mode == "exact":
        return eager_loss_and_grads(loss_fn, model, *args)
    return detached_reference(model, *args, tail=TAILS[loss_fn])


def check_parity(kind, mode, G, P, R, chunk, pad=False, loss_fn=grpo_loss_f64, model=None, seed=0):
    model = make_model(kind) if model is None else model
    args = make_group(G, P, R, pad=pad, seed=seed)
    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=chunk)
    got_loss, got = compiled_loss_and_grads(compile_loss(loss_fn, backend), model, *args)
    want_loss, want = expected(mode, loss_fn, model, *args)
    tol = parity_tol(kind)
    assert_close(got_loss, want_loss, tol, "loss")
    assert_grads_close(got, want, tol)
    plan = backend.plans[-1]
    assert plan.num_branches == G
    assert plan.prefix_len == P - 1
    return backend
